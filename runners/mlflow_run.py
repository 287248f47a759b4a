"""A run's record in MLflow, built in one place: the logger a training or evaluation run gets (``make_logger``),
the tags and params the run carries (``run_tags``, ``run_params``; a sweep trial's own in ``trial_tags``,
``trial_params``), and the error it ended with (``record_error``). runners/trial.py records a failed trial from the
same builders.

Tags of every run: ``mlflow.source.git.commit``, ``flowlm.name``, ``flowlm.run_dir`` (a training run), and
``flowlm.error`` on a failed one. A sweep trial adds (documented in docs/sweeps.md, read by ``analysis/``):

- ``flowlm.sweep``: the sweep's name (``sweep.name``; also its folder under ``<runs>/sweeps/`` and its Optuna study)
- ``flowlm.trial``: Hydra's job number within this launch; ``flowlm.trial_id``: the trial's folder (stable)
- ``flowlm.sweeper``, ``flowlm.sweep_dir``, ``flowlm.study`` (Optuna), ``flowlm.overrides``, ``flowlm.objectives``
- ``flowlm.attempt`` identifies one execution.

Params: the run's sections (name, task, seed, method, backbone, data, eval, trainer), flattened; a trial's
overrides as ``trial/<key>``.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lightning.pytorch.loggers import MLFlowLogger
from omegaconf import DictConfig, OmegaConf

from flowlm.experiment_kind import mark_model_training
from flowlm.project import git_commit
from flowlm.redaction import redact, redact_uri
from runners.common import SUPERSEDED, is_rank_zero
from runners.objectives import objective_keys
from runners.tracking import ResilientMLFlowLogger, TrackingUnavailable, check_store_space

log = logging.getLogger(__name__)
ERROR_TAG = "flowlm.error"  # the error a failed run ended with (also set on failed sweep trials)
# MLflow accepts these characters in param names; tag and param values are capped well under its limits.
_PARAM_NAME = re.compile(r"[^\w./\- :]")
MAX_VALUE = 5000


def make_logger(cfg: DictConfig, run_dir: Path | None) -> MLFlowLogger | None:
    """The configured MLflow logger; a resumed run continues its MLflow run (id kept in the run folder)."""
    if not cfg.get("logger"):
        return None
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    run_id_file = run_dir / "mlflow_run_id" if run_dir else None
    run_id = (run_id_file.read_text().strip() or None) if run_id_file and run_id_file.exists() else None
    try:
        logger = instantiate(cfg.logger, run_id=run_id)
    except InstantiationException as err:
        if isinstance(err.__cause__, TrackingUnavailable):  # a store that cannot be opened: its own message
            raise err.__cause__ from err.__cause__.__cause__
        raise
    if is_rank_zero() and isinstance(logger, ResilientMLFlowLogger):
        logger.check_reachable()
    if is_rank_zero() and isinstance(logger, MLFlowLogger):
        client, rid = logger.experiment, logger.run_id
        if run_id_file is not None and rid != run_id:
            run_id_file.parent.mkdir(parents=True, exist_ok=True)
            run_id_file.write_text(rid)
        superseded = run_dir / SUPERSEDED if run_dir else None
        if superseded is not None and superseded.exists():
            _end_superseded(client, superseded.read_text().strip(), rid)
            superseded.unlink()
        old = getattr(logger, "replaced_run_id", None)
        if old:  # the store lost the run (a deleted or replaced mlflow.db): the resumed training gets a new one
            client.set_tag(rid, "flowlm.previous_mlflow_run_id", old)
            warnings.warn(
                f"resuming {run_dir}: the MLflow store {redact_uri(logger._tracking_uri)} has no run {old} (the id "
                f"recorded in {run_id_file}): the store was deleted or replaced since this run was tracked. The "
                f"resumed training is tracked in a new MLflow run {rid}, tagged flowlm.previous_mlflow_run_id; what "
                "the old run logged is not in this store. If the run was tracked in another store, stop this launch, "
                f"write {old} back into {run_id_file.name} and resume with logger.tracking_uri=<that store>.",
                RuntimeWarning,
                stacklevel=2,
            )
        mark_model_training(client, logger.experiment_id)  # a model-training experiment for MLflow's UI
        for key, value in run_tags(cfg, run_dir).items():
            client.set_tag(rid, key, value)
        resolved = OmegaConf.create(redact(OmegaConf.to_container(cfg, resolve=True)))  # no URI's password
        client.log_text(rid, OmegaConf.to_yaml(resolved), "config/resolved.yaml")
        logger.log_hyperparams(run_params(cfg))
    return logger


def check_tracking(cfg: DictConfig) -> None:
    """Refuse, before the run writes anything, a local MLflow store or artifact folder on a full disk
    (``runners.tracking.check_store_space``)."""
    logger = cfg.get("logger")
    if logger and is_rank_zero():
        check_store_space(logger.get("tracking_uri"), logger.get("artifact_location"))


def announce(run_dir: Path | str | None, logger: MLFlowLogger | None) -> None:
    """Print where a run lives, one line each: its folder (when there is one) and its MLflow run (when tracked), at
    the start of a training or evaluation and again at its end, so that neither has to be searched for in the log."""
    if not is_rank_zero():
        return
    lines = [f"run folder: {run_dir}"] if run_dir else []
    if logger is not None and logger.run_id:
        lines.append(f"MLflow run: {logger.run_id} ({redact_uri(logger._tracking_uri)})")
    if lines:
        print("\n".join(lines), flush=True)


def _end_superseded(client, old: str, new: str) -> None:
    """End the MLflow run of a launch killed before its first checkpoint (left RUNNING: a SIGKILL ends nothing)
    that a launch with other settings replaced; a run that ended (FAILED, KILLED) keeps its status."""
    try:
        if old and old != new and client.get_run(old).info.status == "RUNNING":
            client.set_tag(old, ERROR_TAG, f"killed before its first checkpoint; superseded by MLflow run {new}")
            client.set_terminated(old, "KILLED")
    except Exception as err:  # noqa: BLE001 - another store, a deleted run: nothing to end
        log.info("could not end the superseded MLflow run %s: %s", old, err)


def run_tags(cfg: DictConfig, run_dir: Path | None = None) -> dict[str, str]:
    """MLflow tags of a run: the code's commit, the run's name and folder, and a sweep trial's own."""
    tags = {"mlflow.source.git.commit": git_commit(), "flowlm.name": str(cfg.name)}
    if run_dir is not None:
        tags["flowlm.run_dir"] = str(run_dir)
    return {**tags, **trial_tags(cfg)}  # a sweep trial: its sweep, trial number, overrides


