"""EMA of the weights through Lightning's WeightAveraging (swapped in for validation, saved as state_dict).

Under FSDP2 (trainer=fsdp2: ModelParallelStrategy) the average is kept shard for shard beside the sharded weights
(``ShardedAverage``) and written into the sharded checkpoint with them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from lightning.pytorch.callbacks import WeightAveraging
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel

from lightning_modules.checkpoints import LIVE_KEY, is_sharded_checkpoint, read_shard_index
from lightning_modules.sharding import is_dtensor, reshard_all


class EMA(WeightAveraging):
    """Exponential moving average with optional warm-up: decay_n = min(decay, (1 + n) / (10 + n)).

    The warm-up keeps a short run's average from being dominated by the random initialisation; with
    ``warmup=False`` it is the plain EMA of the released recipes (0.9999 for FMLM+, 0.999 for MLFM).
    Lightning swaps the average in for every validation epoch and writes it as the checkpoint's
    ``state_dict`` (the live weights go to ``current_model_state``), so evaluation always sees the EMA.
    """

    def __init__(self, *, decay: float = 0.9999, warmup: bool = True, every_n_steps: int = 1) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must lie in [0, 1), got {decay}")
        self.decay = decay
        self.warmup = warmup
        self.every_n_steps = every_n_steps
        self._sharded = False  # set in setup: the strategy shards the weights (FSDP2)
        super().__init__(multi_avg_fn=self._update, use_buffers=True)

    def setup(self, trainer, pl_module, stage: str) -> None:
        """Under FSDP2 build the average once the model is sharded (``on_fit_start``); otherwise WeightAveraging's
        copy of the plain module."""
        self._sharded = isinstance(trainer.strategy, ModelParallelStrategy)
        if stage != "fit" or self._sharded:
            return
        # WeightAveraging.setup without its configure_model call (and warning): FlowLMModule.configure_model adds no
        # layers, it only shards (not here) or compiles in place, so the average is a copy of the plain module.
        self._average_model = HostCountedAverage(
            model=pl_module, device=self._device or pl_module.device, use_buffers=self._use_buffers, **self._kwargs
        )

    def on_fit_start(self, trainer, pl_module) -> None:
        """Under FSDP2: start the average from the sharded weights (before a resumed run restores it)."""
        if self._sharded and self._average_model is None:
            self._average_model = ShardedAverage(pl_module, self._update)

    @torch.no_grad()
    def _update(self, averaged: list, current: list, num_averaged: int | Tensor) -> None:
        n = float(num_averaged)  # a host int from HostCountedAverage / ShardedAverage: no device read
        decay = min(self.decay, (1.0 + n) / (10.0 + n)) if self.warmup else self.decay
        floats = [(a, c) for a, c in zip(averaged, current, strict=True) if a.is_floating_point()]
        if floats:
            torch._foreach_lerp_([a for a, _ in floats], [c for _, c in floats], 1.0 - decay)

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        """Update after every ``every_n_steps`` optimiser steps, never at epoch ends."""
        return step_idx is not None and step_idx % self.every_n_steps == 0

    # ---------------------------------------------------------------------------------- sharded (FSDP2) weights
    def _swap_models(self, pl_module) -> None:
        if not self._sharded:
            return super()._swap_models(pl_module)
        for average, current in self._average_model.pairs(pl_module):
            tmp = average.clone()
            average.copy_(current)
            current.copy_(tmp)

    def _copy_average_to_current(self, pl_module) -> None:
        if not self._sharded:
            return super()._copy_average_to_current(pl_module)
        for average, current in self._average_model.pairs(pl_module):
            current.copy_(average)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        """As WeightAveraging (``state_dict`` = the average, the live weights beside it), with the average taken in
        the strategy's own state-dict form; in a sharded checkpoint the live weights go inside ``state_dict`` (under
        ``current_model_state``), the only part the strategy writes as shards (``meta.pt`` is rank 0's alone)."""
        if not self._sharded or self._average_model is None:
            return super().on_save_checkpoint(trainer, pl_module, checkpoint)
        live = checkpoint["state_dict"]
        self._swap_models(pl_module)
        try:  # cloned: on CPU the strategy's state dict shares the parameters' memory
            average = {
                k: v.clone() if isinstance(v, Tensor) else v
                for k, v in trainer.strategy.lightning_module_state_dict().items()
            }
        finally:
            self._swap_models(pl_module)
        if any(is_dtensor(v) for v in live.values()):
            checkpoint["state_dict"] = {**average, LIVE_KEY: live}
        else:  # save_distributed_checkpoint=false: full tensors in one file written by rank 0
            checkpoint["state_dict"] = average
            checkpoint[LIVE_KEY] = live
        checkpoint["averaging_state"] = {"n_averaged": torch.tensor(self._average_model.n_averaged)}

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        """Resume a sharded run: the strategy has loaded ``state_dict`` (the average) into the module; take it as
        the average, then load the live weights (from the shards, or a full file's ``current_model_state``)."""
        if not self._sharded:
            return super().on_load_checkpoint(trainer, pl_module, checkpoint)
        if self._average_model is None:
            return super().on_load_checkpoint(trainer, pl_module, checkpoint)  # outside fit: its warning
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            set_model_state_dict,
        )

        self._average_model.copy_from(pl_module)
        n_averaged = int(checkpoint.get("averaging_state", {}).get("n_averaged", 0))
        path = Path(trainer.ckpt_path) if trainer.ckpt_path else None
        if LIVE_KEY in checkpoint:
            options = StateDictOptions(full_state_dict=True, strict=True)
            set_model_state_dict(pl_module, checkpoint.pop(LIVE_KEY), options=options)
        elif path is not None and is_sharded_checkpoint(path) and _has_live_shards(path):
            import torch.distributed.checkpoint as dcp

            live = get_model_state_dict(pl_module)
            dcp.load({"state_dict": {LIVE_KEY: live}}, checkpoint_id=path)
            set_model_state_dict(pl_module, live)
        else:
            rank_zero_warn(
                "The checkpoint was not written with EMA: the average restarts from its weights at the next step."
            )
            n_averaged = 0
        self._average_model.n_averaged = n_averaged


