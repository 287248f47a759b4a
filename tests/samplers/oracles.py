"""The MDM samplers' earlier whole-tensor random stream (``draws="full"``, removed from the runtime), kept as test
oracles: a float64 log-softmax and Gumbel-max draw over the whole (B, L, |V|) at every step, the ranking over every
position. The samplers draw only where a step commits or unmasks, in the same law (tests/samplers/
test_committed_draws.py); at temperature 0 they commit the same tokens as these."""

from __future__ import annotations

import torch

from flowlm.ops.draws import pick_tokens
from flowlm.samplers import (
    AncestralSampler,
    ConfidenceSampler,
    EBSampler,
    SampleOutput,
    SemiARConfidenceSampler,
    ThresholdSampler,
)
from flowlm.samplers.common import slots
from flowlm.samplers.mdm_adaptive import CallStats
from flowlm.samplers.mdm_confidence import decode_steps


def _commit_ranked(log_p, candidate, eligible, n_commit, x, confidence, score):
    """Commit the ``n_commit`` best-ranked eligible positions of each row (ranked by max p or p(candidate))."""
    positions = torch.arange(x.shape[1], device=x.device)
    p_candidate = log_p.gather(-1, candidate[..., None]).squeeze(-1)
    ranked = torch.where(eligible, log_p.amax(-1) if score == "max_prob" else p_candidate, -torch.inf)
    order = ranked.argsort(dim=-1, descending=True)
    rank = torch.empty_like(order).scatter_(-1, order, positions.expand_as(order))
    commit = eligible & (rank < n_commit[:, None])
    return torch.where(commit, candidate, x), torch.where(commit, p_candidate.exp().float(), confidence)


class FullDrawConfidence(ConfidenceSampler):
    """``ConfidenceSampler`` drawing at every position of every step."""

    def sample(self, model, prompt, prompt_mask, steps, generator) -> SampleOutput:
        model, x, confidence, cost = self.start(model, prompt, prompt_mask)
        n_free = (~prompt_mask).sum(-1).clamp_min(1)
        most_masked = int((x == model.mask_id).sum(-1).max()) if x.numel() else 0
        calls = 0
        for k in range(decode_steps(most_masked, steps)):
            masked = x == model.mask_id
            n_masked = masked.sum(-1)
            log_p = torch.log_softmax(model.fn(x, n_masked / n_free).double(), -1)
            calls += cost
            n_commit = torch.div(n_masked + (steps - k) - 1, steps - k, rounding_mode="floor")
            candidate = pick_tokens(log_p, self.temperature, generator)
            x, confidence = _commit_ranked(log_p, candidate, masked, n_commit, x, confidence, self.score)
        return SampleOutput(tokens=x, confidence=confidence, nfe=calls)


class FullDrawAncestral(AncestralSampler):
    """``AncestralSampler`` drawing Gumbel uniforms over the whole (B, L, |V|) before each step's unmask coins."""

    def sample(self, model, prompt, prompt_mask, steps, generator) -> SampleOutput:
        model, x, confidence, cost = self.start(model, prompt, prompt_mask)
        masked = x == model.mask_id
        cacheable = self.cache and not model.time_conditioned
        logits, calls = None, 0
        for k in range(steps):
            t, s = 1.0 - k / steps, 1.0 - (k + 1) / steps
            if logits is None:
                logits = model.fn(x, torch.full((x.shape[0],), t, device=x.device))
                calls += cost
            uniforms = None
            if self.temperature > 0:
                uniforms = torch.rand(logits.shape, generator=generator, device=x.device, dtype=torch.float64)
            u = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float64)
            unmask = masked & (u < (t - s) / t)
            rows = unmask.nonzero(as_tuple=True)
            if rows[0].numel():
                log_p = torch.log_softmax(logits[rows].double(), -1)
                draw = pick_tokens(
                    log_p, self.temperature, generator, uniforms=None if uniforms is None else uniforms[rows]
                )
                x = x.index_put(rows, draw.to(x.dtype))
                confidence = confidence.index_put(rows, log_p.gather(-1, draw[:, None]).squeeze(-1).exp().float())
            masked = masked & ~unmask
            if not masked.any():
                break
            if not (cacheable and rows[0].numel() == 0):
                logits = None
        return SampleOutput(tokens=x, confidence=confidence, nfe=calls)


