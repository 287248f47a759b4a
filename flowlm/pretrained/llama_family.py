"""The steps the LLaMA-family loaders (``smdm``, ``llada``, ``dream``) share: a config checked against the expected
one, the ``BidirectionalLM`` arguments, and a checkpoint read into the backbone once its names and shapes match."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from flowlm.backbones.llama import BidirectionalLM
from flowlm.pretrained.files import check_state, checkpoint_files, load_tensors, tensor_shapes

# BidirectionalLM arguments that the LLaMA-family configs hold under the same names
SHARED_SPEC = ("rope_theta", "rms_norm_eps", "max_positions", "mask_id")


def block_shapes(d: int, kv: int, inter: int) -> dict[str, tuple[int, ...]]:
    """One decoder block's weights under ``BidirectionalLM``'s (Hugging Face Llama/Qwen2) names and their shapes,
    biases aside: width d, key/value rows kv (grouped-query heads), MLP width inter."""
    return {
        "self_attn.q_proj.weight": (d, d),
        "self_attn.k_proj.weight": (kv, d),
        "self_attn.v_proj.weight": (kv, d),
        "self_attn.o_proj.weight": (d, d),
        "mlp.gate_proj.weight": (inter, d),
        "mlp.up_proj.weight": (inter, d),
        "mlp.down_proj.weight": (d, inter),
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
    }


def check_expected(cfg: dict, expect: dict | None, what: str) -> dict:
    """``cfg``, refused naming every field whose value is not the one in ``expect`` (``what``: the config read)."""
    bad = {key: (cfg.get(key), value) for key, value in (expect or {}).items() if cfg.get(key) != value}
    if bad:
        raise ValueError(f"{what} does not match the expected config: {{field: (found, expected)}} {bad}")
    return cfg


def bidirectional_spec(cfg: dict, arch: str, size_fields: dict[str, str], *, shift_logits: bool) -> dict:
    """The ``BidirectionalLM`` arguments: ``arch``, the sizes (``size_fields``: argument → the config's field), the
    ``SHARED_SPEC`` fields of ``cfg``, and whether logits are shifted."""
    sizes = {arg: cfg[field] for arg, field in size_fields.items()}
    return {"arch": arch, **sizes, **{key: cfg[key] for key in SHARED_SPEC}, "shift_logits": shift_logits}


def load_backbone(
    path: Path,
    cfg: dict,
    mapping: tuple[Callable, Callable, Callable],
    *,
    config: str,
    dtype: torch.dtype | str | None,
) -> BidirectionalLM:
    """The checkpoint at ``path`` as a ``BidirectionalLM``. ``mapping`` = (expected_keys, to_backbone_state,
    backbone_spec) of the source: names and shapes are checked against ``expected_keys(cfg)`` (``config`` names
    the config in the message) before any tensor is read; ``dtype``: cast to it (default: as stored)."""
    expected_keys, to_backbone_state, backbone_spec = mapping
    files = checkpoint_files(path)
    check_state(tensor_shapes(files), expected_keys(cfg), source=str(path), config=config)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    state = load_tensors(files, deferrable=True)  # on the meta device where rank 0 broadcasts them (FSDP2)
    return BidirectionalLM.from_state(backbone_spec(cfg), to_backbone_state(state, cfg), dtype)


def decoder_config(spec: dict) -> dict:
    """The transformers Llama/Qwen2 config keys every layout writes for a ``BidirectionalLM`` spec (each adds its
    own: the rotary keys' form, the mask id, bidirectionality)."""
    return {
        "hidden_size": spec["hidden_size"],
        "num_hidden_layers": spec["n_layers"],
        "num_attention_heads": spec["n_heads"],
        "num_key_value_heads": spec["n_kv_heads"],
        "intermediate_size": spec["intermediate_size"],
        "vocab_size": spec["embed_rows"],
        "max_position_embeddings": spec["max_positions"],
        "rms_norm_eps": spec["rms_norm_eps"],
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }
