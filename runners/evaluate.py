"""`flowlm-eval`: sample and score a trained checkpoint with any samplers and NFE budgets; no training."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigKeyError

from flowlm.project import CONF_DIR
from runners.common import (
    build,
    check_arguments,
    check_budgets,
    check_run_name,
    check_seeds,
    cpu_choices,
    exit_on_sigterm,
    gpu_choices,
    pivot_table,
    redact_hydra_output,
    resolve_paths,
    sampling_stops_on_sigterm,
)
from runners.console import console_script, log_lightning_once
from runners.outputs import check_writable

if TYPE_CHECKING:
    import lightning as L

    from callbacks.sampling_eval import SamplingEvaluation

# conf/eval.yaml's `name`: an evaluation left with it is named after its checkpoint (``name_after_checkpoint``).
DEFAULT_NAME = "eval"


def evaluate(cfg: DictConfig) -> dict:
    """Check the checkpoint against the data and samplers (before compute), then run every sampler × budget."""
    # Lightning, torch and what builds on them are imported here, not at the top: `flowlm-eval --help` (and --cfg,
    # --info) answer without them (tests/runners/test_first_hour.py).
    import lightning as L

    from callbacks.progress import progress_callbacks
    from lightning_modules.checkpoints import import_class, load_module, read_checkpoint_meta
    from lightning_modules.vocabulary import check_data_tokens
    from runners.mlflow_run import announce, check_tracking, make_logger, record_error
    from runners.objectives import check_objectives

    log_lightning_once()
    gpu_choices(cfg)  # TF32 on CUDA, before any compute
    cpu_choices(cfg)  # bf16 products by float32 BLAS on a CPU without bf16 kernels, before any compute
    check_run_name(cfg)
    meta = read_checkpoint_meta(cfg.ckpt_path)
    inherit_temperature(cfg, meta)  # before the config is resolved: the samplers' temperatures interpolate it
    inherit_seed(cfg, meta)  # and eval.seed interpolates the seed
    check_seeds(cfg)
    redact_hydra_output()
    resolve_paths(cfg)
    check_budgets(cfg.eval)
    check_tracking(cfg)  # a full disk under the MLflow store: refused before anything is written
    if cfg.get("results_csv"):  # a folder the rows cannot join or be written to: refused before the weights are read
        check_writable("results_csv", results_folder(cfg, meta))
    name_after_checkpoint(cfg, meta)
    cls = import_class(meta["class_path"])
    evaluation: SamplingEvaluation = build(cfg.eval)
    evaluation.check_model(cls)
    data_cfg = eval_data_config(cfg, meta)
    with open_dict(cfg):
        cfg.data = data_cfg  # the data evaluated on, as the MLflow run records it
    datamodule = build(data_cfg)
    if "source" in meta:  # a foreign pretrained MDM: read for these data (a [PAD] row the source lacks is added)
        meta = read_checkpoint_meta(cfg.ckpt_path, data_vocab_size=datamodule.vocab_size)
    for what in ("vocab_size", "seq_len"):
        have, want = getattr(datamodule, what), meta["data_vocab_size" if what == "vocab_size" else what]
        if have != want:
            raise ValueError(
                f"data/checkpoint mismatch: the data have {what}={have}, the checkpoint was trained with {want} "
                f"({cfg.ckpt_path}); evaluate it on data of the same layout"
            )
    evaluation.check_data(datamodule)
    check_objectives(cfg.get("optimized_metric"), evaluation, datamodule)
    L.seed_everything(cfg.seed, verbose=False)
    # a file, a sharded folder consolidated here, an export folder, or a foreign MDM (path or hub name)
    module = load_module(cfg.ckpt_path, map_location="cpu", data_vocab_size=datamodule.vocab_size)
    check_data_tokens(datamodule, module)
    if cfg.get("compile"):  # each DiT block compiled, as training's `compile: true`: speed only
        from lightning_modules.sharding import compile_blocks

        compile_blocks(module)
    check_arguments(cfg.trainer, "trainer")
    progress = progress_callbacks(cfg.trainer.get("enable_progress_bar", True), cfg.get("progress_every_s", 30))
    trainer: L.Trainer = build(cfg.trainer, callbacks=[evaluation, *progress], logger=False)
    start_at_step(trainer, checkpoint_step(cfg.ckpt_path))
    logger = make_logger(cfg, None)  # the MLflow run is made once everything is built
    if logger is not None:
        trainer.loggers = [logger]
        logger.experiment.set_tag(logger.run_id, "flowlm.checkpoint", str(cfg.ckpt_path))
    # Hydra's output folder (its .hydra/ and the log; an evaluation writes nothing else there), when it was made
    run_dir = cfg.paths.run_dir if Path(cfg.paths.run_dir).is_dir() else None
    announce(run_dir, logger)  # at the start and (below) at the end, failed or not
    try:
        with sampling_stops_on_sigterm(trainer):
            trainer.validate(module, datamodule=datamodule, verbose=False)
        rows = [{"run": str((meta.get("config") or {}).get("name", "checkpoint")), **r} for r in evaluation.results]
        if trainer.is_global_zero and rows:
            table = pivot_table(rows, evaluation.primary)
            print(f"\n{evaluation.primary} by NFE budget (NFE spent)\n{table}\n", flush=True)
            if logger is not None:
                logger.experiment.log_text(logger.run_id, table, "eval/final_table.md")
        if trainer.is_global_zero and cfg.get("results_csv"):
            path = write_results_csv(cfg, meta, module, evaluation)
            print(f"rows written to {path}", flush=True)
    except BaseException as err:
        if logger is not None and trainer.is_global_zero:
            record_error(logger, err)  # FAILED with its error (the run is new: no earlier error to clear)
        exit_on_sigterm(err, f"the evaluation of {cfg.ckpt_path}; its results are incomplete")
        raise
    finally:
        announce(run_dir, logger)
    return {"rows": rows, "metric": evaluation.primary, "mlflow_run_id": getattr(logger, "run_id", None)}


def inherit_temperature(cfg: DictConfig, meta: dict) -> None:
    """``a_priori_temperature`` left null takes the checkpoint run's own (an unconditional task samples at 1.0: its
    argmax decoding would repeat one sample, every row alike), else 0.0 (a foreign model, or a run that set none)."""
    if cfg.get("a_priori_temperature") is not None:
        return
    recorded = (meta.get("config") or {}).get("a_priori_temperature")
    with open_dict(cfg):
        cfg.a_priori_temperature = 0.0 if recorded is None else float(recorded)
    if recorded:
        print(f"a_priori_temperature={cfg.a_priori_temperature} as the checkpoint's run had it", flush=True)


def inherit_seed(cfg: DictConfig, meta: dict) -> None:
    """``seed`` left null takes the checkpoint run's own, else 0 (a foreign model, or a run that recorded none). The
    evaluation then draws what the run's final evaluation drew, and its MLflow run's ``seed`` is the model's, by which
    ``flowlm-report`` groups seeds. With a fixed 0, re-evaluating a seed-1 model drew other samples than its training
    rows and logged ``seed`` 0 beside the checkpoint's 1 (MLflow kept the first: "parameters differ")."""
    if cfg.get("seed") is not None:
        return
    recorded = (meta.get("config") or {}).get("seed")
    with open_dict(cfg):
        cfg.seed = 0 if recorded is None else int(recorded)


