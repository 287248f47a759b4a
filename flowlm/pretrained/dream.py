"""Dream (Dream-org/Dream-v0-Base-7B, a Qwen2.5 decoder run bidirectionally) → the bidirectional Qwen2 backbone.

Layout (docs/pretrained.md "LLaMA-family MDMs"): a Hugging Face folder with a Qwen2-style ``config.json`` plus
``mask_token_id`` and (sharded) safetensors whose names are exactly ``Qwen2ForCausalLM``'s (q/k/v biases, no o_proj
or MLP bias, untied ``lm_head``). Logits are shifted: the prediction for position i is the raw output at i − 1.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from flowlm.backbones.llama import BidirectionalLM
from flowlm.pretrained.files import read_json, resolve_source
from flowlm.pretrained.llama_family import (
    bidirectional_spec,
    block_shapes,
    check_expected,
    decoder_config,
    load_backbone,
)

# Dream-v0-7B's shapes (third-party configs, docs/pretrained.md), for `expect=` in conf/backbone/dream_7b.yaml.
DREAM_7B = {
    "hidden_size": 3584,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "intermediate_size": 18944,
    "vocab_size": 152064,
}
# BidirectionalLM size argument → Dream config field
SIZE_FIELDS = {
    "embed_rows": "vocab_size",
    "head_rows": "vocab_size",
    "hidden_size": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "intermediate_size": "intermediate_size",
}
QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")  # the biased projections


def dream_config(config: dict, expect: dict | None = None) -> dict:
    """The fields the mapping needs from a Dream ``config.json``; a tied head, a non-SiLU MLP or a mismatch with
    ``expect`` (e.g. ``DREAM_7B``) is refused naming the field."""
    if config.get("tie_word_embeddings", False) or config.get("hidden_act", "silu") != "silu":
        raise ValueError(
            "Dream config.json: this loader needs tie_word_embeddings false and hidden_act silu, got "
            f"{config.get('tie_word_embeddings')}, {config.get('hidden_act')}"
        )
    if "mask_token_id" not in config:
        raise ValueError("Dream config.json has no mask_token_id (Dream-v0 uses 151666)")
    rope = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 1e6)
    heads = config["num_attention_heads"]
    cfg = {
        "hidden_size": config["hidden_size"],
        "num_hidden_layers": config["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": config.get("num_key_value_heads") or heads,
        "intermediate_size": config["intermediate_size"],
        "vocab_size": config["vocab_size"],
        "rope_theta": float(rope),
        "rms_norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "max_positions": config.get("max_position_embeddings", 131072),
        "mask_id": config["mask_token_id"],
    }
    return check_expected(cfg, expect, "Dream config.json")


def expected_keys(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape of a Qwen2ForCausalLM state dict for this config (no buffers)."""
    d, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * (d // cfg["num_attention_heads"])
    shapes = {}
    for name, shape in block_shapes(d, kv, inter).items():
        shapes[name] = shape
        if name in QKV:  # Qwen2's q/k/v biases, each after its weight
            shapes[name.replace(".weight", ".bias")] = shape[:1]
    keys = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,), "lm_head.weight": (vocab, d)}
    for i in range(cfg["num_hidden_layers"]):
        keys |= {f"model.layers.{i}.{name}": shape for name, shape in shapes.items()}
    return keys


def to_backbone_state(state: dict[str, Tensor], cfg: dict) -> dict[str, Tensor]:
    """Dream tensors → ``BidirectionalLM`` names: the same names (Qwen2's ``model.*`` and ``lm_head``)."""
    return dict(state)


def backbone_spec(cfg: dict) -> dict:
    """The ``BidirectionalLM`` arguments equivalent to a Dream config (Qwen2 decoder, shifted logits)."""
    # Dream eval/generation: logits = cat(raw[:, :1], raw[:, :-1])
    return bidirectional_spec(cfg, "qwen2", SIZE_FIELDS, shift_logits=True)


def load_dream(
    source: str | Path, *, expect: dict | None = None, dtype: torch.dtype | str | None = None
) -> BidirectionalLM:
    """A Dream folder (local, or a hub name such as ``Dream-org/Dream-v0-Base-7B`` from the HF cache) as a
    bidirectional Qwen2 backbone with shifted logits; config, names and shapes are checked before any tensor is read."""
    path = resolve_source(source, allow_patterns=["*.json", "*.safetensors"])
    cfg = dream_config(read_json(path / "config.json"), expect)
    mapping = (expected_keys, to_backbone_state, backbone_spec)
    return load_backbone(path, cfg, mapping, config="Dream config.json", dtype=dtype)


# ------------------------------------------------------------------------------------------- writing the layout
def from_backbone_state(state: dict[str, Tensor], cfg: dict) -> dict[str, Tensor]:
    """``BidirectionalLM`` tensors → Dream's names: the same (``Qwen2ForCausalLM``'s)."""
    return dict(state)


def source_config(spec: dict) -> dict | None:
    """Dream's ``config.json`` fields (Qwen2's, plus ``mask_token_id``; ``dream_config`` reads them back) for a
    ``BidirectionalLM`` spec in Dream's layout (Qwen2, shifted logits, a head as wide as the embedding); None for
    another."""
    if spec["arch"] != "qwen2" or not spec["shift_logits"] or spec["embed_rows"] != spec["head_rows"]:
        return None
    return {**decoder_config(spec), "rope_theta": spec["rope_theta"], "mask_token_id": spec["mask_id"]}
