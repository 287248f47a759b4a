"""SMDM (Nie et al., lit-gpt ``TransEncoder``, configs ``Diff_LLaMA_{size}M``) → the bidirectional Llama backbone.

Layout (docs/pretrained.md "LLaMA-family MDMs"): one flat safetensors file (or a fabric ``.pth`` with the state under
``model``) with ``transformer.wte`` (padded vocab + 1 rows, the last is [MASK]), per block ``norm_1``, a fused
``attn.attn`` interleaved per query group, ``attn.proj``, ``norm_2``, xformers SwiGLU ``w1`` (gate), ``w2`` (up),
``w3`` (down), then ``ln_f`` and an untied ``lm_head`` of padded-vocab rows (no [MASK] logit). RoPE θ = 1e4 on the
whole head, RMSNorm eps 1e-5, bidirectional attention without a mask.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from flowlm.backbones.llama import BidirectionalLM
from flowlm.pretrained.files import resolve_source
from flowlm.pretrained.llama_family import load_backbone

# Diff_LLaMA configs of lit_gpt/config.py (ML-GSAI/SMDM) with a public checkpoint on nieshen/SMDM: (n_layer, n_head,
# n_embd, intermediate_size); all MHA (n_query_groups = n_head), vocab 32000 padded to a multiple of 64, block 2048.
SIZES: dict[str, tuple[int, int, int, int]] = {
    "170M": (18, 12, 768, 3072),
    "231M": (18, 14, 896, 3584),
    "336M": (20, 16, 1024, 4096),
    "472M": (18, 10, 1280, 5120),
    "551M": (21, 10, 1280, 5120),
    "629M": (24, 10, 1280, 5120),
    "717M": (19, 12, 1536, 6144),
    "831M": (22, 12, 1536, 6144),
    "944M": (25, 12, 1536, 6144),
    "1028M": (20, 14, 1792, 7168),
    "1476M": (22, 16, 2048, 8192),
}
LITGPT_FIELDS = ("n_layer", "n_head", "n_embd", "intermediate_size")


def smdm_config(config: str | dict) -> dict:
    """The lit-gpt fields of a named config ("1028M" or "Diff_LLaMA_1028M") or of a dict of them (tiny tests):
    n_layer, n_head, n_embd, intermediate_size, n_query_groups, vocab_size, padding_multiple, block_size, norm_eps."""
    if isinstance(config, str):
        size = config.removeprefix("Diff_LLaMA_")
        if size not in SIZES:
            raise ValueError(f"unknown SMDM config {config!r}; known: {sorted(SIZES, key=lambda s: float(s[:-1]))}")
        config = dict(zip(LITGPT_FIELDS, SIZES[size], strict=True))
    missing = [field for field in LITGPT_FIELDS if field not in config]
    if missing:
        raise ValueError(f"SMDM config lacks {missing}")
    out = {"vocab_size": 32000, "padding_multiple": 64, "block_size": 2048, "norm_eps": 1e-5, **config}
    out.setdefault("n_query_groups", out["n_head"])
    if out["n_embd"] % out["n_head"] or out["n_head"] % out["n_query_groups"]:
        raise ValueError(f"SMDM config: n_embd % n_head and n_head % n_query_groups must be 0, got {out}")
    multiple = out["padding_multiple"]
    out["padded_vocab_size"] = -(-out["vocab_size"] // multiple) * multiple  # lit-gpt find_multiple
    return out


def expected_keys(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape of ``TransEncoder.state_dict()`` for this config (no buffers)."""
    d, hs, padded = cfg["n_embd"], cfg["n_embd"] // cfg["n_head"], cfg["padded_vocab_size"]
    qkv_rows = (cfg["n_head"] + 2 * cfg["n_query_groups"]) * hs
    keys = {"transformer.wte.weight": (padded + 1, d), "transformer.ln_f.weight": (d,), "lm_head.weight": (padded, d)}
    for i in range(cfg["n_layer"]):
        p = f"transformer.h.{i}."
        keys |= {
            p + "norm_1.weight": (d,),
            p + "attn.attn.weight": (qkv_rows, d),
            p + "attn.proj.weight": (d, d),
            p + "norm_2.weight": (d,),
            p + "mlp.swiglu.w1.weight": (cfg["intermediate_size"], d),
            p + "mlp.swiglu.w2.weight": (cfg["intermediate_size"], d),
            p + "mlp.swiglu.w3.weight": (d, cfg["intermediate_size"]),
        }
    return keys


