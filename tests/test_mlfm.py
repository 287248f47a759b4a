"""MLFM (methods.md §6): Brownian bridge, MDM adapter, objective, CCFG/OTP sampler, bad input."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flowlm.backbones.adapters import MLFMAdapter
from flowlm.backbones.dit import build_dit
from flowlm.processes.bridge import BridgeProcess, gamma_of_t, t_of_gamma
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
        return mlfm_loss(module(z, torch.full((4,), t)), tokens, masked, V)["loss"]

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
    assert out["mse"].item() < 1e-6 and out["ce"].item() < 1e-6
    wrong = logits.roll(1, dims=-1)
    out = mlfm_loss(wrong, tokens, masked, V, embeddings=emb, aux_weight=10.0)
    assert out["loss"].item() == pytest.approx(out["ce"].item() + 10 * out["mse"].item(), rel=1e-5)
    assert out["ce"].item() > 10


# ---------------------------------------------------------------------------------------------------- sampler
class Recorder:
    """A denoiser that records every call (its NFE) and whose logits read the prompt embedding when asked."""

    def __init__(self, use_context: bool = True, sharp: float = 1.0) -> None:
        torch.manual_seed(3)
        self.emb = torch.randn(V + 1, 8)
        self.proj = torch.randn(8, V) * sharp
        self.pos = torch.randn(L, V) * sharp
        self.use_context = use_context
        self.calls: list[torch.Tensor] = []

    def __call__(self, z, t):
        self.calls.append(z.clone())
        ctx = z[:, :3].mean(1, keepdim=True) @ self.proj if self.use_context else 0
        return self.pos + z @ self.proj * 0.5 + ctx

    def denoiser(self, sigma: float = 0.2) -> BridgeDenoiser:
        return BridgeDenoiser(
            fn=self, embeddings=self.emb[:V], mask_embedding=self.emb[V], process=BridgeProcess(sigma=sigma)
        )


def run(sampler, rec, nfe=12, sigma=0.2, seed=0):
    prompt = torch.randint(0, V, (5, L), generator=torch.Generator().manual_seed(9))
    pm = torch.zeros(5, L, dtype=torch.bool)
    pm[:, :3] = True
    out = sampler(
        rec.denoiser(sigma), prompt=prompt, prompt_mask=pm, nfe=nfe, generator=torch.Generator().manual_seed(seed)
    )
    return out, prompt, pm


@pytest.mark.parametrize(
    "kwargs, nfe, calls",
    [
        ({}, 12, 12),
        ({"guidance": 2.0}, 12, 12),
        ({"guidance": 2.0}, 13, 12),  # 6 steps × 2; the odd NFE is not spent
        ({"otp_eps": 0.3}, 9, 9),
        ({"otp_eps": 0.3, "otp_mode": "rounds", "rounds": 3}, 12, 12),
        ({"guidance": 1.0, "otp_eps": 0.3, "otp_mode": "rounds", "rounds": 2, "grid": "uniform"}, 12, 12),
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
    # (σ ≈ 0 so that the reference's extra noise draw does not change the trajectory).
    plain, _, _ = run(MLFMSampler(), Recorder(use_context=False), nfe=6, sigma=1e-12)
    guided, _, _ = run(MLFMSampler(guidance=3.0), Recorder(use_context=False), nfe=12, sigma=1e-12)
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

    mdm = train(compose_config(overrides=["experiment=sudoku_mdm_easy_tiny", *FAST, "logger=none"]))
    mdm_ckpt = Path(mdm["run_dir"], "checkpoints", "last.ckpt")
    base = ["experiment=sudoku_mlfm_easy_tiny", *FAST, "logger=none", "eval.nfe=[4]"]
    with pytest.raises(ValueError, match="another backbone size"):
        train(compose_config(overrides=[*base, "backbone.d_model=64"]))
    flow = train(compose_config(overrides=["experiment=sudoku_fmlmp_scratch_easy_tiny", *FAST, "logger=none"]))
    flow_ckpt = Path(flow["run_dir"], "checkpoints", "last.ckpt")
    with pytest.raises(ValueError, match="is a 'flow' checkpoint, expected a 'mdm' one"):
        train(compose_config(overrides=[*base, f"method.init_from={flow_ckpt}"]))
    with pytest.raises(ValueError, match="match no module"):
        train(compose_config(overrides=[*base, "method.adapter.lora_targets=[wq]"]))
    assert not (runs_env / "runs" / "sudoku_mlfm_easy_tiny").exists()  # nothing written before the checks

    result = train(compose_config(overrides=base))
    rows = {(r["sampler"], r["nfe"]) for r in result["rows"]}
    assert rows == {("mlfm", 4.0), ("mlfm_ccfg", 4.0), ("mlfm_ccfg_otp", 4.0)}
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
    assert all(r["nfe"] == 4.0 for r in out["rows"])  # 4 plain steps, or 2 guided steps × 2 NFE
