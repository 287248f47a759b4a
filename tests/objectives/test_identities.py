"""Identities the modules and samplers must keep (issue 14), checked against hand computations:

- the MDM module's ELBO wiring: Σ_masked (1/t)·CE / #non-prompt tokens (methods.md §2), from the module's own masks;
- the ancestral sampler: unmask probability (t − s)/t per step under α_t = 1 − t, tokens drawn ∝ p_θ (statistical);
- float64 draws (methods.md §9): Gumbel-max uniforms of ``gumbel_argmax`` / ``pick_tokens`` and the ancestral and
  confidence samplers that use them; Posterior Refinement's fresh Gaussian noise.

Statistical tests use fixed seeds; each states its tolerance (≈ 4–5 standard errors, chi-square at p ≈ 1e-4).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flowlm.ops.draws import gumbel_argmax, pick_tokens
from flowlm.processes.gaussian_flow import OneHotSpace
from flowlm.samplers import AncestralSampler, MaskedDenoiser, PosteriorRefinementSampler
from flowlm.samplers.base import FlowDenoiser
from lightning_modules.mdm import MDMModule
from tests.samplers.oracles import FullDrawAncestral, FullDrawConfidence

BACKBONE = {"d_model": 16, "n_layers": 1, "n_heads": 2, "cond_dim": 16}


# -------------------------------------------------------------------------------------- MDM module: 1/t ELBO
def _mdm(v: int, length: int, seed: int = 0, **kwargs) -> MDMModule:
    torch.manual_seed(seed)
    module = MDMModule(data_vocab_size=v, seq_len=length, backbone=BACKBONE, optim={}, **kwargs)
    with torch.no_grad():
        for p in module.parameters():  # non-uniform output, so CE differs across tokens and positions
            torch.nn.init.normal_(p, std=0.3)
    return module


def _hand_elbo(logits, tokens, masked, t, denominator_mask, v):
    """Σ_masked (1/t_b)·(−log softmax(logits[:V])[y]) / #denominator tokens, in float64."""
    log_p = F.log_softmax(logits.double()[..., :v], -1)
    nll = -log_p.gather(-1, tokens[..., None]).squeeze(-1)
    return (torch.where(masked, nll, 0.0) / t.double()[:, None]).sum() / denominator_mask.sum()


def test_mdm_loss_weights_the_masked_cross_entropy_by_one_over_t():
    """The MDM loss with given mask uniforms u: masks are u < t off the prompt (1 − α_t = t), and the loss is the
    1/t-weighted CE over masked tokens / #non-prompt tokens (weight 1 or t would be off by a factor ≥ 2 here)."""
    v, length, b = 5, 10, 6
    module = _mdm(v, length)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, v, (b, length), generator=gen)
    prompt = torch.zeros(b, length, dtype=torch.bool)
    prompt[:, :3] = True
    t = torch.tensor([0.05, 0.2, 0.4, 0.6, 0.8, 0.97])
    u = torch.rand(b, length, generator=gen)
    loss = module.loss({"tokens": tokens, "prompt_mask": prompt}, {"t": t, "u": u}).loss
    masked = (u < t[:, None]) & ~prompt
    with torch.no_grad():
        logits = module(torch.where(masked, module.mask_id, tokens), t)
    reference = _hand_elbo(logits, tokens, masked, t, ~prompt, v)
    torch.testing.assert_close(loss.double(), reference, rtol=1e-5, atol=0)
    unweighted = _hand_elbo(logits, tokens, masked, torch.ones_like(t), ~prompt, v)
    weighted_t = _hand_elbo(logits, tokens, masked, 1 / t, ~prompt, v)
    assert min(abs(reference / unweighted - 1), abs(reference / weighted_t - 1)) > 0.5

    # text data: PAD positions (loss_mask False) leave the numerator and the denominator
    loss_mask = ~prompt
    loss_mask[:, -2:] = False
    loss_pad = module.loss({"tokens": tokens, "prompt_mask": prompt, "loss_mask": loss_mask}, {"t": t, "u": u}).loss
    torch.testing.assert_close(
        loss_pad.double(), _hand_elbo(logits, tokens, masked & loss_mask, t, loss_mask, v), rtol=1e-5, atol=0
    )


@pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")
def test_mdm_training_step_is_the_one_over_t_elbo_of_its_own_draws():
    """training_step end to end (its own stratified t and masks, observed at the network call): the returned loss
    is Σ_masked (1/t)·CE / #non-prompt tokens for exactly the masks and times the network saw."""
    v, length, b = 4, 12, 8
    module = _mdm(v, length, seed=2, time_conditioning=True)
    tokens = torch.randint(0, v, (b, length), generator=torch.Generator().manual_seed(3))
    prompt = torch.zeros(b, length, dtype=torch.bool)
    prompt[:, :2] = True
    seen, forward = [], module.forward

    def spy(x, t):
        seen.append((x.clone(), t.clone()))
        return forward(x, t)

    module.forward = spy
    loss = module.training_step({"tokens": tokens, "prompt_mask": prompt}, batch_idx=0)
    ((x_t, t),) = seen
    masked = x_t == module.mask_id
    assert not masked[prompt].any() and torch.equal(x_t[~masked], tokens[~masked])
    assert t.min() < 0.2 and t.max() > 0.8  # stratified over the batch: weights 1/t span a factor > 4
    with torch.no_grad():
        logits = forward(x_t, t)
    reference = _hand_elbo(logits, tokens, masked, t, ~prompt, v)
    torch.testing.assert_close(loss.detach().double(), reference, rtol=1e-5, atol=0)
    for wrong in (torch.ones_like(t), 1 / t):
        assert abs(_hand_elbo(logits, tokens, masked, wrong, ~prompt, v) / reference - 1) > 0.3


# --------------------------------------------------------------------------------------- ancestral sampler
V3, MASK3 = 3, 3
LAWS = torch.tensor([[0.6, 0.3, 0.1], [0.1, 0.2, 0.7]], dtype=torch.float64)  # even / odd positions


class FixedLaw:
    """A time-conditioned stub MDM whose p_θ is a fixed known law per position (even, odd), whatever the input:
    it is called at every step (no cache) on the whole batch (``rows_alone=False``: not only the rows still masked),
    so each step's input shows which tokens the step unmasked."""

    def __init__(self, length: int):
        self.logits = (LAWS.log().float() + 4.0)[torch.arange(length) % 2]  # unnormalised: the sampler normalises
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, x, t):
        self.calls.append((x.clone(), t.clone()))
        return self.logits.expand(x.shape[0], -1, -1)

    def view(self) -> MaskedDenoiser:
        return MaskedDenoiser(fn=self, mask_id=MASK3, time_conditioned=True, rows_alone=False)


def test_ancestral_unmasks_with_probability_t_minus_s_over_t_and_draws_from_p():
    """N = 4 steps on the grid t_k = 1 − k/N: among the tokens still masked at step k a share (t−s)/t = 1/(N−k)
    unmasks (1/4, 1/3, 1/2, 1); the network is called at t_k; the drawn tokens follow p_θ per position (chi-square,
    2 dof, bound 18.4 ≈ p 1e-4) and each token's confidence is its probability. 18 000 free tokens; unmask shares
    within 4.5 SE."""
    b, length, n_prompt, nfe = 2000, 11, 2, 4
    net = FixedLaw(length)
    prompt = torch.randint(0, V3, (b, length), generator=torch.Generator().manual_seed(4))
    prompt_mask = torch.zeros(b, length, dtype=torch.bool)
    prompt_mask[:, :n_prompt] = True
    out = AncestralSampler()(
        net.view(), prompt=prompt, prompt_mask=prompt_mask, nfe=nfe, generator=torch.Generator().manual_seed(5)
    )
    assert out.nfe == len(net.calls) == nfe
    masked = [(x == MASK3) for x, _ in net.calls] + [out.tokens == MASK3]
    for k in range(nfe):
        t, s = 1 - k / nfe, 1 - (k + 1) / nfe
        assert torch.allclose(net.calls[k][1], torch.full((b,), t))
        before, after = masked[k].sum().item(), masked[k + 1].sum().item()
        assert (masked[k + 1] <= masked[k]).all()
        share, p = (before - after) / before, (t - s) / t
        tol = 4.5 * (p * (1 - p) / before) ** 0.5 + 1e-12
        assert abs(share - p) <= tol, (k, share, p, tol)
    assert torch.equal(out.tokens[prompt_mask], prompt[prompt_mask])
    free = ~prompt_mask
    parity = torch.arange(length).expand(b, -1) % 2
    for law_idx in (0, 1):
        drawn = out.tokens[free & (parity == law_idx)]
        counts = torch.bincount(drawn, minlength=V3).double()
        expected = LAWS[law_idx] * drawn.numel()
        chi2 = ((counts - expected) ** 2 / expected).sum().item()
        assert chi2 < 18.4, (law_idx, counts.tolist(), expected.tolist(), chi2)
    conf = out.confidence[free].double()
    torch.testing.assert_close(conf, LAWS[parity[free], out.tokens[free]], rtol=1e-5, atol=0)


