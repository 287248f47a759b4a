"""Count the operations that would make the host wait for a GPU, on any device (the tests run on CPU).

On CUDA these aten ops copy a device value to the host before they can return: reading a scalar (``item``,
``bool``/``float`` of a tensor, ``if tensor:``), data-dependent output shapes (``nonzero``, boolean-mask indexing,
``masked_select``, ``unique``, ``repeat_interleave`` without ``output_size``). A ``TorchDispatchMode`` sees them
below the Python layer, so the count holds for any code path; ``torch.cuda.set_sync_debug_mode`` is the GPU twin.

Not seen here (everything is on the CPU in the tests): ``.tolist()``/``.numpy()`` (no aten op: the code uses them
on host-only data, e.g. FMLM+'s pair kinds) and blocking host→device copies (``.to(device)`` of a CPU tensor
syncs a CUDA stream; the training code passes ``non_blocking=True``). Ops inside ``torch.optim``'s optimisers are
not counted: their step counters live on the host for GPU parameters unless fused or capturable (``swa_utils``'
AveragedModel is counted: its count lives on the model's device).
"""

from __future__ import annotations

import traceback
from collections import Counter

import torch
from lightning.pytorch.callbacks import Callback
from torch.utils._python_dispatch import TorchDispatchMode

_ALWAYS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim"}
_ALWAYS |= {"unique_consecutive", "masked_scatter_backward"}
_BOOL_INDEX = {"index", "index_put", "index_put_", "_index_put_impl_"}


class HostSyncs(TorchDispatchMode):
    """``with HostSyncs() as syncs: ...`` then ``syncs.count`` / ``syncs.where`` (op → the caller's source line)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.where: list[str] = []

    @property
    def count(self) -> int:
        """Host syncs seen."""
        return sum(self.ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in _ALWAYS or (name in _BOOL_INDEX and _has_bool_index(args)) or _unsized_repeat(name, args, kwargs):
            stack = traceback.extract_stack()[:-1]
            if _inside_torch_optim(stack):
                # torch.optim keeps its step counters on the host for GPU parameters (unless fused/capturable):
                # reading them is free on a GPU
                return func(*args, **(kwargs or {}))
            self.ops[name] += 1
            frame = next((f for f in reversed(stack) if "/torch/" not in f.filename), None)
            self.where.append(f"{name} at {frame.filename}:{frame.lineno}" if frame else name)
        return func(*args, **(kwargs or {}))


def _inside_torch_optim(stack) -> bool:
    """Whether an optimiser's code runs between the last frame outside torch and the op (not swa_utils: its
    ``AveragedModel`` keeps its count on the model's device)."""
    last_outside = max((i for i, f in enumerate(stack) if "/torch/" not in f.filename), default=-1)
    inner = stack[last_outside + 1 :]
    return any("/torch/optim/" in f.filename and not f.filename.endswith("swa_utils.py") for f in inner)


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


def _unsized_repeat(name: str, args, kwargs) -> bool:
    return name == "repeat_interleave" and (kwargs or {}).get("output_size") is None and len(args) < 3


class SyncProbe(Callback):
    """Counts the host syncs of every training batch (training step, backward, optimiser step, EMA update);
    Lightning's own logging after the batch is outside the window."""

    def __init__(self) -> None:
        self.per_batch: list[HostSyncs] = []
        self._mode: HostSyncs | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: D102
        self._mode = HostSyncs().__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: D102
        self._mode.__exit__(None, None, None)
        self.per_batch.append(self._mode)
