"""One trial of a sweep: its own run folder, its objective, and failures recorded as such.

A multirun (``flowlm-train -m``, ``flowlm-eval -m``) calls the console script's task once per trial; ``run_trial``
wraps that call. ``join_sweep`` records in ``cfg.sweep`` the facts a trial's MLflow tags and params hold (built in
runners/mlflow_run.py, documented in docs/sweeps.md, read by ``analysis/``); a failed trial's run is FAILED with
``flowlm.error``, and metrics ``sweep/objective_<i>`` hold its objective values.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Sequence
from enum import Enum
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from flowlm.tasks.sudoku import SudokuSpec, clues_for
from runners.common import release_run_dir
from runners.experiment_kind import mark_model_training
from runners.mlflow_run import ERROR_TAG, MAX_VALUE, end_with_error, run_tags, trial_params
from sweeps.objectives import ObjectiveError, objective_keys, objective_values, parse_key

log = logging.getLogger(__name__)


def short_hash(text: object) -> str:
    """First 10 hex digits of the SHA-1 of ``str(text)``: a stable, filesystem-safe name for a config value."""
    return hashlib.sha1(str(text).encode()).hexdigest()[:10]


def sudoku_table_nfe(conditional: bool, box_rows: int, box_cols: int, difficulty: str | None) -> list[int]:
    """The NFE budgets of the papers' Sudoku tables (docs/results.md): conditional 4 (PR's R = 4, N = 1) and the
    number of empty cells (full); unconditional 1, 3, 9, 27 and n² (the paper's 1 / 3 / 9 / 27 / 81 on 9×9)."""
    spec = SudokuSpec(int(box_rows), int(box_cols))
    cells = spec.n**2
    if not conditional:
        return sorted({*(b for b in (1, 3, 9, 27) if b < cells), cells})
    return sorted({4, cells - clues_for(spec, str(difficulty))})


# `${flowlm.hash:...}` in configs: trial folders (conf/hydra/default.yaml), one sweep name per checkpoint.
OmegaConf.register_new_resolver("flowlm.hash", short_hash, replace=True)
# `${flowlm.sudoku_table_nfe:...}`: the budgets of hparams_search=sudoku_tables, from the task's data config.
OmegaConf.register_new_resolver(
    "flowlm.sudoku_table_nfe", lambda *args: OmegaConf.create(sudoku_table_nfe(*args)), replace=True
)  # a ListConfig: OmegaConf.resolve writes the value back into the config


def run_trial(task: Callable[[DictConfig], dict], cfg: DictConfig) -> float | list[float] | None:
    """Run ``task`` (train or evaluate) on ``cfg``; in a multirun, as one trial of the sweep.

    Returns the objective(s) named by ``optimized_metric`` (one float, or a list for several), which the Optuna
    sweeper optimises; None without one. With ``sweep.continue_on_error`` a failing trial is marked FAILED in
    MLflow and returns None, which hydra-optuna-sweeper records as a failed trial; either sweeper goes on, and the
    multirun exits with status 1 at its end (``SweepCallback``).
    A wrong ``optimized_metric`` is the sweep's mistake, not the trial's: it stops the sweep.
    """
    hydra_cfg = HydraConfig.get() if HydraConfig.initialized() else None
    if hydra_cfg is None or hydra_cfg.mode != RunMode.MULTIRUN:
        try:
            return _returned(objective_values(cfg.get("optimized_metric"), task(cfg)["rows"]))
        finally:
            _release(cfg)
    check_directions(cfg.get("optimized_metric"), hydra_cfg.sweeper)
    join_sweep(cfg, hydra_cfg)
    try:
        result = task(cfg)
        values = objective_values(cfg.get("optimized_metric"), result["rows"])
    except ObjectiveError:
        raise
    except Exception as err:
        if not cfg.sweep.continue_on_error:
            raise
        log.exception("trial %s (%s) failed; recorded as failed, the sweep goes on", cfg.sweep.trial, cfg.run_name)
        record_failure(cfg, err)
        _note_failure(cfg, err)
        return None
    finally:
        _release(cfg)
    record_success(cfg, result.get("mlflow_run_id"), values)
    return _returned(values)


def _release(cfg: DictConfig) -> None:
    """Drop the run folder's lock once the task is over: a launcher process that runs trial after trial (basic,
    joblib workers) then holds none of the finished ones."""
    try:
        run_dir = OmegaConf.select(cfg, "paths.run_dir", default=None)
    except Exception:  # an unresolvable folder was never locked; the task's own error is the one to see
        return
    if run_dir is not None:
        release_run_dir(run_dir)


def _returned(values: list[float]) -> float | list[float] | None:
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def check_directions(spec: str | Sequence[str] | None, sweeper: DictConfig) -> None:
    """Refuse an Optuna sweep whose ``optimized_metric`` does not give one key per direction."""
    keys = objective_keys(spec)
    for key in keys:
        parse_key(key)
    if "direction" not in sweeper:  # the basic sweeper optimises nothing: an objective is only logged
        return
    direction = sweeper.direction
    directions = [direction] if isinstance(direction, str | Enum) else list(direction)
    names = [d.name if isinstance(d, Enum) else str(d) for d in directions]
    if len(keys) != len(names):
        raise ObjectiveError(
            f"the Optuna sweeper optimises {len(names)} objective(s) {names} but optimized_metric names "
            f"{len(keys)}: {keys}; give one eval/<sampler>/nfe<budget>/<metric> key per direction"
        )


def join_sweep(cfg: DictConfig, hydra_cfg: DictConfig) -> None:
    """Make ``cfg`` one trial of the running sweep: its run folder, its run name and the facts its tags hold."""
    out = Path(hydra_cfg.runtime.output_dir)
    sweeper = hydra_cfg.sweeper
    with open_dict(cfg):
        if cfg.sweep.get("run_dirs", "trial") == "experiment":
            # A sweep over experiments × seeds (hparams_search=sudoku_tables): each trial keeps its experiment's
            # own folder ${paths.root}/<name>/<scale>/seed<seed>, where the runs built on it (init_from, teacher)
            # find its checkpoint and a relaunch resumes it; one trial per (experiment, seed): no two share a folder.
            run_dir = Path(cfg.paths.run_dir)
            cfg.paths.run_dir = str(run_dir)
            cfg.sweep.trial_id = "-".join(run_dir.relative_to(cfg.paths.root).parts)  # <name>-<scale>-seed<seed>
        else:
            # The trial's run folder is Hydra's job folder, <sweep dir>/trial-<hash of the trial's overrides>
            # (conf/hydra/default.yaml): trials that differ in any parameter never share a folder, a checkpoint or
            # an MLflow run, and the same overrides again (a re-queued trial, another worker) resume the same run.
            cfg.paths.run_dir = str(out)
            cfg.run_name = f"{cfg.sweep.name}/{out.name}"
            cfg.sweep.trial_id = out.name
        cfg.sweep.trial = int(hydra_cfg.job.num)
        cfg.sweep.dir = str(Path(hydra_cfg.sweep.dir).resolve())
        cfg.sweep.sweeper = str(sweeper._target_).rsplit(".", 1)[-1]
        cfg.sweep.study = OmegaConf.select(sweeper, "study_name", default=None)
        cfg.sweep.overrides = list(hydra_cfg.overrides.task)
        # Finds this execution's MLflow run after a crash (a resumed run keeps its id, a new one has no other key).
        cfg.sweep.attempt = uuid.uuid4().hex


def _client(cfg: DictConfig):
    """An MLflow client on the run's tracking store, or None when the run is not tracked in MLflow."""
    logger = cfg.get("logger")
    if not logger or not str(logger.get("_target_", "")).endswith("MLFlowLogger"):
        return None
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=logger.tracking_uri)


