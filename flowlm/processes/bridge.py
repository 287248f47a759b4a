"""Brownian bridge on token embeddings between [MASK] and the clean token (MLFM, methods.md §6).

Two variables: s = masking probability (which positions are noised), t = bridge time (t = 0 is the [MASK] end,
t = 1 is clean). For a masked position l with clean token y:

    z_t = (1 − t)·m + t·E_y + σ·sqrt(t(1 − t))·ε,     m = E[MASK],  ε ~ N(0, I)

Unmasked positions hold E_y exactly. The noise level is also written γ = log(σ²(1 − t)/t) (the log of the bridge's
variance-to-signal ratio), so t = σ² / (σ² + e^γ).
"""

from __future__ import annotations

import math
from dataclasses import InitVar, dataclass

import torch
from torch import Tensor

from flowlm.processes.base import NoisedBatch, NoiseProcess
from flowlm.removed import check_removed

TIME_DISTRIBUTIONS = ("uniform", "gamma_uniform", "gamma_mixture")
NEEDS_TABLE = "the bridge lives on embeddings: pass the embedding table and the row of [MASK] in it (mask_id)"


def gamma_of_t(t: Tensor, sigma: float) -> Tensor:
    """γ = log(σ²(1 − t)/t)."""
    return torch.log(sigma**2 * (1 - t) / t)


def t_of_gamma(gamma: Tensor, sigma: float) -> Tensor:
    """t = σ² / (σ² + e^γ): the inverse of gamma_of_t (γ → −∞ is clean, γ → +∞ is [MASK])."""
    return torch.sigmoid(2 * math.log(sigma) - gamma)


def cosine_mask_prob(u: Tensor, *, s_min: float = 0.05) -> Tensor:
    """Masking probability s for u ~ U(0, 1) from MaskGIT's cosine mapped onto [s_min, 1] (the released code's
    ``maskgit_cosine`` with ``mask_p_min`` = s_min, ``mask_p_max`` = 1)."""
    return s_min + (1 - s_min) * torch.cos(0.5 * math.pi * u)  # s = s_min + (1 − s_min)·cos(πu/2)


