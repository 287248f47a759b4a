"""Issue 39: a ``data=`` choice of the user wins at every scale (``scale=cpu`` merged its fixture over it: ``data=owt``
trained on the TinyStories fixture with status 0, ``data=tinystories_local data.files.train=...`` failed as "Key
'train' is not in struct"); an MLflow store on a full disk is refused by name before any compute (it was reported as
"not reachable", after run_config.yaml was written)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch.loggers import MLFlowLogger
from mlflow.exceptions import MlflowException
from omegaconf import OmegaConf

from runners.tracking import ResilientMLFlowLogger, TrackingUnavailable
from runners.train import train
from tests.conftest import compose_config
from tests.process_helpers import subprocess_env
from tests.runners.test_bad_input_round3 import RUN

BIN = Path(sys.executable).parent
# Each text task's data from local files (conf/data/<task>_local.yaml), as its README line spells it.
LOCAL = {
    "tinystories": [
        "data=tinystories_local",
        "data.files.train=/mine/train.jsonl",
        "data.files.validation=/mine/v.jsonl",
    ],
    "owt": ["data=owt_local", "data.files=/mine/owt.jsonl"],
    "gsm8k": ["data=gsm8k_local", "data.train_files=/mine/train.jsonl", "data.eval_files=/mine/test.jsonl"],
    "tinygsm": ["data=tinygsm_local", "data.train_files=/mine/train.jsonl", "data.eval_files=/mine/test.jsonl"],
}

CPU_OWNS = ("batch_size", "num_workers", "num_proc")  # the data keys conf/scale/<task>/cpu.yaml sets


# ------------------------------------------------------------------ data= at any scale: the user's choice wins
def _data(overrides: list[str]) -> dict:
    return OmegaConf.to_container(compose_config(overrides=overrides).data, resolve=True)


@pytest.mark.parametrize("task", LOCAL)
def test_a_data_choice_of_the_user_wins_at_the_cpu_scale_which_sets_only_its_sizes(task):
    at_cpu = [f"experiment={task}_mdm", "scale=cpu"]
    mine = _data([*at_cpu, *LOCAL[task]])  # tinystories_local was "Key 'train' is not in struct"; others the fixture
    as_configured = _data(LOCAL[task])  # the same choice on the bare config: no experiment, no scale
    cpu = {key: value for key, value in _data(at_cpu).items() if key in CPU_OWNS}
    assert mine == {**as_configured, **cpu}
    assert mine["batch_size"] < as_configured["batch_size"]  # the CPU batch (16 or 4), not the papers' (512, ...)
    other = "gsm8k" if task in ("tinystories", "owt") else "owt"  # another task's hub data: chosen, so trained on
    assert _data([*at_cpu, f"data={other}"]) == {**_data([f"data={other}"]), **cpu}


@pytest.mark.parametrize("task", LOCAL)
def test_without_a_data_choice_each_scale_trains_on_its_own_data(task):
    assert _data([f"experiment={task}_mdm", "scale=cpu"]) == _data([f"data=tiny_{task}"])  # the shipped fixture
    assert _data([f"experiment={task}_mdm", "scale=paper"]) == _data([f"data={task}"])  # the papers' data


def test_cfg_job_shows_the_data_a_cpu_launch_trains_on(runs_env):
    cmd = [str(BIN / "flowlm-train"), "experiment=tinystories_mdm", "scale=cpu", *LOCAL["tinystories"], "--cfg", "job"]
    done = subprocess.run(cmd, env=subprocess_env(runs_env), cwd=runs_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]  # was 1: "Key 'train' is not in struct"
    job = OmegaConf.create(done.stdout)
    assert OmegaConf.to_container(job.data.files) == {"train": "/mine/train.jsonl", "validation": "/mine/v.jsonl"}
    assert (job.data.name, job.data.tokenizer, job.data.batch_size) == (None, "gpt2", 16)  # yours; the CPU batch
    assert (job.backbone.d_model, job.trainer.max_steps) == (128, 300)  # sizes the CPU scale owns: tiny DiT, steps
    assert not (runs_env / "runs").exists()  # shown, nothing made


# ------------------------------------------------------------------ a full disk under the MLflow store
def test_a_full_disk_under_the_mlflow_store_is_refused_before_anything_is_written(runs_env, monkeypatch):
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=4096))
    with pytest.raises(
        TrackingUnavailable, match=r"the MLflow store sqlite:///.*mlflow\.db is on a full disk: 4096 by"
    ):
        train(compose_config(overrides=RUN))  # the default logger: a SQLite store under the runs folder
    assert not (runs_env / "runs").exists()  # was: run_config.yaml written, then "not reachable"


def test_a_store_that_fails_for_a_full_disk_says_so_not_unreachable(tmp_path, monkeypatch):
    logger = ResilientMLFlowLogger(experiment_name="x", tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")

    def full(self):
        raise MlflowException("(sqlite3.OperationalError) database or disk is full")

    monkeypatch.setattr(MLFlowLogger, "experiment", property(full))
    with pytest.raises(TrackingUnavailable) as refused:
        logger.check_reachable()
    assert "is on a full disk" in str(refused.value) and "database or disk is full" in str(refused.value)
    assert "not reachable" not in str(refused.value)