def name_after_checkpoint(cfg: DictConfig, meta: dict) -> None:
    """Name an evaluation after the run that made its checkpoint, unless the command line named it (``name=``):
    ``name`` becomes ``eval/<that run's name>`` (its MLflow run ``eval/<run's name>/<run_name>``), ``task`` (the
    MLflow experiment) that run's task, and the run's ``method`` and ``backbone`` are recorded among its params. Every
    ``flowlm-eval`` run was named ``eval`` in the experiment ``eval``, and ``flowlm-report`` pooled them all into one
    row. A checkpoint that records no run config (a foreign model) is named by its path; its task stays ``eval``."""
    if cfg.name != DEFAULT_NAME:
        return
    recorded = meta.get("config") or {}
    old_name, old_task = cfg.name, cfg.task
    with open_dict(cfg):
        cfg.name = f"{DEFAULT_NAME}/{recorded.get('name') or cfg.ckpt_path}"
        if old_task == old_name and recorded.get("task"):  # task: ${name}, as conf/eval.yaml has it
            cfg.task = str(recorded["task"])
        for key in ("method", "backbone"):
            if recorded.get(key) and key not in cfg:
                cfg[key] = recorded[key]
        logger = cfg.get("logger")
        if logger:  # its names were resolved from the old ones (conf/logger/mlflow.yaml); names given stay
            if logger.get("experiment_name") == old_task:
                logger.experiment_name = cfg.task
            if logger.get("run_name") == f"{old_name}/{cfg.run_name}":
                logger.run_name = f"{cfg.name}/{cfg.run_name}"


