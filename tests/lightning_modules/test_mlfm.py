"""MLFM (methods.md §6): Brownian bridge, MDM adapter, objective, CCFG/OTP sampler, bad input."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flowlm.backbones.adapters import MLFMAdapter
from flowlm.backbones.dit import build_dit
from flowlm.processes.bridge import BridgeProcess, cosine_mask_prob, gamma_of_t, t_of_gamma
from flowlm.samplers.mlfm import BridgeDenoiser, MLFMSampler
from lightning_modules.mdm import MDMModule
from lightning_modules.mlfm import MLFMModule

V, L, BB = 6, 12, {"size": "tiny", "n_layers": 2, "d_model": 32, "n_heads": 2, "cond_dim": 16}


def random_mdm(seed: int = 0) -> MDMModule:
    """An MDM with every weight random (zero-initialised modulations and head included), so nothing is trivial."""
    torch.manual_seed(seed)
    mdm = MDMModule(data_vocab_size=V, seq_len=L, backbone=BB, optim={})
    for p in mdm.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return mdm


def adapted(mdm: MDMModule, **adapter) -> MLFMModule:
    module = MLFMModule(
        data_vocab_size=V, seq_len=L, backbone=BB, optim={}, init_from="mdm.ckpt", adapter={"lora_rank": 4, **adapter}
    )
    module.init_report = module._copy_mdm(module.net, mdm.state_dict())
    return module


def perturb_adapter(module: MLFMModule) -> None:
    """Give every zero-initialised adapter part a value, as training would."""
    for p in module.net.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.2)


# ------------------------------------------------------------------------------------------------------ bridge
def test_bridge_marginal_endpoints_mean_and_variance():
    bridge = BridgeProcess(sigma=0.2)
    m, e_y = torch.randn(8), torch.randn(3, 5, 8)
    noised = torch.rand(3, 5) < 0.5
    noised[0, 0], noised[0, 1] = True, False
    for t_val, mean_expected in ((0.0, m.expand(3, 5, 8)), (1.0, e_y)):
        z = bridge.sample(m, e_y, torch.full((3,), t_val), noised, torch.Generator().manual_seed(0))
        torch.testing.assert_close(z[noised], mean_expected[noised])  # variance σ²t(1−t) vanishes
    # Unmasked positions hold E_y exactly at every t.
    z = bridge.sample(m, e_y, torch.full((3,), 0.4), noised, torch.Generator().manual_seed(1))
    assert torch.equal(z[~noised], e_y[~noised])
    # Mean (1 − t)·m + t·E_y and variance σ²·t(1 − t), from many draws at t = 0.3.
    n, t = 200_000, 0.3
    y = torch.randn(1, 1, 8).expand(n, 1, 8)
    draws = bridge.sample(m, y, torch.full((n,), t), torch.ones(n, 1, dtype=torch.bool), torch.Generator())
    torch.testing.assert_close(draws.mean(0)[0], (1 - t) * m + t * y[0, 0], atol=5e-3, rtol=0)
    assert draws.var(0).mean().item() == pytest.approx(0.04 * t * (1 - t), rel=0.02)


def test_gamma_time_maps_and_training_distributions():
    t = torch.tensor([1e-4, 0.1, 0.5, 0.9, 0.9999], dtype=torch.float64)
    torch.testing.assert_close(t_of_gamma(gamma_of_t(t, 0.2), 0.2), t)
    for dist in ("uniform", "gamma_uniform", "gamma_mixture"):
        bridge = BridgeProcess(time_dist=dist)
        draws = bridge.sample_t(20_000, generator=torch.Generator().manual_seed(0))
        assert draws.min() >= bridge.t_min and draws.max() <= 1 - bridge.t_min
        grid = bridge.t_quantiles(16)
        assert grid[0] == 0 and grid[-1] == 1 and torch.all(grid[1:] > grid[:-1])
        # The grid sits at the training distribution's quantiles: ≈ 1/16 of the draws between neighbours.
        # (Draws are clipped to [t_min, 1 − t_min]; grid points beyond that see the clipped mass.)
        inner = grid[1:-1].float()
        keep = (inner > bridge.t_min) & (inner < 1 - bridge.t_min)
        frac = (draws[:, None] <= inner).float().mean(0)
        torch.testing.assert_close(frac[keep], (torch.arange(1, 16) / 16)[keep], atol=0.02, rtol=0)
        assert keep.sum() >= 12
    mixture = BridgeProcess(time_dist="gamma_mixture")
    gammas = mixture.gamma_quantile(torch.rand(50_000, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    # 90 % of the mass is N(−2.5, 2²): the median sits near −2.5, everything in [−10, 6].
    assert gammas.median().item() == pytest.approx(-2.5, abs=0.15)
    assert gammas.min() >= -10 and gammas.max() <= 6
    cond = BridgeProcess(condition_on="gamma").condition(torch.tensor([t_of_gamma(torch.tensor(-10.0), 0.2), 0.5]))
    assert cond[0].item() == pytest.approx(0.0, abs=1e-5) and 0 < cond[1] < 1


def test_ddpm_step_is_the_bridge_to_the_endpoint():
    bridge = BridgeProcess(sigma=0.2)
    z, x1 = torch.randn(4, 3, 8), torch.randn(4, 3, 8)
    t, t2 = 0.25, 0.6
    # Mean: z + (t' − t)·v with v = (x̂₁ − z)/(1 − t); variance σ²(t' − t)(1 − t')/(1 − t).
    draws = torch.stack([bridge.ddpm_step(z, x1, t, t2, torch.Generator().manual_seed(i)) for i in range(4000)])
    torch.testing.assert_close(draws.mean(0), z + (t2 - t) * (x1 - z) / (1 - t), atol=0.01, rtol=0)
    assert draws.var(0).mean().item() == pytest.approx(0.04 * (t2 - t) * (1 - t2) / (1 - t), rel=0.05)
    assert torch.equal(bridge.ddpm_step(z, x1, t, 1.0, None), x1)  # the last step lands on x̂₁
    with pytest.raises(ValueError, match="t < t'"):
        bridge.ddpm_step(z, x1, 0.5, 0.5, None)


def clipped_cosine(u: torch.Tensor, s_min: float = 0.05) -> torch.Tensor:
    """The suite's earlier schedule (``mask_schedule="clip"``, removed), the oracle: s = min(1, max(s_min, cos(πu/2))),
    mass s_min at u ≥ 2/π·arccos(s_min)."""
    return torch.cos(0.5 * math.pi * u).clamp(min=s_min, max=1.0)


def test_mask_probability_schedule_exact_values():
    u = torch.tensor([0.0, 0.5, 0.9, 0.98, 1.0], dtype=torch.float64)
    # released (affine): s = 0.05 + 0.95·cos(πu/2); the oracle of the earlier one: cos(πu/2) clipped to [0.05, 1]
    affine = torch.tensor([1.0, 0.7217514421272202, 0.19861274178821936, 0.07984022112422198, 0.05], dtype=u.dtype)
    clip = torch.tensor([1.0, 0.7071067811865476, 0.15643446504023092, 0.05, 0.05], dtype=u.dtype)
    torch.testing.assert_close(cosine_mask_prob(u), affine, rtol=0, atol=1e-12)
    torch.testing.assert_close(clipped_cosine(u), clip, rtol=0, atol=1e-12)
    torch.testing.assert_close(cosine_mask_prob(u, s_min=0.2)[1], torch.tensor(0.2 + 0.8 * 0.5**0.5, dtype=u.dtype))
    # Both reach 1 at u = 0 and s_min at u = 1 and agree as u → 0 (the affine map shrinks cos by 1 − s_min only)
    torch.testing.assert_close(cosine_mask_prob(u[[0, -1]]), clipped_cosine(u[[0, -1]]), rtol=0, atol=1e-12)
    # The training draw is the released form on u ~ U(0, 1), no mass at s_min (the earlier clip put 3 % there).
    draws = torch.rand(64, generator=torch.Generator().manual_seed(5))
    s = BridgeProcess().mask_prob(64, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(s, cosine_mask_prob(draws))
    assert BridgeProcess().mask_prob(4096, generator=torch.Generator()).min() > 0.05
    # Removed: saved checkpoints hold mask_schedule=affine (accepted); anything else is refused, naming it
    assert BridgeProcess(mask_schedule="affine") == BridgeProcess()
    with pytest.raises(ValueError, match=r"mask_schedule='clip' was removed; the masking probability is the released"):
        BridgeProcess(mask_schedule="clip")


def test_bridge_noise_can_be_drawn_in_float64():
    bridge = BridgeProcess(sigma=0.2)
    m, e_y, t = torch.randn(8), torch.randn(2, 5, 8), torch.full((2,), 0.3)
    noised = torch.ones(2, 5, dtype=torch.bool)
    mean, std = bridge.mean_std(m, e_y, t)
    z = bridge.sample(m, e_y, t, noised, torch.Generator().manual_seed(3), noise_dtype=torch.float64)
    eps64 = torch.randn(e_y.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert z.dtype == torch.float32 and torch.equal(z, mean + std * eps64.float())
    z32 = bridge.sample(m, e_y, t, noised, torch.Generator().manual_seed(3))  # the training default: E's dtype
    assert not torch.allclose(z, z32)


# ----------------------------------------------------------------------------------------------------- adapter
def test_adapter_at_init_computes_the_mdm_logits_exactly():
    mdm = random_mdm()
    module = adapted(mdm)
    x = torch.randint(0, V + 1, (3, L))
    ref = mdm(x, torch.zeros(3))
    for t in (torch.zeros(3), torch.rand(3)):  # any time: the time modulation starts at zero
        assert torch.equal(module(module.net.embeddings[x], t), ref)
    perturb_adapter(module)
    assert not torch.allclose(module(module.net.embeddings[x], torch.rand(3)), ref)  # the check can fail
    # The base tensors are the MDM's, copied exactly.
    base = dict(module.net.base.named_parameters())
    for name, p in mdm.net.named_parameters():
        own = (
            base.get(name)
            if name in base
            else base[name.replace(".weight", ".base_layer.weight").replace(".bias", ".base_layer.bias")]
        )
        assert torch.equal(own, p), name


def test_only_configured_parts_train():
    mdm = random_mdm()
    default = adapted(mdm)
    names = {n for n, p in default.named_parameters() if p.requires_grad}
    assert names and all(".lora_" in n or n.split(".")[1] in ("time_embed", "block_mods", "final_mod") for n in names)
    assert any("final.linear.lora_B" in n for n in names)  # the additive head LoRA
    assert not any("embed.weight" in n or "base_layer" in n or "adaLN" in n for n in names)
    frozen_lora = adapted(mdm, train=["time_adaln"])
    assert not any(".lora_" in n for n, p in frozen_lora.named_parameters() if p.requires_grad)
    wide = adapted(mdm, train=["time_adaln", "lora", "base_adaln", "embeddings"], lora_targets=["qkv"], lora_head=False)
    wide_names = {n for n, p in wide.named_parameters() if p.requires_grad}
    assert "net.base.embed.weight" in wide_names and any("adaLN" in n for n in wide_names)
    assert not any("mlp" in n and "lora" in n for n in wide_names) and not any(
        "final.linear.lora" in n for n in wide_names
    )
    # The optimiser sees trainable parameters only, with no decay on biases / adaLN / time embeddings.
    groups = default.optimizer_groups()
    assert sum(len(g["params"]) for g in groups) == len(names)
    no_decay = {id(p) for p in groups[1]["params"]}
    assert all(id(p) in no_decay for n, p in default.named_parameters() if p.requires_grad and "block_mods" in n)


def test_adapter_bad_configuration_is_refused():
    base = build_dit(vocab_size=V + 1, **{k: v for k, v in BB.items() if k != "size"})
    with pytest.raises(ValueError, match="match no module"):
        MLFMAdapter(base, lora_targets=["q_proj"])
    with pytest.raises(ValueError, match="unknown trainable parts"):
        MLFMAdapter(base, train=["everything"])
    with pytest.raises(ValueError, match="σ must be > 0"):
        BridgeProcess(sigma=0.0)


# --------------------------------------------------------------------------------------------------- objective
def test_loss_at_t0_is_the_mdm_cross_entropy_on_the_same_masks():
    mdm = random_mdm()
    module = adapted(mdm)  # the endpoint equivalence holds for the zero-initialised adapter
    tokens = torch.randint(0, V, (4, L))
    masked = torch.rand(4, L, generator=torch.Generator().manual_seed(0)) < 0.5
    masked[:, 0] = True
    emb = module.net.embeddings
    from flowlm.objectives.mlfm import mlfm_loss

    def mlfm_at(t: float) -> torch.Tensor:
        z = module.process.sample(emb[V], emb[tokens], torch.full((4,), t), masked, torch.Generator().manual_seed(1))
        return mlfm_loss(module(z, torch.full((4,), t)), tokens, masked, V).loss

    # MDM: the masked sequence as ids, CE at masked positions, per-sequence mean over them.
    logits = mdm(torch.where(masked, V, tokens), torch.zeros(4))
    nll = -F.log_softmax(logits[..., :V], -1).gather(-1, tokens[..., None]).squeeze(-1)
    expected = ((nll * masked).sum(-1) / masked.sum(-1)).mean()
    torch.testing.assert_close(mlfm_at(0.0), expected)
    assert not torch.allclose(mlfm_at(0.7), expected)  # a noised bridge state is not the MDM input


def test_auxiliary_mse_and_empty_rows():
    from flowlm.objectives.mlfm import mlfm_loss

    emb = torch.randn(V + 1, 8)
    tokens = torch.randint(0, V, (2, 5))
    logits = torch.full((2, 5, V + 1), -30.0)
    logits.scatter_(-1, tokens[..., None], 30.0)  # a confident, correct model: x̂₁ = E_y, MSE ≈ 0
    masked = torch.zeros(2, 5, dtype=torch.bool)
    masked[0, :2] = True  # row 1 has no masked position: it is left out of the mean, not counted as 0
    out = mlfm_loss(logits, tokens, masked, V, embeddings=emb, aux_weight=10.0)
    assert out.parts["mse"].item() < 1e-6 and out.parts["ce"].item() < 1e-6
    wrong = logits.roll(1, dims=-1)
    out = mlfm_loss(wrong, tokens, masked, V, embeddings=emb, aux_weight=10.0)
    assert out.loss.item() == pytest.approx(out.parts["ce"].item() + 10 * out.parts["mse"].item(), rel=1e-5)
    assert out.parts["ce"].item() > 10


def test_full_response_masking_masks_every_response_position(monkeypatch):
    module = adapted(random_mdm())
    tokens = torch.randint(0, V, (16, L), generator=torch.Generator().manual_seed(0))
    prompt = torch.zeros(16, L, dtype=torch.bool)
    prompt[:, :4] = True
    seen = []
    original = BridgeProcess.sample

    def spy(self, m, e_y, t, noised, generator, **kwargs):
        seen.append(noised.clone())
        return original(self, m, e_y, t, noised, generator, **kwargs)

    monkeypatch.setattr(BridgeProcess, "sample", spy)
    batch = {"tokens": tokens, "prompt_mask": prompt}
    for p, expect_all in ((1.0, True), (0.0, False)):
        module.full_response_mask_prob = p
        module.loss(batch, module.draws_at(batch, torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)))
        noised = seen[-1]
        assert not noised[:, :4].any()  # the prompt is never noised
        assert bool(noised[:, 4:].all()) == expect_all  # p = 1: s = 1 for every row, the whole response masked


# ---------------------------------------------------------------------------------------------------- sampler
class Recorder:
    """A denoiser that records every call (its NFE) and whose logits read the prompt embedding when asked."""

    def __init__(self, use_context: bool = True, sharp: float = 1.0) -> None:
        torch.manual_seed(3)
        self.emb = torch.randn(V + 1, 8)
        self.proj = torch.randn(8, V) * sharp
        self.pos = torch.randn(L, V) * sharp
        self.use_context = use_context
        self.calls: list[torch.Tensor] = []  # every call's input z, time t and output logits
        self.times: list[torch.Tensor] = []
        self.outs: list[torch.Tensor] = []

    def __call__(self, z, t):
        self.calls.append(z.clone())
        self.times.append(t.clone())
        ctx = z[:, :3].mean(1, keepdim=True) @ self.proj if self.use_context else 0
        self.outs.append(self.pos + z @ self.proj * 0.5 + ctx)
        return self.outs[-1].clone()

    def denoiser(self, sigma: float = 0.2) -> BridgeDenoiser:
        return BridgeDenoiser(fn=self, table=self.emb, mask_id=V, data_vocab_size=V, process=BridgeProcess(sigma=sigma))


def run(sampler, rec, nfe=12, sigma=0.2, seed=0, pm=None):
    prompt = torch.randint(0, V, (5, L), generator=torch.Generator().manual_seed(9))
    if pm is None:
        pm = torch.zeros(5, L, dtype=torch.bool)
        pm[:, :3] = True
    out = sampler(
        rec.denoiser(sigma), prompt=prompt, prompt_mask=pm, nfe=nfe, generator=torch.Generator().manual_seed(seed)
    )
    return out, prompt, pm


@pytest.mark.parametrize(
    "kwargs, nfe, calls",
    [
        # NFE = steps × (1, or 2 with CCFG) + 1 final call at t = 1 per trajectory, when the budget has room for it
        ({}, 12, 12),  # 11 steps + the final call
        ({}, 1, 1),  # no room for the final call: one step, decoded from its posterior
        ({"guidance": 2.0}, 12, 11),  # 5 steps × 2 + 1; the even NFE is not spent
        ({"guidance": 2.0}, 13, 13),  # 6 steps × 2 + 1
        ({"guidance": 2.0}, 2, 2),  # one guided step, decoded from its guided posterior
        ({"guidance": 2.0, "final_decode": "guided"}, 12, 12),  # 6 steps × 2, no final call
        ({"otp_eps": 0.3}, 9, 9),
        ({"otp_eps": 0.3, "otp_mode": "rounds", "rounds": 3}, 12, 12),  # 3 × (3 steps + 1)
        ({"guidance": 1.0, "otp_eps": 0.3, "otp_mode": "rounds", "rounds": 2, "grid": "uniform"}, 12, 10),  # 2 × 5
    ],
)
def test_sampler_nfe_is_exact_and_prompt_kept(kwargs, nfe, calls):
    rec = Recorder()
    out, prompt, pm = run(MLFMSampler(**kwargs), rec, nfe=nfe)
    assert out.nfe == len(rec.calls) == calls
    assert torch.equal(out.tokens[pm], prompt[pm]) and torch.all(out.confidence[pm] == 1)
    assert out.tokens.min() >= 0 and out.tokens.max() < V
    assert torch.all((out.confidence[~pm] > 0) & (out.confidence[~pm] <= 1))
    a, _, _ = run(MLFMSampler(**kwargs), Recorder(), nfe=nfe)
    assert torch.equal(a.tokens, out.tokens)  # deterministic under a seed


def test_ccfg_guided_field_and_w0():
    # With a model that ignores the context, the reference equals the conditional: any w gives the plain step
    # (σ ≈ 0 so that the reference's extra noise draw does not change the trajectory). 5 steps + the final call each.
    plain, _, _ = run(MLFMSampler(), Recorder(use_context=False), nfe=6, sigma=1e-12)
    guided, _, _ = run(MLFMSampler(guidance=3.0), Recorder(use_context=False), nfe=11, sigma=1e-12)
    assert torch.equal(plain.tokens, guided.tokens)
    torch.testing.assert_close(plain.confidence, guided.confidence)
    # With a context-reading model w changes the samples, and the reference re-noises the prompt only.
    rec = Recorder(sharp=3.0)
    w4, _, pm = run(MLFMSampler(guidance=4.0), rec, nfe=12, sigma=1e-12)
    assert not torch.allclose(w4.confidence, run(MLFMSampler(), Recorder(sharp=3.0), nfe=6, sigma=1e-12)[0].confidence)
    cond, corr = rec.calls[2], rec.calls[3]  # step 2: conditional, then reference
    assert torch.equal(cond[:, 3:], corr[:, 3:]) and not torch.allclose(cond[:, :3], corr[:, :3])
    # At t = 0 the reference context is fully re-noised: the [MASK] embedding (σ ≈ 0).
    torch.testing.assert_close(rec.calls[1][:, :3], rec.emb[V].expand(5, 3, 8))


def test_ccfg_field_is_v_plus_w_times_v_minus_v_corr():
    """Every guided step moves the free positions by (t' − t)·v_w, v_w = v + w·(v − v_corr), by hand from the stub's
    recorded calls (σ ≈ 0: the step is its mean); the final call reads the state the last step landed on."""
    w = 3.0
    rec = Recorder(sharp=2.0)
    out, _, pm = run(MLFMSampler(guidance=w, grid="uniform"), rec, nfe=7, sigma=1e-12)  # 3 steps × 2 + 1
    assert len(rec.calls) == 7
    emb, free = rec.emb[:V], ~pm
    for k in range(3):
        z, t = rec.calls[2 * k], rec.times[2 * k][0].item()
        assert torch.equal(rec.calls[2 * k + 1][free], z[free]) and rec.times[2 * k + 1][0].item() == t
        v = (F.softmax(rec.outs[2 * k], -1) @ emb - z) / (1 - t)
        v_corr = (F.softmax(rec.outs[2 * k + 1], -1) @ emb - z) / (1 - t)
        v_w = v + w * (v - v_corr)
        z_next, t_next = rec.calls[2 * k + 2], rec.times[2 * k + 2][0].item()
        torch.testing.assert_close(z_next[free], (z + (t_next - t) * v_w)[free], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(v_w[free], v[free], atol=1e-3)  # the guidance term is not negligible here


def test_final_decode_is_a_call_at_t1_on_the_final_state():
    rec = Recorder(sharp=3.0)
    out, _, pm = run(MLFMSampler(guidance=2.0, grid="uniform"), rec, nfe=7)
    assert out.nfe == len(rec.calls) == 7
    assert [t[0].item() for t in rec.times] == pytest.approx([0, 0, 1 / 3, 1 / 3, 2 / 3, 2 / 3, 1.0], abs=1e-7)
    assert torch.all(rec.times[-1] == 1.0)
    # It reads the last step's landing point z(1) = x̂₁,w (the bridge variance vanishes at t' = 1) ...
    emb, free = rec.emb[:V], ~pm
    x1, x1_corr = F.softmax(rec.outs[4], -1) @ emb, F.softmax(rec.outs[5], -1) @ emb
    torch.testing.assert_close(rec.calls[-1][free], (x1 + 2.0 * (x1 - x1_corr))[free], rtol=1e-5, atol=1e-5)
    # ... and its posterior is what is decoded (argmax at temperature 0) with its probability as the confidence.
    final = F.softmax(rec.outs[-1], -1)
    assert torch.equal(out.tokens[free], final.argmax(-1)[free])
    torch.testing.assert_close(out.confidence[free], final.max(-1).values[free])


def test_guidance_reaches_the_tokens_at_one_step():
    """One bridge step: CCFG changes the tokens, decoded by the final call (NFE 2 + 1) or, at the smallest budget,
    from the guided posterior (NFE 2); the removed decode from the step's conditional posterior could not (it is the
    unguided one-step decode whatever w)."""
    for decode, nfe in (("call", 2), ("guided", 1), ("call", 1)):
        plain, _, _ = run(MLFMSampler(final_decode=decode), Recorder(sharp=3.0), nfe=nfe)
        rec = Recorder(sharp=3.0)
        guided, _, pm = run(MLFMSampler(guidance=4.0, final_decode=decode), rec, nfe=nfe + 1)
        assert guided.nfe == len(rec.calls) == nfe + 1
        assert not torch.equal(plain.tokens[~pm], guided.tokens[~pm]), decode


@pytest.mark.parametrize("mask_id", [V, 2], ids=["mask_last_row", "mask_inside_llada"])
def test_ccfg_reference_is_the_bridge_marginal_at_the_mask_row(mask_id):
    """The reference call reads z with the prompt re-noised by the bridge marginal at the step's t,
    (1 − t)·E[mask_id] + t·E_y + σ·√(t(1 − t))·ε, ε the generator's next float64 N(0, I) draw (after the previous
    step's bridge noise), with [MASK] the table's last row (DiT) or a row inside the vocabulary (LLaDA, Dream); the
    free positions keep the state. By hand from the stream: ε₀ (t = 0), the step's noise, ε₁ (t = ½)."""
    rec, sigma = Recorder(), 0.2
    view = BridgeDenoiser(fn=rec, table=rec.emb, mask_id=mask_id, data_vocab_size=V, process=BridgeProcess(sigma=sigma))
    prompt = torch.randint(0, V, (5, L), generator=torch.Generator().manual_seed(9))
    pm = torch.zeros(5, L, dtype=torch.bool)
    pm[:, :3] = True
    out = MLFMSampler(guidance=2.0)(
        view, prompt=prompt, prompt_mask=pm, nfe=5, generator=torch.Generator().manual_seed(4)
    )
    assert out.nfe == len(rec.calls) == 5  # 2 steps × (state + reference), the call at t = 1
    gen = torch.Generator().manual_seed(4)
    eps = [torch.randn((5, L, 8), generator=gen, dtype=torch.float64) for _ in range(3)]  # ε₀, step noise, ε₁
    m, e_y = rec.emb[mask_id], rec.emb[prompt]
    for call, t, e in ((1, 0.0, eps[0]), (3, 0.5, eps[2])):
        state = rec.calls[call - 1]
        want = torch.where(pm[..., None], (1 - t) * m + t * e_y + sigma * (t * (1 - t)) ** 0.5 * e.float(), state)
        torch.testing.assert_close(rec.calls[call], want, rtol=0, atol=1e-6)
    assert not torch.allclose(rec.calls[3][pm], rec.calls[2][pm], atol=1e-2)  # the reference is re-noised


