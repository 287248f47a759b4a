"""The released protocols as defaults (docs/protocol.md): commit-loop scores, PR's times and noise, the released
DiT's choices, checkpoints written before them. Every test here fails if the line it guards is broken."""

import math

import pytest
import torch
import torch.nn.functional as F

import flowlm.backbones.dit as dit
from flowlm.backbones.dit import LEGACY_OPTIONS, RELEASED_OPTIONS, TimeEmbedding, attention, build_dit
from flowlm.samplers import ConfidenceSampler, FlowDenoiser, MaskedDenoiser, PosteriorRefinementSampler
from lightning_modules.checkpoints import check_backbone_options, load_module
from lightning_modules.mdm import MDMModule

# ------------------------------------------------------------------------------------------ commit-loop scores

# Two free positions, two data tokens: position 0 has p = (0.6, 0.4), position 1 p = (0.5, 0.5). The first of two
# steps commits one position. By max probability it is always position 0 (0.6 > 0.5), whatever token is drawn; by
# the drawn token's probability it is position 0 iff token 0 was drawn there (0.6 > 0.5 > 0.4): probability 0.6.
_P = torch.tensor([[0.6, 0.4], [0.5, 0.5]])


def _two_position_mdm(calls: list):
    def fn(x, t):
        calls.append(x.clone())
        return _P.log().expand(x.shape[0], 2, 2)

    return MaskedDenoiser(fn=fn, mask_id=2)


def _first_commit(sampler, rows=4000, seed=0):
    calls = []
    prompt = torch.zeros(rows, 2, dtype=torch.long)
    out = sampler(
        _two_position_mdm(calls),
        prompt=prompt,
        prompt_mask=torch.zeros(rows, 2, dtype=torch.bool),
        nfe=2,
        generator=torch.Generator().manual_seed(seed),
    )
    committed_first = calls[1] != 2  # what the second call saw unmasked
    assert (committed_first.sum(-1) == 1).all()
    return committed_first[:, 0], out


@pytest.mark.parametrize("score", ["max_prob", "sampled"])
def test_confidence_at_temperature_zero_commits_the_argmax_of_the_most_confident_position(score):
    first_is_0, out = _first_commit(ConfidenceSampler(temperature=0.0, score=score), rows=8)
    assert first_is_0.all() and (out.tokens == 0).all()
    assert torch.allclose(out.confidence, torch.tensor([0.6, 0.5]).expand(8, 2))


def test_confidence_at_temperature_one_ranks_by_max_probability_by_default():
    assert ConfidenceSampler().score == "max_prob"
    first_is_0, out = _first_commit(ConfidenceSampler(temperature=1.0))
    assert first_is_0.all()  # whatever was drawn there
    drew_0 = out.tokens[:, 0] == 0
    assert abs(drew_0.float().mean().item() - 0.6) < 4 * math.sqrt(0.24 / 4000)  # the draw itself is p
    # the reported confidence is the probability of the committed token, not the score
    assert torch.allclose(out.confidence[:, 0], torch.where(drew_0, 0.6, 0.4))


def test_confidence_sampled_rule_ranks_by_the_drawn_tokens_probability():
    first_is_0, out = _first_commit(ConfidenceSampler(temperature=1.0, score="sampled"))
    assert (out.tokens[first_is_0, 0] == 0).all()  # position 0 goes first only when it drew token 0
    share = first_is_0.float().mean().item()
    assert abs(share - 0.6) < 4 * math.sqrt(0.24 / 4000), share  # 4 σ of a binomial share over 4 000 rows


def test_a_priori_loop_ranks_by_max_probability_at_temperature_one():
    """The PR/a-priori loop with the same two positions (flow form: log δ at every call)."""
    calls = []

    def fn(x, s, t):
        calls.append(s.clone())
        return _P.log().expand(x.shape[0], 2, 2)

    model = FlowDenoiser(fn=fn, vocab_size=2)
    kwargs = dict(prompt=torch.zeros(4000, 2, dtype=torch.long), prompt_mask=torch.zeros(4000, 2, dtype=torch.bool))
    for score, expect_all in (("max_prob", True), ("sampled", False)):
        calls.clear()
        sampler = PosteriorRefinementSampler(
            rounds=2, threshold=1.0, confidence="a_priori", temperature=1.0, score=score
        )
        out = sampler(model, nfe=2, generator=torch.Generator().manual_seed(0), **kwargs)
        first_is_0 = calls[1][:, 0] == 1  # committed positions sit at s = 1
        if expect_all:
            assert first_is_0.all()
        else:
            assert (out.tokens[first_is_0, 0] == 0).all()
            assert abs(first_is_0.float().mean().item() - 0.6) < 4 * math.sqrt(0.24 / 4000)


