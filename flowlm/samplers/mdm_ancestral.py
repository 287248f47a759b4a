"""MDLM ancestral sampler with the no-change cache (methods.md §2)."""

from __future__ import annotations

import torch
from torch import Tensor

from flowlm.samplers.base import (
    MaskedDenoiser,
    SampleOutput,
    Sampler,
    check_temperature,
    masked_start,
    pick_tokens,
)


class AncestralSampler(Sampler):
    """Time grid 1 → 0 in ``nfe`` steps; a masked token unmasks with probability (α_s − α_t)/(1 − α_t).

    Under α_t = 1 − t that probability is (t − s)/t; the last step goes to s = 0, where it is 1, so every token
    is decoded within the budget and no extra "noise removal" call is spent. A step in which no token changed
    leaves the input unchanged, so a time-agnostic network's output is reused at no NFE (``ddpm_cache``).
    """

    family = "mdm"

    def __init__(self, *, temperature: float = 1.0, cache: bool = True) -> None:
        self.temperature = check_temperature(temperature)
        self.cache = cache

    def __call__(
        self,
        model: MaskedDenoiser,
        *,
        prompt: Tensor,
        prompt_mask: Tensor,
        nfe: int,
        generator: torch.Generator | None = None,
    ) -> SampleOutput:
        """Sample with at most ``nfe`` network calls."""
        self.check_budget(nfe)
        x, confidence = masked_start(prompt, prompt_mask, model.mask_id)
        batch = x.shape[0]
        log_p: Tensor | None = None
        calls = 0
        for k in range(nfe):
            t, s = 1.0 - k / nfe, 1.0 - (k + 1) / nfe
            masked = x == model.mask_id
            if log_p is None:
                log_p = torch.log_softmax(model.fn(x, torch.full((batch,), t, device=x.device)).double(), -1)
                calls += 1
            draw = pick_tokens(log_p, self.temperature, generator)
            p_unmask = (t - s) / t  # (α_s − α_t)/(1 − α_t) with α = 1 − t
            u = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float64)
            unmask = masked & (u < p_unmask)
            x = torch.where(unmask, draw, x)
            confidence = torch.where(unmask, log_p.gather(-1, draw[..., None]).squeeze(-1).exp().float(), confidence)
            if not (x == model.mask_id).any():
                break
            # Cache: the next call would see the same input; exact only for a time-agnostic network.
            if not (self.cache and not model.time_conditioned and not unmask.any()):
                log_p = None
        return SampleOutput(tokens=x, confidence=confidence, nfe=calls)
