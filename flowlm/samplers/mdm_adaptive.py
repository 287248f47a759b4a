"""Adaptive-NFE decoding of MDMs: each network call commits as many masked positions as a rule allows (the threshold
sampler, ``mdm_threshold.py``; the EB-sampler, ``mdm_eb.py``), so a row spends as many calls as its content needs.

One call, per row:

    p = softmax(logits)            at the masked positions (float64)
    rank                           by ``score``: max_v p (max_prob), p₍₁₎ − p₍₂₎ (margin), −H(p) (entropy); best first
    eligible                       the masked positions of the row's current block (the first block, of ``block_length``
                                   positions from the row's first non-prompt position, that still holds [MASK]; all
                                   masked positions without blocks)
    n                              the rule's count (``select``), at least 1, and at least ⌈#masked / calls left⌉
    commit                         the n best eligible positions, each to argmax p (T = 0) or a draw from p^(1/T)

The NFE budget is a cap: the lower bound ⌈#masked / calls left⌉ is the fixed-step confidence sampler's schedule, and
the budget's last call commits every masked position (every block), as that sampler's last step does; no row ever
spends more than the budget. ``SampleOutput.row_nfe`` holds the calls each row needed (a row stops counting once it
holds no [MASK]); ``nfe`` is the calls the batch made.

``cache`` "prefix" | "dual" with ``block_length`` (block_cache.py, Fast-dLLM's block KV cache, as ``semi_ar``'s): a
row's first call in a block (and every ``refresh`` calls) is a full pass for it, its other calls run its block and
what follows (prefix) or its block alone (dual) over the keys kept from that pass; the budget's last call, which
commits beyond the block, is a full pass. Rows enter blocks at different calls; each keeps its own schedule. The
calls, and so the NFE, are the same as without the cache; approximate unless ``refresh=1``.

Per-row generators (``flowlm.ops.draws.Generators``): at T > 0 each call draws from each row's generator its |V|
Gumbel uniforms per position, read where the row commits; a row's calls, rule and blocks are its own, so it decodes
alike (tokens and ``row_nfe``) alone and inside any batch.
"""

from __future__ import annotations

from abc import abstractmethod

import torch
from torch import Tensor

from flowlm.ops.draws import check_generators, pick_tokens, row_uniforms
from flowlm.samplers.base import MaskedDenoiser, SampleOutput
from flowlm.samplers.block_cache import BlockCachedReader, check_cache
from flowlm.samplers.common import check_temperature, masked_start
from flowlm.samplers.planned import PlannedSampler

RANKS = ("max_prob", "margin", "entropy")


def check_rank(score: str) -> str:
    """How positions are ranked for committing: by max_v p (max_prob), the top-two margin p₍₁₎ − p₍₂₎ (margin,
    arXiv 2502.06768), or the negative entropy −H(p) (entropy, the EB-sampler's default error proxy)."""
    if score not in RANKS:
        raise ValueError(f"score must be one of {RANKS}, got {score!r}")
    return score


def position_scores(log_p: Tensor, score: str) -> Tensor:
    """The ranking score of every position (higher commits first) from its log-probabilities (…, |V|)."""
    if score == "max_prob":
        return log_p.amax(-1).exp()
    if score == "margin":
        top2 = log_p.topk(2, dim=-1).values.exp()
        return top2[..., 0] - top2[..., 1]
    return -entropy(log_p)  # 0 for a certain position, −log |V| for a uniform one; a −inf logit (a [MASK] row) adds 0


def entropy(log_p: Tensor) -> Tensor:
    """H(p) = −Σ_v p_v log p_v per position, in nats (0·log 0 = 0)."""
    return -(log_p.exp() * log_p.nan_to_num(neginf=0.0)).sum(-1)


