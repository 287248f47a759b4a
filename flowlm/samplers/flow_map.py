"""Multi-step flow map (FMLM, one NFE per jump) and FLM Euler on the diagonal denoiser (methods.md §3)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from flowlm.processes.gaussian_flow import flow_map
from flowlm.samplers.base import FlowDenoiser, SampleOutput, Sampler


class FlowMapSampler(Sampler):
    """z ← X_{t_k, t_{k+1}}(z) over a uniform grid 0 → 1 of ``nfe`` jumps (every non-prompt token at once).

    ``euler=True`` is the FLM sampler: the jump uses the diagonal denoiser δ_{t_k,t_k} = D_{t_k} in place of
    δ_{t_k,t_{k+1}}, i.e. an Euler step of the velocity (D − z)/(1 − t). The output is the argmax at t = 1.
    """

    family = "flow"

    def __init__(self, *, euler: bool = False) -> None:
        self.euler = euler

    def __call__(
        self,
        model: FlowDenoiser,
        *,
        prompt: Tensor,
        prompt_mask: Tensor,
        nfe: int,
        generator: torch.Generator | None = None,
    ) -> SampleOutput:
        """Sample with exactly ``nfe`` network calls."""
        self.check_budget(nfe)
        onehot = F.one_hot(prompt.clamp(0, model.vocab_size - 1), model.vocab_size).float()
        noise = torch.randn(onehot.shape, generator=generator, device=prompt.device, dtype=torch.float64).float()
        z = torch.where(prompt_mask[..., None], onehot, noise)
        ones = torch.ones(prompt.shape, device=prompt.device)
        delta = onehot
        for k in range(nfe):
            t_k, t_next = k / nfe, (k + 1) / nfe
            s = torch.where(prompt_mask, 1.0, t_k * ones)
            t = torch.where(prompt_mask, 1.0, (t_k if self.euler else t_next) * ones)
            delta = model.fn(z, s, t).exp()
            z = flow_map(z, delta, s, torch.where(prompt_mask, 1.0, t_next * ones))
        probs = torch.where(prompt_mask[..., None], onehot, delta)
        confidence, tokens = probs.max(-1)
        return SampleOutput(tokens=torch.where(prompt_mask, prompt, tokens), confidence=confidence, nfe=nfe)
