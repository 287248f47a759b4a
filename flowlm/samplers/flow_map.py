"""Multi-step flow map (FMLM, one NFE per jump) and FLM Euler on the diagonal denoiser (methods.md §3)."""

from __future__ import annotations

import torch
from torch import Tensor

from flowlm.processes.gaussian_flow import flow_map, one_hot
from flowlm.samplers.base import FlowDenoiser, SampleOutput, Sampler


def flow_jumps(model: FlowDenoiser, x: Tensor, pinned: Tensor, steps: int, *, euler: bool = False) -> Tensor:
    """Jump the unpinned tokens of x from 0 to 1 over a uniform grid of ``steps`` (one NFE each); pinned tokens
    stay at s = t = 1. Returns the last δ (at t = 1 the endpoint X_{s,1} = δ_{s,1}). ``euler`` uses the diagonal
    denoiser δ_{t_k,t_k} = D_{t_k} in the jump (FLM's Euler step of the velocity (D − z)/(1 − t))."""
    delta = x
    for k in range(steps):
        delta = model.at(x, k / steps, k / steps if euler else (k + 1) / steps, pinned).exp()
        if k < steps - 1:  # the last jump's endpoint X_{s,1} is δ itself: no (B, L, |V|) map to compute
            s = torch.where(pinned, 1.0, torch.full_like(x[..., 0], k / steps))
            t_next = torch.where(pinned, 1.0, torch.full_like(x[..., 0], (k + 1) / steps))
            x = flow_map(x, delta, s, t_next)
    return delta


class FlowMapSampler(Sampler):
    """z ← X_{t_k, t_{k+1}}(z) over a uniform grid 0 → 1 of ``nfe`` jumps (every non-prompt token at once).

    ``euler=True`` is the FLM sampler: the jump uses the diagonal denoiser δ_{t_k,t_k} = D_{t_k} in place of
    δ_{t_k,t_{k+1}}, i.e. an Euler step of the velocity (D − z)/(1 − t). The output is the argmax at t = 1.
    """

    family = "flow"
    confidence_kind = "a-posteriori"  # max_v δ of the finished draft at t = 1

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
        onehot = one_hot(prompt, model.vocab_size)
        noise = torch.randn(onehot.shape, generator=generator, device=prompt.device, dtype=torch.float64).float()
        delta = flow_jumps(
            model, torch.where(prompt_mask[..., None], onehot, noise), prompt_mask, nfe, euler=self.euler
        )
        confidence, tokens = delta.max(-1)  # prompt positions: their one-hot, i.e. the prompt token at p = 1
        confidence = torch.where(prompt_mask, 1.0, confidence)
        return SampleOutput(tokens=torch.where(prompt_mask, prompt, tokens), confidence=confidence, nfe=nfe)
