"""Semi-autoregressive confidence sampling for MDMs (LLaDA's ``generate``: blocks left to right, low-confidence
remasking inside each block; methods.md §2)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from flowlm.ops.draws import draw_at, row_uniforms
from flowlm.ops.summary import chunked_head_keep, chunked_head_summary, draw_kept, keeps_draw
from flowlm.samplers.base import MaskedDenoiser, SampleOutput, Sampler
from flowlm.samplers.block_cache import BlockCachedReader, check_cache
from flowlm.samplers.common import block_ids, column_major_head, slots
from flowlm.samplers.guidance import GuidedSampler, guided_steps
from flowlm.samplers.mdm_confidence import commit_slots, max_log_prob


class SemiARConfidenceSampler(GuidedSampler):
    """Each row's non-prompt positions in blocks of ``block_length``, left to right: row r has n_r = ⌈free_r /
    block_length⌉ blocks of K_r = budget // n_r steps, and at step k commits the ⌈#masked in block / (K_r − k)⌉ most
    confident of its block's masked positions (LLaDA's ``get_num_transfer_tokens`` split: the remainder goes to the
    first steps). Later blocks stay [MASK] and are seen by the network. Candidates: argmax at T = 0, else a float64
    Gumbel draw from softmax(logits / T); ``score`` "sampled" ranks by p_θ(candidate) (LLaDA's low_confidence
    remasking), "max_prob" by max_v p_θ(v). A row's plan is its own, so it decodes alike alone and in any batch:
    ``row_nfe`` = n_r × K_r, NFE = max_r n_r × K_r (a row past its schedule does not move). ``cfg_scale`` w > 0:
    SMDM's unsupervised CFG (``flowlm.samplers.guidance``; LLaDA's ``generate`` has the same ``cfg_scale``) on the
    logits every step reads; a step spends 2 network evaluations, so K_r = ⌊budget / 2⌋ // n_r and row_nfe =
    2 × n_r × K_r.

    Cost beyond the network: only the current block's positions are ever
    eligible, so only their ≤ ``block_length`` rows of the logits are read (``slots``): at T = 0 (the default) the
    argmax and log max p in float32 (``max_log_prob``), the two scores' common value; at T > 0 with "max_prob" the
    same ranking, then the float64 draw at the committing positions only (the ranking does not depend on it); with
    "sampled" the draw at every block position first (``draw_rows``, two-level inverse CDF), ranked by its log p.
    Per-row generators (``flowlm.ops.draws.Generators``): at T > 0 each step draws from each row's generator one
    categorical u per position, read where the row draws.

    ``cache`` "prefix" | "dual" (block_cache.py, Fast-dLLM's block KV cache): a block's first step (and every
    ``refresh`` steps) is a full pass; its other steps run on the block and what follows it (prefix) or the block
    alone (dual), the rest read from the cache (each row's own block: a row decodes alike alone and in a batch). On
    the DiT and the LLaMA family. NFE unchanged; approximate unless ``refresh=1``. Not with guidance.
    """

    reads_head = True  # read the network's head at the block's slots where it offers one (``MaskedDenoiser.head_fn``)
    keeps_masses = True  # at T > 0 the head's fold keeps the group masses the draw after the rank reads
    column_major = True  # the head's weight laid out (d, |V|) once a decode on the CPU (``column_major_head``)

    family = "mdm"
    confidence_kind = "a-priori"

    def __init__(
        self,
        *,
        block_length: int,
        temperature: float = 0.0,
        score: str = "sampled",
        draws: str = "committed",
        cfg_scale: float = 0.0,
        cache: str = "none",
        refresh: int | None = None,
    ) -> None:
        if block_length < 1:
            raise ValueError(f"block_length must be ≥ 1, got {block_length}")
        self.block_length = block_length
        self.cache, self.refresh = check_cache(cache, refresh), refresh
        if cache != "none" and cfg_scale > 0:
            raise ValueError("cache (the block KV cache) does not combine with cfg_scale > 0: use cache=none")
        super().__init__(temperature=temperature, score=score, draws=draws, cfg_scale=cfg_scale)

    def plan(self, nfe: int, free_positions: int, *, capped: bool = True) -> tuple[int, int]:
        """(blocks, steps per block) for a row with ``free_positions`` to generate, or a clear error before any
        compute; ``capped``: the budget is also checked against that row's cap (``Sampler.check_budget``)."""
        if capped:
            Sampler.check_budget(self, nfe, free_positions=free_positions)  # guidance is checked per block below
        n_blocks = max(1, math.ceil(free_positions / self.block_length))
        if self.cfg_scale == 0 and nfe < n_blocks:
            raise ValueError(f"{n_blocks} blocks of {self.block_length} need at least {n_blocks} NFE, got {nfe}")
        steps = guided_steps(f"{n_blocks} blocks of {self.block_length}", nfe, self.cfg_scale, at_least=n_blocks)
        return n_blocks, steps // n_blocks

    def check_budget(self, nfe: int, *, free_positions: int | None = None) -> None:  # noqa: D102
        if free_positions is None:
            super().check_budget(nfe)
        else:
            self.plan(nfe, free_positions)

    def schedule(self, nfe: int, prompt: Tensor, prompt_mask: Tensor) -> tuple[Tensor, list[tuple[int, int, int]]]:
        """Each row's index into the plans (B,), and for each distinct number of positions to generate f in the batch
        (the call's one host read) the plan (f, blocks, steps per block); the budget checked against the longest."""
        distinct, row_plan = torch.unique((~prompt_mask).sum(-1), return_inverse=True)
        counts = distinct.tolist()
        self.check_budget(nfe, free_positions=max(counts, default=0))
        return row_plan, [(f, *self.plan(nfe, f, capped=False)) for f in counts]

    def split(self, free: int, n_blocks: int, steps: int) -> list[int]:
        """The commits of a row with ``free`` positions at each of its blocks × K steps: ⌈#masked in block / (K − k)⌉
        at step k (LLaDA's split)."""
        commits = []
        for b in range(n_blocks):
            most = min(self.block_length, max(free - b * self.block_length, 0))
            for k in range(steps):
                commits.append(-(-most // (steps - k)))
                most -= commits[-1]
        return commits

    def sample(self, model: MaskedDenoiser, prompt: Tensor, prompt_mask: Tensor, schedule, generator) -> SampleOutput:
        """max_r n_r × K_r steps (network evaluations: × 2 with guidance); row r's k-th step in its block b is the
        batch's step b·K_r + k, and a row past its n_r × K_r steps has no block left (it does not move)."""
        row_plan, plans = schedule
        model, x, confidence, cost = self.start(model, prompt, prompt_mask, generator)
        fn, reader = self.network(model, x.shape[1])
        # the network's head at the block's slots only, where it offers one (through the block cache too: its
        # reader then gives the head's input; not with CFG)
        if reader is None:
            head = model.head_fn if self.reads_head else None
        else:
            head = reader if reader.head else None
        if self.column_major:  # the head's weight laid out once a decode for its chunks' product
            head = column_major_head(head)
        block_id, n_free = self.blocks(prompt_mask)
        positions = torch.arange(x.shape[1], device=x.device)
        each_plan = torch.tensor([plan[1:] for plan in plans], dtype=torch.long, device=x.device).view(-1, 2)
        n_blocks, steps = each_plan[row_plan].unbind(-1)  # each row's (blocks, steps per block)
        commits = [self.split(*plan) for plan in plans]  # on the host: the most any row commits at each step
        total = max(map(len, commits), default=0)
        for g in range(total):
            block, k = g // steps, g % steps  # each row's block and its step in it
            if any(g % plan[2] == 0 for plan in plans):  # some row enters a block
                in_block = block_id == block[:, None]
                if reader is not None:  # each row's block lies in [lo, hi) (empty where the row has no block b)
                    lo = torch.where(in_block, positions, x.shape[1]).amin(-1)
                    reader.block(lo, torch.where(in_block, positions + 1, 0).amax(-1), None if g == 0 else k == 0)
                slot, _ = slots(in_block, self.block_length)  # the blocks' positions (only they are ever eligible)
            masked = x == model.mask_id
            if head is None:
                logits, linear = fn(x, masked.sum(-1) / n_free), None
            else:  # the head's input: the head runs at the block's slots only (``commit``)
                logits, *linear = head(x, masked.sum(-1) / n_free)
            width = max(c[g] for c in commits if g < len(c))  # every committing slot of every row is among these
            x, confidence = self.commit(
                x, confidence, logits, masked & in_block, slot, steps - k, width, generator, linear=linear
            )
        return SampleOutput(tokens=x, confidence=confidence, nfe=total * cost, row_nfe=n_blocks * steps * cost)

    def network(self, model: MaskedDenoiser, length: int):
        """The network call, through the block KV cache where asked, and that cache's reader (None without)."""
        if self.cache == "none":
            return model.fn, None
        reader = BlockCachedReader(model, self.cache, self.refresh, length, head=self.reads_head)
        return reader, reader

    def blocks(self, prompt_mask: Tensor) -> tuple[Tensor, Tensor]:
        """Each position's block among its row's positions to fill (``block_ids``), and each row's count of them."""
        free = ~prompt_mask
        return block_ids(free, self.block_length), free.sum(-1).clamp_min(1)

    def commit(
        self,
        x: Tensor,
        confidence: Tensor,
        logits: Tensor,
        eligible: Tensor,
        slot: Tensor,
        left,
        width: int,
        generator,
        *,
        linear: list[Tensor | None] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """One call's commits: of each row's ``eligible`` positions (its block's masked ones, held in ``slot``),
        the ⌈#eligible / ``left``⌉ best scored take their candidates (``left``: the row's steps left in its block);
        ``width``: how many of a row's best-ranked slots can commit (the draw's width under "max_prob").
        ``linear`` = (W, b): ``logits`` is the head's input (B, L, d), and the head runs at the slots only."""
        positions = torch.arange(x.shape[1], device=x.device)
        block_rows = slot + torch.arange(x.shape[0], device=x.device)[:, None] * x.shape[1]  # rows of (B·L, |V|)
        flat = block_rows.reshape(-1)
        draw_all = self.temperature > 0 and self.score == "sampled"  # the ranking reads the draw: draw every slot
        n_commit = torch.div(eligible.sum(-1) + left - 1, left, rounding_mode="floor")  # ⌈eligible / left⌉
        by_row = logits.reshape(-1, logits.shape[-1])
        live = eligible.gather(1, slot)
        per_row = row_uniforms(generator, x.shape, x.device, self.temperature)
        vocab = None if linear is None else linear[0].shape[0]
        kept = None  # the slots' group masses, kept by the head's fold for the draw after the rank

        def draw(rows: Tensor) -> tuple[Tensor, Tensor]:  # at the flat positions ``rows``
            return draw_at(by_row, rows, self.temperature, generator, uniforms=per_row, linear=linear)

        if draw_all:
            drawn, log_p = draw(flat)
            candidate, score = drawn.view(slot.shape), log_p.view(slot.shape)
        elif linear is not None and self.temperature > 0 and self.keeps_masses and keeps_draw(flat.numel(), vocab):
            # log max p from the head's chunks at the slots, the draw at the committing ones from the same pass
            read, kept = chunked_head_keep(by_row[flat], *linear, self.temperature)
            score, candidate = read.log_max.view(slot.shape), x.gather(1, slot)  # every committing one drawn
        elif linear is not None:  # argmax and log max p from the head's chunks at the slots
            read = chunked_head_summary(by_row[flat], *linear)
            score, candidate = read.log_max.view(slot.shape), read.argmax.view(slot.shape)
        else:  # argmax and log max p (the score at T = 0, where "sampled" and "max_prob" coincide)
            score, candidate = (t.view(slot.shape) for t in max_log_prob(logits, rows=flat))
        order = torch.where(live, score, -torch.inf).argsort(dim=-1, descending=True)
        rank = torch.empty_like(order).scatter_(-1, order, positions[: order.shape[1]].expand_as(order))
        commit = live & (rank < n_commit[:, None])
        p_candidate = score
        if self.temperature > 0 and not draw_all:  # "max_prob": the draw at the committing slots only
            top = order[:, :width]
            committing = block_rows.gather(1, top).view(-1)
            if kept is None:
                drawn, log_p = draw(committing)
            else:  # the slots' rows of the kept fold: slot (b, j) is its row b·W + j
                kept_rows = (top + torch.arange(top.shape[0], device=top.device)[:, None] * slot.shape[1]).view(-1)
                own = None if per_row is None else per_row.reshape(-1)[committing]
                drawn, log_p = draw_kept(kept, kept_rows, generator, uniforms=own)
            candidate = candidate.scatter(1, top, drawn.view(top.shape))
            p_candidate = score.scatter(1, top, log_p.float().view(top.shape))
        return commit_slots(x, confidence, slot, commit, candidate, p_candidate)
