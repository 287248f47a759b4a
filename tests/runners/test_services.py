"""What runs on a cluster leans on, exercised with real processes on loopback: an MLflow tracking server that
several workers log to (scripts/mlflow_server.sh), an Optuna study on SQLite shared by two sweep workers, and a
SLURM-style requeue (submitit's preemption signal, through Hydra's submitit launcher) that resumes the same trial
folder and the same MLflow run."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import lightning as L
import mlflow
import optuna
import pytest
import torch
from mlflow.tracking import MlflowClient

from flowlm.project import PROJECT_DIR
from tests.conftest import compose_config
from tests.process_helpers import wait_for_flag

BIN = Path(sys.executable).parent
SERVER_SCRIPT = PROJECT_DIR / "scripts" / "mlflow_server.sh"
# A tiny run: 6×6 unconditional Sudoku, tiny DiT, 2 optimizer steps, one evaluation batch.
TINY = [
    "data.num_train=64",
    "data.num_val=16",
    "data.batch_size=16",
    "data.gen_workers=1",
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.log_every_n_steps=1",
    "eval.max_batches=1",
    "trainer.enable_progress_bar=false",
]


def _env(root: Path, **extra: str) -> dict[str, str]:
    """A worker's environment: one thread (others share the CPU), runs and data under ``root``, no inherited
    tracking server unless given."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLOWLM_RUNS": str(root / "runs"), "FLOWLM_DATA": str(root / "data")}
    env.pop("MLFLOW_TRACKING_URI", None)
    # `tests.*` importable in the job processes (the requeue test injects a callback from this module).
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_DIR), env.get("PYTHONPATH")]))
    return {**env, **extra}


