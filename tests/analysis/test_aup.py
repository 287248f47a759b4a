"""AUP on hand-computed curves, the report's AUP tables, adaptive samplers on the speed–quality plot at their mean
NFE, and results CSVs from before TPF still read (the committed ones under results/, and old beside new)."""

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis import plots
from analysis.aup import aup, aup_lines, curve
from analysis.sudoku_tables import (
    aggregate,
    aup_table,
    best_within_nfe,
    conditional_table,
    read_results,
    verdicts,
    with_tpf,
)
from analysis.tables import aup_table as report_aup_table
from callbacks.results_csv import COLUMNS, write_rows
from tests.analysis.test_sudoku_tables import row

RESULTS = Path(__file__).resolve().parents[2] / "results" / "sudoku"


def w(y: float, y_max: float) -> float:
    return min(math.exp(-3 * (1 - y / y_max)), 1.0)


def test_aup_on_a_hand_computed_curve():
    # points given out of order; (4, 60) lies more than 5 below y_1 = 80 (the lowest TPF's) and is left out
    got = aup([4.0, 1.0, 2.0], [60.0, 80.0, 78.0])
    assert got == pytest.approx(1 * 80 + 0.5 * (2 - 1) * (78 * w(78, 80) + 80 * w(80, 80)))  # 156.18
    # y_max from the task (another decoder reached 100): every point weighted, the first rectangle not
    got = aup([1.0, 2.0, 3.0], [80.0, 78.0, 76.0], y_max=100.0)
    want = 80 + 0.5 * (78 * w(78, 100) + 80 * w(80, 100)) + 0.5 * (76 * w(76, 100) + 78 * w(78, 100))
    assert got == pytest.approx(want)
    assert aup([2.5], [40.0]) == 100.0  # one point: ρ₁ y₁
    assert aup([1.0, 3.0], [0.0, 0.0]) == 0.0  # y_max = 0: no weight to divide by


@pytest.mark.parametrize(
    ("tpf", "acc", "kwargs", "match"),
    [
        ([1.0, 2.0], [50.0], {}, "as many TPF as accuracy"),
        ([], [], {}, "at least one"),
        ([0.0, 2.0], [50.0, 40.0], {}, "must be > 0"),
        ([1.0, 2.0], [50.0, 140.0], {}, r"percentage in \[0, 100\]"),
        ([1.0, 2.0], [50.0, float("nan")], {}, "finite"),
        ([2.0, 2.0], [50.0, 40.0], {}, "distinct TPF"),
        ([1.0, 2.0], [50.0, 40.0], {"y_max": 45.0}, "below this curve's best"),
    ],
)
def test_aup_refuses_what_is_not_a_curve(tpf, acc, kwargs, match):
    with pytest.raises(ValueError, match=match):
        aup(tpf, acc, **kwargs)


def test_equal_tpf_points_merge_and_lines_share_the_tasks_y_max():
    rho, y = curve(pd.Series([2.0, 1.0, 2.0, np.nan]), pd.Series([70.0, 80.0, 74.0, 90.0]))
    assert rho.tolist() == [1.0, 2.0] and y.tolist() == [80.0, 72.0]
    points = pd.DataFrame(
        {"sampler": ["a", "a", "b", "c"], "tpf": [1.0, 2.0, 1.0, np.nan], "accuracy": [80.0, 78.0, 100.0, 50.0]}
    )
    lines = aup_lines(points, ["sampler"], "accuracy").set_index("sampler")
    assert lines.loc["a", "aup"] == pytest.approx(aup([1.0, 2.0], [80.0, 78.0], y_max=100.0))  # b's 100 is y_max
    assert lines.loc["a", "points"] == 2 and (lines.loc["a", "tpf_min"], lines.loc["a", "tpf_max"]) == (1.0, 2.0)
    assert math.isnan(lines.loc["c", "aup"]) and lines.loc["c", "points"] == 0  # no TPF logged
    with pytest.raises(ValueError, match="not 'gen_ppl'"):
        aup_lines(points.rename(columns={"accuracy": "gen_ppl"}), ["sampler"], "gen_ppl")