def test_unknown_score_is_refused():
    with pytest.raises(ValueError, match="score must be one of"):
        ConfidenceSampler(score="entropy")
    with pytest.raises(ValueError, match="score must be one of"):
        PosteriorRefinementSampler(score="margin")


# ------------------------------------------------------------------------------ PR: times, noise, threshold


class _TimeRecorder:
    """A flow 'network' on per-token times (no pinned form): records (x, s, t) and returns fixed log δ."""

    def __init__(self, log_delta: torch.Tensor):
        self.log_delta, self.calls = log_delta, []

    def __call__(self, x, s, t):
        self.calls.append((x.clone(), s.clone(), t.clone()))
        return self.log_delta.expand(x.shape[0], *self.log_delta.shape[-2:])

    def view(self):
        return FlowDenoiser(fn=self, vocab_size=self.log_delta.shape[-1])


def _free(length=6, batch=3, prompt_len=2, v=4):
    prompt = torch.randint(0, v, (batch, length), generator=torch.Generator().manual_seed(3))
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[:, :prompt_len] = True
    return prompt, mask


def _random_log_delta(length=6, v=4, seed=0):
    return torch.randn(length, v, generator=torch.Generator().manual_seed(seed)).mul(3).log_softmax(-1)


@pytest.mark.parametrize(
    ("kwargs", "nfe", "times"),
    [
        ({"rounds": 2, "flow_steps": 1}, 2, [(0.0, 1.0), (0.0, 1.0)]),  # PR: δ_{0,1}, each round from s = 0
        ({"rounds": 1, "flow_steps": 2}, 2, [(0.0, 0.5), (0.5, 1.0)]),  # two flow-map jumps 0 → ½ → 1
        ({"rounds": 2, "flow_steps": None}, 8, [(k / 4, (k + 1) / 4) for k in range(4)] * 2),  # N = 8 // 2
        ({"rounds": 3, "confidence": "a_priori"}, 3, [(0.0, 0.0)] * 3),  # δ_{0,0}
    ],
)
def test_pr_and_a_priori_feed_their_times_and_pin_committed_tokens(kwargs, nfe, times):
    net = _TimeRecorder(_random_log_delta())
    prompt, mask = _free()
    out = PosteriorRefinementSampler(threshold=1.0, **kwargs)(
        net.view(), prompt=prompt, prompt_mask=mask, nfe=nfe, generator=torch.Generator().manual_seed(0)
    )
    assert out.nfe == len(net.calls) == len(times)
    for (x, s, t), (s_free, t_free) in zip(net.calls, times, strict=True):
        pinned = s == 1.0
        assert (pinned[mask]).all()  # the prompt sits at s = t = 1 with its exact one-hot
        assert (t[pinned] == 1.0).all() and torch.equal(x[mask], F.one_hot(prompt[mask], 4).float())
        assert torch.all(s[~pinned] == s_free) and torch.all(t[~pinned] == t_free)


@pytest.mark.parametrize("noise", ["fresh", "reuse"])
def test_pr_renoises_with_fresh_float64_draws_or_reuses_the_first(noise):
    net = _TimeRecorder(_random_log_delta())
    prompt, mask = _free()
    PosteriorRefinementSampler(rounds=3, threshold=1.0, noise=noise)(
        net.view(), prompt=prompt, prompt_mask=mask, nfe=3, generator=torch.Generator().manual_seed(5)
    )
    gen = torch.Generator().manual_seed(5)  # the same stream, drawn by hand: one (B, L, |V|) float64 draw per round
    draws = [torch.randn((3, 6, 4), generator=gen, dtype=torch.float64).float() for _ in range(3)]
    for r, (x, s, _) in enumerate(net.calls):
        open_ = s == 0
        expected = draws[r] if noise == "fresh" else draws[0]
        assert torch.equal(x[open_], expected[open_])
        assert open_.any()


