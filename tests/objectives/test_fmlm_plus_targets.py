"""FMLM+ inside the module (methods.md §3–4, issue 14): the semigroup, boundary and MDM-distill targets of the
objective (flowlm/objectives/fmlm_plus.py) with the module's teachers, and the module's ``loss``, against dense hand
computations with the same network, the context rate f ~ U(0, 1), the interpolant, the soft-cap as the module
applies it, ``teacher_train_mode`` and ``zero_t_embedding``.

Every reference here recomputes the module's quantities from its own network with dense per-token times (the
module uses the cheaper pinned form), in float64 wherever the combination is hand-written, so these tests do not
depend on the network's initialisation or on DiT internals.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F

from flowlm.objectives.fmlm_plus import BOUNDARY, DIAGONAL, DISTILL, OFF_DIAGONAL, targets
from lightning_modules.fmlm_plus import FMLMPlusModule
from lightning_modules.mdm import MDMModule

V, L = 3, 8
BACKBONE = {"d_model": 16, "n_layers": 1, "n_heads": 2, "cond_dim": 16}
CAP = 30.0  # methods.md §1: FMLM/FMLM+ apply 30·tanh(logits/30) before log_softmax
TOL = {"rtol": 1e-5, "atol": 2e-6}  # float32 module vs float64 hand combination of the same float32 network calls


def _randomise(module: torch.nn.Module, std: float = 0.3) -> None:
    """Every weight N(0, std²): the zero-initialised final layer and adaLN modulations too, so the output depends
    on the input and on both times (emb_s and emb_t become two different random functions)."""
    with torch.no_grad():
        for p in module.parameters():
            torch.nn.init.normal_(p, std=std)


def _flow(seed: int = 0, **kwargs) -> FMLMPlusModule:
    torch.manual_seed(seed)
    module = FMLMPlusModule(data_vocab_size=V, seq_len=L, backbone=kwargs.pop("backbone", BACKBONE), optim={}, **kwargs)
    _randomise(module)
    return module.eval()


def _delta(module: FMLMPlusModule, x: torch.Tensor, s_tok: torch.Tensor, t_tok: torch.Tensor) -> torch.Tensor:
    """δ_{s,t}(x) by hand in float64: soft-capped softmax of the raw network at dense per-token times (B, L)."""
    with torch.no_grad():
        logits = module.net(x.float(), s_tok.float(), t_tok.float()).double()
    return torch.softmax(CAP * torch.tanh(logits / CAP), dim=-1)


def _targets(module: FMLMPlusModule, batch, kinds, x_s, times, token_times, onehot, active) -> torch.Tensor:
    """The objective's per-token targets with the module's teachers, as the module's ``loss`` wires them."""
    return targets(
        kinds,
        x_s,
        times,
        token_times,
        onehot,
        active,
        process=module.view.process,
        tokens=batch["tokens"],
        prompt=batch["prompt_mask"],
        **module.teachers(),
    )


def _hand_jump_target(module, x_s, s, t, active, onehot, *, d1_times=None, d2_times=None):
    """The semigroup target of methods.md §3, dense and in float64, for per-sequence times s, t (B,):
    u = (s+t)/2 on active tokens (pinned at 1 elsewhere), D1 = δ_{s,u}(x_s), X_u = X_{s,u}(x_s) (pinned tokens keep
    their one-hot), D2 = δ_{u,t}(X_u), γ = (1−t)(u−s)/((1−u)(t−s)) on active tokens (0 elsewhere),
    target = γ·D1 + (1−γ)·D2. ``d1_times`` / ``d2_times`` ("s", "u", "t" names) build deliberately wrong variants."""
    s, t = s.double()[:, None], t.double()[:, None]
    u = (s + t) / 2
    pin = lambda time: torch.where(active, time, torch.ones_like(time))  # noqa: E731
    times = {"s": pin(s.expand_as(active)), "u": pin(u.expand_as(active)), "t": pin(t.expand_as(active))}
    a1, b1 = d1_times or ("s", "u")
    a2, b2 = d2_times or ("u", "t")
    d1 = _delta(module, x_s, times[a1], times[b1])
    su, uu = times["s"][..., None], times["u"][..., None]
    x64 = x_s.double()
    flowed = ((1 - uu) / (1 - su).clamp_min(1e-300)) * x64 + ((uu - su) / (1 - su).clamp_min(1e-300)) * d1
    x_u = torch.where(active[..., None], flowed, onehot.double())
    d2 = _delta(module, x_u, times[a2], times[b2])
    st, ss, ut = times["t"], times["s"], times["u"]
    gamma = torch.where(active, (1 - st) * (ut - ss) / ((1 - ut) * (st - ss)).clamp_min(1e-300), 0.0)[..., None]
    return gamma * d1 + (1 - gamma) * d2, x_u


