"""Compiled logit passes (``flowlm.ops.compiled``): off by default, on inside ``compiled_tails()``, the same samples."""

from __future__ import annotations

import pytest
import torch

from flowlm.ops.compiled import compilable, compiled_tails, tails_enabled
from flowlm.samplers import ConfidenceSampler, MaskedDenoiser, PosteriorRefinementSampler


def test_switch_is_scoped_and_off_by_default(monkeypatch):
    """Off outside the block, on inside, restored after an exception; a marked function runs eagerly when off and
    through one torch.compile (made on first use, then reused) when on."""
    calls, compiles = [], []

    def fake_compile(fn, **kwargs):
        compiles.append(kwargs)
        return lambda *args: fn(*args) + 1  # marks the compiled path's results

    monkeypatch.setattr(torch, "compile", fake_compile)

    @compilable
    def double(x):
        calls.append(1)
        return 2 * x

    assert not tails_enabled()
    assert torch.equal(double(torch.ones(2)), torch.full((2,), 2.0)) and calls == [1]
    with pytest.raises(RuntimeError), compiled_tails():
        assert tails_enabled()
        raise RuntimeError
    assert not tails_enabled()
    with compiled_tails(False):
        assert not tails_enabled()
    assert double.eager(torch.ones(1)).item() == 2.0 and compiles == []
    with compiled_tails():
        assert double(torch.ones(1)).item() == 3.0 and double(torch.ones(1)).item() == 3.0
    assert compiles == [{"dynamic": True}]


@pytest.mark.slow
def test_compiled_samplers_give_the_eager_samples():
    """The MDM confidence sampler and PR on an FMLM+ in the embedding space give the same tokens (and confidences
    to float rounding) with their logit passes compiled as eagerly, at T = 0 (compiling takes seconds)."""
    from tests.objectives.test_state_spaces import B, L, V, flow_module

    gen = torch.Generator().manual_seed(0)
    table = torch.randn(V + 1, L, V, generator=gen) * 3

    def net(x, t):
        return table[x, torch.arange(L)] + x.float().mean(-1, keepdim=True)[..., None] / 10

    prompt = torch.randint(0, V, (B, L), generator=gen)
    mask = torch.zeros(B, L, dtype=torch.bool)
    mask[:, :3] = True
    module = flow_module()
    runs = [
        (ConfidenceSampler(), MaskedDenoiser(fn=net, mask_id=V), 4),
        (PosteriorRefinementSampler(rounds=3, threshold=0.5), module.denoiser(), 3),
    ]
    for sampler, model, nfe in runs:
        outs = []
        for compiled in (False, True):
            with torch.no_grad(), compiled_tails(compiled):
                outs.append(
                    sampler(model, prompt=prompt, prompt_mask=mask, nfe=nfe, generator=torch.Generator().manual_seed(1))
                )
        assert torch.equal(outs[0].tokens, outs[1].tokens), type(sampler).__name__
        assert torch.allclose(outs[0].confidence, outs[1].confidence, atol=1e-5)


@pytest.mark.slow
def test_compiled_training_loss_and_gradients_match_eager(monkeypatch):
    """``method.compile_tails``: the FMLM+ loss (diagonal, boundary and off-diagonal rows: student log δ with its
    backward, the teachers' no-grad passes) and every parameter's gradient equal the eager ones to float rounding;
    the compiled step's student and teacher log δ run inside ``compiled_tails``, the eager step's outside."""
    import flowlm.models.flow_map as fmlm_plus
    from flowlm.objectives.fmlm_plus import batch_kinds_and_times
    from tests.objectives.test_state_spaces import B, L, V, flow_module

    seen, original = [], fmlm_plus.log_delta
    monkeypatch.setattr(fmlm_plus, "log_delta", lambda logits: seen.append(tails_enabled()) or original(logits))
    module = flow_module(fused_loss=False).train()  # the dense student loss, eager against compiled
    gen = torch.Generator().manual_seed(0)
    batch = {"tokens": torch.randint(0, V, (B, L), generator=gen), "prompt_mask": torch.zeros(B, L, dtype=torch.bool)}
    batch["prompt_mask"][:, :2] = True
    kinds, s, t = batch_kinds_and_times(B, offset=0, count=B, generator=gen, diagonal=0.5, boundary=1 / 6)
    results = []
    for compiled in (False, True):
        module.compile_tails = compiled
        module.zero_grad(set_to_none=True)
        loss = module.loss(batch, module.draws_at(batch, kinds, s, t, torch.Generator().manual_seed(1))).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}))
    assert seen == [False, True, True, True]  # eager: the student's (its teachers in place); compiled: all three
    (eager, eager_grads), (fused, fused_grads) = results
    assert torch.allclose(eager, fused, rtol=1e-5, atol=1e-6), (eager, fused)
    assert eager_grads.keys() == fused_grads.keys() and len(eager_grads) > 10
    for name, grad in eager_grads.items():
        assert torch.allclose(grad, fused_grads[name], rtol=1e-4, atol=1e-6), name