class FullDrawSemiAR(SemiARConfidenceSampler):
    """``SemiARConfidenceSampler`` (no cache) drawing at every position of every step, ranking the blocks': row r's
    step k of block b at the batch's step b·K_r + k."""

    def sample(self, model, prompt, prompt_mask, schedule, generator) -> SampleOutput:
        row_plan, plans = schedule
        model, x, confidence, cost = self.start(model, prompt, prompt_mask)
        free = ~prompt_mask
        block_id = torch.where(free, (free.cumsum(-1) - 1) // self.block_length, -1)
        n_free = free.sum(-1).clamp_min(1)
        n_blocks, steps = torch.tensor([plan[1:] for plan in plans])[row_plan].unbind(-1)
        total = int((n_blocks * steps).max())
        for g in range(total):
            masked = x == model.mask_id
            eligible = masked & (block_id == (g // steps)[:, None])
            log_p = torch.log_softmax(model.fn(x, masked.sum(-1) / n_free).double(), -1)
            left = steps - g % steps
            n_commit = torch.div(eligible.sum(-1) + left - 1, left, rounding_mode="floor")
            candidate = pick_tokens(log_p, self.temperature, generator)
            x, confidence = _commit_ranked(log_p, candidate, eligible, n_commit, x, confidence, self.score)
        return SampleOutput(tokens=x, confidence=confidence, nfe=total * cost, row_nfe=n_blocks * steps * cost)


class BatchPlannedSemiAR(SemiARConfidenceSampler):
    """``SemiARConfidenceSampler`` as it was before its rows planned alone (issue 37): every row's blocks and steps
    per block from the batch's longest response. Where every row has as many positions to fill, the sampler's
    tokens, confidences and NFE are this one's, bit for bit."""

    def schedule(self, nfe, prompt, prompt_mask) -> tuple[int, int, int]:
        """(blocks, steps per block) for the row with the most positions to generate, and that number."""
        free = ~prompt_mask
        most_free = int(free.sum(-1).max()) if free.numel() else 0  # the call's one host read
        return (*self.plan(nfe, most_free), most_free)

    def sample(self, model, prompt, prompt_mask, schedule, generator) -> SampleOutput:
        """blocks × K steps (network evaluations: × 2 with guidance)."""
        n_blocks, steps, most_free = schedule
        model, x, confidence, cost = self.start(model, prompt, prompt_mask, generator)
        fn, reader = self.network(model, x.shape[1])
        # the network read as the sampler reads it (the head's input where it offers one): the plan is what differs
        head = (model.head_fn if self.reads_head else None) if reader is None else (reader if reader.head else None)
        block_id, n_free = self.blocks(prompt_mask)
        positions = torch.arange(x.shape[1], device=x.device)
        calls = 0
        for b in range(n_blocks):
            in_block = block_id == b
            if reader is not None:  # each row's block lies in [lo, hi) (empty where the row has no block b)
                lo = torch.where(in_block, positions, x.shape[1]).amin(-1)
                reader.block(lo, torch.where(in_block, positions + 1, 0).amax(-1))
            # the block's positions (only they are ever eligible) as slots; the fullest row's count
            slot, _ = slots(in_block, self.block_length)
            most = min(self.block_length, max(most_free - b * self.block_length, 0))
            for k in range(steps):  # one call's commits as the sampler's own (``commit``): the plan is what differs
                masked = x == model.mask_id
                if head is None:
                    logits, linear = fn(x, masked.sum(-1) / n_free), None
                else:
                    logits, *linear = head(x, masked.sum(-1) / n_free)
                calls += cost
                left = steps - k
                x, confidence = self.commit(
                    x, confidence, logits, masked & in_block, slot, left, -(-most // left), generator, linear=linear
                )
                most -= -(-most // left)
        return SampleOutput(tokens=x, confidence=confidence, nfe=calls)


class DenseStats:
    """The adaptive MDM decoders' statistics as they were read before the chunked summary (2026-12-06): a float64
    log_softmax over the whole (B, L, |V|) at every call, max p, margin and entropy at every position. Mixed into
    ``ThresholdSampler`` / ``EBSampler``: the same calls, ranks, rules and draws, from the dense statistics of the
    network's whole logits (never its head in chunks)."""

    reads_head = False

    def stats(self, logits: torch.Tensor, at: torch.Tensor) -> CallStats:  # noqa: D102
        log_p = torch.log_softmax(logits.double(), -1)
        top2 = log_p.topk(min(2, log_p.shape[-1]), dim=-1).values.exp()
        margin = top2[..., 0] - (top2[..., 1] if top2.shape[-1] > 1 else 0.0)
        h = -(log_p.exp() * log_p.nan_to_num(neginf=0.0)).sum(-1)  # 0·log 0 = 0 (a −inf [MASK] logit)
        return CallStats(top2[..., 0], log_p.argmax(-1), margin, h)


class DenseThreshold(DenseStats, ThresholdSampler):
    """``ThresholdSampler`` over the dense float64 statistics."""


class DenseEB(DenseStats, EBSampler):
    """``EBSampler`` over the dense float64 statistics."""


class LogitsThreshold(ThresholdSampler):
    """``ThresholdSampler`` reading the network's whole logits in chunks (its path where the network offers no head
    in chunks, and on every network before 2026-12-06's ``head_fn``)."""

    reads_head = False


class LogitsEB(EBSampler):
    """``EBSampler`` reading the network's whole logits in chunks."""

    reads_head = False


class LogitsConfidence(ConfidenceSampler):
    """``ConfidenceSampler`` reading the network's whole logits (its path where the network offers no head in chunks,
    and on every network before 2026-12-06's ``head_fn``)."""

    reads_head = False


class LogitsAncestral(AncestralSampler):
    """``AncestralSampler`` reading the network's whole logits (its path where the network offers no head in chunks,
    and on every network before 2026-12-06's ``head_fn``)."""

    reads_head = False


class LogitsSemiAR(SemiARConfidenceSampler):
    """``SemiARConfidenceSampler`` reading the network's whole logits (its path where the network offers no head in
    chunks, and on every network before 2026-12-06's ``head_fn``)."""

    reads_head = False


class TwoPassConfidence(ConfidenceSampler):
    """``ConfidenceSampler`` on the head's chunks making the committing rows' head product a second time for the
    draw at T > 0 (``draw_at``), as before its fold kept the group masses (2026-12-06)."""

    keeps_masses = False


class TwoPassSemiAR(SemiARConfidenceSampler):
    """``SemiARConfidenceSampler`` (``score="max_prob"`` at T > 0) drawing from a second head product."""

    keeps_masses = False


class TwoPassThreshold(ThresholdSampler):
    """``ThresholdSampler`` (``confidence="max_prob"`` at T > 0) drawing from a second head product."""

    keeps_masses = False


class TwoPassEB(EBSampler):
    """``EBSampler`` at T > 0 drawing from a second head product."""

    keeps_masses = False
