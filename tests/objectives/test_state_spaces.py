"""Flow states carried projected, h = x·E (the embedding space), against the one-hot states x the network projects.

The embedding space is exact in law: its noise z·R (RᵀR = EᵀE) is N(0, EᵀE), the law of ε·E; everything else a
sampler builds is linear in the state. So (i) the noise has covariance EᵀE, (ii) fed the same h both ways, the
samplers make the same calls, drafts and commits, and (iii) the automatic choice takes the one-hot space where
|V| ≤ d (Sudoku), bit for bit the released draws.
"""

from __future__ import annotations

import functools

import pytest
import torch

from flowlm.processes.gaussian_flow import EmbeddingSpace, OneHotSpace, choose_space
from flowlm.samplers import BlockFlowSampler, FlowMapSampler, PosteriorRefinementSampler
from flowlm.samplers.base import FlowDenoiser
from lightning_modules.fmlm_plus import FMLMPlusModule

V, D, L, B = 40, 16, 10, 6


def test_embedding_noise_has_covariance_gram():
    """z·R over 200 000 draws: the empirical covariance matches EᵀE to 2 % of its largest entry (the standard error
    of each entry is about √(2/n) ≈ 0.3 % of it), and the mean is 0; a factor off by a transpose or a scale fails."""
    gen = torch.Generator().manual_seed(0)
    e = torch.randn(V, 4, generator=gen) * torch.tensor([1.0, 0.5, 2.0, 0.1]) + 0.3  # anisotropic, correlated
    space = EmbeddingSpace(e)
    h = space.noise((2000, 100), torch.Generator().manual_seed(1), "cpu").double().reshape(-1, 4)
    gram = e.double().T @ e.double()
    cov = h.T @ h / h.shape[0]
    assert (cov - gram).abs().max() <= 0.02 * gram.abs().max(), (cov, gram)
    assert h.mean(0).abs().max() <= 0.02 * gram.diagonal().sqrt().max()
    assert torch.allclose(space.factor.T @ space.factor, gram, rtol=1e-10, atol=1e-10)


def test_embedding_space_data_and_lift_are_the_projection():
    """E[y] = onehot(y)·E exactly; δ·E is the projection of a simplex point."""
    gen = torch.Generator().manual_seed(2)
    e = torch.randn(V, D, generator=gen)
    space, onehot = EmbeddingSpace(e), OneHotSpace(V)
    tokens = torch.randint(0, V, (B, L), generator=gen)
    assert torch.equal(space.data(tokens), onehot.data(tokens) @ e)
    probs = torch.softmax(torch.randn(B, L, V, generator=gen), -1)
    assert torch.allclose(space.lift(probs), probs @ e, atol=1e-6)
    assert torch.equal(onehot.lift(probs), probs)


def test_automatic_choice_by_shape():
    """auto: the embedding space only when |V| > d; onehot/embedding force one; anything else is refused."""
    wide, narrow = torch.randn(D, V), torch.randn(V, D)  # |V| ≤ d (Sudoku-like) and |V| > d (text-like)
    assert isinstance(choose_space("auto", wide), OneHotSpace)
    assert isinstance(choose_space("auto", narrow), EmbeddingSpace)
    assert isinstance(choose_space("auto", torch.randn(D, D)), OneHotSpace)  # |V| = d: no saving, keep the draws
    assert isinstance(choose_space("onehot", narrow), OneHotSpace)
    assert isinstance(choose_space("embedding", narrow), EmbeddingSpace)
    with pytest.raises(ValueError, match="state_space"):
        choose_space("projected", narrow)
    with pytest.raises(ValueError, match="|V| ≥ d"):
        EmbeddingSpace(wide)


class ProjectedOneHot(EmbeddingSpace):
    """The embedding space fed the one-hot space's own noise, projected: ε·E from the same float64 draw."""

    def noise(self, shape, generator, device):  # noqa: D102
        return OneHotSpace(self.vocab_size).noise(shape, generator, device) @ self.embeddings


def flow_module(**kwargs) -> FMLMPlusModule:
    """An untrained FMLM+ with |V| = 40 > d = 16 (its zero-initialised output layer given small random weights)."""
    torch.manual_seed(3)
    backbone = {"d_model": D, "n_layers": 2, "n_heads": 2, "cond_dim": 16}
    module = FMLMPlusModule(data_vocab_size=V, seq_len=L, backbone=backbone, optim={"lr": 1e-3}, **kwargs).eval()
    with torch.no_grad():
        for p in module.parameters():
            if not p.any():
                p.normal_(0, 0.5)
    return module


def recorded(fn, calls: list):
    """fn, recording its state input."""

    def call(x, *args, **kwargs):
        calls.append(x.clone())
        return fn(x, *args, **kwargs)

    return call


