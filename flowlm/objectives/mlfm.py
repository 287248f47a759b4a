"""MLFM objective: cross-entropy on the clean token at masked positions, optional embedding MSE (methods.md §6)."""

from __future__ import annotations

import torch
from torch import Tensor

from flowlm.objectives.base import LossOutput
from flowlm.objectives.mdm import subs_log_probs


def mlfm_loss(
    logits: Tensor,
    tokens: Tensor,
    masked: Tensor,
    mask_id: int | None,
    *,
    embeddings: Tensor | None = None,
    aux_weight=0.0,
) -> LossOutput:
    """Per-sequence mean of −log p(y^l | z_t) over masked positions, averaged over sequences that have any; plus
    λ · the same mean of ‖softmax(logits)·E − E_y‖² when ``aux_weight`` > 0 (E: data rows of the embedding).

    logits (B, L, |V| + 1) with [MASK] last (its logit is dropped, SUBS), or (B, L, |V|) with ``mask_id=None``
    ([MASK] removed by the caller); tokens, masked (B, L). Per token: the
    NLL at masked positions (0 elsewhere); parts: "ce", and "mse" with the auxiliary term.
    """
    log_p = subs_log_probs(logits, mask_id)
    nll = -log_p.gather(-1, tokens[..., None]).squeeze(-1)
    per_token = torch.where(masked, nll, torch.zeros_like(nll))
    ce = _per_sequence_mean(per_token, masked)
    if aux_weight <= 0:
        return LossOutput(loss=ce, per_token=per_token, parts={"ce": ce})
    if embeddings is None:
        raise ValueError("the auxiliary embedding MSE needs the embedding matrix")
    e = embeddings[: log_p.shape[-1]].float()  # the data rows (mask_id=None: logits over the data vocabulary)
    x1 = log_p.exp() @ e  # endpoint estimate x̂₁ = softmax(logits)·E
    mse = ((x1 - e[tokens]) ** 2).mean(-1)
    mse = _per_sequence_mean(torch.where(masked, mse, torch.zeros_like(mse)), masked)
    return LossOutput(loss=ce + aux_weight * mse, per_token=per_token, parts={"ce": ce, "mse": mse})


def _per_sequence_mean(values: Tensor, masked: Tensor) -> Tensor:
    """Mean over each sequence's masked positions (``values`` is zero elsewhere), then over the sequences with at
    least one."""
    count = masked.sum(-1)
    per_seq = values.sum(-1) / count.clamp_min(1)
    has = count > 0
    return (per_seq * has).sum() / has.sum().clamp_min(1)  # 0 (with zero gradient) when no sequence has any
