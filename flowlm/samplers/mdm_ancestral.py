"""MDLM ancestral sampler with the no-change cache (methods.md §2)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from flowlm.ops.draws import draw_at, draw_uniforms, row_uniforms
from flowlm.samplers.base import MaskedDenoiser, SampleOutput
from flowlm.samplers.common import call_rows, read_counts, rows_to_call
from flowlm.samplers.guidance import GuidedSampler


class AncestralSampler(GuidedSampler):
    """Time grid 1 → 0 in ``nfe`` steps; a masked token unmasks with probability (α_s − α_t)/(1 − α_t).

    Under α_t = 1 − t that probability is (t − s)/t; the last step goes to s = 0, where it is 1, so every token
    is decoded within the budget and no extra "noise removal" call is spent. A step in which no token changed
    leaves the input unchanged, so a time-agnostic network's output is reused at no NFE (``ddpm_cache``).
    ``row_nfe``: the calls each row needs, while it holds [MASK], its first and one after each step that changed it
    (every step without the cache), as alone; ``nfe``: the batch's, a call whenever some row needs one. A call
    computes only the rows that need it (``call_rows``; every row where the view holds the batch, CFG's), the others
    keeping their last output: a batch costs its rows' own calls (Σ ``row_nfe`` forwards of one row), not ``nfe``
    forwards of every row. Each step reads back from the device, in one read, how many tokens unmask and how many
    rows the next call computes: they decide whether the next step spends an NFE (the cache, and the early exit once
    nothing is masked). The float64 draw is made at the unmasking positions only, by the two-level inverse CDF of
    ``draw_rows``, which also gives the drawn token's log-probability from the same normaliser. Per-row generators
    (``flowlm.ops.draws.Generators``): each step draws from each row's generator its L coins, then (T > 0) L
    categorical uniforms, one per position, read where the row unmasks.

    ``cfg_scale`` w > 0: SMDM's unsupervised CFG (``flowlm.samplers.guidance``); each step spends 2 network
    evaluations, so the grid has ⌊nfe / 2⌋ steps (a cached step spends none).
    """

    family = "mdm"
    confidence_kind = "a-priori"  # p_θ(token) when it unmasks, before the masked rest is drawn
    reads_head = True  # read the network's head at the unmasking rows only where it offers one (``head_fn``)

    def __init__(
        self, *, temperature: float = 1.0, cache: bool = True, draws: str = "committed", cfg_scale: float = 0.0
    ) -> None:
        super().__init__(temperature=temperature, draws=draws, cfg_scale=cfg_scale)
        self.cache = cache

    def sample(self, model: MaskedDenoiser, prompt: Tensor, prompt_mask: Tensor, steps: int, generator) -> SampleOutput:
        """The grid of ``steps`` steps (at most ``nfe`` network evaluations; a cached step spends none)."""
        model, x, confidence, cost = self.start(model, prompt, prompt_mask, generator)
        batch = x.shape[0]
        masked = x == model.mask_id
        need = masked.any(-1)  # the rows the next call computes: those holding [MASK] whose input changed
        # tracked on the host from here: drawn tokens are data ids, never [MASK]
        remaining, n_need = read_counts(masked.sum(), need.sum(), bound=masked.numel())
        cacheable = self.cache and not model.time_conditioned
        # the network's head only at the rows that unmask, where it offers one (not with CFG): the call keeps the
        # head's input (B, L, d) instead of the logits (B, L, |V|)
        head = model.head_fn if self.reads_head else None
        logits: Tensor | None = None  # each row's latest call's logits, or with ``head`` its head input
        calls = 0
        row_nfe = torch.zeros(batch, dtype=torch.long, device=x.device)
        for k in range(steps):
            t, s = 1.0 - k / steps, 1.0 - (k + 1) / steps
            if n_need:  # a call on the rows that need it (each row's own NFE; the others keep their last output)
                rows = rows_to_call(model, need, n_need)
                logits, linear = call_rows(head or model.fn, x, torch.full((batch,), t, device=x.device), rows, logits)
                calls, row_nfe, n_need = calls + cost, row_nfe + cost * need, 0
            # Only the positions that unmask need the categorical draw: the unmask coins, then the draw on those rows.
            p_unmask = (t - s) / t  # (α_s − α_t)/(1 − α_t) with α = 1 − t
            u = draw_uniforms(generator, x.shape, x.device)  # the unmask coins
            categorical = row_uniforms(generator, x.shape, x.device, self.temperature)  # per row: every step
            unmask = masked & (u < p_unmask)
            # the next call's rows: those still holding [MASK] that changed (every one, uncached)
            need = (masked & ~unmask).any(-1) & (unmask.any(-1) | (not cacheable))
            # the step's one host read: how many positions unmask, and how many rows the next call computes
            n_unmask, n_need = read_counts(unmask.sum(), need.sum(), bound=unmask.numel())
            rows = torch.nonzero_static(unmask, size=n_unmask).unbind(-1)
            if n_unmask:
                flat = rows[0] * x.shape[1] + rows[1]  # the rows of the call's output viewed as (B·L, ·)
                source = logits.reshape(-1, logits.shape[-1])  # logits, or with ``head`` the head's input
                through = None if head is None else linear  # the head's product at the unmasking rows only
                if self.temperature == 0:
                    picked = (source[flat] if through is None else F.linear(source[flat], *through)).float()
                    draw = picked.argmax(-1)
                    p_draw = (picked.gather(-1, draw[:, None]).squeeze(-1) - picked.logsumexp(-1)).exp()
                else:  # read in column tiles from the logits themselves: no (n, |V|) gather, cast or second pass
                    draw, log_p = draw_at(
                        source, flat, self.temperature, generator, uniforms=categorical, linear=through
                    )
                    p_draw = log_p.exp().float()
                x = x.index_put(rows, draw.to(x.dtype))
                confidence = confidence.index_put(rows, p_draw)
            masked = masked & ~unmask
            remaining -= n_unmask
            if remaining == 0:  # everything decoded: no further call
                break
        return SampleOutput(tokens=x, confidence=confidence, nfe=calls, row_nfe=row_nfe)