def _finish(procs: list[subprocess.Popen], timeout: float = 300) -> list[str]:
    """Wait for every process (killing any still running after ``timeout`` s); fail with the output tail of any
    that did not exit cleanly."""
    outs = []
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        outs.append(out)
    for proc, out in zip(procs, outs, strict=True):
        assert proc.returncode == 0, f"{' '.join(map(str, proc.args[:4]))} ... exited {proc.returncode}:\n{out[-4000:]}"
    return outs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`scripts/mlflow_server.sh` on a free loopback port (SQLite store, served artifacts); yields its URL and
    its folder (store and artifact root). Stopped, with its worker processes, at the end of the module."""
    root = tmp_path_factory.mktemp("server")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}  # the script's defaults, no others
    env.update(
        FLOWLM_RUNS=str(root / "runs"), MLFLOW_HOST="127.0.0.1", MLFLOW_PORT=str(port), MLFLOW=str(BIN / "mlflow")
    )
    log = root / "server.log"
    with open(log, "w") as out:
        # Its own process group: the server forks a uvicorn worker, and both must go at the end.
        proc = subprocess.Popen(
            ["bash", str(SERVER_SCRIPT)], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"the tracking server exited:\n{log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"no /health answer in 120 s:\n{log.read_text()[-3000:]}"
            time.sleep(0.5)
        yield url, root / "runs" / "mlflow_server"
    finally:
        _stop_group(proc)


def _stop_group(proc: subprocess.Popen, sig: signal.Signals = signal.SIGTERM) -> None:
    """End ``proc`` and the processes it started (it leads its own process group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.slow
def test_tracking_server_receives_runs_from_two_processes(mlflow_server, tmp_path):
    url, server_dir = mlflow_server
    common = [str(BIN / "flowlm-train"), "experiment=sudoku_mdm_uncond", "scale=cpu", *TINY, "eval.nfe=[2]"]
    procs = [
        # The two documented ways to point a worker at the server: the environment, or the override.
        subprocess.Popen(
            [*common, "logger=mlflow_server", "run_name=worker0", "seed=0"],
            env=_env(tmp_path, MLFLOW_TRACKING_URI=url),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ),
        subprocess.Popen(
            [*common, "logger=mlflow_server", f"logger.tracking_uri={url}", "run_name=worker1", "seed=1"],
            env=_env(tmp_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ),
    ]
    _finish(procs)

    client = MlflowClient(url)
    experiment = client.get_experiment_by_name("sudoku_uncond_6x6")
    assert experiment is not None and experiment.artifact_location.startswith("mlflow-artifacts:")
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    assert sorted(runs) == ["sudoku_mdm_uncond/worker0", "sudoku_mdm_uncond/worker1"]
    for i, run in enumerate(runs[f"sudoku_mdm_uncond/worker{i}"] for i in range(2)):
        assert run.info.status == "FINISHED"
        assert run.data.params["seed"] == str(i)
        assert "train/loss" in run.data.metrics and run.data.metrics["eval/confidence/nfe2/nfe"] <= 2
        run_dir = tmp_path / "runs" / "sudoku_mdm_uncond" / f"worker{i}"
        assert (run_dir / "mlflow_run_id").read_text().strip() == run.info.run_id
        listed = {f.path for f in client.list_artifacts(run.info.run_id)}
        assert {"config", "eval"} <= listed
        # Uploaded through the server into its artifact root, not written by the worker into its own runs folder.
        stored = server_dir / "artifacts" / experiment.experiment_id / run.info.run_id / "artifacts"
        assert (stored / "config" / "resolved.yaml").is_file() and (stored / "eval" / "final_table.md").is_file()
        table = Path(client.download_artifacts(run.info.run_id, "eval/final_table.md", str(tmp_path)))
        assert "| sudoku_mdm_uncond | confidence |" in table.read_text()
    assert not (tmp_path / "runs" / "mlflow.db").exists() and not (tmp_path / "runs" / "mlartifacts").exists()


@pytest.mark.slow
def test_optuna_study_on_sqlite_is_shared_by_two_sweep_workers(mlflow_server, tmp_path):
    url, _ = mlflow_server
    storage = f"sqlite:///{tmp_path / 'runs' / 'optuna.db'}"
    study_name = "shared"
    (tmp_path / "runs").mkdir()
    # Both workers start on a fresh SQLite file: SweepCallback creates its schema under a file lock (without it,
    # one of two workers crashed on the schema race in 4 of 5 tries); the study itself is created by whichever
    # worker comes first and loaded by the other.
    n_trials = 3
    worker = [
        str(BIN / "flowlm-train"),
        "-m",
        "hparams_search=train_optuna",
        "experiment=sudoku_fmlm_plus_scratch_uncond",
        "scale=cpu",
        *TINY,
        "optimized_metric=eval/pr/nfe8/valid_pct",  # unconditional: validity
        f"sweep.name={study_name}",
        f"hydra.sweeper.n_trials={n_trials}",
        "logger=mlflow_server",
        f"logger.tracking_uri={url}",
    ]
    procs = [
        subprocess.Popen(
            [*worker, f"hydra.sweeper.sampler.seed={seed}"],  # workers of one study need different sampler seeds
            env=_env(tmp_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for seed in (1, 2)
    ]
    _finish(procs)

    study = optuna.load_study(study_name=study_name, storage=storage)
    trials = study.get_trials(deepcopy=False)
    assert len(trials) == 2 * n_trials, [(t.number, t.state) for t in trials]
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials), [(t.number, t.state) for t in trials]
    assert sorted(t.number for t in trials) == list(range(2 * n_trials))  # distinct numbers, none lost
    assert len({t.params["method.optim.lr"] for t in trials}) == 2 * n_trials  # no trial sampled twice

    # Every Optuna trial trained in its own trial folder and has one finished MLflow run with its objective.
    client = MlflowClient(url)
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()], f"tags.`flowlm.study` = '{study_name}'"
    )
    assert len(runs) == 2 * n_trials
    by_lr = {r.data.params["trial/method.optim.lr"]: r for r in runs}
    for trial in trials:
        run = by_lr[str(trial.params["method.optim.lr"])]
        assert run.info.status == "FINISHED"
        assert run.data.metrics["sweep/objective_0"] == trial.value
    trial_dirs = {Path(r.data.tags["flowlm.run_dir"]) for r in runs}
    assert len(trial_dirs) == 2 * n_trials
    assert all(
        d.parent == tmp_path / "runs" / "sweeps" / study_name and d.name.startswith("trial-") for d in trial_dirs
    )


class PauseOnFirstAttempt(L.Callback):
    """Fault injection for the requeue test: a run that did not resume from a checkpoint stops at ``step`` (after
    its checkpoint at an earlier step is on disk), touches ``flag`` and waits for the preemption signal."""

    def __init__(self, step: int, flag: str, seconds: float = 120.0) -> None:
        self.step, self.flag, self.seconds = step, Path(flag), seconds

    def on_train_batch_end(self, trainer: L.Trainer, *args, **kwargs) -> None:  # noqa: D102
        if trainer.ckpt_path is None and trainer.global_step == self.step:
            self.flag.touch()
            time.sleep(self.seconds)  # the signal handler raises SystemExit from here


@pytest.mark.slow
def test_a_preempted_and_requeued_trial_resumes_its_folder_and_mlflow_run(tmp_path):
    import psutil

    flag = tmp_path / "paused"
    cmd = [
        str(BIN / "flowlm-train"),
        "-m",
        # submitit's local executor handles the preemption signal as on SLURM: the job is checkpointed (Hydra's
        # launcher resubmits the same trial) and requeued.
        "hydra/launcher=submitit_local",
        "hydra.launcher.timeout_min=60",  # far from the time limit: the signal means preemption
        "experiment=sudoku_mdm_uncond",
        "scale=cpu",
        *TINY,
        "eval.nfe=[2]",
        "trainer.max_steps=8",
        "trainer.val_check_interval=4",  # a checkpoint at step 4; the first attempt is stopped at step 6
        "+callbacks.pause._target_=tests.runners.test_services.PauseOnFirstAttempt",
        "+callbacks.pause.step=6",
        f"+callbacks.pause.flag={flag}",
        "sweep.name=requeue",
    ]
    proc = subprocess.Popen(
        cmd, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        wait_for_flag(proc, flag, timeout_s=240, poll_s=0.2, never="the first attempt never reached step 6")
        (trial_dir,) = (tmp_path / "runs" / "sweeps" / "requeue").glob("trial-*")
        assert torch.load(trial_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 4
        jobs = []
        for child in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):  # a short-lived child may be gone already
                if "submitit.core._submit" in child.cmdline():
                    jobs.append(child)
        assert len(jobs) == 1, jobs
        jobs[0].send_signal(signal.SIGUSR2)  # what SLURM sends (--signal=USR2@<signal_delay_s>) before it stops a job
    except BaseException:
        _stop_group(proc, signal.SIGKILL)  # the sweep, submitit's controller and the job
        raise
    _finish([proc])

    (job_dir,) = (tmp_path / "runs" / "sweeps" / "requeue" / ".submitit").glob("[0-9]*")
    job_out = "".join(p.read_text() for p in sorted(job_dir.glob("*_log.out")))
    job_err = "".join(p.read_text() for p in sorted(job_dir.glob("*_log.err")))
    assert "this job is preempted" in job_out and "Requeued job" in job_out, job_out[-3000:]
    assert f"Restoring states from the checkpoint path at {trial_dir / 'checkpoints' / 'last.ckpt'}" in job_err
    assert job_out.count("valid_pct by NFE budget") == 1  # the first attempt never finished
    assert torch.load(trial_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 8

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    runs = mlflow.search_runs(search_all_experiments=True, filter_string="tags.`flowlm.sweep` = 'requeue'")
    assert len(runs) == 1, runs[["run_id", "status"]]  # the requeued attempt continued the first one's run
    run = runs.iloc[0]
    assert run["status"] == "FINISHED" and run["run_id"] == (trial_dir / "mlflow_run_id").read_text().strip()
    assert Path(run["tags.flowlm.run_dir"]) == trial_dir
    steps = [m.step for m in MlflowClient().get_metric_history(run["run_id"], "train/loss")]
    # The steps after the checkpoint at step 4 ran twice (before the signal, and again after the resume): at most
    # the steps since the last checkpoint are lost, and the run reaches max_steps (logged steps are 0-based).
    assert max(steps) == 7 and sorted(set(steps)) == list(range(8)) and len(steps) > len(set(steps)), steps


def test_slurm_requeue_is_left_on_for_lightning_and_submitit(monkeypatch, tmp_path):
    """Lightning's SLURM environment keeps auto-requeue (our trainer configs add no cluster plugin) and the SLURM
    launcher asks SLURM for a warning signal and for requeues."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from lightning.fabric.plugins.environments import SLURMEnvironment
    from omegaconf import OmegaConf

    from flowlm.project import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=["experiment=sudoku_mdm_medium", "launcher=slurm"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher.max_num_timeout >= 1 and launcher.signal_delay_s >= 60
    assert launcher.additional_parameters.requeue is True  # sbatch --requeue: preempted jobs go back to the queue
    slurm = {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "7", "SLURM_PROCID": "0"}
    for key, value in {**slurm, "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("FLOWLM_RUNS", str(tmp_path))
    for trainer_cfg in sorted(p.stem for p in Path(CONF_DIR, "trainer").glob("*.yaml")):
        cfg = compose_config(overrides=[f"trainer={trainer_cfg}"])
        assert "auto_requeue" not in OmegaConf.to_yaml(cfg.trainer), trainer_cfg  # no SLURMEnvironment plugin
    for trainer_cfg in ("cpu", "ddp"):
        cfg = compose_config(overrides=[f"trainer={trainer_cfg}", "trainer.accelerator=cpu", "trainer.devices=1"])
        trainer = instantiate(cfg.trainer, logger=False, enable_checkpointing=False)
        env = trainer._accelerator_connector.cluster_environment
        assert isinstance(env, SLURMEnvironment) and env.auto_requeue, (trainer_cfg, env)
