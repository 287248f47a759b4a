"""The Sudoku tables' report on hand-made results CSVs whose tables and verdicts are known: the merge of every CSV
(seeds from separate invocations), the deduplication, mean ± std, the papers' rows, the verdict rule; the report's own
output never read back, bad CSVs named and skipped, mixed machines named, each verdict's scope."""

import csv
import json
import re
import shutil
import warnings

import pandas as pd
import pytest

from analysis.sudoku_tables import (
    PAPER,
    SUITE,
    Cell,
    NoResultsError,
    ResultsCSVWarning,
    aggregate,
    build_sudoku_report,
    calibration_table,
    cell,
    conditional_table,
    empty_cells,
    headline,
    machines_note,
    read_results,
    rounded,
    scope,
    unconditional_table,
    verdict,
    verdicts,
    wilson,
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
    mdm_one = {0: 80.0, 1: 82.0, 2: 84.0}[seed]  # ancestral at one call per generated position: the paper's row
    init_pr = {0: 95.0, 1: 96.0, 2: 97.0}[seed]  # 96 ± 1
    scratch_pr = {0: 60.0, 1: 62.0, 2: 64.0}[seed]  # 62 ± 2
    distill_pr = {0: 80.0, 1: 84.0, 2: 88.0}[seed]  # 84 ± 4
    rows = [
        row("MDM", "scratch", "confidence", 18, seed, mdm_conf, auroc=0.7, wrong_pct=20.0),
        row("MDM", "scratch", "ancestral", 18, seed, 50.0),
        row("MDM", "scratch", "ancestral", 41, seed, mdm_one),
        row("MDM", "scratch", "confidence", 41, seed, 90.0 + seed),
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
    assert "converged" not in agg  # the convergence rule is a recorded diagnostic, no fact of a cell (issue 47)


def test_empty_cells_of_the_boards():
    assert [empty_cells("6x6", d) for d in ("easy", "medium", "hard", "uncond")] == [18, 20, 23, 36]
    assert empty_cells("9x9", "easy") == 41


def _seeds(*values: float) -> tuple[tuple[int, float], ...]:
    return tuple(enumerate(values))


def test_verdict_rule_reads_paired_seed_differences():
    """Paired per-seed differences with a 95 % t-interval (t at n − 1 degrees of freedom): above 0 reproduces, below
    does not, covering 0 is inconclusive."""
    better, worse = Cell(96, 1, 3, by_seed=_seeds(95, 96, 97)), Cell(82, 2, 3, by_seed=_seeds(80, 82, 84))
    assert verdict(better, worse) == "reproduces (paired Δ +14.0 [+11.5, +16.5], 3 seeds)"  # 14 ± 4.303 / √3
    assert verdict(worse, better) == "does not reproduce at this scale (paired Δ -14.0 [-16.5, -11.5], 3 seeds)"
    # the seeds move together: unpaired ± std (20 each) overlap, the paired differences (2, 2, 2) do not cover 0
    wide, wider = Cell(80, 20, 3, by_seed=_seeds(60, 80, 100)), Cell(78, 20, 3, by_seed=_seeds(58, 78, 98))
    assert verdict(wide, wider).startswith("reproduces (paired Δ +2.0 [+2.0, +2.0]")
    # differences 3, 1, 2: mean 2, sd 1; t(2) = 4.303 gives ±2.48 (covers 0) where a normal 1.96 gave ±1.13
    assert verdict(Cell(0, 0, 3, by_seed=_seeds(3, 1, 2)), Cell(0, 0, 3, by_seed=_seeds(0, 0, 0))) == (
        "inconclusive (paired Δ +2.0 [-0.5, +4.5], 3 seeds)"
    )
    assert verdict(None, worse) == "not measured"


def test_a_single_seed_decides_only_where_the_wilson_intervals_separate():
    """One paired seed (or none) has no t-interval: only two Wilson 95 % intervals that do not overlap decide."""
    pr = Cell(64.8, 0, 1, hits=332, total=512, by_seed=_seeds(64.8))
    prior = Cell(2.9, 0, 1, hits=15, total=512, by_seed=_seeds(2.9))
    assert verdict(pr, prior) == (
        "reproduces (one paired seed, 0: 64.8 [60.6–68.9] against 2.9 [1.8–4.8]: the Wilson 95 % intervals do not "
        "overlap)"
    )
    assert verdict(prior, pr).startswith("does not reproduce at this scale (one paired seed, 0: 2.9 [")
    close = Cell(47.0, 0, 1, hits=120, total=256, by_seed=_seeds(47.0))
    half = Cell(50.0, 0, 1, hits=128, total=256, by_seed=_seeds(50.0))
    assert verdict(half, close).startswith("inconclusive (one paired seed, 0: 50.0 [")
    assert verdict(half, close).endswith(": the Wilson 95 % intervals overlap)")
    other_seeds = Cell(50.0, 0, 2, hits=256, total=512, by_seed=((3, 50.0), (4, 50.0)))
    assert verdict(pr, other_seeds).startswith("reproduces (no seed on both sides: the Wilson")


def test_few_paired_seeds_each_decided_alike_by_their_own_intervals_keep_that_verdict():
    """Two paired seeds whose t-interval covers 0 (t95 at 1 degree of freedom is 12.7) but each of which its own
    Wilson 95 % intervals decide, the same way: their verdict, said so; a second seed agreeing with a first one never
    weakens the verdict one seed alone gave. One seed undecided, or the two decided opposite ways: inconclusive."""
    n = (2000, 2000)

    def cell(*values: float) -> Cell:
        hits = sum(round(v / 100 * 2000) for v in values)
        return Cell(sum(values) / 2, 0, 2, hits=hits, total=4000, by_seed=_seeds(*values), samples_by_seed=_seeds(*n))

    pr, mdm = cell(97.0, 92.0), cell(85.8, 84.0)  # differences 11.2 and 8.0: 9.6 ± 12.706 · 2.26 / √2 covers 0
    first = Cell(97.0, 0, 1, hits=1940, total=2000, by_seed=_seeds(97.0), samples_by_seed=_seeds(2000))
    assert verdict(first, mdm).startswith("reproduces (one paired seed, 0: ")
    assert verdict(pr, mdm) == (
        "reproduces (paired Δ +9.6 [-10.7, +29.9], 2 seeds: the t-interval covers 0, but on every paired seed the "
        "Wilson 95 % intervals do not overlap)"
    )
    assert verdict(mdm, pr).startswith("does not reproduce at this scale (paired Δ -9.6 [-29.9, +10.7], 2 seeds: the")
    assert verdict(cell(97.0, 85.0), mdm) == "inconclusive (paired Δ +6.1 [-58.7, +70.9], 2 seeds)"  # 2nd: +1.0
    assert verdict(cell(97.0, 80.0), mdm).startswith("inconclusive (paired Δ +3.6 [")  # +11.2 and −4.0


def test_one_paired_seed_decides_by_its_own_intervals_not_the_pool_of_a_side_with_more_seeds(tmp_path):
    """FMLM+ at one seed beside an MDM at two (a campaign that has finished one model of the pair): the verdict reads
    seed 0's own Wilson intervals on both sides, each from that seed's own count, not the MDM's pool over seeds 0–1,
    whose centre seed 1 moves."""
    folder = tmp_path / "results"
    mdm = [
        row("MDM", "scratch", "ancestral", 41, 0, 85.0, samples=2000),
        row("MDM", "scratch", "ancestral", 41, 1, 97.0, samples=512),
    ]
    write_rows(folder / "mdm.csv", mdm)
    write_rows(folder / "pr.csv", [row("FMLM+", "scratch", "pr", 4, 0, 89.0, samples=2000)])
    agg = aggregate(read_results(folder))
    pr = cell(agg, "accuracy", method="FMLM+", sampler="pr")
    mdm_cell = cell(agg, "accuracy", method="MDM", sampler="ancestral")
    # pooled, 87.5 % of 2 512 [86.1–88.7] overlaps PR's 89.0 % of 2 000 [87.6–90.3]; seed 0 alone [83.4–86.5] does not
    assert mdm_cell.interval() == wilson(2197, 2512)
    assert verdict(pr, Cell(87.5, 6.0, 2, hits=2197, total=2512)).startswith("inconclusive")
    assert mdm_cell.seed_interval(0) == wilson(1700, 2000)
    assert mdm_cell.seed_interval(1) == wilson(497, 512)  # its own 512 samples, not the pool's share
    assert verdict(pr, mdm_cell) == (  # seed 0's own values and intervals, not the MDM's pooled cell
        "reproduces (one paired seed, 0: 89.0 [87.6–90.3] against 85.0 [83.4–86.5]: the Wilson 95 % intervals do "
        "not overlap)"
    )
    # seed 1 alone (FMLM+ at 89 % of 2 000 against 97 % of 512 [95.2–98.2]): the MDM leads on its own count
    write_rows(folder / "pr.csv", [row("FMLM+", "scratch", "pr", 4, 1, 89.0, samples=2000)])
    agg = aggregate(read_results(folder))
    said = verdict(cell(agg, "accuracy", method="FMLM+", sampler="pr"), mdm_cell)
    assert said.startswith("does not reproduce at this scale (one paired seed, 1: 89.0 [87.6–90.3] against 97.0 ["), (
        said
    )


def test_verdicts_compare_equal_training_only():
    """Seeds pair only where both sides trained the same own steps, and two cells whose recorded steps share no count
    (a model retrained to the new budget beside one not yet retrained) are not compared; steps not recorded (CSVs
    before the column) pair as before."""
    better = Cell(96, 1, 3, by_seed=_seeds(95, 96, 97), steps_by_seed=((0, 20000), (1, 20000), (2, 20000)))
    worse = Cell(82, 2, 3, by_seed=_seeds(80, 82, 84), steps_by_seed=((0, 20000), (1, 20000), (2, 20000)))
    assert verdict(better, worse) == "reproduces (paired Δ +14.0 [+11.5, +16.5], 3 seeds)"
    old = Cell(82, 2, 3, by_seed=_seeds(80, 82, 84), steps_by_seed=((0, 6000), (1, 6000), (2, 6000)))
    assert verdict(better, old) == "not compared (unequal training: 20000 against 6000 steps)"
    assert verdict(old, better) == "not compared (unequal training: 6000 against 20000 steps)"
    # seed 0 still at the old budget on one side: the two seeds at equal training pair, seed 0 does not
    mixed = Cell(82, 2, 3, by_seed=_seeds(0, 82, 84), steps_by_seed=((0, 6000), (1, 20000), (2, 20000)))
    assert verdict(better, mixed) == "reproduces (paired Δ +13.5 [+7.1, +19.9], 2 seeds)"  # 13.5 ± 12.706 · 0.707 / √2
    unrecorded = Cell(82, 2, 3, by_seed=_seeds(80, 82, 84))
    assert verdict(better, unrecorded) == verdict(better, worse)


def test_the_report_does_not_judge_a_retrained_line_against_one_not_yet_retrained(tmp_path):
    """From the CSVs on: the MDM retrained to 20 000 steps (seeds 0, 1) beside FMLM+ scratch still at 6 000 (seed
    0): its claim is not compared, and the headline says the training is unequal so far."""
    folder = tmp_path / "results"
    mdm = [row("MDM", "scratch", "ancestral", 41, s, 90.0, steps=20000, budget_steps=20000) for s in (0, 1)]
    write_rows(folder / "mdm.csv", mdm)
    write_rows(folder / "pr.csv", [row("FMLM+", "scratch", "pr", 4, 0, 84.0, steps=6000, budget_steps=6000)])
    agg = aggregate(read_results(folder))
    table = verdicts(agg)
    line = table[table["claim"].str.contains("PR") & table["compared"].str.contains("ancestral")]
    said = set(line["verdict"])  # the easy line not compared; the others (medium, hard) not measured
    assert said == {"not compared (unequal training: 6000 against 20000 steps)", "not measured"}, said
    assert "(unequal training so far: 6000 against 20000 steps)" in " ".join(headline(agg))


def test_verdicts_pair_seeds_trained_in_the_same_precision_only():
    """The protocol's bf16-mixed against float32 (a CPU without bf16 kernels, FLOWLM_CAMPAIGN_PRECISION): a seed
    pairs only where both sides trained in the same precision; two cells that share none are not compared; a seed
    whose precision is not recorded pairs as before."""
    bf16 = tuple((s, "bf16-mixed") for s in range(3))
    better = Cell(96, 1, 3, by_seed=_seeds(95, 96, 97), precision_by_seed=bf16)
    worse = Cell(82, 2, 3, by_seed=_seeds(80, 82, 84), precision_by_seed=bf16)
    assert verdict(better, worse) == "reproduces (paired Δ +14.0 [+11.5, +16.5], 3 seeds)"
    fp32 = Cell(82, 2, 3, by_seed=_seeds(80, 82, 84), precision_by_seed=tuple((s, "32-true") for s in range(3)))
    assert verdict(better, fp32) == "not compared (unequal precision: bf16-mixed against 32-true)"
    # seed 0 in float32 on one side (a later machine without bf16 kernels): seeds 1 and 2 pair, seed 0 does not
    mixed = Cell(
        82, 2, 3, by_seed=_seeds(0, 82, 84), precision_by_seed=((0, "32-true"), (1, "bf16-mixed"), (2, "bf16-mixed"))
    )
    assert verdict(better, mixed) == "reproduces (paired Δ +13.5 [+7.1, +19.9], 2 seeds)"
    assert verdict(better, Cell(82, 2, 3, by_seed=_seeds(80, 82, 84))) == verdict(better, worse)


def test_the_report_reads_each_seeds_precision_from_the_rows(tmp_path):
    """From the CSVs on: FMLM+ scratch trained in float32 beside the MDM in bf16 (both at 20 000 steps) is not
    compared, and the headline says the precisions differ; the aggregate keeps each seed's precision."""
    folder = tmp_path / "results"
    mdm = [row("MDM", "scratch", "ancestral", 41, s, 90.0, steps=20000, precision="bf16-mixed") for s in (0, 1)]
    write_rows(folder / "mdm.csv", mdm)
    pr = [row("FMLM+", "scratch", "pr", 4, s, 84.0, steps=20000, precision="32-true") for s in (0, 1)]
    write_rows(folder / "pr.csv", pr)
    agg = aggregate(read_results(folder))
    line = agg[(agg["method"] == "MDM") & (agg["sampler"] == "ancestral")].iloc[0]
    assert json.loads(line["precision_by_seed"]) == {"0": "bf16-mixed", "1": "bf16-mixed"}
    table = verdicts(agg)
    line = table[table["claim"].str.contains("PR") & table["compared"].str.contains("ancestral")]
    said = set(line["verdict"])
    assert said == {"not compared (unequal precision: 32-true against bf16-mixed)", "not measured"}, said
    assert "(unequal precision so far: 32-true against bf16-mixed)" in " ".join(headline(agg))


def test_wilson_interval_against_newcombes_example():
    """Newcombe (1998): 81 of 263 → 25.53–36.62 %; 0 of n → [0, z² / (n + z²)]."""
    from analysis.sudoku_tables import wilson

    low, high = wilson(81, 263)
    assert (round(low, 2), round(high, 2)) == (25.53, 36.62)
    assert wilson(0, 256) == (0.0, pytest.approx(100 * 1.959964**2 / (256 + 1.959964**2)))
    with pytest.raises(ValueError, match="at least one trial"):
        wilson(0, 0)


def test_t_quantiles_match_students_t():
    from analysis.sudoku_tables import t95

    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 3, 4, 5, 10, 20, 30):
        assert t95(df) == pytest.approx(stats.t.ppf(0.975, df), abs=1e-3)
    assert t95(22) == pytest.approx(stats.t.ppf(0.975, 20), abs=1e-3)  # between entries: the wider, lower df's


def test_cells_pool_the_correct_count_over_seeds(results):
    """The Wilson interval counts accuracy % × samples, summed over seeds (256 puzzles a seed in these rows: written
    before the `samples` column and before the fixed-budget protocol)."""
    line = aggregate(read_results(results)).set_index(["variant", "sampler", "nfe_budget"]).loc[("init", "pr", 4)]
    assert (line["accuracy_hits"], line["accuracy_total"]) == (round(0.95 * 256) + round(0.96 * 256) + 248, 768)
    assert line["samples_assumed"] == 3
    assert json.loads(line["accuracy_by_seed"]) == {"0": 95.0, "1": 96.0, "2": 97.0}


def _verdict(table, claim_start: str, compared_start: str, task: str = "easy") -> str:
    pick = table[table["claim"].str.startswith(claim_start) & table["compared"].str.startswith(compared_start)]
    pick = pick[pick["task"] == task]
    assert len(pick) == 1, (claim_start, compared_start, pick)
    return pick["verdict"].iloc[0]


def test_verdicts_of_the_claims(results):
    table = verdicts(aggregate(read_results(results)))
    paper_row = "FMLM+ PR at 4 NFE beats the paper's MDM row: MDLM (ancestral) at one call per generated position"
    assert _verdict(table, paper_row, "FMLM+ init PR@4").startswith("reproduces (paired Δ +14.0")  # 95/96/97 − 80/82/84
    assert _verdict(table, paper_row, "FMLM+ scratch PR@4").startswith("does not reproduce at this scale (paired")
    assert _verdict(table, paper_row, "FMLM+ distill PR@4").startswith("inconclusive (paired Δ +2.0")
    assert (
        "vs MDM ancestral@41 82.0 ± 2.0 [79.2–84.6]"
        in table[table["claim"].str.startswith(paper_row)].iloc[0]["compared"]
    )  # the paper's row: ancestral at one call per generated position, not the MDM's better sampler at 18
    stronger = "FMLM+ PR at 4 NFE beats the MDM's confidence sampler at one call per generated position (41 NFE)"
    # a comparison the papers do not state holds (or does not): there is no claim of theirs to reproduce
    assert _verdict(table, stronger, "FMLM+ init PR@4").startswith("holds (paired Δ +5.0")
    # claims the papers state elsewhere (unconditional Sudoku, GSM8K) hold or not here: nothing to reproduce
    assert _verdict(table, "PR beats the a-priori", "FMLM+ init PR").startswith("holds")
    assert _verdict(table, "MDM-initialised", "init").startswith("holds (paired Δ +12.0")
    assert _verdict(table, "MDM-initialised", "distill").startswith("holds (paired Δ +22.0")
    assert _verdict(table, "MLFM", "mlfm_ccfg_otp").startswith("holds")
    assert _verdict(table, "MLFM", "mlfm_ccfg ").startswith("inconclusive")
    # a task without rows: the paper's claim stated there is listed, not measured (the tally counts it), the
    # suite's own comparisons are not
    for d in ("medium", "hard"):
        lines = table[table["task"] == d]
        assert list(zip(lines["claim"], lines["verdict"], lines["scope"], strict=True)) == [
            (paper_row, "not measured", "paper")
        ]
        assert lines["compared"].iloc[0] == "FMLM+ scratch PR@4 — vs MDM ancestral@41 —"


def test_tables_hold_measured_cells_paper_rows_and_training(results):
    agg = aggregate(read_results(results))
    cond = conditional_table(agg)
    assert "easy @18 (empty cells)" in cond.columns and "hard @23 (empty cells)" in cond.columns
    assert "easy @41 (one call per position)" in cond.columns
    paper = cond[(cond["source"] == "paper, 9×9") & (cond["model"] == "FMLM+")].iloc[0]
    assert (paper["easy @4"], paper["medium @4"], paper["hard @4"]) == ("97.9", "92.0", "71.2")
    mdlm = cond[(cond["source"] == "paper, 9×9") & (cond["model"] == "MDLM")].iloc[0]
    assert mdlm["easy @41 (one call per position)"] == "92.0 (NFE 128)"  # 128 calls on 89 positions: ≤ 1 a call
    init = cond[(cond["model"] == "FMLM+ init") & (cond["sampler"] == "pr")].iloc[0]
    assert init["source"] == "measured, 6x6" and init["easy @4"] == "96.0 ± 1.0 [94.3–97.1]" and init["medium @4"] == ""
    assert init["role"] == "strategy row"
    scratch = cond[(cond["model"] == "FMLM+ scratch") & (cond["sampler"] == "pr")].iloc[0]
    assert scratch["role"] == "headline (the paper's variant)"
    assert not any("training" in c for c in cond.columns)  # per-seed training facts have their own table
    uncond = unconditional_table(agg)
    mdm = uncond[(uncond["source"] == "measured, 6x6") & (uncond["sampler"] == "confidence")].iloc[0]
    assert mdm["NFE 36"] == "50.0 [45.7–54.3] · 100 · 1.0"  # one seed of 512 grids (the earlier rows' default)
    paper_pr = uncond[(uncond["source"] == "paper, 9×9") & (uncond["sampler"] == "pr")].iloc[0]
    assert (paper_pr["NFE 9"], paper_pr["NFE 36"]) == ("87.1", "99.6 (81)")


def test_one_seed_shows_no_spread(results):
    """A single seed's std is 0 by construction, not a measured spread: its cells show the mean alone."""
    one = aggregate(read_results(results / "machine0"))
    line = calibration_table(one).set_index(["model", "sampler"]).loc[("FMLM+ init", "pr")]
    assert line["@4"] == "0.900 (5 % wrong)"
    assert Cell(0.9, 0.0, 3).format(3) == "0.900 ± 0.000" and Cell(0.9, 0.0, 1).format(3) == "0.900"
    init = conditional_table(one).set_index(["model", "sampler"]).loc[("FMLM+ init", "pr")]
    assert init["easy @4"] == "95.0 [91.5–97.0]"  # no ± std; the Wilson interval of its 256 puzzles


def test_calibration_counts_the_wrong_tokens_it_ranked_summed_over_seeds():
    """An AUROC comes with the wrong tokens it ranked (of those scored, summed over the seeds): 1 wrong token of
    2 048 ranks one token; none wrong leaves no AUROC (—), not an empty cell."""
    rows = pd.DataFrame(
        [
            row("FMLM+", "scratch", "pr", 4, 0, 97.0, auroc=0.96, wrong_pct=100 / 2048, calibration_tokens=2048),
            row("FMLM+", "scratch", "pr", 18, 0, 97.0, auroc=0.98, wrong_pct=300 / 2048, calibration_tokens=2048),
            row("FMLM+", "scratch", "a_priori", 4, 0, 99.8, auroc="", wrong_pct=0.0, calibration_tokens=2048),
            row("FMLM+", "scratch", "a_priori", 18, 0, 100.0, auroc="", wrong_pct=0.0, calibration_tokens=2048),
            *(
                row("MDM", "scratch", "ancestral", nfe, seed, 85.0, auroc=a, wrong_pct=w, calibration_tokens=2048)
                for nfe, seed, a, w in [(4, 0, 0.9, 1.0), (4, 1, 0.8, 2.0), (18, 0, 0.9, 1.0), (18, 1, "", 0.0)]
            ),
        ]
    )
    for c in ("nfe_budget", "seed", "auroc", "wrong_pct", "calibration_tokens", "accuracy", "steps"):
        rows[c] = pd.to_numeric(rows[c], errors="coerce")
    table = calibration_table(aggregate(rows)).set_index(["model", "sampler"])
    assert table.loc[("FMLM+ scratch", "pr"), "@4"] == "0.960 (1 of 2048 tokens wrong)"
    assert table.loc[("FMLM+ scratch", "pr"), "@empty cells"] == "0.980 (3 of 2048 tokens wrong)"
    assert table.loc[("FMLM+ scratch", "a_priori"), "@4"] == "— (0 of 2048 tokens wrong)"
    # two seeds: 20 + 41 wrong of 4 096 (1 % and 2 % of 2 048, rounded per seed)
    assert table.loc[("MDM", "ancestral"), "@4"] == "0.850 ± 0.071 (61 of 4096 tokens wrong)"
    # seed 1 made no wrong token at 18: its AUROC is undefined, so the cell is seed 0's alone, with no spread
    assert table.loc[("MDM", "ancestral"), "@empty cells"] == "0.900 (20 of 4096 tokens wrong)"


def test_report_files_and_a_clear_error_without_results(results, tmp_path):
    out = tmp_path / "report"
    report = build_sudoku_report(results, out)
    text = report.markdown.read_text()
    for heading in ("## Verdicts", "## Conditional Sudoku", "## Unconditional Sudoku", "## Calibration"):
        assert heading in text
    assert "| easy | FMLM+ init | pr | a-posteriori | 0.900 ± 0.000 (5 % wrong) |" in text  # AUROC at 4 NFE
    assert "| easy | FMLM+ init | a_priori | a-priori | 0.600 ± 0.000 (40 % wrong) |" in text
    assert (
        "easy: FMLM+ scratch PR@4 62.0 ± 2.0 [58.6–65.5] % (seeds 0, 1, 2) vs the paper's row, MDM ancestral@41 "
        "82.0 ± 2.0 [79.2–84.6] % (seeds 0, 1, 2); the suite's stronger baselines: MDM confidence@41 91.0 ± 1.0 "
        "[88.8–92.8] % (seeds 0, 1, 2)"
    ) in text  # the headline: the paper's variant against the paper's row, the stronger baselines beside
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


# ---------------------------------------------------------------- the report's own output is never read back
TABLES = ("rows", "aggregate", "conditional", "unconditional", "calibration", "verdicts")


def _outputs(out) -> dict[str, str]:
    """The report's files, its generation time blanked."""
    files = {name: (out / f"{name}.csv").read_text() for name in TABLES}
    files["report.md"] = re.sub(r"Generated [\d-]+ [\d:]+ UTC", "Generated", (out / "report.md").read_text())
    return files


def test_a_report_inside_the_results_folder_reads_the_same_rows_twice(results):
    """The default `out` is inside `results_dir`: a second run must not read the first's CSVs as results."""
    expected = read_results(results)
    out = results / "report"
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResultsCSVWarning)  # nor are they named as bad results CSVs
        first = _outputs(build_sudoku_report(results, out).out)
        second = _outputs(build_sudoku_report(results, out).out)
    assert second == first
    files = expected["file"].nunique()
    assert f"{len(expected)} measured rows, seeds [0, 1, 2], from {files} CSV files;" in second["report.md"]
    assert "50.0 [45.7–54.3] · 100 · 1.0" in second["unconditional"]  # one seed: no "± 0.0" from a read-back "seed"


