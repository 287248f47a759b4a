"""Helpers for tests that run more than one process: the environment of a `flowlm-train` subprocess, a spawn with
a hang guard, and callbacks that tests add to such a subprocess (``PYTHONPATH`` = the repository root):
``+callbacks.<name>._target_=tests.process_helpers.<Class>``. Nothing here imports ``conftest``, so a subprocess
can import it."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

ROOT = Path(__file__).resolve().parents[1]


def subprocess_env(root: Path, **extra: str) -> dict:
    """Environment of a `flowlm-train` subprocess whose runs and data live under ``root`` (one thread, this
    checkout on the path, no tracking URI inherited from the caller), plus ``extra`` variables."""
    env = {
        **os.environ,
        "FLOWLM_RUNS": str(root / "runs"),
        "FLOWLM_DATA": str(root / "data"),
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        **extra,
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def spawn_ranks(worker, tmp_path, *, nprocs: int = 2, timeout_s: int = 180, what: str = "ranks") -> None:
    """Run ``worker(rank, <rendezvous file>, <out dir>)`` on ``nprocs`` CPU processes; a hang fails the test after
    ``timeout_s`` seconds (the processes are killed) instead of blocking the suite."""
    import torch.multiprocessing as mp

    context = mp.spawn(worker, args=(str(tmp_path / "pg"), str(tmp_path)), nprocs=nprocs, join=False)
    for _ in range(timeout_s):
        if context.join(timeout=1):
            return
    for process in context.processes:
        process.kill()
    pytest.fail(f"{what} hung")


class KillAtStep(Callback):
    """SIGKILL this process when the optimizer step counter reaches ``step`` (no cleanup, no checkpoint: a crash)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: D102
        if trainer.global_step >= self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class LossTrace(Callback):
    """The global-batch training loss of every optimizer step (mean over ranks and accumulated micro-batches, which
    hold equal numbers of rows), written by rank 0 as JSON, with the final weights beside it (``.pt``)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.losses: list[float] = []
        self._micro: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: D102
        self._micro.append(outputs["loss"].detach().double().clone())
        if len(self._micro) < trainer.accumulate_grad_batches:
            return
        # Lightning hands on the loss already divided by the accumulation steps: their sum is the step's loss.
        loss = torch.stack(self._micro).sum()
        self._micro = []
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        self.losses.append(float(loss))

    def on_train_end(self, trainer, pl_module) -> None:  # noqa: D102
        if trainer.is_global_zero:
            self.path.write_text(json.dumps(self.losses))
            torch.save({k: v.detach().clone() for k, v in pl_module.state_dict().items()}, self.path.with_suffix(".pt"))
