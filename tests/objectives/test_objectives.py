"""The FMLM+ objective (flowlm/objectives/fmlm_plus.py) by hand on a 3-token vocabulary (methods.md §3–4).

A deterministic per-token "network" with a closed form stands in for the student and the teacher:

    δ_{s,t}(x) = w / Σ_v w_v,   w = 1 + x + t·e₀ + s·e₂          (pinned tokens read s = t = 1)

so every quantity of the loss is a fraction that is written out below: the noisy state, D1, the flow map X_u, D2,
γ, the targets and the soft cross-entropy. s and t enter w at different coordinates, so a swap of two times shows.
The MDM teacher has logits log q with q = 1 + rate·e₀ + 2·[input = MASK]·e₁.

One batch of four rows, one per pair kind; position 0 is the prompt in every row:

    row  kind          (s, t)      tokens     context   active   ε at the active positions
    A    diagonal      (1/4, 1/4)  (2, 0, 1)  pos 1     pos 2    (1, 0, −1)
    B    boundary      (0, 1)      (1, 2, 0)  pos 1     pos 2    (0, 1, 0)
    C    off-diagonal  (1/5, 3/5)  (0, 1, 2)  pos 1     pos 2    (1/2, 0, 0)
    D    distill       (0, 0)      (1, 0, 2)  —         pos 1, 2 (1, 0, 0), (0, 0, 1)

The noise at pinned positions is large on purpose: it must never reach the network.
"""

from __future__ import annotations

import math

import pytest
import torch

from flowlm.objectives.base import LossOutput
from flowlm.objectives.fmlm_plus import BOUNDARY, DIAGONAL, DISTILL, OFF_DIAGONAL, context_set, fmlm_plus_loss
from flowlm.processes.gaussian_flow import GaussianFlowProcess

V, MASK = 3, 3
FLOW = GaussianFlowProcess(vocab_size=V)
LOG = math.log
KINDS = torch.tensor([DIAGONAL, BOUNDARY, OFF_DIAGONAL, DISTILL])
S = torch.tensor([1 / 4, 0.0, 1 / 5, 0.0])
T = torch.tensor([1 / 4, 1.0, 3 / 5, 0.0])
TOKENS = torch.tensor([[2, 0, 1], [1, 2, 0], [0, 1, 2], [1, 0, 2]])
PROMPT = torch.tensor([[True, False, False]] * 4)
CONTEXT = torch.tensor([[False, True, False]] * 3 + [[False, False, False]])


def _noise() -> torch.Tensor:
    noise = torch.full((4, 3, V), 50.0)  # pinned positions: never seen
    noise[0, 2] = torch.tensor([1.0, 0.0, -1.0])
    noise[1, 2] = torch.tensor([0.0, 1.0, 0.0])
    noise[2, 2] = torch.tensor([0.5, 0.0, 0.0])
    noise[3, 1] = torch.tensor([1.0, 0.0, 0.0])
    noise[3, 2] = torch.tensor([0.0, 0.0, 1.0])
    return noise


