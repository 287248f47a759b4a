"""Flow map language model objectives: soft-capped log δ and (soft) cross-entropy on active tokens (methods.md §3–4)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from flowlm.compiled import compilable

SOFT_CAP = 30.0


@compilable
def log_delta(logits: Tensor, cap: float = SOFT_CAP) -> Tensor:
    """log δ_{s,t} = log_softmax(cap · tanh(logits / cap)) in float32 (the FMLM/FMLM+ soft-capped head)."""
    logits = logits.float()
    return F.log_softmax(cap * torch.tanh(logits / cap), dim=-1)


def log_delta_(logits: Tensor, cap: float = SOFT_CAP) -> Tensor:
    """``log_delta`` computed in place where it can be (inference: no autograd), on one (B, L, |V|) float32 buffer
    instead of four: the logits' own when they are float32, else their float32 copy. Equal to ``log_delta``."""
    x = logits.float()
    x.div_(cap).tanh_().mul_(cap)
    return x.sub_(x.logsumexp(-1, keepdim=True))


def soft_cross_entropy(log_probs: Tensor, target: Tensor, active: Tensor) -> tuple[Tensor, Tensor]:
    """Σ_active −Σ_v target_v · log δ_v / #active, and the per-token loss (zero off the active set).

    ``target`` is either ids (B, L) (one-hot targets: the diagonal) or probabilities (B, L, V) (semigroup and MDM
    distillation targets).
    """
    if target.dtype in (torch.long, torch.int):
        per_token = -log_probs.gather(-1, target[..., None]).squeeze(-1)
    else:
        per_token = -(target.to(log_probs.dtype) * log_probs).sum(-1)
    per_token = torch.where(active, per_token, torch.zeros_like(per_token))
    return per_token.sum() / active.sum().clamp_min(1), per_token
