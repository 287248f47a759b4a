"""The FMLM+ objective (and FMLM's, FLM's): semigroup self-distillation of a two-time flow map (methods.md §3–4).

The batch's draws, one global draw per step (identical on every rank; a rank takes its slice):

    kinds         exact counts (``split_counts``, the released recipe): ⌊distill·B⌋ distill rows, of the rest R
                  ⌊½R⌋ diagonal and ⌊R/64⌋ boundary, the remainder off-diagonal; shuffled
    times         diagonal s = t ~ U(0, 1); boundary s = 0, t = 1; off-diagonal t − s ~ U(0, 1), s ~ U(0, 1 − (t − s));
                  distill s = t = 0 (``batch_kinds_and_times``; both uniforms stratified over the batch)
    context rate  f ~ U(0, 1) per sequence, stratified (``context_rates``); each non-prompt token is context with
                  probability f (``context_set``)

One batch, given every random draw (the draws above, the noise ε):

    active A      non-prompt tokens outside the context set; prompt and context are pinned at s = t = 1
    x_s           (1 − s)·ε + s·onehot(y) on A, onehot(y) elsewhere                     (t = 0 noise, t = 1 data)
    student       log δ_{s,t}(x_s)
    target        per row, by its pair kind, under no_grad:
      diagonal      s = t             onehot(y)
      off-diagonal  s < t             γ·D1 + (1 − γ)·D2,  u = (s + t)/2,  D1 = δ_{s,u}(x_s),  X_u = X_{s,u}(x_s),
      boundary      s = 0, t = 1                          D2 = δ_{u,t}(X_u),  γ = (1 − t)(u − s) / ((1 − u)(t − s))
      distill       s = t = 0         softmax of an MDM teacher on y with A as [MASK], fed the time 0 (the released
                                      code; ``mdm_teacher_time="rate"``: its masking rate |A| / #non-prompt)
    loss          Σ_{A ∩ scored} −Σ_v target_v · log δ_{s,t}(x_s)_v / |A ∩ scored|

FMLM is the same loss with an empty context set, FLM its diagonal-only case. The state operations (the noisy state,
the flow map) are the process's (``GaussianFlowProcess.noise`` and ``.flow_map``): with an embedding space the
states are h = x·E, the noise z·R, the student and teacher read h (exact in law; methods.md §9).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from flowlm.objectives.base import LossOutput
from flowlm.objectives.flow import SOFT_CAP
from flowlm.ops.fused_ce import fused_capped_ce
from flowlm.processes.gaussian_flow import GaussianFlowProcess

# student(x (B, L, |V|), s (B,), t (B,), pinned (B, L)) → log δ_{s,t}(x) (B, L, |V|): per-sequence times, the
# pinned tokens at s = t = 1.
FlowModel = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
# mdm_teacher(ids (B, L), time (B,)) → logits over the data vocabulary (B, L, |V|), [MASK] removed.
MDMTeacher = Callable[[Tensor, Tensor], Tensor]
# The time the MDM teacher of the distill rows is fed: "zero" (the released ``_teacher_log_q`` feeds 0) or "rate" (the
# masking rate |A| / #non-prompt of the row, the suite's earlier choice). The same for a time-agnostic teacher.
MDM_TEACHER_TIMES = ("zero", "rate")

# ------------------------------------------------------------------------------------ the batch: pairs and draws
# Kinds of training pairs (s, t) in one batch.
DIAGONAL, BOUNDARY, OFF_DIAGONAL, DISTILL = 0, 1, 2, 3
KIND_NAMES = ("diagonal", "boundary", "off_diagonal", "distill")


def split_counts(global_batch: int, *, diagonal: float = 0.5, boundary: float = 1 / 64, distill: float = 0.0):
    """Exact counts of (diagonal, boundary, off-diagonal, distill) sequences in a global batch.

    As in the released code: ⌊distill·B⌋ distill rows first; of the rest R, ⌊diagonal·R⌋ diagonal and
    ⌊boundary·R⌋ boundary rows; the remainder is off-diagonal (B = 256: 128 / 4 / 124 / 0).
    """
    for name, share in (("diagonal", diagonal), ("boundary", boundary), ("distill", distill)):
        if not 0 <= share <= 1:
            raise ValueError(f"the {name} share must lie in [0, 1], got {share}")
    if diagonal + boundary > 1:
        raise ValueError(f"diagonal {diagonal} + boundary {boundary} shares exceed the batch")
    n_dist = math.floor(distill * global_batch)
    rest = global_batch - n_dist
    n_diag = math.floor(diagonal * rest)
    n_bound = math.floor(boundary * rest)
    return n_diag, n_bound, rest - n_diag - n_bound, n_dist


def batch_uniforms(n: int, *, generator: torch.Generator, antithetic: bool = True) -> Tensor:
    """n float64 U(0, 1) draws: i.i.d., or ``antithetic`` (the released code's ``training.antithetic_sampling``):
    one per stratum [i/n, (i+1)/n) of [0, 1), in random order, so each draw is still U(0, 1) but the batch covers
    the interval evenly."""
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    if not antithetic:
        return u
    return ((torch.arange(n, dtype=torch.float64) + u) / n)[torch.randperm(n, generator=generator)]


def batch_kinds_and_times(
    global_batch: int,
    *,
    offset: int,
    count: int,
    generator: torch.Generator,
    diagonal: float = 0.5,
    boundary: float = 1 / 64,
    distill: float = 0.0,
    antithetic: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """Kinds and (s, t) for a slice [offset, offset+count) of one global draw (identical on every rank).

    diagonal: s = t ~ U(0, 1); boundary: s = 0, t = 1; off-diagonal: t−s ~ U(0, 1), s ~ U(0, 1−(t−s));
    distill: s = t = 0 (δ_{0,0} against an MDM teacher). The two uniforms behind the times are stratified over the
    global batch with ``antithetic`` (``batch_uniforms``), as in the released code.
    """
    counts = split_counts(global_batch, diagonal=diagonal, boundary=boundary, distill=distill)
    kinds = torch.repeat_interleave(torch.arange(4), torch.tensor(counts), output_size=global_batch)
    kinds = kinds[torch.randperm(global_batch, generator=generator)]
    u1 = batch_uniforms(global_batch, generator=generator, antithetic=antithetic)
    u2 = batch_uniforms(global_batch, generator=generator, antithetic=antithetic)
    gap = u1
    s_off = u2 * (1 - gap)
    s = torch.where(kinds == DIAGONAL, u1, torch.where(kinds == OFF_DIAGONAL, s_off, torch.zeros_like(u1)))
    t = torch.where(
        kinds == DIAGONAL,
        u1,
        torch.where(kinds == OFF_DIAGONAL, s_off + gap, torch.where(kinds == BOUNDARY, 1.0, 0.0)),
    )
    sl = slice(offset, offset + count)
    return kinds[sl], s[sl].float(), t[sl].float()


def context_rates(
    global_batch: int, *, offset: int, count: int, generator: torch.Generator, antithetic: bool = True
) -> Tensor:
    """Context rates f ~ U(0, 1) for a slice [offset, offset+count) of one global draw (stratified with
    ``antithetic``, as the released code draws them), float64 on the host."""
    return batch_uniforms(global_batch, generator=generator, antithetic=antithetic)[offset : offset + count]


# ------------------------------------------------------------------------------------------ targets and the loss


def context_set(rates: Tensor, uniforms: Tensor, prompt: Tensor) -> Tensor:
    """Each non-prompt token is context (clean, pinned) with its sequence's probability f: uniforms (B, L) < f (B,)."""
    return (uniforms < rates[:, None]) & ~prompt


def semigroup_gamma(s: Tensor, u: Tensor, t: Tensor) -> Tensor:
    """γ = (1−t)(u−s) / ((1−u)(t−s)): the weight of δ_{s,u} in the midpoint target (in [0, 1/2] for u = (s+t)/2).

    Derived from X_{s,t} = X_{u,t} ∘ X_{s,u}: δ_{s,t} = γ·δ_{s,u}(x_s) + (1−γ)·δ_{u,t}(X_{s,u}(x_s)).
    """
    return (1 - t) * (u - s) / ((1 - u) * (t - s)).clamp_min(1e-12)


def semigroup_target(d1: Tensor, d2: Tensor, gamma: Tensor) -> Tensor:
    """target = γ·D1 + (1−γ)·D2, a convex combination of two simplex points (so on the simplex)."""
    gamma = gamma[..., None].to(d1.dtype)
    return gamma * d1 + (1 - gamma) * d2


@torch.no_grad()
def soft_targets(
    kinds: Tensor,
    x_s: Tensor,
    times: tuple[Tensor, Tensor],
    token_times: tuple[Tensor, Tensor],
    active: Tensor,
    *,
    teacher: FlowModel,
    process: GaussianFlowProcess,
    tokens: Tensor | None = None,
    prompt: Tensor | None = None,
    mdm_teacher: MDMTeacher | None = None,
    mask_id: int | None = None,
    mdm_teacher_time: str = "zero",
    every_pass: bool = False,
) -> tuple[Tensor, Tensor] | None:
    """The rows whose target is not one-hot and their targets (stop-gradient): (rows (n,), distributions
    (n, L, |V|)), the jump rows (off-diagonal and boundary: the semigroup midpoint from two ``teacher`` passes joined
    by the ``process``'s flow map) then the distill rows (MDM teacher probabilities: needs ``tokens``, ``prompt``,
    ``mdm_teacher`` and its ``mask_id``; ``mdm_teacher_time``: ``MDM_TEACHER_TIMES``); None when every row is
    diagonal. ``kinds``: host tensor (B,); ``times``: (s, t) per sequence (B,); ``token_times``: the same per token
    (1 off the active set). On the inactive (pinned) tokens of the semigroup rows γ = 0, so their target is
    D2 = δ_{1,1}(X_u) there: the network's output at a pinned token, not a one-hot; it is never scored, so the loss
    does not depend on it.
    ``every_pass``: run each teacher pass even when no row needs it (on row 0, its result dropped), as a sharded
    (FSDP) network needs: its all-gathers are collective, so every rank must run the same forwards whatever kinds its
    rows drew (an empty batch is no way out: transformers' attention cannot reshape one)."""
    (s_seq, t_seq), (s_tok, t_tok) = times, token_times
    device = x_s.device
    # kinds are host data: the rows of each pass are chosen on the host and their indices copied to the device
    # without a stream sync
    host = kinds.tolist()
    jump = [i for i, kind in enumerate(host) if kind not in (DIAGONAL, DISTILL)]
    distill = [i for i, kind in enumerate(host) if kind == DISTILL]
    parts = []
    if jump or every_pass:
        idx = torch.tensor(jump or [0]).to(device, non_blocking=True)  # row 0: a pass only to keep ranks in step
        x, s, t, act = x_s[idx], s_tok[idx], t_tok[idx], active[idx]
        u_seq = (s_seq[idx] + t_seq[idx]) / 2
        u = torch.where(act, u_seq[:, None], 1.0)  # = (s + t) / 2 on the active tokens
        d1 = teacher(x, s_seq[idx], u_seq, ~act).exp()  # D1 = δ_{s,u}(x_s)
        x_u = process.flow_map(x, d1, s, u)  # X_u = X_{s,u}(x_s)
        d2 = teacher(x_u, u_seq, t_seq[idx], ~act).exp()  # D2 = δ_{u,t}(X_u)
        gamma = torch.where(act, semigroup_gamma(s, u, t), 0.0)
        parts += [semigroup_target(d1, d2, gamma)] if jump else []
    if distill or (every_pass and mdm_teacher is not None):
        if mdm_teacher is None or tokens is None or prompt is None or mask_id is None:
            raise ValueError("distill rows need the MDM teacher, its [MASK] id, the tokens and the prompt mask")
        idx = torch.tensor(distill or [0]).to(device, non_blocking=True)
        ids, act = tokens[idx], active[idx]
        masked_in = torch.where(act, mask_id, ids)  # the teacher sees the active tokens as [MASK]
        if mdm_teacher_time == "rate":  # its masking rate
            time = act.float().sum(-1) / (~prompt[idx]).float().sum(-1).clamp_min(1)
        else:  # the released code
            time = torch.zeros(len(idx), device=device)
        probs = F.softmax(mdm_teacher(masked_in, time).float(), dim=-1)
        parts += [probs] if distill else []
    if not parts:
        return None
    rows = torch.tensor(jump + distill).to(device, non_blocking=True)
    return rows, torch.cat(parts) if len(parts) > 1 else parts[0]


def targets(
    kinds: Tensor,
    x_s: Tensor,
    times: tuple[Tensor, Tensor],
    token_times: tuple[Tensor, Tensor],
    onehot: Tensor,
    active: Tensor,
    **kwargs,
) -> Tensor:
    """Per-token target distributions (B, L, |V|), stop-gradient: one-hot (diagonal), semigroup midpoint (off-diagonal
    and boundary; on their inactive tokens D2 = δ_{1,1}(X_u), never scored), MDM teacher probabilities (distill);
    ``soft_targets`` for the arguments. The loss never builds this dense tensor: it scores the one-hot rows by a
    gather."""
    target = onehot.clone()
    soft = soft_targets(kinds, x_s, times, token_times, active, **kwargs)
    if soft is not None:
        rows, values = soft
        target[rows] = values.to(target.dtype)
    return target


def fmlm_plus_loss(
    student: FlowModel,
    tokens: Tensor,
    prompt: Tensor,
    kinds: Tensor,
    s: Tensor,
    t: Tensor,
    *,
    context: Tensor,
    noise: Tensor,
    process: GaussianFlowProcess,
    teacher: FlowModel | None = None,
    mdm_teacher: MDMTeacher | None = None,
    mask_id: int | None = None,
    mdm_teacher_time: str = "zero",
    loss_mask: Tensor | None = None,
    parts: bool = False,
    head: tuple[Tensor, Tensor | None] | None = None,
    every_pass: bool = False,
) -> LossOutput:
    """The soft CE of δ_{s,t}(x_s) against each row's target, on the active tokens (see the module docstring).

    tokens, prompt, context (B, L): ids, prompt mask, context set (``context_set``; all False for FMLM); kinds (B,) on
    the host (``batch_kinds_and_times``); s, t (B,) per-sequence times; noise: the standard normal draws of the
    ``process``'s noisy state (``process.draw_shape``: ε (B, L, |V|), or z (B, L, d) in the embedding space).
    ``teacher`` runs the semigroup passes (default: the student; the caller may wrap it, e.g. to switch dropout);
    ``loss_mask`` (B, L) leaves tokens out of the loss (text PAD). With ``parts``, each kind's mean per-token loss
    (one host read; a kind whose rows score no token is left out). With ``head`` = (W (|V|, d), b) of the output
    Linear, the student returns the head's input features (B, L, d) instead of log δ, and the loss is the fused
    cross-entropy of its soft-capped logits, its gradient made in the same pass (flowlm/ops/fused_ce.py: no
    (B, L, |V|) tensor; the same values to float rounding; per_token is then for logging, without a gradient); the
    ``teacher`` (required then) still returns log δ. ``every_pass``: the teacher passes run on every call, on row 0
    when no row needs them (a sharded network: ``soft_targets``).
    """
    if head is not None and teacher is None:
        raise ValueError("with a fused head the student returns features: the semigroup passes need a teacher")
    active = ~prompt & ~context
    s_tok = torch.where(active, s[:, None], 1.0)  # prompt and context pinned at s = t = 1
    t_tok = torch.where(active, t[:, None], 1.0)
    noised = process.noise(tokens, s_tok, ~active, draws=noise)  # x_s = (1 − s)·ε + s·onehot(y) on the active tokens
    x_s = noised.state
    out = student(x_s, s, t, ~active)  # log δ_{s,t}(x_s) (its head's input with ``head``), before the teachers

    soft = soft_targets(
        kinds,
        x_s,
        (s, t),
        (s_tok, t_tok),
        active,
        teacher=student if teacher is None else teacher,
        process=process,
        tokens=tokens,
        prompt=prompt,
        mdm_teacher=mdm_teacher,
        mask_id=mask_id,
        mdm_teacher_time=mdm_teacher_time,
        every_pass=every_pass,
    )
    scored = active if loss_mask is None else active & loss_mask
    count = scored.sum().clamp_min(1)
    # −Σ_v target_v · log δ_v: a gather where the target is one-hot (diagonal rows), the full sum on the soft rows
    if head is not None:  # the same from the head's blocks, given the masked mean's weights (soft values in float32)
        soft32 = None if soft is None else (soft[0], soft[1].float())
        loss, per_token = fused_capped_ce(out, head[0], head[1], tokens, scored / count, soft32, cap=SOFT_CAP)
        per_token = torch.where(scored, per_token, torch.zeros_like(per_token))
    else:
        log_d = out
        per_token = -log_d.gather(-1, tokens[..., None]).squeeze(-1)
        if soft is not None:
            rows, values = soft
            per_token = per_token.index_copy(0, rows, -(values.to(log_d.dtype) * log_d[rows]).sum(-1))
        per_token = torch.where(scored, per_token, torch.zeros_like(per_token))
        loss = per_token.sum() / count
    by_kind = {}
    if parts:  # one host read for all kinds
        with torch.no_grad():
            on_device = kinds.to(tokens.device, non_blocking=True)
            rows = on_device[None, :] == torch.arange(len(KIND_NAMES), device=tokens.device)[:, None]
            weight = rows[:, :, None] & scored  # (kinds, B, L)
            sums = torch.stack([(weight * per_token).sum((1, 2)), weight.sum((1, 2)).float()]).tolist()
        by_kind = {name: num / den for name, num, den in zip(KIND_NAMES, *sums, strict=True) if den > 0}
    return LossOutput(loss=loss, per_token=per_token, parts=by_kind)
