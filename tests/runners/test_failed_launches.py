"""A launch that fails leaves nothing in the way of its corrected relaunch: bad input is refused before anything is
written, a run that never saved a checkpoint does not block other settings, a checkpoint folder that cannot take a
checkpoint is found before training, and every failed run ends FAILED in MLflow with its error."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from conftest import FAST, SHORT, compose_config
from mlflow import MlflowClient
from omegaconf import OmegaConf

from callbacks.checkpoint import CheckpointSaveError
from lightning_modules.mdm import MDMModule
from runners.common import RUN_CONFIG
from runners.evaluate import evaluate
from runners.train import train
from runners.trial import NOTES_ENV, _note_failure
from sweeps.multirun import SweepCallback

RUN = ["experiment=sudoku_mdm_uncond", "scale=cpu", *FAST]
TEXT = [
    "experiment=tinystories_mdm",
    "scale=cpu",
    *SHORT,
    "eval.nfe=[4]",
    "data.batch_size=4",
    "data.seq_len=64",
    "logger=none",
]


def _runs(root: Path) -> list:
    """Every MLflow run of the test's store, oldest first."""
    client = MlflowClient(f"sqlite:///{root / 'runs' / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return sorted(runs, key=lambda r: r.info.start_time)


def test_a_missing_data_file_writes_nothing_and_the_fixed_command_runs(runs_env):
    with pytest.raises(FileNotFoundError, match="nothing matches /nonexistent.jsonl"):
        train(compose_config(overrides=[*TEXT, "data.files=/nonexistent.jsonl"]))
    assert not (runs_env / "runs").exists()  # was: run_config.yaml with data.files, refusing the fixed command
    result = train(compose_config(overrides=[*TEXT, "data.files=data/cpu/tinystories_sample.jsonl"]))
    assert result["global_step"] == 2


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("trainer.max_steps=abc", r"trainer.max_steps = 'abc' does not fit Trainer's max_steps: int"),
        ("trainer.precision=bf17", r"trainer.precision = 'bf17' does not fit Trainer's precision: Union\[Literal"),
        ("trainer.max_steps=2.5", r"trainer.max_steps = 2.5 does not fit Trainer's max_steps: int"),
    ],
)
def test_bad_trainer_arguments_are_refused_before_anything_is_written(override, match, runs_env):
    with pytest.raises(TypeError, match=match):  # was: a run folder and an MLflow run left RUNNING
        train(compose_config(overrides=[*RUN, override]))
    assert not (runs_env / "runs").exists()


def test_if_exists_is_checked_on_a_new_folder_too(runs_env):
    with pytest.raises(ValueError, match=r"if_exists must be one of \('resume', 'error'\), got 'overwrite'"):
        train(compose_config(overrides=[*RUN, "if_exists=overwrite"]))  # was: accepted while the folder is new
    assert not (runs_env / "runs").exists()


def _fail_first_step(patch) -> None:
    def boom(self, *args, **kwargs):
        raise RuntimeError("boom at the first step")

    patch.setattr(MDMModule, "loss", boom)


def test_a_run_that_failed_before_its_first_checkpoint_does_not_block_other_settings(runs_env, monkeypatch):
    with monkeypatch.context() as patch:
        _fail_first_step(patch)
        with pytest.raises(RuntimeError, match="boom"):
            train(compose_config(overrides=RUN))
    run_dir = runs_env / "runs" / "sudoku_mdm_uncond" / "cpu" / "seed0"
    assert (run_dir / RUN_CONFIG).exists() and not (run_dir / "checkpoints" / "last.ckpt").exists()
    (failed,) = _runs(runs_env)
    assert failed.info.status == "FAILED"
    assert failed.data.tags["flowlm.error"] == "RuntimeError: boom at the first step"

    result = train(compose_config(overrides=[*RUN, "backbone.n_layers=1"]))  # was: RunExistsError, backbone.n_layers
    assert result["global_step"] == 2
    assert OmegaConf.load(run_dir / RUN_CONFIG).backbone.n_layers == 1
    first, second = _runs(runs_env)
    assert first.info.run_id == failed.info.run_id and first.info.status == "FAILED"  # kept as the record
    assert second.info.run_id == result["mlflow_run_id"] and second.info.status == "FINISHED"
    assert (run_dir / "mlflow_run_id").read_text() == result["mlflow_run_id"]


def test_a_run_killed_before_its_first_checkpoint_is_ended_when_other_settings_replace_it(runs_env, monkeypatch):
    with monkeypatch.context() as patch:
        _fail_first_step(patch)
        with pytest.raises(RuntimeError, match="boom"):
            train(compose_config(overrides=RUN))
    (killed,) = _runs(runs_env)
    client = MlflowClient(f"sqlite:///{runs_env / 'runs' / 'mlflow.db'}")
    client.update_run(killed.info.run_id, status="RUNNING")  # what a SIGKILL leaves: nothing ended the run
    result = train(compose_config(overrides=[*RUN, "backbone.n_layers=1"]))
    old, new = _runs(runs_env)
    assert old.info.run_id == killed.info.run_id and old.info.status == "KILLED"  # was: RUNNING for ever
    assert (
        old.data.tags["flowlm.error"]
        == f"killed before its first checkpoint; superseded by MLflow run {new.info.run_id}"
    )
    assert new.info.run_id == result["mlflow_run_id"] and new.info.status == "FINISHED"
    assert not (Path(result["run_dir"]) / "mlflow_run_id.superseded").exists()


def test_the_same_settings_continue_the_failed_mlflow_run_and_clear_its_error(runs_env, monkeypatch):
    with monkeypatch.context() as patch:
        _fail_first_step(patch)
        with pytest.raises(RuntimeError, match="boom"):
            train(compose_config(overrides=RUN))
    result = train(compose_config(overrides=RUN))
    (run,) = _runs(runs_env)
    assert run.info.run_id == result["mlflow_run_id"] and run.info.status == "FINISHED"
    assert "flowlm.error" not in run.data.tags


def test_a_run_failing_after_training_is_failed_in_mlflow_with_its_error(runs_env, monkeypatch):
    def broken_table(rows, value):
        raise KeyError("no such column")

    monkeypatch.setattr("runners.train.pivot_table", broken_table)
    with pytest.raises(KeyError):
        train(compose_config(overrides=RUN))
    (run,) = _runs(runs_env)
    assert run.info.status == "FAILED"  # was FINISHED: Lightning marks the run when fit ends, not the launch
    assert run.data.tags["flowlm.error"] == "KeyError: 'no such column'"

    monkeypatch.setattr("runners.evaluate.pivot_table", broken_table)  # an evaluation's MLflow run likewise
    ckpt = runs_env / "runs" / "sudoku_mdm_uncond" / "cpu" / "seed0" / "checkpoints" / "last.ckpt"
    with pytest.raises(KeyError):
        evaluate(compose_config("eval", overrides=[f"ckpt_path={ckpt}", "eval.nfe=[2]", "eval.max_batches=1"]))
    _, evaluation = _runs(runs_env)
    assert evaluation.info.status == "FAILED" and evaluation.data.tags["flowlm.error"] == "KeyError: 'no such column'"


def test_an_interrupted_run_is_killed_in_mlflow_saying_so(runs_env, monkeypatch):
    import signal

    def interrupt(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(MDMModule, "loss", interrupt)
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit):  # Lightning's graceful shutdown: SystemExit(1) while handling the Ctrl-C
            train(compose_config(overrides=RUN))
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores further Ctrl-Cs from then on
    (run,) = _runs(runs_env)
    assert run.info.status == "KILLED"
    assert run.data.tags["flowlm.error"].startswith(
        "KeyboardInterrupt: interrupted (Ctrl-C or SIGINT)"
    )  # was: SystemExit: 1


# ------------------------------------------------------------------ checkpoint folders


@pytest.fixture
def small_mount(tmp_path):
    """Mount a tmpfs with the given options on a new folder under tmp_path (root and mount(8) only)."""
    mounted = []

    def mount(options: str) -> Path:
        if os.geteuid() != 0 or shutil.which("mount") is None:
            pytest.skip("mounting a tmpfs needs root and mount(8)")
        folder = tmp_path / f"mount{len(mounted)}"
        folder.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        if subprocess.run(["umount", str(folder)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def _read_only_folder(tmp_path: Path, small_mount) -> Path:
    if os.geteuid() == 0:  # root writes through permissions: a read-only filesystem
        return small_mount("ro,size=1m")
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
    return folder


def test_a_read_only_checkpoint_folder_is_refused_before_training(runs_env, small_mount, monkeypatch):
    folder = _read_only_folder(runs_env, small_mount)
    monkeypatch.setattr(MDMModule, "training_step", lambda *a, **k: pytest.fail("trained before the check"))
    with pytest.raises(CheckpointSaveError, match=f"cannot write checkpoints to {folder}/ckpts: {folder} is not a"):
        train(compose_config(overrides=[*RUN, f"callbacks.checkpoint.dirpath={folder}/ckpts"]))
    assert not (runs_env / "runs").exists()  # nothing written: no run folder, no MLflow run


def test_a_full_checkpoint_folder_is_refused_before_training(runs_env, small_mount, monkeypatch):
    folder = small_mount("size=4m")  # the tiny model's checkpoint takes ≈ 20 MB
    monkeypatch.setattr(MDMModule, "training_step", lambda *a, **k: pytest.fail("trained before the check"))
    with pytest.raises(CheckpointSaveError, match=r"its filesystem has 4\.0 MiB free, less than one checkpoint"):
        train(compose_config(overrides=[*RUN, f"callbacks.checkpoint.dirpath={folder}"]))
    assert not (runs_env / "runs").exists()


# ------------------------------------------------------------------ sweeps


def _sweep_config(root: Path):
    return OmegaConf.create({"paths": {"root": str(root)}, "sweep": {"name": "s"}, "hydra": {"sweep": {"dir": root}}})


def test_a_sweep_with_a_failed_trial_exits_non_zero_after_all_trials(tmp_path, monkeypatch):
    monkeypatch.setenv(NOTES_ENV, "")  # restored after the test, whatever happens in it
    callback = SweepCallback()
    callback.on_multirun_start(_sweep_config(tmp_path))
    _note_failure(OmegaConf.create({"sweep": {"trial_id": "trial-abc"}}), ValueError("bad threshold"))
    with pytest.raises(SystemExit, match=r"sweep s: 1 trial\(s\) failed.*\n  trial-abc: ValueError: bad threshold"):
        callback.on_multirun_end(_sweep_config(tmp_path))
    assert not list(tmp_path.glob(".trials-*"))  # its notes are removed

    callback.on_multirun_start(_sweep_config(tmp_path))  # a relaunch: the earlier launch's failures are not its own
    callback.on_multirun_end(_sweep_config(tmp_path))
