"""Reliability of a training run: non-finite losses, corrupt or interrupted checkpoints, tracking outages, resumes
from another working directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import mlflow
import pytest
import torch

from callbacks.finite_loss import NonFiniteLossError
from lightning_modules.mdm import MDMModule
from runners.common import RunExistsError
from runners.tracking import ResilientMLFlowLogger, TrackingUnavailable
from runners.train import train
from tests.conftest import FAST, compose_config

RUN = ["experiment=sudoku_mdm_uncond", "scale=cpu", *FAST, "eval.nfe=[2]"]


def _ckpt(result_or_dir) -> Path:
    run_dir = result_or_dir["run_dir"] if isinstance(result_or_dir, dict) else result_or_dir
    return Path(run_dir, "checkpoints", "last.ckpt")


def test_non_finite_loss_stops_before_the_update_and_keeps_the_last_checkpoint(runs_env, monkeypatch):
    first = train(compose_config(overrides=[*RUN, "logger=none"]))  # 2 steps, checkpoint at step 2
    saved = torch.load(_ckpt(first), weights_only=False)
    real = MDMModule.loss

    def poisoned(self, batch, draws, **kwargs):
        out = real(self, batch, draws, **kwargs)
        return replace(out, loss=out.loss * float("nan")) if self.global_step >= 3 else out

    monkeypatch.setattr(MDMModule, "loss", poisoned)
    with pytest.raises(NonFiniteLossError, match="non-finite training loss at step 3.*not applied"):
        train(compose_config(overrides=[*RUN, "logger=none", "trainer.max_steps=6", "trainer.val_check_interval=2"]))
    kept = torch.load(_ckpt(first), weights_only=False)
    assert kept["global_step"] == saved["global_step"] == 2
    # Step 3 was never applied: the checkpoint on disk is the one from before the poisoned step.
    for key, value in saved["state_dict"].items():
        assert torch.equal(kept["state_dict"][key], value), key


def test_non_finite_loss_can_skip_the_step_by_config(runs_env, monkeypatch):
    real = MDMModule.loss
    seen = {}

    def poisoned(self, batch, draws, **kwargs):
        out = real(self, batch, draws, **kwargs)
        if self.global_step in (2, 3):  # the 3rd and 4th steps
            seen[self.global_step] = {k: v.detach().clone() for k, v in self.state_dict().items()}
            return replace(out, loss=out.loss * float("nan"))
        if self.global_step == 4:
            seen[4] = {k: v.detach().clone() for k, v in self.state_dict().items()}
        return out

    monkeypatch.setattr(MDMModule, "loss", poisoned)
    skip = [*RUN, "logger=none", "trainer.max_steps=6", "callbacks.finite_loss.action=skip"]
    with pytest.warns(UserWarning, match="step skipped"):
        result = train(compose_config(overrides=skip))
    assert result["global_step"] == 6
    for key, value in seen[2].items():  # neither poisoned step changed a weight
        assert torch.equal(seen[3][key], value) and torch.equal(seen[4][key], value), key
    ckpt = torch.load(_ckpt(result), weights_only=False)
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values())
    assert ckpt["callbacks"]["FiniteLossGuard"] == {"consecutive": 0, "skipped": 2}

    seen.clear()
    with pytest.raises(NonFiniteLossError, match="at step 3 after 1 skipped steps in a row"):
        train(compose_config(overrides=[*skip, "run_name=strict", "callbacks.finite_loss.max_consecutive_skips=1"]))


def test_truncated_last_checkpoint_is_refused_with_a_clear_error(runs_env):
    result = train(compose_config(overrides=[*RUN, "logger=none"]))
    last = _ckpt(result)
    data = last.read_bytes()
    last.write_bytes(data[: len(data) // 2])
    with pytest.raises(RunExistsError, match="cannot resume .* not a readable PyTorch checkpoint.*periodic checkpoint"):
        train(compose_config(overrides=[*RUN, "logger=none", "trainer.max_steps=4"]))
    assert last.stat().st_size == len(data) // 2  # nothing written


def test_a_crash_while_saving_leaves_the_previous_checkpoint_intact(runs_env, monkeypatch):
    result = train(compose_config(overrides=[*RUN, "logger=none"]))
    before = _ckpt(result).read_bytes()
    from tests.lightning_modules.test_atomic_checkpoints import inject_write_fault

    # A context of its own: monkeypatch.undo() would also drop runs_env's FLOWLM_RUNS / FLOWLM_DATA, and the
    # relaunch below would train runs/ and data_cache/ in the checkout.
    with monkeypatch.context() as patch:
        # The disk fills after a third of the new checkpoint (whichever code writes into checkpoints/).
        inject_write_fault(patch.setattr, _ckpt(result).parent, nth=1, after_bytes=len(before) // 3, action="enospc")
        with pytest.raises(OSError, match="No space left on device.*the previous last.ckpt .* is intact"):
            train(compose_config(overrides=[*RUN, "logger=none", "trainer.max_steps=4"]))
    assert _ckpt(result).read_bytes() == before  # written beside it, fsynced, then renamed over it
    assert train(compose_config(overrides=[*RUN, "logger=none", "trainer.max_steps=4"]))["global_step"] == 4


def test_unreachable_tracking_server_is_reported_before_compute(runs_env):
    cfg = compose_config(overrides=[*RUN, "logger.tracking_uri=http://127.0.0.1:9"])
    with pytest.raises(TrackingUnavailable, match="127.0.0.1:9.*not reachable.*logger=none"):
        train(cfg)
    assert not list((runs_env / "runs").glob("**/*.ckpt"))


# A process that opens a new SQLite store and is SIGKILLed half-way through MLflow's schema migrations (as a
# Ctrl-\\ or an out-of-memory kill of a first launch would): one migration's table made, the version not recorded.
KILLED_MIDWAY = """
import os, signal, sys
import mlflow.store.db.utils as db_utils

