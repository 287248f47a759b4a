"""What every datamodule shares: global batch sizes split over devices and accumulation, and the loaders."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def check_ints(*checks: tuple[str, Any, int]) -> None:
    """Refuse, in order, the first ``(name, value, low)`` whose value is not an int >= low."""
    for name, value, low in checks:
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def check_optional_ints(*checks: tuple[str, Any]) -> None:
    """Refuse, in order, the first ``(name, value)`` whose value is neither None nor an int >= 1."""
    for name, value in checks:
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")


class GlobalBatchSampler(DistributedSampler):
    """One shuffled order of global batches, split over ranks and accumulation, resumable at any optimizer step.

    Epoch ``e`` is a permutation seeded by ``seed + e``, cut into ``len(dataset) // global_batch`` global batches
    (the remainder is dropped, so an epoch is a whole number of optimizer steps). Micro-batch ``m`` of rank ``r``
    takes rows ``[(r·A + m)·b, (r·A + m + 1)·b)`` of each global batch — the slice ``FlowLMModule.global_batch_slice``
    assigns to the same micro-batch for its random draws — so 1 process or N processes × A accumulation steps see the
    same global batches. Iteration starts where ``steps_done()`` optimizer steps left off: a run resumed mid-epoch
    from a checkpoint continues with exactly the batches it had not trained on yet (no RNG state to save).

    A ``DistributedSampler`` subclass only so Lightning keeps it instead of inserting its own under DDP/FSDP.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        global_batch: int,
        num_replicas: int = 1,
        rank: int = 0,
        accumulate: int = 1,
        seed: int = 0,
        steps_done: Callable[[], int] = lambda: 0,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        split = num_replicas * accumulate
        if global_batch % split:
            raise ValueError(f"global batch {global_batch} is not divisible by world × accumulation = {split}")
        self.global_batch, self.accumulate, self.micro_batch = global_batch, accumulate, global_batch // split
        self.steps_per_epoch = len(dataset) // global_batch  # type: ignore[arg-type]
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"{len(dataset)} training examples are fewer than one global batch ({global_batch}): "  # type: ignore[arg-type]
                "no optimizer step would ever run; lower data.batch_size or add data"
            )
        self.steps_done = steps_done
        self.num_samples = self.steps_per_epoch * accumulate * self.micro_batch  # per rank and epoch
        self.total_size = self.num_samples * num_replicas

    def order(self, epoch: int) -> torch.Tensor:
        """The epoch's permutation of the dataset (the same on every rank)."""
        return torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.seed + epoch))  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[int]:
        epoch, first_step = divmod(int(self.steps_done()), self.steps_per_epoch)
        self.epoch = epoch
        perm = self.order(epoch)
        b, a = self.micro_batch, self.accumulate
        for step in range(first_step, self.steps_per_epoch):
            for micro in range(a):
                start = step * self.global_batch + (self.rank * a + micro) * b
                yield from perm[start : start + b].tolist()

    def __len__(self) -> int:
        return self.num_samples


class ResumableDataLoader(DataLoader):
    """A DataLoader that tells Lightning it resumes mid-epoch (its ``GlobalBatchSampler`` starts at the restored
    optimizer step); the state records what defines the order, to warn when a resumed run's data changed."""

    def state_dict(self) -> dict[str, int]:
        sampler = self.sampler
        return {"seed": sampler.seed, "global_batch": sampler.global_batch, "num_examples": len(sampler.dataset)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        now = self.state_dict()
        if state != now:
            warnings.warn(
                f"the training data order changed since the checkpoint ({state} → {now}): the resumed run does not "
                "continue the interrupted epoch's order",
                stacklevel=2,
            )


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
        """Global batches in a seeded order, split over ranks and accumulation, resuming at the trainer's step."""
        if self.train_set is None:
            raise RuntimeError("call setup() before train_dataloader()")
        world, accumulate = self._world_and_accumulation()
        sampler = GlobalBatchSampler(
            self.train_set,
            global_batch=self.batch_size,
            num_replicas=world,
            rank=self.trainer.global_rank if self.trainer is not None else 0,
            accumulate=accumulate,
            seed=self.seed,
            steps_done=self._steps_done,
        )
        return ResumableDataLoader(
            self.train_set, batch_size=sampler.micro_batch, sampler=sampler, drop_last=True, **self._loader_kwargs()
        )

    def _steps_done(self) -> int:
        return self.trainer.global_step if self.trainer is not None else 0

    def check_train_size(self, stage: str | None = None) -> None:
        """At least one global batch of training data (epochs drop the remainder), when the ``stage`` trains (fit, or
        None): an evaluation reads the validation split only, whatever the training split's size."""
        if stage in (None, "fit") and 0 < len(self.train_set) < self.batch_size:  # type: ignore[arg-type]
            raise ValueError(
                f"{len(self.train_set)} training examples are fewer than one global batch "  # type: ignore[arg-type]
                f"(data.batch_size = {self.batch_size}): no optimizer step would ever run"
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