def split_fused_qkv(weight: Tensor, n_head: int, n_query_groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """lit-gpt's legacy fused QKV → (q, k, v). Rows are grouped per query group g: [q_{g,0} … q_{g,q_per_kv−1}, k_g,
    v_g], head_size rows each (lit-gpt ``qkv.view(B, T, G, q_per_kv + 2, hs)``); not the [Q; K; V] stacking."""
    q_per_kv = n_head // n_query_groups
    hs = weight.shape[0] // (n_head + 2 * n_query_groups)
    w = weight.view(n_query_groups, q_per_kv + 2, hs, weight.shape[-1])
    q = w[:, :q_per_kv].reshape(n_head * hs, -1)  # head h = g·q_per_kv + j, the order lit-gpt's attention uses
    k = w[:, q_per_kv].reshape(n_query_groups * hs, -1)
    v = w[:, q_per_kv + 1].reshape(n_query_groups * hs, -1)
    return q, k, v


# lit-gpt name (after transformer.h.{i}.) → BidirectionalLM name (after model.layers.{i}.); attn.attn is split.
BLOCK_NAMES = {
    "norm_1.weight": "input_layernorm.weight",
    "attn.proj.weight": "self_attn.o_proj.weight",
    "norm_2.weight": "post_attention_layernorm.weight",
    "mlp.swiglu.w1.weight": "mlp.gate_proj.weight",  # xformers SwiGLU: w3(silu(x·w1ᵀ) ⊙ x·w2ᵀ)
    "mlp.swiglu.w2.weight": "mlp.up_proj.weight",
    "mlp.swiglu.w3.weight": "mlp.down_proj.weight",
}


def to_backbone_state(state: dict[str, Tensor], cfg: dict) -> dict[str, Tensor]:
    """SMDM tensors → ``BidirectionalLM`` names, the fused QKV split per query group."""
    out = {
        "model.embed_tokens.weight": state["transformer.wte.weight"],
        "model.norm.weight": state["transformer.ln_f.weight"],
        "lm_head.weight": state["lm_head.weight"],
    }
    for i in range(cfg["n_layer"]):
        src, dst = f"transformer.h.{i}.", f"model.layers.{i}."
        for name, target in BLOCK_NAMES.items():
            out[dst + target] = state[src + name]
        q, k, v = split_fused_qkv(state[src + "attn.attn.weight"], cfg["n_head"], cfg["n_query_groups"])
        out |= {dst + "self_attn.q_proj.weight": q, dst + "self_attn.k_proj.weight": k}
        out[dst + "self_attn.v_proj.weight"] = v
    return out


def backbone_spec(cfg: dict) -> dict:
    """The ``BidirectionalLM`` arguments equivalent to an SMDM config ([MASK] = padded vocab, the extra wte row)."""
    return {
        "arch": "llama",
        "embed_rows": cfg["padded_vocab_size"] + 1,
        "head_rows": cfg["padded_vocab_size"],
        "hidden_size": cfg["n_embd"],
        "n_layers": cfg["n_layer"],
        "n_heads": cfg["n_head"],
        "n_kv_heads": cfg["n_query_groups"],
        "intermediate_size": cfg["intermediate_size"],
        "rope_theta": 10_000.0,  # lit-gpt build_rope_cache default base, not configurable in SMDM
        "rms_norm_eps": cfg["norm_eps"],
        "max_positions": cfg["block_size"],
        "mask_id": cfg["padded_vocab_size"],
        "shift_logits": False,
    }


def load_smdm(
    source: str | Path,
    *,
    config: str | dict = "1028M",
    filename: str | None = None,
    dtype: torch.dtype | str | None = None,
) -> BidirectionalLM:
    """An SMDM checkpoint (a local ``.safetensors``/``.pth``, or hub ``nieshen/SMDM`` with ``filename``, from the HF
    cache) as a bidirectional Llama backbone; names and shapes are checked against ``config`` before any tensor is
    read. ``dtype``: cast to it (default: as stored)."""
    cfg = smdm_config(config)
    path = resolve_source(source, filename=filename)
    mapping = (expected_keys, to_backbone_state, backbone_spec)
    return load_backbone(path, cfg, mapping, config=f"SMDM {config}", dtype=dtype)


# ------------------------------------------------------------------------------------------- writing the layout
def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, n_head: int, n_query_groups: int) -> Tensor:
    """(q, k, v) → lit-gpt's legacy fused QKV, the inverse of ``split_fused_qkv``: per query group g the rows
    [q_{g,0} … q_{g,q_per_kv−1}, k_g, v_g], head_size rows each."""
    hs, d = k.shape[0] // n_query_groups, q.shape[-1]
    groups = (n_query_groups, -1, hs, d)
    return torch.cat([q.reshape(groups), k.reshape(groups), v.reshape(groups)], dim=1).reshape(-1, d)