def test_ccfg_without_context_spends_one_nfe_per_step():
    """No prompt in the batch: the reference would equal the state (v_corr = v), so it is skipped and CCFG is the
    unguided sampler at the same budget; a batch where some rows have a prompt pays 2 NFE per step, and its
    prompt-less rows follow the unguided field."""
    none = torch.zeros(5, L, dtype=torch.bool)
    rec = Recorder()
    guided, _, _ = run(MLFMSampler(guidance=2.0), rec, nfe=8, pm=none)
    plain, _, _ = run(MLFMSampler(), Recorder(), nfe=8, pm=none)
    assert guided.nfe == len(rec.calls) == 8  # 7 steps + the final call
    assert torch.equal(guided.tokens, plain.tokens) and torch.equal(guided.confidence, plain.confidence)
    rounds = MLFMSampler(guidance=2.0, guidance_scope="context", otp_eps=0.3, otp_mode="rounds", rounds=2)
    rec = Recorder()
    out, _, _ = run(rounds, rec, nfe=10, pm=none)  # round 1: no context, 4 steps + 1; round 2: promoted, 2 × 2 + 1
    assert out.nfe == len(rec.calls) == 10
    mixed = none.clone()
    mixed[2:, :3] = True
    rec = Recorder()
    guided, _, _ = run(MLFMSampler(guidance=2.0), rec, nfe=11, sigma=1e-12, pm=mixed)
    plain, _, _ = run(MLFMSampler(), Recorder(), nfe=6, sigma=1e-12, pm=mixed)
    assert guided.nfe == len(rec.calls) == 11  # 5 steps × 2 + 1
    assert torch.equal(guided.tokens[:2], plain.tokens[:2])
    torch.testing.assert_close(guided.confidence[:2], plain.confidence[:2])
    # The decision is one host read per call (none inside the loop); check_context=False reads nothing, pays 2 NFE.
    from tests.host_syncs import HostSyncs

    for check, reads, calls in ((True, 1, 8), (False, 0, 7)):
        rec = Recorder()
        with HostSyncs() as syncs:
            out, _, _ = run(MLFMSampler(guidance=2.0, check_context=check), rec, nfe=8, pm=none)
        assert syncs.count == reads and out.nfe == len(rec.calls) == calls, syncs.where


class Confident:
    """A stub whose posterior at position 5 turns confident in token 2 (p ≈ 0.98) once t > ``after``; it records
    every call's input."""

    def __init__(self, after: float) -> None:
        torch.manual_seed(4)
        self.emb = torch.randn(V + 1, 8)
        self.after = after
        self.calls: list[torch.Tensor] = []

    def __call__(self, z, t):
        self.calls.append(z.clone())
        logits = 0.1 * z @ self.emb[:V].T  # reads z, so the reference call differs
        bump = torch.zeros(V)
        bump[2] = 6.0
        logits[:, 5] = logits[:, 5] + (t[:, None] > self.after) * bump
        return logits

    def sample(self, sampler: MLFMSampler, nfe: int):
        model = BridgeDenoiser(fn=self, table=self.emb, mask_id=V, data_vocab_size=V, process=BridgeProcess())
        pm = torch.zeros(2, L, dtype=torch.bool)
        pm[:, :3] = True
        prompt = torch.randint(0, V, (2, L), generator=torch.Generator().manual_seed(1))
        return sampler(model, prompt=prompt, prompt_mask=pm, nfe=nfe, generator=torch.Generator().manual_seed(2))


def test_otp_promotes_before_the_step():
    """As the paper: a position promoted at a step is context for that step's CCFG reference (re-noised there) and
    promotion acts at the last step too (the removed ``otp_order=after_step`` did neither)."""
    kw = {"guidance": 1.0, "guidance_scope": "context", "otp_eps": 0.05, "grid": "uniform"}
    target = Confident(after=0.0).emb[2]
    # 3 steps at t = 0, 1/3, 2/3 (calls 0–5: conditional, reference) + the final call; confident from t = 1/3 on.
    stub = Confident(after=0.25)
    out = stub.sample(MLFMSampler(**kw), nfe=7)
    cond, ref = stub.calls[2][:, 5], stub.calls[3][:, 5]
    assert torch.all(out.tokens[:, 5] == 2) and torch.equal(stub.calls[4][:, 5], target.expand(2, 8))
    assert not torch.allclose(ref, cond) and not torch.allclose(ref, target)  # re-noised from E_2 at t = 1/3
    # Confident only at the last step (t = 2/3): promoted there, so the final call sees E_2 exactly (before_step).
    stub = Confident(after=0.5)
    stub.sample(MLFMSampler(**kw), nfe=7)
    assert torch.equal(stub.calls[-1][:, 5], target.expand(2, 8))