class HostCountedAverage(AveragedModel):
    """AveragedModel whose update reads no device value: torch's ``update_parameters`` tests its on-device count
    twice per update (``n_averaged == 0``, ``> 0``), two host syncs per training step on a GPU. The count is
    mirrored on the host (read once after construction or a checkpoint load); the buffer stays the checkpointed
    truth and is incremented on its device."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._host_n: int | None = None

    def _load_from_state_dict(self, *args, **kwargs) -> None:  # noqa: D102 - a loaded count is re-read once
        super()._load_from_state_dict(*args, **kwargs)
        self._host_n = None

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        """A copy the first time, then ``multi_avg_fn`` with the count as a host int (parameters and buffers)."""
        if self._host_n is None:
            self._host_n = int(self.n_averaged)
        averaged = _tensors(self.module) if self.use_buffers else list(self.parameters())
        current = _tensors(model) if self.use_buffers else list(model.parameters())
        pairs = [(a.detach(), c.detach().to(a.device)) for a, c in zip(averaged, current, strict=True)]
        _average_step(pairs, self._host_n, self.multi_avg_fn)
        if not self.use_buffers:  # as AveragedModel: buffers follow the model
            for b_avg, b_model in zip(self.module.buffers(), model.buffers(), strict=True):
                b_avg.detach().copy_(b_model.detach().to(b_avg.device))
        self.n_averaged += 1
        self._host_n += 1


class ShardedAverage:
    """AveragedModel's part for a sharded (FSDP2) module: a copy of every parameter and buffer as the module holds
    it (DTensor shards stay DTensor shards), updated elementwise on the local shards: no communication, and the
    average is sharded exactly like the weights."""

    def __init__(self, module: nn.Module, multi_avg_fn) -> None:
        self.multi_avg_fn = multi_avg_fn
        self.n_averaged = 0
        reshard_all(module)
        self.tensors = [t.detach().clone() for t in _tensors(module)]

    def pairs(self, module: nn.Module) -> list[tuple[Tensor, Tensor]]:
        """(average, current) local tensors, position by position; the module is resharded first (an outermost
        FSDP2 unit keeps its parameters gathered after a forward pass without backward)."""
        reshard_all(module)
        current = _tensors(module)
        if len(current) != len(self.tensors):
            raise RuntimeError(f"the module now has {len(current)} tensors, the average {len(self.tensors)}")
        return [(_local(a), _local(c.detach())) for a, c in zip(self.tensors, current, strict=True)]

    @torch.no_grad()
    def update_parameters(self, module: nn.Module) -> None:
        """As AveragedModel.update_parameters: a copy the first time, then ``multi_avg_fn``."""
        _average_step(self.pairs(module), self.n_averaged, self.multi_avg_fn)
        self.n_averaged += 1

    @torch.no_grad()
    def copy_from(self, module: nn.Module) -> None:
        """The average := the module's current weights."""
        for average, current in self.pairs(module):
            average.copy_(current)


def _average_step(pairs: list[tuple[Tensor, Tensor]], n_averaged: int, multi_avg_fn) -> None:
    """AveragedModel's update on (average, current) pairs: a copy the first time, then ``multi_avg_fn``."""
    if n_averaged == 0:
        for average, current in pairs:
            average.copy_(current)
    else:
        multi_avg_fn([a for a, _ in pairs], [c for _, c in pairs], n_averaged)


def _tensors(module: nn.Module) -> list[Tensor]:
    return [*module.parameters(), *module.buffers()]


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if is_dtensor(tensor) else tensor


def _has_live_shards(path: Path) -> bool:
    prefix = f"state_dict.{LIVE_KEY}."
    return any(key.startswith(prefix) for key in read_shard_index(path).state_dict_metadata)