def test_ancestral_temperature_draws_from_p_to_the_one_over_temperature():
    """At temperature 1/2 the law is ∝ p² per position (a temperature ignored, or applied as T·log p, fails the
    chi-square by two orders of magnitude)."""
    b, length = 1500, 8
    net = FixedLaw(length)
    prompt = torch.zeros(b, length, dtype=torch.long)
    prompt_mask = torch.zeros(b, length, dtype=torch.bool)
    out = AncestralSampler(temperature=0.5)(
        net.view(), prompt=prompt, prompt_mask=prompt_mask, nfe=2, generator=torch.Generator().manual_seed(6)
    )
    parity = torch.arange(length).expand(b, -1) % 2
    for law_idx in (0, 1):
        law = LAWS[law_idx] ** 2 / (LAWS[law_idx] ** 2).sum()
        drawn = out.tokens[parity == law_idx]
        counts = torch.bincount(drawn, minlength=V3).double()
        expected = law * drawn.numel()
        chi2 = ((counts - expected) ** 2 / expected).sum().item()
        assert chi2 < 18.4, (law_idx, counts.tolist(), expected.tolist(), chi2)


# ------------------------------------------------------------------------------------------ float64 draws
def _hand_gumbel(log_probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Gumbel-max by hand in float64: argmax(log p − log(−log u))."""
    return (log_probs.double() - (-uniforms.double().log()).log()).argmax(-1)


def test_gumbel_argmax_and_pick_tokens_draw_float64_uniforms():
    """With a generator, the draw equals a float64 Gumbel-max on torch.rand(..., float64) from the same generator
    state (a float32 draw reads other numbers from the stream and picks other tokens), consumes exactly that
    draw, and equals the draw with those uniforms passed in; temperature T scales log p by 1/T; temperature 0 is
    the argmax and draws nothing."""
    gen = torch.Generator().manual_seed(7)
    log_p = torch.log_softmax(torch.randn(64, 9, 5, generator=gen, dtype=torch.float64), -1)
    log_p[..., 0] = -40.0  # a rare token: float32 uniforms never reach it, float64 ones hardly
    for temperature in (1.0, 0.7):
        scaled = log_p / temperature
        ref_gen = torch.Generator().manual_seed(8)
        uniforms = torch.rand(log_p.shape, generator=ref_gen, dtype=torch.float64)
        after = torch.rand(3, generator=ref_gen)  # what the stream yields next
        hand = _hand_gumbel(scaled, uniforms)
        g = torch.Generator().manual_seed(8)
        drawn = pick_tokens(log_p, temperature, g)
        assert torch.equal(drawn, hand)
        assert torch.equal(torch.rand(3, generator=g), after)  # exactly one (…, V) float64 draw consumed
        assert torch.equal(pick_tokens(log_p, temperature, None, uniforms=uniforms), hand)
        if temperature == 1.0:
            assert torch.equal(gumbel_argmax(log_p, torch.Generator().manual_seed(8)), hand)
            assert torch.equal(gumbel_argmax(log_p, None, uniforms=uniforms), hand)
        # the float32 stream draws other numbers: the test tells the two apart
        u32 = torch.rand(log_p.shape, generator=torch.Generator().manual_seed(8))
        assert not torch.equal(_hand_gumbel(scaled, u32), hand)
    g = torch.Generator().manual_seed(9)
    state = g.get_state()
    assert torch.equal(pick_tokens(log_p, 0.0, g), log_p.argmax(-1))
    assert torch.equal(g.get_state(), state)


def _all_masked(b: int, length: int, n_prompt: int, v: int):
    prompt = torch.randint(0, v, (b, length), generator=torch.Generator().manual_seed(10))
    prompt_mask = torch.zeros(b, length, dtype=torch.bool)
    prompt_mask[:, :n_prompt] = True
    return prompt, prompt_mask


class RandomLogits:
    """A stub MDM with fixed random logits per (sequence, position): every draw is visible in the output."""

    def __init__(self, b: int, length: int, v: int):
        self.logits = 3 * torch.randn(b, length, v, generator=torch.Generator().manual_seed(11))
        self.v = v

    def __call__(self, x, t):
        return self.logits

    def view(self) -> MaskedDenoiser:
        return MaskedDenoiser(fn=self, mask_id=self.v)


def test_ancestral_and_confidence_samplers_draw_through_float64_gumbel_max():
    """One step (nfe = 1) decodes every masked token: in the earlier whole-tensor stream (the oracles of
    tests/samplers/oracles.py) the ancestral sampler's tokens equal a hand float64 Gumbel-max of log_softmax(logits)
    on the stream's first (B, L, V) float64 uniforms (its unmask coins come after them), and so do the confidence
    sampler's at temperature 1. (The samplers draw at the committing positions only, in the same law:
    tests/samplers/test_committed_draws.py.)"""
    b, length, v = 16, 9, 6
    net = RandomLogits(b, length, v)
    prompt, prompt_mask = _all_masked(b, length, 3, v)
    uniforms = torch.rand((b, length, v), generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    hand = _hand_gumbel(torch.log_softmax(net.logits.double(), -1), uniforms)
    free = ~prompt_mask
    for sampler in (FullDrawAncestral(), FullDrawConfidence(temperature=1.0)):
        out = sampler(
            net.view(), prompt=prompt, prompt_mask=prompt_mask, nfe=1, generator=torch.Generator().manual_seed(12)
        )
        assert torch.equal(out.tokens[free], hand[free]), type(sampler).__name__
        assert torch.equal(out.tokens[prompt_mask], prompt[prompt_mask])
    u32 = torch.rand((b, length, v), generator=torch.Generator().manual_seed(12))
    assert not torch.equal(_hand_gumbel(torch.log_softmax(net.logits.double(), -1), u32)[free], hand[free])


def test_posterior_refinement_noise_is_drawn_in_float64():
    """PR's fresh noise (the one-hot space) is torch.randn(..., float64) cast to float32, drawn from the sampler's
    generator: directly (``OneHotSpace.noise``) and as the first round's input on every uncommitted position."""
    shape, v = (4, 7), 5
    noise = OneHotSpace(v).noise(shape, torch.Generator().manual_seed(13), "cpu")
    ref = torch.randn((*shape, v), generator=torch.Generator().manual_seed(13), dtype=torch.float64).float()
    assert noise.dtype == torch.float32 and torch.equal(noise, ref)
    assert not torch.equal(ref, torch.randn((*shape, v), generator=torch.Generator().manual_seed(13)))

    calls = []

    def flow(x, s, t):
        calls.append(x.clone())
        return torch.log_softmax(x * 2.0, -1)

    prompt = torch.randint(0, v, shape, generator=torch.Generator().manual_seed(14))
    prompt_mask = torch.zeros(shape, dtype=torch.bool)
    prompt_mask[:, :2] = True
    PosteriorRefinementSampler(rounds=1)(
        FlowDenoiser(fn=flow, vocab_size=v),
        prompt=prompt,
        prompt_mask=prompt_mask,
        nfe=1,
        generator=torch.Generator().manual_seed(13),
    )
    (x,) = calls
    assert torch.equal(x[~prompt_mask], ref[~prompt_mask])
    assert torch.equal(x[prompt_mask], F.one_hot(prompt, v).float()[prompt_mask])
