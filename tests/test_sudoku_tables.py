"""The Sudoku tables' report on hand-made results CSVs whose tables and verdicts are known: the merge of every CSV
(seeds from separate invocations), the deduplication, mean ± std, the papers' rows, the verdict rule."""

import csv

import pytest

from analysis.sudoku_tables import (
    Cell,
    NoResultsError,
    aggregate,
    build_sudoku_report,
    calibration_table,
    conditional_table,
    empty_cells,
    read_results,
    unconditional_table,
    verdict,
    verdicts,
)
from callbacks.results_csv import COLUMNS, write_rows


def row(method, variant, sampler, nfe, seed, value, *, difficulty="easy", date="2026-12-01T10:00:00Z", **extra):
    """One results-CSV row (accuracy, or % valid when unconditional)."""
    metric = "valid_pct" if difficulty == "uncond" else "accuracy"
    base = {c: "" for c in COLUMNS}
    base.update(
        task=f"sudoku_{difficulty}_6x6",
        board="6x6",
        difficulty=difficulty,
        conditional=difficulty != "uncond",
        method=method,
        variant=variant,
        name=f"{method}_{variant}",
        sampler=sampler,
        sampler_settings="{}",
        confidence_kind="a-posteriori" if sampler == "pr" else "a-priori",
        nfe_budget=nfe,
        nfe=nfe,
        seed=seed,
        steps=1000,
        budget_steps=2000 if variant != "scratch" else 1000,
        wall_s=120.0,
        final_val_loss=0.5,
        converged=True,
        date=date,
        **{metric: value},
    )
    base.update(extra)
    return base


def seed_rows(seed: int) -> list[dict]:
    """The rows one invocation (one seed) writes; values chosen so that each verdict is known (see the test)."""
    mdm_conf = {0: 80.0, 1: 82.0, 2: 84.0}[seed]  # 82 ± 2
    init_pr = {0: 95.0, 1: 96.0, 2: 97.0}[seed]  # 96 ± 1
    scratch_pr = {0: 60.0, 1: 62.0, 2: 64.0}[seed]  # 62 ± 2
    distill_pr = {0: 80.0, 1: 84.0, 2: 88.0}[seed]  # 84 ± 4
    rows = [
        row("MDM", "scratch", "confidence", 18, seed, mdm_conf, auroc=0.7, wrong_pct=20.0),
        row("MDM", "scratch", "ancestral", 18, seed, 50.0),
        row("MDM", "scratch", "confidence", 4, seed, 10.0),
        row("FMLM+", "init", "pr", 4, seed, init_pr, auroc=0.9, wrong_pct=5.0),
        row("FMLM+", "init", "a_priori", 4, seed, 50.0, auroc=0.6, wrong_pct=40.0),
        row("FMLM+", "scratch", "pr", 4, seed, scratch_pr, converged=seed != 1),
        row("FMLM+", "distill", "pr", 4, seed, distill_pr),
        row("MLFM", "init", "mlfm_ccfg_otp", 18, seed, 70.0 + seed),
        row("MLFM", "init", "mlfm_ccfg", 18, seed, 40.0 + seed),
        row("MLFM", "init", "mlfm", 18, seed, 40.0 + seed),
    ]
    if seed == 0:
        rows.append(
            row("MDM", "scratch", "confidence", 36, 0, 50.0, difficulty="uncond", distinct_valid=100, train_copy_pct=1)
        )
    return rows


@pytest.fixture
def results(tmp_path):
    """Three invocations (seeds 0, 1, 2) in separate folders, plus an older copy of seed 0's FMLM+ init run."""
    folder = tmp_path / "results"
    for seed in (0, 1, 2):
        by_run = {}
        for r in seed_rows(seed):
            by_run.setdefault(r["name"], []).append(r)
        for name, rows in by_run.items():
            write_rows(folder / f"machine{seed}" / f"{name}_seed{seed}.csv", rows)
    stale = [row("FMLM+", "init", "pr", 4, 0, 0.0, date="2026-11-30T10:00:00Z")]  # an older run of the same seed
    write_rows(folder / "old" / "FMLM+_init_seed0.csv", stale)
    return folder


def test_every_csv_is_merged_and_the_latest_duplicate_kept(results):
    rows = read_results(results)
    pr = rows[(rows["variant"] == "init") & (rows["sampler"] == "pr")]
    assert sorted(pr["seed"]) == [0, 1, 2] and 0.0 not in set(pr["accuracy"])
    agg = aggregate(rows)
    line = agg[(agg["variant"] == "init") & (agg["sampler"] == "pr")].iloc[0]
    assert (line["accuracy_mean"], line["accuracy_std"], line["n"]) == (96.0, 1.0, 3)
    scratch = agg[(agg["variant"] == "scratch") & (agg["method"] == "FMLM+")].iloc[0]
    assert scratch["converged"] == 2  # seed 1 did not meet the rule within its cap


def test_empty_cells_of_the_boards():
    assert [empty_cells("6x6", d) for d in ("easy", "medium", "hard", "uncond")] == [18, 20, 23, 36]
    assert empty_cells("9x9", "easy") == 41


def test_verdict_rule():
    assert verdict(Cell(96, 1, 3), Cell(82, 2, 3)) == "reproduces"  # 14 > 1 + 2
    assert verdict(Cell(62, 2, 3), Cell(82, 2, 3)) == "does not reproduce at this scale"
    assert verdict(Cell(84, 4, 3), Cell(82, 2, 3)).startswith("inconclusive (overlapping")  # 2 ≤ 6
    assert verdict(Cell(85, 1, 3), Cell(82, 2, 3)).startswith("inconclusive")  # 3 ≤ 3: not more than the stds
    assert verdict(Cell(99, 0, 1), Cell(1, 0, 3)).startswith("inconclusive (one seed")
    assert verdict(None, Cell(1, 0, 3)) == "not measured"


