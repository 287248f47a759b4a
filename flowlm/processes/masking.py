"""Absorbing ("masking") forward process of MDLM with the log-linear schedule α_t = 1 − t (methods.md §2)."""

from __future__ import annotations

import torch
from torch import Tensor

from flowlm.processes.base import NoisedBatch, NoiseProcess, stratified_uniforms


class LogLinearSchedule:
    """α_t = 1 − t: at time t a token is still clean with probability α_t."""

    def alpha(self, t: Tensor) -> Tensor:
        """α_t."""
        return 1.0 - t

    def loss_weight(self, t: Tensor) -> Tensor:
        """ELBO weight −α'_t / (1 − α_t), which is 1/t for the log-linear schedule."""
        return 1.0 / t


def stratified_times(global_batch: int, *, offset: int, count: int, eps: float, generator: torch.Generator) -> Tensor:
    """Times t_i = ε + (1−ε)·(i + u_i)/n for i in [offset, offset+count) of a global batch of n: the earlier call
    shape of ``MaskingProcess(eps=ε).sample_t(n, offset=, count=)``, which draws them (the same draws)."""
    return MaskingProcess(mask_id=-1, eps=eps).sample_t(global_batch, generator=generator, offset=offset, count=count)


class MaskingProcess(NoiseProcess):
    """Replace each non-prompt token by [MASK] independently with probability 1 − α_t.

    Time law: t = ε + (1 − ε)·u, u stratified over the global batch (one draw per stratum of [0, 1), MDLM's
    antithetic sampling), so the times are stratified across devices and micro-batches too. Draws: the uniforms u
    (B, L); a position is masked where u < 1 − α_t.
    """

    def __init__(self, *, mask_id: int, eps: float = 1e-3) -> None:
        if not 0.0 < eps < 1.0:
            raise ValueError(f"eps must lie in (0, 1), got {eps}")
        self.mask_id = mask_id
        self.eps = eps
        self.schedule = LogLinearSchedule()

    def time_uniforms(self, n: int, generator: torch.Generator | None) -> Tensor:
        """One uniform per stratum [i/n, (i + 1)/n), in stratum order."""
        return stratified_uniforms(n, generator=generator)

    def time_quantile(self, u: Tensor) -> Tensor:
        """t = ε + (1 − ε)·u."""
        return self.eps + (1.0 - self.eps) * u

    def draw(self, tokens: Tensor, generator: torch.Generator | None, embeddings: Tensor | None) -> Tensor:
        """u ~ U(0, 1) (B, L)."""
        return torch.rand(tokens.shape, generator=generator, device=tokens.device)

    def noise_from(
        self, tokens: Tensor, times: Tensor, keep: Tensor, draws: Tensor, embeddings: Tensor | None, mask_id: int | None
    ) -> NoisedBatch:
        """x_t: ids with this process's [MASK] where u < 1 − α_t off ``keep``; times (B,)."""
        masked = (draws < (1.0 - self.schedule.alpha(times))[:, None]) & ~keep
        return NoisedBatch(state=torch.where(masked, self.mask_id, tokens), clean=tokens, noised=masked)
