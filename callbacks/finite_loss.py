"""Guard against non-finite training losses: stop the run (default) or skip the step, before the update."""

from __future__ import annotations

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or infinite."""


class FiniteLossGuard(Callback):
    """Checks the losses of each optimizer step before its update, on every rank (one all-reduced flag, so all ranks
    decide together).

    The micro-batches' losses are collected on their device and read once, just before the optimizer step, when
    the backward passes are already queued: one host sync per step (reading each loss before its backward would
    stall a GPU once per micro-batch with nothing queued behind it).

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
        self._losses: list[torch.Tensor] = []  # this step's micro-batch losses, on their device
        self.consecutive = 0
        self.skipped = 0

    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:  # noqa: D102
        self._losses.append(loss.detach())

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # noqa: D102
        losses, self._losses = self._losses, []
        if not losses:
            return
        bad = not bool(torch.isfinite(torch.stack(losses)).all())  # the step's one host read
        if trainer.world_size > 1:
            bad = trainer.strategy.reduce_boolean_decision(bad, all=False)
        if not bad:
            self.consecutive = 0
            return
        if self.action == "stop" or self.consecutive >= self.max_consecutive_skips:
            ckpt = getattr(trainer.checkpoint_callback, "last_model_path", "") or "none saved yet"
            after = f" after {self.consecutive} skipped steps in a row" if self.action == "skip" else ""
            mine = ", ".join(f"{value:g}" for value in torch.stack(losses).tolist())
            raise NonFiniteLossError(
                f"non-finite training loss at step {trainer.global_step}{after} (this rank's micro-batch losses: "
                f"{mine}); the step was not applied. Last checkpoint: {ckpt}. Lower method.optim.lr or raise "
                "trainer.gradient_clip_val and relaunch the same command to resume from it."
            )
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