class Net:
    """δ_{s,t}(x) = w / Σw, w = 1 + x + t·e₀ + s·e₂, per token; records every call's inputs."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, ...]] = []

    def __call__(self, x, s, t, pinned):
        self.calls.append((x.clone(), s.clone(), t.clone(), pinned.clone()))
        s_tok = torch.where(pinned, 1.0, s[:, None])[..., None]
        t_tok = torch.where(pinned, 1.0, t[:, None])[..., None]
        w = 1 + x + t_tok * torch.tensor([1.0, 0.0, 0.0]) + s_tok * torch.tensor([0.0, 0.0, 1.0])
        return (w / w.sum(-1, keepdim=True)).log()


def mdm_teacher(ids, rate):
    """logits = log q, q = 1 + rate·e₀ + 2·[ids = MASK]·e₁ (softmax(log q) = q / Σq)."""
    q = torch.ones(*ids.shape, V)
    q[..., 0] += rate[:, None]
    q[..., 1] += 2.0 * (ids == MASK)
    return q.log()


def ce(target, delta) -> float:
    """−Σ_v target_v · log δ_v of two explicit distributions."""
    return -sum(p * LOG(d) for p, d in zip(target, delta, strict=True) if p)


# ------------------------------------------------------------------------------------------ the hand computation
# A (diagonal, s = t = 1/4, y = 1): x_s = (3/4)·ε + (1/4)·e₁ = (3/4, 1/4, −3/4);
#   w = 1 + x + (1/4)·e₀ + (1/4)·e₂ = (2, 5/4, 1/2), Σ = 15/4, δ = (8/15, 1/3, 2/15); target e₁: −log(1/3).
LOSS_A = ce((0, 1, 0), (8 / 15, 1 / 3, 2 / 15))  # = log 3
# B (boundary, s = 0, t = 1, u = 1/2): x_0 = ε = (0, 1, 0).
#   D1 = δ_{0,1/2}(x): w = (1 + 1/2, 2, 1) = (3/2, 2, 1), Σ = 9/2, D1 = (1/3, 4/9, 2/9).
#   X_u = ((1 − u)/(1 − s))·x + ((u − s)/(1 − s))·D1 = x/2 + D1/2 = (1/6, 13/18, 1/9).
#   D2 = δ_{1/2,1}(X_u): w = (1 + 1/6 + 1, 1 + 13/18, 1 + 1/9 + 1/2) = (39, 31, 29)/18, D2 = (39, 31, 29)/99.
#   γ = (1 − t)(u − s)/((1 − u)(t − s)) = 0: target = D2.
#   student δ_{0,1}(x): w = (2, 2, 1), δ = (2/5, 2/5, 1/5).
LOSS_B = ce((39 / 99, 31 / 99, 29 / 99), (2 / 5, 2 / 5, 1 / 5))
# C (off-diagonal, s = 1/5, t = 3/5, u = 2/5, y = 2): x_s = (4/5)·ε + (1/5)·e₂ = (2/5, 0, 1/5).
#   D1 = δ_{1/5,2/5}(x_s): w = (1 + 2/5 + 2/5, 1, 1 + 1/5 + 1/5) = (9, 5, 7)/5, D1 = (9, 5, 7)/21.
#   X_u = (3/4)·x_s + (1/4)·D1 = (3/10 + 9/84, 5/84, 3/20 + 7/84) = (171, 25, 98)/420.
#   D2 = δ_{2/5,3/5}(X_u): w = (420 + 171 + 252, 420 + 25, 420 + 98 + 168)/420 = (843, 445, 686)/420,
#        D2 = (843, 445, 686)/1974.
#   γ = (2/5)(1/5) / ((3/5)(2/5)) = 1/3; target = D1/3 + 2·D2/3 = ((846, 470, 658) + 2·(843, 445, 686))/5922
#        = (2532, 1360, 2030)/5922.
#   student δ_{1/5,3/5}(x_s): w = (1 + 2/5 + 3/5, 1, 1 + 1/5 + 1/5) = (2, 1, 7/5), δ = (10, 5, 7)/22.
LOSS_C = ce((2532 / 5922, 1360 / 5922, 2030 / 5922), (10 / 22, 5 / 22, 7 / 22))
# D (distill, s = t = 0): both non-prompt tokens active, so the teacher reads (1, MASK, MASK) at its masking rate
#   2/2 = 1 (mdm_teacher_time="rate"; the default feeds time 0, LOSS_D*_ZERO below):
#   q = (1 + 1, 1 + 2, 1) = (2, 3, 1), target = (1/3, 1/2, 1/6) at both.
#   student δ_{0,0}(ε): pos 1 w = (2, 1, 1), δ = (1/2, 1/4, 1/4); pos 2 w = (1, 1, 2), δ = (1/4, 1/4, 1/2).
LOSS_D1 = ce((1 / 3, 1 / 2, 1 / 6), (1 / 2, 1 / 4, 1 / 4))  # = (5/3)·log 2
LOSS_D2 = ce((1 / 3, 1 / 2, 1 / 6), (1 / 4, 1 / 4, 1 / 2))  # = (11/6)·log 2
# D at time 0 (the released code's teacher time, the default): q = (1, 3, 1), target = (1/5, 3/5, 1/5) at both.
LOSS_D1_ZERO = ce((1 / 5, 3 / 5, 1 / 5), (1 / 2, 1 / 4, 1 / 4))
LOSS_D2_ZERO = ce((1 / 5, 3 / 5, 1 / 5), (1 / 4, 1 / 4, 1 / 2))


def _loss(**kwargs) -> tuple[LossOutput, Net]:
    net = Net()
    out = fmlm_plus_loss(
        net, TOKENS, PROMPT, KINDS, S, T, context=CONTEXT, noise=_noise(), process=FLOW, mdm_teacher=mdm_teacher,
        mask_id=MASK,
        **{"mdm_teacher_time": "rate", **kwargs},  # the hand computation's rate 1 shows in the teacher's output
    )  # fmt: skip
    return out, net


def test_the_hand_arithmetic_of_the_closed_forms():
    """The comments' fractions, checked once in exact terms (a slip in the hand computation is caught here)."""
    assert LOSS_A == pytest.approx(LOG(3))
    assert LOSS_D1 == pytest.approx(5 / 3 * LOG(2)) and LOSS_D2 == pytest.approx(11 / 6 * LOG(2))
    assert 39 + 31 + 29 == 99 and 843 + 445 + 686 == 1974 == 21 * 94 and 2532 + 1360 + 2030 == 5922
    assert (171 + 25 + 98) / 420 == pytest.approx(3 / 4 * (2 / 5 + 1 / 5) + 1 / 4)  # Σ X_u = (3/4)·Σx + (1/4)·1


