"""scripts/tables_campaign.sh's plan: a model whose rows are committed is skipped, unless `redo` asks for it again
(a protocol change: the rows are replaced when it finishes); a finished model is marked done. The training command is
a stand-in that records what it was asked to train."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from flowlm.project import PROJECT_DIR

SCRIPT = Path(PROJECT_DIR) / "scripts" / "tables_campaign.sh"
COMMITTED = "sudoku_mdm_easy:0"  # results/sudoku/sudoku_easy_6x6/sudoku_mdm_easy_seed0.csv is committed


def campaign(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    trained = tmp_path / "trained.txt"
    python = tmp_path / "python"  # the stand-in: records the experiment and seed it was asked to train
    python.write_text(f'#!/bin/bash\necho "$*" | grep -o "experiment=[a-z_]* seed=[0-9]*" >> {trained}\n')
    python.chmod(0o755)
    code = tmp_path / "campaign" / "code"
    if not code.exists():
        code.mkdir(parents=True)
        subprocess.run(["git", "init", "-q", str(code)], check=True)
        subprocess.run(
            ["git", "-C", str(code), "commit", "-q", "--allow-empty", "-m", "x"],
            check=True,
            env={
                **os.environ,
                "GIT_AUTHOR_NAME": "t",
                "GIT_AUTHOR_EMAIL": "t@t",
                "GIT_COMMITTER_NAME": "t",
                "GIT_COMMITTER_EMAIL": "t@t",
            },
        )
    env = {
        **os.environ,
        "FLOWLM_CAMPAIGN": str(tmp_path / "campaign"),
        "FLOWLM_PYTHON": str(python),
        "FLOWLM_CAMPAIGN_PLAN": f"{COMMITTED} sudoku_mdm_easy:7",
    }
    done = subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)
    return done, trained.read_text().splitlines() if trained.exists() else []


def test_committed_rows_are_skipped_unless_redone(tmp_path):
    done, trained = campaign(tmp_path, "run")
    assert done.returncode == 0, done.stderr
    assert trained == ["experiment=sudoku_mdm_easy seed=7"]  # seed 0's rows are committed
    assert "skip sudoku_mdm_easy seed 0" in done.stdout
    assert (tmp_path / "campaign" / "done" / "sudoku_mdm_easy_seed7").exists()

    redo, _ = campaign(tmp_path, "redo", "sudoku_mdm_easy", "0")
    assert redo.returncode == 0, redo.stderr
    again, trained = campaign(tmp_path, "run")
    assert again.returncode == 0, again.stderr
    assert trained[1:] == ["experiment=sudoku_mdm_easy seed=0"]  # seed 7 is done; seed 0 trains again
    assert not (tmp_path / "campaign" / "redo" / "sudoku_mdm_easy_seed0").exists()  # done: no longer asked for

    bad, _ = campaign(tmp_path, "redo", "no_such_experiment", "0")
    assert bad.returncode == 2 and "usage" in bad.stderr