class AdaptiveMDMSampler(PlannedSampler):
    """The loop above; a subclass gives the rule's count per row (``select``)."""

    family = "mdm"
    confidence_kind = "a-priori"  # p_θ(token) when it is committed, before the masked rest is drawn
    row_generators = True  # ``generator`` may be one per row (flowlm.ops.draws.Generators)

    def __init__(
        self,
        *,
        score: str = "max_prob",
        block_length: int | None = None,
        temperature: float = 0.0,
        cache: str = "none",
        refresh: int | None = None,
    ):
        self.score = check_rank(score)
        if block_length is not None and block_length < 1:
            raise ValueError(f"block_length must be ≥ 1 (or null: one block), got {block_length}")
        self.block_length = block_length
        self.temperature = check_temperature(temperature)
        self.cache, self.refresh = check_cache(cache, refresh), refresh
        if cache != "none" and block_length is None:
            raise ValueError(f"cache={cache!r} (the block KV cache) needs semi-AR blocks: set block_length")

    @abstractmethod
    def select(self, log_p: Tensor, ordered: Tensor, eligible: Tensor) -> Tensor:
        """How many of each row's eligible positions the rule commits (B,), given log p (B, L, |V|) and the
        positions ``ordered`` best first (B, L; the eligible ones lead)."""

    def sample(self, model: MaskedDenoiser, prompt: Tensor, prompt_mask: Tensor, nfe: int, generator) -> SampleOutput:
        """Decode with at most ``nfe`` network evaluations (fewer where the rule commits faster)."""
        check_generators(generator, prompt.shape[0], prompt.device)
        x, confidence = masked_start(prompt, prompt_mask, model.mask_id)
        b, length = x.shape
        n_free = (~prompt_mask).sum(-1).clamp_min(1)
        positions = torch.arange(length, device=x.device)
        if self.block_length is None:
            block = torch.zeros_like(x)
        else:
            first = torch.where(prompt_mask, length, positions).amin(-1, keepdim=True)  # first non-prompt position
            block = (positions - first).clamp_min(0) // self.block_length
        row_nfe = torch.zeros(b, dtype=torch.long, device=x.device)
        reader = None if self.cache == "none" else BlockCachedReader(model, self.cache, self.refresh, length)
        fn, entered = (model.fn, None) if reader is None else (reader, torch.full_like(n_free, -1))
        calls = 0
        while calls < nfe:
            masked = x == model.mask_id
            left = masked.any(-1)
            if not bool(left.any()):  # one host read per call: how many calls a batch needs is what is measured
                break
            current = torch.where(masked, block, block.max() + 1).amin(-1, keepdim=True)
            if reader is not None:  # rows entering a block, or the last call (a full pass): refresh
                lo = (first + current * self.block_length).clamp(max=length)[:, 0]
                hi = (lo + self.block_length).clamp(max=length)
                reader.block(lo, hi, None if calls + 1 == nfe else current[:, 0] != entered)
                entered = current[:, 0]
            logits = fn(x, masked.sum(-1) / n_free)
            calls += 1
            row_nfe += left
            log_p = torch.log_softmax(logits.double(), -1)
            per_row = row_uniforms(generator, log_p.shape, x.device, self.temperature)
            candidate = pick_tokens(log_p, self.temperature, generator, uniforms=per_row)
            if calls == nfe:  # the budget's last call commits the rest, as the fixed-step sampler's last step does
                eligible = masked
            else:
                eligible = masked & (block == current)
            score = torch.where(eligible, position_scores(log_p, self.score), -torch.inf)
            ordered = score.argsort(dim=-1, descending=True)
            n_eligible = eligible.sum(-1)
            floor = torch.div(masked.sum(-1) + (nfe - calls), nfe - calls + 1, rounding_mode="floor")
            n_commit = torch.maximum(self.select(log_p, ordered, eligible).clamp_min(1), floor)
            n_commit = n_eligible if calls == nfe else torch.minimum(n_commit, n_eligible)
            rank = torch.empty_like(ordered).scatter_(-1, ordered, positions.expand_as(ordered))
            commit = eligible & (rank < n_commit[:, None])
            p_candidate = log_p.gather(-1, candidate[..., None]).squeeze(-1).exp().float()
            x = torch.where(commit, candidate, x)
            confidence = torch.where(commit, p_candidate, confidence)
        return SampleOutput(tokens=x, confidence=confidence, nfe=calls, row_nfe=row_nfe)


def sorted_eligible(values: Tensor, ordered: Tensor, eligible: Tensor, fill: float) -> Tensor:
    """``values`` (B, L) in the ranking's order, ``fill`` past each row's eligible positions."""
    n_eligible = eligible.sum(-1, keepdim=True)
    ranks = torch.arange(values.shape[-1], device=values.device)
    return torch.where(ranks < n_eligible, values.gather(-1, ordered), fill)
