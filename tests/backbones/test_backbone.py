"""The shared DiT: shapes, per-token conditioning, zero-initialised output, ids ≡ one-hot vectors."""

import pytest
import torch

from flowlm.backbones.dit import SIZES, DiT, build_dit


def _net(**kw):
    torch.manual_seed(0)
    return DiT(vocab_size=7, d_model=32, n_layers=2, n_heads=4, cond_dim=16, **kw)


def test_output_is_uniform_at_init():
    logits = _net()(torch.randint(0, 7, (2, 5)), torch.rand(2))
    assert logits.shape == (2, 5, 7)
    assert torch.count_nonzero(logits) == 0  # zero-initialised final Linear


def test_ids_and_one_hot_vectors_agree():
    net = _net()
    torch.nn.init.normal_(net.final.linear.weight)
    x = torch.randint(0, 7, (2, 5))
    s = torch.rand(2)
    by_ids = net(x, s)
    by_vectors = net(torch.nn.functional.one_hot(x, 7).float(), s)
    torch.testing.assert_close(by_ids, by_vectors)


def test_per_token_times_condition_each_token():
    net = _net(two_times=True)
    for p in net.parameters():  # leave zero-init behind so conditioning shows in the output
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randint(0, 7, (1, 4))
    s = torch.zeros(1, 4)
    t = torch.ones(1, 4)
    base = net(x, s, t)
    torch.testing.assert_close(net(x, torch.zeros(1), torch.ones(1)), base)  # broadcast = per-token constant
    s2 = s.clone()
    s2[0, 2] = 0.5
    assert not torch.allclose(net(x, s2, t), base)


def test_two_time_contract_is_enforced():
    with pytest.raises(ValueError, match="two_times"):
        _net()(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1), torch.zeros(1))
    with pytest.raises(ValueError, match="two_times"):
        _net(two_times=True)(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1))


def test_named_sizes():
    assert set(SIZES) == {"tiny", "mini", "small"}
    net = build_dit(size="tiny", vocab_size=10)
    assert net.d_model == 128 and len(net.blocks) == 4
    with pytest.raises(ValueError, match="unknown backbone size"):
        build_dit(size="huge", vocab_size=10)


@pytest.mark.parametrize("two_times", [False, True])
def test_pinned_times_equal_dense_per_token_times_with_gradients(two_times):
    """The pinned form (times per sequence, pinned tokens at s = t = 1: two adaLN rows per sequence) computes the
    dense per-token forward, values and gradients, with random (non-zero) modulations."""
    net = _net(two_times=two_times)
    for p in net.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randint(0, 7, (3, 6))
    pinned = torch.rand(3, 6) < 0.4
    pinned[0] = True  # a row with nothing free
    s, t = torch.rand(3), torch.rand(3)
    s_tok, t_tok = torch.where(pinned, 1.0, s[:, None]), torch.where(pinned, 1.0, t[:, None])
    second = (t_tok,) if two_times else ()
    dense = net(x, s_tok, *second)
    grads_dense = torch.autograd.grad(dense.square().sum(), list(net.parameters()))
    compact = net(x, s, *((t,) if two_times else ()), pinned=pinned)
    grads_compact = torch.autograd.grad(compact.square().sum(), list(net.parameters()))
    torch.testing.assert_close(compact, dense, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads_compact, grads_dense, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))  # float32 summation order
    scalar = net(x, torch.tensor(0.25), *((torch.tensor(0.5),) if two_times else ()), pinned=pinned)
    full = net(x, torch.where(pinned, 1.0, 0.25), *((torch.where(pinned, 1.0, 0.5),) if two_times else ()))
    torch.testing.assert_close(scalar, full, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="per sequence"):
        net(x, s_tok, *second, pinned=pinned)
