"""Optional ``torch.compile`` of the elementwise tails a sampler runs over (B, L, |V|) (off by default).

At a text vocabulary the passes over the logits that come after a network's output head cost about as much as the
head itself in eager PyTorch: each op reads and writes the whole (B, L, |V|) tensor. FMLM+'s soft-capped
log-softmax (cap·tanh(logits/cap), then log-softmax) is four or five such passes, the confidence sampler's
log max p = max logit − logsumexp three. Compiled, each tail is one fused loop over the logits (measured on this
project's CPU, one thread, (4, 128, 50 258) bf16 logits: soft-capped log-softmax 417 → 134–215 ms, log max p with
the argmax 274 → 41 ms; `benchmarks/sampler_overhead.py --compile-tails` prints the sampler ratios both ways).
The values are the eager ones to float rounding; compiling costs seconds once per process (dynamic shapes: one
graph serves every batch shape).

    with compiled_tails():          # e.g. the evaluation callback with eval.compile_tails=true
        sampler(model.denoiser(), ...)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)
_enabled = False


@contextlib.contextmanager
def compiled_tails(enabled: bool = True) -> Iterator[None]:
    """Within the block, functions marked ``compilable`` run their compiled version (when ``enabled``)."""
    global _enabled
    before, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = before


def tails_enabled() -> bool:
    """Whether compiled tails are on here."""
    return _enabled


def compilable(fn: F) -> F:
    """``fn``, or its ``torch.compile(dynamic=True)`` version inside ``compiled_tails()`` (compiled on first use)."""
    compiled: list[Callable] = []

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not _enabled:
            return fn(*args, **kwargs)
        if not compiled:
            compiled.append(torch.compile(fn, dynamic=True))
        return compiled[0](*args, **kwargs)

    call.eager = fn  # type: ignore[attr-defined]
    return call  # type: ignore[return-value]