def test_verdicts_of_the_claims(results):
    table = verdicts(aggregate(read_results(results)))
    pr_vs_mdm = table[table["claim"].str.startswith("FMLM+ PR at 4 NFE")].set_index("compared")["verdict"]
    assert pr_vs_mdm["FMLM+ init PR@4 96.0 ± 1.0 vs MDM@18 82.0 ± 2.0"] == "reproduces"
    assert pr_vs_mdm["FMLM+ scratch PR@4 62.0 ± 2.0 vs MDM@18 82.0 ± 2.0"] == "does not reproduce at this scale"
    assert pr_vs_mdm["FMLM+ distill PR@4 84.0 ± 4.0 vs MDM@18 82.0 ± 2.0"].startswith("inconclusive")
    prior = table[table["claim"].str.startswith("PR beats the a-priori") & table["compared"].str.contains("init")]
    assert prior["verdict"].tolist() == ["reproduces"]
    order = table[table["claim"].str.startswith("MDM-initialised")].set_index("compared")["verdict"]
    assert order["init 96.0 ± 1.0 vs distill 84.0 ± 4.0"] == "reproduces"  # 12 > 5
    assert order["distill 84.0 ± 4.0 vs scratch 62.0 ± 2.0"] == "reproduces"
    mlfm = table[table["claim"].str.startswith("MLFM")].set_index("compared")["verdict"]
    assert mlfm["mlfm_ccfg_otp 71.0 ± 1.0 vs mlfm_ccfg 41.0 ± 1.0"] == "reproduces"
    assert mlfm["mlfm_ccfg 41.0 ± 1.0 vs mlfm 41.0 ± 1.0"].startswith("inconclusive")


def test_tables_hold_measured_cells_paper_rows_and_training(results):
    agg = aggregate(read_results(results))
    cond = conditional_table(agg)
    assert "easy @18 (full)" in cond.columns and "hard @23 (full)" in cond.columns
    paper = cond[(cond["source"] == "paper, 9×9") & (cond["model"] == "FMLM+")].iloc[0]
    assert (paper["easy @4"], paper["medium @4"], paper["hard @4"]) == ("97.9", "92.0", "71.2")
    mdlm = cond[(cond["source"] == "paper, 9×9") & (cond["model"] == "MDLM")].iloc[0]
    assert mdlm["easy @18 (full)"] == "92.0 (NFE 128)"
    init = cond[(cond["model"] == "FMLM+ init") & (cond["sampler"] == "pr")].iloc[0]
    assert init["source"] == "measured, 6x6" and init["easy @4"] == "96.0 ± 1.0" and init["medium @4"] == ""
    assert init["easy training"] == "2000 steps (1000 own), 2.0 min, val loss 0.500, converged"
    scratch = cond[(cond["model"] == "FMLM+ scratch") & (cond["sampler"] == "pr")].iloc[0]
    assert "NOT converged in 1/3" in scratch["easy training"]
    uncond = unconditional_table(agg)
    mdm = uncond[(uncond["source"] == "measured, 6x6") & (uncond["sampler"] == "confidence")].iloc[0]
    assert mdm["NFE 36"] == "50.0 · 100 · 1.0"
    paper_pr = uncond[(uncond["source"] == "paper, 9×9") & (uncond["sampler"] == "pr")].iloc[0]
    assert (paper_pr["NFE 9"], paper_pr["NFE 36"], paper_pr["training"]) == ("87.1", "99.6 (81)", "")


def test_one_seed_shows_no_spread(results):
    """A single seed's std is 0 by construction, not a measured spread: its cells show the mean alone."""
    one = aggregate(read_results(results / "machine0"))
    line = calibration_table(one).set_index(["model", "sampler"]).loc[("FMLM+ init", "pr")]
    assert line["@4"] == "0.900 (5 % wrong)"
    assert Cell(0.9, 0.0, 3).format(3) == "0.900 ± 0.000" and Cell(0.9, 0.0, 1).format(3) == "0.900"
    init = conditional_table(one).set_index(["model", "sampler"]).loc[("FMLM+ init", "pr")]
    assert init["easy @4"] == "95.0"


def test_report_files_and_a_clear_error_without_results(results, tmp_path):
    out = tmp_path / "report"
    report = build_sudoku_report(results, out)
    text = report.markdown.read_text()
    for heading in ("## Verdicts", "## Conditional Sudoku", "## Unconditional Sudoku", "## Calibration"):
        assert heading in text
    assert "| easy | FMLM+ init | pr | a-posteriori | 0.900 ± 0.000 (5 % wrong) |" in text  # AUROC at 4 NFE
    assert "| easy | FMLM+ init | a_priori | a-priori | 0.600 ± 0.000 (40 % wrong) |" in text
    assert "easy: FMLM+ init PR@4 96.0 ± 1.0 % vs MDM@18 82.0 ± 2.0 %" in text  # the headline
    assert "<table>" in report.html.read_text()
    for name in ("conditional", "unconditional", "calibration", "verdicts", "rows"):
        with (out / f"{name}.csv").open() as f:
            assert len(list(csv.reader(f))) > 1
    with pytest.raises(NoResultsError, match="no results CSV"):
        build_sudoku_report(tmp_path / "nothing", out)


def test_flowlm_report_builds_the_tables_from_its_config(results, tmp_path):
    from conftest import compose_config

    from runners.report import report

    cfg = compose_config("report_sudoku", overrides=[f"results_dir={results}", f"out={tmp_path / 'tables'}"])
    built, run_id = report(cfg)
    assert run_id is None and built.markdown == tmp_path / "tables" / "report.md"
    assert "reproduces" in built.markdown.read_text()
