"""The transformers configuration of a flowlm export in LLaDA's layout (shipped by ``flowlm-export``; transformers
only): ``config.json`` holds LLaDA's own keys (``d_model``, ``n_layers``, …, ``mask_token_id``) for LLaDA's code and
the suite's reader, and the same sizes under transformers' Llama names, which this class reads."""

from transformers import LlamaConfig

# LLaDA's layout, the one statement of it (the shipped model's weight renaming and the suite's loader and writer,
# flowlm/pretrained/llada.py, read it): a block's name (after model.transformer.blocks.{i}.) → transformers' Llama
# name (after model.layers.{i}.); the head is model.transformer.ff_out.
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "attn_out": "self_attn.o_proj",
    "ff_norm": "post_attention_layernorm",
    "ff_proj": "mlp.gate_proj",  # silu(ff_proj(h)) ⊙ up_proj(h)
    "up_proj": "mlp.up_proj",
    "ff_out": "mlp.down_proj",  # a block's ff_out; the head's is model.transformer.ff_out
}


class LLaDAConfig(LlamaConfig):
    """A Llama decoder run bidirectionally (``is_causal`` false), untied head, [MASK] = ``mask_token_id``."""

    model_type = "llada"
