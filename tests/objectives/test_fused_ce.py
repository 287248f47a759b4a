"""The fused blocked soft-capped cross-entropy (flowlm/ops/fused_ce.py) against the dense log δ path.

per_token = −Σ_v q_v log δ_v with log δ = log_delta(features·Wᵀ + b) (flowlm/objectives/flow.py), q one-hot by the
tokens except on the soft rows, and loss = Σ w · per_token for token weights w that are zero on some tokens (the
caller's mask); the loss's gradients w.r.t. the features, W and b, made in the forward pass. Blocks: one row, an odd
size that does not divide B·L, all rows at once; float32, and bf16 autocast (both paths round the logits to bf16 as
the model's head does).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flowlm.ops.fused_ce as fused_ce_module
import flowlm.ops.summary as summary_module
from flowlm.objectives.flow import SOFT_CAP, log_delta
from flowlm.ops.fused_ce import MIN_BLOCK, block_rows, fused_capped_ce
from flowlm.ops.summary import DEVICE_PASS_BYTES, vocab_sizes

B, L, D, V = 4, 6, 12, 53


def _case(seed: int = 0, dtype=torch.float32, b: int = B, length: int = L):
    """Features, a head with logits spread over ±3·cap (the cap's curved part and its flat tails), tokens, two soft
    rows of target distributions (rows 2 and 0: not sorted) and token weights with zeros."""
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(b, length, D, generator=gen, dtype=dtype)
    weight = torch.randn(V, D, generator=gen, dtype=dtype) * 12
    bias = torch.randn(V, generator=gen, dtype=dtype) * 5
    tokens = torch.randint(0, V, (b, length), generator=gen)
    rows = torch.tensor([2, 0])
    values = F.softmax(torch.randn(2, length, V, generator=gen, dtype=dtype) * 3, -1)
    upstream = torch.randn(b, length, generator=gen, dtype=dtype)
    upstream[1, 2:] = 0  # masked tokens, a one-hot row
    upstream[2, 0] = 0  # and a soft row
    return features, weight, bias, tokens, (rows, values), upstream


def _dense(features, weight, bias, tokens, soft):
    """fmlm_plus_loss's dense per-token loss: a gather on one-hot rows, the full sum on the soft rows."""
    log_d = log_delta(F.linear(features, weight, bias))
    per_token = -log_d.gather(-1, tokens[..., None]).squeeze(-1)
    if soft is not None:
        rows, values = soft
        per_token = per_token.index_copy(0, rows, -(values.to(log_d.dtype) * log_d[rows]).sum(-1))
    return per_token


def _dense_fn(tokens, soft, upstream):
    """(loss, per_token) of the dense path with the token weights ``upstream``, as the fused function returns."""

    def fn(f, w, b):
        per_token = _dense(f, w, b, tokens, soft)
        return (per_token * upstream).sum(), per_token

    return fn


def _fused_fn(tokens, soft, upstream, block):
    return lambda f, w, b: fused_capped_ce(f, w, b, tokens, upstream, soft, cap=SOFT_CAP, block=block)


def _loss_and_grads(fn, features, weight, bias, *, autocast: bool = False):
    """per_token, loss and the loss's gradients w.r.t. the leaves that are given."""
    leaves = [None if x is None else x.detach().clone().requires_grad_() for x in (features, weight, bias)]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss, per_token = fn(*leaves)
    grads = torch.autograd.grad(loss, [x for x in leaves if x is not None])
    return per_token.detach(), grads, loss.detach()


@pytest.mark.parametrize("block", [1, 7, B * L])
@pytest.mark.parametrize("with_soft", [True, False])
def test_fused_equals_dense_float32(block, with_soft):
    """float32: per_token and the loss to 2e-5 (per_token's scale: up to 2·cap), the gradients to 1e-5 of their
    largest entry (measured: ≤ 2e-7)."""
    features, weight, bias, tokens, soft, upstream = _case(1)
    soft = soft if with_soft else None
    dense = _loss_and_grads(_dense_fn(tokens, soft, upstream), features, weight, bias)
    fused = _loss_and_grads(_fused_fn(tokens, soft, upstream, block), features, weight, bias)
    assert torch.allclose(fused[0], dense[0], rtol=2e-5, atol=2e-5), (fused[0] - dense[0]).abs().max()
    assert torch.allclose(fused[2], dense[2], rtol=2e-5, atol=2e-5), (fused[2], dense[2])
    for name, got, want in zip(("features", "weight", "bias"), fused[1], dense[1], strict=True):
        assert got.dtype == want.dtype
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), name