class _RecordedConvergence:
    """The convergence facts of the checkpoint's run, as its ``convergence.json`` holds them (``Convergence.record``
    of the run that trained it); none for a checkpoint outside a run folder."""

    def __init__(self, ckpt_path: str) -> None:
        from callbacks.convergence import CONVERGENCE_FILE

        record = Path(ckpt_path).resolve().parent.parent / CONVERGENCE_FILE
        self._record = json.loads(record.read_text()) if record.is_file() else {}

    def record(self) -> dict:
        return self._record


def write_results_csv(cfg: DictConfig, meta: dict, module, evaluation: SamplingEvaluation) -> Path:
    """The evaluation's rows in the results-CSV schema (callbacks/results_csv.py) at
    ``<results_csv>/<task>/<name>_seed<seed>_eval.csv``: the run's identity and convergence facts, this evaluation's
    samplers and settings; the training precision from the run's config, the device from the run's own rows
    beside it (blank when they are not there)."""
    from callbacks.results_csv import ResultsCSV, method_label, write_rows

    run = dict(meta.get("config") or {})
    folder = results_folder(cfg, meta)
    run["eval"] = OmegaConf.to_container(cfg.eval, resolve=True)
    run["data"] = OmegaConf.to_container(cfg.data, resolve=True)  # the data evaluated on (their task columns)
    trained = folder / f"{run['name']}_seed{run.get('seed', 0)}.csv"
    device = ""
    if trained.is_file():
        with trained.open(newline="") as f:
            device = next(csv.DictReader(f), {}).get("device", "") or ""
    machine = {"precision": str((run.get("trainer") or {}).get("precision", "")), "device": device}
    rows = ResultsCSV.rows(run, method_label(module), evaluation, _RecordedConvergence(cfg.ckpt_path), machine)
    path = folder / f"{run['name']}_seed{run.get('seed', 0)}_eval.csv"
    write_rows(path, [*earlier_rows(path, rows), *rows])
    return path


def results_folder(cfg: DictConfig, meta: dict) -> Path:
    """``<results_csv>/<task>``, where the rows of the checkpoint's run go; ValueError for a checkpoint that records
    no run name and task (a foreign pretrained model)."""
    run = meta.get("config") or {}
    if not run.get("task") or not run.get("name"):
        raise ValueError(
            f"{cfg.ckpt_path} records no run name and task: its rows cannot join a results folder; leave results_csv "
            "out (the scores are in the printed table and the MLflow run)"
        )
    return Path(cfg.results_csv) / str(run["task"])