def test_pr_commits_every_token_above_the_threshold_on_top_of_the_uniform_budget():
    # 4 free positions; the first three have p_max = 0.5 exactly (the threshold: ≥ commits), the last 0.4
    p = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.5, 0.3], [0.3, 0.2, 0.5], [0.4, 0.35, 0.25]])
    net = _TimeRecorder(p.log())
    prompt = torch.zeros(2, 4, dtype=torch.long)
    no_prompt = torch.zeros(2, 4, dtype=torch.bool)
    for threshold, committed_after_round_1 in ((0.5, 3), (0.6, 1)):  # uniform budget ⌈4/4⌉ = 1
        net.calls.clear()
        out = PosteriorRefinementSampler(rounds=4, threshold=threshold)(
            net.view(), prompt=prompt, prompt_mask=no_prompt, nfe=4, generator=torch.Generator().manual_seed(0)
        )
        assert ((net.calls[1][1] == 1).sum(-1) == committed_after_round_1).all()
        assert torch.equal(out.tokens, p.argmax(-1).expand(2, 4))


def test_pr_budget_with_fixed_rounds_and_free_flow_steps():
    sampler = PosteriorRefinementSampler(rounds=4, flow_steps=None)
    assert sampler.plan(32) == (4, 8) and sampler.plan(128) == (4, 32) and sampler.plan(6) == (4, 1)
    with pytest.raises(ValueError, match="below 4 rounds"):
        sampler.check_budget(3)
    with pytest.raises(ValueError, match="needs rounds or flow_steps"):
        PosteriorRefinementSampler(rounds=None, flow_steps=None)


def test_text_flow_eval_uses_the_released_rounds():
    from tests.conftest import compose_config

    cfg = compose_config("train", ["experiment=tinystories_fmlm_plus_scratch"])
    pr = cfg.eval.samplers.pr
    assert (pr.rounds, pr.flow_steps, pr.threshold, pr.noise, pr.commit) == (4, None, 0.999, "fresh", "uniform")
    assert cfg.backbone.d_model == 512  # the released TinyStories model is `mini`
    assert cfg.eval.samplers.a_priori.score == "max_prob" and pr.score == "max_prob"


# ------------------------------------------------------------------------------------- the released DiT


def _tiny(**kw):
    return build_dit(vocab_size=kw.pop("vocab_size", 11), d_model=64, n_layers=1, n_heads=4, cond_dim=16, **kw)


def test_dit_defaults_are_the_released_choices_and_every_backbone_config_states_them():
    import inspect
    from pathlib import Path

    from omegaconf import OmegaConf

    defaults = {k: p.default for k, p in inspect.signature(dit.DiT).parameters.items() if k in RELEASED_OPTIONS}
    assert defaults == RELEASED_OPTIONS
    assert RELEASED_OPTIONS == {
        "embed_init": "kaiming_uniform",
        "time_scale": 1.0,
        "attn_dropout": 0.0,
        "attn_softcap": 50.0,
        "input_fp32": True,
        "time_fp32": True,
    }
    from flowlm.pretrained.mdlm import MDLM_OPTIONS

    pretrained = {"mdlm_owt.yaml": MDLM_OPTIONS}  # a pretrained model's own DiT (docs/pretrained.md)
    for path in sorted((Path(__file__).parents[2] / "conf" / "backbone").glob("*.yaml")):
        cfg = OmegaConf.to_container(OmegaConf.load(path))
        want = {k: pretrained.get(path.name, RELEASED_OPTIONS)[k] for k in RELEASED_OPTIONS}
        assert {k: cfg[k] for k in RELEASED_OPTIONS} == want, path.name


