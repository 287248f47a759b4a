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
    conditional_table,
    empty_cells,
    machines_note,
    read_results,
    scope,
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
    assert "50.0 · 100 · 1.0" in second["unconditional"]  # one seed: no "± 0.0" from a second, read-back "seed"


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
    assert init["easy @4"] == "96.0 ± 1.0"


# ---------------------------------------------------------------- bad CSVs are named and skipped
def _bad_csv(kind: str, folder):
    """A bad CSV of the kind ``kind`` under ``folder``, from seed 7's FMLM+ init run (a PR row, then an a-priori row);
    its path and the samplers of its rows that are good."""
    path = folder / "extra" / "FMLM+_init_seed7.csv"
    rows = [row("FMLM+", "init", "pr", 4, 7, 91.0), row("FMLM+", "init", "a_priori", 4, 7, 55.0)]
    if kind == "decimal_comma":
        rows[1]["accuracy"] = "91,8"  # quoted by the writer: one field, not a number
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
    return path, ["pr"] if kind in ("cut_line", "cut_date", "decimal_comma") else []


@pytest.mark.parametrize(
    "kind, reason",
    [
        ("cut_line", rf"skipped 1 of 2 rows: line 3: \d+ fields where the header has {len(COLUMNS)} \(a cut line\?\)"),
        (
            "cut_date",
            r"skipped 1 of 2 rows: line 3: date '2026-12-01T10:00:0' is not %Y-%m-%dT%H:%M:%SZ \(a cut line\?\)",
        ),
        ("decimal_comma", r"skipped 1 of 2 rows: line 3: accuracy '91,8' is not a number \(a decimal comma\?\)"),
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
    write_rows(folder / "a" / "run_seed0.csv", [row("MDM", "scratch", "confidence", 18, 0, 80.0, **cpu)])
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
    table_end = text.index("| measured, 6x6 | MDM | confidence |", conditional)
    assert text.index(note, table_end) < text.index("## Unconditional")  # one line under the conditional table
    assert text.count("Mixed machines") == 3  # conditional, verdicts, calibration; not the one-machine uncond table
    assert note.replace("'", "&#x27;") in report.html.read_text()
    printed = capsys.readouterr().out
    assert f"conditional table: {note}" in printed and "unconditional table:" not in printed
    assert f"Read {folder}: 5 measured rows, seeds [0, 1, 2], from 4 CSV files;" in printed


def test_machines_note_names_either_kind_of_mix():
    rows = pd.DataFrame({"precision": ["32-true", "32-true"], "device": ["cpu: AMD EPYC", "NVIDIA H200"]})
    assert machines_note(rows) == (
        "Mixed machines in this table: precision 32-true (2 rows); device NVIDIA H200 (1 row), cpu: AMD EPYC (1 row)."
    )
    assert machines_note(rows.assign(device="NVIDIA H200")) == ""
    assert machines_note(rows.drop(columns=["precision", "device"])) == ""  # older CSVs only: one (unknown) kind


# ---------------------------------------------------------------- where the paper states each claim
def test_each_verdict_says_whether_the_paper_states_it_there(results, tmp_path):
    uncond = [
        row("FMLM+", "init", sampler, nfe, seed, value + seed, difficulty="uncond", distinct_valid=9, train_copy_pct=0)
        for seed in (0, 1, 2)
        for nfe in (3, 9)
        for sampler, value in (("pr", 60.0), ("a_priori", 10.0))
    ]
    write_rows(results / "uncond" / "FMLM+_init_uncond.csv", uncond)
    table = verdicts(aggregate(read_results(results)))
    prior = table[table["claim"].str.startswith("PR beats the a-priori") & table["compared"].str.contains("init")]
    prior = prior.set_index("task")
    assert prior.loc["easy", "scope"] == SUITE  # the paper's a-priori row (δ₀,₀) is on unconditional Sudoku only
    assert prior.loc["easy", "verdict"] == "reproduces"  # judged all the same, as the suite's own finding
    assert prior.loc["uncond", "scope"].tolist() == [PAPER, PAPER]  # NFE 3 and 9
    assert prior.loc["easy", "stated"].startswith("sudoku_uncond: FMLM+ PR (δ₀,₁) @3/9/27 > FMLM+ a-priori")
    pr_vs_mdm = table[table["claim"].str.startswith("FMLM+ PR at 4 NFE beats the MDM at full NFE")]
    assert set(pr_vs_mdm["scope"]) == {PAPER}
    fast = table[table["claim"].str.contains("best decoder at ≤ 4 mean NFE")]
    assert len(fast) and set(fast["scope"]) == {SUITE}  # the papers compare against the MDM at full NFE only
    assert pr_vs_mdm["stated"].iloc[0].startswith("sudoku_easy, sudoku_medium, sudoku_hard: FMLM+ PR @4 > MDLM @128")
    order = table[table["claim"].str.startswith("MDM-initialised")]
    mlfm = table[table["claim"].str.startswith("MLFM")]
    assert set(order["scope"]) == set(mlfm["scope"]) == {SUITE}  # the papers state both on GSM8K
    assert order["stated"].iloc[0].startswith("gsm8k: FMLM+ init PR @32 > FMLM+ distill PR @32")
    text = build_sudoku_report(results, tmp_path / "report").markdown.read_text()
    assert "Reproduction verdicts: reproduces: 3, " in text
    assert "The suite's own findings: reproduces: 7, " in text  # 4, and PR@4 vs the MDM's best at ≤ 4 NFE ×3
    assert "| PR beats the a-priori loop on the same checkpoint at low NFE (4) | easy |" in text


def test_scope_reads_task_and_nfe():
    assert scope("pr_beats_a_priori", "uncond", 9) == PAPER
    assert scope("pr_beats_a_priori", "uncond", 36) == SUITE  # the paper's 81: PR leads there by 0.8 only
    assert scope("pr_beats_a_priori", "easy", 4) == SUITE
    assert scope("pr_beats_mdm", "hard", 4) == PAPER
    assert scope("pr_beats_mdm", "uncond", 4) == SUITE
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
