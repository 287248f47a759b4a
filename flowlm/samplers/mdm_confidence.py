"""Confidence ("a-priori", MaskGIT/LLaDA-style) sampler for MDMs (methods.md §2)."""

from __future__ import annotations

import torch
from torch import Tensor

from flowlm.compiled import compilable, tails_enabled
from flowlm.samplers.base import (
    MaskedDenoiser,
    SampleOutput,
    Sampler,
    check_draws,
    check_score,
    check_temperature,
    masked_start,
    pick_tokens,
    sample_categorical,
)
from flowlm.samplers.summary import chunked_max_log_prob


class ConfidenceSampler(Sampler):
    """At each of ``nfe`` steps commit the ⌈#masked / steps_left⌉ most confident masked positions; never remask.

    Candidates: argmax at temperature 0, else a float64 Gumbel draw from softmax(logits / T). Positions are ranked
    by ``score``: "max_prob", max_v p_θ(v) (MaskGIT, the released MDLM confidence sampler; the default), or
    "sampled", p_θ(candidate) (LLaDA's low-confidence remasking); the two agree at T = 0. The reported confidence
    of a committed token is p_θ(token). The network sees the fraction of still-masked non-prompt tokens as its
    time, if it is time-conditioned.

    Cost beyond the network: the ranking reads the logits once in float32 (log max p = max logit − logsumexp);
    with "max_prob" the ranking does not depend on the draw, so the float64 draw is made at the committing positions
    only (``draws="committed"``): at most ⌈#masked / steps_left⌉ rows per sequence, whose number is known on the
    host, so the step reads nothing back. "sampled" ranks by the draw itself and draws at every masked position.
    """

    family = "mdm"
    confidence_kind = "a-priori"  # p_θ(token) when it is committed, before the masked rest is drawn

    def __init__(self, *, temperature: float = 0.0, score: str = "max_prob", draws: str = "committed") -> None:
        self.temperature = check_temperature(temperature)
        self.score = check_score(score)
        self.draws = check_draws(draws)

    def __call__(
        self,
        model: MaskedDenoiser,
        *,
        prompt: Tensor,
        prompt_mask: Tensor,
        nfe: int,
        generator: torch.Generator | None = None,
    ) -> SampleOutput:
        """Sample with at most ``nfe`` network calls."""
        self.check_budget(nfe)
        x, confidence = masked_start(prompt, prompt_mask, model.mask_id)
        n_free = (~prompt_mask).sum(-1).clamp_min(1)
        positions = torch.arange(x.shape[1], device=x.device)
        calls = 0
        most_masked = int((x == model.mask_id).sum(-1).max()) if x.numel() else 0  # the call's one host read
        full = self.draws == "full" or (self.score == "sampled" and self.temperature > 0)
        for k in range(decode_steps(most_masked, nfe)):
            masked = x == model.mask_id
            n_masked = masked.sum(-1)
            logits = model.fn(x, n_masked / n_free)
            calls += 1
            n_commit = torch.div(n_masked + (nfe - k) - 1, nfe - k, rounding_mode="floor")  # ⌈masked/left⌉
            if full:
                log_p = torch.log_softmax(logits.double(), -1)
                candidate = pick_tokens(log_p, self.temperature, generator)
                p_candidate = log_p.gather(-1, candidate[..., None]).squeeze(-1)
                score = log_p.amax(-1) if self.score == "max_prob" else p_candidate  # log-probabilities: same order
            else:
                score, argmax = max_log_prob(logits)
                candidate, p_candidate = argmax, score
            score = torch.where(masked, score, -torch.inf)
            order = score.argsort(dim=-1, descending=True)
            rank = torch.empty_like(order).scatter_(-1, order, positions.expand_as(order))
            commit = masked & (rank < n_commit[:, None])
            if not full and self.temperature > 0:  # the draw, at the (at most) k_max committing positions
                k_max = -(-most_masked // (nfe - k))  # the most-masked row commits the most (⌈n/m⌉ is monotone)
                idx = order[:, :k_max]  # every committing position of a row is among its first k_max
                rows = logits.gather(1, idx[..., None].expand(-1, -1, logits.shape[-1])).float()
                drawn = sample_categorical(rows, self.temperature, generator)
                log_p = (rows.gather(-1, drawn[..., None]).squeeze(-1) - rows.logsumexp(-1)).float()
                candidate = x.scatter(1, idx, drawn)
                p_candidate = score.scatter(1, idx, log_p)
            most_masked -= -(-most_masked // (nfe - k))
            x = torch.where(commit, candidate, x)
            confidence = torch.where(commit, p_candidate.exp().float(), confidence)
        return SampleOutput(tokens=x, confidence=confidence, nfe=calls)


def max_log_prob(logits: Tensor) -> tuple[Tensor, Tensor]:
    """(log max_v p(v), argmax) per position from logits, in float32: max logit − logsumexp. Eagerly in vocabulary
    chunks without a (B, L, |V|) float32 copy (``chunked_max_log_prob``: 218 → 90 ms at (4, 128, 50 258) bf16 on one
    CPU thread, measured); with ``compiled_tails`` one fused pass."""
    if tails_enabled():
        return fused_max_log_prob(logits)
    return chunked_max_log_prob(logits)


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
