"""LLaMA-family pretrained MDMs (SMDM, LLaDA, Dream): tiny random checkpoints written in each source's on-disk layout
(names, dtypes, SMDM's per-group interleaved fused QKV, LLaDA/Dream sharded safetensors + index), loaded and compared
with an independent reference, transformers' Llama/Qwen2ForCausalLM built from the equivalent config with
is_causal=False and filled by this file's own writer. Tolerance: max |Δlogit| ≤ 1e-4 in float32 (logits ≈ 1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fixtures.tiny_llama_family import DREAM, LLADA, write_shards
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from flowlm.backbones.llama import BidirectionalLM
from flowlm.pretrained import smdm
from flowlm.pretrained.dream import load_dream
from flowlm.pretrained.files import resolve_source
from flowlm.pretrained.llada import LLADA_8B, load_llada
from flowlm.pretrained.smdm import load_smdm
from flowlm.samplers import ConfidenceSampler, SemiARConfidenceSampler
from tests.process_helpers import gloo_rank, rank_outputs, sharded_step_error

TOL = 1e-4
D, LAYERS, HEADS, INTER = 32, 2, 4, 48


def _reference(arch: str, vocab: int, kv_heads: int, theta: float, eps: float, d: int = D, inter: int = INTER):
    """transformers' own causal-LM class, run bidirectionally, with random bf16-representable weights (norm gains
    too, so a swapped norm shows)."""
    cls, model_cls = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    config = cls(
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=inter,
        hidden_act="silu",  # what BidirectionalLM states (transformers' default)
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=kv_heads,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        rms_norm_eps=eps,
        tie_word_embeddings=False,
        is_causal=False,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = model_cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn_like(p))
            p.copy_(p.bfloat16().float())  # the files hold bf16 (LLaDA, Dream): the reference uses the same values
    return model.eval()


def _ids(vocab: int, mask_id: int, length: int = 9) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, length), generator=gen)
    ids[0, 3] = ids[1, -1] = mask_id  # the [MASK] embedding row is read too
    return ids


# ------------------------------------------------------------------------------------------------------ SMDM
def _smdm_cfg(n_query_groups: int) -> dict:
    # vocab 61 padded to 64 (lit-gpt find_multiple): [MASK] = 64, wte 65 rows, lm_head 64 rows
    return {
        "n_layer": LAYERS,
        "n_head": HEADS,
        "n_embd": D,
        "intermediate_size": INTER,
        "n_query_groups": n_query_groups,
        "vocab_size": 61,
        "padding_multiple": 8,
        "block_size": 64,
    }


def _write_smdm(path, ref, cfg, *, drop=(), fmt="safetensors"):
    """The reference's weights in TransEncoder's names; attn.attn rows [q_{g,0..}, k_g, v_g] per group g."""
    sd = ref.state_dict()
    hs, groups = D // HEADS, cfg["n_query_groups"]
    per = HEADS // groups
    padded = 64
    out = {
        "transformer.wte.weight": sd["model.embed_tokens.weight"],
        "transformer.ln_f.weight": sd["model.norm.weight"],
        "lm_head.weight": sd["lm_head.weight"][:padded],
    }
    for i in range(LAYERS):
        p, h = f"transformer.h.{i}.", f"model.layers.{i}."
        q, k, v = (sd[h + f"self_attn.{n}_proj.weight"] for n in "qkv")
        rows = []
        for g in range(groups):
            rows += [q[(g * per + j) * hs : (g * per + j + 1) * hs] for j in range(per)]
            rows += [k[g * hs : (g + 1) * hs], v[g * hs : (g + 1) * hs]]
        out |= {
            p + "attn.attn.weight": torch.cat(rows),
            p + "attn.proj.weight": sd[h + "self_attn.o_proj.weight"],
            p + "norm_1.weight": sd[h + "input_layernorm.weight"],
            p + "norm_2.weight": sd[h + "post_attention_layernorm.weight"],
            p + "mlp.swiglu.w1.weight": sd[h + "mlp.gate_proj.weight"],
            p + "mlp.swiglu.w2.weight": sd[h + "mlp.up_proj.weight"],
            p + "mlp.swiglu.w3.weight": sd[h + "mlp.down_proj.weight"],
        }
    out = {k: v.contiguous() for k, v in out.items() if k not in drop}
    if fmt == "safetensors":
        save_file(out, str(path))
    else:  # a fabric training checkpoint
        torch.save({"model": out, "iter_num": 3, "hparams": {"name": "tiny"}}, path)
    return path


def _litgpt_forward(sd: dict, cfg: dict, ids: torch.Tensor) -> torch.Tensor:
    """SMDM's TransEncoder forward written from its semantics, straight on the lit-gpt tensors (a second reference,
    independent of transformers and of this file's writer): the fused output viewed (B, T, G, q_per_kv + 2, hs) and
    split (q_per_kv, 1, 1), k/v expanded over each group's queries, NeoX RoPE θ 1e4, RMSNorm eps 1e-5, no mask."""
    d, heads, groups = cfg["n_embd"], cfg["n_head"], cfg["n_query_groups"]
    hs, per, (b, n) = d // heads, heads // groups, ids.shape
    angles = torch.outer(torch.arange(n).float(), 1.0 / 10_000 ** (torch.arange(0, hs, 2).float() / hs))
    cos, sin = angles.cos(), angles.sin()

    def rope(z):
        z1, z2 = z[..., : hs // 2], z[..., hs // 2 :]
        return torch.cat([z1 * cos - z2 * sin, z2 * cos + z1 * sin], -1)

    def rms(z, w):
        return z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    x = sd["transformer.wte.weight"][ids]
    for i in range(cfg["n_layer"]):
        w = {k.removeprefix(f"transformer.h.{i}."): v for k, v in sd.items() if k.startswith(f"transformer.h.{i}.")}
        qkv = (rms(x, w["norm_1.weight"]) @ w["attn.attn.weight"].T).view(b, n, groups, per + 2, hs)
        q, k, v = qkv.split((per, 1, 1), dim=-2)
        k, v = (z.expand(b, n, groups, per, hs) for z in (k, v))
        q, k, v = (z.reshape(b, n, heads, hs).transpose(1, 2) for z in (q, k, v))
        att = torch.softmax(rope(q) @ rope(k).transpose(-1, -2) / hs**0.5, -1) @ v
        x = x + att.transpose(1, 2).reshape(b, n, d) @ w["attn.proj.weight"].T
        h = rms(x, w["norm_2.weight"])
        gate, up = h @ w["mlp.swiglu.w1.weight"].T, h @ w["mlp.swiglu.w2.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w["mlp.swiglu.w3.weight"].T
    return rms(x, sd["transformer.ln_f.weight"]) @ sd["lm_head.weight"].T


@pytest.mark.parametrize("groups", [2, 4, 1], ids=["gqa", "mha", "mqa"])
def test_smdm_loads_to_the_reference_logits(tmp_path, groups):
    cfg = _smdm_cfg(groups)
    ref = _reference("llama", 65, groups, 1e4, 1e-5)
    path = _write_smdm(tmp_path / "m.safetensors", ref, cfg)
    model = load_smdm(path, config=cfg)
    ids = _ids(64, 64)
    with torch.no_grad():
        got, want = model(ids), ref(ids).logits[..., :64]  # lm_head has no [MASK] row
        litgpt = _litgpt_forward(load_file(str(path)), smdm.smdm_config(cfg), ids)
    assert got.shape == (2, 9, 64) and model.mask_id == 64 and model.model.embed_tokens.weight.shape[0] == 65
    assert (got - want).abs().max() < TOL and (got - litgpt).abs().max() < TOL


def test_smdm_pth_training_checkpoint_loads(tmp_path):
    cfg = _smdm_cfg(2)
    ref = _reference("llama", 65, 2, 1e4, 1e-5)
    model = load_smdm(_write_smdm(tmp_path / "m.pth", ref, cfg, fmt="pth"), config=cfg)
    ids = _ids(64, 64)
    with torch.no_grad():
        assert (model(ids) - ref(ids).logits[..., :64]).abs().max() < TOL


def test_a_naive_qkv_split_does_not_reproduce_smdm(tmp_path, monkeypatch):
    """The test above can fail: splitting the fused rows as [Q; K; V] gives garbage logits."""
    cfg = _smdm_cfg(4)
    ref = _reference("llama", 65, 4, 1e4, 1e-5)
    path = _write_smdm(tmp_path / "m.safetensors", ref, cfg)

    def naive(weight, n_head, n_query_groups):
        hs = weight.shape[0] // (n_head + 2 * n_query_groups)
        return weight.split([n_head * hs, n_query_groups * hs, n_query_groups * hs])

    monkeypatch.setattr(smdm, "split_fused_qkv", naive)
    ids = _ids(64, 64)
    with torch.no_grad():
        assert (load_smdm(path, config=cfg)(ids) - ref(ids).logits[..., :64]).abs().max() > 0.1


def test_smdm_file_with_a_missing_key_or_wrong_shape_is_refused_naming_it(tmp_path):
    cfg = _smdm_cfg(2)
    ref = _reference("llama", 65, 2, 1e4, 1e-5)
    path = _write_smdm(tmp_path / "m.safetensors", ref, cfg, drop=("lm_head.weight",))
    with pytest.raises(ValueError, match=r"missing 1 keys.*lm_head\.weight"):
        load_smdm(path, config=cfg)
    path = _write_smdm(tmp_path / "ok.safetensors", ref, cfg)
    with pytest.raises(ValueError, match=r"wrong shapes: transformer\.h\.0\.attn\.attn\.weight \(64, 32\)"):
        load_smdm(path, config={**cfg, "n_query_groups": 4})  # the file was written with 2 groups
    with pytest.raises(ValueError, match=r"unknown SMDM config"):
        load_smdm(path, config="1029M")


def test_named_smdm_1028m_config_has_the_released_shapes():
    keys = smdm.expected_keys(smdm.smdm_config("Diff_LLaMA_1028M"))
    assert keys["transformer.wte.weight"] == (32001, 1792) and keys["lm_head.weight"] == (32000, 1792)
    assert keys["transformer.h.19.attn.attn.weight"] == (5376, 1792) and "transformer.h.20.norm_1.weight" not in keys
    assert sum(torch.Size(s).numel() for s in keys.values()) == 1_142_367_744  # pretrained_mdms.md §1 (run)


# ------------------------------------------------------------------------------------------------------ LLaDA
def _llada_config(vocab: int, d: int, inter: int, kv: int) -> dict:
    """LLaDA's config.json fields (the shipped fixture's) at these sizes; [MASK] = vocab − 4."""
    sizes = {"d_model": d, "n_layers": LAYERS, "n_heads": HEADS, "n_kv_heads": kv, "mlp_hidden_size": inter}
    ids = {"vocab_size": vocab, "embedding_size": vocab, "mask_token_id": vocab - 4, "eos_token_id": 1}
    return {**LLADA, **sizes, **ids, "pad_token_id": 1, "max_sequence_length": 64}


def _write_llada(folder, ref, config):
    sd = ref.state_dict()
    out = {
        "model.transformer.wte.weight": sd["model.embed_tokens.weight"],
        "model.transformer.ln_f.weight": sd["model.norm.weight"],
        "model.transformer.ff_out.weight": sd["lm_head.weight"],
    }
    names = {
        "attn_norm": "input_layernorm",
        "q_proj": "self_attn.q_proj",
        "k_proj": "self_attn.k_proj",
        "v_proj": "self_attn.v_proj",
        "attn_out": "self_attn.o_proj",
        "ff_norm": "post_attention_layernorm",
        "ff_proj": "mlp.gate_proj",
        "up_proj": "mlp.up_proj",
        "ff_out": "mlp.down_proj",
    }
    for i in range(LAYERS):
        out |= {
            f"model.transformer.blocks.{i}.{a}.weight": sd[f"model.layers.{i}.{b}.weight"] for a, b in names.items()
        }
    return write_shards(folder, out, config)


# "square": vocab = d = MLP width, so the head's ff_out and a block's ff_out have the same shape and only the
# logits tell them apart.
@pytest.mark.parametrize(("vocab", "d", "inter", "kv"), [(64, D, INTER, 2), (D, D, D, 4)], ids=["gqa", "square"])
def test_llada_loads_to_the_reference_logits(tmp_path, vocab, d, inter, kv):
    ref = _reference("llama", vocab, kv, 5e5, 1e-5, d=d, inter=inter)
    folder = _write_llada(tmp_path / "llada", ref, _llada_config(vocab, d, inter, kv))
    model = load_llada(folder, dtype="float32")
    ids = _ids(vocab, vocab - 4)
    with torch.no_grad():
        got, want = model(ids), ref(ids).logits
    assert model.mask_id == vocab - 4 and not model.shift_logits
    assert (got - want).abs().max() < TOL
    assert got[:, 0].sub(model(ids.flip(-1).roll(1, -1))[:, 0]).abs().max() > 1e-3  # bidirectional


def test_llada_bad_folders_are_refused_before_loading(tmp_path):
    ref = _reference("llama", 64, 2, 5e5, 1e-5)
    config = _llada_config(64, D, INTER, 2)
    folder = _write_llada(tmp_path / "llada", ref, config)
    with pytest.raises(ValueError, match=r"'d_model': \(32, 4096\)"):
        load_llada(folder, expect=LLADA_8B)
    (folder / "config.json").write_text(json.dumps({**config, "include_bias": True}))
    with pytest.raises(ValueError, match="unsupported settings.*include_bias"):
        load_llada(folder)
    (folder / "config.json").write_text(json.dumps({**config, "mlp_hidden_size": 40}))
    with pytest.raises(ValueError, match=r"wrong shapes: model\.transformer\.blocks\.0\.ff_out\.weight"):
        load_llada(folder)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        load_llada(folder)


# ------------------------------------------------------------------------------------------------------ Dream
def _dream_config(vocab: int) -> dict:
    """Dream's config.json fields (the shipped fixture's) at this file's sizes; [MASK] = vocab − 2."""
    sizes = {"hidden_size": D, "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS}
    ids = {"vocab_size": vocab, "mask_token_id": vocab - 2, "pad_token_id": 1, "eos_token_id": 1}
    return {**DREAM, **sizes, **ids, "num_key_value_heads": 2, "max_position_embeddings": 128}


def test_dream_loads_with_shifted_logits(tmp_path):
    ref = _reference("qwen2", 64, 2, 1e6, 1e-6)
    folder = write_shards(tmp_path / "dream", dict(ref.state_dict()), _dream_config(64))
    model = load_dream(folder, dtype=torch.float32)
    ids = _ids(64, 62)
    with torch.no_grad():
        got, raw = model(ids), ref(ids).logits
    assert model.shift_logits and model.mask_id == 62
    assert (got[:, 1:] - raw[:, :-1]).abs().max() < TOL  # target i is read from output i − 1
    assert (got[:, 0] - raw[:, 0]).abs().max() < TOL  # position 0 keeps its own (never scored)
    assert (got[:, 1:] - raw[:, 1:]).abs().max() > 0.1  # the shift is not a no-op here


def test_dream_samples_after_a_prompt_and_refuses_a_masked_first_position(tmp_path):
    ref = _reference("qwen2", 64, 2, 1e6, 1e-6)
    model = load_dream(write_shards(tmp_path / "dream", dict(ref.state_dict()), _dream_config(64)))
    prompt, prompt_mask = _prompt(model.mask_id)
    with torch.no_grad():
        out = SemiARConfidenceSampler(block_length=4)(model.denoiser(), prompt=prompt, prompt_mask=prompt_mask, nfe=3)
        assert torch.equal(out.tokens[prompt_mask], prompt[prompt_mask]) and not (out.tokens == 62).any()
        with pytest.raises(ValueError, match="position 0"):
            ConfidenceSampler()(model.denoiser(), prompt=prompt, prompt_mask=torch.zeros_like(prompt_mask), nfe=3)


def test_dream_missing_bias_is_refused_naming_it(tmp_path):
    state = {
        k: v
        for k, v in _reference("qwen2", 64, 2, 1e6, 1e-6).state_dict().items()
        if k != "model.layers.1.self_attn.k_proj.bias"
    }
    folder = write_shards(tmp_path / "dream", state, _dream_config(64))
    with pytest.raises(ValueError, match=r"missing 1 keys.*model\.layers\.1\.self_attn\.k_proj\.bias"):
        load_dream(folder)


# ------------------------------------------------------------------------------------------------------ sources
def test_a_hub_name_not_in_the_cache_fails_at_once_saying_how_to_provide_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(FileNotFoundError, match="huggingface-cli download GSAI-ML/LLaDA-8B-Base.*local path"):
        load_llada("GSAI-ML/LLaDA-8B-Base")
    with pytest.raises(
        FileNotFoundError,
        match=r"(?s)'nieshen/SMDM' is not a local path.*huggingface-cli download nieshen/SMDM.*local path",
    ):
        resolve_source("nieshen/SMDM", filename="mdm_safetensors/x.safetensors")
    with pytest.raises(FileNotFoundError, match="neither a local path nor a hub name"):
        resolve_source(str(tmp_path / "absent" / "file.safetensors"))


# ------------------------------------------------------------------------------------------------------ samplers
@pytest.fixture
def llada_model(tmp_path) -> BidirectionalLM:
    ref = _reference("llama", 64, 2, 5e5, 1e-5)
    return load_llada(_write_llada(tmp_path / "llada", ref, _llada_config(64, D, INTER, 2)))


def _prompt(mask_id: int, length: int = 14, n_prompt: int = 4):
    prompt = torch.randint(0, mask_id, (2, length), generator=torch.Generator().manual_seed(2))
    prompt_mask = torch.zeros(2, length, dtype=torch.bool)
    prompt_mask[:, :n_prompt] = True
    return prompt, prompt_mask


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_confidence_samplers_run_on_the_loaded_model_and_keep_the_prompt(llada_model, temperature):
    prompt, prompt_mask = _prompt(llada_model.mask_id)
    for sampler, nfe in (
        (ConfidenceSampler(temperature=temperature, score="sampled"), 5),
        (SemiARConfidenceSampler(block_length=4, temperature=temperature), 6),
    ):
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            out = sampler(llada_model.denoiser(), prompt=prompt, prompt_mask=prompt_mask, nfe=nfe, generator=gen)
        assert torch.equal(out.tokens[prompt_mask], prompt[prompt_mask])
        assert not (out.tokens == llada_model.mask_id).any()  # [MASK] is inside LLaDA's vocabulary: never proposed
        assert out.nfe == nfe and bool(((out.confidence >= 0) & (out.confidence <= 1)).all())


def test_semi_ar_fills_blocks_left_to_right(llada_model):
    prompt, prompt_mask = _prompt(llada_model.mask_id)  # 10 free positions: blocks 4, 4, 2
    seen = []
    base = llada_model.denoiser()

    def fn(x, t):
        seen.append(x.clone())
        return base.fn(x, t)

    model = type(base)(fn=fn, mask_id=base.mask_id)
    with torch.no_grad():
        out = SemiARConfidenceSampler(block_length=4)(model, prompt=prompt, prompt_mask=prompt_mask, nfe=6)
    assert out.nfe == 6 and len(seen) == 6  # 3 blocks × 2 steps
    for step, x in enumerate(seen):  # before call 2b, blocks < b are done and blocks ≥ b untouched
        b, masked = step // 2, x[:, 4:] == llada_model.mask_id
        assert not masked[:, : 4 * b].any() and masked[:, 4 * (b + 1) :].all()
    with pytest.raises(ValueError, match="3 blocks of 4 need at least 3 NFE"):
        SemiARConfidenceSampler(block_length=4).check_budget(2, free_positions=10)


def test_the_time_argument_is_ignored(llada_model):
    ids = _ids(64, 60)
    with torch.no_grad():
        assert torch.equal(llada_model(ids, torch.rand(2)), llada_model(ids))


def test_samplers_never_see_a_mask_logit_inside_the_vocabulary(llada_model):
    ids = _ids(64, 60)
    with torch.no_grad():
        logits, raw = llada_model.token_logits(ids), llada_model(ids)
    assert torch.isneginf(logits[..., 60]).all()
    assert torch.equal(logits[..., :60], raw[..., :60]) and torch.equal(logits[..., 61:], raw[..., 61:])


# ------------------------------------------------------------------------------------------------------ adapters
@pytest.mark.parametrize("source", ["smdm", "dream"])
@pytest.mark.parametrize("two_times", [False, True], ids=["mlfm", "fmlm_plus"])
def test_adapted_model_at_init_computes_the_mdm_logits(tmp_path, source, two_times):
    """MLFM (one bridge time per sequence, on embeddings) and FMLM+ init (per-token (s, t), continuous x·E input):
    zero adaLN and LoRA B = 0 give the loaded MDM's logits; a nonzero modulation changes them (the hooks act)."""
    from flowlm.backbones.llama import LlamaAdaLNAdapter

    if source == "smdm":
        cfg = _smdm_cfg(2)
        base = load_smdm(
            _write_smdm(tmp_path / "m.safetensors", _reference("llama", 65, 2, 1e4, 1e-5), cfg), config=cfg
        )
    else:
        ref = _reference("qwen2", 64, 2, 1e6, 1e-6)
        base = load_dream(write_shards(tmp_path / "dream", dict(ref.state_dict()), _dream_config(64)))
    ids = _ids(base.head_rows, base.mask_id)
    with torch.no_grad():
        want = base(ids)
        x = torch.softmax(torch.randn(2, 9, base.vocab_size), -1)  # FMLM+-style vectors over the embedding rows
        want_x = base(x)
    adapter = LlamaAdaLNAdapter(base, cond_dim=16, two_times=two_times, lora_rank=4)
    assert adapter.lora_names[-1] == "lm_head" and any("lora_B" in n for n, _ in base.named_parameters())
    s = torch.rand(2, 9) if two_times else torch.rand(2)
    t = torch.rand(2, 9) if two_times else None
    with torch.no_grad():
        assert (adapter(ids, s, t) - want).abs().max() < 1e-5
        assert (adapter.forward_embeddings(adapter.embeddings[ids], s, t) - want).abs().max() < 1e-5
        if two_times:
            assert (adapter(x, s, t) - want_x).abs().max() < 1e-5
        trainable = {n for n, p in adapter.named_parameters() if p.requires_grad}
        assert trainable and all(".lora_" in n or n.startswith(("emb_", "layer_mods")) for n in trainable)
        for mod in adapter.layer_mods:
            torch.nn.init.normal_(mod.weight, std=0.5)
        assert (adapter(ids, s, t) - want).abs().max() > 1e-2
        if two_times:  # both times reach the modulation
            assert (adapter(ids, s, t) - adapter(ids, s, t.flip(-1))).abs().max() > 1e-3
            assert (adapter(ids, s, t) - adapter(ids, s.flip(-1), t)).abs().max() > 1e-3
        assert torch.equal(base(ids), want)  # the base called alone is untouched by the hooks


@pytest.mark.parametrize(("slot", "zeroed"), [(2, "self_attn.o_proj"), (4, "mlp.down_proj")], ids=["gate1", "scale2"])
def test_adapter_modulation_slots_act_where_the_equations_say(tmp_path, slot, zeroed):
    """gate₁ = −1 removes the attention branch ((1 + gate) form), scale₂ = −1 zeroes the MLP's input (SwiGLU(0) = 0):
    each equals the MDM with that branch's output projection zeroed, so the chunk order is checked too."""
    import copy

    from flowlm.backbones.llama import LlamaAdaLNAdapter

    cfg = _smdm_cfg(2)
    base = load_smdm(_write_smdm(tmp_path / "m.safetensors", _reference("llama", 65, 2, 1e4, 1e-5), cfg), config=cfg)
    cut = copy.deepcopy(base)
    adapter = LlamaAdaLNAdapter(base, cond_dim=16, lora_rank=0)
    with torch.no_grad():
        for i, mod in enumerate(adapter.layer_mods):
            mod.bias[slot * D : (slot + 1) * D] = -1.0
            cut.get_submodule(f"model.layers.{i}.{zeroed}").weight.zero_()
        ids = _ids(64, 64)
        assert (adapter(ids, torch.rand(2)) - cut(ids)).abs().max() < 1e-5
        assert (cut(ids) - base(ids)).abs().max() > 1e-2


# ------------------------------------------------------------------------------------------------------ configs
def test_backbone_configs_build_or_fail_offline_saying_how_to_provide_the_source(tmp_path, monkeypatch):
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from flowlm.pretrained.dream import DREAM_7B
    from flowlm.project import CONF_DIR

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    folder = Path(CONF_DIR) / "backbone" / "llama"
    confs = {path.stem: OmegaConf.load(path) for path in folder.glob("*.yaml")}
    assert set(confs) == {"tiny", "smdm_1028m", "llada_8b", "dream_7b"}
    tiny = instantiate(confs["tiny"])
    assert isinstance(tiny, BidirectionalLM) and tiny(torch.tensor([[1, 64, 3]])).shape == (1, 3, 64)
    assert dict(confs["llada_8b"].expect) == LLADA_8B and dict(confs["dream_7b"].expect) == DREAM_7B
    smdm.smdm_config(confs["smdm_1028m"].config)  # a known named config
    for name in ("smdm_1028m", "llada_8b", "dream_7b"):
        with pytest.raises(InstantiationException, match="SourceUnavailableError.*huggingface-cli download"):
            instantiate(confs[name])  # hydra wraps the resolver's SourceUnavailableError (a FileNotFoundError)


# ------------------------------------------------------------------------------------------------------ FSDP2
def _fsdp_worker(rank: int, init_file: str, out_dir: str) -> None:
    """Rank r of 2: FSDP2 over the decoder layers and the adapter, its half of the batch, one step; compared with
    the unsharded model on the whole batch (the gradient mean over ranks = the full batch's)."""
    with gloo_rank(rank, init_file):
        diff, n_dtensor = sharded_step_error(rank)
        Path(out_dir, f"rank{rank}").write_text(f"{diff:.3e} {n_dtensor}")


@pytest.mark.slow
def test_fsdp2_on_two_cpu_processes_trains_the_adapted_llama_like_one_process(tmp_path):
    # a hang fails the test instead of blocking it
    for rank, out in enumerate(rank_outputs(_fsdp_worker, tmp_path, timeout_s=180, what="FSDP2 ranks")):
        diff, n_dtensor = out.split()
        assert float(diff) < 1e-5 and int(n_dtensor) > 0, (rank, diff, n_dtensor)


# ------------------------------------------------------------------------------ FSDP2: weights from rank 0 alone
def _deferred_sources(tmp_path):
    """A tiny SMDM .pth, LLaDA and Dream folder, each with its loader (float32 LLaDA, stored dtypes otherwise)."""
    llada = _write_llada(tmp_path / "llada", _reference("llama", 64, 2, 5e5, 1e-5), _llada_config(64, D, INTER, 2))
    dream = write_shards(
        tmp_path / "dream", dict(_reference("qwen2", 64, 2, 1e6, 1e-6).state_dict()), _dream_config(64)
    )
    cfg = _smdm_cfg(2)
    pth = _write_smdm(tmp_path / "smdm.pth", _reference("llama", 65, 2, 1e4, 1e-5), cfg, fmt="pth")
    return {
        "llada": lambda: load_llada(llada, dtype="float32"),
        "dream": lambda: load_dream(dream),
        "smdm": lambda: load_smdm(pth, config=cfg),
    }


def test_a_deferred_load_reads_no_data_but_checks_the_files(tmp_path, monkeypatch):
    """Inside tensors_from_rank_zero(True) the three loaders build the same model on the meta device (same names,
    shapes and dtypes, RoPE buffers too) without reading a tensor; a wrong file is still refused there."""
    import safetensors
    from safetensors import safe_open

    from flowlm.pretrained.files import load_tensors, reads_deferred, tensors_from_rank_zero

    loaders = _deferred_sources(tmp_path)
    for name, load in loaders.items():
        real = load()
        with tensors_from_rank_zero(True):
            assert reads_deferred()
            deferred = load()
        assert not reads_deferred()
        got = {k: (tuple(v.shape), v.dtype, v.is_meta) for k, v in deferred.state_dict(keep_vars=True).items()}
        want = {k: (tuple(v.shape), v.dtype, True) for k, v in real.state_dict().items()}
        assert got == want, name
        assert all(b.is_meta for b in deferred.buffers()) and not any(b.is_meta for b in real.buffers()), name

    # no tensor data is read at all: safetensors' get_tensor is never called
    class HeadersOnly:
        def __init__(self, *args, **kwargs):
            self._file = safe_open(*args, **kwargs)

        def __enter__(self):
            self._file.__enter__()
            return self

        def __exit__(self, *exc):
            return self._file.__exit__(*exc)

        def keys(self):
            return self._file.keys()

        def get_slice(self, key):
            return self._file.get_slice(key)

        def get_tensor(self, key):
            raise AssertionError(f"a deferred load read {key}")

    monkeypatch.setattr(safetensors, "safe_open", HeadersOnly)
    with tensors_from_rank_zero(True):
        loaders["llada"]()
        loaders["dream"]()
    with pytest.raises(AssertionError, match="a deferred load read"):
        loaders["llada"]()  # the guard bites outside the context
    monkeypatch.undo()
    # a caller that does not opt in still reads, inside the context
    files = {"w": tmp_path / "one.safetensors"}
    save_file({"w": torch.ones(3)}, str(files["w"]))
    with tensors_from_rank_zero(True):
        assert load_tensors(files)["w"].sum() == 3 and load_tensors(files, deferrable=True)["w"].is_meta
        config = json.loads((tmp_path / "llada" / "config.json").read_text())
        (tmp_path / "llada" / "config.json").write_text(json.dumps({**config, "d_model": 2 * D}))
        with pytest.raises(ValueError, match="wrong shapes"):
            loaders["llada"]()


def _broadcast_worker(rank: int, init_file: str, out_dir: str) -> None:
    """Rank 0 loads the tiny LLaDA; rank 1 builds it on the meta device (no data read); after ``shard`` both hold
    rank 0's weights and buffers, and the sharded forward gives the unsharded model's logits."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from flowlm.pretrained.files import tensors_from_rank_zero
    from lightning_modules.sharding import shard

    with gloo_rank(rank, init_file):
        folder = Path(out_dir, "llada")
        reference = load_llada(folder, dtype="float32")
        with tensors_from_rank_zero(rank != 0):
            holder = torch.nn.Module()
            holder.net = load_llada(folder, dtype="float32")
        meta_before = all(t.is_meta for t in (*holder.parameters(), *holder.buffers()))
        assert shard(holder, init_device_mesh("cpu", (2,)))
        diffs, n_dtensor = [], 0
        want = {**dict(reference.named_parameters()), **dict(reference.named_buffers())}
        for name, t in (*holder.named_parameters(), *holder.named_buffers()):
            n_dtensor += isinstance(t, DTensor)
            value = t.full_tensor() if isinstance(t, DTensor) else t
            diffs.append((value - want[name.removeprefix("net.")]).abs().max().item())
        ids = _ids(64, 60)
        with torch.no_grad():
            diffs.append((holder.net(ids) - reference(ids)).abs().max().item())
        Path(out_dir, f"rank{rank}").write_text(f"{max(diffs):.3e} {n_dtensor} {int(meta_before)}")


@pytest.mark.slow
def test_fsdp2_rank_one_gets_rank_zeros_weights_without_reading_the_source(tmp_path):
    _write_llada(tmp_path / "llada", _reference("llama", 64, 2, 5e5, 1e-5), _llada_config(64, D, INTER, 2))
    for rank, out in enumerate(rank_outputs(_broadcast_worker, tmp_path, timeout_s=180, what="FSDP2 broadcast ranks")):
        diff, n_dtensor, meta_before = out.split()
        assert float(diff) == 0.0 and int(n_dtensor) > 0 and int(meta_before) == (rank == 1), (rank, diff)


def test_a_padding_mask_keeps_padded_keys_out(llada_model):
    # in float32: the loaded bf16 weights exactly, without bf16 activations, whose rounding depends on the kernel
    # path (masked vs short attention differ by ≈ 0.05 in bf16 on a CPU without bf16 kernels)
    llada_model = llada_model.float()
    ids = _ids(64, 60)
    mask = torch.ones_like(ids)
    mask[:, 6:] = 0  # right padding: positions 0..5 keep their RoPE positions
    with torch.no_grad():
        padded, short = llada_model(ids, attention_mask=mask), llada_model(ids[:, :6])
        assert torch.equal(llada_model(ids, attention_mask=torch.ones_like(ids)), llada_model(ids))
    assert (padded[:, :6] - short).abs().max() < 1e-5 and (llada_model(ids)[:, :6] - short).abs().max() > 1e-3


def test_a_hub_name_in_the_cache_loads_from_its_snapshot(tmp_path, monkeypatch):
    """The Hugging Face cache layout (models--owner--name/refs/main → snapshots/<commit>/), no network."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--GSAI-ML--LLaDA-8B-Base"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots").mkdir()
    ref = _reference("llama", 64, 2, 5e5, 1e-5)
    _write_llada(repo / "snapshots" / commit, ref, _llada_config(64, D, INTER, 2))
    model = load_llada("GSAI-ML/LLaDA-8B-Base", dtype="float32")
    ids = _ids(64, 60)
    with torch.no_grad():
        assert (model(ids) - ref(ids).logits).abs().max() < TOL


@pytest.mark.parametrize(("name", "ids"), [("llada", (515, 528, 513, 512)), ("dream", (516, 528, 515, 514))])
def test_the_shipped_tiny_folders_are_current_and_laid_out_as_the_released_ones(tmp_path, name, ids):
    """data/cpu/tiny_{llada,dream} (scale=cpu of tinygsm_fmlm_plus_init_{llada,dream}) are what
    tests/fixtures/tiny_llama_family.py writes, file for file; through the loader and the data's tokenizer code they
    have the released layout: the special tokens after the text ids, [MASK] the tokenizer's own (LLaDA's found by
    name, Dream's named), PAD = EOS, a head padded beyond the tokenizer."""
    from fixtures import tiny_llama_family as fam

    from datamodules.sources import load_tokenizer

    fresh, shipped = fam.write_all(tmp_path)[name], fam.HERE / f"tiny_{name}"
    assert sorted(p.name for p in shipped.iterdir()) == sorted(p.name for p in fresh.iterdir())
    for file in fresh.iterdir():
        assert (shipped / file.name).read_bytes() == file.read_bytes(), f"stale {shipped}: run its writer"
    model = {"llada": load_llada, "dream": load_dream}[name](shipped, dtype="float32")
    tok = load_tokenizer(shipped, "eos")
    assert (len(tok), model.head_rows, model.mask_id, tok.bos_token_id) == ids
    assert tok.mask_token_id == model.mask_id and tok.pad_token_id == tok.eos_token_id == 0
    assert model.shift_logits == (name == "dream") and model.covers_data(len(tok))
    assert tok.convert_ids_to_tokens(model.mask_id) == {"llada": "<|mdm_mask|>", "dream": "<|mask|>"}[name]
