"""Semi-autoregressive confidence sampling for MDMs (LLaDA's ``generate``: blocks left to right, low-confidence
remasking inside each block; methods.md §2)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from flowlm.samplers.base import (
    MaskedDenoiser,
    SampleOutput,
    Sampler,
    check_score,
    check_temperature,
    masked_start,
    pick_tokens,
)


class SemiARConfidenceSampler(Sampler):
    """Non-prompt positions in blocks of ``block_length``, left to right; each block gets K = budget // blocks steps,
    and at step k commits the ⌈#masked in block / (K − k)⌉ most confident of its masked positions (LLaDA's
    ``get_num_transfer_tokens`` split: the remainder goes to the first steps). Later blocks stay [MASK] and are
    seen by the network. Candidates: argmax at T = 0, else a float64 Gumbel draw from softmax(logits / T);
    ``score`` "sampled" ranks by p_θ(candidate) (LLaDA's low_confidence remasking), "max_prob" by max_v p_θ(v).
    NFE = blocks × K.
    """

    family = "mdm"
    confidence_kind = "a-priori"

    def __init__(self, *, block_length: int, temperature: float = 0.0, score: str = "sampled") -> None:
        if block_length < 1:
            raise ValueError(f"block_length must be ≥ 1, got {block_length}")
        self.block_length = block_length
        self.temperature = check_temperature(temperature)
        self.score = check_score(score)

    def plan(self, nfe: int, free_positions: int) -> tuple[int, int]:
        """(blocks, steps per block) for a budget, or a clear error before any compute."""
        super().check_budget(nfe)
        n_blocks = max(1, math.ceil(free_positions / self.block_length))
        if nfe < n_blocks:
            raise ValueError(f"{n_blocks} blocks of {self.block_length} need at least {n_blocks} NFE, got {nfe}")
        return n_blocks, nfe // n_blocks

    def check_budget(self, nfe: int, *, free_positions: int | None = None) -> None:  # noqa: D102
        if free_positions is None:
            super().check_budget(nfe)
        else:
            self.plan(nfe, free_positions)

    def __call__(
        self,
        model: MaskedDenoiser,
        *,
        prompt: Tensor,
        prompt_mask: Tensor,
        nfe: int,
        generator: torch.Generator | None = None,
    ) -> SampleOutput:
        """Sample with blocks × K network calls."""
        free = ~prompt_mask
        n_blocks, steps = self.plan(nfe, int(free.sum(-1).max()) if free.numel() else 0)
        block_id = torch.where(free, (free.cumsum(-1) - 1) // self.block_length, -1)
        x, confidence = masked_start(prompt, prompt_mask, model.mask_id)
        n_free = free.sum(-1).clamp_min(1)
        positions = torch.arange(x.shape[1], device=x.device)
        calls = 0
        for b in range(n_blocks):
            in_block = block_id == b
            for k in range(steps):
                masked = x == model.mask_id
                eligible = masked & in_block
                logits = model.fn(x, masked.sum(-1) / n_free)
                calls += 1
                log_p = torch.log_softmax(logits.double(), -1)
                candidate = pick_tokens(log_p, self.temperature, generator)
                p_candidate = log_p.gather(-1, candidate[..., None]).squeeze(-1)
                score = p_candidate if self.score == "sampled" else log_p.amax(-1)
                score = torch.where(eligible, score, -torch.inf)
                left = steps - k
                n_commit = torch.div(eligible.sum(-1) + left - 1, left, rounding_mode="floor")  # ⌈masked / left⌉
                order = score.argsort(dim=-1, descending=True)
                rank = torch.empty_like(order).scatter_(-1, order, positions.expand_as(order))
                commit = eligible & (rank < n_commit[:, None])
                x = torch.where(commit, candidate, x)
                confidence = torch.where(commit, p_candidate.exp().float(), confidence)
        return SampleOutput(tokens=x, confidence=confidence, nfe=calls)
