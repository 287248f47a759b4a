"""MLFM sampler: bridge-DDPM steps on embeddings with CCFG and Online Token Promotion (methods.md §6).

One step from t to t' on the free (masked, not promoted) positions:
    x̂₁ = softmax(logits(z, t))·E                              endpoint estimate (1 NFE)
    CCFG: x̂₁ ← x̂₁ + w·(x̂₁ − x̂₁(z_corr)), z_corr = z with the context re-noised by the bridge marginal at t
          (1 more NFE); with the same z this is the guided field v_w = v + w·(v − v_corr), v = (x̂₁ − z)/(1 − t)
    z' ~ N(((1 − t')/(1 − t))·z + ((t' − t)/(1 − t))·x̂₁, σ²(t' − t)(1 − t')/(1 − t)·I)
    clean positions (prompt, promoted tokens) are reset to their embeddings.
OTP (paper): after a step, a free position whose posterior mode has probability ≥ 1 − ε is promoted — fixed to the
mode's embedding and treated as context from then on. The released code's variant (``otp_mode=rounds``) instead runs
whole trajectories and promotes between them (at least one token per round, as it does). Promotion and the final
decoding read the conditional posterior softmax(logits(z, t)) (the released code's choice; guidance acts on the
trajectory); at t' = 1 the free positions take a draw from the last step's posterior at ``temperature`` (0 = argmax).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from flowlm.processes.bridge import BridgeProcess
from flowlm.samplers.base import SampleOutput, Sampler, check_temperature, pick_tokens

GUIDANCE_SCOPES = ("prompt", "context")
OTP_MODES = ("trajectory", "rounds")
GRIDS = ("uniform", "density")


@dataclass(frozen=True)
class BridgeDenoiser:
    """An MLFM as samplers see it: ``fn(z (B, L, d), t (B,)) → logits over the data vocabulary (B, L, |V|)``, the
    data rows of the embedding matrix E (|V|, d), the [MASK] embedding m (d,) and the bridge process."""

    fn: Callable[[Tensor, Tensor], Tensor]
    embeddings: Tensor
    mask_embedding: Tensor
    process: BridgeProcess


class MLFMSampler(Sampler):
    """Bridge-DDPM sampling with optional CCFG (``guidance`` w > 0: 2 NFE per step) and OTP (``otp_eps`` > 0).

    The NFE budget sets the number of steps: ⌊nfe / (cost per step)⌋, split evenly over ``rounds`` trajectories in
    the round-based OTP variant. ``grid``: steps uniform in t, or at equal quantiles of the training t density.
    """

    family = "mlfm"

    def __init__(
        self,
        *,
        guidance: float = 0.0,
        guidance_scope: str = "prompt",
        otp_eps: float = 0.0,
        otp_mode: str = "trajectory",
        rounds: int = 1,
        grid: str = "uniform",
        temperature: float = 0.0,
    ) -> None:
        if guidance < 0:
            raise ValueError(f"CCFG guidance scale w must be ≥ 0, got {guidance}")
        if guidance_scope not in GUIDANCE_SCOPES:
            raise ValueError(f"guidance_scope must be one of {GUIDANCE_SCOPES}, got {guidance_scope!r}")
        if not 0 <= otp_eps < 1:
            raise ValueError(f"OTP ε must be in [0, 1) (0 = no promotion), got {otp_eps}")
        if otp_mode not in OTP_MODES:
            raise ValueError(f"otp_mode must be one of {OTP_MODES}, got {otp_mode!r}")
        if rounds < 1 or (rounds > 1 and otp_mode != "rounds"):
            raise ValueError(f"rounds={rounds}: must be ≥ 1, and > 1 only with otp_mode=rounds")
        if grid not in GRIDS:
            raise ValueError(f"grid must be one of {GRIDS}, got {grid!r}")
        self.guidance = guidance
        self.guidance_scope = guidance_scope
        self.otp_eps = otp_eps
        self.otp_mode = otp_mode
        self.rounds = rounds
        self.grid = grid
        self.temperature = check_temperature(temperature)

    @property
    def cost_per_step(self) -> int:
        """Network calls per step: 2 with CCFG (conditional + context-corrupted), else 1."""
        return 2 if self.guidance > 0 else 1

    def check_budget(self, nfe: int, *, free_positions: int | None = None) -> None:
        """At least one step per trajectory."""
        super().check_budget(nfe)
        need = self.cost_per_step * self.rounds
        if nfe < need:
            raise ValueError(
                f"MLFMSampler: NFE budget {nfe} is below one step per round ({self.rounds} round(s) × "
                f"{self.cost_per_step} NFE per step{' with CCFG' if self.guidance > 0 else ''} = {need})"
            )

    def __call__(
        self, model: BridgeDenoiser, *, prompt: Tensor, prompt_mask: Tensor, nfe: int, generator: torch.Generator
    ) -> SampleOutput:
        """Sample completions of ``prompt``; returns tokens, per-token confidence and the NFE spent."""
        self.check_budget(nfe)
        steps = nfe // (self.cost_per_step * self.rounds)
        fixed = prompt_mask.clone()
        tokens = torch.where(fixed, prompt, 0)  # free positions hold a placeholder id until decoded
        confidence = prompt_mask.float()
        spent = 0
        for r in range(self.rounds):
            last_round = r == self.rounds - 1
            in_trajectory = self.otp_eps > 0 and self.otp_mode == "trajectory"
            out = self._trajectory(
                model, tokens, fixed, confidence, prompt_mask, steps, generator, promote=in_trajectory
            )
            tokens, fixed, confidence = out.tokens, out.fixed, out.confidence
            spent += out.nfe
            free = ~fixed
            if last_round:  # decode everything still free
                draw = pick_tokens(out.final_log_probs, self.temperature, generator)
                p_draw = out.final_log_probs.gather(-1, draw[..., None]).squeeze(-1).exp()
                tokens = torch.where(free, draw, tokens)
                confidence = torch.where(free, p_draw, confidence)
            else:  # round-based OTP: promote the confident free positions (at least one per row), run again
                pmax, mode = out.final_log_probs.exp().max(-1)
                pmax = torch.where(free, pmax, -1.0)
                new = free & (pmax >= 1 - self.otp_eps)
                best = (torch.arange(pmax.shape[-1], device=pmax.device) == pmax.argmax(-1, keepdim=True)) & free
                new = new | (best & ~new.any(-1, keepdim=True))
                tokens = torch.where(new, mode, tokens)
                confidence = torch.where(new, pmax, confidence)
                fixed = fixed | new
        return SampleOutput(tokens=tokens, confidence=confidence, nfe=spent)

    def _trajectory(
        self,
        model: BridgeDenoiser,
        tokens: Tensor,
        fixed: Tensor,
        confidence: Tensor,
        prompt_mask: Tensor,
        steps: int,
        generator: torch.Generator,
        *,
        promote: bool,
    ) -> _Trajectory:
        """One trajectory from t = 0 to 1 with ``fixed`` positions clean (and, if ``promote``, OTP inside it)."""
        emb = model.embeddings.float()
        m = model.mask_embedding.float()
        b = tokens.shape[0]
        process = model.process
        grid = time_grid(process, steps, self.grid)
        tokens, fixed, confidence = tokens.clone(), fixed.clone(), confidence.clone()
        clean = emb[tokens]
        z = torch.where(fixed[..., None], clean, m)  # t = 0: every free position at the [MASK] embedding
        nfe = 0
        logits = None
        for k in range(steps):
            t, t_next = grid[k], grid[k + 1]
            tt = torch.full((b,), t, device=z.device)
            logits = model.fn(z, tt).float()
            nfe += 1
            probs = F.softmax(logits, -1)
            x1 = probs @ emb  # x̂₁ = softmax(logits)·E
            if self.guidance > 0:
                # CCFG reference: the context re-noised by the forward bridge marginal at the current t.
                scope = prompt_mask if self.guidance_scope == "prompt" else fixed
                z_corr = process.sample(m, clean, tt, scope, generator)
                z_corr = torch.where(scope[..., None], z_corr, z)
                x1_corr = F.softmax(model.fn(z_corr, tt).float(), -1) @ emb
                nfe += 1
                # v_w = v + w·(v − v_corr) with v = (x̂₁ − z)/(1 − t) at the same z ⇔ x̂₁ + w·(x̂₁ − x̂₁,corr).
                x1 = x1 + self.guidance * (x1 - x1_corr)
            z = process.ddpm_step(z, x1, t, t_next, generator)
            if promote and k < steps - 1:
                pmax, mode = probs.max(-1)
                new = ~fixed & (pmax >= 1 - self.otp_eps)
                tokens = torch.where(new, mode, tokens)
                confidence = torch.where(new, pmax, confidence)
                fixed = fixed | new
                clean = emb[tokens]
            z = torch.where(fixed[..., None], clean, z)  # clean positions are reset every step
        log_probs = F.log_softmax(logits, -1)  # the last step's posterior (only the last one is read)
        return _Trajectory(tokens=tokens, fixed=fixed, confidence=confidence, final_log_probs=log_probs, nfe=nfe)


@functools.lru_cache(maxsize=64)
def time_grid(process: BridgeProcess, steps: int, grid: str) -> tuple[float, ...]:
    """The k + 1 step times 0 → 1 (uniform, or equal quantiles of the training t density), as Python floats.
    Cached: the density grid inverts the γ mixture's CDF by bisection, the same for every call with these
    settings (the process is a frozen dataclass, so it is a key)."""
    values = process.t_quantiles(steps) if grid == "density" else torch.linspace(0, 1, steps + 1)
    return tuple(values.tolist())


@dataclass
class _Trajectory:
    tokens: Tensor
    fixed: Tensor
    confidence: Tensor
    final_log_probs: Tensor
    nfe: int
