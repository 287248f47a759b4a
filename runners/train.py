"""`flowlm-train`: train one method on one task from a Hydra config, evaluate its samplers, track in MLflow."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from omegaconf import DictConfig, OmegaConf

from flowlm.project import CONF_DIR
from flowlm.redaction import redact
from runners.common import (
    build,
    check_arguments,
    check_budgets,
    check_run_dir,
    check_run_name,
    check_seeds,
    cpu_choices,
    exit_on_sigterm,
    gpu_choices,
    is_rank_zero,
    pivot_table,
    redact_hydra_output,
    resolve_paths,
    sampling_stops_on_sigterm,
    write_run_config,
)
from runners.console import console_script, log_lightning_once
from runners.outputs import check_writable

if TYPE_CHECKING:
    from callbacks.sampling_eval import SamplingEvaluation


def train(cfg: DictConfig) -> dict:
    """Build data, model, evaluation and trainer from ``cfg``; fit (or resume); evaluate; return the results."""
    # Lightning, torch and what builds on them are imported here, not at the top: `flowlm-train --help` (and --cfg,
    # --info) answer without them (tests/runners/test_first_hour.py).
    import lightning as L
    import torch.distributed as dist
    from hydra.utils import instantiate
    from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
    from lightning.pytorch.callbacks import LearningRateMonitor

    from callbacks.checkpoint import check_folder
    from callbacks.progress import progress_callbacks
    from flowlm.pretrained.files import tensors_from_rank_zero
    from lightning_modules.vocabulary import check_data_tokens
    from runners.mlflow_run import announce, check_tracking, make_logger, record_error
    from runners.objectives import check_objectives

    log_lightning_once()
    check_seeds(cfg)
    redact_hydra_output()
    gpu_choices(cfg)  # TF32 on CUDA, before any compute
    cpu_choices(cfg)  # bf16 products by float32 BLAS on a CPU without bf16 kernels, before any compute
    resolve_paths(cfg)
    check_run_name(cfg)
    check_budgets(cfg.eval)
    check_tracking(cfg)  # a full disk under the MLflow store: refused before anything is written
    results = OmegaConf.select(cfg, "callbacks.results_csv.dir", default=None)
    if results:  # the evaluation rows' folder (callbacks/results_csv.py): found read-only after training otherwise
        check_writable("callbacks.results_csv.dir", Path(results) / str(cfg.task))
    run_dir = Path(cfg.paths.run_dir)
    # Every check that can fail runs before any compute and before anything is written: the run folder, its
    # run_config.yaml and the MLflow run are made only once data, model, evaluation and trainer are built.
    ckpt_path = check_run_dir(cfg) if is_rank_zero() else _last_ckpt(run_dir)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = build(cfg.data)
    with tensors_from_rank_zero(weights_from_rank_zero(cfg.trainer)):  # FSDP2: one read of a pretrained source
        module = build(cfg.method, data_vocab_size=datamodule.vocab_size, seq_len=datamodule.seq_len)
    check_data_tokens(datamodule, module)
    module.run_config = redact(OmegaConf.to_container(cfg, resolve=True))  # the checkpoint's record: no password
    module.validate_inputs()
    evaluation: SamplingEvaluation = build(cfg.eval)
    evaluation.check_model(module)
    evaluation.check_data(datamodule)
    check_objectives(cfg.get("optimized_metric"), evaluation, datamodule)
    callbacks = [instantiate(c) for c in cfg.get("callbacks", {}).values() if c is not None]
    if not cfg.get("logger"):  # nothing to monitor into
        callbacks = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
    check_arguments(cfg.trainer, "trainer")
    callbacks += progress_callbacks(cfg.trainer.get("enable_progress_bar", True), cfg.get("progress_every_s", 30))
    trainer: L.Trainer = build(cfg.trainer, callbacks=[*callbacks, evaluation], logger=False)
    if cfg.get("micro_batch_size"):
        if cfg.trainer.get("accumulate_grad_batches", 1) != 1:
            raise ValueError("set micro_batch_size or trainer.accumulate_grad_batches, not both")
        accumulate = accumulation_for(cfg.data.batch_size, trainer.world_size, cfg.micro_batch_size)
        trainer.accumulate_grad_batches = accumulate
    if is_rank_zero():
        # One checkpoint ≈ the weights and Adam's two moments; a read-only or full folder is found now, not at the
        # first save after training.
        need = 3 * sum(p.numel() * p.element_size() for p in module.parameters())
        for callback in trainer.checkpoint_callbacks:
            if callback.dirpath and _is_local_file_protocol(callback.dirpath):
                check_folder(Path(callback.dirpath), need)
        write_run_config(cfg)
    logger = make_logger(cfg, run_dir)
    if logger is not None:
        trainer.loggers = [logger]
    announce(run_dir, logger)  # where the run lives, at its start and (below) at its end, failed or not
    try:
        with sampling_stops_on_sigterm(trainer):
            result = _fit(cfg, trainer, module, datamodule, evaluation, ckpt_path, logger)
    except BaseException as err:
        if logger is not None and is_rank_zero():
            record_error(logger, err)  # FAILED with its error, wherever it failed (Lightning marks only fit's)
        where = f"{run_dir} at step {trainer.global_step}"
        exit_on_sigterm(err, f"{where}; the same command resumes it from its last checkpoint (afresh without one)")
        raise
    finally:
        announce(run_dir, logger)
    if logger is not None and is_rank_zero():
        record_error(logger, None)  # a relaunch that succeeded: the earlier launch's error no longer applies
    if dist.is_available() and dist.is_initialized():
        # torch 2.13 + gloo aborts at exit in 10–40 % of runs unless the group is destroyed (ecosystem.md).
        dist.barrier()
        dist.destroy_process_group()
    return result


def _fit(cfg, trainer, module, datamodule, evaluation, ckpt_path, logger) -> dict:
    """Fit (or resume), evaluate the final weights unless just done, print and log the table; the run's results."""
    from callbacks.convergence import Convergence

    module.resuming_from = str(ckpt_path) if ckpt_path else None  # before on_fit_start, whatever the strategy
    trainer.fit(module, datamodule=datamodule, ckpt_path=module.resuming_from)
    evaluated_last_step = evaluation.results and evaluation.results[0]["step"] == trainer.global_step
    if cfg.get("final_eval", True) and not evaluated_last_step:
        trainer.validate(module, datamodule=datamodule, verbose=False)
    rows = [{"run": cfg.name, **row} for row in evaluation.results]
    if trainer.is_global_zero and rows:
        table = pivot_table(rows, evaluation.primary)
        print(f"\n{cfg.name}: {evaluation.primary} by NFE budget (NFE spent)\n{table}\n", flush=True)
        if logger is not None:
            logger.experiment.log_text(logger.run_id, table, "eval/final_table.md")
    return {
        "rows": rows,
        "metric": evaluation.primary,
        "run_dir": str(cfg.paths.run_dir),
        "mlflow_run_id": getattr(logger, "run_id", None),
        "global_step": trainer.global_step,
        "converged": next((c.verdict.converged for c in trainer.callbacks if isinstance(c, Convergence)), None),
    }