def test_fmlm_plus_loss_by_hand_on_every_pair_kind():
    """Each active token's term, the mean over the five active tokens, and each kind's mean."""
    out, _ = _loss(parts=True)
    per_token = out.per_token.double()
    expected = torch.zeros(4, 3, dtype=torch.float64)
    expected[0, 2], expected[1, 2], expected[2, 2] = LOSS_A, LOSS_B, LOSS_C
    expected[3, 1], expected[3, 2] = LOSS_D1, LOSS_D2
    torch.testing.assert_close(per_token, expected, rtol=1e-6, atol=1e-7)  # zero on the prompt and the context
    total = (LOSS_A + LOSS_B + LOSS_C + LOSS_D1 + LOSS_D2) / 5
    assert out.loss.item() == pytest.approx(total, rel=1e-6)
    assert out.parts == pytest.approx(
        {"diagonal": LOSS_A, "boundary": LOSS_B, "off_diagonal": LOSS_C, "distill": (LOSS_D1 + LOSS_D2) / 2},
        rel=1e-6,
    )


def test_the_distill_teacher_reads_time_zero_by_default():
    """The released ``_teacher_log_q`` feeds the MDM teacher t = 0, whatever the row's masking rate."""
    out = fmlm_plus_loss(
        Net(), TOKENS, PROMPT, KINDS, S, T, context=CONTEXT, noise=_noise(), process=FLOW, mdm_teacher=mdm_teacher,
        mask_id=MASK,
    )  # fmt: skip
    torch.testing.assert_close(out.per_token[3, 1:].double(), torch.tensor([LOSS_D1_ZERO, LOSS_D2_ZERO],
                               dtype=torch.float64), rtol=1e-6, atol=1e-7)  # fmt: skip


def test_the_loss_mask_leaves_tokens_out_of_the_mean():
    """A scored subset: row D's last token left out, the mean is over the four others."""
    loss_mask = torch.ones(4, 3, dtype=torch.bool)
    loss_mask[3, 2] = False
    out, _ = _loss(loss_mask=loss_mask)
    assert out.loss.item() == pytest.approx((LOSS_A + LOSS_B + LOSS_C + LOSS_D1) / 4, rel=1e-6)
    assert out.per_token[3, 2] == 0 and out.parts == {}


