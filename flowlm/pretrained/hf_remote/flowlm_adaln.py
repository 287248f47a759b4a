"""Time adaLN around transformers' own decoder layers, through forward hooks (shipped in a flowlm export beside the
models that use it: ``modeling_flowlm_llama.py``, ``mlfm_peft.py``; no imports beyond the standard library).

Per decoder layer l, with (shift₁, scale₁, gate₁, shift₂, scale₂, gate₂) = W_l c (methods.md §4, §6):

    h ← h + (1 + gate₁) ⊙ Attn(RMSNorm₁(h) ⊙ (1 + scale₁) + shift₁)
    h ← h + (1 + gate₂) ⊙ MLP(RMSNorm₂(h) ⊙ (1 + scale₂) + shift₂)

The hooks change the outputs of the layer's two norms and two branches only; the layer's own code (residuals,
attention, its mask) runs unchanged. The suite's ``flowlm.backbones.llama.LlamaAdaLNAdapter`` computes the same.
"""

import contextlib
import functools

# (submodule of a Llama/Qwen2 decoder layer, what its output gets, index of its first chunk among the six)
HOOKED = (
    ("input_layernorm", "norm", 0),  # shift₁, scale₁
    ("self_attn", "gate", 2),  # gate₁
    ("post_attention_layernorm", "norm", 3),  # shift₂, scale₂
    ("mlp", "gate", 5),  # gate₂
)


class LayerModulation:
    """Forward hooks on each decoder layer's norms and branches that apply the chunks ``applied`` sets (one 6-tuple
    per layer, each broadcasting against (B, L, d)); outside ``applied`` the layers run unchanged."""

    def __init__(self, layers) -> None:
        self.mods = None
        for i, layer in enumerate(layers):
            for name, kind, slot in HOOKED:
                getattr(layer, name).register_forward_hook(functools.partial(self._hook, i, kind, slot))

    def _hook(self, layer, kind, slot, module, args, output):
        """A norm's output → output ⊙ (1 + scale) + shift; a branch's → output ⊙ (1 + gate)."""
        if self.mods is None:
            return output
        chunks = self.mods[layer]
        if kind == "norm":
            return output * (1 + chunks[slot + 1]) + chunks[slot]
        if isinstance(output, tuple):  # attention returns (output, weights)
            return (output[0] * (1 + chunks[slot]), *output[1:])
        return output * (1 + chunks[slot])

    @contextlib.contextmanager
    def applied(self, mods):
        """The layers modulated by ``mods`` (a list of per-layer chunk tuples) inside the block."""
        saved, self.mods = self.mods, mods
        try:
            yield
        finally:
            self.mods = saved
