"""Confidence-threshold parallel decoding of MDMs (Fast-dLLM, arXiv 2505.22618, its ``get_transfer_index``): each call
commits every eligible masked position whose confidence is at least τ, and at least the most confident one; the factor
rule (its ``get_transfer_index_dynamic``) commits instead the longest prefix of the confidences sorted best first with
c₍ₙ₎ ≥ 1 − f / (n + 1) for every n ≥ 2, and all of them where only the last one fails. The confidence is p of the
position's candidate token: the argmax at T = 0; at T > 0 the token drawn at T, whose untempered p the reference
thresholds and ranks (``confidence="sampled"``, the default; ``"max_prob"``, the suite's earlier rule, thresholds
max_v p and draws at the committing positions only). The loop, blocks and budget: ``mdm_adaptive.py``."""

from __future__ import annotations

import torch
from torch import Tensor

from flowlm.samplers.common import check_finite
from flowlm.samplers.mdm_adaptive import AdaptiveMDMSampler, CallStats

CONFIDENCES = ("sampled", "max_prob")


class ThresholdSampler(AdaptiveMDMSampler):
    """Commit every eligible position with confidence ≥ ``threshold`` (τ; at least one per call), or with ``factor``
    f the NVlabs factor rule above. With ``score`` margin or entropy the rule's count n is kept and the n best
    positions by that rank commit (which may differ from those above τ). τ above every confidence commits the
    budget schedule's ⌈#masked / calls left⌉ (the confidence sampler's); τ ≤ 0 commits a whole block per call.
    ``confidence``: what the rule reads at T > 0 (above). ``cache`` / ``refresh`` with ``block_length``: the block KV
    cache (``mdm_adaptive.py``)."""

    def __init__(
        self,
        *,
        threshold: float = 0.9,
        factor: float | None = None,
        score: str = "max_prob",
        confidence: str = "sampled",
        **options,
    ) -> None:
        super().__init__(score=score, **options)  # block_length, temperature, cache, refresh: AdaptiveMDMSampler
        if factor is not None and check_finite("factor", factor) <= 0:
            raise ValueError(f"factor must be > 0 (or null: the threshold rule), got {factor}")
        if confidence not in CONFIDENCES:
            raise ValueError(f"confidence must be one of {CONFIDENCES}, got {confidence!r}")
        self.threshold, self.factor, self.confidence = check_finite("threshold", threshold), factor, confidence
        self.rule_reads_draw = confidence == "sampled"

    def select(self, stats: CallStats, ordered: Tensor, eligible: Tensor) -> Tensor:  # noqa: D102
        if self.factor is None:
            return (eligible & (stats.confidence >= self.threshold)).sum(-1)
        c = torch.where(eligible, stats.confidence, -torch.inf).sort(dim=-1, descending=True).values  # c₍₁₎ ≥ c₍₂₎ …
        n = torch.arange(1, c.shape[-1] + 1, device=c.device, dtype=c.dtype)
        holds = (c >= 1 - self.factor / (n + 1)) | (n == 1)  # the first always commits
        prefix = holds.long().cumprod(-1).sum(-1)  # the longest prefix where the rule holds
        n_eligible = eligible.sum(-1)
        return torch.where(prefix >= n_eligible - 1, n_eligible, prefix)  # only the last failing: it commits too