def record_success(cfg: DictConfig, run_id: str | None, values: Sequence[float]) -> None:
    """Log the trial's objective values as ``sweep/objective_<i>`` on its MLflow run (and clear an old error)."""
    client = _client(cfg)
    if client is None or run_id is None:
        return
    for i, value in enumerate(values):
        client.log_metric(run_id, f"sweep/objective_{i}", value)
    if ERROR_TAG in client.get_run(run_id).data.tags:  # a re-queued trial that failed before has now succeeded
        client.delete_tag(run_id, ERROR_TAG)


def record_failure(cfg: DictConfig, err: BaseException) -> None:
    """Mark the trial's MLflow run FAILED with the error, creating it if the trial failed before it had one."""
    client = _client(cfg)
    if client is None:
        return
    try:
        name = cfg.logger.experiment_name
        experiment = client.get_experiment_by_name(name)
        runs = []
        if experiment is not None:
            runs = client.search_runs([experiment.experiment_id], f"tags.`flowlm.attempt` = '{cfg.sweep.attempt}'")
        if runs:
            run_id = runs[0].info.run_id
        else:
            experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else client.create_experiment(name, artifact_location=cfg.logger.get("artifact_location"))
            )
            mark_model_training(client, experiment_id)
            tags = run_tags(cfg)  # a run made here has no run folder of its own
            run_id = client.create_run(experiment_id, run_name=cfg.logger.run_name, tags=tags).info.run_id
            for key, value in trial_params(cfg).items():
                client.log_param(run_id, key, value)
        end_with_error(client, run_id, err)
    except Exception:  # the sweep must go on even when the tracking store cannot take the record
        log.exception("could not record the failed trial in MLflow")


