"""benchmarks/gpu_tables.sh's plan, read with ``--plan`` (which prints the phases and runs nothing): every model that
starts from scratch (MDMs, then FMLM+ from scratch) in phase 1, the runs built from an MDM in phase 2, ``--models``
choosing some of them; a model whose source is neither chosen nor finished, or an unknown name, is refused in one
line before anything else (the wheels' install, the CUDA check)."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

from flowlm.project import PROJECT_DIR

ROOT = Path(PROJECT_DIR)
MDMS = ["sudoku_mdm_easy", "sudoku_mdm_medium", "sudoku_mdm_hard", "sudoku_mdm_uncond"]
SCRATCH = [f"sudoku_fmlm_plus_scratch_{t}" for t in ("easy", "medium", "hard", "uncond")]


def _plan(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    out = tmp_path / "out"
    return subprocess.run(
        ["bash", "benchmarks/gpu_tables.sh", "--plan", "--out", str(out), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _phases(done: subprocess.CompletedProcess) -> tuple[list[str], list[str], str]:
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    one = lines[0].removeprefix("phase 1, from scratch:").split()
    two = lines[1].removeprefix("phase 2, from an MDM:").split()
    return one, two, lines[2]


def test_every_model_from_scratch_trains_in_phase_one_the_runs_built_on_an_mdm_in_phase_two(tmp_path):
    one, two, rest = _phases(_plan(tmp_path))
    assert one == MDMS + SCRATCH
    assert len(two) == 11 and {
        "sudoku_fmlm_plus_init_easy",
        "sudoku_mlfm_hard",
        "sudoku_fmlm_plus_distill_uncond",
    } <= set(two)
    assert "sudoku_mlfm_uncond" not in two  # no unconditional MLFM in the tables
    assert rest.startswith("seeds: 0 1 2;")
    assert not (tmp_path / "out").exists()  # --plan makes nothing


def test_models_choose_some_in_the_plans_order(tmp_path):
    one, two, rest = _phases(
        _plan(tmp_path, "--seeds", "0 1 2 3 4", "--models", "sudoku_fmlm_plus_scratch_easy sudoku_mdm_easy")
    )
    assert (one, two) == (["sudoku_mdm_easy", "sudoku_fmlm_plus_scratch_easy"], ["none"])
    assert rest.startswith("seeds: 0 1 2 3 4;")
    one, two, _ = _phases(_plan(tmp_path, "--models", "sudoku_mlfm_easy sudoku_mdm_easy"))
    assert (one, two) == (["sudoku_mdm_easy"], ["sudoku_mlfm_easy"])


def test_a_run_whose_mdm_is_neither_chosen_nor_finished_is_refused_in_one_line(tmp_path):
    refused = _plan(tmp_path, "--seeds", "0 1", "--models", "sudoku_fmlm_plus_init_easy")
    assert refused.returncode == 2 and refused.stdout == "" and refused.stderr.count("\n") == 1
    assert "sudoku_fmlm_plus_init_easy starts from sudoku_mdm_easy" in refused.stderr and "(seed 0)" in refused.stderr
    done = tmp_path / "out" / "done"
    done.mkdir(parents=True)
    (done / "sudoku_mdm_easy_seed0").touch()  # finished for seed 0 only
    refused = _plan(tmp_path, "--seeds", "0 1", "--models", "sudoku_fmlm_plus_init_easy")
    assert refused.returncode == 2 and "(seed 1)" in refused.stderr
    (done / "sudoku_mdm_easy_seed1").touch()
    one, two, _ = _phases(_plan(tmp_path, "--seeds", "0 1", "--models", "sudoku_fmlm_plus_init_easy"))
    assert (one, two) == (["none"], ["sudoku_fmlm_plus_init_easy"])


def test_an_archive_that_cannot_be_written_is_refused_before_the_runs(tmp_path):
    refused = _plan(tmp_path, "--archive", str(tmp_path / "missing" / "out.tgz"))
    assert refused.returncode == 2 and refused.stdout == "" and refused.stderr.count("\n") == 1
    assert "--archive" in refused.stderr and "cannot be written" in refused.stderr


def test_an_unknown_model_is_refused_before_the_wheels_are_installed(tmp_path):
    refused = _plan(tmp_path, "--models", "sudoku_mdm_easy sudoku_mdm_tiny", "--wheels", str(tmp_path / "none"))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert refused.stderr.startswith("gpu_tables: --models: sudoku_mdm_tiny is not one of the tables' models")
    assert "wheels" not in refused.stderr


def test_a_run_at_its_time_limit_skips_every_model_and_an_empty_phase_runs_nothing(tmp_path):
    """The whole script on the CPU (``--dry-run``) with no time left: the tracking server starts (its ``mlflow``
    found beside ``$PYTHON``), phase 1 skips its one model, phase 2 has none to run (xargs would otherwise run one
    job without arguments), and the resume line names the models."""
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW", None)
    done = subprocess.run(
        ["bash", "benchmarks/gpu_tables.sh", "--dry-run", "--models", "sudoku_mdm_easy", "--budget-s", "0"]
        + ["--out", str(tmp_path / "t"), "--archive", str(tmp_path / "t.tgz")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if not line.startswith("[")]
    assert lines[0].startswith("== phase 1: the models from scratch")
    assert lines[1:3] == [
        "skipped (time limit): sudoku_mdm_easy seed 0",
        "== phase 2: the runs built from an MDM: none",
    ]
    assert lines[-2].endswith('--models "sudoku_mdm_easy"') and "1 model(s) not finished" in lines[-2]
    assert lines[-1].startswith(f"== archive: {tmp_path / 't.tgz'}")
    with tarfile.open(tmp_path / "t.tgz") as archive:
        names = set(archive.getnames())
    assert {"results", "logs", "done", "logs/mlflow_server.log"} <= names and not any(
        n.startswith("runs") for n in names
    )
    assert not (tmp_path / "t_dry_run" / "runs" / "sudoku_mdm_easy").exists()  # nothing trained
