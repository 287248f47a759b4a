"""scripts/sampler_versions.sh: every measured column of each (sampler, budget) row compared exactly across commits,
a difference or a missing row named with exit 1; bad input refused before any compute. The commits' rows are laid
in beforehand (each commit's `done` marker: the script samples only the commits not yet done)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from flowlm.project import PROJECT_DIR

SCRIPT = Path(PROJECT_DIR) / "scripts" / "sampler_versions.sh"
ROWS = [
    {"sampler": "pr", "nfe_budget": 4, "nfe": 4.0, "accuracy": 96.95, "auroc": 0.96, "samples": 2000},
    {"sampler": "threshold", "nfe_budget": 18, "nfe": 1.6, "accuracy": 95.7, "auroc": 0.95, "samples": 2000},
]


def _commits() -> list[str]:
    got = subprocess.run(["git", "-C", PROJECT_DIR, "rev-parse", "HEAD", "HEAD~1"], capture_output=True, text=True)
    if got.returncode != 0:
        pytest.skip("a checkout with two commits (not a shallow clone)")
    return [sha[:10] for sha in got.stdout.split()]  # the script's names for them


def _lay(out: Path, sha: str, rows: list[dict]) -> None:
    folder = out / f"rows-{sha}" / "sudoku_easy_6x6"
    folder.mkdir(parents=True)
    pd.DataFrame(rows).to_csv(folder / "run_eval.csv", index=False)
    (out / f"rows-{sha}" / "done").write_text(sha + "\n")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "FLOWLM_PYTHON": sys.executable},
        timeout=120,
    )


@pytest.fixture
def ckpt(tmp_path) -> Path:
    path = tmp_path / "model.ckpt"
    path.write_bytes(b"")
    return path


def test_the_same_numbers_in_every_commit_pass(tmp_path, ckpt):
    a, b = _commits()
    for sha in (a, b):
        _lay(tmp_path / "out", sha, ROWS)
    got = _run(str(ckpt), str(tmp_path / "out"), a, b, "--", "eval=sudoku_flow")
    assert got.returncode == 0, got.stderr
    assert "pr@4: the same in all 2: nfe 4, samples 2000, accuracy 96.95, auroc 0.96" in got.stdout
    assert "2 sampler × budget rows over 2 commits: the same numbers" in got.stdout


def test_a_different_value_or_a_missing_row_fails_naming_it(tmp_path, ckpt):
    a, b = _commits()
    _lay(tmp_path / "out", a, ROWS)
    _lay(tmp_path / "out", b, [ROWS[0] | {"accuracy": 96.9}])  # one value off, and threshold@18 not sampled
    got = _run(str(ckpt), str(tmp_path / "out"), a, b, "--", "eval=sudoku_flow")
    assert got.returncode == 1
    assert f"pr@4 accuracy: DIFFERS {a} 96.95, {b} 96.9" in got.stdout
    assert f"threshold@18: no row from {b}" in got.stdout
    assert "2 difference(s)" in got.stdout


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("unknown commit", "no commit not-a-commit"),
        ("one commit", "name at least two commits"),
        ("out inside the work tree", "OUT must lie outside the work tree"),
        ("no overrides", "usage:"),
        ("no checkpoint", "no checkpoint"),
    ],
)
def test_bad_input_is_refused_before_any_compute(tmp_path, ckpt, case, message):
    a, b = _commits()
    out = str(tmp_path / "out")
    args = {
        "unknown commit": [str(ckpt), out, a, "not-a-commit", "--", "x=1"],
        "one commit": [str(ckpt), out, a, "--", "x=1"],
        "out inside the work tree": [str(ckpt), str(Path(PROJECT_DIR) / "versions"), a, b, "--", "x=1"],
        "no overrides": [str(ckpt), out, a, b],
        "no checkpoint": [str(tmp_path / "missing.ckpt"), out, a, b, "--", "x=1"],
    }[case]
    got = _run(*args)
    assert got.returncode == 2 and message in got.stderr, (got.returncode, got.stderr)
    assert not (tmp_path / "out").exists() and not (Path(PROJECT_DIR) / "versions").exists()
