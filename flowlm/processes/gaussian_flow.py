"""Gaussian → one-hot flow (t = 0 noise, t = 1 data), its two-time flow map and the batch split (methods.md §3–4).

The loss built on them (semigroup targets, context set) is flowlm/objectives/fmlm_plus.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from flowlm.processes.base import NoisedBatch, NoiseProcess

# Kinds of training pairs (s, t) in one batch.
DIAGONAL, BOUNDARY, OFF_DIAGONAL, DISTILL = 0, 1, 2, 3
KIND_NAMES = ("diagonal", "boundary", "off_diagonal", "distill")


def one_hot(ids: Tensor, num_classes: int) -> Tensor:
    """Float one-hot vectors (…, num_classes) of ids, zero for ids outside [0, num_classes). By comparison:
    ``F.one_hot`` range-checks the ids by reading their min and max back to the host (two syncs per call on a GPU,
    every round of a sampler)."""
    return (ids[..., None] == torch.arange(num_classes, device=ids.device)).float()


def noisy_state(onehot: Tensor, noise: Tensor, time: Tensor) -> Tensor:
    """x_t = (1 − t)·ε + t·onehot(y), with per-token times (B, L)."""
    time = time[..., None].to(onehot.dtype)
    return (1 - time) * noise + time * onehot


def flow_map(x: Tensor, delta: Tensor, s: Tensor, t: Tensor) -> Tensor:
    """X_{s,t}(x) = ((1−t)/(1−s))·x + ((t−s)/(1−s))·δ_{s,t}(x); per-token (B, L) times.

    Tokens at s = 1 (prompt, context, committed) are already data and stay where they are: X_{1,1} = identity.
    """
    s, t = s[..., None].to(x.dtype), t[..., None].to(x.dtype)
    done = s >= 1
    denom = torch.where(done, torch.ones_like(s), 1 - s)
    out = ((1 - t) / denom) * x + ((t - s) / denom) * delta
    return torch.where(done, x, out)


@dataclass(frozen=True)
class GaussianFlowProcess(NoiseProcess):
    """The flow's state operations on one-hot vectors of a ``vocab_size`` vocabulary: the noisy state and the flow
    map (an objective calls these two, so a process on another state space can stand in)."""

    vocab_size: int

    def noise(
        self,
        tokens: Tensor,
        times: Tensor,
        keep: Tensor,
        *,
        generator: torch.Generator | None = None,
        draws: Tensor | None = None,
        embeddings: Tensor | None = None,
    ) -> NoisedBatch:
        """x_t = (1 − t)·ε + t·onehot(y) off ``keep``, the exact one-hot on it; times (B, L) per token or (B,).
        ``draws``: ε (B, L, |V|) when the caller drew it, else drawn from ``generator``."""
        onehot = one_hot(tokens, self.vocab_size)
        if draws is None:
            draws = torch.randn(onehot.shape, generator=generator, device=tokens.device)
        times = times if times.dim() == tokens.dim() else times[:, None]
        return NoisedBatch(
            state=torch.where(keep[..., None], onehot, noisy_state(onehot, draws, times)), clean=onehot, noised=~keep
        )

    def flow_map(self, x: Tensor, delta: Tensor, s: Tensor, t: Tensor) -> Tensor:
        """X_{s,t}(x) (``flow_map``)."""
        return flow_map(x, delta, s, t)


def split_counts(global_batch: int, *, diagonal: float = 0.5, boundary: float = 1 / 64, distill: float = 0.0):
    """Exact counts of (diagonal, boundary, off-diagonal, distill) sequences in a global batch.

    As in the released code: ⌊distill·B⌋ distill rows first; of the rest R, ⌊diagonal·R⌋ diagonal and
    ⌊boundary·R⌋ boundary rows; the remainder is off-diagonal (B = 256: 128 / 4 / 124 / 0).
    """
    for name, share in (("diagonal", diagonal), ("boundary", boundary), ("distill", distill)):
        if not 0 <= share <= 1:
            raise ValueError(f"the {name} share must lie in [0, 1], got {share}")
    if diagonal + boundary > 1:
        raise ValueError(f"diagonal {diagonal} + boundary {boundary} shares exceed the batch")
    n_dist = math.floor(distill * global_batch)
    rest = global_batch - n_dist
    n_diag = math.floor(diagonal * rest)
    n_bound = math.floor(boundary * rest)
    return n_diag, n_bound, rest - n_diag - n_bound, n_dist


def batch_uniforms(n: int, *, generator: torch.Generator, antithetic: bool = True) -> Tensor:
    """n float64 U(0, 1) draws: i.i.d., or ``antithetic`` (the released code's ``training.antithetic_sampling``):
    one per stratum [i/n, (i+1)/n) of [0, 1), in random order, so each draw is still U(0, 1) but the batch covers
    the interval evenly."""
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    if not antithetic:
        return u
    return ((torch.arange(n, dtype=torch.float64) + u) / n)[torch.randperm(n, generator=generator)]


def batch_kinds_and_times(
    global_batch: int,
    *,
    offset: int,
    count: int,
    generator: torch.Generator,
    diagonal: float = 0.5,
    boundary: float = 1 / 64,
    distill: float = 0.0,
    antithetic: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """Kinds and (s, t) for a slice [offset, offset+count) of one global draw (identical on every rank).

    diagonal: s = t ~ U(0, 1); boundary: s = 0, t = 1; off-diagonal: t−s ~ U(0, 1), s ~ U(0, 1−(t−s));
    distill: s = t = 0 (δ_{0,0} against an MDM teacher). The two uniforms behind the times are stratified over the
    global batch with ``antithetic`` (``batch_uniforms``), as in the released code.
    """
    counts = split_counts(global_batch, diagonal=diagonal, boundary=boundary, distill=distill)
    kinds = torch.repeat_interleave(torch.arange(4), torch.tensor(counts), output_size=global_batch)
    kinds = kinds[torch.randperm(global_batch, generator=generator)]
    u1 = batch_uniforms(global_batch, generator=generator, antithetic=antithetic)
    u2 = batch_uniforms(global_batch, generator=generator, antithetic=antithetic)
    gap = u1
    s_off = u2 * (1 - gap)
    s = torch.where(kinds == DIAGONAL, u1, torch.where(kinds == OFF_DIAGONAL, s_off, torch.zeros_like(u1)))
    t = torch.where(
        kinds == DIAGONAL,
        u1,
        torch.where(kinds == OFF_DIAGONAL, s_off + gap, torch.where(kinds == BOUNDARY, 1.0, 0.0)),
    )
    sl = slice(offset, offset + count)
    return kinds[sl], s[sl].float(), t[sl].float()