def _inputs(b: int, seed: int, *, prompt_len: int = 2, ctx_rate: float = 0.3, s=None):
    """Tokens, prompt, a context set, the active set and x_s = (1−s)ε + s·onehot on active tokens (one-hot
    elsewhere), with every row keeping at least one active and one pinned non-prompt token."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (b, L), generator=gen)
    prompt = torch.zeros(b, L, dtype=torch.bool)
    prompt[:, :prompt_len] = True
    ctx = (torch.rand(b, L, generator=gen) < ctx_rate) & ~prompt
    ctx[:, prompt_len] = True  # one context token per row
    ctx[:, prompt_len + 1] = False  # one active token per row
    active = ~prompt & ~ctx
    onehot = F.one_hot(tokens, V).float()
    noise = torch.randn(b, L, V, generator=gen)
    x_s = onehot
    if s is not None:
        s_tok = torch.where(active, s[:, None], 1.0)[..., None]
        x_s = torch.where(active[..., None], (1 - s_tok) * noise + s_tok * onehot, onehot)
    return tokens, prompt, active, onehot, x_s


# ------------------------------------------------------------------------------------ semigroup / boundary targets
KINDS = torch.tensor([OFF_DIAGONAL, BOUNDARY, DIAGONAL, OFF_DIAGONAL, OFF_DIAGONAL, BOUNDARY])
S = torch.tensor([0.2, 0.0, 0.35, 0.05, 0.3, 0.0])
T = torch.tensor([0.6, 1.0, 0.35, 0.35, 1.0, 1.0])


def test_targets_match_the_dense_semigroup_and_boundary_computation():
    """Off-diagonal and boundary rows get γ·δ_{s,u}(x_s) + (1−γ)·δ_{u,t}(X_{s,u}(x_s)) with u = (s+t)/2 on active
    tokens only; diagonal rows their one-hot. A swap of s and u (in D1) or of u and t (in D2), another midpoint, a
    reversed flow map or a wrong γ all move the target far beyond the tolerance (checked below)."""
    module = _flow()
    tokens, prompt, active, onehot, x_s = _inputs(len(KINDS), seed=1, s=S)
    s_tok, t_tok = torch.where(active, S[:, None], 1.0), torch.where(active, T[:, None], 1.0)
    batch = {"tokens": tokens, "prompt_mask": prompt}
    target = _targets(module, batch, KINDS, x_s, (S, T), (s_tok, t_tok), onehot, active)

    hand, _ = _hand_jump_target(module, x_s, S, T, active, onehot)
    jump = KINDS != DIAGONAL
    assert torch.isfinite(target).all()
    torch.testing.assert_close(target[jump].double(), hand[jump], **TOL)
    assert torch.equal(target[~jump], onehot[~jump])  # the diagonal target is the one-hot data
    torch.testing.assert_close(target.sum(-1), torch.ones(len(KINDS), L))  # on the simplex
    # boundary (s = 0, t = 1) and off-diagonal rows with t = 1: γ = 0, the target is D2 = δ_{u,1}(X_u) alone
    d2_only = (T == 1) & jump
    assert d2_only.sum() == 3
    # power of the test: every plausible wiring slip changes the target by far more than the tolerance
    wrong = {
        "D1 at (u, s)": _hand_jump_target(module, x_s, S, T, active, onehot, d1_times=("u", "s"))[0],
        "D2 at (t, u)": _hand_jump_target(module, x_s, S, T, active, onehot, d2_times=("t", "u"))[0],
        "D1 at (s, t)": _hand_jump_target(module, x_s, S, T, active, onehot, d1_times=("s", "t"))[0],
        "D2 at (s, t)": _hand_jump_target(module, x_s, S, T, active, onehot, d2_times=("s", "t"))[0],
    }
    for name, other in wrong.items():
        gap = (other[jump] - hand[jump]).abs().max().item()
        assert gap > 1e-3, f"the test cannot tell the right target from {name} (gap {gap:.2e})"


def test_teacher_passes_see_the_flow_map_with_pinned_tokens_kept_one_hot():
    """D2's input is X_{s,u}(x_s) = ((1−u)/(1−s))·x + ((u−s)/(1−s))·D1 on active tokens and the exact one-hot on
    pinned (prompt, context) tokens; D1's input is x_s itself. Observed by wrapping the module's forward."""
    module = _flow()
    tokens, prompt, active, onehot, x_s = _inputs(len(KINDS), seed=2, s=S)
    s_tok, t_tok = torch.where(active, S[:, None], 1.0), torch.where(active, T[:, None], 1.0)
    seen, forward = [], module.forward

    def spy(x, s, t, pinned=None):
        seen.append(x.clone())
        return forward(x, s, t, pinned=pinned)

    module.forward = spy
    batch = {"tokens": tokens, "prompt_mask": prompt}
    _targets(module, batch, KINDS, x_s, (S, T), (s_tok, t_tok), onehot, active)
    jump = KINDS != DIAGONAL
    x1, x2 = seen
    assert torch.equal(x1, x_s[jump])
    _, x_u = _hand_jump_target(module, x_s, S, T, active, onehot)
    pinned = ~active[jump]
    assert torch.equal(x2[pinned], onehot[jump][pinned])  # pinned tokens stay exactly their one-hot
    torch.testing.assert_close(x2.double(), x_u[jump], **TOL)


def test_flow_loss_is_the_soft_ce_of_the_hand_target_on_active_tokens():
    """The module's loss end to end: the student pass is δ_{s,t}(x_s) at the sequence's (s, t) with prompt and context
    pinned, and the loss is Σ_active −Σ_v target·log δ_{s,t}(x_s) / #active with the hand target of each kind."""
    module = _flow()
    b = len(KINDS)
    tokens, prompt, _, _, _ = _inputs(b, seed=3)
    calls, forward = [], module.forward

    def spy(x, s, t, pinned=None):
        calls.append((x.clone(), s.clone(), t.clone(), None if pinned is None else pinned.clone()))
        return forward(x, s, t, pinned=pinned)

    module.forward = spy
    batch = {"tokens": tokens, "prompt_mask": prompt}
    loss = module.loss(batch, module.draws_at(batch, KINDS, S, T, torch.Generator().manual_seed(4))).loss
    x_s, s_seen, t_seen, pinned = calls[0]
    assert len(calls) == 3  # the student pass, then D1 and D2 for the jump rows
    assert torch.equal(s_seen, S) and torch.equal(t_seen, T)  # the student sees (s, t), not (s, u) or (u, t)
    assert pinned[prompt].all()
    active = ~pinned
    assert active.any(-1).all() and pinned[~prompt].any()  # some context drawn, some tokens active
    onehot = F.one_hot(tokens, V).double()
    assert torch.equal(x_s[pinned], onehot.float()[pinned])
    s_tok, t_tok = torch.where(active, S[:, None], 1.0), torch.where(active, T[:, None], 1.0)
    hand, _ = _hand_jump_target(module, x_s, S, T, active, onehot)
    target = torch.where((KINDS != DIAGONAL)[:, None, None], hand, onehot)
    log_d = _delta(module, x_s, s_tok, t_tok).log()
    reference = -(target * log_d).sum(-1)[active].sum() / active.sum()
    torch.testing.assert_close(loss.double(), reference, rtol=1e-5, atol=0)
    # the diagonal-only CE of the same draw differs: the jump targets are not one-hot
    diag_only = -(onehot * log_d).sum(-1)[active].sum() / active.sum()
    assert abs(diag_only.item() - reference.item()) > 1e-3