@pytest.mark.parametrize("block", [1, 7, B * L])
def test_fused_equals_dense_under_bf16_autocast(block):
    """bf16 autocast: the head's blocks are rounded to bf16 as the dense head's logits are, so per_token agrees to
    float32 rounding of the same bf16 logits (1e-4); the gradients to 1 % of their largest entry (measured: ≤ 0.5 %;
    the dense backward rounds dL/dl and the whole products to bf16, the fused one each block's product); grads in
    the parameters' dtype (float32)."""
    features, weight, bias, tokens, soft, upstream = _case(2)
    dense = _loss_and_grads(_dense_fn(tokens, soft, upstream), features, weight, bias, autocast=True)
    fused = _loss_and_grads(_fused_fn(tokens, soft, upstream, block), features, weight, bias, autocast=True)
    assert fused[0].dtype == torch.float32
    assert torch.allclose(fused[0], dense[0], rtol=1e-4, atol=1e-4), (fused[0] - dense[0]).abs().max()
    for name, got, want in zip(("features", "weight", "bias"), fused[1], dense[1], strict=True):
        assert got.dtype == torch.float32
        assert (got - want).abs().max() <= 1e-2 * want.abs().max(), name


def test_the_cpu_keeps_its_32_mib_blocks_and_a_gpu_takes_memory_bounded_ones():
    """``block_rows`` per device (flowlm/ops/summary.py ``vocab_sizes``, issue 51): the CPU's 32 MiB of float32 a
    block, 166 rows at |V| = 50 258 (99 blocks at a 16 × 1 024 micro batch), at least ``MIN_BLOCK``; CUDA and meta
    the samplers' memory bound, 1 335 rows (13 blocks)."""
    assert vocab_sizes("cpu").ce_block_bytes == 32 << 20
    assert block_rows(50258, "cpu") == block_rows(50258, torch.device("cpu")) == 166
    assert block_rows(V, "cpu") == (32 << 20) // (4 * V) and block_rows(10**7, "cpu") == MIN_BLOCK
    for device in ("cuda", torch.device("cuda", 1), "meta"):
        assert vocab_sizes(device).ce_block_bytes == DEVICE_PASS_BYTES
        assert block_rows(50258, device) == 1335 and 1335 * 50258 * 4 <= DEVICE_PASS_BYTES
        assert block_rows(10**7, device) == MIN_BLOCK


class _HeadProducts(torch.overrides.TorchFunctionMode):
    """Counts ``F.linear`` calls: the fused function's head product, one per block."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func is F.linear
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("autocast", [False, True])
def test_fused_cut_as_on_a_gpu_equals_dense(monkeypatch, autocast):
    """CPU tensors cut into the blocks a GPU takes (``vocab_sizes("cuda")``, its budget narrowed to 20 rows at
    |V| = 53, the default ``block``): 8 × 16 tokens in seven blocks (96 one-hot tokens in five, 32 soft in two), the
    loss, per_token and the gradients the dense path's within the float32 and bf16 tolerances above."""
    real = summary_module.vocab_sizes
    monkeypatch.setattr(fused_ce_module, "vocab_sizes", lambda device: real("cuda"))
    monkeypatch.setattr(summary_module, "DEVICE_PASS_BYTES", 4 * V * 20)
    assert block_rows(V, "cpu") == 20
    features, weight, bias, tokens, soft, upstream = _case(6, b=8, length=16)
    dense = _loss_and_grads(_dense_fn(tokens, soft, upstream), features, weight, bias, autocast=autocast)
    with _HeadProducts() as products:
        fused = _loss_and_grads(_fused_fn(tokens, soft, upstream, None), features, weight, bias, autocast=autocast)
    assert products.count == 7
    close, grad_rel = (1e-4, 1e-2) if autocast else (2e-5, 1e-5)
    assert torch.allclose(fused[0], dense[0], rtol=close, atol=close), (fused[0] - dense[0]).abs().max()
    assert torch.allclose(fused[2], dense[2], rtol=close, atol=close), (fused[2], dense[2])
    for name, got, want in zip(("features", "weight", "bias"), fused[1], dense[1], strict=True):
        assert (got - want).abs().max() <= grad_rel * want.abs().max(), name


