"""Adaptive-NFE decoding of MDMs: each network call commits as many masked positions as a rule allows (the threshold
sampler, ``mdm_threshold.py``; the EB-sampler, ``mdm_eb.py``), so a row spends as many calls as its content needs.

One call, per row:

    eligible                       the masked positions of the row's current block (the first block, of ``block_length``
                                   positions from the row's first non-prompt position, that still holds [MASK]; all
                                   masked positions without blocks)
    p = softmax(logits)            read at the eligible positions only: max_v p and its argmax, and the margin
                                   p₍₁₎ − p₍₂₎ and entropy H(p) where the rank or the rule needs them
    rank                           by ``score``: max_v p (max_prob), p₍₁₎ − p₍₂₎ (margin), −H(p) (entropy); best first
    n                              the rule's count (``select``), at least 1, and at least ⌈#masked / calls left⌉
    commit                         the n best eligible positions, each to argmax p (T = 0) or a draw from p^(1/T)

The statistics come from ``flowlm.ops.summary.chunked_summary``: the logits read in vocabulary chunks in float32, no
(B, L, |V|) tensor beyond the network's own logits (the dense float64 log_softmax stays as the tests' oracle,
tests/samplers/oracles.py ``DenseStats``); on the suite's DiT from the head's own chunks at the eligible positions
(``chunked_head_summary``: the network's whole logits are never made). Where no rank or rule reads the draw, at
T > 0 the draw is made at the committing positions only, by the two-level inverse CDF (``flowlm.ops.draws.draw_rows``):
one uniform per position and call from per-row generators (before 2026-12-06: |V| Gumbel uniforms per position, a
change of stream, the same law); on the head's chunks from the 64-column group masses the summary's pass kept
(``chunked_head_keep``, ``draw_kept``: the same u, each eligible row's head product made once a call). Where the rule
reads it (the threshold's drawn-token rule), the draw is made at every eligible position: on the head's chunks in the
same pass as the summary (``chunked_head_draw``, the same u), else from the logits. Host reads per call: how many
positions are eligible and how many rows still hold [MASK], in one read (before the network call; it also ends the
loop once nothing is masked), and, at T > 0, the committing positions. The network computes only the rows that still
hold [MASK] (``call_rows``; with the block cache every row): a batch costs its rows' own calls (Σ ``row_nfe``
forwards of one row), not ``nfe`` forwards of every row.

The NFE budget is a cap: the lower bound ⌈#masked / calls left⌉ is the fixed-step confidence sampler's schedule, and
the budget's last call commits every masked position (every block), as that sampler's last step does; no row ever
spends more than the budget. ``SampleOutput.row_nfe`` holds the calls each row needed (a row stops counting once it
holds no [MASK]); ``nfe`` is the calls the batch made.

``cache`` "prefix" | "dual" with ``block_length`` (block_cache.py, Fast-dLLM's block KV cache, as ``semi_ar``'s): a
row's first call in a block (and every ``refresh`` calls) is a full pass for it, its other calls run its block and
what follows (prefix) or its block alone (dual) over the keys kept from that pass; the budget's last call, which
commits beyond the block, is a full pass. Rows enter blocks at different calls; each keeps its own schedule. The
calls, and so the NFE, are the same as without the cache; approximate unless ``refresh=1``.

Per-row generators (``flowlm.ops.draws.Generators``): at T > 0 each call draws from each row's generator one uniform
per position, read where the row commits; a row's calls, rule and blocks are its own, so it decodes alike (tokens and
``row_nfe``) alone and inside any batch.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import NamedTuple

import torch
from torch import Tensor

from flowlm.ops.draws import check_generators, draw_at, row_uniforms
from flowlm.ops.summary import (
    KeptDraw,
    PositionSummary,
    chunked_head_draw,
    chunked_head_keep,
    chunked_head_summary,
    chunked_summary,
    draw_kept,
    keeps_draw,
)
from flowlm.samplers.base import MaskedDenoiser, SampleOutput
from flowlm.samplers.block_cache import BlockCachedReader, check_cache
from flowlm.samplers.common import (
    call_rows,
    check_temperature,
    column_major_head,
    masked_start,
    read_counts,
    rows_to_call,
)
from flowlm.samplers.planned import PlannedSampler

RANKS = ("max_prob", "margin", "entropy")


def check_rank(score: str) -> str:
    """How positions are ranked for committing: by max_v p (max_prob), the top-two margin p₍₁₎ − p₍₂₎ (margin,
    arXiv 2502.06768), or the negative entropy −H(p) (entropy, the EB-sampler's default error proxy)."""
    if score not in RANKS:
        raise ValueError(f"score must be one of {RANKS}, got {score!r}")
    return score


class CallStats(NamedTuple):
    """What one call's rank and rule read per position (B, L), meaningful at the eligible positions: the
    ``confidence`` of the position's ``token`` (max_v p and its argmax; at T > 0 under a rule that reads the draw, the
    drawn token and its p), and where asked for the margin p₍₁₎ − p₍₂₎ and the entropy H(p) in nats (else None)."""

    confidence: Tensor
    token: Tensor
    margin: Tensor | None = None
    entropy: Tensor | None = None


def position_scores(stats: CallStats, score: str) -> Tensor:
    """The ranking score of every position (higher commits first): the confidence (max_v p, or the drawn token's p
    under a rule that reads the draw), p₍₁₎ − p₍₂₎, or −H(p) (0 for a certain position, −log |V| for a uniform
    one)."""
    if score == "max_prob":
        return stats.confidence
    return stats.margin if score == "margin" else -stats.entropy


def spread(values: Tensor | None, at: Tensor, shape: tuple[int, int], fill: float) -> Tensor | None:
    """``values`` (n,) at the flat positions ``at`` of a (B, L) tensor of ``shape`` holding ``fill`` elsewhere."""
    if values is None:
        return None
    whole = torch.full((shape[0] * shape[1],), fill, dtype=values.dtype, device=values.device)
    return whole.index_copy_(0, at, values).view(shape)


def blocks_left(masked: Tensor, block: Tensor, n_blocks: int) -> Tensor:
    """Per row (B,): how many of its blocks still hold [MASK] (at least 1)."""
    holding = torch.zeros(masked.shape[0], n_blocks, dtype=torch.long, device=masked.device)
    return (holding.scatter_add_(1, block, masked.long()) > 0).sum(-1).clamp_min(1)


class AdaptiveMDMSampler(PlannedSampler):
    """The loop above; a subclass gives the rule's count per row (``select``)."""

    family = "mdm"
    confidence_kind = "a-priori"  # p_θ(token) when it is committed, before the masked rest is drawn
    row_generators = True  # ``generator`` may be one per row (flowlm.ops.draws.Generators)
    rule_reads_entropy = False  # whether ``select`` reads ``CallStats.entropy`` (the EB rule)
    rule_reads_draw = False  # whether, at T > 0, the rule and the max_prob rank read the drawn token's p (Fast-dLLM)
    reads_head = True  # read the network's head in chunks where it offers one (``MaskedDenoiser.head_fn``)
    keeps_masses = True  # at T > 0 the head's fold keeps the group masses the draw after the rank reads
    column_major = True  # the head's weight laid out (d, |V|) once a decode on the CPU (``column_major_head``)

    def __init__(
        self,
        *,
        score: str = "max_prob",
        block_length: int | None = None,
        temperature: float = 0.0,
        cache: str = "none",
        refresh: int | None = None,
    ):
        self.score = check_rank(score)
        if block_length is not None and block_length < 1:
            raise ValueError(f"block_length must be ≥ 1 (or null: one block), got {block_length}")
        self.block_length = block_length
        self.temperature = check_temperature(temperature)
        self.cache, self.refresh = check_cache(cache, refresh), refresh
        if cache != "none" and block_length is None:
            raise ValueError(f"cache={cache!r} (the block KV cache) needs semi-AR blocks: set block_length")

    @abstractmethod
    def select(self, stats: CallStats, ordered: Tensor, eligible: Tensor) -> Tensor:
        """How many of each row's eligible positions the rule commits (B,), given the call's ``stats`` and the
        positions ``ordered`` best first (B, L; the eligible ones lead)."""

    def stats(self, logits: Tensor, at: Tensor) -> CallStats:
        """``CallStats`` of the (B, L, |V|) ``logits`` at the flat positions ``at`` (of the (B·L,) view), from the
        logits' vocabulary chunks (``chunked_summary``): max_v p and its argmax; every other position holds
        confidence 0, margin 0 and entropy +inf."""
        flat = chunked_summary(logits, rows=at, margin=self.score == "margin", entropy=self.reads_entropy())
        return self.spread_stats(flat, at, logits.shape[:2])

    def head_stats(
        self, features: Tensor, weight: Tensor, bias: Tensor | None, at: Tensor, shape: tuple[int, int]
    ) -> tuple[CallStats, KeptDraw | None]:
        """``stats`` from the head's chunks (``chunked_head_summary``) over ``features`` (n, d) of the positions
        ``at``: the logits of no other position are computed. At T > 0 (the draw at the committing positions after
        the rank) also what that draw needs from the same pass (``chunked_head_keep``: no argmax, token None), within
        ``keeps_draw``'s budget; else None."""
        options = {"margin": self.score == "margin", "entropy": self.reads_entropy()}
        if self.temperature > 0 and self.keeps_masses and keeps_draw(features.shape[0], weight.shape[0]):
            flat, kept = chunked_head_keep(features, weight, bias, self.temperature, **options)
            return self.spread_stats(flat, at, shape), kept
        return self.spread_stats(chunked_head_summary(features, weight, bias, **options), at, shape), None

    def head_draw_stats(
        self,
        features: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        at: Tensor,
        shape: tuple[int, int],
        generator,
        uniforms: Tensor | None,
    ) -> CallStats:
        """``head_stats`` with a draw at T at every position ``at`` in the same pass over the head's chunks
        (``chunked_head_draw``, the stream of ``draw_at``: one u per position): the confidence is the drawn token's
        untempered p, the token the drawn one."""
        flat, drawn, log_p = chunked_head_draw(
            features,
            weight,
            bias,
            self.temperature,
            None if uniforms is not None else generator,
            uniforms=None if uniforms is None else uniforms.reshape(-1)[at],
            margin=self.score == "margin",
            entropy=self.reads_entropy(),
        )
        return CallStats(
            spread(log_p.exp(), at, shape, 0.0),
            spread(drawn, at, shape, 0),
            spread(flat.margin, at, shape, 0.0),
            spread(flat.entropy, at, shape, float("inf")),
        )

    def reads_entropy(self) -> bool:
        """Whether the rank or the rule reads the entropy."""
        return self.score == "entropy" or self.rule_reads_entropy

    @staticmethod
    def spread_stats(flat: PositionSummary, at: Tensor, shape: tuple[int, int]) -> CallStats:
        """A summary at the flat positions ``at`` as (B, L) ``CallStats`` (confidence 0, margin 0, entropy +inf
        elsewhere)."""
        return CallStats(
            spread(flat.log_max.exp(), at, shape, 0.0),
            spread(flat.argmax, at, shape, 0),
            spread(flat.margin, at, shape, 0.0),
            spread(flat.entropy, at, shape, float("inf")),
        )

    def sample(self, model: MaskedDenoiser, prompt: Tensor, prompt_mask: Tensor, nfe: int, generator) -> SampleOutput:
        """Decode with at most ``nfe`` network evaluations (fewer where the rule commits faster)."""
        check_generators(generator, prompt.shape[0], prompt.device)
        x, confidence = masked_start(prompt, prompt_mask, model.mask_id)
        b, length = x.shape
        n_free = (~prompt_mask).sum(-1).clamp_min(1)
        positions = torch.arange(length, device=x.device)
        if self.block_length is None:
            block = torch.zeros_like(x)
        else:
            first = torch.where(prompt_mask, length, positions).amin(-1, keepdim=True)  # first non-prompt position
            block = (positions - first).clamp_min(0) // self.block_length
        n_blocks = 1 if self.block_length is None else -(-length // self.block_length)
        row_nfe = torch.zeros(b, dtype=torch.long, device=x.device)
        forced = torch.zeros(b, dtype=torch.long, device=x.device)  # commits beyond the rule's count
        reader = None
        if self.cache != "none":
            reader = BlockCachedReader(model, self.cache, self.refresh, length, head=self.reads_head)
        fn, entered = (model.fn, None) if reader is None else (reader, torch.full_like(n_free, -1))
        # the head in vocabulary chunks at the eligible positions, where the network offers it (through the block
        # cache too: its reader then gives the head's input); where the rule reads the draw (the threshold's
        # published rule at T > 0) the draw at every eligible position is made in the same pass (``chunked_head_draw``)
        drawn_first = self.temperature > 0 and self.rule_reads_draw
        head = model.head_fn if reader is None and self.reads_head else None
        cached_head = reader is not None and reader.head
        # the head's weight laid out once a decode for its chunks' product, through the cache too
        cached_read = reader if cached_head else None
        if self.column_major:
            head, cached_read = column_major_head(head), column_major_head(cached_read)
        calls = 0
        while calls < nfe:
            masked = x == model.mask_id
            current = torch.where(masked, block, block.max() + 1).amin(-1, keepdim=True)
            # the budget's last call commits the rest, as the fixed-step sampler's last step does
            eligible = masked if calls + 1 == nfe else masked & (block == current)
            need = masked.any(-1)  # the rows the call computes (the block cache's reader keeps every row's window)
            # one host read per call: how many positions are eligible (how many calls a batch needs) and rows need it
            n_at, n_need = read_counts(eligible.sum(), need.sum(), bound=eligible.numel())
            if n_at == 0:  # nothing masked: a row with [MASK] left has some in its current block
                break
            at = torch.nonzero_static(eligible.view(-1), size=n_at).squeeze(1)
            calling = rows_to_call(model, need, n_need)
            if reader is not None:  # rows entering a block, or the last call (a full pass): refresh
                lo = (first + current * self.block_length).clamp(max=length)[:, 0]
                hi = (lo + self.block_length).clamp(max=length)
                reader.block(lo, hi, None if calls + 1 == nfe else current[:, 0] != entered)
                entered = current[:, 0]
            per_row = row_uniforms(generator, x.shape, x.device, self.temperature)
            time = masked.sum(-1) / n_free
            kept = None  # the eligible rows' group masses, kept by the head's fold for the draw after the rank
            if head is None and not cached_head:  # the network's logits, read at the eligible positions
                logits = fn(x, time) if reader is not None else call_rows(fn, x, time, calling)[0]
                by_row, linear = logits.reshape(-1, logits.shape[-1]), None
                # the summary, unless the draw replaces all the rank and rule read (max p and its argmax)
                stats = None if drawn_first and self.score == "max_prob" else self.stats(logits, at)
            else:  # the head's product and summary (and the draw, where the rule reads it) at the eligible positions
                if cached_head:
                    features, *linear = cached_read(x, time)
                else:
                    features, linear = call_rows(head, x, time, calling)
                by_row = features.reshape(-1, features.shape[-1])
                if drawn_first:
                    stats = self.head_draw_stats(by_row[at], *linear, at, x.shape, generator, per_row)
                else:
                    stats, kept = self.head_stats(by_row[at], *linear, at, x.shape)
            calls += 1
            row_nfe += need
            if drawn_first and linear is None:  # the rule reads the drawn token's p: the draw at every eligible one
                drawn, log_p = draw_at(by_row, at, self.temperature, generator, uniforms=per_row)
                p_drawn, token = spread(log_p.exp(), at, x.shape, 0.0), spread(drawn, at, x.shape, 0)
                stats = CallStats(p_drawn, token) if stats is None else stats._replace(confidence=p_drawn, token=token)
            score = torch.where(eligible, position_scores(stats, self.score), -torch.inf)
            ordered = score.argsort(dim=-1, descending=True)
            n_eligible = eligible.sum(-1)
            # the budget's floor: the current block's share of the calls left, split evenly over the row's blocks
            # that still hold [MASK] (without blocks: ⌈#masked / calls left⌉, the confidence sampler's schedule)
            share = torch.div(nfe - calls + 1, blocks_left(masked, block, n_blocks), rounding_mode="floor")
            floor = torch.div(n_eligible + share.clamp_min(1) - 1, share.clamp_min(1), rounding_mode="floor")
            n_rule = torch.minimum(self.select(stats, ordered, eligible).clamp_min(1), n_eligible)
            n_commit = n_eligible if calls == nfe else torch.maximum(n_rule, torch.minimum(floor, n_eligible))
            forced += n_commit - n_rule
            rank = torch.empty_like(ordered).scatter_(-1, ordered, positions.expand_as(ordered))
            commit = eligible & (rank < n_commit[:, None])
            candidate = x if stats.token is None else stats.token  # None: every committing position is drawn
            p_candidate = stats.confidence.float()
            if self.temperature > 0 and not drawn_first:  # the draw at the committing positions only
                rows = commit.view(-1).nonzero().squeeze(1)  # T > 0: the call's second host read
                if kept is not None:  # their rows of the kept fold: their places among the (sorted) eligible ``at``
                    own = None if per_row is None else per_row.reshape(-1)[rows]
                    drawn, log_p = draw_kept(kept, torch.searchsorted(at, rows), generator, uniforms=own)
                else:
                    drawn, log_p = draw_at(by_row, rows, self.temperature, generator, uniforms=per_row, linear=linear)
                candidate = candidate.view(-1).index_copy(0, rows, drawn).view_as(x)
                p_candidate = p_candidate.view(-1).index_copy(0, rows, log_p.exp().float()).view_as(x)
            x = torch.where(commit, candidate, x)
            confidence = torch.where(commit, p_candidate, confidence)
        return SampleOutput(tokens=x, confidence=confidence, nfe=calls, row_nfe=row_nfe, forced=forced)


def sorted_eligible(values: Tensor, ordered: Tensor, eligible: Tensor, fill: float) -> Tensor:
    """``values`` (B, L) in the ranking's order, ``fill`` past each row's eligible positions."""
    n_eligible = eligible.sum(-1, keepdim=True)
    ranks = torch.arange(values.shape[-1], device=values.device)
    return torch.where(ranks < n_eligible, values.gather(-1, ordered), fill)
