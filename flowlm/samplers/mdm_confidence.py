"""Confidence ("a-priori", MaskGIT/LLaDA-style) sampler for MDMs (methods.md §2)."""

from __future__ import annotations

import torch
from torch import Tensor

from flowlm.ops.compiled import compilable, tails_enabled
from flowlm.ops.draws import draw_at, pick_tokens, row_uniforms
from flowlm.ops.summary import chunked_head_keep, chunked_head_summary, chunked_max_log_prob, draw_kept, keeps_draw
from flowlm.samplers.base import MaskedDenoiser, SampleOutput
from flowlm.samplers.common import slots
from flowlm.samplers.guidance import GuidedSampler


class ConfidenceSampler(GuidedSampler):
    """At each of ``nfe`` steps commit the ⌈#masked / steps_left⌉ most confident masked positions; never remask.

    Candidates: argmax at temperature 0, else a float64 Gumbel draw from softmax(logits / T). Positions are ranked
    by ``score``: "max_prob", max_v p_θ(v) (MaskGIT, the released MDLM confidence sampler; the default), or
    "sampled", p_θ(candidate) (LLaDA's low-confidence remasking); the two agree at T = 0. The reported confidence
    of a committed token is p_θ(token). The network sees the fraction of still-masked non-prompt tokens as its
    time, if it is time-conditioned.

    Cost beyond the network: the ranking reads the logits of the still-masked positions once in float32 (log max p = max
    logit − logsumexp; on the suite's DiT the head itself runs in vocabulary chunks at those positions only,
    ``MaskedDenoiser.head_fn``, and the network's whole logits are never made; the masked ones of a row are among its
    first ``most_masked`` slots, a number tracked on the host, ``slots``); with "max_prob" the ranking does not depend
    on the draw, so the float64 draw is made at the committing positions only: at most ⌈#masked / steps_left⌉ rows per
    sequence, by the two-level inverse CDF of ``draw_rows``, so the step reads nothing back (on the head's chunks from
    the group masses the ranking's pass kept, ``chunked_head_keep``: each row's head product made once). "sampled" ranks
    by the draw itself and draws at every masked position (the full path). Per-row generators
    (``flowlm.ops.draws.Generators``): each step draws from each row's generator one categorical u per position (the
    full path: |V| Gumbel uniforms per position), read where the row draws.

    ``cfg_scale`` w > 0: SMDM's unsupervised CFG (``flowlm.samplers.guidance``) on the logits every step reads, so the
    ranking, the draw and the reported confidence are the guided distribution's; each step spends 2 network
    evaluations, so the schedule has ⌊nfe / 2⌋ steps.
    """

    family = "mdm"
    confidence_kind = "a-priori"  # p_θ(token) when it is committed, before the masked rest is drawn
    reads_head = True  # read the network's head in chunks where it offers one (``MaskedDenoiser.head_fn``)
    keeps_masses = True  # at T > 0 the head's fold keeps the group masses the draw after the rank reads

    def __init__(
        self, *, temperature: float = 0.0, score: str = "max_prob", draws: str = "committed", cfg_scale: float = 0.0
    ) -> None:
        super().__init__(temperature=temperature, score=score, draws=draws, cfg_scale=cfg_scale)

    def sample(self, model: MaskedDenoiser, prompt: Tensor, prompt_mask: Tensor, steps: int, generator) -> SampleOutput:
        """``steps`` commit steps, fewer once nothing is masked (at most ``nfe`` network evaluations)."""
        model, x, confidence, cost = self.start(model, prompt, prompt_mask, generator)
        n_free = (~prompt_mask).sum(-1).clamp_min(1)
        positions = torch.arange(x.shape[1], device=x.device)
        calls = 0
        most_masked = int((x == model.mask_id).sum(-1).max()) if x.numel() else 0  # the call's one host read
        full = self.score == "sampled" and self.temperature > 0  # the ranking reads the draw: draw everywhere
        # the network's head in vocabulary chunks at the masked slots, where it offers one (not with CFG, whose
        # guided logits combine two passes, nor with compiled tails, which read the whole logits at once)
        head = model.head_fn if self.reads_head and not full and not tails_enabled() else None
        for k in range(decode_steps(most_masked, steps)):
            masked = x == model.mask_id
            n_masked = masked.sum(-1)
            if head is None:
                logits = model.fn(x, n_masked / n_free)
            else:
                features, *linear = head(x, n_masked / n_free)
                by_feature = features.reshape(-1, features.shape[-1])
            calls += cost
            n_commit = torch.div(n_masked + (steps - k) - 1, steps - k, rounding_mode="floor")  # ⌈masked/left⌉
            if full:
                log_p = torch.log_softmax(logits.double(), -1)
                per_row = row_uniforms(generator, log_p.shape, x.device, self.temperature)
                candidate = pick_tokens(log_p, self.temperature, generator, uniforms=per_row)
                p_candidate = log_p.gather(-1, candidate[..., None]).squeeze(-1)
                score = log_p.amax(-1) if self.score == "max_prob" else p_candidate  # log-probabilities: same order
                score = torch.where(masked, score, -torch.inf)
                order = score.argsort(dim=-1, descending=True)
                rank = torch.empty_like(order).scatter_(-1, order, positions.expand_as(order))
                commit = masked & (rank < n_commit[:, None])
                x = torch.where(commit, candidate, x)
                confidence = torch.where(commit, p_candidate.exp().float(), confidence)
            else:  # rank the masked positions only: every row's are among its first ``most_masked`` slots
                slot, live = slots(masked, most_masked)
                # the slots' rows of logits viewed as (B·L, |V|)
                flat = slot + torch.arange(x.shape[0], device=x.device)[:, None] * x.shape[1]
                kept = None
                if head is None:
                    score, candidate = (t.view(slot.shape) for t in max_log_prob(logits, rows=flat.reshape(-1)))
                elif self.temperature > 0 and self.keeps_masses and keeps_draw(flat.numel(), linear[0].shape[0]):
                    # the head's product at the slots, once: the draw at the committing slots reads its group masses
                    read, kept = chunked_head_keep(by_feature[flat.reshape(-1)], *linear, self.temperature)
                    score, candidate = read.log_max.view(slot.shape), x.gather(1, slot)  # every committing one drawn
                else:  # the head's product at the slots only
                    read = chunked_head_summary(by_feature[flat.reshape(-1)], *linear)
                    score, candidate = read.log_max.view(slot.shape), read.argmax.view(slot.shape)
                score = torch.where(live, score, -torch.inf)
                order = score.argsort(dim=-1, descending=True)
                rank = torch.empty_like(order).scatter_(-1, order, positions[: order.shape[1]].expand_as(order))
                commit = live & (rank < n_commit[:, None])
                p_candidate = score
                if self.temperature > 0:  # the draw, at the (at most) k_max committing positions
                    k_max = -(-most_masked // (steps - k))  # the most-masked row commits the most (⌈n/m⌉ is monotone)
                    top = order[:, :k_max]  # every committing slot of a row is among its first k_max
                    per_row = row_uniforms(generator, x.shape, x.device, self.temperature)
                    at = flat.gather(1, top).view(-1)
                    if kept is not None:  # the slots' rows of the kept fold: slot (b, j) is its row b·W + j
                        kept_rows = top + torch.arange(top.shape[0], device=top.device)[:, None] * flat.shape[1]
                        own = None if per_row is None else per_row.reshape(-1)[at]
                        drawn, log_p = draw_kept(kept, kept_rows.view(-1), generator, uniforms=own)
                    else:
                        source = logits.reshape(-1, logits.shape[-1]) if head is None else by_feature
                        drawn, log_p = draw_at(
                            source,
                            at,
                            self.temperature,
                            generator,
                            uniforms=per_row,
                            linear=None if head is None else linear,
                        )
                    candidate = candidate.scatter(1, top, drawn.view(top.shape))
                    p_candidate = score.scatter(1, top, log_p.float().view(top.shape))
                x, confidence = commit_slots(x, confidence, slot, commit, candidate, p_candidate)
            most_masked -= -(-most_masked // (steps - k))
        return SampleOutput(tokens=x, confidence=confidence, nfe=calls)


def commit_slots(
    x: Tensor, confidence: Tensor, slot: Tensor, commit: Tensor, candidate: Tensor, log_p: Tensor
) -> tuple[Tensor, Tensor]:
    """x and confidence with the committing slots (``commit``, over the distinct positions ``slot``, (B, W)) set to
    their candidate token and p = exp(log_p); the other slots keep what they hold."""
    tokens = torch.where(commit, candidate, x.gather(1, slot))
    p = torch.where(commit, log_p.exp().float(), confidence.gather(1, slot))
    return x.scatter(1, slot, tokens), confidence.scatter(1, slot, p)


def max_log_prob(logits: Tensor, *, rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(log max_v p(v), argmax) per position from logits, in float32: max logit − logsumexp. Eagerly in vocabulary
    chunks without a (B, L, |V|) float32 copy (``chunked_max_log_prob``); with ``compiled_tails`` one fused pass.
    ``rows``: only these rows of logits viewed as (B·L, |V|), results (n,)."""
    if tails_enabled():
        return fused_max_log_prob(logits if rows is None else logits.reshape(-1, logits.shape[-1])[rows])
    return chunked_max_log_prob(logits, rows=rows)


@compilable
def fused_max_log_prob(logits: Tensor) -> tuple[Tensor, Tensor]:
    """``max_log_prob`` over the whole vocabulary at once (compiled inside ``compiled_tails``)."""
    x = logits.float()
    top, argmax = x.max(-1)
    return top - x.logsumexp(-1), argmax


def decode_steps(n_masked: int, nfe: int) -> int:
    """Steps until ⌈#masked / steps_left⌉ commits per step leave nothing masked, for the row with the most masked
    positions (n ↦ n − ⌈n/m⌉ = ⌊n(m−1)/m⌋ is monotone, so that row is the last to finish): the sampler's loop length
    and NFE, known before the loop, which then needs no host read per step."""
    steps = 0
    while n_masked > 0 and steps < nfe:
        n_masked -= -(-n_masked // (nfe - steps))
        steps += 1
    return steps
