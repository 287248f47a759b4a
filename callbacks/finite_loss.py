"""Stop a run at the first non-finite training loss, before it reaches the weights or a checkpoint."""

from __future__ import annotations

import torch
from lightning.pytorch.callbacks import Callback


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or infinite."""


class FiniteLossGuard(Callback):
    """Checks the loss before backward on every rank (one all-reduced flag, so all ranks stop together).

    The step's update never happens, so the weights, the EMA and every checkpoint on disk stay as they were; the
    message names the step and the last checkpoint to resume from (e.g. with a lower learning rate).
    """

    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:  # noqa: D102
        bad = not bool(torch.isfinite(loss.detach()).all())
        if trainer.world_size > 1:
            bad = trainer.strategy.reduce_boolean_decision(bad, all=False)
        if bad:
            ckpt = getattr(trainer.checkpoint_callback, "last_model_path", "") or "none saved yet"
            raise NonFiniteLossError(
                f"non-finite training loss at step {trainer.global_step} (this rank: {loss.item()}); the step was "
                f"not applied. Last checkpoint: {ckpt}. Lower method.optim.lr or raise trainer.gradient_clip_val and "
                "relaunch the same command to resume from it."
            )
