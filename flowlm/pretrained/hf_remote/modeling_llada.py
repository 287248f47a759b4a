"""The transformers model of a flowlm export in LLaDA's layout (shipped by ``flowlm-export``; torch and transformers
only). Not LLaDA's own ``modeling_llada.py``, which reads this folder too (same tensor names, same config keys):
transformers' ``LlamaForCausalLM`` run bidirectionally, loading LLaDA's names through a registered renaming
(``model.transformer.blocks.{i}.q_proj`` → ``model.layers.{i}.self_attn.q_proj``, …; the head
``model.transformer.ff_out`` → ``lm_head``), which ``save_pretrained`` inverts.

``AutoModel.from_pretrained(folder, trust_remote_code=True)(input_ids).logits``: (B, L, vocab), unshifted (position i
predicts token i), over every id [MASK] included (a sampler sets the [MASK] logit to −∞).
"""

from transformers import LlamaForCausalLM
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import WeightRenaming

from .configuration_llada import BLOCK_NAMES, LLaDAConfig
from .flowlm_loading import WeightsMatchConfig

RENAMES = [
    WeightRenaming(r"^model\.transformer\.wte\.", "model.embed_tokens."),
    WeightRenaming(r"^model\.transformer\.ln_f\.", "model.norm."),
    WeightRenaming(r"^model\.transformer\.ff_out\.", "lm_head."),
] + [
    WeightRenaming(rf"^model\.transformer\.blocks\.(\d+)\.{name}\.", rf"model.layers.\1.{target}.")
    for name, target in BLOCK_NAMES.items()
]


class LLaDAModelLM(WeightsMatchConfig, LlamaForCausalLM):
    """LLaDA's network on transformers' Llama: bidirectional attention, untied head over the whole vocabulary."""

    config_class = LLaDAConfig


register_checkpoint_conversion_mapping(LLaDAModelLM.__name__, RENAMES, overwrite=True)
