"""LLaDA (GSAI-ML/LLaDA-8B-Base/-Instruct, OLMo-derived ``LLaDAModelLM``) → the bidirectional Llama backbone.

Layout (docs/pretrained.md "LLaMA-family MDMs"): a Hugging Face folder with ``config.json`` (OLMo field names) and
sharded safetensors of ``model.transformer.*`` keys. ``ff_out`` names both a block's MLP down-projection
(``blocks.{i}.ff_out``) and the untied LM head (``transformer.ff_out``): names are matched whole, never by suffix.
Logits are not shifted; [MASK] = ``mask_token_id`` (126336) lies inside the vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from flowlm.backbones.llama import BidirectionalLM
from flowlm.pretrained.files import read_json, resolve_source
from flowlm.pretrained.hf_remote.configuration_llada import BLOCK_NAMES as LLADA_LAYOUT
from flowlm.pretrained.llama_family import bidirectional_spec, block_shapes, check_expected, load_backbone

# config.json fields whose value this mapping assumes; any other value is refused (a different architecture).
REQUIRED = {
    "block_type": "llama",
    "layer_norm_type": "rms",
    "activation_type": "silu",
    "include_bias": False,
    "attention_layer_norm": False,
    "weight_tying": False,
    "alibi": False,
    "rope": True,
    "scale_logits": False,
    "input_emb_norm": False,
}
# LLaDA-8B's shapes (config.json of the released snapshot), for `expect=` in conf/backbone/llada_8b.yaml.
LLADA_8B = {"d_model": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 32, "mlp_hidden_size": 12288}

# block tensor (after model.transformer.blocks.{i}.) → BidirectionalLM tensor (after model.layers.{i}.): LLaDA's
# layout as the shipped export states it (hf_remote/configuration_llada.py), so loader, writer and export agree
BLOCK_NAMES = {f"{name}.weight": f"{target}.weight" for name, target in LLADA_LAYOUT.items()}
TOP_NAMES = {
    "model.transformer.wte.weight": "model.embed_tokens.weight",
    "model.transformer.ln_f.weight": "model.norm.weight",
    "model.transformer.ff_out.weight": "lm_head.weight",  # the LM head (untied)
}
# BidirectionalLM size argument → LLaDA config field
SIZE_FIELDS = {
    "embed_rows": "vocab_rows",
    "head_rows": "vocab_rows",
    "hidden_size": "d_model",
    "n_layers": "n_layers",
    "n_heads": "n_heads",
    "n_kv_heads": "n_kv_heads",
    "intermediate_size": "mlp_hidden_size",
}


def llada_config(config: dict, expect: dict | None = None) -> dict:
    """The fields the mapping needs from a LLaDA ``config.json``; unsupported architecture options, or a mismatch
    with ``expect`` (e.g. ``LLADA_8B``), are refused naming the field."""
    wrong = {key: config.get(key) for key, value in REQUIRED.items() if config.get(key, value) != value}
    if config.get("include_qkv_bias"):
        wrong["include_qkv_bias"] = True
    if wrong:
        raise ValueError(f"LLaDA config.json has unsupported settings {wrong}; this loader needs {REQUIRED}")
    d, heads = config["d_model"], config["n_heads"]
    cfg = {
        "d_model": d,
        "n_layers": config["n_layers"],
        "n_heads": heads,
        "n_kv_heads": config.get("n_kv_heads") or heads,
        "mlp_hidden_size": config.get("mlp_hidden_size") or config.get("mlp_ratio", 4) * d,
        "vocab_rows": config.get("embedding_size") or config["vocab_size"],
        "rope_theta": float(config.get("rope_theta", 10_000.0)),
        "rms_norm_eps": float(config.get("rms_norm_eps", 1e-5)),
        "max_positions": config.get("max_sequence_length", 4096),
        "mask_id": config.get("mask_token_id", 126336),
    }
    return check_expected(cfg, expect, "LLaDA config.json")


def expected_keys(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape of ``LLaDAModelLM.state_dict()`` for this config."""
    d, inter, hd = cfg["d_model"], cfg["mlp_hidden_size"], cfg["d_model"] // cfg["n_heads"]
    kv = cfg["n_kv_heads"] * hd
    block = block_shapes(d, kv, inter)
    shapes = {name: block[target] for name, target in BLOCK_NAMES.items()}
    keys = {
        "model.transformer.wte.weight": (cfg["vocab_rows"], d),
        "model.transformer.ln_f.weight": (d,),
        "model.transformer.ff_out.weight": (cfg["vocab_rows"], d),
    }
    for i in range(cfg["n_layers"]):
        keys |= {f"model.transformer.blocks.{i}.{name}": shape for name, shape in shapes.items()}
    return keys


