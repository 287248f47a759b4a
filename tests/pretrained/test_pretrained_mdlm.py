"""MDLM-OWT checkpoints read into the suite's DiT (docs/pretrained.md, MDLM), hub names through the HF cache.

No downloads: tiny random checkpoints are written in MDLM's two layouts (the HF folder: config.json +
model.safetensors with ``backbone.*`` keys, incl. the bare ``vocab_embed.embedding``; the Lightning .ckpt with
EMA ``shadow_params``), loaded through the suite's one entry point (``read_checkpoint`` / ``load_module``) and
compared with ``mdlm_reference``: MDLM's DiT forward written here from its published block equations on MDLM's
own tensor names, in float32. Tolerance: 1e-5 absolute on logits of size ≈ 1 (the two differ only in float32
operation order: fused vs separate LayerNorm weight, SDPA vs an explicit softmax).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from safetensors.torch import save_file

from flowlm.backbones.dit import build_dit
from flowlm.pretrained.formats import PAD_LOGIT
from flowlm.pretrained.hub import SourceUnavailableError, resolve_source
from flowlm.pretrained.mdlm import mdlm_backbone, mdlm_parameter_count
from flowlm.project import CONF_DIR
from lightning_modules.checkpoints import check_backbone_options, load_module, read_checkpoint
from lightning_modules.fmlm_plus import FMLMPlusModule
from lightning_modules.mdm import MDMModule
from lightning_modules.mlfm import MLFMModule

DATA = 10  # data tokens; MDLM's [MASK] is row DATA (vocab_size = DATA + 1, as GPT-2's 50 257 + 1)
VOCAB, D, HEADS, COND, BLOCKS, L = DATA + 1, 32, 4, 16, 2, 8
ATOL = 1e-5
# The suite's DiT options that compute MDLM's DiT (conf/backbone/mdlm_owt.yaml at tiny sizes).
BACKBONE = {
    "d_model": D,
    "n_layers": BLOCKS,
    "n_heads": HEADS,
    "cond_dim": COND,
    "mlp_ratio": 4,
    "dropout": 0.1,
    "attn_softcap": 0.0,
    "attn_dropout": 0.0,
}


# ------------------------------------------------------------------------------- MDLM's format, written by hand
def mdlm_tensors(seed: int, vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    """A random MDLM DiT state dict (unprefixed names, MDLM's module registration order = parameters() order)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 0.3, one: bool = False) -> torch.Tensor:
        return (1.0 if one else 0.0) + scale * torch.randn(*shape, generator=g)

    state = {
        "vocab_embed.embedding": rnd(vocab, D, scale=1.0),
        "sigma_map.mlp.0.weight": rnd(COND, 256, scale=0.1),
        "sigma_map.mlp.0.bias": rnd(COND),
        "sigma_map.mlp.2.weight": rnd(COND, COND),
        "sigma_map.mlp.2.bias": rnd(COND),
    }
    for i in range(BLOCKS):
        state |= {
            f"blocks.{i}.norm1.weight": rnd(D, scale=0.1, one=True),
            f"blocks.{i}.attn_qkv.weight": rnd(3 * D, D),
            f"blocks.{i}.attn_out.weight": rnd(D, D),
            f"blocks.{i}.norm2.weight": rnd(D, scale=0.1, one=True),
            f"blocks.{i}.mlp.0.weight": rnd(4 * D, D),
            f"blocks.{i}.mlp.0.bias": rnd(4 * D),
            f"blocks.{i}.mlp.2.weight": rnd(D, 4 * D, scale=0.1),
            f"blocks.{i}.mlp.2.bias": rnd(D),
            f"blocks.{i}.adaLN_modulation.weight": rnd(6 * D, COND),  # non-zero: gates and shifts matter
            f"blocks.{i}.adaLN_modulation.bias": rnd(6 * D),
        }
    state |= {
        "output_layer.norm_final.weight": rnd(D, scale=0.1, one=True),
        "output_layer.linear.weight": rnd(vocab, D),
        "output_layer.linear.bias": rnd(vocab),  # MDLM's head has a bias
        "output_layer.adaLN_modulation.weight": rnd(2 * D, COND),
        "output_layer.adaLN_modulation.bias": rnd(2 * D),
    }
    return state


def inv_freq(head: int = D // HEADS, base: float = 10_000.0) -> torch.Tensor:
    """MDLM's Rotary buffer: 1 / base^(2i/head)."""
    return 1.0 / (base ** (torch.arange(0, head, 2).float() / head))


def write_hf_folder(path, state, *, with_inv_freq=True, dtype=torch.float32, **config) -> None:
    """The HF layout: config.json (MDLMConfig fields) + model.safetensors with ``backbone.*`` keys."""
    path.mkdir(parents=True, exist_ok=True)
    tensors = {f"backbone.{k}": v.to(dtype).contiguous() for k, v in state.items()}
    if with_inv_freq:
        tensors["backbone.rotary_emb.inv_freq"] = inv_freq()
    save_file(tensors, str(path / "model.safetensors"))
    fields = {
        "model_type": "mdlm",
        "vocab_size": VOCAB,
        "model_length": L,
        "hidden_dim": D,
        "cond_dim": COND,
        "n_blocks": BLOCKS,
        "n_heads": HEADS,
        "dropout": 0.1,
        "time_conditioning": False,
        **config,
    }
    (path / "config.json").write_text(json.dumps(fields))


def write_lightning_ckpt(path, live, ema, *, time_conditioning=False, n_heads=HEADS) -> None:
    """MDLM's Lightning .ckpt: live ``backbone.*`` weights (+ the wrapper's own tensors), EMA shadow params in
    backbone.parameters() order, the Hydra config as an OmegaConf DictConfig."""
    state = {f"backbone.{k}": v for k, v in live.items()} | {"backbone.rotary_emb.inv_freq": inv_freq()}
    state["train_metrics.nll.mean_value"] = torch.tensor(0.0)  # the Diffusion module's metric states
    config = OmegaConf.create(
        {
            "backbone": "dit",
            "parameterization": "subs",
            "time_conditioning": time_conditioning,
            "model": {"hidden_size": D, "cond_dim": COND, "length": L, "n_blocks": BLOCKS, "n_heads": n_heads},
        }
    )
    config.model.dropout = 0.1
    torch.save(
        {
            "state_dict": state,
            "ema": {"decay": 0.9999, "num_updates": 7, "shadow_params": list(ema.values())},
            "hyper_parameters": {"config": config},
            "loops": {},
            "global_step": 7,
        },
        path,
    )


# --------------------------------------------------------------------- MDLM's forward from its equations
def mdlm_reference(state: dict[str, torch.Tensor], x: torch.Tensor, *, embedded: bool = False) -> torch.Tensor:
    """MDLM's DIT.forward (models/dit.py) in float32 for σ = 0 (time_conditioning False), from its equations:
    c = SiLU(MLP([cos 0·ω; sin 0·ω])); per block, (shift, scale, gate)×2 = W c + b and
    x ← x + gate_msa ⊙ W_out Attn(RoPE(W_qkv (LN(x)·(1 + scale_msa) + shift_msa))),
    x ← x + gate_mlp ⊙ MLP(LN(x)·(1 + scale_mlp) + shift_mlp); LN(x) = layer_norm(x) · w (no bias);
    out = W_head (LN(x)·(1 + scale) + shift) + b_head."""
    s = {k: v.float() for k, v in state.items()}
    h = x.float() if embedded else s["vocab_embed.embedding"][x]
    b, n, d = h.shape
    hd = d // HEADS
    half = 128
    freqs = torch.exp(-math.log(10_000) * torch.arange(half, dtype=torch.float32) / half)
    sig = torch.zeros(b)[:, None] * freqs  # σ ≡ 0
    t = torch.cat([torch.cos(sig), torch.sin(sig)], -1)
    t = F.silu(t @ s["sigma_map.mlp.0.weight"].T + s["sigma_map.mlp.0.bias"])
    c = F.silu(t @ s["sigma_map.mlp.2.weight"].T + s["sigma_map.mlp.2.bias"])[:, None]  # (B, 1, cond)

    def ln(v, w):
        mu = v.mean(-1, keepdim=True)
        var = v.var(-1, unbiased=False, keepdim=True)
        return (v - mu) / torch.sqrt(var + 1e-5) * w

    angles = torch.outer(torch.arange(n, dtype=torch.float32), inv_freq(hd))  # (L, hd/2)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    def rope(v):  # half-split (NeoX), as flash_attn's apply_rotary_emb_qkv_ non-interleaved
        v1, v2 = v[..., : hd // 2], v[..., hd // 2 :]
        return v * cos + torch.cat([-v2, v1], -1) * sin

    for i in range(BLOCKS):
        p = f"blocks.{i}."
        mods = c @ s[p + "adaLN_modulation.weight"].T + s[p + "adaLN_modulation.bias"]
        sh_a, sc_a, g_a, sh_m, sc_m, g_m = mods.chunk(6, -1)
        u = ln(h, s[p + "norm1.weight"]) * (1 + sc_a) + sh_a
        qkv = (u @ s[p + "attn_qkv.weight"].T).view(b, n, 3, HEADS, hd)  # rows [Q; K; V], head-major
        q, k, v = (qkv[:, :, j].transpose(1, 2) for j in range(3))  # (B, H, L, hd)
        q, k = rope(q), rope(k)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd), -1) @ v
        h = h + g_a * (att.transpose(1, 2).reshape(b, n, d) @ s[p + "attn_out.weight"].T)  # plain gate
        u = ln(h, s[p + "norm2.weight"]) * (1 + sc_m) + sh_m
        u = F.gelu(u @ s[p + "mlp.0.weight"].T + s[p + "mlp.0.bias"], approximate="tanh")
        h = h + g_m * (u @ s[p + "mlp.2.weight"].T + s[p + "mlp.2.bias"])
    shift, scale = (c @ s["output_layer.adaLN_modulation.weight"].T + s["output_layer.adaLN_modulation.bias"]).chunk(
        2, -1
    )
    u = ln(h, s["output_layer.norm_final.weight"]) * (1 + scale) + shift
    return u @ s["output_layer.linear.weight"].T + s["output_layer.linear.bias"]


def ids(seed: int = 0, batch: int = 3) -> torch.Tensor:
    """Token ids with some [MASK]s (= DATA)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, DATA, (batch, L), generator=g)
    return x.masked_fill(torch.rand(batch, L, generator=g) < 0.4, DATA)


# ---------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("with_inv_freq", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_folder_computes_mdlms_forward(tmp_path, with_inv_freq, dtype):
    """The HF layout, with and without the rotary buffer, fp32 or bf16 tensors: the loaded MDM's logits are MDLM's
    (at any t: the OWT model is time-agnostic)."""
    state = mdlm_tensors(0)
    write_hf_folder(tmp_path / "mdlm", state, with_inv_freq=with_inv_freq, dtype=dtype)
    module = load_module(tmp_path / "mdlm").eval()
    assert isinstance(module, MDMModule) and module.mask_id == DATA
    assert module.net.embed.weight.dtype == torch.float32  # bf16 weights upcast exactly
    x = ids()
    ref = mdlm_reference({k: v.to(dtype) for k, v in state.items()}, x)
    with torch.no_grad():
        for t in (torch.zeros(3), torch.rand(3)):
            torch.testing.assert_close(module(x, t), ref, atol=ATOL, rtol=0)
    assert ref.abs().max() > 1  # logits of size ≈ 1: the tolerance is meaningful
    meta = read_checkpoint(tmp_path / "mdlm")["flowlm"]
    assert meta["family"] == "mdm" and meta["data_vocab_size"] == DATA and meta["seq_len"] == L


def test_layer_norms_run_in_float32_under_bf16_autocast(tmp_path):
    """MDLM normalises in float32 (``F.layer_norm(x.float())``) inside bf16 autocast; the suite's LayerNorms do too
    because the residual stream they read stays float32 (an fp32 embedding plus bf16 branch updates)."""
    write_hf_folder(tmp_path / "mdlm", mdlm_tensors(0))
    module = load_module(tmp_path / "mdlm").eval()
    norms = [m for name, m in module.net.named_modules() if name.endswith(("norm1", "norm2", "final.norm"))]
    seen = []
    for norm in norms:
        norm.register_forward_hook(lambda mod, args, out: seen.append((args[0].dtype, out.dtype)))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = module(ids(), torch.zeros(3))
    assert out.dtype == torch.bfloat16  # the autocast really ran
    assert len(seen) == 2 * BLOCKS + 1 and set(seen) == {(torch.float32, torch.float32)}


def test_mdlm_owt_backbone_config_is_what_the_reader_builds():
    """conf/backbone/mdlm_owt.yaml is the reader's backbone for MDLM-OWT's shapes (so ``backbone=mdlm_owt`` passes
    the backbone check), and those shapes have MDLM-OWT's 169 627 218 parameters."""
    cfg = OmegaConf.to_container(OmegaConf.load(Path(CONF_DIR) / "backbone" / "mdlm_owt.yaml"))
    assert cfg == mdlm_backbone({"d_model": 768, "n_layers": 12, "cond_dim": 128}, n_heads=12, dropout=0.1)
    assert mdlm_parameter_count(50_258, 768, 128, 12) == 169_627_218
    with torch.device("meta"):  # shapes only: no memory, no init
        net = build_dit(vocab_size=50_258, **cfg)
    assert sum(p.numel() for p in net.parameters()) == 169_627_218  # the suite's DiT has exactly MDLM's tensors


def test_lightning_ckpt_loads_the_ema_weights(tmp_path):
    """MDLM's .ckpt: the shadow parameters (EMA), not the live state_dict, are the weights; the live ones are kept
    as the checkpoint's ``current_model_state``."""
    live, ema = mdlm_tensors(1), mdlm_tensors(2)
    write_lightning_ckpt(tmp_path / "mdlm.ckpt", live, ema)
    module = load_module(tmp_path / "mdlm.ckpt").eval()
    x = ids(1)
    with torch.no_grad():
        out = module(x, torch.rand(3))
    torch.testing.assert_close(out, mdlm_reference(ema, x), atol=ATOL, rtol=0)
    assert (out - mdlm_reference(live, x)).abs().max() > 0.1  # the two differ: the check can fail
    ckpt = read_checkpoint(tmp_path / "mdlm.ckpt")
    assert torch.equal(ckpt["current_model_state"]["net.blocks.0.qkv.weight"], live["blocks.0.attn_qkv.weight"])
    assert ckpt["flowlm"]["source"]["weights"] == "EMA shadow parameters"


def test_pad_row_for_the_suites_gpt2_data(tmp_path):
    """Read for data with one more token (the suite's GPT-2 data add [PAD] at 50 257, MDLM's [MASK] id): [PAD]
    is inserted before [MASK]; every data logit and the [MASK] logit are MDLM's, the PAD logit is PAD_LOGIT."""
    state = mdlm_tensors(3)
    write_hf_folder(tmp_path / "mdlm", state)
    module = load_module(tmp_path / "mdlm", data_vocab_size=DATA + 1).eval()
    assert module.mask_id == DATA + 1 and module.net.embed.weight.shape[0] == DATA + 2
    x = ids(3)
    with torch.no_grad():
        out = module(torch.where(x == DATA, DATA + 1, x), torch.zeros(3))  # [MASK] moved up by one
    ref = mdlm_reference(state, x)
    torch.testing.assert_close(out[..., :DATA], ref[..., :DATA], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[..., DATA + 1], ref[..., DATA], atol=ATOL, rtol=0)
    assert torch.equal(out[..., DATA], torch.full_like(out[..., DATA], -100.0))
    # log-softmax over the other tokens is unchanged by the PAD row (exp(−100) vanishes next to these logits), up to
    # float32 summation order
    assert out.softmax(-1)[..., DATA].max() < 1e-30
    keep = [*range(DATA), DATA + 1]
    torch.testing.assert_close(out[..., keep].log_softmax(-1), out.log_softmax(-1)[..., keep], atol=1e-6, rtol=0)


def _fit_started(cls, **sources):
    """A ``cls`` module on the MDLM-shaped DiT with its pretrained ``sources``, checked and read as at fit start."""
    module = cls(data_vocab_size=DATA, seq_len=L, backbone=BACKBONE, optim={}, **sources)
    module.validate_inputs()
    module.on_fit_start()
    return module


def test_fmlm_plus_init_from_mdlm_computes_mdlms_logits_at_time_zero(tmp_path):
    """FMLM+ initialised from MDLM (``method.init_from``, zero_t_embedding): at s = t = 0, on one-hot inputs, the
    student's logits are MDLM's over the data tokens ([MASK] row dropped)."""
    state = mdlm_tensors(4)
    write_hf_folder(tmp_path / "mdlm", state)
    flow = _fit_started(FMLMPlusModule, init_from=str(tmp_path / "mdlm"), zero_t_embedding=True)
    flow.eval()
    assert flow.init_report["sliced"] == ["embed.weight", "final.linear.weight", "final.linear.bias"]
    x = ids(4).clamp(max=DATA - 1)  # data tokens (a flow state never holds [MASK])
    with torch.no_grad():
        out = flow.net(F.one_hot(x, DATA).float(), torch.zeros(3), torch.zeros(3))
    torch.testing.assert_close(out, mdlm_reference(state, x)[..., :DATA], atol=ATOL, rtol=0)


def test_fmlm_plus_teacher_from_mdlm(tmp_path):
    """The frozen MDM teacher of a distilled FMLM+ (``method.teacher``) read from MDLM's .ckpt: MDLM's EMA logits."""
    live, ema = mdlm_tensors(5), mdlm_tensors(6)
    write_lightning_ckpt(tmp_path / "mdlm.ckpt", live, ema)
    flow = _fit_started(FMLMPlusModule, teacher=str(tmp_path / "mdlm.ckpt"), shares={"distill": 0.25})
    teachers = flow.teachers()
    assert teachers["mask_id"] == DATA
    x = ids(5)
    with torch.no_grad():
        out = teachers["mdm_teacher"](x, torch.rand(3))
    torch.testing.assert_close(out, mdlm_reference(ema, x)[..., :DATA], atol=ATOL, rtol=0)


def test_mlfm_adapter_from_mdlm_computes_mdlms_logits_at_init(tmp_path):
    """MLFM adapted from MDLM: with the zero-initialised adapter, at any bridge time, the logits of the embedded
    tokens are MDLM's (MLFM's identity at init, methods.md §6)."""
    state = mdlm_tensors(7)
    write_hf_folder(tmp_path / "mdlm", state)
    module = _fit_started(MLFMModule, init_from=str(tmp_path / "mdlm"))
    module.eval()
    x = ids(7)
    ref = mdlm_reference(state, x)
    with torch.no_grad():
        for t in (torch.zeros(3), torch.rand(3)):
            torch.testing.assert_close(module(module.net.embeddings[x], t), ref, atol=ATOL, rtol=0)
        torch.testing.assert_close(module.net.base.forward_embeddings(state["vocab_embed.embedding"][x], 0 * t), ref)


def test_wrong_layouts_are_refused_naming_what_is_wrong(tmp_path):
    """Missing, unexpected or misshapen tensors, a time-conditioned MDLM, another rotary, an EMA list out of
    order, and a run backbone with another attention are refused before any compute, naming the cause."""
    state = mdlm_tensors(8)
    cases = {
        "missing blocks.1.mlp.2.bias": {k: v for k, v in state.items() if k != "blocks.1.mlp.2.bias"},
        "unexpected blocks.0.extra.weight": state | {"blocks.0.extra.weight": torch.zeros(2)},
        r"blocks.0.attn_out.weight has shape \(32, 16\)": state | {"blocks.0.attn_out.weight": torch.zeros(D, 16)},
    }
    for i, (message, bad) in enumerate(cases.items()):
        write_hf_folder(tmp_path / f"bad{i}", bad)
        with pytest.raises(ValueError, match=message):
            read_checkpoint(tmp_path / f"bad{i}")
    write_hf_folder(tmp_path / "timed", state, time_conditioning=True)
    with pytest.raises(ValueError, match="time-conditioned MDLM"):
        read_checkpoint(tmp_path / "timed")
    write_hf_folder(tmp_path / "heads", state, n_heads=2)  # inv_freq says head 8, the config head 16
    with pytest.raises(ValueError, match="rotary of head size 16"):
        read_checkpoint(tmp_path / "heads")
    write_hf_folder(tmp_path / "sizes", state, n_blocks=3)
    with pytest.raises(ValueError, match="n_blocks=3 vs 2"):
        read_checkpoint(tmp_path / "sizes")
    ema = dict(reversed(list(state.items())))
    write_lightning_ckpt(tmp_path / "order.ckpt", state, ema)
    with pytest.raises(ValueError, match="not in backbone.parameters\\(\\) order"):
        read_checkpoint(tmp_path / "order.ckpt")
    write_lightning_ckpt(tmp_path / "timed.ckpt", state, state, time_conditioning=True)
    with pytest.raises(ValueError, match="time-conditioned MDLM"):
        read_checkpoint(tmp_path / "timed.ckpt")
    # not MDLM at all: a safetensors folder of other names
    (tmp_path / "other").mkdir()
    save_file({"w": torch.zeros(2)}, str(tmp_path / "other" / "model.safetensors"))
    with pytest.raises(ValueError, match="nor any of the pretrained layouts read here.*mdlm-hf"):
        read_checkpoint(tmp_path / "other")
    # the suite's `tiny` backbone (soft-capped attention) would compute another function with MDLM's weights
    write_hf_folder(tmp_path / "ok", state)
    with pytest.raises(ValueError, match="attn_softcap=0.0 there, 50.0 here"):
        check_backbone_options(
            read_checkpoint(tmp_path / "ok"), {}, tmp_path / "ok", role="init_from", time_conditioned=False
        )
    mlfm = MLFMModule(data_vocab_size=DATA + 3, seq_len=L, backbone=BACKBONE, optim={}, init_from=str(tmp_path / "ok"))
    with pytest.raises(ValueError, match="vocabulary of 10 data tokens, this run has 13"):
        mlfm.validate_inputs()


def _fake_hub_cache(cache, repo: str, state) -> None:
    """The Hugging Face cache layout of one snapshot: models--owner--name/{refs/main, snapshots/<commit>/…}."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    write_hf_folder(folder / "snapshots" / commit, state)
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)


def test_hub_name_resolves_through_the_cache_offline(tmp_path, monkeypatch):
    """A hub name reads the cached snapshot offline (HF_HUB_OFFLINE=1, HF_HUB_CACHE); a missing one fails at once
    with the ways to provide it; a missing local path is a plain 'checkpoint not found'."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    state = mdlm_tensors(9)
    _fake_hub_cache(tmp_path / "cache", "kuleshov-group/mdlm-owt", state)
    import huggingface_hub

    calls, real = [], huggingface_hub.snapshot_download
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    module = load_module("kuleshov-group/mdlm-owt").eval()
    x = ids(9)
    with torch.no_grad():
        torch.testing.assert_close(module(x, torch.zeros(3)), mdlm_reference(state, x), atol=ATOL, rtol=0)
    assert resolve_source("kuleshov-group/mdlm-owt").parent.name == "snapshots"
    assert calls and all(kw["local_files_only"] for kw in calls)  # offline: the hub is never asked
    assert {kw["cache_dir"] for kw in calls} == {tmp_path / "cache"}  # HF_HUB_CACHE, read at call time
    start = time.perf_counter()
    with pytest.raises(SourceUnavailableError) as err:
        MLFMModule(
            data_vocab_size=DATA, seq_len=L, backbone=BACKBONE, optim={}, init_from="someone/missing-mdlm"
        ).validate_inputs()
    assert time.perf_counter() - start < 5  # at once, before any compute
    text = str(err.value)
    for way in ("huggingface-cli download someone/missing-mdlm", "HF_HUB_CACHE", "local path", "HF_HUB_OFFLINE"):
        assert way in text, way
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        read_checkpoint(tmp_path / "missing.ckpt")
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        read_checkpoint("runs/missing/last.ckpt")  # a relative path that looks like owner/name is not a hub name


@pytest.mark.slow
def test_flowlm_eval_scores_an_mdlm_folder_on_the_suites_text_data(tmp_path, runs_env):
    """``flowlm-eval ckpt_path=<MDLM folder> data=...``: MDLM over the tiny tokenizer's 512 tokens (+ [MASK]) read
    for the suite's text data (512 + [PAD]): the PAD row is added, the samplers run and score."""
    from conftest import compose_config

    from runners.evaluate import evaluate

    write_hf_folder(tmp_path / "mdlm", mdlm_tensors(10, vocab=513), vocab_size=513, model_length=64)
    overrides = [
        f"ckpt_path={tmp_path / 'mdlm'}",
        "data=tiny_owt",
        "eval=text_mdm",
        "eval.metric.evaluator=data/cpu/tiny_evaluator",
        "eval.nfe=[4]",
        "eval.max_batches=1",
        "data.batch_size=4",
        "logger=none",
    ]
    out = evaluate(compose_config("eval", overrides=overrides))
    assert out["rows"] and all(row["nfe"] <= 4 and row[out["metric"]] > 1 for row in out["rows"])
    assert {row["run"] for row in out["rows"]} == {"checkpoint"}


def test_the_shipped_tiny_mdlm_folder_is_current_and_reads_as_at_paper_scale():
    """data/cpu/tiny_mdlm (scale=cpu of owt_fmlm_plus_init_mdlm / owt_mlfm_mdlm) is what its make.py writes; it
    resolves and loads through the suite's reader for the run's data (the tiny tokenizer's 512 ids + the [PAD] the
    suite adds = 513 data tokens, MDLM's 512 + [MASK]): the PAD row is inserted as for GPT-2 data and MDLM-OWT, the
    logits are MDLM's forward's, and the configured CPU-scale backbone is the one the reader builds."""
    from conftest import compose_config
    from fixtures.tiny_mdlm.make import CONFIG, CONFIG_FILE, FOLDER, WEIGHTS, build
    from safetensors.torch import load_file

    from datamodules.sources import load_tokenizer

    shipped, fresh = load_file(str(WEIGHTS)), build()
    assert shipped.keys() == fresh.keys(), "stale data/cpu/tiny_mdlm: run its make.py"
    assert all(torch.equal(shipped[k], fresh[k]) for k in fresh), "stale data/cpu/tiny_mdlm: run its make.py"
    assert json.loads(CONFIG_FILE.read_text()) == CONFIG, "stale data/cpu/tiny_mdlm: run its make.py"
    assert (CONFIG["hidden_dim"], CONFIG["n_heads"], CONFIG["n_blocks"]) == (D, HEADS, BLOCKS)  # mdlm_reference's
    tokenizer = load_tokenizer("data/cpu/tiny_tokenizer")
    data = len(tokenizer)  # the run's data vocabulary: [PAD] added at 512, MDLM's [MASK] id
    assert data == CONFIG["vocab_size"] == 513 and tokenizer.pad_token_id == 512
    assert resolve_source(str(FOLDER)) == FOLDER
    ckpt = read_checkpoint(FOLDER, data_vocab_size=data)
    assert "pad_row" in ckpt["flowlm"]["source"] and ckpt["flowlm"]["data_vocab_size"] == data
    for experiment in ("owt_fmlm_plus_init_mdlm", "owt_mlfm_mdlm"):
        cfg = compose_config(overrides=[f"experiment={experiment}", "scale=cpu"])
        assert resolve_source(cfg.method.init_from).resolve() == FOLDER.resolve()
        assert OmegaConf.to_container(cfg.backbone) == ckpt["hyper_parameters"]["backbone"], experiment
    module = load_module(FOLDER, data_vocab_size=data).eval()
    assert module.mask_id == data
    state = {k.removeprefix("backbone."): v for k, v in shipped.items() if not k.endswith("inv_freq")}
    x = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    x[:, ::3] = 512  # MDLM's [MASK]
    with torch.no_grad():
        out = module(torch.where(x == 512, data, x), torch.zeros(2))  # the run's [MASK] is one up
    ref = mdlm_reference(state, x)
    torch.testing.assert_close(out[..., :512], ref[..., :512], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[..., data], ref[..., 512], atol=ATOL, rtol=0)
    assert torch.equal(out[..., 512], torch.full_like(out[..., 512], PAD_LOGIT))
