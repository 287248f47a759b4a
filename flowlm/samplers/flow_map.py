"""Multi-step flow map (FMLM, one NFE per jump) and FLM Euler on the diagonal denoiser (methods.md §3)."""

from __future__ import annotations

import torch
from torch import Tensor

from flowlm.processes.gaussian_flow import flow_map
from flowlm.samplers.base import FlowDenoiser, SampleOutput
from flowlm.samplers.common import slots
from flowlm.samplers.planned import PlannedSampler


def flow_jumps(model: FlowDenoiser, x: Tensor, pinned: Tensor, steps: int, *, euler: bool = False) -> Tensor:
    """Jump the unpinned tokens of x from 0 to 1 over a uniform grid of ``steps`` (one NFE each); pinned tokens
    stay at s = t = 1. Returns the last log δ (at t = 1 the endpoint X_{s,1} = δ_{s,1}). ``euler`` uses the diagonal
    denoiser δ_{t_k,t_k} = D_{t_k} in the jump (FLM's Euler step of the velocity (D − z)/(1 − t)).

    x is a state of the model's space (``model.states``): the jump X = a·x + b·δ is linear, so in the embedding
    space it reads a·h + b·(δ·E), one δ·E product per intermediate jump (none for a single jump), which the model's
    head computes chunk by chunk where it can (``FlowDenoiser.lifted_at``)."""
    x, s, t = _to_last_jump(model, x, pinned, steps, euler)
    return model.at(x, s, t, pinned)


def flow_jumps_summary(
    model: FlowDenoiser, x: Tensor, pinned: Tensor, steps: int, *, euler: bool = False, rows: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``flow_jumps`` read off as (max_v log δ, argmax_v) per position, all a greedy draft needs from the last
    jump: its endpoint X_{s,1} is δ itself, so no (B, L, |V|) log δ is made there (``FlowDenoiser.summary_at``);
    with ``rows`` at those flat positions only."""
    x, s, t = _to_last_jump(model, x, pinned, steps, euler)
    return model.summary_at(x, s, t, pinned, rows=rows)


def summary_at_slots(read, flag: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """A greedy draft's (max_v log δ, argmax_v) (B, L) read at the positions ``flag`` marks only: every row's are
    among its first ``width`` slots (``slots``, no host read), whose flat indices ``read(rows=…)`` takes (the
    ``rows`` of ``FlowDenoiser.summary_at``), so the head runs at B × ``width`` positions, not B × L. The other
    positions hold −∞ and token 0: the caller reads none of them."""
    batch, length = flag.shape
    slot, _ = slots(flag, max(width, 1))
    log_max, argmax = read(rows=(slot + torch.arange(batch, device=slot.device)[:, None] * length).view(-1))
    full = torch.full(flag.shape, -torch.inf, dtype=log_max.dtype, device=flag.device)
    return full.scatter(1, slot, log_max.view(slot.shape)), argmax.new_zeros(flag.shape).scatter(
        1, slot, argmax.view(slot.shape)
    )


def _to_last_jump(
    model: FlowDenoiser, x: Tensor, pinned: Tensor, steps: int, euler: bool
) -> tuple[Tensor, float, float]:
    """The first ``steps`` − 1 jumps of ``flow_jumps``: the state before the last and the last jump's (s, t)."""
    for k in range(steps - 1):
        delta = model.lifted_at(x, k / steps, k / steps if euler else (k + 1) / steps, pinned)
        s = torch.where(pinned, 1.0, torch.full_like(x[..., 0], k / steps))
        t_next = torch.where(pinned, 1.0, torch.full_like(x[..., 0], (k + 1) / steps))
        x = flow_map(x, delta, s, t_next)
    last = (steps - 1) / steps
    return x, last, last if euler else 1.0


class FlowMapSampler(PlannedSampler):
    """z ← X_{t_k, t_{k+1}}(z) over a uniform grid 0 → 1 of ``nfe`` jumps (every non-prompt token at once).

    ``euler=True`` is the FLM sampler: the jump uses the diagonal denoiser δ_{t_k,t_k} = D_{t_k} in place of
    δ_{t_k,t_{k+1}}, i.e. an Euler step of the velocity (D − z)/(1 − t). The output is the argmax at t = 1.
    """

    family = "flow"
    confidence_kind = "a-posteriori"  # max_v δ of the finished draft at t = 1

    def __init__(self, *, euler: bool = False) -> None:
        self.euler = euler

    def sample(self, model: FlowDenoiser, prompt: Tensor, prompt_mask: Tensor, nfe: int, generator) -> SampleOutput:
        """Sample with exactly ``nfe`` network calls."""
        space = model.states
        clean, noise = space.data(prompt), space.noise(prompt.shape, generator, prompt.device)
        log_max, tokens = flow_jumps_summary(
            model, torch.where(prompt_mask[..., None], clean, noise), prompt_mask, nfe, euler=self.euler
        )
        confidence = torch.where(prompt_mask, 1.0, log_max.exp())  # prompt positions: the prompt token at p = 1
        return SampleOutput(tokens=torch.where(prompt_mask, prompt, tokens), confidence=confidence, nfe=nfe)
