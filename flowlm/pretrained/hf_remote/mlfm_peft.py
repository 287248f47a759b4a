"""The loader of a flowlm MLFM export (shipped by ``flowlm-export``; torch, transformers and peft only).

The folder is a PEFT LoRA adapter (``adapter_config.json``, ``adapter_model.safetensors``) over the frozen MDM in
``base/`` (an export of its own: the suite's DiT, or a LLaMA-family MDM in its source's layout). PEFT carries the
LoRA factors; MLFM's time conditioning is not LoRA: a time embedding c = SiLU(emb(t)) and per layer a zero-initialised
adaLN (shift, scale, gate) = W_l c applied around the MDM's own layers (methods.md §6), held in ``model.safetensors``
and attached here::

    import sys; sys.path.insert(0, FOLDER); from mlfm_peft import load_mlfm
    mlfm = load_mlfm(FOLDER)  # = PeftModel.from_pretrained(base, FOLDER) + the time adaLN
    logits = mlfm(z, t)  # z (B, L, d): input embeddings (bridge states), t (B,): the bridge's time feature

A folder exported with ``--merge-mlfm`` also holds ``merged/``, the base with the LoRA folded in (W + (α/r)·B A):
``load_mlfm(FOLDER, merged=True)`` loads it with the time adaLN and needs no peft.
"""

import importlib.util
import json
from pathlib import Path

import torch
from torch import nn


def _shipped(folder: Path, name: str):
    """The module ``name``.py shipped in ``folder`` (``flowlm_dit``, ``flowlm_adaln``), loaded by its path."""
    spec = importlib.util.spec_from_file_location(f"{name}_mlfm", folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class MLFM(nn.Module):
    """The MDM with LoRA (a PEFT model, or the merged weights) + MLFM's time adaLN: ``forward(z, t) → logits`` over
    the MDM's vocabulary."""

    def __init__(self, model: nn.Module, info: dict, time_state: dict, dit, adaln) -> None:
        super().__init__()
        self.model, self.info = model, info
        net = model.get_base_model() if hasattr(model, "get_base_model") else model  # PeftModel's, or merged
        self.kind = info["kind"]
        first = "time_embed" if self.kind == "dit" else "emb_s"
        cond = time_state[f"{first}.mlp.0.weight"].shape[0]
        embedding = dit.TimeEmbedding(cond)
        if self.kind == "dit":  # the DiT reads the modulation itself (forward_embeddings(extra=...))
            self.net = net.net
            d = self.net.d_model
            self.time_embed = embedding
            self.block_mods = nn.ModuleList(nn.Linear(cond, 6 * d) for _ in self.net.blocks)
            self.final_mod = nn.Linear(cond, 2 * d)
        else:  # transformers' decoder layers, modulated through forward hooks (flowlm_adaln.py)
            layers = net.model.layers
            self.emb_s = embedding
            self.layer_mods = nn.ModuleList(nn.Linear(cond, 6 * net.config.hidden_size) for _ in layers)
            self.modulation = adaln.LayerModulation(layers)
        own = {k: v for k, v in self.state_dict().items() if not k.startswith(("model.", "net."))}
        missing = set(own) ^ set(time_state)
        if missing:
            raise ValueError(f"model.safetensors does not hold MLFM's time adaLN: {sorted(missing)[:4]}")
        self.load_state_dict(time_state, strict=False)

    def forward(self, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Logits (B, L, vocab) for input embeddings z (B, L, d) at time feature t (B,)."""
        if self.kind == "dit":
            c = nn.functional.silu(self.time_embed(t[:, None]))
            extra = [mod(c) for mod in self.block_mods] + [self.final_mod(c)]
            return self.net.forward_embeddings(z, torch.zeros_like(t), extra=extra)  # the MDM reads time 0
        c = nn.functional.silu(self.emb_s(t[:, None]))
        mods = [mod(c).to(z.dtype).chunk(6, dim=-1) for mod in self.layer_mods]
        with self.modulation.applied(mods):
            logits = self.model(inputs_embeds=z).logits
        if self.info["shift_logits"]:  # Dream: the prediction for position i is the output at i − 1
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        return logits


def load_mlfm(folder, base: nn.Module | None = None, *, merged: bool = False) -> MLFM:
    """The MLFM of an export folder: its ``base/`` MDM (or ``base``, the same weights loaded elsewhere) with the PEFT
    adapter, or with ``merged`` the folded weights of ``merged/``, and the time adaLN, in eval mode."""
    import transformers
    from safetensors.torch import load_file

    folder = Path(folder)
    info = json.loads((folder / "config.json").read_text())["mlfm_peft"]
    if merged and not info.get("merged"):
        raise ValueError(f"{folder} has no merged/ weights: export it with --merge-mlfm")
    if merged or base is None:
        auto = getattr(transformers, info["auto_class"])
        model = auto.from_pretrained(str(folder / ("merged" if merged else "base")), trust_remote_code=True)
    if not merged:
        from peft import PeftModel

        model = PeftModel.from_pretrained(base if base is not None else model, str(folder))
    time_state = load_file(str(folder / "model.safetensors"))
    return MLFM(model, info, time_state, _shipped(folder, "flowlm_dit"), _shipped(folder, "flowlm_adaln")).eval()
