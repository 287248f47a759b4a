"""Issue 47's report on hand-made rows of the fixed-budget protocol: the curve's checkpoints apart from the tables'
final weights, the accuracy-versus-training curves and their last-quarter gains, Wilson intervals from the pooled
count, paired verdicts, the paper's baseline row and variant, the unconditional mappings and the "fail
catastrophically" claim, NFE spent, TPF over cells and AUP over the same budgets."""

import pandas as pd
import pytest

from analysis.aup import aup
from analysis.sudoku_tables import (
    Cell,
    adaptive_table,
    aggregate,
    aup_table,
    budget_candidates,
    budget_check,
    build_sudoku_report,
    chosen_budget,
    conditional_table,
    curve_gains,
    curve_points,
    fail_verdict,
    final_rows,
    fixed_step_wall,
    headline,
    read_results,
    samples_of,
    stated_text,
    tokens_per_call_table,
    training_table,
    unconditional_table,
    verdicts,
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
    """Every checkpoint is a row of its own (eval_step in the row's identity), and only the final weights' row
    (eval_step = steps; a row without eval_step: its run's steps) joins a cell."""
    rows = read_results(curves)
    assert len(rows[(rows["method"] == "MDM") & (rows["seed"] == 0)]) == len(CHECKPOINTS)
    assert final_rows(rows)["eval_step"].tolist() == [BUDGET] * 4
    line = aggregate(rows).set_index("sampler").loc["ancestral"]
    assert (line["accuracy_mean"], line["n"]) == (pytest.approx(89.3), 2)  # not the mean over the curve's points
    old = row("MDM", "scratch", "ancestral", 41, 2, 95.0, steps=1200)  # an older row: eval_step blank, final
    write_rows(curves / "old" / "mdm_seed2.csv", [old])
    line = aggregate(read_results(curves)).set_index("sampler").loc["ancestral"]
    assert (line["accuracy_mean"], line["n"]) == (pytest.approx((89.0 + 89.6 + 95.0) / 3), 3)


def test_a_csv_from_before_the_step_columns_is_one_final_row(tmp_path):
    """A results CSV without `eval_step` and `steps` (the schema's earliest): its rows are their runs' final ones."""
    old = pd.DataFrame([row("MDM", "scratch", "ancestral", 41, 0, 80.0)]).drop(columns=["eval_step", "steps"])
    (tmp_path / "r").mkdir()
    old.to_csv(tmp_path / "r" / "old.csv", index=False)
    rows = read_results(tmp_path / "r")
    assert len(final_rows(rows)) == 1 and aggregate(rows)["accuracy_mean"].tolist() == [80.0]


def test_curve_points_and_the_gain_over_the_last_quarter(curves):
    points = curve_points(read_results(curves))
    mdm = points[points["sampler"] == "ancestral"].set_index("step")
    assert mdm.index.tolist() == CHECKPOINTS and set(mdm["n"]) == {2}
    assert (mdm.loc[3000, "mean"], mdm.loc[3000, "min"], mdm.loc[3000, "max"]) == (61.0, 60.0, 62.0)
    gains = curve_gains(points).set_index("sampler")
    assert gains.loc["ancestral", "step at 3/4"] == 4500  # the last checkpoint at ≤ 3/4 of 6 000 steps
    assert gains.loc["ancestral", "gain"] == pytest.approx(89.3 - 85.0)
    assert gains.loc["pr", "gain"] == pytest.approx(50.5 - 30.0)
    # its sampling interval (Newcombe): the pooled counts 457 / 512 at the end, 435 / 512 at step 4 500 (256 puzzles
    # a seed, the rows' default before the `samples` column), each point's Wilson interval about its proportion
    assert (mdm.loc[4500, "pooled"], mdm.loc[6000, "pooled"]) == (100 * 435 / 512, 100 * 457 / 512)
    assert gains.loc["ancestral", ["gain_lo", "gain_hi"]].tolist() == pytest.approx([0.186, 8.423], abs=1e-3)
    assert budget_check(gains.reset_index()).endswith(
        "ancestral +4.3 [+0.2, +8.4] → NOT accepted: the models were still learning."
    )
    flat = gains.reset_index().assign(gain=lambda g: g["sampler"].map({"ancestral": 0.4, "pr": 27.5}))
    # only the easy MDM at one call per position decides, by the gain itself (issue 47's rule), its interval shown
    assert budget_check(flat).endswith("ancestral +0.4 [+0.2, +8.4] → accepted.")


def test_the_budget_is_the_first_step_whose_last_quarter_gains_less_than_a_point(curves):
    """Issue 47's choice from a curve run past the budget: the mean of seeds 0 and 1 at 41 (one call per position)
    gains 89.3 − 85.0 = 4.3 over 4 500 → 6 000, 89.3 − 70.0 = 19.3 over 3 000 → 4 500 … never < 1: no budget yet;
    a confidence curve flat from 2 250 on and an ancestral one whose last two points add 0.5 accept 6 000 only where
    both do."""
    points = curve_points(read_results(curves))
    table = budget_candidates(points).set_index(["budget", "sampler"])
    assert table.loc[(6000, "ancestral"), "step at 3/4"] == 4500
    assert table.loc[(6000, "ancestral"), "gain"] == pytest.approx(4.3)
    assert table.loc[(3000, "ancestral"), "step at 3/4"] == 2250  # the last checkpoint at ≤ 3/4 of 3 000
    assert "pr" not in table.index.get_level_values("sampler") and chosen_budget(table.reset_index()) is None
    flat = points[points["sampler"] == "ancestral"].assign(
        sampler="confidence", mean=lambda p: p["step"].map(lambda s: 99.0 if s >= 2250 else 50.0)
    )
    late = points.assign(mean=lambda p: p["mean"].where(p["step"] < 6000, 85.5))  # 85.0 at 4 500 → 85.5 at 6 000
    both = budget_candidates(pd.concat([late, flat]))
    # confidence accepts 3 000 on, ancestral first at 6 000, the last step: named provisionally, not confirmed
    assert chosen_budget(both, confirmed=False) == 6000 and chosen_budget(both) is None
    jump = flat.assign(mean=lambda p: p["mean"].where(p["step"] < 6000, 100.5))  # confidence +1.5 at the end
    assert chosen_budget(budget_candidates(pd.concat([late, jump])), confirmed=False) is None  # every curve


def test_a_budget_is_confirmed_only_by_later_steps_that_accept_it_too():
    """A gain within the points' error: accepted at 12 000, rejected at 13 500, accepted at 15 000 and 16 500 — the
    budget is 15 000 (confirmed by 16 500), not the lone 12 000."""
    table = pd.DataFrame(
        {"sampler": "ancestral", "budget": [9000, 10500, 12000, 13500, 15000, 16500],
         "accepted": [False, False, True, False, True, True]}
    )  # fmt: skip
    assert chosen_budget(table) == 15000 and chosen_budget(table, confirmed=False) == 15000
    assert chosen_budget(table[table["budget"] <= 15000]) is None
    assert chosen_budget(table[table["budget"] <= 15000], confirmed=False) == 15000
    assert chosen_budget(table[table["budget"] <= 13500], confirmed=False) is None


def test_seeds_that_ended_at_other_steps_make_no_gain(tmp_path):
    """Rows of an earlier protocol: seed 0 stopped at 3 650 steps, seed 1 at 1 000; their final points are no one
    curve, and no gain is read across them."""
    rows = [
        row("FMLM+", "scratch", "pr", 4, 0, 89.5, eval_step=3650, steps=3650),
        row("FMLM+", "scratch", "pr", 4, 1, 40.0, eval_step=1000, steps=1000),
    ]
    write_rows(tmp_path / "r" / "rows.csv", rows)
    gains = curve_gains(curve_points(read_results(tmp_path / "r")))
    assert gains["points"].tolist() == [2] and gains["gain"].isna().all()


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
    assert "| easy | MDM | ancestral | 41 | 8 | 6000 | 89.3 | 4500 | 85.0 | +4.3 [+0.2, +8.4] |" in text
    # the verdicts say beside them whether the budget was accepted (here: still learning), not only under the curves
    verdicts_text = text[text.index("## Verdicts") : text.index("## Conditional")]
    assert "Every verdict is at the models' training budget: Budget check (" in verdicts_text
    assert "NOT accepted: the models were still learning." in verdicts_text
    assert pd.read_csv(tmp_path / "report" / "curve_points.csv")["step"].max() == BUDGET
    assert 'src="data:image/png;base64,' in report.html.read_text()


# ---------------------------------------------------------------- statistics: the count behind a cell
def test_the_sample_count_is_read_else_a_labelled_default(tmp_path):
    """`samples` where the row has it; otherwise 2 000 for rows of the fixed-budget protocol and the CPU scale's
    256 puzzles / 512 grids for earlier ones, said in the report's header."""
    rows = [
        row("MDM", "scratch", "ancestral", 41, 0, 50.0, samples=100, date="2026-12-07T10:00:00Z"),
        row("MDM", "scratch", "ancestral", 41, 1, 50.0, date="2026-12-07T10:00:00Z"),  # new, no column: 2 000
        row("MDM", "scratch", "ancestral", 41, 2, 50.0, date="2026-12-01T10:00:00Z"),  # earlier: 256
        row("MDM", "scratch", "confidence", 36, 0, 50.0, difficulty="uncond", distinct_valid=9, train_copy_pct=0),
    ]
    write_rows(tmp_path / "r" / "rows.csv", rows)
    counts, recorded = samples_of(pd.DataFrame(rows))
    assert counts.tolist() == [100, 2000, 256, 512] and recorded.tolist() == [True, False, False, False]
    line = aggregate(read_results(tmp_path / "r")).set_index("sampler").loc["ancestral"]
    assert (line["accuracy_hits"], line["accuracy_total"], line["samples_assumed"]) == (1178, 2356, 2)
    header = build_sudoku_report(tmp_path / "r", tmp_path / "out").markdown.read_text().split("\n")[2]
    assert "Rows without a recorded `samples` count (CSVs written before the column): 1 rows as 256, " in header
    assert "1 rows as 512, 1 rows as 2000 (the fixed-budget protocol's 2000 val puzzles / grids" in header


def test_tpf_is_cells_filled_over_the_mean_nfe_a_ratio_of_sums():
    """Two seeds of an adaptive line on easy 6×6 (18 empty cells): 3 NFE on 1 000 puzzles and 6 NFE on 3 000: TPF =
    18 · 4 000 / (3 · 1 000 + 6 · 3 000), not the mean of 18/3 and 18/6, nor 41 generated positions a row."""
    rows = [
        dict(row("MDM", "scratch", "eb", 18, 0, 70.0, samples=1000, tpf=13.7), nfe=3.0),
        dict(row("MDM", "scratch", "eb", 18, 1, 80.0, samples=3000, tpf=6.8), nfe=6.0),
    ]
    line = aggregate(pd.DataFrame(rows)).iloc[0]
    assert line["tpf_mean"] == pytest.approx(18 * 4000 / 21000)  # 3.43
    assert (line["nfe_mean"], line["nfe_seed_max"]) == (4.5, 6.0)


# ---------------------------------------------------------------- the unconditional claims
def test_the_fail_catastrophically_claim_is_encoded_from_the_papers_rows():
    """reference.yaml's mdm_a_priori_fail: its first model (PR) stands above `fails_below` at each NFE it names, the
    others (MDLM, both samplers, and FMLM+ a-priori) under it at theirs: the paper's own rows."""
    from analysis.tables import reference_numbers

    ref = reference_numbers()["sudoku_uncond"]
    claim = ref["claims"]["mdm_a_priori_fail"]
    below = claim["fails_below"]
    rows = {(r["model"], r["sampler"]): r["values"] for r in ref["rows"]}
    (pr_name, pr_nfe), *failing = claim["compared"].items()
    assert pr_name.startswith("FMLM+ PR") and all(rows[("FMLM+", "pr")][n] > below for n in pr_nfe)
    samplers = {
        "MDLM": [("MDLM", "ancestral"), ("MDLM", "confidence")],
        "FMLM+ a-priori (δ₀,₀)": [("FMLM+", "a_priori")],
    }
    for name, nfes in failing:
        assert all(rows[line][n] < below for line in samplers[name] for n in nfes)
    assert stated_text("mdm_a_priori_fail").startswith(
        "sudoku_uncond: MDLM @1/3/9, FMLM+ a-priori (δ₀,₀) @1/3/9 < 5 % where FMLM+ PR (δ₀,₁) @3/9 is not"
    )


def test_fail_verdict_reads_both_wilson_intervals_against_the_threshold():
    fails, pr = Cell(0.4, 0, 1, hits=8, total=2000), Cell(40.0, 0, 1, hits=800, total=2000)
    assert fail_verdict(fails, pr, 5.0).startswith("reproduces (Wilson 95 %: 0.2–0.8 vs PR")
    assert fail_verdict(Cell(12, 0, 1, hits=240, total=2000), pr, 5.0).startswith(
        "does not reproduce at this scale (it does not fail"
    )
    assert fail_verdict(fails, Cell(1.0, 0, 1, hits=20, total=2000), 5.0).startswith(
        "does not reproduce at this scale (PR fails too"
    )
    assert fail_verdict(Cell(4.5, 0, 1, hits=9, total=200), pr, 5.0).startswith("inconclusive")  # 2.4–8.3 straddles
    assert fail_verdict(None, pr, 5.0) == "not measured"
    # the failing line retrained to the budget beside a PR not yet retrained: not judged across budgets
    old_pr = Cell(40.0, 0, 1, hits=800, total=2000, steps_by_seed=((0, 6000),))
    new_fail = Cell(0.4, 0, 1, hits=8, total=2000, steps_by_seed=((0, 20000),))
    assert fail_verdict(new_fail, old_pr, 5.0) == "not compared (unequal training: 20000 against 6000 steps)"


def _uncond(tmp_path):
    """Unconditional rows of 3 seeds × 2 000 grids: MDM (both samplers) and FMLM+ scratch (PR, a-priori) at the
    absolute budgets and at 4 (the paper's 9 by tokens per call)."""
    valid = {"ancestral": 0.5, "confidence": 1.0, "a_priori": 2.0, "pr": 60.0}
    rows = [
        row("FMLM+" if s in ("pr", "a_priori") else "MDM", "scratch", s, nfe, seed, v + seed * 0.1 + nfe / 10,
            difficulty="uncond", distinct_valid=9, train_copy_pct=0, samples=2000)
        for seed in (0, 1, 2) for nfe in (1, 2, 3, 4, 9, 27, 36) for s, v in valid.items()
    ]  # fmt: skip
    write_rows(tmp_path / "u" / "rows.csv", rows)
    return aggregate(read_results(tmp_path / "u"))


def test_unconditional_claims_at_every_stated_nfe_under_both_mappings(tmp_path):
    table = verdicts(_uncond(tmp_path))
    fail = table[table["claim"].str.startswith("MDMs and FMLM+ with a-priori confidence fail catastrophically")]
    paper = fail[fail["scope"] == "paper"]
    assert sorted(set(paper["claim"].str.split("(").str[-1])) == [
        "paper NFE 3 → NFE 2, by tokens per call)",
        "paper NFE 3 → NFE 3, absolute)",
        "paper NFE 9 → NFE 4, by tokens per call)",
        "paper NFE 9 → NFE 9, absolute)",
    ]
    assert len(paper) == 12  # 4 budgets × (MDM ancestral, MDM confidence, FMLM+ a-priori) against PR
    assert set(paper["verdict"].str[:10]) == {"reproduces"}
    assert paper["compared"].iloc[0].startswith("MDM ancestral@3 0.9 ± 0.1 [")
    prior = table[table["claim"].str.startswith("PR beats the a-priori") & (table["scope"] == "paper")]
    assert len(prior) == 6  # paper NFE 3 / 9 / 27, each absolute (3, 9, 27) and by tokens per call (2, 4, 12)
    assert set(prior["verdict"].str[:10]) == {"reproduces", "not measur"}  # NFE 12 was not measured


def test_tokens_per_call_never_more_parallel_than_the_paper():
    from analysis.sudoku_tables import tokens_per_call_nfe

    assert [tokens_per_call_nfe(p) for p in (1, 3, 9, 27, 81)] == [1, 2, 4, 12, 36]  # 36/81, 1.33, 4, 12, 36 up
    assert tokens_per_call_nfe(9, "9x9") == 9  # the paper's own board: its own budgets


def test_the_curves_budgets_follow_the_board():
    """PR's unconditional curve: the paper's 9 and its 9 cells a call on this board (4 on 6×6; on 9×9 the same 9,
    once); the MDM at one call per cell and 9; conditional, one call per generated position and 4."""
    from analysis.sudoku_tables import curve_nfe

    assert curve_nfe("6x6", "uncond") == {"MDM": (36, 9), "FMLM+": (9, 4)}
    assert curve_nfe("9x9", "uncond") == {"MDM": (81, 9), "FMLM+": (9,)}
    assert curve_nfe("9x9", "hard") == {"MDM": (89, 4), "FMLM+": (4,)}


def test_unconditional_tables_show_both_mappings(tmp_path):
    agg = _uncond(tmp_path)
    absolute = unconditional_table(agg).set_index(["source", "sampler"])
    assert list(absolute.columns[-5:]) == ["NFE 1", "NFE 3", "NFE 9", "NFE 27", "NFE 36"]
    assert absolute.loc[("paper, 9×9", "pr"), "NFE 9"] == "87.1"
    assert absolute.loc[("measured, 6x6", "pr"), "NFE 9"].startswith("61.0 ± 0.1 [")
    per_call = tokens_per_call_table(agg).set_index(["source", "sampler"])
    nine = "paper NFE 9 (9 a call) ↔ NFE 4 (9 a call)"
    assert nine in per_call.columns and "paper NFE 27 (3 a call) ↔ NFE 12 (3 a call)" in per_call.columns
    assert per_call.loc[("paper, 9×9", "pr"), nine] == "87.1"
    assert per_call.loc[("measured, 6x6", "pr"), nine].startswith("60.5 ± 0.1 [")  # measured at NFE 4, not 9
    assert per_call.loc[("measured, 6x6", "pr"), "paper NFE 27 (3 a call) ↔ NFE 12 (3 a call)"] == ""


# ---------------------------------------------------------------- the report: NFE spent, AUP, training, order
def _conditional(tmp_path):
    """Easy rows, 3 seeds: the MDM (ancestral, confidence at 4 / 18 / 41; EB capped at 4 and 18, spending less),
    FMLM+ scratch PR and a-priori at 4 and 18; training facts per seed."""
    rows = []
    for seed in (0, 1, 2):
        facts = dict(steps=6000, budget_steps=6000, wall_s=600.0 * (seed + 1), final_val_loss=0.01 * (seed + 1))
        facts |= dict(eval_step=6000, samples=2000)
        for nfe, acc in ((4, 20.0), (18, 85.0), (41, 90.0)):
            rows.append(row("MDM", "scratch", "ancestral", nfe, seed, acc - 10 + seed, **facts))
            rows.append(row("MDM", "scratch", "confidence", nfe, seed, acc + seed, **facts))
        for cap, spent, acc in ((4, 3.6 + 0.1 * seed, 70.0), (18, 5.0 + seed, 88.0)):
            rows.append(dict(row("MDM", "scratch", "eb", cap, seed, acc + seed, **facts), nfe=spent))
        for nfe, pr, prior in ((4, 60.0, 40.0), (18, 80.0, 95.0)):
            rows.append(row("FMLM+", "scratch", "pr", nfe, seed, pr + seed, **facts))
            rows.append(row("FMLM+", "scratch", "a_priori", nfe, seed, prior + seed, **facts))
    write_rows(tmp_path / "c" / "rows.csv", rows)
    return tmp_path / "c"


def test_adaptive_decoders_have_rows_of_their_own_with_the_nfe_spent(tmp_path):
    agg = aggregate(read_results(_conditional(tmp_path)))
    cond = conditional_table(agg)
    assert "eb" not in set(cond["sampler"])  # not under a fixed budget's column header
    eb = adaptive_table(agg).set_index("cap")
    assert eb.loc[4, "NFE spent (mean; seed max)"] == "3.70; 3.80" and eb.loc[18, "NFE spent (mean; seed max)"] == (
        "6.00; 7.00"
    )
    assert eb.loc[4, "TPF"] == f"{18 / 3.7:.2f}" and eb.loc[4, "accuracy / % valid"].startswith("71.0 ± 1.0 [")
    assert eb.loc[4, "wall ms / sample (per NFE)"] == ""  # no row recorded its sampling time


def test_adaptive_rows_show_their_wall_time_beside_the_fixed_step_samplers_per_nfe(tmp_path):
    """Issue 50's goal: what a saved call buys in time. EB at cap 4 spends 3.6 / 3.7 / 3.8 NFE in 36 / 37 / 38 ms a
    sample (10 ms a call); the MDM's confidence spends 2 ms a call at every budget."""
    rows = read_results(_conditional(tmp_path))
    eb = rows["sampler"] == "eb"
    rows.loc[eb, "sec_per_sample"] = rows.loc[eb, "nfe"].astype(float) * 0.010
    fixed = rows["sampler"] == "confidence"
    rows.loc[fixed, "sec_per_sample"] = rows.loc[fixed, "nfe_budget"].astype(float) * 0.002
    agg = aggregate(rows)
    table = adaptive_table(agg).set_index("cap")
    assert table.loc[4, "wall ms / sample (per NFE)"] == "37.0 (10.0)"
    assert fixed_step_wall(agg) == " Fixed-step samplers of the same rows, per NFE: easy MDM confidence 2.0 ms."


def test_the_headline_and_the_fast_baseline_use_the_nfe_spent_on_every_seed(tmp_path):
    agg = aggregate(read_results(_conditional(tmp_path)))
    (easy,) = headline(agg)
    assert easy.startswith("easy: FMLM+ scratch PR@4 61.0 ± 1.0 [") and "the paper's row, MDM ancestral@41 81.0" in easy
    assert "MDM confidence@41 91.0 ± 1.0" in easy and "MDM eb@4 (3.7 NFE) 71.0 ± 1.0" in easy  # eb@18 spent 5–7
    table = verdicts(agg)
    paper = table[table["claim"].str.startswith("FMLM+ PR at 4 NFE beats the paper's MDM row")].iloc[0]
    assert (paper["scope"], paper["row"]) == ("paper", "headline (the paper's variant)")
    assert paper["verdict"] == "does not reproduce at this scale (paired Δ -20.0 [-20.0, -20.0], 3 seeds)"


def test_aup_scores_every_line_over_the_same_budgets(tmp_path):
    """PR's NFE-4 point falls 20 below its NFE-18 point: d3LLM's cut leaves PR its slow end alone, the table's AUP
    keeps it; every line over NFE 4 and 18 (the MDM's 41 is the MDM's alone), TPF = cells / NFE spent."""
    agg = aggregate(read_results(_conditional(tmp_path)))
    table = aup_table(agg).set_index(["model", "sampler"])
    pr = table.loc[("FMLM+ scratch", "pr")]
    y_max = 96.0  # the task's best point among NFE 4 and 18: FMLM+ a-priori at 18, its seeds' mean
    want = aup([18 / 18, 18 / 4], [81.0, 61.0], y_max=y_max, drop=None)
    assert pr["points"] == 2 and pr["AUP"] == f"{want:.1f}" and pr["comparable"] == "yes"
    assert pr["AUP, d3LLM cut"] == f"{1.0 * 81.0:.1f}"  # the cut: the slow point alone
    assert pr["TPF"] == "1–4.5"
    eb = table.loc[("MDM", "eb")]
    assert eb["TPF"] == f"{18 / 6.0:.3g}–{18 / 3.7:.3g}"  # its caps, at the NFE it spent
    lone = aggregate(read_results(_conditional(tmp_path))).query("not (sampler == 'a_priori' and nfe_budget == 18)")
    assert aup_table(lone).set_index(["model", "sampler"]).loc[("FMLM+ scratch", "a_priori"), "comparable"] == (
        "no: no point at NFE 18"
    )


def test_training_is_shown_per_seed_without_the_convergence_flag(tmp_path):
    rows = read_results(_conditional(tmp_path))
    table = training_table(rows).set_index(["model", "seed"])
    assert table.loc[("MDM", 1)].tolist() == ["easy", "6000", "6000", "20.0", "0.0200"]
    assert list(table.columns) == ["task", "own steps", "total steps", "wall (min)", "final val loss"]


def test_the_reports_page_order(tmp_path):
    text = build_sudoku_report(_conditional(tmp_path), tmp_path / "out").markdown.read_text()
    headings = [line for line in text.split("\n") if line.startswith("#")]
    assert [h.split(":")[0].split(",")[0] for h in headings] == [
        "# flowlm",
        "## Headline",
        "## Verdicts",
        "## Conditional Sudoku",
        "## Unconditional Sudoku",
        "## Unconditional Sudoku",
        "## Adaptive decoders (their own rows)",
        "## Calibration",
        "## Training",
        "## Accuracy versus training",
        "## AUP",
    ]
    assert "converged" not in text.lower().replace("convergence", "")