def half_upgrade(engine):
    with engine.begin() as connection:
        connection.exec_driver_sql("CREATE TABLE scorers (id INTEGER)")
    os.kill(os.getpid(), signal.SIGKILL)

db_utils._upgrade_db = half_upgrade
from {module} import {cls}
{cls}({args})
"""


def _killed_while_creating(store: Path, module: str, cls: str, args: str) -> None:
    code = KILLED_MIDWAY.format(module=module, cls=cls, args=args.format(uri=f"sqlite:///{store}"))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == -9, done.stderr[-2000:]


def test_a_launch_killed_while_creating_the_store_leaves_no_half_made_store(runs_env):
    store = runs_env / "runs" / "mlflow.db"
    _killed_while_creating(
        store, "runners.tracking", "ResilientMLFlowLogger", "experiment_name='x', tracking_uri='{uri}'"
    )
    # was: a store with half its schema, which every later launch failed to open ("table scorers already exists")
    assert not store.exists()
    assert list(store.parent.glob(".mlflow.db.init-*"))  # the killed process's temporary store
    (store.parent / f"{next(store.parent.glob('.mlflow.db.init-*')).name}-journal").write_bytes(b"x")  # SQLite's
    assert train(compose_config(overrides=[*RUN, "trainer.max_steps=1", "trainer.val_check_interval=1"]))["rows"]
    assert not list(store.parent.glob(".mlflow.db.init-*"))  # removed by the next launch: its process is gone
    (run,) = mlflow.MlflowClient(f"sqlite:///{store}").search_runs(["1"])
    assert run.info.status == "FINISHED"


def test_a_half_made_store_is_refused_before_compute_saying_what_to_do(runs_env):
    store = runs_env / "runs" / "mlflow.db"
    store.parent.mkdir(parents=True)
    _killed_while_creating(store, "mlflow", "MlflowClient", "'{uri}'")  # MLflow's own creation, not atomic
    assert store.exists()
    with pytest.raises(TrackingUnavailable, match=rf"store {store} cannot be opened .*holds 0 run\(s\).*move it away"):
        train(compose_config(overrides=RUN))  # was: OperationalError('... table scorers already exists')
    assert not list((runs_env / "runs").glob("**/*.ckpt"))


def test_tracking_outage_mid_run_does_not_end_training(runs_env, monkeypatch):
    from mlflow.tracking import MlflowClient

    real = MlflowClient.log_batch
    calls = {"n": 0}

    def flaky(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 2:  # the server goes away after the first parameters
            raise mlflow.exceptions.MlflowException("connection refused (simulated outage)")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", flaky)
    with pytest.warns(RuntimeWarning, match="training goes on") as caught:
        result = train(compose_config(overrides=[*RUN, "trainer.max_steps=4", "trainer.val_check_interval=2"]))
    assert result["global_step"] == 4 and result["rows"] and _ckpt(result).exists()
    # At the end, what tracking lost is summed up, naming the run and its store.
    summary = [str(w.message) for w in caught if "is incomplete" in str(w.message)]
    assert len(summary) == 1 and result["mlflow_run_id"] in summary[0] and "mlflow.db" in summary[0]
    assert re.search(r"\d+ tracking call\(s\) failed \(log_batch ×\d+\)", summary[0])


def test_a_resume_whose_store_lost_the_run_goes_on_in_a_new_mlflow_run(runs_env):
    first = train(compose_config(overrides=RUN))
    # The run's store replaced (a deleted mlflow.db is recreated empty by the next process): it has no such run.
    other = f"sqlite:///{runs_env / 'other' / 'mlflow.db'}"
    (runs_env / "other").mkdir()
    with pytest.warns(RuntimeWarning, match=f"has no run {first['mlflow_run_id']}.*new MLflow run") as caught:
        second = train(compose_config(overrides=[*RUN, "trainer.max_steps=4", f"logger.tracking_uri={other}"]))
    assert second["global_step"] == 4 and second["mlflow_run_id"] != first["mlflow_run_id"]
    assert f"write {first['mlflow_run_id']} back into mlflow_run_id" in str(caught[0].message)
    run = mlflow.MlflowClient(other).get_run(second["mlflow_run_id"])
    assert run.data.tags["flowlm.previous_mlflow_run_id"] == first["mlflow_run_id"]
    assert run.data.metrics["train/loss"] > 0 and run.info.status == "FINISHED"
    # The run folder now names the new run: the next relaunch resumes it without a warning.
    assert Path(first["run_dir"], "mlflow_run_id").read_text() == second["mlflow_run_id"]


def test_a_store_deleted_mid_run_is_reported_at_the_end(runs_env, monkeypatch):
    db = runs_env / "runs" / "mlflow.db"
    real = MDMModule.loss

    def deleting(self, batch, draws, **kwargs):
        if self.global_step == 2 and db.exists():
            db.unlink()  # SQLite writes on into the deleted file: no tracking call fails
        return real(self, batch, draws, **kwargs)

    monkeypatch.setattr(MDMModule, "loss", deleting)
    # Evaluated at step 3, then a final validation at step 4: Lightning finalizes the logger twice.
    with pytest.warns(RuntimeWarning, match=f"store file {db} was deleted or replaced") as caught:
        result = train(compose_config(overrides=[*RUN, "trainer.max_steps=4", "trainer.val_check_interval=3"]))
    assert result["global_step"] == 4 and not db.exists()
    assert len([w for w in caught if "is incomplete" in str(w.message)]) == 1


def test_resume_from_another_data_folder_keeps_the_first_params(runs_env, tmp_path):
    first = train(compose_config(overrides=[*RUN, f"paths.data_dir={tmp_path / 'a'}"]))
    second = train(compose_config(overrides=[*RUN, f"paths.data_dir={tmp_path / 'b'}", "trainer.max_steps=4"]))
    assert second["mlflow_run_id"] == first["mlflow_run_id"] and second["global_step"] == 4
    run = mlflow.MlflowClient(f"sqlite:///{runs_env / 'runs' / 'mlflow.db'}").get_run(first["mlflow_run_id"])
    assert run.data.params["data/cache_dir"].startswith(str(tmp_path / "a"))
    assert "data/cache_dir" in run.data.tags["flowlm.resume_changed_params"]


def test_sharded_checkpoint_folders_are_switched_atomically(tmp_path):
    """last.ckpt names a complete folder at every moment: a new one is written beside it, then the link is replaced;
    leftovers (the previous folder, an unlinked newer one, a pre-link real folder) are cleaned after the switch."""
    from callbacks.checkpoint import switch_link

    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    link = ckpts / "last.ckpt"
    link.mkdir()  # a sharded folder written before the link scheme
    (link / "meta.pt").write_text("old")
    for step in (4, 8):
        version = ckpts / f"last.ckpt.step{step:07d}"
        version.mkdir()
        (version / "meta.pt").write_text(str(step))
        (ckpts / "last.ckpt.step0000099").mkdir(exist_ok=True)  # a crash left a newer folder unlinked
        switch_link(link, version)
        assert link.is_symlink() and (link / "meta.pt").read_text() == str(step)
        assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt", version.name]


def test_a_dangling_last_checkpoint_link_is_refused(runs_env):
    result = train(compose_config(overrides=[*RUN, "logger=none"]))
    last = _ckpt(result)
    last.unlink()
    last.symlink_to("last.ckpt.step0000002")  # its folder is gone
    with pytest.raises(RunExistsError, match="which is gone"):
        train(compose_config(overrides=[*RUN, "logger=none"]))


@pytest.mark.parametrize("user_uri", [None, "sqlite:////elsewhere/mlflow.db"])
def test_a_run_leaves_the_process_tracking_uri_as_it_was(tmp_path, monkeypatch, user_uri):
    """Lightning's first MLflow call exports its store as $MLFLOW_TRACKING_URI (mlflow.set_tracking_uri), which
    conf/logger/mlflow.yaml reads first: the next job of a multirun in the same process tracked into this run's
    store (a deleted temporary one: "attempt to write a readonly database")."""
    if user_uri is None:
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    else:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", user_uri)
    for name in ("first", "second"):
        logger = ResilientMLFlowLogger(experiment_name="x", tracking_uri=f"sqlite:///{tmp_path / name}.db")
        logger.check_reachable()  # what every run does first
        assert os.environ.get("MLFLOW_TRACKING_URI") == user_uri
        assert logger.experiment.get_experiment_by_name("x") is not None
        assert os.environ.get("MLFLOW_TRACKING_URI") == user_uri
