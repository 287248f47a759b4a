"""MDLM continuous-time ELBO with the SUBS parametrisation (methods.md §2)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from flowlm.objectives.base import LossOutput


def subs_log_probs(logits: Tensor, mask_id: int | None) -> Tensor:
    """Log-probabilities over the data vocabulary: the [MASK] logit is −∞ (SUBS "zero masking probability").

    The [MASK] id is the last row of the model vocabulary, so dropping it is a slice; ``mask_id=None``: the logits
    are over the data vocabulary already, [MASK] removed by the caller (a LLaMA-family MDM's head).
    """
    if mask_id is None:
        return F.log_softmax(logits.float(), dim=-1)
    if mask_id != logits.shape[-1] - 1:
        raise ValueError(f"[MASK] must be the last id ({logits.shape[-1] - 1}), got {mask_id}")
    return F.log_softmax(logits[..., :mask_id].float(), dim=-1)


def mdm_elbo_loss(
    logits: Tensor, tokens: Tensor, masked: Tensor, weight: Tensor, loss_mask: Tensor, mask_id: int | None
) -> LossOutput:
    """Σ_l masked · w(t) · (−log p_θ(y^l | x_t)) / #non-prompt tokens; per token: w(t) · NLL (0 where not masked).

    SUBS "carry-over unmasking": unmasked positions copy their input, so they contribute exactly zero.
    weight: (B,) ELBO weight −α'_t/(1−α_t) (= 1/t, log-linear). loss_mask: non-prompt positions (B, L).
    """
    log_p = subs_log_probs(logits, mask_id)
    nll = -log_p.gather(-1, tokens[..., None]).squeeze(-1)
    nll = torch.where(masked, nll, torch.zeros_like(nll))  # carry-over: zero loss where not masked
    per_token = nll * weight[:, None]
    return LossOutput(loss=per_token.sum() / loss_mask.sum().clamp_min(1), per_token=per_token)