def test_otp_never_changes_a_promoted_token():
    rec = Recorder(sharp=4.0)
    out, prompt, pm = run(MLFMSampler(otp_eps=0.2, grid="uniform"), rec, nfe=16)
    emb = rec.emb[:V]
    promoted_any = False
    for b in range(5):
        for pos in range(3, L):
            # A position whose input equals a token embedding exactly has been promoted (noise is continuous).
            hits = [c[b, pos] for c in rec.calls[1:]]
            exact = [int(i) for i, h in enumerate(hits) if any(torch.equal(h, e) for e in emb)]
            if exact:
                promoted_any = True
                first = exact[0]
                assert exact == list(range(first, len(hits)))  # stays clean from then on
                token = next(v for v in range(V) if torch.equal(hits[first], emb[v]))
                assert out.tokens[b, pos] == token
                assert out.confidence[b, pos] >= 0.8
    assert promoted_any, "the test model should be confident enough to promote"


def test_round_based_otp_promotes_at_least_one_per_round():
    rec = Recorder()
    out, _, pm = run(MLFMSampler(otp_eps=1e-9, otp_mode="rounds", rounds=4, grid="uniform"), rec, nfe=8)
    # Round r's first call sees the positions promoted in earlier rounds clean: at least r per row.
    emb = rec.emb[:V]
    for r in range(1, 4):
        first_call = rec.calls[2 * r]
        clean = [(first_call[:, pos, None] == emb).all(-1).any(-1) for pos in range(3, L)]
        assert torch.all(torch.stack(clean, 1).sum(1) >= r)