def row_key(row: dict) -> tuple[str, ...]:
    """What made a row of a run's ``_eval.csv`` (the file is the run's: its name and model seed): the checkpoint's
    step, the sampler's name, settings and budget, and the evaluation's seed. A row written before rows named their
    evaluation seed (``eval_seed`` blank) was drawn with the default, the model's seed."""
    text = lambda key: "" if row.get(key) is None else str(row[key])  # noqa: E731 - 0 is a seed, not a blank
    eval_seed = text("eval_seed") or text("seed")
    return text("eval_step"), str(row["sampler"]), str(row["sampler_settings"]), str(row["nfe_budget"]), eval_seed


def earlier_rows(path: Path, rows: list[dict]) -> list[dict]:
    """The rows already in ``path`` that ``rows`` do not replace (``row_key``: the same checkpoint step, sampler
    settings, budget and evaluation seed): the trials of a sampling-only sweep (``hparams_search=eb_grid``) and the
    evaluations at other seeds each add theirs to the checkpoint's one file; evaluating a setting again replaces its
    rows. ``flowlm-eval seed=7`` replaced the seed-0 rows with seed 7's values, labelled seed 0."""
    if not path.is_file():
        return []
    new = {row_key(row) for row in rows}
    with path.open(newline="") as f:
        return [row for row in csv.DictReader(f) if row_key(row) not in new]


def checkpoint_step(path: str) -> int:
    """The optimizer step a checkpoint was saved at: the ``global_step`` of a file (read as every checkpoint is,
    memory-mapped), of a sharded folder's ``meta.pt`` or of an export's ``config.json``; 0 for a foreign model."""
    from flowlm.pretrained.export import CONFIG as EXPORT_CONFIG
    from flowlm.pretrained.export import is_export
    from flowlm.pretrained.hub import resolve_source
    from lightning_modules.checkpoints import _read_sharded_meta, is_sharded_checkpoint, read_checkpoint

    local = resolve_source(path)
    if is_sharded_checkpoint(local):
        record = _read_sharded_meta(local)
    elif local.is_file():
        record = read_checkpoint(local)
    elif is_export(local):
        record = json.loads((local / EXPORT_CONFIG).read_text())
    else:
        return 0
    step = record.get("global_step")
    return step if isinstance(step, int) else 0


def start_at_step(trainer: L.Trainer, step: int) -> None:
    """Set a new Trainer's step counters to ``step`` before ``validate``: ``trainer.global_step`` (the progress
    line, the evaluation's rows and artifact folders) and the step metrics are logged at. ``validate`` restores no
    loop state, so a fresh Trainer evaluated a step-30 checkpoint "at step 0"."""
    loop = trainer.fit_loop.epoch_loop
    loop.automatic_optimization.optim_progress.optimizer.step.total.completed = step
    loop.manual_optimization.optim_step_progress.total.completed = step
    loop._batches_that_stepped = step  # the loggers' step outside fit


def eval_data_config(cfg: DictConfig, meta: dict) -> DictConfig:
    """The data to evaluate on: a data config of its own (``data=<name>``), else the one recorded in the checkpoint
    with the command line's ``data.<key>=...`` on top (keys it does not have are refused)."""
    given = cfg.get("data") or OmegaConf.create({})
    if "_target_" in given:
        return given
    recorded = (meta.get("config") or {}).get("data")
    if not recorded:
        raise ValueError(f"{cfg.ckpt_path} records no data config; pass data=... (e.g. data=sudoku ...)")
    base = OmegaConf.create(recorded)
    OmegaConf.set_struct(base, True)
    try:
        return OmegaConf.merge(base, given)
    except ConfigKeyError as err:
        raise ValueError(
            f"data.{err.full_key} is not a key of the data config recorded in {cfg.ckpt_path} (its keys: "
            f"{', '.join(base)}); override one of those, or give a data config of its own with data=<name>"
        ) from None


@console_script
@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="eval")
def main(cfg: DictConfig) -> float | list[float] | None:
    """Console entry point; in a sweep, returns the trial's objective(s) to the sweeper."""
    from runners.trial import run_trial

    return run_trial(evaluate, cfg)


if __name__ == "__main__":
    main()