def test_zero_weights_give_zero_gradient_and_the_upstream_scales_it():
    """A token of weight 0 contributes nothing: all-zero weights → all-zero gradients; the gradients made in the
    forward are scaled by the upstream gradient of the loss (here 2.5); without grad mode none are made (one head
    product, counted by torch's FlopCounterMode, against three with it)."""
    features, weight, bias, tokens, soft, upstream = _case(3)
    _, grads, _ = _loss_and_grads(_fused_fn(tokens, soft, torch.zeros_like(upstream), 7), features, weight, bias)
    assert all(not g.any() for g in grads)
    _, ones, _ = _loss_and_grads(_fused_fn(tokens, soft, upstream, 7), features, weight, bias)

    def times_2_5(f, w, b):
        loss, per_token = fused_capped_ce(f, w, b, tokens, upstream, soft, cap=SOFT_CAP, block=7)
        return 2.5 * loss, per_token

    scaled = _loss_and_grads(times_2_5, features, weight, bias)[1]
    for one, two in zip(ones, scaled, strict=True):
        assert torch.allclose(two, 2.5 * one, rtol=1e-6, atol=0)
    from torch.utils.flop_counter import FlopCounterMode

    leaf = features.clone().requires_grad_()
    head = 2 * B * L * D * V  # one product over every row
    for grad, products in ((False, 1), (True, 3)):  # the forward's; with grad also ∂features and ∂W
        with torch.set_grad_enabled(grad), FlopCounterMode(display=False) as counter:
            fused_capped_ce(leaf, weight.requires_grad_(), bias, tokens, upstream, soft, cap=SOFT_CAP, block=7)
        assert counter.get_total_flops() == products * head, grad


