"""Absorbing ("masking") forward process of MDLM with the log-linear schedule α_t = 1 − t (methods.md §2)."""

from __future__ import annotations

import torch
from torch import Tensor

from flowlm.processes.base import NoisedBatch, NoiseProcess


class LogLinearSchedule:
    """α_t = 1 − t: at time t a token is still clean with probability α_t."""

    def alpha(self, t: Tensor) -> Tensor:
        """α_t."""
        return 1.0 - t

    def loss_weight(self, t: Tensor) -> Tensor:
        """ELBO weight −α'_t / (1 − α_t), which is 1/t for the log-linear schedule."""
        return 1.0 / t


def stratified_times(global_batch: int, *, offset: int, count: int, eps: float, generator: torch.Generator) -> Tensor:
    """Times t_i = ε + (1−ε)·(i + u_i)/n for i in [offset, offset+count) of a global batch of n.

    One draw per stratum of [0, 1) over the *global* batch (MDLM's antithetic sampling): every rank and
    micro-batch takes its own slice of the same draw, so the times are stratified across devices too.
    The generator must be seeded identically on every rank.
    """
    if not 0 <= offset and offset + count <= global_batch:
        raise ValueError(f"slice [{offset}, {offset + count}) lies outside a global batch of {global_batch}")
    u = torch.rand(global_batch, generator=generator, dtype=torch.float64)
    strata = (torch.arange(global_batch, dtype=torch.float64) + u) / global_batch
    return (eps + (1.0 - eps) * strata[offset : offset + count]).float()


class MaskingProcess(NoiseProcess):
    """Replace each non-prompt token by [MASK] independently with probability 1 − α_t."""

    def __init__(self, *, mask_id: int, eps: float = 1e-3) -> None:
        if not 0.0 < eps < 1.0:
            raise ValueError(f"eps must lie in (0, 1), got {eps}")
        self.mask_id = mask_id
        self.eps = eps
        self.schedule = LogLinearSchedule()

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
        """x_t (ids, [MASK] at the masked positions) at times t (B,); ``keep``: the prompt, never masked.

        ``draws``: the uniforms u (B, L) deciding the masks (u < 1 − α_t), when the caller draws them (e.g. over the
        global batch); else drawn from ``generator``.
        """
        u = draws if draws is not None else torch.rand(tokens.shape, generator=generator, device=tokens.device)
        masked = (u < (1.0 - self.schedule.alpha(times))[:, None]) & ~keep
        return NoisedBatch(state=torch.where(masked, self.mask_id, tokens), clean=tokens, noised=masked)
