"""Issue 47's report on hand-made rows of the fixed-budget protocol: the curve's checkpoints apart from the tables'
final weights, the accuracy-versus-training curves and their last-quarter gains, Wilson intervals from the pooled
count, paired verdicts, the paper's baseline row and variant, the unconditional mappings and the "fail
catastrophically" claim, NFE spent, TPF over cells and AUP over the same budgets."""

import pandas as pd
import pytest

from analysis.sudoku_tables import (
    aggregate,
    budget_check,
    build_sudoku_report,
    curve_gains,
    curve_points,
    final_rows,
    read_results,
)
from callbacks.results_csv import write_rows
from tests.analysis.test_sudoku_tables import row

BUDGET = 6000
CHECKPOINTS = [750 * k for k in range(1, 9)]  # an eighth of the budget each; the last is the final weights


def curve(method, variant, sampler, nfe, seed, values, **extra):
    """One run's rows at every checkpoint (``values`` per step, the last at the final step)."""
    return [
        row(method, variant, sampler, nfe, seed, v, eval_step=step, steps=BUDGET, budget_steps=BUDGET, **extra)
        for step, v in zip(CHECKPOINTS, values, strict=True)
    ]


MDM_41 = {0: [5, 20, 40, 60, 80, 86, 88, 89.0], 1: [3, 18, 44, 62, 78, 84, 89, 89.6]}  # final 89.0 / 89.6


@pytest.fixture
def curves(tmp_path):
    """Two seeds of the easy MDM at 41 (one call per generated position) and an FMLM+ scratch PR@4, every checkpoint;
    the final rows in the run's CSV, the earlier ones in its _eval.csv, as scripts/sudoku_curve.sh writes them."""
    folder = tmp_path / "results"
    for seed, values in MDM_41.items():
        rows = curve("MDM", "scratch", "ancestral", 41, seed, values)
        write_rows(folder / "easy" / f"mdm_seed{seed}.csv", rows[-1:])
        write_rows(folder / "easy" / f"mdm_seed{seed}_eval.csv", rows[:-1])
        pr = curve("FMLM+", "scratch", "pr", 4, seed, [1, 2, 4, 8, 16, 30, 40, 50.0 + seed])
        write_rows(folder / "easy" / f"pr_seed{seed}.csv", pr[-1:])
        write_rows(folder / "easy" / f"pr_seed{seed}_eval.csv", pr[:-1])
    return folder


def test_the_tables_use_the_final_weights_only(curves):
    """Every checkpoint is a row of its own (eval_step in the row's identity), and only the final weights' row (eval_step
    = steps; a row without eval_step: its run's steps) joins a cell."""
    rows = read_results(curves)
    assert len(rows[(rows["method"] == "MDM") & (rows["seed"] == 0)]) == len(CHECKPOINTS)
    assert final_rows(rows)["eval_step"].tolist() == [BUDGET] * 4
    line = aggregate(rows).set_index("sampler").loc["ancestral"]
    assert (line["accuracy_mean"], line["n"]) == (pytest.approx(89.3), 2)  # not the mean over the curve's points
    old = row("MDM", "scratch", "ancestral", 41, 2, 95.0, steps=1200)  # an older row: eval_step blank, final
    write_rows(curves / "old" / "mdm_seed2.csv", [old])
    line = aggregate(read_results(curves)).set_index("sampler").loc["ancestral"]
    assert (line["accuracy_mean"], line["n"]) == (pytest.approx((89.0 + 89.6 + 95.0) / 3), 3)


def test_curve_points_and_the_gain_over_the_last_quarter(curves):
    points = curve_points(read_results(curves))
    mdm = points[points["sampler"] == "ancestral"].set_index("step")
    assert mdm.index.tolist() == CHECKPOINTS and set(mdm["n"]) == {2}
    assert (mdm.loc[3000, "mean"], mdm.loc[3000, "min"], mdm.loc[3000, "max"]) == (61.0, 60.0, 62.0)
    gains = curve_gains(points).set_index("sampler")
    assert gains.loc["ancestral", "step at 3/4"] == 4500  # the last checkpoint at ≤ 3/4 of 6 000 steps
    assert gains.loc["ancestral", "gain"] == pytest.approx(89.3 - 85.0)
    assert gains.loc["pr", "gain"] == pytest.approx(50.5 - 30.0)
    assert budget_check(gains.reset_index()).endswith("ancestral +4.3 → NOT accepted: the models were still learning.")
    flat = gains.reset_index().assign(gain=lambda g: g["sampler"].map({"ancestral": 0.4, "pr": 27.5}))
    # only the easy MDM at one call per position decides
    assert budget_check(flat).endswith("ancestral +0.4 → accepted.")


def test_a_curve_is_not_plotted_from_lines_off_the_headline(curves):
    """Curves of the headline budgets only: the MDM at 41 and 4, PR at 4 (conditional); a sampler at another budget
    is no curve."""
    write_rows(curves / "x" / "mdm_seed0_eval.csv", curve("MDM", "scratch", "ancestral", 18, 0, [1] * 8))
    points = curve_points(read_results(curves))
    assert sorted(set(zip(points["sampler"], points["nfe_budget"], strict=True))) == [("ancestral", 41), ("pr", 4)]


def test_the_report_shows_the_curves_after_the_tables_and_before_aup(curves, tmp_path):
    report = build_sudoku_report(curves, tmp_path / "report")
    text = report.markdown.read_text()
    assert text.index("## Unconditional") < text.index("## Accuracy versus training") < text.index("## AUP")
    assert "![Accuracy versus training](curves.png)" in text and (tmp_path / "report" / "curves.png").is_file()
    assert "| easy | MDM | ancestral | 41 | 8 | 6000 | 89.3 | 4500 | 85.0 | +4.3 |" in text
    assert pd.read_csv(tmp_path / "report" / "curve_points.csv")["step"].max() == BUDGET
    assert 'src="data:image/png;base64,' in report.html.read_text()
