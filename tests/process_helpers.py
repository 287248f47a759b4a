"""Helpers for tests that run more than one process: the environment of a `flowlm-train` subprocess and a wait for
the flag it writes, a spawn of gloo ranks with a hang guard (and the FSDP2 step every such test compares), and
callbacks that tests add to such a subprocess (``PYTHONPATH`` = the repository root):
``+callbacks.<name>._target_=tests.process_helpers.<Class>``. Nothing here imports ``conftest``, so a subprocess
can import it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
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


def rank_outputs(worker, tmp_path, *, nprocs: int = 2, **spawn) -> list[str]:
    """``spawn_ranks(worker, tmp_path, ...)``, then the text each rank r wrote to ``<tmp_path>/rank<r>``."""
    spawn_ranks(worker, tmp_path, nprocs=nprocs, **spawn)
    return [(tmp_path / f"rank{rank}").read_text() for rank in range(nprocs)]


@contextlib.contextmanager
def gloo_rank(rank: int, init_file: str, world_size: int = 2) -> Iterator[None]:
    """Inside: this process (one thread) is rank ``rank`` of a gloo group. Leaving without an error passes a barrier
    first, so no rank tears gloo down while another still has collectives in flight."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()


def tiny_adapter_holder() -> torch.nn.Module:
    """A module holding an adapted tiny random Llama MDM (trainable parts perturbed off zero), seeded."""
    from flowlm.backbones.llama import BidirectionalLM, LlamaAdaLNAdapter

    torch.manual_seed(0)
    base = BidirectionalLM(embed_rows=65, head_rows=64, mask_id=64, hidden_size=32, n_layers=2, n_heads=4,
                           n_kv_heads=2, intermediate_size=48)  # fmt: skip
    holder = torch.nn.Module()
    holder.net = LlamaAdaLNAdapter(base, cond_dim=16, lora_rank=4)
    with torch.no_grad():
        for p in holder.net.parameters():
            if p.requires_grad:
                p.normal_(std=0.05)
    return holder


def sgd_step(holder, ids, targets, times):
    """One SGD step on the mean cross-entropy; returns the logits before it."""
    params = [p for p in holder.parameters() if p.requires_grad]
    logits = holder.net(ids, times)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    torch.optim.SGD(params, lr=0.5).step()
    return logits.detach()


def sharded_step_error(rank: int, prepare: Callable[[torch.nn.Module], None] | None = None) -> tuple[float, int]:
    """Rank r of 2 (inside ``gloo_rank``): FSDP2 over the decoder layers and the adapter of ``tiny_adapter_holder``
    (``prepare(holder)`` first), one step on its half of the batch, compared with the unsharded model on the whole
    batch (the gradient mean over ranks = the full batch's). Returns max |Δ| over the logits and the trained
    weights, and how many trained parameters are DTensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lightning_modules.sharding import shard

    holder, reference = tiny_adapter_holder(), tiny_adapter_holder()
    gen = torch.Generator().manual_seed(3)
    ids, targets = torch.randint(0, 65, (4, 9), generator=gen), torch.randint(0, 64, (4, 9), generator=gen)
    times = torch.rand(4, generator=gen)
    if prepare is not None:
        prepare(holder)
    assert shard(holder, init_device_mesh("cpu", (2,)))
    rows = slice(2 * rank, 2 * rank + 2)
    local = sgd_step(holder, ids[rows], targets[rows], times[rows])
    full = sgd_step(reference, ids, targets, times)
    want = dict(reference.named_parameters())
    diffs = [(local - full[rows]).abs().max().item()]
    n_dtensor = 0
    for name, p in holder.named_parameters():
        if p.requires_grad:
            n_dtensor += isinstance(p, DTensor)
            value = p.full_tensor() if isinstance(p, DTensor) else p
            diffs.append((value - want[name]).abs().max().item())
    return max(diffs), n_dtensor


def launch_until_flag(cmd: list[str], root: Path, flag: Path, *, never: str) -> subprocess.Popen:
    """Start ``cmd`` (a console script) in its own session under ``root`` (``subprocess_env``), output piped and
    merged, and wait until it writes ``flag`` (at most 180 s): the moment a test signals it."""
    proc = subprocess.Popen(
        cmd,
        env=subprocess_env(root),
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        wait_for_flag(proc, flag, timeout_s=180, poll_s=0.1, never=never)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc


def wait_for_flag(proc: subprocess.Popen, flag: Path, *, timeout_s: float, poll_s: float, never: str) -> None:
    """Wait until ``proc`` writes ``flag``; fail with its output if it exits first, or with ``never`` after
    ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while not flag.exists():
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        assert time.monotonic() < deadline, never
        time.sleep(poll_s)


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
