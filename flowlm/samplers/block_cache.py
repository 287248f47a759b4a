"""A block KV cache for semi-autoregressive MDM decoding (Fast-dLLM's prefix and dual cache, arXiv 2505.22618).

At a block's first step (and every ``refresh`` steps after it) the network runs on the whole sequence and keeps
every layer's keys and values; the block's other steps run on a window only, the block and every position after it
(``prefix``) or the block alone (``dual``), attending to the kept keys and values of the positions outside it. The
window's own keys are rewritten each step; the others are read as they were at the last refresh: an approximation,
exact when every step refreshes (``refresh=1``). A step costs one network evaluation either way (NFE unchanged);
what it saves is the compute of the positions outside the window.
"""

from __future__ import annotations

from torch import Tensor

from flowlm.samplers.base import MaskedDenoiser

CACHES = ("none", "prefix", "dual")


def check_cache(cache: str, refresh: int | None) -> str:
    """``cache`` if one of ``CACHES`` and ``refresh`` (steps between full passes inside a block) is ≥ 1 or None."""
    if cache not in CACHES:
        raise ValueError(f"cache must be one of {CACHES}, got {cache!r}")
    if refresh is not None and (not isinstance(refresh, int) or refresh < 1):
        raise ValueError(f"refresh must be an integer ≥ 1 (steps between full passes) or null, got {refresh!r}")
    return cache


class BlockCachedReader:
    """``model.fn`` through a block KV cache over sequences of ``length`` positions: call ``block(lo, hi)`` at each
    block (its positions lie in [lo, hi)), then the reader as ``fn``. It returns logits (B, L, |V|) whose window
    positions are this step's; outside the window they are the last full pass's (a block's sampler reads only
    its block)."""

    def __init__(self, model: MaskedDenoiser, cache: str, refresh: int | None, length: int) -> None:
        if model.windowed is None:
            raise ValueError(
                f"cache={cache!r} needs a network with windowed passes (the suite's DiT); this model has none: "
                "use cache=none"
            )
        self.read = model.windowed(length)
        self.cache, self.refresh = cache, refresh
        self.lo, self.hi, self.step = 0, length, 0
        self.logits: Tensor | None = None

    def block(self, lo: int, hi: int) -> None:
        """The next block's positions lie in [lo, hi): its first call runs the full pass."""
        self.lo, self.hi, self.step = lo, hi, 0

    def __call__(self, x: Tensor, t: Tensor) -> Tensor:
        full = self.step == 0 or (self.refresh is not None and self.step % self.refresh == 0)
        self.step += 1
        if full:
            self.logits = self.read(x, t, 0)
            return self.logits
        hi = x.shape[1] if self.cache == "prefix" else self.hi
        self.logits[:, self.lo : hi] = self.read(x[:, self.lo : hi], t, self.lo)
        return self.logits