SAMPLERS = [
    ("pr", PosteriorRefinementSampler(rounds=3, threshold=0.5), 3),
    ("pr_n2", PosteriorRefinementSampler(rounds=2, flow_steps=2, threshold=0.5), 4),
    ("pr_reuse_t1", PosteriorRefinementSampler(rounds=3, noise="reuse", temperature=1.0), 3),
    ("a_priori", PosteriorRefinementSampler(rounds=3, confidence="a_priori"), 3),
    ("flow_map", FlowMapSampler(), 3),
    ("flm_euler", FlowMapSampler(euler=True), 2),
    ("block", BlockFlowSampler(block_size=4, steps_per_block=2), 4),
]


@pytest.mark.parametrize(("name", "sampler", "nfe"), SAMPLERS, ids=[s[0] for s in SAMPLERS])
def test_same_states_both_ways(name, sampler, nfe):
    """Fed the same h, the embedding path makes the same network calls (its states are the one-hot path's x·E, to
    float rounding where a flow-map jump lifts δ·E), and the same drafts, commits and tokens; the one-hot path's
    network projects x itself, the embedding path's never does."""
    module = flow_module()
    e = module.net.embed.weight.detach()
    prompt = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(4))
    prompt_mask = torch.zeros(B, L, dtype=torch.bool)
    prompt_mask[:, :3] = True
    x_calls, h_calls = [], []
    direct = FlowDenoiser(fn=recorded(module, x_calls), vocab_size=V, pinned_fn=recorded(module, x_calls))
    embedded = module.denoiser("embedding")
    assert embedded.states.embedded
    projected = FlowDenoiser(
        fn=recorded(embedded.fn, h_calls),
        vocab_size=V,
        pinned_fn=recorded(embedded.pinned_fn, h_calls),
        space=ProjectedOneHot(e),
    )
    projections = []
    original = module.net.input_embeddings
    module.net.input_embeddings = lambda x: projections.append(x.shape) or original(x)
    with torch.no_grad():
        a = sampler(direct, prompt=prompt, prompt_mask=prompt_mask, nfe=nfe, generator=torch.Generator().manual_seed(5))
        n_direct = len(projections)
        b = sampler(
            projected, prompt=prompt, prompt_mask=prompt_mask, nfe=nfe, generator=torch.Generator().manual_seed(5)
        )
    assert n_direct == nfe and len(projections) == n_direct  # the embedding path adds no input projection
    assert a.nfe == b.nfe == nfe and len(x_calls) == len(h_calls) == nfe
    for x, h in zip(x_calls, h_calls, strict=True):
        assert h.shape == (B, L, D)
        assert torch.allclose(x @ e, h, rtol=1e-5, atol=1e-5)
    assert torch.equal(a.tokens, b.tokens)
    assert torch.allclose(a.confidence, b.confidence, rtol=1e-5, atol=1e-6)


def test_module_state_space_option():
    """The module chooses once (``state_space``): auto = embedding at |V| > d; onehot keeps the released draws
    (its denoiser reads x over the vocabulary); the embedding factor is reused until the weights change."""
    auto = flow_module()
    assert auto.denoiser().states.embedded and auto.view.states() is auto.view.states()
    factor = auto.view.states().factor
    with torch.no_grad():
        auto.net.embed.weight.mul_(2.0)  # an optimiser step: the values (and the tensor version) change
    assert torch.allclose(auto.view.states().factor, 2 * factor, rtol=1e-6)
    onehot = flow_module(state_space="onehot")
    assert not onehot.denoiser().states.embedded and not onehot.denoiser("onehot").space.embedded
    with pytest.raises(ValueError, match="state_space"):
        flow_module(state_space="projected")
    prompt = torch.zeros(2, L, dtype=torch.long)
    mask = torch.zeros(2, L, dtype=torch.bool)
    for module in (auto, onehot):  # both run end to end through the public API
        with torch.no_grad():
            out = PosteriorRefinementSampler(rounds=2)(
                module.denoiser(), prompt=prompt, prompt_mask=mask, nfe=2, generator=torch.Generator().manual_seed(0)
            )
        assert out.nfe == 2 and out.tokens.shape == (2, L) and bool(((out.tokens >= 0) & (out.tokens < V)).all())


def test_inference_log_delta_in_place_equals_log_delta():
    """Without autograd the module computes log δ in place (one buffer): the same values as ``log_delta`` to float
    rounding, on float32 and bf16 logits, leaving bf16 inputs untouched; with autograd it is ``log_delta`` itself."""
    from flowlm.objectives.flow import log_delta, log_delta_

    x = torch.randn(3, 5, 70, generator=torch.Generator().manual_seed(6)) * 40
    assert torch.allclose(log_delta_(x.clone()), log_delta(x), atol=2e-5, rtol=0)
    xb = x.bfloat16()
    assert torch.allclose(log_delta_(xb), log_delta(xb), atol=2e-5, rtol=0) and torch.equal(xb, x.bfloat16())
    module = flow_module()
    h = torch.randn(2, L, D)
    s = torch.zeros(2)
    with torch.no_grad():
        fast = module(h, s, s, embedded=True)
    slow = module(h, s, s, embedded=True)
    assert slow.requires_grad and torch.allclose(fast, slow.detach(), atol=2e-5, rtol=0)


