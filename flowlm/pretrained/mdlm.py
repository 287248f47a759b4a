"""MDLM (kuleshov-group/mdlm, OpenWebText) checkpoints into the suite's DiT (docs/pretrained.md, MDLM).

MDLM's DiT (``models/dit.py::DIT``) is the suite's DiT block for block (methods.md §1), so the conversion renames
tensors and sets options; no weight is changed:
  - residual gate: both ``x + gate ⊙ branch`` (not 1 + gate); modulate ``x ⊙ (1 + scale) + shift``;
  - LayerNorm: MDLM's ``F.layer_norm(x.float()) ⊙ w`` (no bias) = the suite's bias-free ``nn.LayerNorm`` on a
    float32 residual stream (both streams stay float32 under bf16 autocast: an fp32 embedding plus bf16 updates);
  - head ``output_layer.linear`` has a bias, as the suite's ``final.linear``; both untied from the embedding;
  - fused QKV rows [Q; K; V], head-major (the suite's ``view(b, L, 3, H, hd)``); rotary base 1e4, half-split;
  - attention: no soft-cap, no dropout on the probabilities (``attn_softcap=0``, ``attn_dropout=0``);
  - time: OWT is trained with ``time_conditioning: False``, σ ≡ 0, so c = SiLU(emb(0)): the suite's time-agnostic
    MDM feeds s = 0 to the same sinusoid → Linear → SiLU → Linear (freq 256, max period 1e4, [cos, sin]).
    A time-conditioned MDLM reads σ(t) = −log(1 − (1 − ε)t), not t, and is refused.
Layouts: the Hugging Face folder (``config.json`` + ``model.safetensors``, keys ``backbone.*``) and MDLM's
Lightning ``.ckpt`` (``state_dict`` with ``backbone.*`` keys, EMA ``shadow_params`` in ``backbone.parameters()``
order; the EMA weights are used, as MDLM evaluates with ``ema.copy_to``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from flowlm.pretrained.formats import PretrainedMDM, SourceFormat, register_format

PREFIX = "backbone."  # the HF ``MDLM.backbone`` and the Lightning ``Diffusion.backbone``
ROTARY_BUFFER = "rotary_emb.inv_freq"  # a persistent buffer of MDLM's Rotary: checked, not copied
ROTARY_BASE = 10_000.0
FREQ_DIM = 256  # TimestepEmbedder.frequency_embedding_size
MLP_RATIO = 4  # DDiTBlock's default, never overridden by DIT
# The suite's DiT options that compute MDLM's DiT (sizes come from the checkpoint).
MDLM_OPTIONS: dict[str, object] = {
    "mlp_ratio": MLP_RATIO,
    "embed_init": "kaiming_uniform",
    "time_scale": 1.0,
    "attn_dropout": 0.0,
    "attn_softcap": 0.0,
    "input_fp32": True,
    "time_fp32": True,  # c = SiLU(sigma_map(σ)) runs outside MDLM's bf16 autocast block
}

_BLOCK = (  # (MDLM name, suite name) inside blocks.{i}, in DDiTBlock's parameter registration order
    ("norm1.weight", "norm1.weight"),
    ("attn_qkv.weight", "qkv.weight"),
    ("attn_out.weight", "attn_out.weight"),
    ("norm2.weight", "norm2.weight"),
    ("mlp.0.weight", "mlp.0.weight"),
    ("mlp.0.bias", "mlp.0.bias"),
    ("mlp.2.weight", "mlp.2.weight"),
    ("mlp.2.bias", "mlp.2.bias"),
    ("adaLN_modulation.weight", "adaLN_modulation.weight"),
    ("adaLN_modulation.bias", "adaLN_modulation.bias"),
)


def parameter_names(n_blocks: int) -> list[tuple[str, str]]:
    """(MDLM name, suite DiT name) of every parameter, in MDLM's ``backbone.parameters()`` order (the order of the
    EMA's ``shadow_params``): embedding, sigma_map, blocks, output layer."""
    names = [
        ("vocab_embed.embedding", "embed.weight"),  # a bare nn.Parameter: no `.weight` suffix
        ("sigma_map.mlp.0.weight", "emb_s.mlp.0.weight"),
        ("sigma_map.mlp.0.bias", "emb_s.mlp.0.bias"),
        ("sigma_map.mlp.2.weight", "emb_s.mlp.2.weight"),
        ("sigma_map.mlp.2.bias", "emb_s.mlp.2.bias"),
    ]
    for i in range(n_blocks):
        names += [(f"blocks.{i}.{src}", f"blocks.{i}.{dst}") for src, dst in _BLOCK]
    names += [
        ("output_layer.norm_final.weight", "final.norm.weight"),
        ("output_layer.linear.weight", "final.linear.weight"),
        ("output_layer.linear.bias", "final.linear.bias"),
        ("output_layer.adaLN_modulation.weight", "final.adaLN_modulation.weight"),
        ("output_layer.adaLN_modulation.bias", "final.adaLN_modulation.bias"),
    ]
    return names