def summary_rows() -> pd.DataFrame:
    """A report summary: a fixed-step sampler, an adaptive one (capped at 16, spent 4.9 ± 0.7) and a τ sweep."""
    rows = [
        ("mdm", "confidence", 4, 4.0, 0.0, 9.0, 40.0, ""),
        ("mdm", "confidence", 16, 16.0, 0.0, 2.25, 80.0, ""),
        ("mdm", "eb", 16, 4.9, 0.7, 7.6, 78.0, ""),
        ("mdm (threshold=0.5)", "threshold", 16, 3.0, 0.4, 12.0, 70.0, "tau"),
        ("mdm (threshold=0.9)", "threshold", 16, 5.0, 0.5, 7.2, 79.0, "tau"),
    ]
    frame = pd.DataFrame(rows, columns=["name", "sampler", "nfe_budget", "nfe", "nfe_std", "tpf", "mean", "sweep"])
    return frame.assign(experiment="sudoku", std=0.0, n=1, sec_per_sample=frame["nfe"] * 1e-3)


def test_the_report_aup_table_has_one_line_per_run_and_one_per_sweep():
    table = report_aup_table(summary_rows(), "accuracy").set_index(["run", "sampler"])
    y_max = 80.0
    assert table.loc[("mdm", "confidence"), "AUP"] == f"{aup([2.25, 9.0], [80.0, 40.0], y_max=y_max):.1f}"  # 180.0
    assert table.loc[("mdm", "eb"), "AUP"] == f"{7.6 * 78:.1f}"  # one point: ρ₁ y₁
    pooled = table.loc[("sweep tau (all trials)", "threshold")]
    assert pooled["points"] == 2 and pooled["TPF"] == "7.2–12"
    assert pooled["AUP"] == f"{aup([7.2, 12.0], [79.0, 70.0], y_max=y_max):.1f}"
    no_tpf = report_aup_table(summary_rows().drop(columns=["tpf"]), "accuracy")
    assert set(no_tpf["AUP"]) == {"n/a"}  # runs logged before TPF


def test_an_adaptive_sampler_sits_at_its_mean_nfe_on_the_speed_quality_plot(tmp_path, monkeypatch):
    lines = {(line["name"], line["sampler"]): line for line in plots.curve_points(summary_rows())}
    eb = lines[("mdm", "eb")]
    assert eb["x"].tolist() == [4.9] and eb["xerr"].tolist() == [0.7] and eb["adaptive"]  # not at its cap of 16
    fixed = lines[("mdm", "confidence")]
    assert fixed["x"].tolist() == [4.0, 16.0] and fixed["xerr"].tolist() == [0.0, 0.0] and not fixed["adaptive"]
    assert fixed["seconds"].tolist() == pytest.approx([4e-3, 16e-3])
    old = plots.curve_points(summary_rows().drop(columns=["nfe", "nfe_std"]))[0]  # nothing logged: the budget
    assert old["x"].tolist() == [4.0, 16.0] and not old["adaptive"]
    drawn = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: drawn.append(fig) or path)
    plots.speed_quality(summary_rows(), "accuracy", tmp_path / "a.png", "t")
    plots.speed_quality(summary_rows().drop(columns=["sec_per_sample"]), "accuracy", tmp_path / "b.png", "t")
    timed, untimed = drawn
    assert len(timed.axes) == 2 and len(untimed.axes) == 1  # wall-clock panel only where rows have wall time
    eb_line = next(c for c in timed.axes[0].containers if c.get_label().startswith("mdm · eb"))
    assert eb_line.lines[0].get_xdata().tolist() == [4.9]


def test_the_committed_results_csvs_still_load_and_get_a_tpf():
    """Most CSVs under results/ predate the TPF and NFE-spread columns (later ones have them): read, aggregated, TPF
    from the layout where a row has none."""
    rows = read_results(RESULTS / "superseded")  # the rows of the convergence protocol (issue 47)
    assert len(rows) and ("tpf" not in rows.columns or rows["tpf"].isna().any())
    agg = aggregate(rows)
    fixed = agg[(agg["sampler"] == "confidence") & (agg["difficulty"] == "easy") & (agg["nfe_budget"] == 4)]
    assert fixed["tpf_mean"].tolist() == [18 / 4]  # 6×6 easy: 18 empty cells filled a row, not the 41 positions
    assert agg["tpf_mean"].notna().all()
    assert len(aup_table(agg)) and len(verdicts(agg))


