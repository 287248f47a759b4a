"""MLFM sampler: bridge-DDPM steps on embeddings with CCFG and Online Token Promotion (methods.md §6).

One step from t to t' on the free (masked, not promoted) positions:
    p = softmax(logits(z, t)),  x̂₁ = p·E                      posterior and endpoint estimate (1 NFE)
    CCFG: v_w = v + w·(v − v_corr), v = (x̂₁ − z)/(1 − t), v_corr from z_corr = z with the context re-noised by the
          bridge marginal at t (1 more NFE; noise drawn in float64). At the same z (z_corr = z at free positions) this
          is x̂₁,w = x̂₁ + w·(x̂₁ − x̂₁,corr) = q·E with q = p + w·(p − p_corr), the guided posterior (rows with no
          context take q = p exactly).
    z' ~ N(((1 − t')/(1 − t))·z + ((t' − t)/(1 − t))·x̂₁,w, σ²(t' − t)(1 − t')/(1 − t)·I)
    clean positions (prompt, promoted tokens) are reset to their embeddings.
The last step lands at t' = 1, where z = x̂₁,w exactly.

Cost at a text vocabulary: a greedy trajectory (temperature 0, ``final_decode`` call or conditional) reads each call
through the model's ``posterior_fn``: p's mode, max and x̂₁ = p·E from the head's vocabulary chunks, and the CCFG
target as x̂₁,w = x̂₁ + w·(x̂₁ − x̂₁,corr) (linear in p), so no (B, L, |V|) tensor is made; x̂₁ is one (B·L) × |V| ×
d product per call, which the step needs by its definition. A draw at temperature > 0 and the guided decode read
the whole posterior (the dense path, also the models without ``posterior_fn``). Final decoding (``final_decode``):
  - ``call`` (the released sampler, ``SamplingProposal.propose``: one more network call on the final state at the
    end of the time grid, conditional only, as with its default velocity-space guidance): free positions take a draw at
    ``temperature`` (0 = argmax) from softmax(logits(z, 1)). It costs 1 NFE per trajectory and is made whenever the
    budget has room for it after one step; at the smallest budgets (NFE 1, or 2 with CCFG) the trajectory decodes
    ``guided`` instead.
  - ``guided``: the last step's guided posterior q (negative parts clipped, renormalised), no extra call.
OTP (paper): a free position whose posterior mode has probability ≥ 1 − ε is promoted — fixed to the mode's embedding
and treated as context from then on, from a step's posterior before its bridge step, at every step: the CCFG
reference of that step (``guidance_scope=context``) already re-noises the new context. The released code's variant
(``otp_mode=rounds``) runs whole trajectories and promotes between them from the final posterior (at least one token
per round, as it does). Removed (the suite's earlier choices, reproducing no released sampler): ``otp_order``
(accepted at "before_step" only) and ``final_decode="conditional"``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from flowlm.ops.draws import pick_tokens
from flowlm.processes.bridge import BridgeProcess
from flowlm.removed import REMOVED_SAMPLER_OPTIONS, check_removed
from flowlm.samplers.base import SampleOutput, Sampler
from flowlm.samplers.common import check_temperature

GUIDANCE_SCOPES = ("prompt", "context")
OTP_MODES = ("trajectory", "rounds")
FINAL_DECODES = ("call", "guided")
GRIDS = ("uniform", "density")


@dataclass(frozen=True)
class BridgeDenoiser:
    """An MLFM as samplers see it: ``fn(z (B, L, d), t (B,)) → logits over the data vocabulary (B, L, |V|)``, the
    embedding table E the network reads with [MASK] at row ``mask_id`` (the last row, or one inside the vocabulary:
    LLaDA, Dream), |V| = ``data_vocab_size`` and the bridge process.

    ``posterior_fn(z, t, mean=True)``, when the model has it, returns what a greedy trajectory reads of p =
    softmax(fn(z, t)), without a (B, L, |V|) tensor: (log max_v p, argmax_v, x̂₁ = p·E, or None with ``mean=False``).
    """

    fn: Callable[[Tensor, Tensor], Tensor]
    table: Tensor
    mask_id: int
    data_vocab_size: int
    process: BridgeProcess
    posterior_fn: Callable[..., tuple[Tensor, Tensor, Tensor | None]] | None = None

    @property
    def embeddings(self) -> Tensor:
        """E's data rows (|V|, d): x̂₁ = p·E."""
        return self.table[: self.data_vocab_size]

    @property
    def mask_embedding(self) -> Tensor:
        """m = E[MASK] (d,): the bridge's t = 0 end."""
        return self.table[self.mask_id]