def expected_shapes(vocab: int, d: int, cond: int, n_blocks: int) -> dict[str, tuple[int, ...]]:
    """MDLM's tensor shapes (unprefixed names) for a vocabulary, width, conditioning width and depth."""
    block = {
        "norm1.weight": (d,),
        "attn_qkv.weight": (3 * d, d),
        "attn_out.weight": (d, d),
        "norm2.weight": (d,),
        "mlp.0.weight": (MLP_RATIO * d, d),
        "mlp.0.bias": (MLP_RATIO * d,),
        "mlp.2.weight": (d, MLP_RATIO * d),
        "mlp.2.bias": (d,),
        "adaLN_modulation.weight": (6 * d, cond),
        "adaLN_modulation.bias": (6 * d,),
    }
    shapes = {
        "vocab_embed.embedding": (vocab, d),
        "sigma_map.mlp.0.weight": (cond, FREQ_DIM),
        "sigma_map.mlp.0.bias": (cond,),
        "sigma_map.mlp.2.weight": (cond, cond),
        "sigma_map.mlp.2.bias": (cond,),
        "output_layer.norm_final.weight": (d,),
        "output_layer.linear.weight": (vocab, d),
        "output_layer.linear.bias": (vocab,),
        "output_layer.adaLN_modulation.weight": (2 * d, cond),
        "output_layer.adaLN_modulation.bias": (2 * d,),
    }
    for i in range(n_blocks):
        shapes.update({f"blocks.{i}.{name}": shape for name, shape in block.items()})
    return shapes


def convert_state(state: Mapping[str, Tensor], *, n_heads: int, where: str) -> tuple[dict[str, Tensor], dict[str, int]]:
    """MDLM's backbone tensors (unprefixed names) → the suite's DiT names, and the sizes they imply (vocab, d_model,
    cond_dim, n_layers). ValueError naming every missing, unexpected or misshapen tensor, or another rotary base."""
    if "vocab_embed.embedding" not in state or "sigma_map.mlp.2.weight" not in state:
        raise ValueError(f"{where}: no MDLM embedding/sigma_map tensors (vocab_embed.embedding, sigma_map.mlp.*)")
    vocab, d = state["vocab_embed.embedding"].shape
    cond = state["sigma_map.mlp.2.weight"].shape[0]
    blocks = {int(name.split(".")[1]) for name in state if name.startswith("blocks.")}
    n_blocks = max(blocks) + 1 if blocks else 0
    if d % n_heads:
        raise ValueError(f"{where}: hidden size {d} is not divisible by n_heads={n_heads}")
    shapes = expected_shapes(vocab, d, cond, n_blocks)
    problems = [f"missing {name}" for name in shapes if name not in state]
    problems += [f"unexpected {name}" for name in state if name not in shapes and name != ROTARY_BUFFER]
    problems += [
        f"{name} has shape {tuple(state[name].shape)}, expected {shape}"
        for name, shape in shapes.items()
        if name in state and tuple(state[name].shape) != shape
    ]
    if problems:
        raise ValueError(f"{where} is not an MDLM DiT of its own sizes: " + "; ".join(problems[:8]))
    if ROTARY_BUFFER in state:  # MDLM stores it (persistent); the suite recomputes it with base 1e4
        head = d // n_heads
        ours = 1.0 / (ROTARY_BASE ** (torch.arange(0, head, 2, dtype=torch.float32) / head))
        theirs = state[ROTARY_BUFFER].float()
        if theirs.shape != ours.shape or not torch.allclose(theirs, ours, rtol=1e-6, atol=0):
            raise ValueError(
                f"{where}: {ROTARY_BUFFER} is not the rotary of head size {head} and base {ROTARY_BASE:g} "
                f"(another n_heads or rotary base; n_heads={n_heads} was read from the config)"
            )
    converted = {dst: state[src] for src, dst in parameter_names(n_blocks)}
    return converted, {"vocab": vocab, "d_model": d, "cond_dim": cond, "n_layers": n_blocks}