def test_a_copied_report_is_not_read_and_a_removed_run_stays_removed(results, tmp_path):
    """A report folder copied in beside the results (report.md beside rows.csv) holds the results schema in rows.csv:
    reading it would bring back the rows of a run whose CSV was since removed."""
    shutil.copytree(build_sudoku_report(results, tmp_path / "first").out, results / "from_another_machine")
    (results / "machine2" / "MLFM_init_seed2.csv").unlink()
    rows = read_results(results)
    assert not rows["file"].str.contains("from_another_machine").any()
    mlfm = rows[rows["method"] == "MLFM"]
    assert sorted(mlfm["seed"].unique()) == [0, 1]


def test_the_out_folder_is_not_read_even_without_its_report_md(results):
    """A report stopped after writing rows.csv (no report.md yet) leaves the results schema in `out`."""
    stale = row("FMLM+", "init", "pr", 4, 2, 0.0, date="2026-12-31T10:00:00Z")  # newer than seed 2's real row
    write_rows(results / "report" / "rows.csv", [stale])
    report = build_sudoku_report(results, results / "report")
    init = report.tables["conditional"].set_index(["model", "sampler"]).loc[("FMLM+ init", "pr")]
    assert init["easy @4"] == "96.0 ± 1.0 [94.3–97.1]"


