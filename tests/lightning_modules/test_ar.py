"""Autoregressive baseline: causality, the shifted loss, left-to-right sampling and its NFE, bad budgets."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flowlm.samplers.autoregressive import AutoregressiveSampler, CausalDenoiser
from lightning_modules.ar import ARModule
from tests.conftest import random_ar_module

V, L = 5, 10


def random_ar() -> ARModule:
    return random_ar_module(vocab=V, seq_len=L)


def test_prediction_at_i_reads_only_tokens_before_i():
    module = random_ar()
    x = torch.randint(0, V, (2, L))
    ref = module(x)
    for i in range(L):
        y = x.clone()
        y[:, i:] = torch.randint(0, V, (2, L - i))  # change position i and everything after it
        torch.testing.assert_close(module(y)[:, : i + 1], ref[:, : i + 1])  # predictions up to i unchanged
    z = x.clone()
    z[:, 3] = (z[:, 3] + 1) % V
    assert not torch.allclose(module(z)[:, 4:], ref[:, 4:])  # …but later ones do read it


def test_loss_is_next_token_cross_entropy_on_non_prompt_positions():
    module = random_ar()
    tokens = torch.randint(0, V, (3, L))
    prompt = torch.zeros(3, L, dtype=torch.bool)
    prompt[:, :4] = True
    logits = module(tokens)
    nll = F.cross_entropy(logits.transpose(1, 2), tokens, reduction="none")
    expected = nll[:, 4:].mean()
    torch.testing.assert_close(module.loss({"tokens": tokens, "prompt_mask": prompt}, {}).loss, expected)


def test_sampler_fills_free_positions_left_to_right_with_exact_nfe():
    module = random_ar()
    calls = []

    def fn(x):
        calls.append(x.clone())
        return module(x)

    prompt = torch.randint(0, V, (4, L))
    pm = torch.zeros(4, L, dtype=torch.bool)
    pm[:, :3] = True
    pm[1, 5] = True  # a clue inside the response is copied, not predicted
    out = AutoregressiveSampler(temperature=0.0)(
        CausalDenoiser(fn), prompt=prompt, prompt_mask=pm, nfe=7, generator=None
    )
    assert out.nfe == len(calls) == 7
    assert torch.equal(out.tokens[pm], prompt[pm])
    # Greedy: each generated token is the argmax of the model given the tokens before it.
    logits = module(out.tokens)
    free = ~pm
    assert torch.equal(out.tokens[free], logits.argmax(-1)[free])
    torch.testing.assert_close(out.confidence[free], logits.softmax(-1).max(-1).values[free])
    sampled = AutoregressiveSampler(temperature=1.0)
    a = sampled(
        CausalDenoiser(module), prompt=prompt, prompt_mask=pm, nfe=7, generator=torch.Generator().manual_seed(0)
    )
    b = sampled(
        CausalDenoiser(module), prompt=prompt, prompt_mask=pm, nfe=7, generator=torch.Generator().manual_seed(0)
    )
    assert torch.equal(a.tokens, b.tokens)


def test_budget_below_the_response_is_refused():
    sampler = AutoregressiveSampler()
    with pytest.raises(ValueError, match="below the 7 positions"):
        sampler.check_budget(6, free_positions=7)
    with pytest.raises(ValueError, match="top_k"):
        AutoregressiveSampler(top_k=0)
