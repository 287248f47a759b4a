"""A block KV cache for semi-autoregressive MDM decoding (Fast-dLLM's prefix and dual cache, arXiv 2505.22618).

At a block's first step (and every ``refresh`` steps after it) the network runs on the whole sequence and keeps
every layer's keys and values; the block's other steps run on a window only, the block and every position after it
(``prefix``) or the block alone (``dual``), attending to the kept keys and values of the positions outside it. The
window's own keys are rewritten each step; the others are read as they were at the last refresh: an approximation,
exact when every step refreshes (``refresh=1``). A step costs one network evaluation either way (NFE unchanged);
what it saves is the compute of the positions outside the window.

The networks give the windowed passes (``MaskedDenoiser.windowed``): the suite's DiT (``DiT.forward_window``, its own
``BlockKVCache``) and the LLaMA family (``BidirectionalLM.forward_window``: transformers' own decoder layers at
explicit position ids over a transformers ``Cache``). The decoders: ``semi_ar``, and ``threshold`` / ``eb`` with
blocks, whose rows enter blocks at different calls (the reader keeps each row's own schedule).
"""

from __future__ import annotations

import torch
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
    """``model.fn`` through a block KV cache over sequences of ``length`` positions, for decoders that fill one block
    per row at a time: ``block(lo, hi, rows)`` when rows enter a block (its positions in [lo, hi), per row), then
    the reader as ``fn``.

    A row's first call in a block (and every ``refresh`` calls after it) is a full pass for that row; its other calls
    write keys and read logits on its window only, [lo, length) (prefix) or [lo, hi) (dual); a row whose block is
    empty (lo ≥ hi: nothing left) is idle. A call runs the network once over the columns that cover every row's
    window (their bounds: the call's one host read; where every row's window is all of those columns, a batch in
    step or a full pass, the keys are written without a mask); the rest of a row's keys, and its logits outside its
    window, are those its last full pass left, so a row decodes alike alone and inside any batch. Returns logits
    (B, L, |V|); with ``head`` (where the network offers ``head_fn``) ``(features (B, L, d), W, b)`` as ``head_fn``
    does, the head's input instead, kept and merged the same way: the decoder runs the head at the rows it reads
    only, where logits would cost the head over the whole window and a (B, L, |V|) merge each call."""

    def __init__(
        self, model: MaskedDenoiser, cache: str, refresh: int | None, length: int, *, head: bool = False
    ) -> None:
        if model.windowed is None:
            raise ValueError(
                f"cache={cache!r} needs a network with windowed passes (the suite's DiT or a LLaMA-family backbone); "
                "this model has none: use cache=none"
            )
        self.head = head and model.head_fn is not None
        self.read = model.windowed(length, head=True) if self.head else model.windowed(length)
        self.cache, self.refresh = cache, refresh
        self.lo = self.hi = self.step = None
        self.logits: Tensor | None = None  # the logits (with ``head``: the head's input) each row last computed

    def block(self, lo: Tensor, hi: Tensor, rows: Tensor | None = None) -> None:
        """Rows ``rows`` (B,) bool (None: every row) enter a block spanning [lo, hi) (B,): their next call is a full
        pass."""
        if rows is None or self.step is None:
            self.lo, self.hi, self.step = lo, hi, torch.zeros_like(lo)
        else:
            self.lo, self.hi = torch.where(rows, lo, self.lo), torch.where(rows, hi, self.hi)
            self.step = torch.where(rows, 0, self.step)

    def __call__(self, x: Tensor, t: Tensor) -> Tensor | tuple[Tensor, Tensor, Tensor | None]:
        length = x.shape[1]
        live = self.lo < self.hi
        due = live & ((self.step == 0) if self.refresh is None else (self.step % self.refresh == 0))
        self.step = self.step + 1
        lo = torch.where(due, 0, self.lo).where(live, length)  # each row's window; an idle row's is empty
        hi = (self.hi if self.cache == "dual" else torch.full_like(self.hi, length)).where(~due, length)
        hi = hi.where(live, 0)
        # the call's host read: the columns to run, and whether every row's window is all of them
        start, stop, inner_lo, inner_hi = torch.stack([lo.min(), hi.max(), lo.max(), hi.min()]).tolist()
        if stop <= start:  # no row left to decode: a full pass writes nothing (fresh is empty)
            start, stop = 0, length
        fresh = None  # every row's window spans the columns (a batch in step, a full pass): no masked writes
        if inner_lo > start or inner_hi < stop:
            cols = torch.arange(start, stop, device=x.device)
            fresh = (cols >= lo[:, None]) & (cols < hi[:, None])
        out = self.read(x[:, start:stop], t, start, fresh)
        out, linear = (out[0], out[1:]) if self.head else (out, ())
        if self.logits is None:  # the first call: a full pass (the cache refuses anything else)
            self.logits = out
        elif fresh is None:
            self.logits[:, start:stop] = out
        else:
            self.logits[:, start:stop] = torch.where(fresh[..., None], out, self.logits[:, start:stop])
        return (self.logits, *linear) if self.head else self.logits