def test_gradcheck_float64():
    """torch.autograd.gradcheck in float64 on a tiny case: soft and one-hot rows, a block that does not divide B·L;
    the soft values are not normalised (the function is m·lse − Σ q·g with m = Σ q), so the check, and per_token
    against the dense −Σ q·log δ, also cover m."""
    gen = torch.Generator().manual_seed(4)
    b, length, d, vocab = 3, 4, 5, 11
    features = torch.randn(b, length, d, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = (torch.randn(vocab, d, generator=gen, dtype=torch.float64) * 8).requires_grad_()
    bias = torch.randn(vocab, generator=gen, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, vocab, (b, length), generator=gen)
    values = torch.rand(1, length, vocab, generator=gen, dtype=torch.float64)
    soft = (torch.tensor([1]), values)
    weights = torch.rand(b, length, generator=gen, dtype=torch.float64)
    fn = lambda f, w, bb: fused_capped_ce(f, w, bb, tokens, weights, soft, cap=SOFT_CAP, block=5)[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (features, weight, bias))
    per_token = fused_capped_ce(features, weight, bias, tokens, weights, soft, cap=SOFT_CAP, block=5)[1]
    log_d = F.log_softmax(SOFT_CAP * torch.tanh(F.linear(features, weight, bias) / SOFT_CAP), -1)  # float64
    want = -log_d.gather(-1, tokens[..., None]).squeeze(-1)
    want[1] = -(values[0] * log_d[1]).sum(-1)  # the soft row, unnormalised
    assert torch.allclose(per_token, want, rtol=1e-12, atol=1e-12)


def test_without_bias_and_errors():
    """A head without bias equals the dense path; a non-positive cap, mismatched shapes and block 0 are refused."""
    features, weight, _, tokens, soft, upstream = _case(5)
    dense = _loss_and_grads(_dense_fn(tokens, soft, upstream), features, weight, None)
    fused = _loss_and_grads(_fused_fn(tokens, soft, upstream, 7), features, weight, None)
    assert torch.allclose(fused[0], dense[0], rtol=2e-5, atol=2e-5)
    for got, want in zip(fused[1], dense[1], strict=True):
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    with pytest.raises(ValueError, match="soft cap"):
        fused_capped_ce(features, weight, None, tokens, upstream, cap=0.0)
    with pytest.raises(ValueError, match="do not fit"):
        fused_capped_ce(features, weight[:, :-1], None, tokens, upstream, cap=SOFT_CAP)
    with pytest.raises(ValueError, match="do not match"):
        fused_capped_ce(features, weight, None, tokens, upstream[:, :-1], cap=SOFT_CAP)
    with pytest.raises(ValueError, match="do not match"):
        fused_capped_ce(features, weight, None, tokens, upstream, (soft[0], soft[1][:, :, :-1]), cap=SOFT_CAP)
    with pytest.raises(ValueError, match="block"):
        fused_capped_ce(features, weight, None, tokens, upstream, cap=SOFT_CAP, block=0)


# ------------------------------------------------------------------------------------------- the FMLM+ module
VM, DM, LM, BM = 2003, 16, 8, 6  # |V| a few thousand, odd


def _module(state_space: str, fused: bool):
    from lightning_modules.fmlm_plus import FMLMPlusModule

    torch.manual_seed(7)
    backbone = {"d_model": DM, "n_layers": 1, "n_heads": 2, "cond_dim": 16}
    module = FMLMPlusModule(
        data_vocab_size=VM,
        seq_len=LM,
        backbone=backbone,
        optim={"lr": 1e-3},
        state_space=state_space,
        fused_loss=fused,
        teacher_train_mode=False,  # dropout off: the teachers' passes are deterministic
    ).train()
    with torch.no_grad():
        for p in module.parameters():
            if not p.any():
                p.normal_(0, 0.5)
    return module


@pytest.mark.parametrize("state_space", ["onehot", "embedding"])
def test_module_fused_loss_matches_dense(state_space, monkeypatch):
    """``method.fused_loss``: on one batch of diagonal, boundary and off-diagonal rows, with a PAD loss mask, the
    FMLM+ loss, its parts and every parameter's gradient equal the dense path's to float rounding; the student
    pass never calls log_delta with the fused loss (the teachers still do)."""
    import flowlm.models.flow_map as fmlm_plus
    from flowlm.objectives.fmlm_plus import batch_kinds_and_times

    calls, original = [], fmlm_plus.log_delta
    monkeypatch.setattr(fmlm_plus, "log_delta", lambda x: calls.append(torch.is_grad_enabled()) or original(x))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VM, (BM, LM), generator=gen)
    batch = {"tokens": tokens, "prompt_mask": torch.zeros(BM, LM, dtype=torch.bool)}
    batch["prompt_mask"][:, :2] = True
    batch["loss_mask"] = torch.ones(BM, LM, dtype=torch.bool)
    batch["loss_mask"][0, -2:] = False
    kinds, s, t = batch_kinds_and_times(BM, offset=0, count=BM, generator=gen, diagonal=0.5, boundary=1 / 6)
    assert len(set(kinds.tolist())) == 3
    results = []
    for fused in (False, True):
        module = _module(state_space, fused)
        calls.clear()
        out = module.loss(batch, module.draws_at(batch, kinds, s, t, torch.Generator().manual_seed(1)), parts=True)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
        results.append((out, grads, list(calls)))
    (dense, dense_grads, dense_calls), (fused, fused_grads, fused_calls) = results
    assert dense_calls == [True] and fused_calls == []  # the student's log δ; teachers run log_delta_ (no grad)
    assert torch.allclose(dense.loss, fused.loss, rtol=1e-5, atol=1e-6), (dense.loss, fused.loss)
    assert torch.allclose(dense.per_token, fused.per_token, rtol=1e-5, atol=1e-5)
    assert dense.parts.keys() == fused.parts.keys() and len(dense.parts) == 3
    for name in dense.parts:
        assert abs(dense.parts[name] - fused.parts[name]) <= 1e-5 * abs(dense.parts[name]), name
    assert dense_grads.keys() == fused_grads.keys() and len(dense_grads) > 10
    for name, grad in dense_grads.items():
        assert (grad - fused_grads[name]).abs().max() <= 1e-4 * grad.abs().max() + 1e-7, name


