"""Console scripts in subprocesses: 2-process CPU DDP (gloo) and the demo, as a user runs them."""

import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest

BIN = Path(sys.executable).parent


def _env(tmp_path):
    env = {**os.environ, "FLOWLM_RUNS": str(tmp_path / "runs"), "FLOWLM_DATA": str(tmp_path / "data")}
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


@pytest.mark.slow
def test_ddp_on_two_cpu_processes(tmp_path):
    cmd = [
        str(BIN / "flowlm-train"),
        "experiment=sudoku_mdm_uncond",
        "scale=cpu",
        "trainer=ddp",
        "trainer.accelerator=cpu",
        "data.num_train=64",
        "data.num_val=16",
        "data.batch_size=16",
        "trainer.max_steps=4",
        "trainer.val_check_interval=4",
        "eval.nfe=[2]",
        "eval.max_batches=1",
        "trainer.enable_progress_bar=false",
    ]
    proc = subprocess.run(cmd, env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| sudoku_mdm_uncond | confidence |" in proc.stdout
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in proc.stderr + proc.stdout
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["sudoku_uncond_6x6"])
    assert len(runs) == 1  # rank 1 does not open a second tracking run
    assert runs.iloc[0]["metrics.eval/confidence/nfe2/nfe"] <= 2
    assert (tmp_path / "runs" / "sudoku_mdm_uncond" / "cpu" / "seed0" / "checkpoints" / "last.ckpt").exists()


@pytest.mark.slow
def test_demo_prints_its_table(tmp_path):
    small = [
        "trainer.max_steps=4",
        "trainer.val_check_interval=4",
        "data.num_train=256",
        "data.num_val=32",
        "eval.max_batches=1",
        "trainer.enable_progress_bar=false",
    ]
    cmd = [str(BIN / "flowlm-demo"), "overrides=[" + ",".join(f"'{o}'" for o in small) + "]"]
    proc = subprocess.run(cmd, env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Demo summary" in proc.stdout
    for line in (
        "| demo_mdm | ancestral |",
        "| demo_mdm | confidence |",
        "| demo_fmlm_plus | pr |",
        "| demo_fmlm_plus | a_priori |",
        "NFE 36",
        "What this shows (valid_pct, best sampler per run): at NFE",
        "Scale: 6×6 unconditional Sudoku, DiT 4 × 128, one seed, demo_mdm 4 steps, not converged",
    ):
        assert line in proc.stdout
