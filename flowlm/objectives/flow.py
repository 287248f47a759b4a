"""Flow map language model head: the soft-capped log δ (methods.md §3–4), and its in-place form for inference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from flowlm.ops.compiled import compilable

SOFT_CAP = 30.0


@compilable
def log_delta(logits: Tensor, cap: float = SOFT_CAP) -> Tensor:
    """log δ_{s,t} = log_softmax(cap · tanh(logits / cap)) in float32 (the FMLM/FMLM+ soft-capped head)."""
    logits = logits.float()
    return F.log_softmax(cap * torch.tanh(logits / cap), dim=-1)


def log_delta_(logits: Tensor, cap: float = SOFT_CAP) -> Tensor:
    """``log_delta`` computed in place where it can be (inference: no autograd), on one (B, L, |V|) float32 buffer
    (the logits' own when they are float32, else their float32 copy) and one for its exp: equal to ``log_delta``
    to float rounding. The cap as g − c = c·tanh(l/c) − c = −2c·σ(−2l/c) ∈ (−2c, 0], so log Σ exp(g − c) needs no
    running maximum: a sigmoid and an exp instead of a tanh, a max and an exp (docs/performance.md#design)."""
    x = logits.float()
    x.mul_(-2 / cap).sigmoid_().mul_(-2 * cap)  # g − c
    return x.sub_(x.exp().sum(-1, keepdim=True).log_())