def test_prompt_and_context_are_pinned_one_hot_in_every_pass():
    """The student pass and both teacher passes see the prompt and context tokens as their exact one-hot, flagged
    pinned, at the per-sequence times (s, t), (s, u), (u, t) of the jump rows B and C."""
    _, net = _loss()
    (x_s, s, t, pinned), (x1, s1, u1, p1), (x2, u2, t2, p2) = net.calls  # the student, D1, D2
    onehot = torch.eye(V)[TOKENS]
    assert torch.equal(pinned, PROMPT | CONTEXT)
    assert torch.equal(x_s[pinned], onehot[pinned]) and torch.equal(s, S) and torch.equal(t, T)
    torch.testing.assert_close(x_s[0, 2], torch.tensor([3 / 4, 1 / 4, -3 / 4]))  # (1 − s)·ε + s·onehot(y)
    jump = [1, 2]  # B and C, in batch order
    assert torch.equal(p1, pinned[jump]) and torch.equal(p2, pinned[jump])
    assert torch.equal(x1, x_s[jump]) and torch.equal(x2[p2], onehot[jump][p2])
    torch.testing.assert_close(x2[1, 2], torch.tensor([171, 25, 98]) / 420)  # X_u of row C
    torch.testing.assert_close(s1, torch.tensor([0.0, 1 / 5]))  # D1 at (s, u), D2 at (u, t)
    torch.testing.assert_close(u1, torch.tensor([1 / 2, 2 / 5]))
    torch.testing.assert_close(u2, u1)
    torch.testing.assert_close(t2, T[jump])


def test_the_context_set_is_drawn_off_the_prompt_below_the_rate():
    """A token is context iff its uniform < its row's rate f, never on the prompt."""
    rates = torch.tensor([0.5, 0.0, 1.0])
    uniforms = torch.tensor([[0.1, 0.4, 0.6], [0.0, 0.0, 0.3], [0.2, 0.99, 0.5]])
    prompt = torch.tensor([[True, False, False]] * 3)
    expected = torch.tensor([[False, True, False], [False, False, False], [False, True, True]])
    assert torch.equal(context_set(rates, uniforms, prompt), expected)


def test_distill_rows_need_the_mdm_teacher():
    with pytest.raises(ValueError, match="MDM teacher"):
        fmlm_plus_loss(Net(), TOKENS, PROMPT, KINDS, S, T, context=CONTEXT, noise=_noise(), process=FLOW)


def test_every_pass_keeps_ranks_in_step_without_changing_the_loss():
    """Under FSDP (``every_pass``) both semigroup passes and the MDM teacher run on every call: on a batch of
    diagonal rows only, on row 0, their results dropped (the loss is the diagonal one); on the full batch the
    loss and the passes are the plain ones."""
    plain, net_plain = _loss(parts=True)
    every, net_every = _loss(parts=True, every_pass=True)
    assert torch.equal(plain.per_token, every.per_token) and len(net_every.calls) == len(net_plain.calls) == 3
    diagonal = torch.full((4,), DIAGONAL)
    teacher_calls = []

    def counted(ids, rate):
        teacher_calls.append(ids.shape[0])
        return mdm_teacher(ids, rate)

    losses = {}
    for every_pass, passes, teachers in ((False, 1, []), (True, 3, [1])):
        net, teacher_calls[:] = Net(), []
        out = fmlm_plus_loss(
            net, TOKENS, PROMPT, diagonal, S, S, context=CONTEXT, noise=_noise(), process=FLOW,
            mdm_teacher=counted, mask_id=MASK, every_pass=every_pass,
        )  # fmt: skip
        assert len(net.calls) == passes and teacher_calls == teachers
        assert [call[0].shape[0] for call in net.calls[1:]] == [1] * (passes - 1)  # one row: row 0
        losses[every_pass] = out.per_token
    assert torch.equal(losses[True], losses[False])  # the dropped passes change nothing
