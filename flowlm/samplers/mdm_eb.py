"""The EB-sampler for MDMs (entropy-bounded unmasking, arXiv 2505.24857): positions ranked by an error proxy (the
``score``: entropy by default, or max_prob, or margin), each call commits the largest best-first prefix U of the
eligible positions whose entropies satisfy Σ_{i∈U} H(p_i) − max_{i∈U} H(p_i) ≤ γ (at least one). γ = 0 commits one
position per call wherever the entropies are positive. The loop, blocks and budget: ``mdm_adaptive.py``."""

from __future__ import annotations

from torch import Tensor

from flowlm.samplers.common import check_finite
from flowlm.samplers.mdm_adaptive import AdaptiveMDMSampler, CallStats, sorted_eligible


class EBSampler(AdaptiveMDMSampler):
    """Commit the largest prefix of the ranked eligible positions with Σ H − max H ≤ ``gamma`` (γ ≥ 0). ``cache`` /
    ``refresh`` with ``block_length``: the block KV cache (``mdm_adaptive.py``)."""

    rule_reads_entropy = True

    def __init__(self, *, gamma: float = 0.1, score: str = "entropy", **options) -> None:
        super().__init__(score=score, **options)  # block_length, temperature, cache, refresh: AdaptiveMDMSampler
        if check_finite("gamma", gamma) < 0:
            raise ValueError(f"gamma must be ≥ 0, got {gamma}")
        self.gamma = float(gamma)

    def select(self, stats: CallStats, ordered: Tensor, eligible: Tensor) -> Tensor:  # noqa: D102
        h = sorted_eligible(stats.entropy, ordered, eligible, fill=float("inf"))
        spent = h.cumsum(-1) - h.cummax(-1).values  # non-decreasing along the prefix
        return (spent <= self.gamma).sum(-1)
