"""Left-to-right ancestral sampling for the autoregressive baseline (the papers' AR rows)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flowlm.ops.draws import pick_tokens
from flowlm.samplers.base import SampleOutput, Sampler
from flowlm.samplers.common import check_temperature


@dataclass(frozen=True)
class CausalDenoiser:
    """An AR model as samplers see it: ``fn(tokens (B, L)) → logits (B, L, |V|)`` where position i predicts token i
    from tokens[:, :i] (the model shifts its input internally; what sits at i and after is never read).

    Optional incremental decoding: ``new_cache(max_len)`` gives an empty cache (an object with a ``length``), and
    ``extend(tokens, stop, cache)`` returns the logits of positions cache.length … stop − 1 only — the same as
    ``fn(tokens)[:, cache.length:stop]`` — reading tokens[:, cache.length − 1 : stop − 1] and advancing the cache.
    """

    fn: Callable[[Tensor], Tensor]
    new_cache: Callable[[int], Any] | None = None
    extend: Callable[[Tensor, int, Any], Tensor] | None = None


class AutoregressiveSampler(Sampler):
    """One network call per generated position, left to right; prompt positions are copied, never predicted.

    ``temperature`` 0 is greedy decoding; > 0 samples from softmax(logits / temperature) (float64 Gumbel), with
    optional ``top_k``. The NFE spent is the number of positions that are free in some row; a budget below the
    number of free positions cannot be honoured (AR cannot skip tokens) and is refused before compute.

    ``kv_cache`` (default) decodes through the model's KV cache when it offers one (``CausalDenoiser.extend``):
    each call feeds only the positions the cache has not seen, O(L) per token instead of a full O(L²) forward.
    Same tokens as without it up to float rounding of the logits; ``kv_cache=False`` is the full-forward check.
    """

    family = "ar"
    # p(x_i | x_<i), scored before the later tokens exist: a-priori, like an MDM's (the evaluation recorded AR as
    # a-posteriori before samplers declared their kind, by the fallback "not an MDM").
    confidence_kind = "a-priori"

    def __init__(self, *, temperature: float = 1.0, top_k: int | None = None, kv_cache: bool = True) -> None:
        self.temperature = check_temperature(temperature)
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be ≥ 1 or null, got {top_k}")
        self.top_k = top_k
        self.kv_cache = kv_cache

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
        use_cache = self.kv_cache and model.extend is not None and model.new_cache is not None
        cache = model.new_cache(x.shape[1]) if use_cache and free_cols else None
        for i in free_cols:
            # One network call per generated position, cached or not, so NFE = generated positions, as the
            # papers count an AR model's NFE (one forward per token). With the cache a call feeds the positions
            # cache.length … i: on the first call that is the whole prompt up to the first free column (the
            # prefill rides on the first token's call), afterwards the token just committed plus any columns
            # that are prompt in every row. Rows whose prompt is longer are teacher-forced through the cache:
            # their prompt tokens sit in x before the call that reads them, exactly as in the full forward.
            logits = model.fn(x)[:, i] if cache is None else model.extend(x, i + 1, cache)[:, -1]
            log_p = torch.log_softmax(logits.double(), -1)
            if self.top_k is not None and self.top_k < log_p.shape[-1]:
                kth = log_p.topk(self.top_k, -1).values[:, -1:]
                log_p = torch.log_softmax(log_p.masked_fill(log_p < kth, -torch.inf), -1)
            token = pick_tokens(log_p, self.temperature, generator)
            free = ~prompt_mask[:, i]
            x[:, i] = torch.where(free, token, x[:, i])
            p = log_p.gather(-1, token[:, None]).squeeze(-1).exp().float()
            confidence[:, i] = torch.where(free, p, confidence[:, i])
        return SampleOutput(tokens=x, confidence=confidence, nfe=len(free_cols))
