"""SMDM's unsupervised CFG for the MDM samplers (flowlm/samplers/guidance.py): guided = un + (w + 1)(cond − un) with
un the network on the prompt-masked state, one call over 2B rows counted as 2 NFE, w = 0 exactly the unguided path."""

from __future__ import annotations

import pytest
import torch

from flowlm.backbones.llama import BidirectionalLM
from flowlm.samplers import AncestralSampler, ConfidenceSampler, MaskedDenoiser, SemiARConfidenceSampler
from flowlm.samplers.guidance import guided_denoiser

V, MASK, L, B = 6, 6, 12, 4
W = 1.5


class PromptAwareNet:
    """A fixed random 'network' whose logits at every position depend on every token (so on whether the prompt is
    visible); it records each call's input."""

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(V + 1, L, V, generator=g)
        self.mix = 2 * torch.randn(V + 1, V, generator=g)
        self.inputs: list[torch.Tensor] = []

    def __call__(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        self.inputs.append(x.clone())
        return self.table[x, torch.arange(x.shape[1])] + self.mix[x].mean(1, keepdim=True)

    @property
    def calls(self) -> int:
        return len(self.inputs)

    def view(self) -> MaskedDenoiser:
        return MaskedDenoiser(fn=self, mask_id=MASK)


def reference_guided(net: PromptAwareNet, prompt_mask: torch.Tensor, w: float) -> MaskedDenoiser:
    """The guided model written directly from the formula, two separate calls (SMDM diff_sample)."""

    def fn(x, t):
        cond = net(x, t)
        un = net(torch.where(prompt_mask, MASK, x), t)
        return un + (w + 1) * (cond - un)

    return MaskedDenoiser(fn=fn, mask_id=MASK, rows_alone=False)  # it holds the batch's prompt mask


def _prompt(prompt_lengths=(4, 3, 5, 0)):
    prompt = torch.randint(0, V, (len(prompt_lengths), L), generator=torch.Generator().manual_seed(1))
    prompt_mask = torch.arange(L) < torch.tensor(prompt_lengths)[:, None]
    return prompt, prompt_mask


SAMPLERS = {
    "ancestral": lambda **kw: AncestralSampler(cache=False, **kw),
    "ancestral_cache": lambda **kw: AncestralSampler(**kw),
    "confidence": lambda **kw: ConfidenceSampler(**kw),
    "confidence_t1_sampled": lambda **kw: ConfidenceSampler(temperature=1.0, score="sampled", **kw),
    "confidence_t1": lambda **kw: ConfidenceSampler(temperature=1.0, **kw),
    "semi_ar": lambda **kw: SemiARConfidenceSampler(block_length=3, **kw),
    "semi_ar_t1": lambda **kw: SemiARConfidenceSampler(block_length=3, temperature=1.0, **kw),
}


def _run(sampler, model, nfe, seed=0):
    prompt, prompt_mask = _prompt()
    return sampler(
        model, prompt=prompt, prompt_mask=prompt_mask, nfe=nfe, generator=torch.Generator().manual_seed(seed)
    )


def test_guided_logits_are_the_formula_and_the_branches_see_what_they_should():
    net = PromptAwareNet()
    prompt, prompt_mask = _prompt()
    x = torch.where(prompt_mask | (torch.arange(L) % 3 == 0), prompt, MASK)  # prompt + some committed tokens
    t = torch.rand(B)
    guided = guided_denoiser(net.view(), prompt_mask, W).fn(x, t)
    assert net.calls == 1 and net.inputs[0].shape == (2 * B, L)  # one call over 2B rows
    cond_in, un_in = net.inputs[0][:B], net.inputs[0][B:]
    assert torch.equal(cond_in, x)  # the conditional branch sees the prompt
    assert torch.equal(un_in == MASK, prompt_mask | (x == MASK))  # [MASK] exactly at the prompt (and still-masked)
    assert torch.equal(un_in[~prompt_mask], x[~prompt_mask])  # the rest as in x
    cond, un = net(x, t), net(torch.where(prompt_mask, MASK, x), t)
    assert not torch.allclose(cond[:3], un[:3])  # the prompt matters, so the test can tell the terms apart
    torch.testing.assert_close(guided, un + (W + 1) * (cond - un), rtol=0, atol=1e-5)
    assert guided.dtype == torch.float32
    assert torch.equal(guided[3], cond[3])  # a row without a prompt: the conditional logits exactly


def test_guidance_is_computed_in_float32_from_low_precision_logits():
    net = PromptAwareNet()
    prompt, prompt_mask = _prompt()
    x = torch.where(prompt_mask, prompt, MASK)
    half = MaskedDenoiser(fn=lambda x, t: net(x, t).bfloat16(), mask_id=MASK)
    guided = guided_denoiser(half, prompt_mask, 6.0).fn(x, torch.ones(B))
    cond, un = (net(y, None).bfloat16().float() for y in (x, torch.where(prompt_mask, MASK, x)))
    assert guided.dtype == torch.float32
    torch.testing.assert_close(guided, un + 7.0 * (cond - un), rtol=0, atol=1e-5)  # bf16 arithmetic: off by ≈ 0.1


@pytest.mark.parametrize("name", SAMPLERS)
def test_guided_sampler_reads_the_guided_logits_and_spends_two_nfe_per_step(name):
    """With the same generator, the guided sampler = the unguided sampler on the formula's model with half the budget:
    same tokens and confidences at the positions every step reads; NFE = 2 × steps; the prompt is kept."""
    for nfe in (9, 16):
        net, ref_net = PromptAwareNet(), PromptAwareNet()
        out = _run(SAMPLERS[name](cfg_scale=W), net.view(), nfe)
        ref = _run(SAMPLERS[name](), reference_guided(ref_net, _prompt()[1], W), nfe // 2)
        torch.testing.assert_close(out.confidence, ref.confidence, rtol=1e-5, atol=1e-6)
        assert torch.equal(out.tokens, ref.tokens)
        assert out.nfe == 2 * ref.nfe == 2 * net.calls <= nfe  # each guided step: 1 call over 2B rows = 2 NFE
        assert ref_net.calls == 2 * net.calls and all(x.shape[0] == 2 * B for x in net.inputs)
        prompt, prompt_mask = _prompt()
        assert torch.equal(out.tokens[prompt_mask], prompt[prompt_mask])
        assert (out.tokens < V).all()


@pytest.mark.parametrize("name", SAMPLERS)
def test_scale_zero_is_the_unguided_sampler_bit_for_bit(name):
    for nfe in (5, 12):
        net, plain_net = PromptAwareNet(), PromptAwareNet()
        out = _run(SAMPLERS[name](cfg_scale=0.0), net.view(), nfe)
        plain = _run(SAMPLERS[name](), plain_net.view(), nfe)
        assert torch.equal(out.tokens, plain.tokens) and torch.equal(out.confidence, plain.confidence)
        assert out.nfe == plain.nfe == net.calls == plain_net.calls
        # one call per step, of B rows; the ancestral sampler's of the rows that need it (each row's own NFE)
        rows = [x.shape[0] for x in net.inputs]
        assert sum(rows) == (int(plain.row_nfe.sum()) if name.startswith("ancestral") else B * len(rows)), rows
    view = PromptAwareNet().view()
    assert guided_denoiser(view, _prompt()[1], 0.0) is view


@pytest.mark.parametrize(
    ("sampler", "nfe"),
    [
        (AncestralSampler(cfg_scale=1.0), 1),
        (ConfidenceSampler(cfg_scale=1.0), 1),
        (SemiARConfidenceSampler(block_length=3, cfg_scale=1.0), 1),
        (SemiARConfidenceSampler(block_length=3, cfg_scale=1.0), 7),  # 4 blocks × 2 NFE per step = 8
    ],
)
def test_a_budget_too_small_for_the_guided_schedule_is_refused_before_any_call(sampler, nfe):
    net = PromptAwareNet()
    with pytest.raises(ValueError, match="NFE budget"):
        _run(sampler, net.view(), nfe)
    assert net.calls == 0
    free = int((~_prompt()[1]).sum(-1).max())
    with pytest.raises(ValueError, match="NFE budget"):
        sampler.check_budget(nfe, free_positions=free)
    sampler.check_budget(16, free_positions=free)  # enough: accepted


@pytest.mark.parametrize("bad", [-0.5, float("nan"), float("inf"), "1"])
def test_a_bad_scale_is_refused(bad):
    for cls in (AncestralSampler, ConfidenceSampler):
        with pytest.raises(ValueError, match="cfg_scale"):
            cls(cfg_scale=bad)
    with pytest.raises(ValueError, match="cfg_scale"):
        SemiARConfidenceSampler(block_length=4, cfg_scale=bad)


def _llama(mask_inside: bool) -> BidirectionalLM:
    """A tiny random bidirectional Llama: SMDM's layout ([MASK] = the extra embedding row, no head row) or LLaDA's
    ([MASK] inside the vocabulary and the head; its logit −∞ for samplers)."""
    torch.manual_seed(0)
    rows = V + 1
    model = BidirectionalLM(
        embed_rows=rows,
        head_rows=rows if mask_inside else V,
        mask_id=V,
        hidden_size=16,
        n_layers=1,
        n_heads=2,
        intermediate_size=32,
        max_positions=64,
    )
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return model.eval()


@pytest.mark.parametrize("mask_inside", [False, True], ids=["smdm_layout", "mask_inside_vocab"])
def test_llama_family_denoiser(mask_inside):
    model = _llama(mask_inside)
    prompt, prompt_mask = _prompt()
    x = torch.where(prompt_mask, prompt, MASK)
    t = torch.ones(B)
    with torch.no_grad():
        view = model.denoiser()
        guided = guided_denoiser(view, prompt_mask, W).fn(x, t)
        cond, un = view.fn(x, t), view.fn(torch.where(prompt_mask, MASK, x), t)
        expected = un + (W + 1) * (cond - un)
        assert not torch.isnan(guided).any()
        if mask_inside:  # the [MASK] logit stays −∞, not NaN (−∞ − −∞)
            assert guided.shape[-1] == V + 1 and (guided[..., MASK] == -torch.inf).all()
            expected = expected[..., :V]
        torch.testing.assert_close(guided[..., :V], expected, rtol=0, atol=1e-4)
        for sampler in (
            ConfidenceSampler(cfg_scale=W),
            SemiARConfidenceSampler(block_length=4, temperature=1.0, cfg_scale=W),
            AncestralSampler(cfg_scale=W),
        ):
            out = sampler(
                view, prompt=prompt, prompt_mask=prompt_mask, nfe=8, generator=torch.Generator().manual_seed(0)
            )
            assert torch.equal(out.tokens[prompt_mask], prompt[prompt_mask]) and (out.tokens < V).all()
            assert out.nfe <= 8 and out.nfe % 2 == 0


def test_a_shifted_logits_model_refuses_guidance_before_the_network_runs():
    """Dream predicts nothing at position 0, which the unconditional branch would mask: refused by its denoiser."""
    model = _llama(mask_inside=True)
    model.shift_logits = True
    prompt, prompt_mask = _prompt((3, 3, 3, 3))
    with pytest.raises(ValueError, match="position 0"), torch.no_grad():
        ConfidenceSampler(cfg_scale=W)(model.denoiser(), prompt=prompt, prompt_mask=prompt_mask, nfe=4)