def training_draws(module, k: int, batch: dict):
    """One training step's draws as ``training_step`` makes them (pair kinds on the host, times, context rates)."""
    b = batch["tokens"].shape[0]
    kinds, s, t = module.sample_pairs(b, k)
    return kinds, s, t, module.sample_context_rates(b, k).float(), torch.Generator().manual_seed(100 + k)


def loss_and_gradient(module, batch: dict, steps: int):
    """The FMLM+ loss and its gradient with respect to E over ``steps`` independent draws: (K,) and (K, |V|, d)."""
    losses, grads = [], []
    for k in range(steps):
        kinds, s, t, rates, gen = training_draws(module, k, batch)
        module.zero_grad(set_to_none=True)
        loss = module.loss(batch, module.draws_at(batch, kinds, s, t, gen, rates=rates)).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append(module.net.embed.weight.grad.clone())
    return torch.stack(losses).double(), torch.stack(grads).double()


def test_training_loss_and_gradient_agree_in_law():
    """Over 150 draws of the same batches, times and context sets, the FMLM+ loss and its gradient with respect to
    the embedding E agree between the one-hot states (ε·E inside the network) and the embedding states (z·R, R
    differentiable in E): the mean losses within 4 standard errors of their difference, and the mean gradients
    entry by entry with a mean squared z-score ≤ 1.6 (measured 1.16; a factor R detached from E or transposed gives
    ≈ 6)."""
    onehot, embedded = flow_module(state_space="onehot").train(), flow_module(state_space="embedding").train()
    embedded.load_state_dict(onehot.state_dict())
    assert not onehot.view.training_process().embedded and embedded.view.training_process().embedded
    gen = torch.Generator().manual_seed(8)
    batch = {"tokens": torch.randint(0, V, (16, L), generator=gen), "prompt_mask": torch.zeros(16, L, dtype=torch.bool)}
    batch["prompt_mask"][:, :2] = True
    (la, ga), (lb, gb) = (loss_and_gradient(m, batch, 150) for m in (onehot, embedded))
    n = la.shape[0]
    se = ((la.var() + lb.var()) / n).sqrt()
    assert (la.mean() - lb.mean()).abs() <= 4 * se, (la.mean(), lb.mean(), se)
    z = (ga.mean(0) - gb.mean(0)) / ((ga.var(0) + gb.var(0)) / n).sqrt().clamp_min(1e-12)
    assert (z**2).mean() <= 1.6, (z**2).mean()
    assert ga.abs().sum() > 0 and gb.abs().sum() > 0


class ProjectingSpace(EmbeddingSpace):
    """The embedding space fed the one-hot path's own draws: ``project`` maps ε (…, |V|) to ε·E."""

    def project(self, z):  # noqa: D102
        return z @ self.embeddings


def test_training_path_is_the_projection_of_the_one_hot_path():
    """Fed ε·E for the same ε, the embedding path's FMLM+ loss (student, both teacher passes with the flow map's
    δ·E, every pair kind) and its gradients equal the one-hot path's to float rounding."""
    from flowlm.objectives.fmlm_plus import fmlm_plus_loss
    from flowlm.processes.gaussian_flow import GaussianFlowProcess

    module = flow_module().train()
    gen = torch.Generator().manual_seed(9)
    b = 8
    tokens = torch.randint(0, V, (b, L), generator=gen)
    prompt = torch.zeros(b, L, dtype=torch.bool)
    prompt[:, :2] = True
    context = (torch.rand(b, L, generator=gen) < 0.3) & ~prompt
    kinds = torch.tensor([0, 1, 2, 2, 0, 1, 2, 0])  # diagonal, boundary, off-diagonal
    s = torch.tensor([0.3, 0.0, 0.1, 0.4, 0.7, 0.0, 0.2, 0.05])
    t = torch.where(kinds == 0, s, torch.where(kinds == 1, 1.0, s + 0.3))
    eps = torch.randn(b, L, V, generator=gen)
    results = []
    for embedded in (False, True):
        module.zero_grad(set_to_none=True)
        if embedded:
            process = GaussianFlowProcess(vocab_size=V, space=ProjectingSpace(module.net.embed.weight))
            student = functools.partial(module, embedded=True)
            teacher = functools.partial(module.teacher_pass, embedded=True)
        else:
            process, student, teacher = module.view.process, module, module.teacher_pass
        out = fmlm_plus_loss(
            student, tokens, prompt, kinds, s, t, context=context, noise=eps, process=process, teacher=teacher
        )
        out.loss.backward()
        results.append((out.loss.detach(), {n: q.grad.clone() for n, q in module.named_parameters()}))
    (la, ga), (lb, gb) = results
    assert torch.allclose(la, lb, rtol=1e-5, atol=1e-6), (la, lb)
    for name in ga:
        assert torch.allclose(ga[name], gb[name], rtol=1e-4, atol=1e-6), name
