"""Guard against non-finite training losses: stop the run (default) or skip the step, before the update."""

from __future__ import annotations

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or infinite."""


class FiniteLossGuard(Callback):
    """Checks the loss before backward on every rank (one all-reduced flag, so all ranks decide together).

    ``action="stop"``: the step's update never happens, so the weights, the EMA and every checkpoint on disk stay as
    they were; the message names the step and the last checkpoint to resume from (e.g. with a lower learning rate).
    ``action="skip"``: the step's gradients are dropped (set to None: AdamW leaves those parameters and their moments
    untouched), a warning names the step and the skip is counted in ``train/skipped_steps``; more than
    ``max_consecutive_skips`` skipped steps in a row stop the run as above. With gradient accumulation one bad
    micro-batch skips its whole step.
    """

    def __init__(self, action: str = "stop", max_consecutive_skips: int = 10) -> None:
        if action not in ("stop", "skip"):
            raise ValueError(f"FiniteLossGuard action must be 'stop' or 'skip', got {action!r}")
        self.action = action
        self.max_consecutive_skips = max_consecutive_skips
        self._bad_step = False
        self.consecutive = 0
        self.skipped = 0

    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:  # noqa: D102
        bad = not bool(torch.isfinite(loss.detach()).all())
        if trainer.world_size > 1:
            bad = trainer.strategy.reduce_boolean_decision(bad, all=False)
        if not bad:
            return
        if self.action == "skip" and self.consecutive < self.max_consecutive_skips:
            self._bad_step = True  # dropped in on_before_optimizer_step, after the whole accumulation group
            return
        ckpt = getattr(trainer.checkpoint_callback, "last_model_path", "") or "none saved yet"
        after = f" after {self.consecutive} skipped steps in a row" if self.action == "skip" else ""
        raise NonFiniteLossError(
            f"non-finite training loss at step {trainer.global_step}{after} (this rank: {loss.item()}); the step "
            f"was not applied. Last checkpoint: {ckpt}. Lower method.optim.lr or raise trainer.gradient_clip_val and "
            "relaunch the same command to resume from it."
        )

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # noqa: D102
        if not self._bad_step:
            self.consecutive = 0
            return
        self._bad_step = False
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.grad = None
        self.consecutive += 1
        self.skipped += 1
        rank_zero_warn(f"non-finite training loss at step {trainer.global_step}: step skipped ({self.skipped} so far)")
        pl_module.log("train/skipped_steps", float(self.skipped), rank_zero_only=True)

    def state_dict(self) -> dict:  # noqa: D102 - the counts survive a resume
        return {"consecutive": self.consecutive, "skipped": self.skipped}

    def load_state_dict(self, state_dict: dict) -> None:  # noqa: D102
        self.consecutive = state_dict.get("consecutive", 0)
        self.skipped = state_dict.get("skipped", 0)
