"""The loader of a flowlm MLFM export (shipped by ``flowlm-export``; torch, transformers and peft only).

The folder is a PEFT LoRA adapter (``adapter_config.json``, ``adapter_model.safetensors``) over the frozen MDM in
``base/`` (an export of its own: the suite's DiT, or a LLaMA-family MDM in its source's layout). PEFT carries the
LoRA factors; MLFM's time conditioning is not LoRA: a time embedding c = SiLU(emb(t)) and per layer a zero-initialised
adaLN (shift, scale, gate) = W_l c applied around the MDM's own layers (methods.md §6), held in ``model.safetensors``
and attached here::

    import sys; sys.path.insert(0, FOLDER); from mlfm_peft import load_mlfm
    mlfm = load_mlfm(FOLDER)  # = PeftModel.from_pretrained(base, FOLDER) + the time adaLN
    logits = mlfm(z, t)  # z (B, L, d): input embeddings (bridge states), t (B,): the bridge's time feature
"""

import functools
import importlib.util
import json
from pathlib import Path

import torch
from torch import nn


def _dit_module(folder: Path):
    spec = importlib.util.spec_from_file_location("flowlm_dit_mlfm", folder / "flowlm_dit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class MLFM(nn.Module):
    """A PEFT model (the MDM with LoRA) + MLFM's time adaLN: ``forward(z, t) → logits`` over the MDM's vocabulary."""

    def __init__(self, peft_model: nn.Module, info: dict, time_state: dict, dit) -> None:
        super().__init__()
        self.peft_model, self.info = peft_model, info
        net = peft_model.get_base_model()
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
        else:  # transformers' decoder layers, modulated through forward hooks
            layers = net.model.layers
            self.emb_s = embedding
            self.layer_mods = nn.ModuleList(nn.Linear(cond, 6 * net.config.hidden_size) for _ in layers)
            self._mods = None
            for i, layer in enumerate(layers):
                layer.input_layernorm.register_forward_hook(functools.partial(self._hook, i, "norm", 0))
                layer.self_attn.register_forward_hook(functools.partial(self._hook, i, "gate", 2))
                layer.post_attention_layernorm.register_forward_hook(functools.partial(self._hook, i, "norm", 3))
                layer.mlp.register_forward_hook(functools.partial(self._hook, i, "gate", 5))
        own = {k: v for k, v in self.state_dict().items() if not k.startswith(("peft_model.", "net."))}
        missing = set(own) ^ set(time_state)
        if missing:
            raise ValueError(f"model.safetensors does not hold MLFM's time adaLN: {sorted(missing)[:4]}")
        self.load_state_dict(time_state, strict=False)

    def _hook(self, layer, kind, slot, module, args, output):
        """h ← h + (1 + gate) ⊙ Branch(Norm(h) ⊙ (1 + scale) + shift): a norm's output or a branch's."""
        if self._mods is None:
            return output
        chunks = self._mods[layer]
        if kind == "norm":
            return output * (1 + chunks[slot + 1]) + chunks[slot]
        if isinstance(output, tuple):  # attention returns (output, weights)
            return (output[0] * (1 + chunks[slot]), *output[1:])
        return output * (1 + chunks[slot])

    def forward(self, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Logits (B, L, vocab) for input embeddings z (B, L, d) at time feature t (B,)."""
        if self.kind == "dit":
            c = nn.functional.silu(self.time_embed(t[:, None]))
            extra = [mod(c) for mod in self.block_mods] + [self.final_mod(c)]
            return self.net.forward_embeddings(z, torch.zeros_like(t), extra=extra)  # the MDM reads time 0
        c = nn.functional.silu(self.emb_s(t[:, None]))
        self._mods = [mod(c).to(z.dtype).chunk(6, dim=-1) for mod in self.layer_mods]
        try:
            logits = self.peft_model(inputs_embeds=z).logits
        finally:
            self._mods = None
        if self.info["shift_logits"]:  # Dream: the prediction for position i is the output at i − 1
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        return logits


def load_mlfm(folder, base: nn.Module | None = None) -> MLFM:
    """The MLFM of an export folder: its ``base/`` MDM (or ``base``, the same weights loaded elsewhere) with the PEFT
    adapter and the time adaLN, in eval mode."""
    import transformers
    from peft import PeftModel
    from safetensors.torch import load_file

    folder = Path(folder)
    info = json.loads((folder / "config.json").read_text())["mlfm_peft"]
    if base is None:
        auto = getattr(transformers, info["auto_class"])
        base = auto.from_pretrained(str(folder / "base"), trust_remote_code=True)
    peft_model = PeftModel.from_pretrained(base, str(folder))
    return MLFM(peft_model, info, load_file(str(folder / "model.safetensors")), _dit_module(folder)).eval()