def test_module_fused_loss_refuses_an_adapted_head():
    """A head that is not a plain Linear (an adapter's subclass) is refused with a clear error."""

    class Adapted(torch.nn.Linear):
        pass

    module = _module("onehot", True)
    old = module.net.final.linear
    module.net.final.linear = Adapted(old.in_features, old.out_features)
    batch = {"tokens": torch.zeros(2, LM, dtype=torch.long), "prompt_mask": torch.zeros(2, LM, dtype=torch.bool)}
    with pytest.raises(TypeError, match="plain Linear"):
        module.loss(batch, module.draws_at(batch, torch.zeros(2, dtype=torch.long), torch.rand(2), torch.rand(2), None))


def test_objective_fused_head_matches_dense_with_distill_rows():
    """``fmlm_plus_loss(head=...)`` with every pair kind, distill rows included (an MDM teacher's softmax targets,
    here a fixed random linear map of the ids): the loss and its gradients equal the dense student's; a fused head
    without a separate teacher is refused (the student then returns features, not log δ)."""
    from flowlm.objectives.fmlm_plus import BOUNDARY, DIAGONAL, DISTILL, OFF_DIAGONAL, fmlm_plus_loss

    module = _module("onehot", False)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VM, (BM, LM), generator=gen)
    prompt = torch.zeros(BM, LM, dtype=torch.bool)
    prompt[:, 0] = True
    kinds = torch.tensor([DIAGONAL, DISTILL, OFF_DIAGONAL, BOUNDARY, DISTILL, DIAGONAL])
    s = torch.tensor([0.3, 0.0, 0.2, 0.0, 0.0, 0.7])
    t = torch.tensor([0.3, 0.0, 0.6, 1.0, 0.0, 0.7])
    table = torch.randn(VM + 1, VM, generator=gen)  # ids ([MASK] = VM) → teacher logits
    args = dict(
        context=torch.rand(BM, LM, generator=gen) < 0.3,
        noise=torch.randn(BM, LM, VM, generator=gen),
        process=module.view.process,
        teacher=module.teacher_pass,
        mdm_teacher=lambda ids, rate: table[ids],
        mask_id=VM,
        parts=True,
    )
    head = module.net.final.linear
    results = []
    for fused in (False, True):
        module.zero_grad(set_to_none=True)
        student, extra = (module.view.head_input, {"head": (head.weight, head.bias)}) if fused else (module, {})
        out = fmlm_plus_loss(student, tokens, prompt, kinds, s, t, **args, **extra)
        out.loss.backward()
        results.append((out, {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}))
    (dense, dense_grads), (fused, fused_grads) = results
    assert set(dense.parts) == {"diagonal", "boundary", "off_diagonal", "distill"}
    assert torch.allclose(dense.loss, fused.loss, rtol=1e-5, atol=1e-6), (dense.loss, fused.loss)
    for name in dense.parts:
        assert abs(dense.parts[name] - fused.parts[name]) <= 1e-5 * abs(dense.parts[name]), name
    assert dense_grads.keys() == fused_grads.keys()
    for name, grad in dense_grads.items():
        assert (grad - fused_grads[name]).abs().max() <= 1e-4 * grad.abs().max() + 1e-7, name
    with pytest.raises(ValueError, match="teacher"):
        fmlm_plus_loss(
            module.view.head_input, tokens, prompt, kinds, s, t, **{**args, "teacher": None}, head=(head.weight, None)
        )


def test_fused_loss_auto_chooses_by_shape():
    """``fused_loss=auto`` (the default): fused where |V| > d and the head is a plain Linear (text), dense at a
    Sudoku vocabulary and for an adapted head; false never; an unknown value is refused."""
    from lightning_modules.fmlm_plus import FMLMPlusModule

    assert _module("embedding", "auto").fused_head() is not None  # |V| = VM > d = DM
    assert _module("embedding", False).fused_head() is None
    small = FMLMPlusModule(
        data_vocab_size=6, seq_len=LM, backbone={"d_model": DM, "n_layers": 1, "n_heads": 2, "cond_dim": 16}, optim={}
    )
    assert small.fused_loss == "auto" and small.fused_head() is None  # |V| ≤ d: the dense path
    module = _module("onehot", "auto")
    old = module.net.final.linear

    class Adapted(torch.nn.Linear):
        pass

    module.net.final.linear = Adapted(old.in_features, old.out_features)
    assert module.fused_head() is None  # auto falls back; true refuses (test above)
    with pytest.raises(ValueError, match="fused_loss must be one of"):
        _module("onehot", "fast")
