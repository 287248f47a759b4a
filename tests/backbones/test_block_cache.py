"""The block KV cache of semi-autoregressive MDM decoding (flowlm/samplers/block_cache.py, Fast-dLLM's prefix and
dual cache): windowed passes read what a full pass would where their keys are fresh, a refresh at every step
decodes token for token as no cache, and the approximation runs within the same NFE."""

from __future__ import annotations

import pytest
import torch

from flowlm.samplers import SemiARConfidenceSampler
from lightning_modules.mdm import MDMModule

V, L = 7, 24
BACKBONE = {"d_model": 32, "n_layers": 2, "n_heads": 4, "cond_dim": 16, "dropout": 0.0}


def random_mdm(seed: int = 0, **kwargs) -> MDMModule:
    torch.manual_seed(seed)
    module = MDMModule(data_vocab_size=V, seq_len=L, backbone=BACKBONE, optim={}, **kwargs)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.4)  # every adaLN and the head away from their zero initialisation
    return module.eval()


def prompts(b: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, V, (b, L), generator=gen)
    mask = torch.zeros(b, L, dtype=torch.bool)
    mask[:, :5] = True
    mask[1, :9] = True  # rows with different prompts: the blocks' windows cover every row's block
    mask[2, 12] = True  # a given inside the answer (Sudoku-like)
    return tokens, mask


def test_windowed_passes_read_the_full_pass_where_their_keys_are_fresh():
    net = random_mdm().net
    gen = torch.Generator().manual_seed(2)
    x = torch.randint(0, V + 1, (2, L), generator=gen)
    s = torch.zeros(2)
    cache = net.new_block_cache(L)
    with torch.no_grad():
        full = net(x, s)
        torch.testing.assert_close(net.forward_window(x, s, cache, 0), full, atol=1e-5, rtol=1e-5)  # fills it
        for lo, hi in ((8, 16), (8, L), (0, 4)):  # dual and prefix windows, same inputs: the same logits
            torch.testing.assert_close(
                net.forward_window(x[:, lo:hi], s, cache, lo), full[:, lo:hi], atol=1e-5, rtol=1e-5
            )
        y = x.clone()
        y[:, 16:] = V  # positions outside the window changed since the refresh: the window reads their old keys
        stale = net.forward_window(y[:, 8:16], s, cache, 8)
        assert not torch.allclose(stale, net(y, s)[:, 8:16], atol=1e-3)
    with pytest.raises(ValueError, match="full pass"):
        net.forward_window(x[:, 8:16], s, net.new_block_cache(L), 8)
    with pytest.raises(ValueError, match="outside"):
        net.forward_window(x, s, cache, 4)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("score", ["sampled", "max_prob"])
def test_a_refresh_at_every_step_decodes_as_no_cache(cache, score):
    model = random_mdm().denoiser()
    tokens, mask = prompts()
    outs = {}
    for name, kwargs in (("none", {}), (cache, {"cache": cache, "refresh": 1})):
        sampler = SemiARConfidenceSampler(block_length=4, score=score, **kwargs)
        with torch.no_grad():
            outs[name] = sampler(model, prompt=tokens, prompt_mask=mask, nfe=10, generator=torch.Generator())
    assert torch.equal(outs[cache].tokens, outs["none"].tokens)
    assert outs[cache].nfe == outs["none"].nfe
    torch.testing.assert_close(outs[cache].confidence, outs["none"].confidence, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_the_approximate_cache_spends_the_same_nfe_and_fills_every_position(cache):
    model = random_mdm(seed=3).denoiser()
    tokens, mask = prompts()
    calls = []
    windowed = model.windowed

    def counting(length):
        read = windowed(length)
        return lambda x, t, start: calls.append((start, x.shape[1])) or read(x, t, start)

    counted = type(model)(fn=model.fn, mask_id=model.mask_id, windowed=counting)
    sampler = SemiARConfidenceSampler(block_length=4, cache=cache, temperature=1.0)
    with torch.no_grad():
        out = sampler(counted, prompt=tokens, prompt_mask=mask, nfe=12, generator=torch.Generator().manual_seed(0))
    free = L - 5
    assert out.nfe == len(calls) == 10  # 5 blocks of 4 (19 free in row 0): 12 // 5 = 2 steps each
    assert (out.tokens != model.mask_id).all() and torch.equal(out.tokens[mask], tokens[mask])
    full = [c for c in calls if c == (0, L)]
    assert len(full) == -(-free // 4)  # one full pass per block
    if cache == "dual":
        # the block's window: its positions over the rows (row 1's prompt is 4 longer), never the suffix
        assert all(width <= 4 + 4 for start, width in calls if (start, width) != (0, L))
    else:
        assert all(start + width == L for start, width in calls)  # the block and everything after it


def test_cache_refusals():
    with pytest.raises(ValueError, match="cache must be one of"):
        SemiARConfidenceSampler(block_length=4, cache="both")
    with pytest.raises(ValueError, match="refresh must be"):
        SemiARConfidenceSampler(block_length=4, cache="dual", refresh=0)
    with pytest.raises(ValueError, match="cfg_scale"):
        SemiARConfidenceSampler(block_length=4, cache="dual", cfg_scale=1.0)
    model = random_mdm().denoiser()
    plain = type(model)(fn=model.fn, mask_id=model.mask_id)  # a network without windowed passes
    tokens, mask = prompts()
    with pytest.raises(ValueError, match="windowed passes"):
        SemiARConfidenceSampler(block_length=4, cache="prefix")(
            plain, prompt=tokens, prompt_mask=mask, nfe=8, generator=None
        )
