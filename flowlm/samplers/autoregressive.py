"""Left-to-right ancestral sampling for the autoregressive baseline (the papers' AR rows)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from flowlm.samplers.base import SampleOutput, Sampler, check_temperature, pick_tokens


@dataclass(frozen=True)
class CausalDenoiser:
    """An AR model as samplers see it: ``fn(tokens (B, L)) → logits (B, L, |V|)`` where position i predicts token i
    from tokens[:, :i] (the model shifts its input internally; what sits at i and after is never read)."""

    fn: Callable[[Tensor], Tensor]


class AutoregressiveSampler(Sampler):
    """One network call per generated position, left to right; prompt positions are copied, never predicted.

    ``temperature`` 0 is greedy decoding; > 0 samples from softmax(logits / temperature) (float64 Gumbel), with
    optional ``top_k``. The NFE spent is the number of positions that are free in some row; a budget below the
    number of free positions cannot be honoured (AR cannot skip tokens) and is refused before compute.
    """

    family = "ar"

    def __init__(self, *, temperature: float = 1.0, top_k: int | None = None) -> None:
        self.temperature = check_temperature(temperature)
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be ≥ 1 or null, got {top_k}")
        self.top_k = top_k

    def check_budget(self, nfe: int, *, free_positions: int | None = None) -> None:
        """AR spends one NFE per generated token: the budget must cover every free position."""
        super().check_budget(nfe)
        if free_positions is not None and nfe < free_positions:
            raise ValueError(
                f"AutoregressiveSampler: NFE budget {nfe} is below the {free_positions} positions to generate "
                "(one network call per token); use a budget ≥ the response length"
            )

    @torch.no_grad()
    def __call__(
        self, model: CausalDenoiser, *, prompt: Tensor, prompt_mask: Tensor, nfe: int, generator: torch.Generator
    ) -> SampleOutput:
        """Generate every non-prompt position left to right."""
        free_cols = (~prompt_mask).any(0).nonzero().squeeze(-1).tolist()
        self.check_budget(nfe, free_positions=len(free_cols))
        x = torch.where(prompt_mask, prompt, 0)
        confidence = prompt_mask.float()
        for i in free_cols:
            log_p = torch.log_softmax(model.fn(x)[:, i].double(), -1)
            if self.top_k is not None and self.top_k < log_p.shape[-1]:
                kth = log_p.topk(self.top_k, -1).values[:, -1:]
                log_p = torch.log_softmax(log_p.masked_fill(log_p < kth, -torch.inf), -1)
            token = pick_tokens(log_p, self.temperature, generator)
            free = ~prompt_mask[:, i]
            x[:, i] = torch.where(free, token, x[:, i])
            p = log_p.gather(-1, token[:, None]).squeeze(-1).exp().float()
            confidence[:, i] = torch.where(free, p, confidence[:, i])
        return SampleOutput(tokens=x, confidence=confidence, nfe=len(free_cols))
