"""One trial of a sweep: its own run folder, its objective, and failures recorded as such (the multirun around the
trials: sweeps/multirun.py).

A multirun (``flowlm-train -m``, ``flowlm-eval -m``) calls the console script's task once per trial; ``run_trial``
wraps that call. ``join_sweep`` records in ``cfg.sweep`` the facts a trial's MLflow tags and params hold (built in
runners/mlflow_run.py, documented in docs/sweeps.md, read by ``analysis/``); a failed trial's run is FAILED with
``flowlm.error``, and metrics ``sweep/objective_<i>`` hold its objective values.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import Callable, Sequence
from enum import Enum
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from flowlm.experiment_kind import mark_model_training
from runners.common import RUN_SWITCHES, check_switches, release_run_dir
from runners.console import quiet_library_notices
from runners.mlflow_run import ERROR_TAG, MAX_VALUE, end_with_error, run_tags, trial_params
from runners.objectives import ObjectiveError, objective_keys, objective_values, parse_key

log = logging.getLogger(__name__)


def run_trial(task: Callable[[DictConfig], dict], cfg: DictConfig) -> float | list[float] | None:
    """Run ``task`` (train or evaluate) on ``cfg``; in a multirun, as one trial of the sweep.

    Returns the objective(s) named by ``optimized_metric`` (one float, or a list for several), which the Optuna
    sweeper optimises; None without one. With ``sweep.continue_on_error`` a failing trial is marked FAILED in
    MLflow and returns None, which hydra-optuna-sweeper records as a failed trial; either sweeper goes on, and the
    multirun exits with status 1 at its end (``SweepCallback``).
    A wrong ``optimized_metric`` is the sweep's mistake, not the trial's: it stops the sweep. Each trial notes its
    outcome (objective values, or its error) for the multirun's summary line (``SweepCallback``).
    """
    quiet_library_notices()  # again here: a trial may run in a process of its own (joblib, submitit)
    check_switches(cfg, RUN_SWITCHES)  # before any compute; a sweep's `continue_on_error=maybe` is the sweep's mistake
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
    _note_success(cfg, values)
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


# The folder where the trials of the running multirun note their outcomes (set by SweepCallback; inherited by
# trials in joblib workers and submitit jobs, which run in other processes than the sweep's): a failed trial's
# error in ``<trial_id>``, a finished trial's number and objective values in ``<trial_id>.done`` (JSON).
NOTES_ENV = "FLOWLM_SWEEP_NOTES"
DONE_SUFFIX = ".done"


def _note(name: str, text: str) -> None:
    folder = os.environ.get(NOTES_ENV)
    if folder:
        Path(folder, name).write_text(text)


def _note_failure(cfg: DictConfig, err: BaseException) -> None:
    _note(str(cfg.sweep.trial_id), f"{type(err).__name__}: {err}"[:MAX_VALUE])


def _note_success(cfg: DictConfig, values: Sequence[float]) -> None:
    _note(f"{cfg.sweep.trial_id}{DONE_SUFFIX}", json.dumps({"trial": int(cfg.sweep.trial), "values": list(values)}))
