"""Launches refused by name before any compute (issue 39): a ``data=`` choice the scale would replace (it trained on
the scale's fixture instead, with status 0), and an MLflow store on a full disk (reported as "not reachable", after
run_config.yaml was written)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch.loggers import MLFlowLogger
from mlflow.exceptions import MlflowException
from omegaconf import OmegaConf

from flowlm.project import CONF_DIR
from runners.common import check_data_choice
from runners.tracking import ResilientMLFlowLogger, TrackingUnavailable
from runners.train import train
from tests.conftest import compose_config
from tests.process_helpers import subprocess_env
from tests.runners.test_bad_input_round3 import RUN

BIN = Path(sys.executable).parent
TEXT = {
    "tinystories_mdm": "tiny_tinystories",
    "owt_mdm": "tiny_owt",
    "gsm8k_mdm": "tiny_gsm8k",
    "tinygsm_mdm": "tiny_tinygsm",
}


# ------------------------------------------------------------------ data= at a scale that sets the data
@pytest.mark.parametrize(("experiment", "fixture"), TEXT.items())
def test_a_data_choice_the_cpu_scale_would_replace_is_refused_by_name(experiment, fixture):
    for chosen in ("owt", "tinystories_local", "gsm8k"):
        cfg = compose_config(overrides=[f"experiment={experiment}", "scale=cpu", f"data={chosen}"])
        assert cfg.scale.data == fixture  # what the scale trains on whatever data= says (was: silently)
        match = rf"data={chosen} is refused at scale=cpu: this scale trains {experiment} on the shipped data {fixture}"
        with pytest.raises(ValueError, match=match):
            check_data_choice(cfg, [f"experiment={experiment}", "scale=cpu", f"data={chosen}"])
    cfg = compose_config(overrides=[f"experiment={experiment}", "scale=cpu"])
    check_data_choice(cfg, [f"experiment={experiment}", "scale=cpu", "data.batch_size=8"])  # keys of it: fine
    check_data_choice(cfg, [f"experiment={experiment}", "scale=cpu", f"data={fixture}"])  # the scale's own: fine
    paper = compose_config(overrides=[f"experiment={experiment}", "data=owt"])
    check_data_choice(paper, [f"experiment={experiment}", "data=owt"])  # the paper scale keeps a data choice


@pytest.mark.parametrize("task", ["tinystories", "owt", "gsm8k", "tinygsm"])
def test_scale_data_names_the_data_config_the_scale_merges(task):
    scale = OmegaConf.load(Path(CONF_DIR) / "scale" / task / "cpu.yaml")
    assert f"/data/{scale.scale.data}@data" in scale.defaults


def test_flowlm_train_refuses_a_replaced_data_choice_before_any_run_is_made(runs_env):
    cmd = [str(BIN / "flowlm-train"), "experiment=tinystories_mdm", "scale=cpu", "data=owt", "logger=none"]
    done = subprocess.run(cmd, env=subprocess_env(runs_env), cwd=runs_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]  # was 0, trained on the TinyStories fixture
    assert "data=owt is refused at scale=cpu" in done.stderr and "data.files=<path>" in done.stderr, done.stderr
    run_dir = runs_env / "runs" / "tinystories_mdm" / "cpu" / "seed0"  # Hydra's log only: no run was made there
    assert sorted(p.name for p in run_dir.iterdir()) == [".hydra", "train.log"]


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
