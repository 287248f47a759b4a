"""The model views' earlier reading (``denoiser(summary="dense")``, removed from the runtime), kept as a test oracle:
the same view without its head summaries, so a sampler reads the whole (B, L, |V|) log δ (flow) or posterior (MLFM)
at every call, as it still does for a model that has no summaries."""

from __future__ import annotations

import dataclasses

from flowlm.samplers import FlowDenoiser
from flowlm.samplers.mlfm import BridgeDenoiser


def dense_view(view: FlowDenoiser | BridgeDenoiser) -> FlowDenoiser | BridgeDenoiser:
    """``view`` with no summary, lift or posterior callables: the samplers' whole-tensor path."""
    if isinstance(view, FlowDenoiser):
        return dataclasses.replace(view, summary_fn=None, lift_fn=None)
    return dataclasses.replace(view, posterior_fn=None)
