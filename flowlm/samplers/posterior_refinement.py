"""Posterior Refinement (PR) and the a-priori commit loop on FMLM+ (methods.md §5)."""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from flowlm.ops.draws import pick_tokens
from flowlm.samplers.base import FlowDenoiser, SampleOutput
from flowlm.samplers.common import check_score, check_temperature
from flowlm.samplers.flow_map import flow_jumps, flow_jumps_summary, summary_at_slots
from flowlm.samplers.planned import PlannedSampler


class PosteriorRefinementSampler(PlannedSampler):
    """Draft everything, commit the confident tokens, re-noise the rest, repeat for R rounds.

    Each round drafts the uncommitted tokens from s = 0 to 1 in ``flow_steps`` flow-map jumps (N NFE) and scores
    them by the a-posteriori confidence p_max = max_v δ_{s,1}(x)^{l,v} (``confidence="posterior"``, PR); or, with
    ``confidence="a_priori"``, by the diagonal denoiser δ_{0,0} (token-wise marginals given the committed context,
    as an MDM would: one NFE per round). Commit rule: p_max ≥ ``threshold`` plus at least ⌈#uncommitted /
    rounds_left⌉ top tokens (``commit="uniform"``) or exactly the top ``top_k`` (``commit="top_k"``, plus the
    threshold); the last round commits everything. Committed tokens become one-hot at s = 1 and are never revisited.
    NFE = R × N: without ``early_stop`` the loop reads nothing back from the device, so it spends its R rounds even
    when the threshold has committed every token sooner (later rounds then change nothing). ``early_stop=True``: one
    host read per round, and the loop ends once every row is committed; ``row_nfe`` holds each row's N × (rounds it
    had uncommitted tokens at), ``nfe`` the calls the batch made (≤ R × N). ``rounds=None`` takes R = budget // N,
    ``flow_steps=None`` N = budget // R (the released text settings: R = 4 and N = 8 at 32 NFE on TinyStories,
    N = 32 at 128 on OWT), so one config serves an NFE sweep.

    The draft is the argmax (the released code) or, at ``temperature`` > 0, a float64 Gumbel draw; it is scored by
    ``score``: "max_prob", p_max (methods' step 3; the default) or "sampled", the draft token's probability. The
    reported confidence of a committed token is its probability.
    """

    family = "flow"

    def __init__(
        self,
        *,
        rounds: int | None = None,
        threshold: float = 0.999,
        commit: str = "uniform",
        top_k: int | None = None,
        flow_steps: int | None = 1,
        noise: str = "fresh",
        confidence: str = "posterior",
        temperature: float = 0.0,
        score: str = "max_prob",
        early_stop: bool = False,
    ) -> None:
        if rounds is not None and rounds < 1:
            raise ValueError(f"PR needs rounds ≥ 1, got {rounds}")
        if not 0 < threshold <= 1:
            raise ValueError(f"PR threshold must lie in (0, 1], got {threshold}")
        if commit not in ("uniform", "top_k"):
            raise ValueError(f"commit must be 'uniform' or 'top_k', got {commit!r}")
        if commit == "top_k" and (top_k is None or top_k < 1):
            raise ValueError("commit='top_k' needs top_k ≥ 1")
        if flow_steps is None and rounds is None:
            raise ValueError("PR needs rounds or flow_steps (or both); the other then follows from the NFE budget")
        if flow_steps is not None and flow_steps < 1:
            raise ValueError(f"flow_steps must be ≥ 1, got {flow_steps}")
        if noise not in ("fresh", "reuse"):
            raise ValueError(f"noise must be 'fresh' or 'reuse', got {noise!r}")
        if confidence not in ("posterior", "a_priori"):
            raise ValueError(f"confidence must be 'posterior' or 'a_priori', got {confidence!r}")
        if confidence == "a_priori" and flow_steps != 1:
            raise ValueError("the a-priori loop scores δ_{0,0} with one NFE per round: flow_steps must be 1")
        self.rounds, self.threshold, self.commit, self.top_k = rounds, threshold, commit, top_k
        self.flow_steps, self.noise, self.confidence = flow_steps, noise, confidence
        self.temperature = check_temperature(temperature)
        self.score = check_score(score)
        self.early_stop = bool(early_stop)

    @property
    def confidence_kind(self) -> str:
        """PR scores the finished draft (a-posteriori); the a-priori loop scores δ_{0,0} (a-priori)."""
        return "a-posteriori" if self.confidence == "posterior" else "a-priori"

    def plan(self, nfe: int, free_positions: int | None = None) -> tuple[int, int]:
        """Rounds R and flow steps per round N for an NFE budget (R × N ≤ budget), or a clear error."""
        self.check_budget(nfe, free_positions=free_positions)
        if self.rounds is not None and self.flow_steps is not None:
            return self.rounds, self.flow_steps
        if self.rounds is None:
            return nfe // self.flow_steps, self.flow_steps
        return self.rounds, nfe // self.rounds

    def check_budget(self, nfe: int, *, free_positions: int | None = None) -> None:  # noqa: D102
        super().check_budget(nfe, free_positions=free_positions)
        if self.rounds is not None and self.flow_steps is not None and self.rounds * self.flow_steps > nfe:
            raise ValueError(
                f"PR with R = {self.rounds} rounds × N = {self.flow_steps} flow steps spends "
                f"{self.rounds * self.flow_steps} NFE, above the budget of {nfe}"
            )
        if self.rounds is None and nfe < self.flow_steps:
            raise ValueError(f"NFE budget {nfe} is below one round of {self.flow_steps} flow steps")
        if self.flow_steps is None and nfe < self.rounds:
            raise ValueError(f"NFE budget {nfe} is below {self.rounds} rounds of at least one flow step")

    def schedule(self, nfe: int, prompt: Tensor, prompt_mask: Tensor) -> tuple[int, int]:
        """R and N (``plan``) for the whole row (at most the positions to generate: no host read)."""
        return self.plan(nfe, prompt.shape[-1])

    def sample(self, model: FlowDenoiser, prompt: Tensor, prompt_mask: Tensor, schedule, generator) -> SampleOutput:
        """Sample with R × N network calls (fewer with ``early_stop``, once every row is committed)."""
        rounds, steps = schedule
        space, device = model.states, prompt.device  # states over the vocabulary, or h = x·E (see FlowDenoiser)
        committed = prompt_mask.clone()
        tokens = prompt.clone()
        confidence = prompt_mask.float()
        positions = torch.arange(prompt.shape[1], device=device)
        noise = space.noise(prompt.shape, generator, device)
        calls = 0
        row_nfe = torch.zeros(prompt.shape[0], dtype=torch.long, device=device)
        # the greedy draft's one host read: the most uncommitted positions a row holds, a bound kept on the host after
        # it (the head then runs at those slots only, ``_summary``)
        most_open = int((~committed).sum(-1).max()) if committed.numel() and self.temperature == 0 else 0
        for r in range(rounds):
            x = torch.where(committed[..., None], space.data(tokens), noise)
            if self.temperature == 0:  # the greedy draft reads (log p_max, argmax) only: no (B, L, |V|) log δ
                log_max, draft = self._summary(model, x, committed, steps, most_open)
                p_draft = score = log_max.exp()  # the draft's probability is p_max
            else:
                log_probs = self._draft(model, x, committed, steps)
                draft = pick_tokens(log_probs, self.temperature, generator)
                p_draft = log_probs.gather(-1, draft[..., None]).squeeze(-1).exp()
                score = log_probs.amax(-1).exp() if self.score == "max_prob" else p_draft  # p_max
            calls += steps
            open_ = ~committed
            row_nfe += steps * open_.any(-1)  # a row spends this round's calls while it holds an uncommitted token
            commit = self._commit_mask(score, open_, rounds - r, positions)
            tokens = torch.where(commit, draft, tokens)
            confidence = torch.where(commit, p_draft, confidence)
            committed = committed | commit
            if self.early_stop and bool(committed.all()):  # the one host read per round early stopping costs
                break
            if self.noise == "fresh" and r < rounds - 1:  # re-noise every uncommitted position with fresh N(0, I)
                noise = space.noise(prompt.shape, generator, device)
            most_open -= self._least_commit(most_open, rounds - r)
        return SampleOutput(
            tokens=tokens, confidence=confidence, nfe=calls, row_nfe=row_nfe if self.early_stop else None
        )

    def _draft(self, model: FlowDenoiser, x: Tensor, committed: Tensor, steps: int) -> Tensor:
        """log δ_{0,1} of the uncommitted tokens in N flow-map jumps (PR), or log δ_{0,0} (a-priori: N = 1)."""
        if self.confidence == "a_priori":
            return model.at(x, 0.0, 0.0, committed)
        return flow_jumps(model, x, committed, steps)

    def _summary(
        self, model: FlowDenoiser, x: Tensor, committed: Tensor, steps: int, most_open: int
    ) -> tuple[Tensor, Tensor]:
        """``_draft`` read off as (max_v log δ, argmax_v) per position (``FlowDenoiser.summary_at``), the head run at
        the uncommitted positions only: every row's are among its first ``most_open`` slots (``slots``), the values
        at the other positions −∞ and token 0, which the round never reads."""
        if self.confidence == "a_priori":
            read = functools.partial(model.summary_at, x, 0.0, 0.0, committed)
        else:
            read = functools.partial(flow_jumps_summary, model, x, committed, steps)
        return summary_at_slots(read, ~committed, most_open)

    def _least_commit(self, n_open: int, rounds_left: int) -> int:
        """How many of ``n_open`` uncommitted positions a round commits at least (the threshold commits more, the
        last round all): n − k(n) is non-decreasing in n, so the most-open row's count less its k bounds every
        row's after the round."""
        return n_open if rounds_left == 1 else self._top(n_open, rounds_left)

    def _top(self, n_open, rounds_left: int):
        """The commit rule's k for ``n_open`` uncommitted positions (an int, or a count per row): ⌈n / rounds_left⌉
        (uniform budget) or min(n, top_k) — one formula for the round's commits and the host's bound on them."""
        if self.commit == "uniform":
            return (n_open + rounds_left - 1) // rounds_left
        return n_open.clamp(max=self.top_k) if isinstance(n_open, Tensor) else min(n_open, self.top_k)

    def _commit_mask(self, score: Tensor, open_: Tensor, rounds_left: int, positions: Tensor) -> Tensor:
        """Threshold ∪ top-k (uniform budget ⌈open / rounds_left⌉ or a fixed k); everything on the last round."""
        if rounds_left == 1:
            return open_
        k = self._top(open_.sum(-1), rounds_left)
        masked_score = torch.where(open_, score, -math.inf)
        order = masked_score.argsort(dim=-1, descending=True)
        rank = torch.empty_like(order).scatter_(-1, order, positions.expand_as(order))
        return open_ & ((rank < k[:, None]) | (score >= self.threshold))
