"""The one output type every objective returns."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor


@dataclass(frozen=True)
class LossOutput:
    """A loss, the per-token terms it reduces and its named parts.

    ``loss``: the scalar to optimise. ``per_token``: (B, L), each token's term of the loss, zero where a token is not
    scored (how the terms are reduced is the objective's: a mean over scored tokens, or per sequence first).
    ``parts``: named components to log (e.g. MLFM's "ce" and "mse", FMLM+'s mean loss per pair kind, as floats).
    """

    loss: Tensor
    per_token: Tensor
    parts: dict[str, Tensor | float] = field(default_factory=dict)
