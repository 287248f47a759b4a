"""Autoregressive baseline objective: next-token cross-entropy on the scored (non-prompt) positions."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from flowlm.objectives.base import LossOutput


def ar_loss(logits: Tensor, tokens: Tensor, loss_mask: Tensor) -> LossOutput:
    """Σ_scored −log p(y_i | y_<i) / #scored; logits (B, L, |V|) where position i predicts tokens[:, i]."""
    nll = F.cross_entropy(logits.float().transpose(1, 2), tokens, reduction="none")
    per_token = nll * loss_mask
    return LossOutput(loss=per_token.sum() / loss_mask.sum().clamp_min(1), per_token=per_token)