# -------------------------------------------------------------------------------------------- MDM-distill target
def _teacher(seed: int = 5) -> MDMModule:
    torch.manual_seed(seed)
    teacher = MDMModule(data_vocab_size=V, seq_len=L, backbone=BACKBONE, optim={}, time_conditioning=True)
    _randomise(teacher, std=0.5)
    return teacher.eval().requires_grad_(False)


@pytest.mark.parametrize("teacher_time", ["zero", "rate"])
def test_distill_target_is_the_mdm_teacher_softmax_with_mask_at_active_positions(teacher_time):
    """Distill rows: the teacher sees [MASK] at the active positions and the data elsewhere, at time 0 (the released
    ``_teacher_log_q``, the default) or, with ``mdm_teacher_time="rate"``, at the share of masked non-prompt tokens;
    target = softmax of its logits with the [MASK] logit removed. The teacher is time-conditioned here so the time it
    is given shows in its output."""
    module = _flow(shares={"distill": 0.25}, teacher="unused.ckpt", mdm_teacher_time=teacher_time)
    teacher = _teacher()
    object.__setattr__(module, "_teacher", teacher)  # as on_fit_start does: not a submodule
    kinds = torch.tensor([DISTILL, DIAGONAL, DISTILL, DISTILL])
    b = len(kinds)
    zeros = torch.zeros(b)
    tokens, prompt, active, onehot, x_s = _inputs(b, seed=6, s=zeros)
    prompt[3, :4] = True  # another prompt length: the rate's denominator is the row's own non-prompt count
    active = active & ~prompt
    s_tok = torch.where(active, 0.0, 1.0)
    batch = {"tokens": tokens, "prompt_mask": prompt}
    target = _targets(module, batch, kinds, x_s, (zeros, zeros), (s_tok, s_tok.clone()), onehot, active)

    masked_in = torch.where(active, teacher.mask_id, tokens)
    rate = (active.double().sum(-1) / (~prompt).double().sum(-1)).float()
    time = {"zero": zeros, "rate": rate}[teacher_time]
    with torch.no_grad():
        logits = teacher.net(masked_in, time).double()
    assert logits.shape[-1] == V + 1
    hand = torch.softmax(logits[..., :V], dim=-1)  # [MASK] logit removed before the softmax
    rows = kinds == DISTILL
    torch.testing.assert_close(target[rows].double(), hand[rows], **TOL)
    assert torch.equal(target[~rows], onehot[~rows])
    # power: the softmax over V + 1 then sliced, the teacher at the other option's time or at 1 − rate, or the
    # context masked instead of the active tokens are all far off
    with torch.no_grad():
        wrong = {
            "softmax with [MASK]": torch.softmax(logits, -1)[..., :V],
            "the other time": torch.softmax(
                teacher.net(masked_in, rate if teacher_time == "zero" else zeros)[..., :V].double(), -1
            ),
            "time 1 − rate": torch.softmax(teacher.net(masked_in, 1 - rate)[..., :V].double(), -1),
            "masks inverted": torch.softmax(
                teacher.net(torch.where(~active & ~prompt, teacher.mask_id, tokens), time)[..., :V].double(), -1
            ),
        }
    for name, other in wrong.items():
        gap = (other[rows] - hand[rows]).abs().max().item()
        assert gap > 1e-3, f"the test cannot tell the distill target from {name} (gap {gap:.2e})"


