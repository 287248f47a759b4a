"""The MDM samplers' earlier whole-tensor random stream (``draws="full"``, removed from the runtime), kept as test
oracles: a float64 log-softmax and Gumbel-max draw over the whole (B, L, |V|) at every step, the ranking over every
position. The samplers draw only where a step commits or unmasks, in the same law (tests/samplers/
test_committed_draws.py); at temperature 0 they commit the same tokens as these."""

from __future__ import annotations

import torch

from flowlm.ops.draws import pick_tokens
from flowlm.samplers import AncestralSampler, ConfidenceSampler, SampleOutput, SemiARConfidenceSampler
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
    """``SemiARConfidenceSampler`` (no cache) drawing at every position of every step, ranking the block's."""

    def sample(self, model, prompt, prompt_mask, schedule, generator) -> SampleOutput:
        n_blocks, steps, _ = schedule
        model, x, confidence, cost = self.start(model, prompt, prompt_mask)
        free = ~prompt_mask
        block_id = torch.where(free, (free.cumsum(-1) - 1) // self.block_length, -1)
        n_free = free.sum(-1).clamp_min(1)
        calls = 0
        for b in range(n_blocks):
            for k in range(steps):
                masked = x == model.mask_id
                eligible = masked & (block_id == b)
                log_p = torch.log_softmax(model.fn(x, masked.sum(-1) / n_free).double(), -1)
                calls += cost
                n_commit = torch.div(eligible.sum(-1) + steps - k - 1, steps - k, rounding_mode="floor")
                candidate = pick_tokens(log_p, self.temperature, generator)
                x, confidence = _commit_ranked(log_p, candidate, eligible, n_commit, x, confidence, self.score)
        return SampleOutput(tokens=x, confidence=confidence, nfe=calls)