def test_embedding_is_kaiming_uniform_by_default_and_normal_as_an_option():
    torch.manual_seed(0)
    d = 256
    e = build_dit(vocab_size=4000, d_model=d, n_layers=1, n_heads=4, cond_dim=16).embed.weight
    bound = 1 / math.sqrt(d)  # kaiming-uniform with a = √5: gain √(2/6) · √(3/fan_in), fan_in = d
    assert e.abs().max() <= bound and e.abs().max() > 0.99 * bound
    assert abs(e.std().item() - bound / math.sqrt(3)) < 0.01 * bound
    legacy = build_dit(vocab_size=4000, d_model=d, n_layers=1, n_heads=4, cond_dim=16, embed_init="normal")
    assert abs(legacy.embed.weight.std().item() - 1.0) < 0.01
    with pytest.raises(ValueError, match="embed_init"):
        _tiny(embed_init="xavier")


def test_time_features_read_the_raw_time_by_default():
    torch.manual_seed(0)
    t = torch.tensor([0.0, 0.25, 0.7, 1.0])
    for scale in (1.0, 1000.0):
        emb = TimeEmbedding(16, scale=scale)
        args = scale * t[:, None] * emb.freqs
        by_hand = emb.mlp(torch.cat([args.cos(), args.sin()], -1))
        assert torch.allclose(emb(t), by_hand, atol=1e-6)
    assert _tiny(two_times=True).emb_s.scale == 1.0 and _tiny(two_times=True).emb_t.scale == 1.0


def test_dropout_acts_on_the_residual_branches_not_on_attention_probabilities(monkeypatch):
    seen = []

    def recording_attention(q, k, v, *, dropout_p, softcap=0.0, **kw):
        seen.append((dropout_p, softcap))
        return attention(q, k, v, dropout_p=dropout_p, softcap=softcap, **kw)

    monkeypatch.setattr(dit, "attention", recording_attention)
    torch.manual_seed(0)
    net = _tiny(dropout=0.3).train()
    for layer in (net.blocks[0].adaLN_modulation, net.final.linear):  # zero at init: open the gates and the head
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.5)
    x, s = torch.randint(0, 11, (2, 5)), torch.zeros(2)
    a, b = net(x, s), net(x, s)
    assert not torch.allclose(a, b)  # residual dropout is active in train mode
    assert seen == [(0.0, 50.0)] * 2  # attention probabilities are not dropped; logits capped at 50
    seen.clear()
    _tiny(dropout=0.3, attn_dropout=0.2, attn_softcap=0.0).train()(x, s)
    assert seen == [(0.2, 0.0)]


def test_soft_capped_attention_is_cap_tanh_of_the_scaled_logits():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 8, generator=g) * 6 for _ in range(3))  # logits far beyond the cap
    cap = 5.0
    scores = q @ k.transpose(-1, -2) / math.sqrt(8)
    assert scores.abs().max() > 3 * cap
    by_hand = torch.softmax(cap * torch.tanh(scores / cap), -1) @ v
    capped = attention(q, k, v, dropout_p=0.0, is_causal=False, softcap=cap)
    assert torch.allclose(capped, by_hand, atol=1e-5)
    assert not torch.allclose(attention(q, k, v, dropout_p=0.0, is_causal=False), by_hand, atol=1e-2)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    by_hand = torch.softmax((cap * torch.tanh(scores / cap)).masked_fill(~causal, -math.inf), -1) @ v
    assert torch.allclose(attention(q, k, v, dropout_p=0.0, is_causal=True, softcap=cap), by_hand, atol=1e-5)


