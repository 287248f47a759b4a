"""What every datamodule shares: global batch sizes split over devices and accumulation, and the loaders."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset


class GlobalBatchDataModule(L.LightningDataModule):
    """Batch sizes in the config are global (the effective batch on 1 or 8 devices); the loaders get per-device ones.

    Subclasses set ``train_set`` / ``val_set`` in ``setup`` and hold ``batch_size``, ``val_batch_size``,
    ``num_workers``, ``pin_memory`` and ``seed``.
    """

    train_set: Dataset | None = None
    val_set: Dataset | None = None
    batch_size: int
    val_batch_size: int | None
    num_workers: int
    pin_memory: bool
    seed: int

    def train_dataloader(self) -> DataLoader:
        """Shuffled with a seeded generator, drop_last (Lightning swaps in a DistributedSampler under DDP)."""
        if self.train_set is None:
            raise RuntimeError("call setup() before train_dataloader()")
        return DataLoader(
            self.train_set,
            batch_size=self.per_device_batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(self.seed),
            drop_last=True,
            **self._loader_kwargs(),
        )

    def val_dataloader(self) -> DataLoader:
        """In order, keeping the last partial batch: every validation example is scored."""
        if self.val_set is None:
            raise RuntimeError("call setup() before val_dataloader()")
        return DataLoader(
            self.val_set,
            batch_size=self.per_device_val_batch_size,
            shuffle=False,
            drop_last=False,
            **self._loader_kwargs(),
        )

    def _loader_kwargs(self) -> dict[str, Any]:
        return {
            "num_workers": self.num_workers,
            "pin_memory": self.pin_memory and torch.cuda.is_available(),
            "persistent_workers": self.num_workers > 0,
        }

    def _world_and_accumulation(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is None:
            return 1, 1
        return int(trainer.world_size), int(trainer.accumulate_grad_batches)

    @property
    def per_device_batch_size(self) -> int:
        """batch_size // (world_size · accumulate_grad_batches); must divide exactly."""
        world, accumulate = self._world_and_accumulation()
        split = world * accumulate
        if self.batch_size % split:
            raise ValueError(
                f"global batch_size {self.batch_size} is not divisible by world_size {world} × "
                f"accumulate_grad_batches {accumulate} = {split}"
            )
        return self.batch_size // split

    @property
    def per_device_val_batch_size(self) -> int:
        """Global val_batch_size (default: batch_size) // world_size; validation does not accumulate."""
        world, _ = self._world_and_accumulation()
        total = self.batch_size if self.val_batch_size is None else self.val_batch_size
        if total % world:
            raise ValueError(f"global val_batch_size {total} is not divisible by world_size {world}")
        return total // world