def to_backbone_state(state: dict[str, Tensor], cfg: dict) -> dict[str, Tensor]:
    """LLaDA tensors → ``BidirectionalLM`` names (whole-name matches: the head's ff_out is not a block's)."""
    out = {target: state[name] for name, target in TOP_NAMES.items()}
    for i in range(cfg["n_layers"]):
        for name, target in BLOCK_NAMES.items():
            out[f"model.layers.{i}.{target}"] = state[f"model.transformer.blocks.{i}.{name}"]
    return out


def backbone_spec(cfg: dict) -> dict:
    """The ``BidirectionalLM`` arguments equivalent to a LLaDA config."""
    return bidirectional_spec(cfg, "llama", SIZE_FIELDS, shift_logits=False)  # position i predicts token i


def load_llada(
    source: str | Path, *, expect: dict | None = None, dtype: torch.dtype | str | None = None
) -> BidirectionalLM:
    """A LLaDA folder (local, or a hub name such as ``GSAI-ML/LLaDA-8B-Base`` from the HF cache) as a bidirectional
    Llama backbone; config, names and shapes are checked before any tensor is read."""
    path = resolve_source(source, allow_patterns=["*.json", "*.safetensors"])
    cfg = llada_config(read_json(path / "config.json"), expect)
    mapping = (expected_keys, to_backbone_state, backbone_spec)
    return load_backbone(path, cfg, mapping, config="LLaDA config.json", dtype=dtype)


# ------------------------------------------------------------------------------------------- writing the layout
def from_backbone_state(state: dict[str, Tensor], cfg: dict) -> dict[str, Tensor]:
    """``BidirectionalLM`` tensors → LLaDA's names (``to_backbone_state`` inverted)."""
    out = {name: state[target] for name, target in TOP_NAMES.items()}
    for i in range(cfg["n_layers"]):
        out |= {f"model.transformer.blocks.{i}.{n}": state[f"model.layers.{i}.{t}"] for n, t in BLOCK_NAMES.items()}
    return out


def source_config(spec: dict) -> dict | None:
    """LLaDA's ``config.json`` fields (OLMo names, ``llada_config`` reads them back) for a ``BidirectionalLM`` spec in
    LLaDA's layout (Llama, [MASK] inside a vocabulary the head predicts in full, unshifted); None for another."""
    if spec["arch"] != "llama" or spec["shift_logits"] or spec["embed_rows"] != spec["head_rows"]:
        return None
    return {
        **REQUIRED,
        "d_model": spec["hidden_size"],
        "n_layers": spec["n_layers"],
        "n_heads": spec["n_heads"],
        "n_kv_heads": spec["n_kv_heads"],
        "mlp_hidden_size": spec["intermediate_size"],
        "vocab_size": spec["embed_rows"],
        "embedding_size": spec["embed_rows"],
        "max_sequence_length": spec["max_positions"],
        "rope_theta": spec["rope_theta"],
        "rms_norm_eps": spec["rms_norm_eps"],
        "mask_token_id": spec["mask_id"],
        "include_qkv_bias": False,
        "rope_full_precision": True,
        "layer_norm_with_affine": True,
        "bias_for_layer_norm": False,
        "block_group_size": 1,
    }