def mdlm_backbone(sizes: dict[str, int], n_heads: int, dropout: float) -> dict:
    """The ``build_dit`` options of an MDLM DiT of these sizes (d_model, n_layers, cond_dim)."""
    return {
        "d_model": sizes["d_model"],
        "n_layers": sizes["n_layers"],
        "n_heads": n_heads,
        "cond_dim": sizes["cond_dim"],
        "dropout": float(dropout),
        **MDLM_OPTIONS,
    }


def _field(cfg: object, *keys: str, default: object = None) -> object:
    """cfg[k1][k2]… of nested mappings (MDLM's hyper-parameters are an OmegaConf DictConfig), or ``default``."""
    for key in keys:
        if cfg is None or not hasattr(cfg, "keys") or key not in cfg:
            return default
        cfg = cfg[key]
    return cfg


def _refuse_time_conditioned(flag: object, where: str) -> None:
    if flag:
        raise ValueError(
            f"{where} is a time-conditioned MDLM (time_conditioning: True): it reads σ(t) = −log(1 − (1 − ε)t), "
            "which the suite's DiT does not compute; only time-agnostic MDLMs (the OWT release) are read"
        )


def _unprefixed(state: Mapping[str, Tensor], where: str, *, strict: bool) -> dict[str, Tensor]:
    own = {name[len(PREFIX) :]: t for name, t in state.items() if name.startswith(PREFIX)}
    others = [name for name in state if not name.startswith(PREFIX)]
    if strict and others:
        raise ValueError(f"{where}: tensors outside `{PREFIX}*`: {others[:4]}")
    return own


class MDLMHubFolder(SourceFormat):
    """The Hugging Face layout (``kuleshov-group/mdlm-owt``): ``config.json`` (MDLMConfig: vocab_size,
    model_length, hidden_dim, cond_dim, n_blocks, n_heads, dropout, time_conditioning) + ``model.safetensors``
    with ``backbone.*`` keys (``backbone.rotary_emb.inv_freq`` present or not)."""

    name = "mdlm-hf (config.json + model.safetensors, backbone.* keys)"

    def matches(self, path: Path, payload: object | None) -> bool:
        """A folder whose model.safetensors holds ``backbone.vocab_embed.embedding``."""
        weights = path / "model.safetensors"
        if not (path.is_dir() and weights.is_file()):
            return False
        from safetensors import safe_open

        with safe_open(str(weights), framework="pt") as f:
            return PREFIX + "vocab_embed.embedding" in f.keys()

    def read(self, path: Path, payload: object | None) -> PretrainedMDM:
        """The folder's weights in the suite's names; sizes cross-checked against config.json."""
        from safetensors.torch import load_file

        config_file = path / "config.json"
        if not config_file.is_file():
            raise ValueError(f"{path}: an MDLM folder needs its config.json (n_heads is not implied by the shapes)")
        config = json.loads(config_file.read_text())
        if "n_heads" not in config:
            raise ValueError(f"{config_file} has no n_heads: not an MDLMConfig")
        _refuse_time_conditioned(config.get("time_conditioning", False), str(path))
        where = str(path / "model.safetensors")
        state, sizes = convert_state(
            _unprefixed(load_file(where), where, strict=True), n_heads=int(config["n_heads"]), where=where
        )
        recorded = {"vocab_size": "vocab", "hidden_dim": "d_model", "cond_dim": "cond_dim", "n_blocks": "n_layers"}
        diff = [f"{k}={config[k]} vs {sizes[v]}" for k, v in recorded.items() if k in config and config[k] != sizes[v]]
        if diff:
            raise ValueError(f"{config_file} disagrees with the weights' shapes: {', '.join(diff)}")
        mask = config.get("mask_token_id", config.get("mask_index", sizes["vocab"] - 1))
        if mask != sizes["vocab"] - 1:
            raise ValueError(f"{config_file}: [MASK] id {mask} is not the last row ({sizes['vocab'] - 1})")
        return PretrainedMDM(
            state=state,
            backbone=mdlm_backbone(sizes, int(config["n_heads"]), config.get("dropout", 0.1)),
            data_vocab_size=sizes["vocab"] - 1,
            seq_len=int(config.get("model_length", 1024)),
            provenance={"format": "mdlm-hf", "path": str(path), "weights": "as stored (EMA or not: not recorded)"},
        )