@dataclass(frozen=True)
class BridgeProcess(NoiseProcess):
    """The forward bridge, its time distribution and the time feature the network is conditioned on.

    ``time_dist``:
      - ``uniform``: t ~ U(t_min, 1 − t_min);
      - ``gamma_uniform``: γ ~ U(γ_min, γ_max) (uniform in log noise-to-signal);
      - ``gamma_mixture``: a fixed mixture over γ on [γ_min, γ_max]: ``mixture_uniform`` of the mass uniform on the
        whole range, the rest N(``gamma_mean``, ``gamma_std``²) truncated to it. The defaults are the released
        code's mixture (0.1 uniform on [−10, 6] + 0.9 N(−2.5, 2²), its fitted third component being optional and
        absent here), which trains most where the bridge turns from [MASK]- to token-dominated.
    ``condition_on``: the network reads ``t`` itself or γ mapped linearly from [γ_min, γ_max] onto [0, 1].
    The masking probability s is the released s_min + (1 − s_min)·cos(πu/2) (``cosine_mask_prob``);
    ``mask_schedule``, removed, is accepted at "affine" only (what saved checkpoints hold).
    """

    sigma: float = 0.2
    time_dist: str = "uniform"
    condition_on: str = "t"
    t_min: float = 1e-3
    gamma_min: float = -10.0
    gamma_max: float = 6.0
    gamma_mean: float = -2.5
    gamma_std: float = 2.0
    mixture_uniform: float = 0.1
    s_min: float = 0.05
    mask_schedule: InitVar[str] = "affine"

    def __post_init__(self, mask_schedule: str) -> None:
        replacement = "the masking probability is the released s_min + (1 − s_min)·cos(πu/2)"
        check_removed("BridgeProcess", "mask_schedule", mask_schedule, "affine", replacement)
        if not self.sigma > 0:
            raise ValueError(f"bridge σ must be > 0, got {self.sigma}")
        if self.time_dist not in TIME_DISTRIBUTIONS:
            raise ValueError(f"unknown time distribution {self.time_dist!r}; known: {list(TIME_DISTRIBUTIONS)}")
        if self.condition_on not in ("t", "gamma"):
            raise ValueError(f"condition_on must be 't' or 'gamma', got {self.condition_on!r}")
        if not 0 < self.t_min < 0.5:
            raise ValueError(f"t_min must be in (0, 0.5), got {self.t_min}")
        if not self.gamma_min < self.gamma_max:
            raise ValueError(f"need gamma_min < gamma_max, got [{self.gamma_min}, {self.gamma_max}]")
        if not 0 <= self.mixture_uniform <= 1 or self.gamma_std <= 0:
            raise ValueError("gamma mixture needs mixture_uniform in [0, 1] and gamma_std > 0")
        if not 0 < self.s_min <= 1:
            raise ValueError(f"s_min must be in (0, 1], got {self.s_min}")

    # ---------------------------------------------------------------------------------------------- marginals
    def mean_std(self, m: Tensor, e_y: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        """Mean (1 − t)·m + t·E_y and standard deviation σ·sqrt(t(1 − t)); t broadcasts as (B, 1, 1)."""
        t = t.reshape(-1, *([1] * (e_y.dim() - 1))).to(e_y.dtype)
        return (1 - t) * m + t * e_y, self.sigma * torch.sqrt((t * (1 - t)).clamp_min(0))

    def sample(
        self,
        m: Tensor,
        e_y: Tensor,
        t: Tensor,
        noised: Tensor,
        generator: torch.Generator | None,
        *,
        noise_dtype: torch.dtype | None = None,
        eps: Tensor | None = None,
    ) -> Tensor:
        """z_t: the bridge marginal at the ``noised`` (B, L) positions, E_y exactly elsewhere. The Gaussian noise ε
        is ``eps`` when given, else drawn in ``noise_dtype`` (default: E_y's dtype); it is used in E_y's dtype."""
        mean, std = self.mean_std(m, e_y, t)
        if eps is None:
            eps = torch.randn(e_y.shape, generator=generator, device=e_y.device, dtype=noise_dtype or e_y.dtype)
        return torch.where(noised[..., None], mean + std * eps.to(e_y.dtype), e_y)  # (1 − t)·m + t·E_y + σ√(t(1−t))·ε

    def draw(self, tokens: Tensor, generator: torch.Generator | None, embeddings: Tensor | None) -> Tensor:
        """ε ~ N(0, I) (B, L, d) in E's dtype, on E's device."""
        if embeddings is None:
            raise ValueError(NEEDS_TABLE)
        shape = (*tokens.shape, embeddings.shape[-1])
        return torch.randn(shape, generator=generator, device=embeddings.device, dtype=embeddings.dtype)

    def noise_from(
        self, tokens: Tensor, times: Tensor, keep: Tensor, draws: Tensor, embeddings: Tensor | None, mask_id: int | None
    ) -> NoisedBatch:
        """z_t at bridge times t (B,) off ``keep`` (E_y exactly on it), m = E[``mask_id``]; draws ε (B, L, d)."""
        if embeddings is None or mask_id is None:
            raise ValueError(NEEDS_TABLE)
        clean = embeddings[tokens]
        z = self.sample(embeddings[mask_id], clean, times, ~keep, None, eps=draws)
        return NoisedBatch(state=z, clean=clean, noised=~keep)

    # ---------------------------------------------------------------------------------------------- training
    def time_quantile(self, u: Tensor) -> Tensor:
        """The configured training law (``time_dist``) at u: t = t_min + (1 − 2·t_min)·u, or t(γ) at γ's quantile
        (``gamma_quantile``); clipped to [t_min, 1 − t_min]."""
        if self.time_dist == "uniform":
            t = self.t_min + (1 - 2 * self.t_min) * u
        else:
            t = t_of_gamma(self.gamma_quantile(u), self.sigma)
        return t.clamp(self.t_min, 1 - self.t_min)

    def gamma_quantile(self, u: Tensor) -> Tensor:
        """Inverse CDF of the γ distribution (γ-based ``time_dist`` only); monotone in u."""
        lo, hi = self.gamma_min, self.gamma_max
        if self.time_dist == "gamma_uniform":
            return lo + (hi - lo) * u
        # Mixture CDF F(γ) = w·U(γ) + (1 − w)·N_trunc(γ), inverted by bisection (monotone, 60 halvings ≈ 1e-17).
        u = u.double()
        a, b = torch.full_like(u, lo), torch.full_like(u, hi)
        for _ in range(60):
            mid = 0.5 * (a + b)
            below = self.gamma_cdf(mid) < u
            a, b = torch.where(below, mid, a), torch.where(below, b, mid)
        return 0.5 * (a + b)

    def gamma_cdf(self, gamma: Tensor) -> Tensor:
        """CDF of the γ mixture on [γ_min, γ_max]."""
        lo, hi, w = self.gamma_min, self.gamma_max, self.mixture_uniform
        normal = torch.distributions.Normal(
            torch.tensor(self.gamma_mean, dtype=torch.float64), torch.tensor(self.gamma_std, dtype=torch.float64)
        )
        g = gamma.double().clamp(lo, hi)
        n_lo, n_hi = (
            normal.cdf(torch.tensor(lo, dtype=torch.float64)),
            normal.cdf(torch.tensor(hi, dtype=torch.float64)),
        )
        return w * (g - lo) / (hi - lo) + (1 - w) * (normal.cdf(g) - n_lo) / (n_hi - n_lo)

    def t_quantiles(self, k: int) -> Tensor:
        """k + 1 times from 0 to 1 at equal quantiles of the training t distribution (a sampler time grid):
        steps are dense where training put its mass. Endpoints are exactly 0 and 1."""
        u = torch.linspace(0, 1, k + 1, dtype=torch.float64)
        if self.time_dist == "uniform":
            grid = u.clone()
        else:
            # t decreases in γ, so the t-quantile u is the γ-quantile 1 − u.
            grid = t_of_gamma(self.gamma_quantile(1 - u), self.sigma)
        grid[0], grid[-1] = 0.0, 1.0
        return grid

    def condition(self, t: Tensor) -> Tensor:
        """The time feature the network reads, in [0, 1]: t, or γ(t) mapped from [γ_min, γ_max] onto [0, 1]."""
        if self.condition_on == "t":
            return t
        t = t.clamp(1e-12, 1 - 1e-12)
        gamma = gamma_of_t(t.double(), self.sigma).clamp(self.gamma_min, self.gamma_max)
        return ((gamma - self.gamma_min) / (self.gamma_max - self.gamma_min)).to(t.dtype)

    def mask_prob(self, n: int, *, generator: torch.Generator | None, device: torch.device | str = "cpu") -> Tensor:
        """Per-sequence masking probabilities s from the cosine schedule (``cosine_mask_prob``)."""
        u = torch.rand(n, generator=generator)
        return cosine_mask_prob(u, s_min=self.s_min).to(device, non_blocking=True)

    # ---------------------------------------------------------------------------------------------- sampling
    def ddpm_step(self, z: Tensor, x1: Tensor, t: float, t_next: float, generator: torch.Generator | None) -> Tensor:
        """One bridge-DDPM step from t to t' given the endpoint estimate x̂₁:

        z' ~ N(((1 − t')/(1 − t))·z + ((t' − t)/(1 − t))·x̂₁, σ²·(t' − t)(1 − t')/(1 − t)·I)

        (the bridge from z at t to x̂₁ at 1, evaluated at t'; its mean is z + (t' − t)·v with v = (x̂₁ − z)/(1 − t)).
        """
        if not 0 <= t < t_next <= 1:
            raise ValueError(f"need 0 ≤ t < t' ≤ 1, got t={t}, t'={t_next}")
        mean = ((1 - t_next) / (1 - t)) * z + ((t_next - t) / (1 - t)) * x1
        var = self.sigma**2 * (t_next - t) * (1 - t_next) / (1 - t)
        if var == 0:
            return mean
        eps = torch.randn(z.shape, generator=generator, device=z.device, dtype=torch.float64).to(z.dtype)
        return mean + math.sqrt(var) * eps
