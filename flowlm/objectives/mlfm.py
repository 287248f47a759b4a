"""MLFM objective (methods.md §6): the training inputs (``mlfm_inputs``: the masked set, the bridge time and state)
and the loss on them (``mlfm_loss``: cross-entropy on the clean token at masked positions, optional embedding MSE)."""

from __future__ import annotations

import torch
from torch import Tensor

from flowlm.objectives.base import LossOutput
from flowlm.objectives.mdm import subs_log_probs
from flowlm.processes.bridge import BridgeProcess


def mlfm_inputs(
    tokens: Tensor,
    prompt: Tensor,
    process: BridgeProcess,
    embeddings: Tensor,
    mask_id: int,
    *,
    full_response_mask_prob: float = 0.0,
    gen_cpu: torch.Generator | None,
    gen: torch.Generator | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(z, t, masked): the bridge state z (B, L, d) at times t (B,) and the masked positions M (B, L) for clean
    tokens y (B, L), the ``prompt`` positions (B, L) held clean. Per sequence:

        s ~ the cosine schedule (``process.mask_prob``); s = 1 with probability ``full_response_mask_prob``
        M = {l ∉ prompt : u_l < s},  u_l ~ U(0, 1);  M = ∅ with a response: M = {l*}, l* uniform off the prompt
        t ~ the bridge's training law (``process.sample_t``)
        z^l = (1 − t)·m + t·E_{y^l} + σ·√(t(1 − t))·ε^l on M, E_{y^l} elsewhere   (``process.noise``, m = E[mask_id])

    E (``embeddings``) is the table the network reads, with [MASK] at row ``mask_id`` (the last row, or one inside
    the vocabulary). Random numbers, in this order: s (and the full-response coin) from ``gen_cpu`` on the host,
    u (B, L) and the pick's (B, L) uniforms from ``gen`` on ``tokens``' device, t from ``gen_cpu``, ε from ``gen``.
    """
    b, length = tokens.shape
    s = process.mask_prob(b, generator=gen_cpu, device=tokens.device)
    if full_response_mask_prob > 0:  # the released SFT's sft_full_response_mask_prob: s = 1 for the row
        full = torch.rand(b, generator=gen_cpu).to(tokens.device, non_blocking=True) < full_response_mask_prob
        s = torch.where(full, 1.0, s)
    free = ~prompt
    masked = (torch.rand(b, length, generator=gen, device=tokens.device) < s[:, None]) & free
    # A sequence with a response and nothing masked gets one free position (as the released code), uniformly
    # picked by the argmax of uniforms off the prompt; drawn for every row, so that no device value decides what runs
    empty = ~masked.any(-1) & free.any(-1)
    pick = torch.rand(b, length, generator=gen, device=tokens.device).masked_fill(~free, -1).argmax(-1)
    masked |= empty[:, None] & (torch.arange(length, device=tokens.device) == pick[:, None])
    t = process.sample_t(b, generator=gen_cpu, device=tokens.device)
    z = process.noise(tokens, t, ~masked, generator=gen, embeddings=embeddings, mask_id=mask_id).state
    return z, t, masked


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