# The folder where the trials of the running multirun note their failures (set by SweepCallback; inherited by
# trials in joblib workers and submitit jobs, which run in other processes than the sweep's).
FAILURES_ENV = "FLOWLM_SWEEP_FAILURES"


def _note_failure(cfg: DictConfig, err: BaseException) -> None:
    folder = os.environ.get(FAILURES_ENV)
    if folder:
        Path(folder, str(cfg.sweep.trial_id)).write_text(f"{type(err).__name__}: {err}"[:MAX_VALUE])


class SweepCallback(Callback):
    """Hydra callback: a multirun's runs folder, and its SQLite Optuna schema, exist before the sweeper opens it; a
    relaunched Optuna sweep continues its study with new proposals; a multirun in which any trial failed exits
    with status 1 once every trial has run."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:  # noqa: D102
        Path(config.paths.root).mkdir(parents=True, exist_ok=True)
        storage = OmegaConf.select(config, "hydra.sweeper.storage", default=None)
        if isinstance(storage, str) and storage.startswith("sqlite:///"):
            init_sqlite_storage(storage)
        continue_study(config)
        failures = Path(config.hydra.sweep.dir) / f".failed-{uuid.uuid4().hex}"  # this launch's, not a relaunch's
        failures.mkdir(parents=True)
        os.environ[FAILURES_ENV] = str(failures)

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:  # noqa: D102
        folder = os.environ.pop(FAILURES_ENV, None)
        if not folder:
            return
        failed = {p.name: p.read_text() for p in sorted(Path(folder).iterdir())}
        shutil.rmtree(folder, ignore_errors=True)
        if failed:
            lines = "\n".join(f"  {trial}: {error.splitlines()[0] if error else ''}" for trial, error in failed.items())
            raise SystemExit(
                f"sweep {config.sweep.name}: {len(failed)} trial(s) failed (the others ran; a tracked trial is FAILED "
                f"in MLflow with its error in the tag flowlm.error):\n{lines}"
            )


def continue_study(config: DictConfig) -> None:
    """Seed the sampler of a relaunched Optuna sweep from (its seed, the trials its study holds) before the sweeper
    is built: with the first launch's seed it would propose the same points again, whose trials would reuse the
    earlier trials' folders and MLflow runs. A new study keeps the configured seed."""
    storage = OmegaConf.select(config, "hydra.sweeper.storage", default=None)
    study = OmegaConf.select(config, "hydra.sweeper.study_name", default=None)
    seed = OmegaConf.select(config, "hydra.sweeper.sampler.seed", default=None)
    if not isinstance(storage, str) or study is None or seed is None:
        return
    import numpy as np
    import optuna

    try:
        done = len(optuna.load_study(study_name=study, storage=storage).trials)
    except KeyError:  # no such study yet
        return
    if done:
        config.hydra.sweeper.sampler.seed = int(np.random.SeedSequence([int(seed), done]).generate_state(1)[0])
        log.info(
            "study %s holds %d trials: sampler seed %d, drawn from seed %s",
            study,
            done,
            config.hydra.sweeper.sampler.seed,
            seed,
        )


def init_sqlite_storage(url: str) -> None:
    """Create an Optuna SQLite file's schema under a file lock: workers launched together on a fresh file would
    otherwise race to create its tables and all but one crash (measured: 4 of 5 tries with two workers)."""
    import optuna

    path = Path(url.removeprefix("sqlite:///"))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        optuna.storages.RDBStorage(url)  # creates the tables once; later workers find them