@dataclass
class _Posterior:
    """One network call read as the trajectory needs it: the posterior's max probability and mode (B, L), and
    either x̂₁ = p·E (the chunked path) or p itself and the logits (the dense path; ``log_probs`` at the end)."""

    p_max: Tensor
    mode: Tensor
    mean: Tensor | None = None
    probs: Tensor | None = None
    logits: Tensor | None = None
    log_probs: Tensor | None = None


class MLFMSampler(Sampler):
    """Bridge-DDPM sampling with optional CCFG (``guidance`` w > 0) and OTP (``otp_eps`` > 0).

    NFE = network calls made, never above the budget. The budget is split evenly over ``rounds`` trajectories
    (n = ⌊nfe / rounds⌋ each); a step costs c = 2 NFE with CCFG (conditional + context-corrupted reference), else 1.
    With ``final_decode=call`` a trajectory takes ⌊(n − 1)/c⌋ steps plus the final call at t = 1 (1 NFE), or, when
    n = c, one step and no final call; otherwise ⌊n/c⌋ steps. CCFG on a batch with no context to corrupt (no prompt
    in any row; with ``guidance_scope=context`` also no promoted token: the first round of ``otp_mode=rounds``, or
    OTP off) skips the reference: its v_corr = v, so c = 1 and the sampler is the unguided one. Deciding this reads
    the prompt mask back once per call (w > 0 only), nothing inside the loop; ``check_context=False`` reads nothing
    and always pays c = 2 with CCFG. A batch where only some rows have context pays c = 2, and its rows without
    context take v_w = v exactly.
    ``grid``: steps uniform in t, or at equal quantiles of the training t density.
    """

    family = "mlfm"
    confidence_kind = "a-posteriori"  # the posterior at the end of the trajectory (or at a promotion)

    def __init__(
        self,
        *,
        guidance: float = 0.0,
        guidance_scope: str = "prompt",
        otp_eps: float = 0.0,
        otp_mode: str = "trajectory",
        otp_order: str = "before_step",
        rounds: int = 1,
        grid: str = "uniform",
        final_decode: str = "call",
        check_context: bool = True,
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
        check_removed(
            "MLFMSampler",
            "otp_order",
            otp_order,
            REMOVED_SAMPLER_OPTIONS["otp_order"],
            "OTP promotes before each bridge step",
        )
        if rounds < 1 or (rounds > 1 and otp_mode != "rounds"):
            raise ValueError(f"rounds={rounds}: must be ≥ 1, and > 1 only with otp_mode=rounds")
        if grid not in GRIDS:
            raise ValueError(f"grid must be one of {GRIDS}, got {grid!r}")
        if final_decode == "conditional":  # removed: the last step's conditional posterior
            raise ValueError("MLFMSampler: final_decode='conditional' was removed; use call (released) or guided")
        if final_decode not in FINAL_DECODES:
            raise ValueError(f"final_decode must be one of {FINAL_DECODES}, got {final_decode!r}")
        self.guidance = guidance
        self.guidance_scope = guidance_scope
        self.otp_eps = otp_eps
        self.otp_mode = otp_mode
        self.rounds = rounds
        self.grid = grid
        self.final_decode = final_decode
        self.check_context = check_context
        self.temperature = check_temperature(temperature)

    @property
    def cost_per_step(self) -> int:
        """Network calls per step at most: 2 with CCFG (conditional + context-corrupted), else 1."""
        return 2 if self.guidance > 0 else 1

    def plan(self, nfe: int, cost: int) -> tuple[int, bool]:
        """(steps per trajectory, whether each ends with the final call at t = 1) for a budget and a step cost."""
        per_round = nfe // self.rounds
        if self.final_decode == "call" and per_round >= cost + 1:
            return (per_round - 1) // cost, True
        return per_round // cost, False

    def check_budget(self, nfe: int, *, free_positions: int | None = None) -> None:
        """At least one step per trajectory (at the step cost of a batch with context)."""
        super().check_budget(nfe, free_positions=free_positions)
        need = self.cost_per_step * self.rounds
        if nfe < need:
            raise ValueError(
                f"MLFMSampler: NFE budget {nfe} is below one step per round ({self.rounds} round(s) × "
                f"{self.cost_per_step} NFE per step{' with CCFG' if self.guidance > 0 else ''} = {need}); the final "
                "call at t = 1 (1 NFE per round) is made only when the budget leaves room for it"
            )

    def __call__(
        self, model: BridgeDenoiser, *, prompt: Tensor, prompt_mask: Tensor, nfe: int, generator: torch.Generator
    ) -> SampleOutput:
        """Sample completions of ``prompt``; returns tokens, per-token confidence and the NFE spent."""
        self.check_budget(nfe, free_positions=prompt.shape[-1])  # at most the sequence: no host read
        fixed = prompt_mask.clone()
        tokens = torch.where(fixed, prompt, 0)  # free positions hold a placeholder id until decoded
        confidence = prompt_mask.float()
        in_trajectory = self.otp_eps > 0 and self.otp_mode == "trajectory"
        # The whole posterior only where a decode needs it: a draw (T > 0), the guided posterior q.
        dense = model.posterior_fn is None or self.temperature > 0 or self.final_decode == "guided"
        has_prompt: bool | None = None
        spent = 0
        for r in range(self.rounds):
            reference = self.guidance > 0
            # Context that appears during sampling: promoted tokens (≥ 1 per row after a round; maybe mid-trajectory)
            promoted_context = self.guidance_scope == "context" and (r > 0 or in_trajectory)
            if reference and self.check_context and not promoted_context:
                if has_prompt is None:
                    has_prompt = bool(prompt_mask.any())  # the one host read of a call (CCFG only)
                reference = has_prompt
            steps, final_call = self.plan(nfe, 2 if reference else 1)
            # a guided decode (final_decode=guided, or call without room for the call) reads the whole q of CCFG
            guided_decode = not final_call and reference
            out = self._trajectory(
                model,
                tokens,
                fixed,
                confidence,
                prompt_mask,
                generator,
                steps=steps,
                reference=reference,
                final_call=final_call,
                promote=in_trajectory,
                dense=dense or guided_decode,
            )
            tokens, fixed, confidence = out.tokens, out.fixed, out.confidence
            spent += out.nfe
            free = ~fixed
            final = out.final
            if r == self.rounds - 1:  # decode everything still free
                if self.temperature == 0:
                    draw, p_draw = final.mode, final.p_max
                else:
                    draw = pick_tokens(final.log_probs, self.temperature, generator)
                    p_draw = final.log_probs.gather(-1, draw[..., None]).squeeze(-1).exp()
                tokens = torch.where(free, draw, tokens)
                confidence = torch.where(free, p_draw, confidence)
            else:  # round-based OTP: promote the confident free positions (at least one per row), run again
                pmax = torch.where(free, final.p_max, -1.0)
                new = free & (pmax >= 1 - self.otp_eps)
                best = (torch.arange(pmax.shape[-1], device=pmax.device) == pmax.argmax(-1, keepdim=True)) & free
                new = new | (best & ~new.any(-1, keepdim=True))
                tokens = torch.where(new, final.mode, tokens)
                confidence = torch.where(new, pmax, confidence)
                fixed = fixed | new
        return SampleOutput(tokens=tokens, confidence=confidence, nfe=spent)

    def _promote(self, post: _Posterior, tokens: Tensor, fixed: Tensor, confidence: Tensor) -> tuple[Tensor, ...]:
        """OTP: fix every free position whose posterior mode has probability ≥ 1 − ε to that mode."""
        new = ~fixed & (post.p_max >= 1 - self.otp_eps)
        return torch.where(new, post.mode, tokens), fixed | new, torch.where(new, post.p_max, confidence)

    @staticmethod
    def _posterior(model: BridgeDenoiser, z: Tensor, t: Tensor, *, dense: bool, mean: bool = True) -> _Posterior:
        """The network at (z, t): through ``posterior_fn`` (x̂₁ if ``mean``), or its whole softmax (``dense``)."""
        if dense:
            logits = model.fn(z, t).float()
            probs = F.softmax(logits, -1)
            p_max, mode = probs.max(-1)
            return _Posterior(p_max=p_max, mode=mode, probs=probs, logits=logits)
        log_max, mode, x1 = model.posterior_fn(z, t, mean=mean)
        return _Posterior(p_max=log_max.exp(), mode=mode, mean=x1)

    def _trajectory(
        self,
        model: BridgeDenoiser,
        tokens: Tensor,
        fixed: Tensor,
        confidence: Tensor,
        prompt_mask: Tensor,
        generator: torch.Generator,
        *,
        steps: int,
        reference: bool,
        final_call: bool,
        promote: bool,
        dense: bool,
    ) -> _Trajectory:
        """One trajectory from t = 0 to 1 with ``fixed`` positions clean (and, if ``promote``, OTP inside it):
        ``steps`` bridge steps (with the CCFG reference call if ``reference``), then the final posterior."""
        table = model.table.float()
        emb, m = table[: model.data_vocab_size], table[model.mask_id]  # E's data rows, m = E[MASK]
        b = tokens.shape[0]
        process = model.process
        grid = time_grid(process, steps, self.grid)
        tokens, fixed, confidence = tokens.clone(), fixed.clone(), confidence.clone()
        clean = emb[tokens]
        z = torch.where(fixed[..., None], clean, m)  # t = 0: every free position at the [MASK] embedding
        nfe = 0
        post = guided = None
        for k in range(steps):
            t, t_next = grid[k], grid[k + 1]
            tt = torch.full((b,), t, device=z.device)
            post = self._posterior(model, z, tt, dense=dense)
            nfe += 1
            if promote:
                tokens, fixed, confidence = self._promote(post, tokens, fixed, confidence)
                clean = emb[tokens]
            guided, target = post.probs, post.mean
            if reference:
                # CCFG reference: the context re-noised by the forward bridge marginal at the current t.
                scope = prompt_mask if self.guidance_scope == "prompt" else fixed
                eps = torch.randn(z.shape, generator=generator, device=z.device, dtype=torch.float64)  # float64 ε
                z_corr = process.noise(tokens, tt, ~scope, draws=eps, embeddings=table, mask_id=model.mask_id).state
                z_corr = torch.where(scope[..., None], z_corr, z)
                corr = self._posterior(model, z_corr, tt, dense=dense)
                nfe += 1
                w = self.guidance * scope.any(-1).to(torch.float32)[:, None, None]  # a row with no context: v_corr = v
                # v_w = v + w·(v − v_corr), v = (x̂₁ − z)/(1 − t): at the same z, x̂₁,w = q·E, q = p + w·(p − p_corr)
                if dense:
                    guided = corr.probs.sub_(post.probs).mul_(-w).add_(post.probs)  # in place: one (B, L, |V|) buffer
                else:
                    target = corr.mean.sub_(post.mean).mul_(-w).add_(post.mean)  # x̂₁ + w·(x̂₁ − x̂₁,corr)
            z = process.ddpm_step(z, guided @ emb if dense else target, t, t_next, generator)
            z = torch.where(fixed[..., None], clean, z)  # clean positions are reset every step
        if final_call:  # the released decode: one conditional call on the final state, at t = 1
            final = self._posterior(model, z, torch.full((b,), grid[-1], device=z.device), dense=dense, mean=False)
            nfe += 1
        elif guided is None and not dense:  # the conditional posterior: the guided one without CCFG
            final = post
        else:  # the last step's guided posterior q, where z(1) = q·E (clipped at 0, renormalised): dense only
            q = guided.clamp_min(0)
            q = q / q.sum(-1, keepdim=True)
            p_max, mode = q.max(-1)
            final = _Posterior(p_max=p_max, mode=mode, probs=q, log_probs=q.log())
        if final.logits is not None:  # the dense call or last posterior: its log-probabilities for a draw
            final.log_probs = F.log_softmax(final.logits, -1)
        return _Trajectory(tokens=tokens, fixed=fixed, confidence=confidence, final=final, nfe=nfe)


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
    final: _Posterior
    nfe: int
