"""MLFM objective: cross-entropy on the clean token at masked positions, optional embedding MSE (methods.md §6)."""

from __future__ import annotations

import torch
from torch import Tensor

from flowlm.objectives.mdm import subs_log_probs


def mlfm_loss(
    logits: Tensor, tokens: Tensor, masked: Tensor, mask_id: int, *, embeddings: Tensor | None = None, aux_weight=0.0
) -> dict[str, Tensor]:
    """Per-sequence mean of −log p(y^l | z_t) over masked positions, averaged over sequences that have any; plus
    λ · the same mean of ‖softmax(logits)·E − E_y‖² when ``aux_weight`` > 0 (E: data rows of the embedding).

    logits (B, L, |V| + 1) with [MASK] last (its logit is dropped, SUBS); tokens, masked (B, L).
    """
    log_p = subs_log_probs(logits, mask_id)
    nll = -log_p.gather(-1, tokens[..., None]).squeeze(-1)
    ce = _per_sequence_mean(nll, masked)
    out = {"ce": ce, "loss": ce}
    if aux_weight > 0:
        if embeddings is None:
            raise ValueError("the auxiliary embedding MSE needs the embedding matrix")
        e = embeddings[:mask_id].float()
        x1 = log_p.exp() @ e  # endpoint estimate x̂₁ = softmax(logits)·E
        mse = ((x1 - e[tokens]) ** 2).mean(-1)
        out["mse"] = _per_sequence_mean(mse, masked)
        out["loss"] = ce + aux_weight * out["mse"]
    return out


def _per_sequence_mean(values: Tensor, masked: Tensor) -> Tensor:
    """Mean over each sequence's masked positions, then over the sequences with at least one."""
    count = masked.sum(-1)
    per_seq = torch.where(masked, values, torch.zeros_like(values)).sum(-1) / count.clamp_min(1)
    has = count > 0
    return (per_seq * has).sum() / has.sum().clamp_min(1)  # 0 (with zero gradient) when no sequence has any