def from_backbone_state(state: dict[str, Tensor], cfg: dict) -> dict[str, Tensor]:
    """``BidirectionalLM`` tensors → SMDM's names (``to_backbone_state`` inverted), the QKV fused per query group."""
    out = {
        "transformer.wte.weight": state["model.embed_tokens.weight"],
        "transformer.ln_f.weight": state["model.norm.weight"],
        "lm_head.weight": state["lm_head.weight"],
    }
    for i in range(cfg["n_layer"]):
        src, dst = f"model.layers.{i}.", f"transformer.h.{i}."
        out |= {dst + name: state[src + target] for name, target in BLOCK_NAMES.items()}
        q, k, v = (state[f"{src}self_attn.{p}_proj.weight"] for p in "qkv")
        out[dst + "attn.attn.weight"] = fuse_qkv(q, k, v, cfg["n_head"], cfg["n_query_groups"])
    return out


def litgpt_fields(spec: dict) -> dict | None:
    """The lit-gpt ``Config`` fields of a ``BidirectionalLM`` spec in SMDM's layout (Llama, [MASK] = the one extra
    embedding row past the head's, RoPE θ = 1e4, unshifted), ``smdm_config`` reads them back; None for another
    layout. The head's rows are the padded vocabulary (``padding_multiple`` 1)."""
    smdm_like = spec["embed_rows"] == spec["head_rows"] + 1 == spec["mask_id"] + 1
    if spec["arch"] != "llama" or spec["shift_logits"] or not smdm_like or spec["rope_theta"] != 10_000.0:
        return None
    return {
        "name": f"Diff_LLaMA_{spec['n_layers']}x{spec['hidden_size']}",
        "n_layer": spec["n_layers"],
        "n_head": spec["n_heads"],
        "n_embd": spec["hidden_size"],
        "intermediate_size": spec["intermediate_size"],
        "n_query_groups": spec["n_kv_heads"],
        "vocab_size": spec["head_rows"],
        "padding_multiple": 1,
        "padded_vocab_size": spec["head_rows"],
        "block_size": spec["max_positions"],
        "norm_eps": spec["rms_norm_eps"],
        "rotary_percentage": 1.0,
        "bias": False,
        "parallel_residual": False,
        "_norm_class": "FusedRMSNorm",
        "_mlp_class": "LLaMAMLP",
    }
