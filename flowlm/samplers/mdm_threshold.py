"""Confidence-threshold parallel decoding of MDMs (Fast-dLLM, arXiv 2505.22618, its ``get_transfer_index``): each call
commits every eligible masked position whose confidence max_v p exceeds τ, at least the best one; the factor rule
commits instead the largest n with (n + 1)·(1 − c₍ₙ₎) < f, c₍ₙ₎ the n-th highest confidence. The loop, blocks and
budget: ``mdm_adaptive.py``."""

from __future__ import annotations

import torch
from torch import Tensor

from flowlm.samplers.mdm_adaptive import AdaptiveMDMSampler, CallStats, sorted_eligible


class ThresholdSampler(AdaptiveMDMSampler):
    """Commit every eligible position with max_v p > ``threshold`` (τ; at least one per call), or with ``factor`` f
    the largest n with (n + 1)(1 − c₍ₙ₎) < f. With ``score`` margin or entropy the rule's count n is kept and the n
    best positions by that rank commit (which may differ from those above τ). τ above every confidence commits the
    budget schedule's ⌈#masked / calls left⌉ (the confidence sampler's); τ ≤ 0 commits a whole block per call.
    ``cache`` / ``refresh`` with ``block_length``: the block KV cache (``mdm_adaptive.py``)."""

    def __init__(
        self, *, threshold: float = 0.9, factor: float | None = None, score: str = "max_prob", **options
    ) -> None:
        super().__init__(score=score, **options)  # block_length, temperature, cache, refresh: AdaptiveMDMSampler
        if factor is not None and factor <= 0:
            raise ValueError(f"factor must be > 0 (or null: the threshold rule), got {factor}")
        self.threshold, self.factor = float(threshold), factor

    def select(self, stats: CallStats, ordered: Tensor, eligible: Tensor) -> Tensor:  # noqa: D102
        confidence = stats.max_prob  # max_v p per position
        if self.factor is None:
            return (eligible & (confidence > self.threshold)).sum(-1)
        c = sorted_eligible(confidence, ordered, eligible, fill=0.0)  # c₍₁₎ ≥ c₍₂₎ ≥ … with score=max_prob
        n = torch.arange(1, c.shape[-1] + 1, device=c.device, dtype=c.dtype)
        return ((n + 1) * (1 - c) < self.factor).cumprod(-1).sum(-1)  # the longest prefix where the rule holds
