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