def accumulation_for(global_batch: int, world_size: int, micro_batch_size: int) -> int:
    """Gradient-accumulation steps that make ``world_size`` devices × ``micro_batch_size`` rows add up to the
    global batch (the same effective batch, data order and random draws on 1 or 8 GPUs). ``micro_batch_size`` is a
    cap: devices whose share of the global batch is no larger take it in one forward (a paper config's micro batch
    then composes for any device count that divides the batch)."""
    if micro_batch_size >= 1 and global_batch % world_size == 0:
        micro_batch_size = min(micro_batch_size, global_batch // world_size)
    per_step = world_size * micro_batch_size
    if micro_batch_size < 1 or global_batch % per_step:
        raise ValueError(
            f"data.batch_size = {global_batch} is not a multiple of world size {world_size} × micro_batch_size "
            f"{micro_batch_size} = {per_step}: choose a micro_batch_size that divides {global_batch // world_size}"
            if global_batch % world_size == 0
            else f"data.batch_size = {global_batch} is not divisible by the world size {world_size}"
        )
    return global_batch // per_step


def weights_from_rank_zero(trainer_cfg: DictConfig) -> bool:
    """True on a rank other than 0 of an FSDP2 run (trainer=fsdp2: ``ModelParallelStrategy``): it builds the model
    without reading a pretrained LLaMA-family source (meta tensors), and ``lightning_modules.sharding.shard``
    broadcasts rank 0's weights into it. Other strategies (DDP keeps a full replica per rank) read on every rank."""
    strategy = trainer_cfg.get("strategy")
    target = strategy.get("_target_", "") if isinstance(strategy, (DictConfig, dict)) else str(strategy or "")
    return not is_rank_zero() and target.rsplit(".", 1)[-1] == "ModelParallelStrategy"


def _last_ckpt(run_dir: Path) -> Path | None:
    last = run_dir / "checkpoints" / "last.ckpt"
    return last if last.exists() else None


@console_script
@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")
def main(cfg: DictConfig) -> float | list[float] | None:
    """Console entry point; in a sweep, returns the trial's objective(s) to the sweeper."""
    from runners.trial import run_trial

    return run_trial(train, cfg)


if __name__ == "__main__":
    main()
