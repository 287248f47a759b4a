"""SMDM's unsupervised classifier-free guidance for the MDM samplers (docs/pretrained.md, "Unsupervised CFG").

The unconditional branch is the same network on the same state with the prompt positions set to [MASK]; no
separately trained unconditional model ("unsupervised": SMDM trains without prompt dropout). At every step,
on the raw logits, in float32 at least:

    un   = fn(x with x[prompt] = [MASK], t),   cond = fn(x, t)
    guided = un + (w + 1)(cond − un)

(SMDM `eval/gen_model_answer.py::diff_sample` and `evaluate_gsm8k.py`, LLaDA `generate.py`: the same formula, applied
to the model's logits before the temperature / Gumbel draw.) The coefficients (−w, w + 1) sum to 1, so a per-position
constant added to both branches passes through unchanged: guiding log-probabilities instead of logits gives the
same softmax. A token the denoiser excludes (−∞ in either branch: [MASK] inside LLaDA's / Dream's head) stays −∞,
so a sampler never proposes [MASK]. w = 0 is the unguided model itself (``guided_denoiser`` returns it unchanged).

Cost and NFE convention (the one place it is defined): the two branches run as **one** network call over 2B rows
(the conditional rows first), as SMDM and LLaDA do; that call counts as **2 NFE**, the network evaluations of B
sequences it makes. The NFE budget counts network evaluations, as MLFM's CCFG does (methods.md §6): with w > 0 a step
costs ``CFG_EVALUATIONS`` = 2, so a budget of N gives ⌊N / 2⌋ steps; a budget below one guided step (or, for a
sampler with blocks, below two per block) is refused before any network call. ``GuidedSampler`` is what the guided
samplers share: their options, that budget, and the guided model.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from flowlm.ops.draws import Generators, check_generators
from flowlm.samplers.base import MaskedDenoiser
from flowlm.samplers.common import check_draws, check_score, check_temperature, masked_start
from flowlm.samplers.planned import PlannedSampler

CFG_EVALUATIONS = 2  # network evaluations per guided step: the conditional and the prompt-masked branch


def check_cfg_scale(cfg_scale: float) -> float:
    """A guidance scale w: finite and ≥ 0 (0 = unguided)."""
    if not (isinstance(cfg_scale, int | float) and math.isfinite(cfg_scale) and cfg_scale >= 0):
        raise ValueError(
            f"cfg_scale (unsupervised CFG's w) must be a finite number ≥ 0 (0 = no guidance), got {cfg_scale!r}"
        )
    return float(cfg_scale)


def evaluations_per_step(cfg_scale: float) -> int:
    """Network evaluations one sampler step spends: 2 with guidance (w > 0), else 1."""
    return CFG_EVALUATIONS if cfg_scale > 0 else 1


def guided_steps(name: str, nfe: int, cfg_scale: float, *, at_least: int = 1) -> int:
    """The steps a budget of ``nfe`` network evaluations buys, ⌊nfe / cost per step⌋, or a clear error (before any
    compute) when that is fewer than ``at_least`` (one per block for a blocked sampler)."""
    cost = evaluations_per_step(cfg_scale)
    steps = nfe // cost
    if steps < at_least:
        guided = f" with cfg_scale={cfg_scale:g} (unsupervised CFG: {cost} network evaluations per step)" * (cost > 1)
        raise ValueError(
            f"{name}: NFE budget {nfe} buys {steps} step(s){guided}; at least {at_least} step(s) = "
            f"{at_least * cost} NFE needed"
        )
    return steps


def guided_denoiser(model: MaskedDenoiser, prompt_mask: Tensor, cfg_scale: float) -> MaskedDenoiser:
    """``model`` with unsupervised CFG at scale w (the module docstring): the same ``MaskedDenoiser`` whose fn returns
    un + (w + 1)(cond − un), float32 at least, from one call of ``model.fn`` over [x; x with the prompt masked].
    w = 0: ``model`` itself (the unguided path, one call per step, the same random stream). A row without a prompt
    has un = cond (the same input), so it takes cond: un + (w + 1)·0."""
    w = check_cfg_scale(cfg_scale)
    if w == 0:
        return model

    def fn(x: Tensor, t: Tensor) -> Tensor:
        b = x.shape[0]
        uncond = torch.where(prompt_mask, model.mask_id, x)  # the prompt positions set to [MASK]
        t = t.expand(b) if t.dim() == 0 else t
        both = model.fn(torch.cat([x, uncond]), torch.cat([t, t]))  # one call, 2B rows: conditional rows first
        dtype = torch.promote_types(both.dtype, torch.float32)
        cond, un = both[:b].to(dtype), both[b:].to(dtype)
        guided = un + (w + 1) * (cond - un)  # SMDM / LLaDA: un_logits + (cfg + 1)(logits − un_logits)
        excluded = (cond == -torch.inf) | (un == -torch.inf)  # [MASK] inside the head: −∞ in both, not NaN
        return guided.masked_fill(excluded, -torch.inf)

    # the view holds the batch's prompt mask: it computes whole batches only
    return MaskedDenoiser(fn=fn, mask_id=model.mask_id, time_conditioned=model.time_conditioned, rows_alone=False)


class GuidedSampler(PlannedSampler):
    """An MDM sampler with unsupervised CFG at ``cfg_scale`` w, as the confidence, semi-AR and ancestral samplers
    are: their options, a budget of ⌊nfe / cost⌋ steps, and the guided model with the all-[MASK] start. The sampler
    draws for the B rows it decodes (the unconditional branch draws nothing), so per-row generators apply as without
    guidance."""

    row_generators = True  # ``generator`` may be one per row (flowlm.ops.draws.Generators)

    def __init__(self, *, temperature: float, draws: str, cfg_scale: float, score: str | None = None) -> None:
        self.temperature = check_temperature(temperature)
        if score is not None:  # the commit loops' ranking (``check_score``); the ancestral sampler has none
            self.score = check_score(score)
        check_draws(type(self).__name__, draws)
        self.cfg_scale = check_cfg_scale(cfg_scale)

    def check_budget(self, nfe: int, *, free_positions: int | None = None) -> None:  # noqa: D102
        super().check_budget(nfe, free_positions=free_positions)
        guided_steps(type(self).__name__, nfe, self.cfg_scale)

    def schedule(self, nfe: int, prompt: Tensor, prompt_mask: Tensor) -> int:
        """The steps the budget buys (``guided_steps``), once it is checked against the whole row."""
        super().schedule(nfe, prompt, prompt_mask)
        return guided_steps(type(self).__name__, nfe, self.cfg_scale)

    def start(
        self, model: MaskedDenoiser, prompt: Tensor, prompt_mask: Tensor, generator: Generators = None
    ) -> tuple[MaskedDenoiser, Tensor, Tensor, int]:
        """The model the steps call (``guided_denoiser``), the all-[MASK] start and its confidence (``masked_start``),
        and the network evaluations a step costs; ``generator`` checked (one, or one per row: ``Generators``)."""
        check_generators(generator, prompt.shape[0], prompt.device)
        model = guided_denoiser(model, prompt_mask, self.cfg_scale)
        x, confidence = masked_start(prompt, prompt_mask, model.mask_id)
        return model, x, confidence, evaluations_per_step(self.cfg_scale)