def test_old_and_new_csvs_merge_and_tpf_counts_the_cells_filled(tmp_path):
    """TPF in the tables: the empty cells a row fills over its mean NFE (issue 47), for old and new rows alike; the
    logged ``tpf`` counts clue copies and separators too and averages per row."""
    new = dict(row("MDM", "scratch", "eb", 4, 0, 75.0, tpf=15.0, nfe_std=0.5), nfe=3.5)
    write_rows(tmp_path / "new.csv", [new])
    old_columns = [c for c in COLUMNS if c not in ("tpf", "nfe_std", "nfe_min", "nfe_p50", "nfe_p90", "nfe_max")]
    old = pd.DataFrame([row("MDM", "scratch", "confidence", 4, 0, 35.0)])[old_columns]
    old.to_csv(tmp_path / "old.csv", index=False)
    rows = with_tpf(read_results(tmp_path)).set_index("sampler")
    assert rows.loc["eb", "tpf"] == 18 / 3.5  # not the logged 15.0 (41 positions, a mean of per-row ratios)
    assert rows.loc["confidence", "tpf"] == 18 / 4  # the old file alike


def test_the_mdms_best_decoder_is_judged_by_its_own_line_and_prs_mean_nfe():
    """Two EB settings at one cap: the one that spent ≤ 4 competes with its own accuracy (was: the first line's);
    PR that stopped early at 3.0 NFE meets only decoders at ≤ 3.0."""
    settings = [json.dumps({"gamma": g}, sort_keys=True) for g in (0.1, 1.0)]
    rows = [
        dict(row("MDM", "scratch", "eb", 18, 0, 90.0, sampler_settings=settings[0]), nfe=6.0),
        dict(row("MDM", "scratch", "eb", 18, 0, 70.0, sampler_settings=settings[1]), nfe=3.8),
        dict(row("MDM", "scratch", "threshold", 18, 0, 60.0), nfe=2.9),
        dict(row("FMLM+", "init", "pr", 4, 0, 80.0), nfe=3.0),
    ]
    agg = aggregate(pd.DataFrame(rows).assign(converged=True))
    part = agg[agg["difficulty"] == "easy"]
    label, got = best_within_nfe(part, "accuracy", "MDM", 4)
    assert label == "MDM eb gamma=1.0@18 (3.8 NFE)" and got.mean == 70.0
    table = verdicts(agg)
    fast = table[table["claim"].str.contains("best decoder")].set_index("compared")["verdict"]
    init = "FMLM+ init PR@4 80.0 [74.8–84.5] · NFE 3.0 (seed max 3.0) vs MDM threshold@18 (2.9 NFE) 60.0 [54.1–66.0]"
    assert fast[init + " · NFE 2.9 (seed max 2.9)"].startswith("holds (one paired seed, ")
    scratch = "FMLM+ scratch PR@4 — vs MDM eb gamma=1.0@18 (3.8 NFE) 70.0 [64.0–75.2] · NFE 3.8 (seed max 3.8)"
    assert fast[scratch] == "not measured"  # PR's cap, 4
    cond = conditional_table(agg).set_index(["model", "sampler"])
    assert cond.loc[("FMLM+ init", "pr"), "easy @4"] == "80.0 [74.8–84.5] · NFE 3.0 (seed max 3.0)"  # spent, not 4


def test_rows_of_a_superseded_protocol_are_not_read_into_the_tables(tmp_path):
    write_rows(tmp_path / "easy" / "new.csv", [row("MDM", "scratch", "ancestral", 4, 0, 50.0)])
    write_rows(tmp_path / "superseded" / "easy" / "old.csv", [row("MDM", "scratch", "ancestral", 4, 0, 90.0)])
    assert read_results(tmp_path)["accuracy"].tolist() == [50.0]
    assert read_results(tmp_path / "superseded")["accuracy"].tolist() == [90.0]  # readable on its own
    # an earlier budget's rows (scripts/tables_campaign.sh collect): out of the tables, and out of superseded/'s
    write_rows(tmp_path / "superseded-steps6000" / "easy" / "old.csv", [row("MDM", "scratch", "ancestral", 4, 0, 80.0)])
    assert read_results(tmp_path)["accuracy"].tolist() == [50.0]
    assert read_results(tmp_path / "superseded")["accuracy"].tolist() == [90.0]
    assert read_results(tmp_path / "superseded-steps6000")["accuracy"].tolist() == [80.0]
