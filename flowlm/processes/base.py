"""The one interface of the noise processes: clean tokens and times in, a ``NoisedBatch`` out."""

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


class NoiseProcess(ABC):
    """A forward noise process: clean tokens and times in, the noised batch out (one call shape for all)."""

    @abstractmethod
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
        """Noise ``tokens`` (B, L) at ``times`` ((B,) per sequence, or (B, L) per token where the process allows it),
        holding the ``keep`` (B, L) positions clean (prompt, context). The random numbers are ``draws`` when given
        (the caller drew them, e.g. over the global batch), else drawn from ``generator``. ``embeddings``: the
        embedding table ([MASK] last) of a process that lives on embeddings; the others ignore it."""
