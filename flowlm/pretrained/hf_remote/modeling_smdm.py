"""The transformers model of a flowlm export in SMDM's layout (shipped by ``flowlm-export``; torch and transformers
only): lit-gpt ``TransEncoder`` names (``transformer.h.{i}.attn.attn`` a fused QKV interleaved per query group,
``norm_1``, ``mlp.swiglu.w1``…) loaded into transformers' ``LlamaForCausalLM`` run bidirectionally, through a
registered renaming and a QKV split that ``save_pretrained`` inverts. The head has one row fewer than the embedding:
[MASK], the last embedding row, has no logit.

``AutoModel.from_pretrained(folder, trust_remote_code=True)(input_ids).logits``: (B, L, padded vocab), unshifted.
"""

import torch
from transformers import LlamaForCausalLM
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import ConversionOps, WeightConverter, WeightRenaming

from .configuration_smdm import SMDMConfig
from .flowlm_loading import WeightsMatchConfig

QKV = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"]


class SplitGroupedQKV(ConversionOps):
    """lit-gpt's fused QKV → (q, k, v): rows per query group g are [q_{g,0} … q_{g,q_per_kv−1}, k_g, v_g]."""

    def convert(self, input_dict, source_patterns, target_patterns, config=None, **kwargs):
        (weight,) = input_dict.values()
        weight = weight[0] if isinstance(weight, list) else weight
        heads, groups = config.num_attention_heads, config.num_key_value_heads
        per = heads // groups
        w = weight.view(groups, per + 2, -1, weight.shape[-1])
        q, k, v = w[:, :per], w[:, per], w[:, per + 1]
        parts = (x.reshape(-1, weight.shape[-1]).contiguous() for x in (q, k, v))
        return dict(zip(target_patterns, parts, strict=True))

    @property
    def reverse_op(self) -> ConversionOps:
        return FuseGroupedQKV()


class FuseGroupedQKV(ConversionOps):
    """(q, k, v) → lit-gpt's fused QKV, interleaved per query group (``SplitGroupedQKV`` inverted)."""

    def convert(self, input_dict, source_patterns, target_patterns, config=None, **kwargs):
        parts = [input_dict[p] for p in source_patterns]
        q, k, v = (p[0] if isinstance(p, list) else p for p in parts)
        groups, d = config.num_key_value_heads, q.shape[-1]
        shape = (groups, -1, k.shape[0] // groups, d)
        fused = torch.cat([q.reshape(shape), k.reshape(shape), v.reshape(shape)], dim=1)
        return {target_patterns[0]: fused.reshape(-1, d)}

    @property
    def reverse_op(self) -> ConversionOps:
        return SplitGroupedQKV()


# lit-gpt name → transformers' Llama name (per block after transformer.h.{i}. / model.layers.{i}.)
RENAMES = [
    WeightRenaming(r"^transformer\.wte\.", "model.embed_tokens."),
    WeightRenaming(r"^transformer\.ln_f\.", "model.norm."),
    WeightRenaming(r"^transformer\.h\.", "model.layers."),
    WeightRenaming(r"\.norm_1\.", ".input_layernorm."),
    WeightRenaming(r"\.norm_2\.", ".post_attention_layernorm."),
    WeightRenaming(r"\.attn\.proj\.", ".self_attn.o_proj."),
    WeightRenaming(r"\.mlp\.swiglu\.w1\.", ".mlp.gate_proj."),  # xformers SwiGLU: w3(silu(x·w1ᵀ) ⊙ x·w2ᵀ)
    WeightRenaming(r"\.mlp\.swiglu\.w2\.", ".mlp.up_proj."),
    WeightRenaming(r"\.mlp\.swiglu\.w3\.", ".mlp.down_proj."),
    WeightConverter("attn.attn.weight", QKV, operations=[SplitGroupedQKV()]),
]


class SMDMForMaskedLM(WeightsMatchConfig, LlamaForCausalLM):
    """SMDM's network on transformers' Llama: bidirectional attention, a head of the padded vocabulary."""

    config_class = SMDMConfig

    def __init__(self, config: SMDMConfig) -> None:
        super().__init__(config)
        rows = config.litgpt_config["padded_vocab_size"]
        self.lm_head = torch.nn.Linear(config.hidden_size, rows, bias=False)
        self.post_init()


register_checkpoint_conversion_mapping(SMDMForMaskedLM.__name__, RENAMES, overwrite=True)