def test_an_unknown_mdm_teacher_time_is_refused_before_compute():
    with pytest.raises(ValueError, match="mdm_teacher_time must be one of"):
        _flow(mdm_teacher_time="one")


# ------------------------------------------------------------------------------- context set and the interpolant
def _stub_forward(module: FMLMPlusModule, seen: list):
    """Replace the network pass by a uniform output that records its inputs: the draws cost nothing."""

    def stub(x, s, t, pinned=None):
        seen.append((x.clone(), s.clone(), t.clone(), pinned.clone()))
        return torch.zeros(x.shape).log_softmax(-1)

    module.forward = stub


def test_context_rate_is_uniform_per_sequence_and_spares_the_prompt():
    """f ~ U(0, 1) per sequence and each non-prompt token is context with probability f: the number K of context
    tokens among n non-prompt tokens is then Beta-Binomial(n, 1, 1), i.e. exactly uniform on {0, …, n}; the share
    K/n has mean 1/2 and variance 1/12 + 1/(6n). Fixed seed; tolerances ≈ 4 standard errors, chi-square at
    p ≈ 1e-4 (a fixed f = 1/2, f², or a per-batch f fail all three by orders of magnitude)."""
    b, n_prompt = 4000, 2
    n = L - n_prompt
    module = FMLMPlusModule(data_vocab_size=V, seq_len=L, backbone=BACKBONE, optim={})
    seen = []
    _stub_forward(module, seen)
    tokens = torch.randint(0, V, (b, L), generator=torch.Generator().manual_seed(7))
    prompt = torch.zeros(b, L, dtype=torch.bool)
    prompt[:, :n_prompt] = True
    s = torch.full((b,), 0.5)
    batch = {"tokens": tokens, "prompt_mask": prompt}
    module.loss(batch, module.draws_at(batch, torch.full((b,), DIAGONAL), s, s, torch.Generator().manual_seed(8)))
    ((_, _, _, pinned),) = seen
    assert pinned[prompt].all()  # the prompt is always pinned (never active, never noised)
    k = (pinned & ~prompt).sum(-1)  # context tokens per sequence
    share = k.double() / n
    assert abs(share.mean().item() - 0.5) < 0.02  # SE = √((1/12 + 1/(6n))/B) ≈ 0.0048
    assert abs(share.var().item() - (1 / 12 + 1 / (6 * n))) < 0.006  # SE ≈ 0.0013
    counts = torch.bincount(k, minlength=n + 1).double()
    expected = b / (n + 1)
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 27.9, f"context counts {counts.tolist()} are not uniform on 0..{n} (chi2 = {chi2:.1f}, 6 dof)"

    # FMLM (context=False): only the prompt is pinned
    fmlm = FMLMPlusModule(data_vocab_size=V, seq_len=L, backbone=BACKBONE, optim={}, context=False)
    seen_fmlm = []
    _stub_forward(fmlm, seen_fmlm)
    batch = {"tokens": tokens[:64], "prompt_mask": prompt[:64]}
    fmlm.loss(batch, fmlm.draws_at(batch, torch.full((64,), DIAGONAL), s[:64], s[:64], None))
    assert torch.equal(seen_fmlm[0][3], prompt[:64])