def run_params(cfg: DictConfig) -> dict:
    """MLflow params of a run: its sections (nested; the logger flattens them) and a sweep trial's overrides, URIs
    without their passwords."""
    return redact({**_flat_params(cfg), **trial_params(cfg)})


def _flat_params(cfg: DictConfig) -> dict:
    keep = {k: cfg[k] for k in ("name", "task", "seed", "method", "backbone", "data", "eval", "trainer") if k in cfg}
    return OmegaConf.to_container(OmegaConf.create(keep), resolve=True)


def trial_tags(cfg: DictConfig) -> dict[str, str]:
    """MLflow tags of a sweep trial (none outside a sweep)."""
    sweep = cfg.get("sweep")
    if not sweep or sweep.get("trial") is None:
        return {}
    tags = {
        "flowlm.sweep": str(sweep.name),
        "flowlm.trial": str(sweep.trial),
        "flowlm.trial_id": str(sweep.trial_id),
        "flowlm.sweeper": str(sweep.sweeper),
        "flowlm.sweep_dir": str(sweep.dir),
        "flowlm.overrides": redact_uri(" ".join(sweep.overrides))[:MAX_VALUE],
        "flowlm.attempt": str(sweep.attempt),
    }
    if sweep.get("study"):
        tags["flowlm.study"] = str(sweep.study)
    keys = objective_keys(cfg.get("optimized_metric"))
    if keys:
        tags["flowlm.objectives"] = ",".join(keys)
    return tags


def trial_params(cfg: DictConfig) -> dict[str, str]:
    """MLflow params ``trial/<key>`` of a sweep trial: its overrides, swept and fixed (none outside a sweep)."""
    sweep = cfg.get("sweep")
    if not sweep or sweep.get("trial") is None:
        return {}
    params = {}
    for override in sweep.overrides:
        key, _, value = override.partition("=")
        params["trial/" + _PARAM_NAME.sub("_", key.lstrip("+~"))] = value[:MAX_VALUE]
    return params


def _describe_error(err: BaseException) -> str:
    """``type: message``; Lightning ends a Ctrl-C (SIGINT) with ``SystemExit(1)`` raised while handling it."""
    if isinstance(err, KeyboardInterrupt) or (
        isinstance(err, SystemExit) and isinstance(err.__context__, KeyboardInterrupt)
    ):
        return "KeyboardInterrupt: interrupted (Ctrl-C or SIGINT); the same command resumes from the last checkpoint"
    return f"{type(err).__name__}: {err}"


def end_with_error(client, run_id: str, err: BaseException) -> None:
    """End the MLflow run FAILED (KILLED for an interrupt) with ``err`` in the tag ``flowlm.error`` (type and
    message, truncated): a failed training run (``record_error``) or sweep trial (runners/trial.py)."""
    client.set_tag(run_id, ERROR_TAG, _describe_error(err)[:MAX_VALUE])
    client.set_terminated(run_id, "FAILED" if isinstance(err, Exception) else "KILLED")


def record_error(logger: MLFlowLogger, err: BaseException | None) -> None:
    """End the logger's MLflow run FAILED (KILLED for an interrupt) with ``err`` in the tag ``flowlm.error``
    (type and message, truncated); with None, drop the tag that an earlier failed launch of the run left.
    Never raises: the run's own error is the one to see."""
    try:
        client, run_id = MLFlowLogger.experiment.fget(logger), logger.run_id
        if err is None:
            if ERROR_TAG in client.get_run(run_id).data.tags:
                client.delete_tag(run_id, ERROR_TAG)
            return
        end_with_error(client, run_id, err)
    except Exception as failure:  # noqa: BLE001
        message = f"could not record the run's outcome in MLflow ({type(failure).__name__}: {failure})"
        warnings.warn(message, RuntimeWarning, stacklevel=2)


@contextmanager
def tracked_run(cfg: DictConfig | None) -> Iterator[MLFlowLogger | None]:
    """The MLflow run of a command without a run folder (runners/lm_harness.py, runners/mt_bench.py): the store
    checked and the run made and announced on entry (None with ``logger=none``, or no config at all: lm-eval's
    ``--mlflow_tracking_uri none``), ended FINISHED when the block ends, FAILED (KILLED for an interrupt) with its
    error when it raises (``record_error``), announced again at the end."""
    if cfg is None:  # untracked
        yield None
        return
    check_tracking(cfg)
    logger = make_logger(cfg, None)
    announce(None, logger)
    try:
        yield logger
        if logger is not None:
            logger.finalize("success")
    except BaseException as err:
        if logger is not None:
            record_error(logger, err)
        raise
    finally:
        announce(None, logger)