# ---------------------------------------------------------------- bad CSVs are named and skipped
def _bad_csv(kind: str, folder):
    """A bad CSV of the kind ``kind`` under ``folder``, from seed 7's FMLM+ init run (a PR row, then an a-priori row);
    its path and the samplers of its rows that are good."""
    path = folder / "extra" / "FMLM+_init_seed7.csv"
    rows = [row("FMLM+", "init", "pr", 4, 7, 91.0), row("FMLM+", "init", "a_priori", 4, 7, 55.0)]
    if kind == "decimal_comma":
        rows[1]["accuracy"] = "91,8"  # quoted by the writer: one field, not a number
    if kind == "no_samples":
        rows[1]["samples"] = 0  # a percentage of nothing: no interval
    if kind == "not_a_percentage":
        rows[1]["accuracy"] = 918.0  # a fraction × 1 000, or a misplaced point: no Wilson interval exists for it
    write_rows(path, rows)
    text = path.read_bytes()
    last = text.rstrip().rfind(b"\n") + 1
    if kind == "cut_line":  # a copy that stopped halfway through the last line: fewer fields than the header
        path.write_bytes(text[: last + (len(text) - last) // 2])
    elif kind == "cut_date":  # stopped inside the last field: every field there, the date cut short
        path.write_bytes(text[:-4])
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "not_utf8":
        path.write_bytes(text.replace(b"FMLM+", b"FMLM\xff", 1))
    elif kind == "foreign_header":
        path.unlink()
        path = path.with_name("notes.csv")
        path.write_text("note,by\nseed 2 was rerun on the GPU box,anna\n")
    return path, ["pr"] if kind in ("cut_line", "cut_date", "decimal_comma", "not_a_percentage", "no_samples") else []


@pytest.mark.parametrize(
    "kind, reason",
    [
        ("cut_line", rf"skipped 1 of 2 rows: line 3: \d+ fields where the header has {len(COLUMNS)} \(a cut line\?\)"),
        (
            "cut_date",
            r"skipped 1 of 2 rows: line 3: date '2026-12-01T10:00:0' is not %Y-%m-%dT%H:%M:%SZ \(a cut line\?\)",
        ),
        ("decimal_comma", r"skipped 1 of 2 rows: line 3: accuracy '91,8' is not a number \(a decimal comma\?\)"),
        ("not_a_percentage", r"skipped 1 of 2 rows: line 3: accuracy 918.0 is not a percentage \(0–100\)"),
        ("no_samples", r"skipped 1 of 2 rows: line 3: samples 0 is not a count of puzzles / grids"),
        ("empty", r"empty file, skipped"),
        ("foreign_header", r"not a results CSV \(its header lacks \['board', 'difficulty', .*\]\), skipped"),
        ("not_utf8", r"not UTF-8 text \(invalid start byte at byte \d+\), skipped"),
    ],
)
def test_a_bad_csv_is_named_and_the_good_rows_still_read(results, kind, reason):
    baseline = read_results(results)
    path, good = _bad_csv(kind, results)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = read_results(results)
    messages = [str(w.message) for w in caught if issubclass(w.category, ResultsCSVWarning)]
    assert len(messages) == 1 and re.fullmatch(re.escape(f"{path}: ") + reason, messages[0]), messages
    extra = rows[rows["seed"] == 7]
    assert extra["sampler"].tolist() == good and len(rows) == len(baseline) + len(good)  # every other file read
    assert extra["accuracy"].tolist() == [91.0] * len(good)
    with pytest.warns(ResultsCSVWarning):
        header = build_sudoku_report(results, results / "report").markdown.read_text().split("\n")[2]
    assert f"skipped (named in the warnings): {path.relative_to(results)} (" in header


def test_a_percentage_not_measured_is_no_bad_row(tmp_path):
    """A NaN percentage (a metric the run did not measure, written as 'nan') is read as missing, not skipped as
    outside 0–100."""
    write_rows(tmp_path / "run_seed0.csv", [row("MDM", "scratch", "confidence", 18, 0, float("nan"))])
    assert "nan" in (tmp_path / "run_seed0.csv").read_text().splitlines()[1].split(",")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResultsCSVWarning)
        rows = read_results(tmp_path)
    assert len(rows) == 1 and rows["accuracy"].isna().all()


def test_only_bad_csvs_is_a_clear_error(tmp_path):
    (tmp_path / "notes.csv").write_text("note\nnothing yet\n")
    (tmp_path / "empty.csv").write_text("")
    with pytest.warns(ResultsCSVWarning), pytest.raises(NoResultsError, match=r"no readable results CSV.*empty\.csv"):
        read_results(tmp_path)


# ---------------------------------------------------------------- mixed machines
def _old_csv(path, rows) -> None:
    """A results CSV from before the `precision` and `device` columns."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        old = [c for c in COLUMNS if c not in ("precision", "device")]
        writer = csv.DictWriter(f, fieldnames=old, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def test_a_table_mixing_machines_says_so_under_it(tmp_path, capsys):
    folder = tmp_path / "results"
    cpu, gpu = {"precision": "32-true", "device": "cpu: AMD EPYC 7B13"}, {"precision": "bf16-mixed", "device": "H200"}
    adaptive = row("MDM", "scratch", "eb", 4, 0, 70.0, **cpu)  # its own table: not a row of the conditional one
    write_rows(folder / "a" / "run_seed0.csv", [row("MDM", "scratch", "confidence", 18, 0, 80.0, **cpu), adaptive])
    write_rows(folder / "b" / "run_seed1.csv", [row("MDM", "scratch", "confidence", 18, 1, 82.0, **gpu)])
    _old_csv(folder / "c" / "run_seed2.csv", [row("MDM", "scratch", "confidence", 18, 2, 84.0)])
    uncond = [
        row("MDM", "scratch", "confidence", 36, s, 50.0, difficulty="uncond", distinct_valid=9, train_copy_pct=0, **cpu)
        for s in (0, 1)
    ]
    write_rows(folder / "a" / "uncond_seed0.csv", uncond)
    report = build_sudoku_report(folder, tmp_path / "report")
    text = report.markdown.read_text()
    note = (
        "Mixed machines in this table: precision 32-true (1 row), bf16-mixed (1 row), not recorded (1 row); "
        "device H200 (1 row), cpu: AMD EPYC 7B13 (1 row), not recorded (1 row)."
    )
    conditional = text.index("## Conditional Sudoku")
    table_end = text.index("| measured, 6x6 | MDM | baseline | confidence |", conditional)
    assert text.index(note, table_end) < text.index("## Unconditional")  # one line under the conditional table
    assert text.count("Mixed machines") == 4  # conditional, verdicts, calibration, training; not the uncond table
    # nor the adaptive one (its one row, one machine)
    training = text[text.index("## Training, per seed") :]
    assert "precision 32-true (3 rows), bf16-mixed (1 row), not recorded (1 row)" in training  # a row per model seed
    assert note.replace("'", "&#x27;") in report.html.read_text()
    printed = capsys.readouterr().out
    assert f"conditional table: {note}" in printed and "unconditional table:" not in printed
    assert f"Read {folder}: 6 measured rows, seeds [0, 1, 2], from 4 CSV files;" in printed


def test_machines_note_names_either_kind_of_mix():
    rows = pd.DataFrame({"precision": ["32-true", "32-true"], "device": ["cpu: AMD EPYC", "NVIDIA H200"]})
    assert machines_note(rows) == (
        "Mixed machines in this table: precision 32-true (2 rows); device NVIDIA H200 (1 row), cpu: AMD EPYC (1 row)."
    )
    assert machines_note(rows.assign(device="NVIDIA H200")) == ""
    assert machines_note(rows.drop(columns=["precision", "device"])) == ""  # older CSVs only: one (unknown) kind


# ---------------------------------------------------------------- where the paper states each claim
def test_each_verdict_says_whether_the_paper_states_it_there(results, tmp_path):
    """Scope `paper`: the task and NFE where the paper states the claim, on its FMLM+ (from scratch); a strategy row
    (initialised, distilled), a stronger baseline or another task is the suite's own finding. Unconditional claims
    at each NFE the paper states, under both budget mappings."""
    uncond = [
        row("FMLM+", v, sampler, nfe, seed, value + seed, difficulty="uncond", distinct_valid=9, train_copy_pct=0)
        for v in ("scratch", "init")
        for seed in (0, 1, 2)
        for nfe in (2, 3, 4, 9)
        for sampler, value in (("pr", 60.0), ("a_priori", 10.0))
    ]
    write_rows(results / "uncond" / "FMLM+_uncond.csv", uncond)
    table = verdicts(aggregate(read_results(results)))
    prior = table[table["claim"].str.startswith("PR beats the a-priori")]
    on_uncond = prior[prior["task"] == "uncond"]
    scratch = on_uncond[on_uncond["compared"].str.startswith("FMLM+ scratch")]
    assert [c.split("(")[-1] for c in scratch["claim"]] == [
        "paper NFE 3 → NFE 3, absolute)",
        "paper NFE 3 → NFE 2, by tokens per call)",
        "paper NFE 9 → NFE 9, absolute)",
        "paper NFE 9 → NFE 4, by tokens per call)",
        "paper NFE 27 → NFE 27, absolute)",
        "paper NFE 27 → NFE 12, by tokens per call)",
    ]  # every NFE the paper states, said where not measured
    assert set(scratch["scope"]) == {PAPER}
    assert scratch["verdict"].str[:10].tolist() == ["reproduces"] * 4 + ["not measur"] * 2
    init = on_uncond[on_uncond["compared"].str.startswith("FMLM+ init")]
    assert len(init) == 4 and set(init["scope"]) == {SUITE} and set(init["row"]) == {"strategy row"}
    easy = prior[(prior["task"] == "easy") & prior["compared"].str.startswith("FMLM+ init")].iloc[0]
    assert easy["scope"] == SUITE  # the paper's a-priori row (δ₀,₀) is on unconditional Sudoku only
    # judged all the same, as the suite's own finding: it holds here (stated for unconditional boards only)
    assert easy["verdict"].startswith("holds")
    assert easy["stated"].startswith("sudoku_uncond: FMLM+ PR (δ₀,₁) @3/9/27 > FMLM+ a-priori")
    pr_vs_mdm = table[table["claim"].str.startswith("FMLM+ PR at 4 NFE beats the paper's MDM row")]
    assert dict(zip(pr_vs_mdm["compared"].str[:13], pr_vs_mdm["scope"], strict=True)) == {
        "FMLM+ scratch": PAPER, "FMLM+ distill": SUITE, "FMLM+ init PR": SUITE
    }  # fmt: skip
    assert pr_vs_mdm["stated"].iloc[0].startswith("sudoku_easy, sudoku_medium, sudoku_hard: FMLM+ PR @4 > MDLM @128")
    stronger = table[table["claim"].str.contains("the suite's stronger baseline")]
    assert len(stronger) == 6 and set(stronger["scope"]) == {SUITE}  # the confidence sampler, the best decoder
    order = table[table["claim"].str.startswith("MDM-initialised")]
    mlfm = table[table["claim"].str.startswith("MLFM")]
    assert set(order["scope"]) == set(mlfm["scope"]) == {SUITE}  # the papers state both on GSM8K
    assert order["stated"].iloc[0].startswith("gsm8k: FMLM+ init PR @32 > FMLM+ distill PR @32")
    text = build_sudoku_report(results, tmp_path / "report").markdown.read_text()
    paper = table[table["scope"] == PAPER]["verdict"].str.split(" \\(").str[0].value_counts()
    assert f"Reproduction verdicts: reproduces: {paper['reproduces']}, does not reproduce" in text  # fixed order
    assert "| PR beats the a-priori loop on the same checkpoint at low NFE (4) | easy | strategy row |" in text


def test_scope_reads_task_nfe_and_variant():
    assert scope("pr_beats_a_priori", "uncond", 9) == PAPER
    assert scope("pr_beats_a_priori", "uncond", 36) == SUITE  # the paper's 81: PR leads there by 0.8 only
    assert scope("pr_beats_a_priori", "uncond", 4, paper_nfe=9) == PAPER  # the paper's 9, mapped by tokens a call
    assert scope("pr_beats_a_priori", "easy", 4) == SUITE
    assert scope("pr_beats_mdm", "hard", 4) == PAPER
    assert scope("pr_beats_mdm", "hard", 4, variant="scratch") == PAPER
    assert scope("pr_beats_mdm", "hard", 4, variant="init") == SUITE  # a strategy row, not the paper's FMLM+
    assert scope("pr_beats_mdm", "uncond", 4) == SUITE
    assert scope("pr_beats_mdm_confidence", "easy", 41) == SUITE  # the suite's stronger baseline
    assert scope("mlfm_guidance", "easy", 18) == SUITE


def test_the_mdms_best_decoder_within_a_budget_counts_the_nfe_spent():
    """An adaptive decoder joins the comparison at the NFE it spent: eb@18 spent 4.9 on average, so at ≤ 4 the best
    is eb@4 (3.9), not eb@18 or the confidence sampler at full NFE."""
    import pandas as pd

    from analysis.sudoku_tables import best_within_nfe

    lines = [
        ("confidence", 4, 4.0, 35.0),
        ("confidence", 18, 18.0, 90.0),
        ("eb", 4, 3.9, 75.0),
        ("threshold", 18, 3.5, 68.0),
        ("eb", 18, 4.9, 83.0),
    ]
    part = pd.DataFrame(
        [
            {"method": "MDM", "variant": "scratch", "sampler": s, "nfe_budget": b, "nfe_mean": spent,
             "accuracy_mean": acc, "accuracy_std": 0.0, "n": 1}
            for s, b, spent, acc in lines
        ]
    )  # fmt: skip
    label, got = best_within_nfe(part, "accuracy", "MDM", 4)
    assert label == "MDM eb@4 (3.9 NFE)" and got.mean == 75.0
    assert best_within_nfe(part, "accuracy", "MDM", 3) is None
    assert best_within_nfe(part, "accuracy", "MDM", 18)[1].mean == 90.0


def test_the_strongest_baseline_is_chosen_on_the_seeds_the_verdict_pairs():
    """FMLM+ has seed 0 only; over the MDM's seeds 0–1 EB is best (95.3 against 95.2), on seed 0 the threshold
    decoder is (95.6 against 94.8): the verdict pairs seed 0, so its strongest baseline is seed 0's best, whose
    interval overlaps PR's (inconclusive), not EB, which would read as PR beating the MDM's best decoder."""
    from analysis.sudoku_tables import headline

    fast = [("eb", 0, 94.8), ("eb", 1, 95.8), ("threshold", 0, 95.6), ("threshold", 1, 94.8)]
    rows = pd.DataFrame(
        [
            row("FMLM+", "scratch", "pr", 4, 0, 96.9, samples=2000),
            *(row("MDM", "scratch", s, 4, seed, acc, samples=2000) for s, seed, acc in fast),
            *(row("MDM", "scratch", "ancestral", 41, seed, 86.0, samples=2000) for seed in (0, 1)),
        ]
    )
    adaptive = rows["sampler"].isin(["eb", "threshold"])
    rows["nfe"] = rows["nfe"].where(~adaptive, 1.7)  # what the adaptive decoders spent under their cap of 4
    for c in ("nfe_budget", "nfe", "seed", "accuracy", "samples", "steps"):
        rows[c] = pd.to_numeric(rows[c], errors="coerce")
    agg = aggregate(rows)
    (line,) = verdicts(agg).query("claim.str.contains('best decoder') and row.str.startswith('headline')").itertuples()
    assert "vs MDM threshold@4" in line.compared
    assert line.verdict.startswith("inconclusive (one paired seed, 0: 96.9 [96.0–97.6] against 95.6 [94.6–96.4]")
    (easy,) = headline(agg)  # each side's seeds named: one FMLM+ seed against the MDM's two
    assert "PR@4 96.9 [96.0–97.6] % (seed 0) vs the paper's row, MDM ancestral@41 86.0 ± 0.0" in easy
    assert "[84.9–87.0] % (seeds 0, 1);" in easy
    assert "MDM threshold@4 (1.7 NFE) 95.2 ± 0.6 [94.5–95.8] % (seeds 0, 1)" in easy


def test_a_line_lacking_the_compared_seeds_does_not_win_on_other_seeds():
    """PR has seed 0; EB was measured on seed 1 only (97), the threshold decoder on both (80 on seed 0): the
    strongest baseline on the seeds a verdict pairs is the threshold decoder, not EB's seed 1."""
    from analysis.sudoku_tables import best_within_nfe

    rows = pd.DataFrame(
        [row("MDM", "scratch", "threshold", 4, 0, 80.0), row("MDM", "scratch", "threshold", 4, 1, 90.0),
         row("MDM", "scratch", "eb", 4, 1, 97.0)]
    )  # fmt: skip
    for c in ("nfe_budget", "nfe", "seed", "accuracy", "steps"):
        rows[c] = pd.to_numeric(rows[c], errors="coerce")
    label, got = best_within_nfe(aggregate(rows), "accuracy", "MDM", 4, seeds=[0])
    assert label.startswith("MDM threshold@4") and got.seeds() == {0: 80.0, 1: 90.0}
    assert best_within_nfe(aggregate(rows), "accuracy", "MDM", 4)[0].startswith("MDM eb@4")  # no seeds: the best mean


def test_seeds_on_either_side_of_a_removed_option_aggregate_together(tmp_path):
    """Seed 0's MDM rows were written while the samplers still recorded `draws: committed` (an option since removed,
    flowlm/removed.py); seed 1's do not name it. The same sampler: one cell, mean ± std over both seeds."""
    old = '{"draws": "committed", "score": "max_prob", "temperature": 0.0}'
    new = '{"score": "max_prob", "temperature": 0.0}'
    write_rows(
        tmp_path / "a" / "mdm_seed0.csv", [row("MDM", "scratch", "confidence", 18, 0, 90.0, sampler_settings=old)]
    )
    write_rows(
        tmp_path / "b" / "mdm_seed1.csv", [row("MDM", "scratch", "confidence", 18, 1, 86.0, sampler_settings=new)]
    )
    other = '{"draws": "full", "score": "max_prob", "temperature": 0.0}'  # not the kept value: another sampler
    write_rows(
        tmp_path / "c" / "mdm_seed2.csv", [row("MDM", "scratch", "confidence", 18, 2, 10.0, sampler_settings=other)]
    )
    cells = aggregate(read_results(tmp_path))
    assert sorted(cells["n"].tolist()) == [1, 2]
    both = cells[cells["n"] == 2].iloc[0]
    assert both["accuracy_mean"] == 88.0 and both["sampler_settings"] == new


def test_seeds_on_either_side_of_an_added_option_aggregate_together(tmp_path):
    """Seed 0's EB rows were written before the adaptive samplers had the block cache; seed 1's name its options at
    the values that decode as before (`block_length: null, cache: "none", refresh: null`). One sampler: one cell; a
    cache in use is another sampler. And those values are the samplers' defaults."""
    import inspect

    from analysis.sudoku_tables import ADDED_SAMPLER_OPTIONS
    from flowlm.samplers.mdm_adaptive import AdaptiveMDMSampler

    defaults = inspect.signature(AdaptiveMDMSampler.__init__).parameters
    assert {k: defaults[k].default for k in ADDED_SAMPLER_OPTIONS} == ADDED_SAMPLER_OPTIONS
    old = '{"gamma": 0.1, "score": "entropy", "temperature": 0.0}'
    new = (
        '{"block_length": null, "cache": "none", "gamma": 0.1, "refresh": null, "score": "entropy", "temperature": 0.0}'
    )
    cached = new.replace('"cache": "none"', '"cache": "dual"').replace('"block_length": null', '"block_length": 6')
    for seed, (settings, accuracy) in enumerate([(old, 75.0), (new, 63.0), (cached, 10.0)]):
        write_rows(
            tmp_path / f"s{seed}" / f"mdm_seed{seed}_eval.csv",
            [row("MDM", "scratch", "eb", 4, seed, accuracy, sampler_settings=settings)],
        )
    cells = aggregate(read_results(tmp_path))
    assert sorted(cells["n"].tolist()) == [1, 2]
    both = cells[cells["n"] == 2].iloc[0]
    assert both["accuracy_mean"] == 69.0 and both["sampler_settings"] == old


def test_within_a_budget_means_on_every_seed(tmp_path):
    """A threshold line whose three seeds spent 3.5, 4.6 and 2.6 NFE on average (mean 3.6) is not within 4 NFE: one
    seed used more calls than PR's 4. The EB line, within 4 on every seed, is the MDM's best at ≤ 4."""
    from analysis.sudoku_tables import best_within_nfe

    spent = {"threshold": [(3.5, 80.0), (4.6, 90.0), (2.6, 85.0)], "eb": [(3.9, 75.0), (3.9, 63.0), (3.4, 89.0)]}
    for sampler, seeds in spent.items():
        for seed, (nfe, accuracy) in enumerate(seeds):
            line = row("MDM", "scratch", sampler, 18, seed, accuracy)
            line["nfe"] = nfe
            write_rows(tmp_path / f"{sampler}{seed}" / f"mdm_seed{seed}_eval.csv", [line])
    cells = aggregate(read_results(tmp_path))
    label, got = best_within_nfe(cells, "accuracy", "MDM", 4)
    assert label.startswith("MDM eb@18 (3.7 NFE)") and round(got.mean, 1) == 75.7


def test_the_threshold_samplers_drawn_token_rule_merges_with_earlier_rows_at_temperature_0_only(tmp_path):
    """Rows written before the threshold sampler's ``confidence`` option read max p; at T = 0 the drawn token is the
    argmax, so a row naming confidence=sampled is the same sampler; at T = 1 it is another rule (issue 48)."""
    from analysis.sudoku_tables import ADDED_GREEDY_OPTIONS
    from flowlm.samplers import ThresholdSampler

    assert ThresholdSampler().confidence == ADDED_GREEDY_OPTIONS["confidence"]
    for temperature, cells in [(0.0, [2]), (1.0, [1, 1])]:
        old = json.dumps({"score": "max_prob", "temperature": temperature, "threshold": 0.9})
        new = json.dumps({"confidence": "sampled", "score": "max_prob", "temperature": temperature, "threshold": 0.9})
        folder = tmp_path / str(temperature)
        for seed, settings in enumerate([old, new]):
            write_rows(
                folder / f"s{seed}" / f"mdm_seed{seed}_eval.csv",
                [row("MDM", "scratch", "threshold", 4, seed, 50.0 + seed, sampler_settings=settings)],
            )
        assert sorted(aggregate(read_results(folder))["n"].tolist()) == cells, temperature


def test_a_line_whose_budget_forced_commits_is_named_capped(tmp_path):
    """issue 48: the threshold rule at 4 NFE on 20 cells commits ≥ 5 a call whatever τ says: its line is
    'threshold, capped' where the rows' forced_share is positive, 'threshold' where it is 0."""
    from analysis.sudoku_tables import best_within_nfe

    for share, name in [(0.35, "MDM threshold, capped@4 (3.5 NFE)"), (0.0, "MDM threshold@4 (3.5 NFE)")]:
        folder = tmp_path / str(share)
        line = row("MDM", "scratch", "threshold", 4, 0, 60.0, forced_share=share)
        write_rows(folder / "mdm_seed0_eval.csv", [{**line, "nfe": 3.5}])
        label, _ = best_within_nfe(aggregate(read_results(folder)), "accuracy", "MDM", 4)
        assert label == name


def test_a_later_evaluation_at_another_seed_does_not_stand_in_for_the_models_own_draws(results):
    """`flowlm-eval seed=7` of the seed-0 model adds rows that name their evaluation seed: the tables keep the model's
    own draws (eval_seed blank, as in older CSVs, or the seed); another seed's rows count only where there are none."""
    other = row("FMLM+", "init", "pr", 4, 0, 1.0, date="2026-12-31T10:00:00Z", eval_seed=7)
    only = row("FMLM+", "init", "pr", 16, 0, 2.0, date="2026-12-31T10:00:00Z", eval_seed=7)
    own = row("FMLM+", "init", "pr", 4, 1, 96.5, date="2026-12-30T10:00:00Z", eval_seed=1)
    write_rows(results / "eval" / "FMLM+_init_seed0_eval.csv", [other, only, own])
    rows = read_results(results)
    pr = rows[(rows["variant"] == "init") & (rows["sampler"] == "pr")]
    at4 = pr[pr["nfe_budget"] == 4].set_index("seed")["accuracy"]
    assert at4.to_dict() == {0: 95.0, 1: 96.5, 2: 97.0}  # seed 0's own row kept; seed 1's newer own row taken
    assert pr[pr["nfe_budget"] == 16]["accuracy"].tolist() == [2.0]  # no own row: the other seed's


def test_percentages_read_as_their_exact_counts_and_print_half_up(tmp_path):
    """A float32 quotient in a row (1 939 of 2 000 written 96.94999694824219) reads as the count's 96.95 and prints
    97.0, as the count rounds by hand (0.15 → 0.2, where float formatting gives 0.1); a value that is no count of the
    row's recorded samples, or a row without them, stays as written."""
    folder = tmp_path / "results"
    float32 = {"pr": 96.94999694824219, "uncond": 0.15000000596046448}
    write_rows(
        folder / "a.csv",
        [
            row("FMLM+", "scratch", "pr", 4, 0, float32["pr"], samples=2000),
            row("FMLM+", "scratch", "pr", 4, 1, float32["pr"]),  # no samples recorded: no count to read
            row("MDM", "scratch", "confidence", 4, 0, 50.01, samples=2000),  # 1 000.2 of 2 000: no count
            row(
                "MDM",
                "scratch",
                "confidence",
                36,
                0,
                float32["uncond"],
                difficulty="uncond",
                samples=2000,
                train_copy_pct=float32["uncond"],
            ),
        ],  # fmt: skip
    )
    rows = read_results(folder).set_index(["sampler", "seed", "nfe_budget"])
    assert rows.loc[("pr", 0, 4), "accuracy"] == 96.95 and rows.loc[("pr", 1, 4), "accuracy"] == float32["pr"]
    assert rows.loc[("confidence", 0, 4), "accuracy"] == 50.01
    assert rows.loc[("confidence", 0, 36), "valid_pct"] == 0.15 == rows.loc[("confidence", 0, 36), "train_copy_pct"]
    agg = aggregate(read_results(folder).query("seed == 0"))
    assert cell(agg, "accuracy", sampler="pr", nfe_budget=4).format() == "97.0 [96.1–97.6]"
    assert cell(agg, "valid_pct", sampler="confidence", nfe_budget=36).format().startswith("0.2 [")
    assert [rounded(v) for v in (96.95, 0.15, 0.25, 97.04, float("nan"))] == ["97.0", "0.2", "0.3", "97.0", "nan"]