def test_sampler_bad_input_is_refused():
    with pytest.raises(ValueError, match="w must be ≥ 0"):
        MLFMSampler(guidance=-1.0)
    with pytest.raises(ValueError, match="ε"):
        MLFMSampler(otp_eps=1.0)
    with pytest.raises(ValueError, match="rounds"):
        MLFMSampler(rounds=2)
    with pytest.raises(ValueError, match=r"otp_order='after_step' was removed; OTP promotes before each bridge step"):
        MLFMSampler(otp_order="after_step")
    assert MLFMSampler(otp_order="before_step").otp_eps == 0  # what saved configs hold
    with pytest.raises(ValueError, match="final_decode='conditional' was removed; use call"):
        MLFMSampler(final_decode="conditional")
    with pytest.raises(ValueError, match="final_decode"):
        MLFMSampler(final_decode="argmax")
    with pytest.raises(ValueError, match="below one step per round"):
        MLFMSampler(guidance=1.0, otp_mode="rounds", rounds=3, otp_eps=0.1).check_budget(5)
    MLFMSampler(guidance=1.0, otp_mode="rounds", rounds=3, otp_eps=0.1).check_budget(6)
    assert math.isclose(MLFMSampler(guidance=1.0).cost_per_step, 2)


# ----------------------------------------------------------------------------------------------- end to end
def test_mlfm_trains_from_its_mdm_and_refuses_wrong_sources(runs_env):
    from pathlib import Path

    from runners.evaluate import evaluate
    from runners.train import train
    from tests.conftest import FAST, compose_config

    mdm = train(compose_config(overrides=["experiment=sudoku_mdm_easy", "scale=cpu", *FAST, "logger=none"]))
    mdm_ckpt = Path(mdm["run_dir"], "checkpoints", "last.ckpt")
    base = ["experiment=sudoku_mlfm_easy", "scale=cpu", *FAST, "logger=none", "eval.nfe=[4]"]
    with pytest.raises(ValueError, match="another backbone size"):
        train(compose_config(overrides=[*base, "backbone.d_model=64"]))
    flow = train(
        compose_config(overrides=["experiment=sudoku_fmlm_plus_scratch_easy", "scale=cpu", *FAST, "logger=none"])
    )
    flow_ckpt = Path(flow["run_dir"], "checkpoints", "last.ckpt")
    with pytest.raises(ValueError, match="is a 'flow' checkpoint, expected a 'mdm' one"):
        train(compose_config(overrides=[*base, f"method.init_from={flow_ckpt}"]))
    with pytest.raises(ValueError, match="match no module"):
        train(compose_config(overrides=[*base, "method.adapter.lora_targets=[wq]"]))
    assert not (runs_env / "runs" / "sudoku_mlfm_easy").exists()  # nothing written before the checks

    result = train(compose_config(overrides=base))
    rows = {(r["sampler"], r["nfe"]) for r in result["rows"]}  # 3 steps + 1, or 1 guided step × 2 + 1
    assert rows == {("mlfm", 4.0), ("mlfm_ccfg", 3.0), ("mlfm_ccfg_otp", 3.0)}
    ckpt = torch.load(Path(result["run_dir"], "checkpoints", "last.ckpt"), weights_only=False)
    assert ckpt["flowlm"]["family"] == "mlfm"
    # The frozen MDM stayed the MDM: its blocks equal the source checkpoint's.
    source = torch.load(mdm_ckpt, weights_only=False)["state_dict"]
    own = ckpt["state_dict"]
    assert torch.equal(own["net.base.blocks.0.qkv.base_layer.weight"], source["net.blocks.0.qkv.weight"])
    assert torch.equal(own["net.base.embed.weight"], source["net.embed.weight"])
    # Sampling-only evaluation of the MLFM checkpoint, with the MLFM grid of samplers.
    out = evaluate(
        compose_config(
            "eval",
            overrides=[
                f"ckpt_path={result['run_dir']}/checkpoints/last.ckpt",
                "eval=sudoku_mlfm_grid",
                "eval.nfe=[4]",
                "eval.max_batches=1",
                "logger=none",
            ],
        )
    )
    assert {r["sampler"] for r in out["rows"]} == {f"w{w}{o}" for w in (0, 1, 2, 4) for o in ("", "_otp")}
    # 3 plain steps + the final call, or 1 guided step × 2 NFE + the final call (one NFE of the budget unspent)
    assert all(r["nfe"] == (4.0 if r["sampler"].startswith("w0") else 3.0) for r in out["rows"])