class MDLMLightningCheckpoint(SourceFormat):
    """MDLM's Lightning ``.ckpt``: ``state_dict`` (``backbone.*`` live weights, plus the Diffusion wrapper's own
    ``noise.*`` and metric states, ignored), ``ema = {decay, num_updates, shadow_params}`` with the EMA tensors in
    ``backbone.parameters()`` order then the noise schedule's (LogLinear has none), ``hyper_parameters.config``."""

    name = "mdlm-lightning (.ckpt with state_dict backbone.* and ema.shadow_params)"

    def matches(self, path: Path, payload: object | None) -> bool:
        """An unpickled dict whose state_dict holds ``backbone.vocab_embed.embedding``."""
        state = payload.get("state_dict") if isinstance(payload, Mapping) else None
        return isinstance(state, Mapping) and PREFIX + "vocab_embed.embedding" in state

    def read(self, path: Path, payload: object | None) -> PretrainedMDM:
        """The EMA weights (the live ones kept as ``live``) in the suite's names."""
        assert isinstance(payload, Mapping)
        config = _field(payload, "hyper_parameters", "config")
        where = str(path)
        n_heads = _field(config, "model", "n_heads")
        if n_heads is None:
            raise ValueError(f"{where}: hyper_parameters.config.model.n_heads is not recorded (shapes do not imply it)")
        for key, want in (("backbone", "dit"), ("parameterization", "subs")):
            have = _field(config, key, default=want)
            if have != want:
                raise ValueError(f"{where}: MDLM {key}={have!r}; only {key}={want!r} is the suite's MDM")
        _refuse_time_conditioned(_field(config, "time_conditioning", default=False), where)
        live_raw = _unprefixed(payload["state_dict"], where, strict=False)
        live, sizes = convert_state(live_raw, n_heads=int(n_heads), where=where)
        ema = payload.get("ema")
        if ema is None:  # trained without EMA: MDLM evaluates the live weights
            weights, note = live, "live weights (the checkpoint has no EMA)"
        else:
            weights, note = self._ema_weights(ema, live_raw, sizes["n_layers"], where), "EMA shadow parameters"
        return PretrainedMDM(
            state=weights,
            backbone=mdlm_backbone(sizes, int(n_heads), _field(config, "model", "dropout", default=0.1)),
            data_vocab_size=sizes["vocab"] - 1,
            seq_len=int(_field(config, "model", "length", default=1024)),
            live=live if ema is not None else None,
            provenance={"format": "mdlm-lightning", "path": where, "weights": note},
        )

    @staticmethod
    def _ema_weights(ema: Mapping, live: Mapping[str, Tensor], n_blocks: int, where: str) -> dict[str, Tensor]:
        shadow = list(ema.get("shadow_params") or [])
        names = parameter_names(n_blocks)
        if len(shadow) < len(names):
            raise ValueError(
                f"{where}: ema.shadow_params holds {len(shadow)} tensors, the backbone has {len(names)} parameters"
            )
        out = {}
        for i, ((src, dst), tensor) in enumerate(zip(names, shadow, strict=False)):
            if tuple(tensor.shape) != tuple(live[src].shape):
                raise ValueError(
                    f"{where}: EMA shadow parameter #{i} has shape {tuple(tensor.shape)}, backbone.{src} has "
                    f"{tuple(live[src].shape)}: the shadow list is not in backbone.parameters() order"
                )
            out[dst] = tensor
        return out


register_format(MDLMHubFolder())
register_format(MDLMLightningCheckpoint())


def mdlm_parameter_count(vocab: int, d: int, cond: int, n_blocks: int) -> int:
    """Parameters of an MDLM DiT (the OWT small one: 169 627 218, docs/pretrained.md)."""
    return sum(math.prod(shape) for shape in expected_shapes(vocab, d, cond, n_blocks).values())