def test_flow_loss_noises_active_tokens_by_the_interpolant():
    """x_s = (1−s)·ε + s·onehot(y) on active tokens with ε ~ N(0, I) (t = 0 noise, t = 1 data), the exact one-hot
    elsewhere: the recovered ε = (x_s − s·onehot)/(1−s) has mean 0 and variance 1 in every coordinate, for rows at
    several s (a reversed interpolant or unscaled noise fails by far). ≈ 12 000 values per s; tolerances ≈ 5 SE."""
    b = 1500
    module = FMLMPlusModule(data_vocab_size=V, seq_len=L, backbone=BACKBONE, optim={})
    seen = []
    _stub_forward(module, seen)
    tokens = torch.randint(0, V, (b, L), generator=torch.Generator().manual_seed(9))
    prompt = torch.zeros(b, L, dtype=torch.bool)
    prompt[:, 0] = True
    s = torch.tensor([0.0, 0.25, 0.7]).repeat(b // 3)
    batch = {"tokens": tokens, "prompt_mask": prompt}
    module.loss(batch, module.draws_at(batch, torch.full((b,), DIAGONAL), s, s, torch.Generator().manual_seed(10)))
    ((x_s, _, _, pinned),) = seen
    onehot = F.one_hot(tokens, V).float()
    assert torch.equal(x_s[pinned], onehot[pinned])
    for value in s.unique().tolist():
        rows = (s == value)[:, None] & ~pinned
        eps = (x_s[rows].double() - value * onehot[rows].double()) / (1 - value)
        assert eps.abs().max() < 7
        assert eps.mean(0).abs().max() < 0.05, (value, eps.mean(0))
        assert (eps.var(0) - 1).abs().max() < 0.07, (value, eps.var(0))


# ------------------------------------------------------------------------------------------------- soft-cap
def test_module_forward_applies_the_soft_cap_to_the_raw_logits():
    """log δ = log_softmax(30·tanh(logits/30)) of the raw network output, at logits in the hundreds where the cap
    decides the result: |logits| ≈ 20–50, where tanh is far from linear (an uncapped softmax or another cap differ
    by more than 1 nat)."""
    module = _flow()
    with torch.no_grad():
        module.net.final.linear.weight.mul_(30.0)
    tokens, prompt, active, onehot, x_s = _inputs(4, seed=11, s=torch.tensor([0.0, 0.3, 0.6, 0.9]))
    s = torch.tensor([0.0, 0.3, 0.6, 0.9])
    t = torch.tensor([0.5, 0.3, 1.0, 0.95])
    s_tok, t_tok = torch.where(active, s[:, None], 1.0), torch.where(active, t[:, None], 1.0)
    with torch.no_grad():
        raw = module.net(x_s, s_tok, t_tok).double()
        ours_dense = module(x_s, s_tok, t_tok)
        ours_pinned = module(x_s, s, t, pinned=~active)
    spread = raw.max(-1).values - raw.min(-1).values
    assert spread.median() > 50  # the cap matters
    hand = F.log_softmax(CAP * torch.tanh(raw / CAP), dim=-1)
    assert ours_dense.dtype == torch.float32
    torch.testing.assert_close(ours_dense.double(), hand, rtol=0, atol=1e-4)
    torch.testing.assert_close(ours_pinned.double(), hand, rtol=1e-4, atol=1e-3)
    # capped logits span at most 2·cap, so no log-probability lies below −2·cap − log|V|; uncapped ones do
    assert ours_dense.min() >= -2 * CAP - math.log(V) - 1e-4 and F.log_softmax(raw, -1).min() < -2 * CAP - math.log(V)
    for other in (F.log_softmax(raw, -1), F.log_softmax(50 * torch.tanh(raw / 50), -1)):
        assert (other - hand).abs().max() > 1.0


# --------------------------------------------------------------------------------------------- teacher modes
@pytest.mark.parametrize("teacher_train_mode", [True, False])
@pytest.mark.parametrize("start_training", [True, False])
def test_teacher_passes_run_in_the_chosen_mode_and_restore_it(teacher_train_mode, start_training):
    """With ``teacher_train_mode`` the two no-grad teacher passes of the semigroup target run in train mode
    (dropout on: two calls with the same inputs differ), else in eval mode (identical); either way the module's
    own mode is restored afterwards."""
    module = _flow(backbone={**BACKBONE, "dropout": 0.5}, teacher_train_mode=teacher_train_mode)
    module.train(start_training)
    kinds = torch.tensor([OFF_DIAGONAL, BOUNDARY])
    s, t = torch.tensor([0.1, 0.0]), torch.tensor([0.7, 1.0])
    tokens, prompt, active, onehot, x_s = _inputs(2, seed=12, s=s)
    s_tok, t_tok = torch.where(active, s[:, None], 1.0), torch.where(active, t[:, None], 1.0)
    modes, forward = [], module.forward

    def spy(x, a, b, pinned=None):
        modes.append((module.training, module.net.training, all(m.training for m in module.net.modules())))
        return forward(x, a, b, pinned=pinned)

    module.forward = spy
    batch = {"tokens": tokens, "prompt_mask": prompt}
    args = (module, batch, kinds, x_s, (s, t), (s_tok, t_tok), onehot, active)
    torch.manual_seed(13)
    first = _targets(*args)
    torch.manual_seed(14)
    second = _targets(*args)
    assert modes == [(teacher_train_mode,) * 3] * 4  # D1 and D2, twice
    assert module.training is start_training and all(m.training is start_training for m in module.modules())
    if teacher_train_mode:
        assert (first - second).abs().max() > 1e-3  # dropout active in the teacher passes
    else:
        assert torch.equal(first, second)


def test_teacher_mode_and_t_embedding_defaults_agree_between_module_and_config():
    """The configs that build FMLM+ (fmlm_plus, and fmlm_plus_init inheriting it) state the same defaults as the
    module's signature, so a run and a module built in code behave alike, and those defaults are the released
    code's: train-mode teachers, emb_t left random (zero_t_embedding=False), antithetic draws; the student's loss
    fused by shape (fused_loss=auto: the released loss to float rounding)."""
    from tests.conftest import compose_config

    signature = inspect.signature(FMLMPlusModule.__init__).parameters
    for name in ("fmlm_plus", "fmlm_plus_init", "fmlm_plus_distill"):  # as train.yaml composes them (their family)
        cfg = compose_config(overrides=[f"method={name}"]).method
        for key in ("zero_t_embedding", "teacher_train_mode", "antithetic", "fused_loss"):
            assert cfg[key] == signature[key].default, (name, key, cfg[key], signature[key].default)
    assert signature["teacher_train_mode"].default is True  # methods.md §9: the released FMLM+ behaviour
    assert signature["zero_t_embedding"].default is False and signature["antithetic"].default is True
    assert signature["fused_loss"].default == "auto"


# ------------------------------------------------------------------------------------------ zero_t_embedding
@pytest.mark.parametrize("zero_t_embedding", [True, False])
def test_mdm_initialisation_zeroes_the_fresh_t_embedding_only_when_asked(zero_t_embedding):
    """With ``zero_t_embedding`` the fresh emb_t outputs exactly 0 at every time after initialisation from an MDM
    (so the conditioning is the MDM's); without it emb_t keeps its fresh random initialisation, unchanged."""
    torch.manual_seed(15)
    mdm = MDMModule(data_vocab_size=V, seq_len=L, backbone=BACKBONE, optim={})
    _randomise(mdm)
    torch.manual_seed(16)
    flow = FMLMPlusModule(data_vocab_size=V, seq_len=L, backbone=BACKBONE, optim={}, zero_t_embedding=zero_t_embedding)
    before = {k: v.clone() for k, v in flow.net.emb_t.state_dict().items()}
    times = torch.linspace(0, 1, 11)
    out_before = flow.net.emb_t(times)
    assert out_before.abs().max() > 0
    report = flow.initialise_from(mdm.state_dict())
    assert any(name.startswith("emb_t.") for name in report["fresh"])
    out = flow.net.emb_t(times)
    if zero_t_embedding:
        assert torch.count_nonzero(out) == 0
        # and with emb_t ≡ 0 the FMLM+ conditioning is the MDM's: c = SiLU(emb_s(s))
        s = torch.rand(2, L)
        cond = flow.net.condition(s, torch.rand(2, L), 2, L)
        torch.testing.assert_close(cond, F.silu(mdm.net.emb_s(s)))
    else:
        after = flow.net.emb_t.state_dict()
        assert all(torch.equal(after[k], before[k]) for k in before)
        torch.testing.assert_close(out, out_before)
    # the copied emb_s is the MDM's either way
    for k, v in flow.net.emb_s.state_dict().items():
        assert torch.equal(v, mdm.net.emb_s.state_dict()[k])
    assert math.isfinite(out.sum().item())
