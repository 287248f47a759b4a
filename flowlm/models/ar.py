"""The autoregressive baseline as its sampler and loss read it: a causal network over [START], y_0 … y_{L−2}."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from flowlm.backbones.dit import KVCache
from flowlm.samplers.autoregressive import CausalDenoiser


@dataclass(eq=False)
class CausalModel:
    """Position i reads [START] (id ``start_id``), y_0 … y_{i−1} and predicts y_i. The DiT's time conditioning is fed
    a constant 0."""

    net: nn.Module
    start_id: int

    def __call__(self, tokens: Tensor) -> Tensor:
        """Logits over the data vocabulary (B, L, |V|); position i is the prediction of tokens[:, i]."""
        inputs = self.shifted_inputs(tokens, 0, tokens.shape[1])
        return self.net(inputs, torch.zeros(tokens.shape[0], device=tokens.device))[..., : self.start_id]

    def shifted_inputs(self, tokens: Tensor, start: int, stop: int) -> Tensor:
        """The network inputs at positions start … stop − 1: [START] at 0, tokens[:, i − 1] at i."""
        if start > 0:
            return tokens[:, start - 1 : stop - 1]
        first = torch.full_like(tokens[:, :1], self.start_id)
        return torch.cat([first, tokens[:, : stop - 1]], dim=1)

    def new_cache(self, max_len: int) -> KVCache:
        """An empty KV cache for decoding up to ``max_len`` positions."""
        return self.net.new_cache(max_len)

    def extend(self, tokens: Tensor, stop: int, cache: KVCache) -> Tensor:
        """Logits (B, stop − cache.length, |V|) of positions cache.length … stop − 1, as ``self(tokens)`` gives
        there, feeding only those positions' inputs through the cache, which advances to ``stop``. The time is the
        same constant 0 per sequence as in ``__call__``, so every adaLN modulation is the identical (B, 1, ·) vector."""
        inputs = self.shifted_inputs(tokens, cache.length, stop)
        time = torch.zeros(tokens.shape[0], device=tokens.device)
        return self.net.forward_cached(inputs, time, cache)[..., : self.start_id]

    def denoiser(self) -> CausalDenoiser:
        """This model as the AR sampler sees it (with incremental KV-cached decoding)."""
        return CausalDenoiser(fn=self, new_cache=self.new_cache, extend=self.extend)
