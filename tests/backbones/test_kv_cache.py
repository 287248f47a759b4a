"""KV-cached decoding of the causal DiT: the cached logits are the full forward's, and the AR sampler draws the
same tokens with and without the cache (greedy and seeded sampling, with and without prompts)."""

from __future__ import annotations

import pytest
import torch

from flowlm.backbones.dit import DiT
from flowlm.samplers.autoregressive import AutoregressiveSampler, CausalDenoiser
from lightning_modules.ar import ARModule
from tests.conftest import random_ar_module

V, L = 11, 16


def random_ar() -> ARModule:
    return random_ar_module(vocab=V, seq_len=L)


def random_causal_dit(**kw) -> DiT:
    torch.manual_seed(1)
    net = DiT(vocab_size=V, d_model=32, n_layers=3, n_heads=4, cond_dim=16, causal=True, **kw)
    for p in net.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return net.eval()


@pytest.mark.parametrize("chunks", [[1] * L, [5, 1, 1, 3, 1, 5], [L]])
def test_cached_logits_match_the_full_forward(chunks):
    net = random_causal_dit()
    x = torch.randint(0, V, (3, L))
    s = torch.rand(3)  # any per-sequence time: the cached path must condition exactly as the full one
    full = net(x, s)
    cache = net.new_cache(L)
    start = 0
    for n in chunks:  # a prefill of several positions, then single steps and chunks
        logits = net.forward_cached(x[:, start : start + n], s, cache)
        assert cache.length == start + n
        torch.testing.assert_close(logits, full[:, start : start + n], atol=1e-5, rtol=1e-5)
        start += n
    assert start == L


def test_cached_path_takes_per_position_times_and_refuses_misuse():
    net = random_causal_dit()
    x = torch.randint(0, V, (2, 6))
    s = torch.rand(2, 6)
    full = net(x, s)
    cache = net.new_cache(8)
    torch.testing.assert_close(net.forward_cached(x[:, :4], s[:, :4], cache), full[:, :4], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(net.forward_cached(x[:, 4:], s[:, 4:], cache), full[:, 4:], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="do not fit"):
        net.forward_cached(x[:, :3], s[:, :3], cache)
    with pytest.raises(ValueError, match="causal"):
        DiT(vocab_size=V, d_model=32, n_layers=1, n_heads=4, cond_dim=16).new_cache(4)


def test_ar_extend_matches_forward_at_those_positions():
    module = random_ar()
    tokens = torch.randint(0, V, (2, L))
    full = module(tokens)
    cache = module.view.new_cache(L)
    torch.testing.assert_close(module.view.extend(tokens, 7, cache), full[:, :7], atol=1e-5, rtol=1e-5)  # prefill
    for i in range(7, L):
        step = module.view.extend(tokens, i + 1, cache)
        assert step.shape == (2, 1, V)
        torch.testing.assert_close(step[:, 0], full[:, i], atol=1e-5, rtol=1e-5)


def prompts(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt, prompt_mask) for 4 rows: none, right-padded prefixes of different lengths (GSM8K: [BOS] prompt
    then the response), or scattered clues with one column that is a clue in every row (Sudoku)."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, V, (4, L), generator=g)
    if kind == "none":
        mask = torch.zeros(4, L, dtype=torch.bool)
    elif kind == "prefix":
        mask = torch.arange(L) < torch.tensor([[2], [5], [9], [3]])
    else:
        mask = torch.rand(4, L, generator=g) < 0.3
        mask[:, 6] = True
        mask[:, 0] = False
    return prompt, mask


@pytest.mark.parametrize("kind", ["none", "prefix", "clues"])
@pytest.mark.parametrize("temperature, top_k", [(0.0, None), (1.0, None), (0.7, 4)])
def test_cached_sampler_draws_the_same_tokens(kind, temperature, top_k):
    module = random_ar()
    prompt, mask = prompts(kind)
    free = int((~mask).any(0).sum())
    calls = {"fn": 0, "extend": 0}

    def counted(name, f):
        def wrapped(*args):
            calls[name] += 1
            return f(*args)

        return wrapped

    cached_model = CausalDenoiser(
        fn=counted("fn", module), new_cache=module.view.new_cache, extend=counted("extend", module.view.extend)
    )
    outs = {}
    for use_cache in (False, True):
        sampler = AutoregressiveSampler(temperature=temperature, top_k=top_k, kv_cache=use_cache)
        gen = torch.Generator().manual_seed(7)
        outs[use_cache] = sampler(cached_model, prompt=prompt, prompt_mask=mask, nfe=L, generator=gen)
    assert calls == {"fn": free, "extend": free}  # one call per generated position either way: same NFE
    assert outs[True].nfe == outs[False].nfe == free
    assert torch.equal(outs[True].tokens, outs[False].tokens)
    assert torch.equal(outs[True].tokens[mask], prompt[mask])
    torch.testing.assert_close(outs[True].confidence, outs[False].confidence, atol=1e-5, rtol=1e-5)


def test_denoiser_uses_the_cache_by_default_and_keeps_the_budget_check():
    module = random_ar()
    model = module.denoiser()
    assert model.extend is not None and model.new_cache is not None
    prompt, mask = prompts("prefix")
    out = AutoregressiveSampler(temperature=0.0)(
        model, prompt=prompt, prompt_mask=mask, nfe=L, generator=torch.Generator().manual_seed(0)
    )
    logits = module(out.tokens)  # greedy: every generated token is the full forward's argmax given its prefix
    assert torch.equal(out.tokens[~mask], logits.argmax(-1)[~mask])
    with pytest.raises(ValueError, match="below the 14 positions"):
        AutoregressiveSampler()(model, prompt=prompt, prompt_mask=mask, nfe=13, generator=None)
