"""The one interface of the noise processes: a time law (``sample_t``) and the forward process at given times
(``noise``: clean tokens in, a ``NoisedBatch`` out)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class NoisedBatch:
    """A batch at its noise level.

    ``state``: what the network reads: ids with [MASK] (masking), points of R^{|V|} (Gaussian flow), embeddings
    (bridge). ``clean``: the clean data in the same space (ids, one-hot vectors, E_y). ``noised`` (B, L): the positions
    that carry noise; every other position holds its clean value exactly.
    """

    state: Tensor
    clean: Tensor
    noised: Tensor


def stratified_uniforms(n: int, *, generator: torch.Generator | None, shuffle: bool = False) -> Tensor:
    """u_i = (i + v_i)/n, v_i ~ U(0, 1), i < n (float64): one draw in each stratum [i/n, (i + 1)/n) of [0, 1), so
    each u_i is U(0, 1) and the n of them cover the interval evenly; in stratum order, or in random order with
    ``shuffle``."""
    u = (torch.arange(n, dtype=torch.float64) + torch.rand(n, generator=generator, dtype=torch.float64)) / n
    return u[torch.randperm(n, generator=generator)] if shuffle else u


class NoiseProcess(ABC):
    """A forward noise process. A subclass gives its time law as an inverse CDF (``time_quantile``, at the uniforms
    of ``time_uniforms``) and the process at given random numbers (``draw``, ``noise_from``)."""

    def sample_t(
        self,
        n: int,
        *,
        generator: torch.Generator | None,
        device: torch.device | str = "cpu",
        offset: int = 0,
        count: int | None = None,
    ) -> Tensor:
        """Training times t = F⁻¹(u) (float32 on ``device``), F the process's time law: the slice
        [offset, offset + count) (default: all n) of one draw u of n uniforms over a global batch. Every rank and
        micro-batch that draws with the same generator state and takes its own slice sees one global draw."""
        count = n - offset if count is None else count
        if offset < 0 or count < 0 or offset + count > n:
            raise ValueError(f"slice [{offset}, {offset + count}) lies outside a global batch of {n}")
        u = self.time_uniforms(n, generator)[offset : offset + count]
        return self.time_quantile(u).float().to(device, non_blocking=True)

    def time_uniforms(self, n: int, generator: torch.Generator | None) -> Tensor:
        """The n uniforms (float64) behind one draw of times: i.i.d. U(0, 1) unless the process stratifies them."""
        return torch.rand(n, generator=generator, dtype=torch.float64)

    @abstractmethod
    def time_quantile(self, u: Tensor) -> Tensor:
        """F⁻¹(u): the time law's quantile function at uniforms u."""

    def noise(
        self,
        tokens: Tensor,
        times: Tensor,
        keep: Tensor,
        *,
        generator: torch.Generator | None = None,
        draws: Tensor | None = None,
        embeddings: Tensor | None = None,
        mask_id: int | None = None,
    ) -> NoisedBatch:
        """Noise ``tokens`` (B, L) at ``times`` ((B,) per sequence, or (B, L) per token where the process allows it),
        holding the ``keep`` (B, L) positions clean (prompt, context). The random numbers are ``draws`` when given
        (the caller drew them, e.g. over the global batch), else drawn from ``generator`` (``draw``).
        ``embeddings``, ``mask_id``: the embedding table E and the row of [MASK] in it (anywhere: the last row, or
        one inside the vocabulary), for a process that lives on embeddings; the others ignore them."""
        if draws is None:
            draws = self.draw(tokens, generator, embeddings)
        return self.noise_from(tokens, times, keep, draws, embeddings, mask_id)

    @abstractmethod
    def draw(self, tokens: Tensor, generator: torch.Generator | None, embeddings: Tensor | None) -> Tensor:
        """The random numbers ``noise`` reads for ``tokens``, drawn from ``generator``."""

    @abstractmethod
    def noise_from(
        self, tokens: Tensor, times: Tensor, keep: Tensor, draws: Tensor, embeddings: Tensor | None, mask_id: int | None
    ) -> NoisedBatch:
        """``noise`` at the given random numbers ``draws``."""
