"""FlexAttention's path (the fused kernel CUDA takes) without per-shape work: one compile for every sequence length
(automatic dynamic shapes, not ``dynamic=False``, whose recompile limit sent the ninth length to the unfused path) and
the causal block mask built once per shape. Run eagerly on the CPU: ``torch.compile`` is replaced by a recorder."""

import torch
from torch.nn.attention import flex_attention as flex_module

from flowlm.backbones import dit


def test_one_compile_for_every_length_and_one_causal_mask_per_shape(monkeypatch):
    compiles, masks = [], []
    monkeypatch.setattr(dit, "_FLEX", {})
    real_compile = torch.compile

    def compile_(fn, **kwargs):  # FlexAttention's own compile is recorded and left eager (the CPU); others go on
        if fn is flex_module.flex_attention:
            compiles.append(kwargs)
            return fn
        return real_compile(fn, **kwargs)

    monkeypatch.setattr(torch, "compile", compile_)
    real_mask = flex_module.create_block_mask
    monkeypatch.setattr(flex_module, "create_block_mask", lambda *a, **k: masks.append(a[3:5]) or real_mask(*a, **k))
    dit.causal_block_mask.cache_clear()
    g = torch.Generator().manual_seed(0)
    for length in (8, 16, 8, 24, 16):
        q, k, v = (torch.randn(1, 2, length, 8, generator=g) for _ in range(3))
        for causal in (True, False):
            mask = torch.ones(length, length, dtype=torch.bool).tril() if causal else None
            out = dit.flex_capped_attention(q, k, v, cap=5.0, is_causal=causal)
            ref = dit.written_capped_attention(q, k, v, cap=5.0, dropout_p=0.0, is_causal=False, attn_mask=mask)
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert len(compiles) == 1 and compiles[0].get("dynamic") is None  # automatic dynamic: no recompile per length
    assert masks == [(8, 8), (16, 16), (24, 24)]  # each causal shape built once
    assert dit.tanh_cap(5.0) is dit.tanh_cap(5.0)  # one score_mod object: one guard