def test_continuous_input_is_projected_in_float32_under_autocast():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 11)
    for fp32, dtype in ((True, torch.float32), (False, torch.bfloat16)):
        net = _tiny(input_fp32=fp32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = net.input_embeddings(x)
        assert h.dtype == dtype
        exact = (x.double() @ net.embed.weight.double()).float()
        assert torch.allclose(h.float(), exact, atol=1e-5) == fp32  # bf16 rounds at 3 significant digits


def test_time_conditioning_is_float32_under_autocast_by_default():
    """``time_fp32`` (the released code): c = SiLU(emb_s(s) + emb_t(t)) is the float32 value also under bf16
    autocast; ``time_fp32=False`` computes it in bf16, where two nearby times blur."""
    torch.manual_seed(0)
    s, t = torch.tensor([0.30, 0.31]), torch.tensor([0.50, 0.505])
    for fp32 in (True, False):
        net = _tiny(two_times=True, time_fp32=fp32)
        exact = net.condition(s, t, 2, 3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            c = net.condition(s, t, 2, 3)
        assert c.dtype == (torch.float32 if fp32 else torch.bfloat16)
        assert torch.equal(c, exact) == fp32
        if not fp32:
            assert (c.float() - exact).abs().max() > 1e-4
    # weights gathered in bf16 (FSDP2's mixed-precision policy): still computed in float32, from those weights
    import copy

    net16 = _tiny(two_times=True).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        c16 = net16.condition(s, t, 2, 3)
    assert c16.dtype == torch.float32
    assert torch.equal(c16, copy.deepcopy(net16).float().condition(s, t, 2, 3))


@pytest.mark.slow
def test_flex_attention_path_equals_the_written_out_cap():
    """The fused path CUDA takes (FlexAttention, compiled), run forward on the CPU (≈ 30 s of compilation)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 8, generator=g) * 6 for _ in range(3))
    for causal in (False, True):
        mask = torch.ones(16, 16, dtype=torch.bool).tril() if causal else None
        math_form = dit.written_capped_attention(q, k, v, cap=5.0, dropout_p=0.0, is_causal=False, attn_mask=mask)
        with torch.no_grad():
            flex = dit.flex_capped_attention(q, k, v, cap=5.0, is_causal=causal)
        assert torch.allclose(flex, math_form, atol=1e-4)


# ------------------------------------------------------------------------ checkpoints from before the options


def _mdm(**backbone):
    torch.manual_seed(0)
    return MDMModule(
        data_vocab_size=5,
        seq_len=6,
        backbone={"d_model": 32, "n_layers": 1, "n_heads": 4, "cond_dim": 16, **backbone},
        optim={},
    )


def _save(module, path, drop_keys=()):
    """A checkpoint as Lightning writes it (hyper-parameters, then the module's on_save_checkpoint); ``drop_keys``
    removes backbone options, as in a checkpoint written before they existed."""
    import lightning

    ckpt = {
        "state_dict": module.state_dict(),
        "hyper_parameters": dict(module.hparams),
        "pytorch-lightning_version": lightning.__version__,
    }
    module.on_save_checkpoint(ckpt)
    ckpt["hyper_parameters"]["backbone"] = {
        k: v for k, v in ckpt["hyper_parameters"]["backbone"].items() if k not in drop_keys
    }
    torch.save(ckpt, path)


def test_a_checkpoint_from_before_the_options_is_built_as_it_was_trained(tmp_path):
    old = _mdm(**{k: v for k, v in LEGACY_OPTIONS.items() if k != "attn_dropout"}, dropout=0.1, attn_dropout=0.1)
    _save(old, tmp_path / "old.ckpt", drop_keys=tuple(LEGACY_OPTIONS))
    loaded = load_module(tmp_path / "old.ckpt")
    net = loaded.net
    assert net.emb_s.scale == 1000.0 and not net.input_fp32
    assert (net.blocks[0].softcap, net.blocks[0].attn_dropout) == (0.0, 0.1)
    x = torch.randint(0, 6, (2, 6))
    assert torch.equal(loaded.eval()(x, torch.zeros(2)), old.eval()(x, torch.zeros(2)))
    _save(_mdm(), tmp_path / "new.ckpt")
    assert load_module(tmp_path / "new.ckpt").net.blocks[0].softcap == 50.0


def test_a_source_checkpoint_with_another_attention_cap_is_refused(tmp_path):
    _save(_mdm(), tmp_path / "mdm.ckpt", drop_keys=tuple(LEGACY_OPTIONS))  # an old MDM: no cap, 1000·t
    ckpt = torch.load(tmp_path / "mdm.ckpt", weights_only=False)
    target = {"d_model": 32, "n_layers": 1, "n_heads": 4, "cond_dim": 16}  # a new config: the released defaults
    with pytest.raises(ValueError, match=r"attn_softcap=0.0 there, 50.0 here"):
        check_backbone_options(ckpt, target, "mdm.ckpt", role="init_from", time_conditioned=False)
    check_backbone_options(ckpt, {**target, "attn_softcap": 0.0}, "mdm.ckpt", role="init_from", time_conditioned=False)
    with pytest.raises(ValueError, match="time_scale=1000.0 there, 1.0 here"):  # only if the source read its time
        check_backbone_options(ckpt, {**target, "attn_softcap": 0.0}, "m", role="init_from", time_conditioned=True)


# --------------------------------------------------------------------- FMLM+ draws: antithetic over the batch


def test_batch_uniforms_take_one_draw_per_stratum_in_random_order():
    from flowlm.objectives.fmlm_plus import batch_uniforms

    u = batch_uniforms(256, generator=torch.Generator().manual_seed(0))
    assert u.dtype == torch.float64 and torch.equal(torch.sort((u * 256).floor()).values, torch.arange(256.0))
    assert (u[1:] > u[:-1]).float().mean().item() < 0.6  # not in stratum order: two draws are not correlated
    iid = batch_uniforms(256, generator=torch.Generator().manual_seed(0), antithetic=False)
    assert len(torch.unique((iid * 256).floor())) < 200  # i.i.d.: ≈ 256·(1 − 1/e) = 162 distinct strata


def test_fmlm_plus_times_and_context_rates_are_stratified_over_the_global_batch():
    from lightning_modules.fmlm_plus import FMLMPlusModule

    module = FMLMPlusModule(
        data_vocab_size=4, seq_len=6, backbone={"d_model": 16, "n_layers": 1, "n_heads": 2, "cond_dim": 8}, optim={}
    )
    assert module.antithetic
    rates = module.sample_context_rates(128, 0)
    assert torch.equal(torch.sort((rates * 128).floor()).values, torch.arange(128.0))
    kinds, s, t = module.sample_pairs(128, 0)
    gap = (t - s).double()  # off-diagonal rows: t − s = u1; diagonal rows s = t = u1
    u1 = torch.where(kinds == 0, s.double(), gap)
    strata = (u1[(kinds == 0) | (kinds == 2)] * 128).floor()
    assert len(torch.unique(strata)) == len(strata)  # no two rows share a stratum
    module.antithetic = False
    assert len(torch.unique((module.sample_context_rates(128, 0) * 128).floor())) < 110


def test_an_init_source_with_another_attention_cap_is_refused_before_compute(tmp_path):
    from lightning_modules.fmlm_plus import FMLMPlusModule

    _save(_mdm(attn_softcap=0.0), tmp_path / "mdm.ckpt")
    small = {"d_model": 32, "n_layers": 1, "n_heads": 4, "cond_dim": 16}
    flow = FMLMPlusModule(data_vocab_size=5, seq_len=6, backbone=small, optim={}, init_from=str(tmp_path / "mdm.ckpt"))
    with pytest.raises(ValueError, match="attn_softcap=0.0 there, 50.0 here"):
        flow.validate_inputs()
    FMLMPlusModule(
        data_vocab_size=5,
        seq_len=6,
        backbone={**small, "attn_softcap": 0.0},
        optim={},
        init_from=str(tmp_path / "mdm.ckpt"),
    ).validate_inputs()


def test_fmlm_plus_training_step_uses_the_stratified_context_rates(monkeypatch):
    from lightning_modules.fmlm_plus import FMLMPlusModule

    backbone = {"d_model": 16, "n_layers": 1, "n_heads": 2, "cond_dim": 8}
    module = FMLMPlusModule(data_vocab_size=4, seq_len=6, backbone=backbone, optim={})
    seen = {}
    real = module.draws_at

    def recording(batch, kinds, s, t, gen, **kwargs):
        seen.update(kwargs)
        return real(batch, kinds, s, t, gen, **kwargs)

    monkeypatch.setattr(module, "draws_at", recording)
    monkeypatch.setattr(module, "log", lambda *a, **k: None)
    batch = {"tokens": torch.randint(0, 4, (8, 6)), "prompt_mask": torch.zeros(8, 6, dtype=torch.bool)}
    module.training_step(batch, 0)
    assert torch.equal(seen["rates"], module.sample_context_rates(8, 0).float())
