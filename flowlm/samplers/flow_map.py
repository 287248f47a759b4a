"""Multi-step flow map (FMLM, one NFE per jump) and FLM Euler on the diagonal denoiser (methods.md §3)."""

from __future__ import annotations

import torch
from torch import Tensor

from flowlm.processes.gaussian_flow import flow_map
from flowlm.samplers.base import FlowDenoiser, SampleOutput, Sampler


def flow_jumps(model: FlowDenoiser, x: Tensor, pinned: Tensor, steps: int, *, euler: bool = False) -> Tensor:
    """Jump the unpinned tokens of x from 0 to 1 over a uniform grid of ``steps`` (one NFE each); pinned tokens
    stay at s = t = 1. Returns the last log δ (at t = 1 the endpoint X_{s,1} = δ_{s,1}; callers that need only its
    argmax and the probability there read them off the logarithm, no (B, L, |V|) exp). ``euler`` uses the diagonal
    denoiser δ_{t_k,t_k} = D_{t_k} in the jump (FLM's Euler step of the velocity (D − z)/(1 − t)).

    x is a state of the model's space (``model.states``): the jump X = a·x + b·δ is linear, so in the embedding
    space it reads a·h + b·(δ·E), one δ·E product per intermediate jump (none for a single jump)."""
    log_delta = x
    for k in range(steps):
        log_delta = model.at(x, k / steps, k / steps if euler else (k + 1) / steps, pinned)
        if k < steps - 1:  # the last jump's endpoint X_{s,1} is δ itself: no (B, L, |V|) map to compute
            s = torch.where(pinned, 1.0, torch.full_like(x[..., 0], k / steps))
            t_next = torch.where(pinned, 1.0, torch.full_like(x[..., 0], (k + 1) / steps))
            x = flow_map(x, model.states.lift(log_delta.exp()), s, t_next)
    return log_delta


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
        space = model.states
        clean, noise = space.data(prompt), space.noise(prompt.shape, generator, prompt.device)
        log_delta = flow_jumps(
            model, torch.where(prompt_mask[..., None], clean, noise), prompt_mask, nfe, euler=self.euler
        )
        log_max, tokens = log_delta.max(-1)
        confidence = torch.where(prompt_mask, 1.0, log_max.exp())  # prompt positions: the prompt token at p = 1
        return SampleOutput(tokens=torch.where(prompt_mask, prompt, tokens), confidence=confidence, nfe=nfe)
