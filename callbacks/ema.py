"""EMA of the weights through Lightning's WeightAveraging (swapped in for validation, saved as state_dict)."""

from __future__ import annotations

import torch
from lightning.pytorch.callbacks import WeightAveraging


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
        super().__init__(multi_avg_fn=self._update, use_buffers=True)

    @torch.no_grad()
    def _update(self, averaged: list, current: list, num_averaged: torch.Tensor) -> None:
        n = float(num_averaged)
        decay = min(self.decay, (1.0 + n) / (10.0 + n)) if self.warmup else self.decay
        floats = [(a, c) for a, c in zip(averaged, current, strict=True) if a.is_floating_point()]
        if floats:
            torch._foreach_lerp_([a for a, _ in floats], [c for _, c in floats], 1.0 - decay)

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        """Update after every ``every_n_steps`` optimiser steps, never at epoch ends."""
        return step_idx is not None and step_idx % self.every_n_steps == 0
