"""The transformers configuration of a flowlm export in LLaDA's layout (shipped by ``flowlm-export``; transformers
only): ``config.json`` holds LLaDA's own keys (``d_model``, ``n_layers``, …, ``mask_token_id``) for LLaDA's code and
the suite's reader, and the same sizes under transformers' Llama names, which this class reads."""

from transformers import LlamaConfig


class LLaDAConfig(LlamaConfig):
    """A Llama decoder run bidirectionally (``is_causal`` false), untied head, [MASK] = ``mask_token_id``."""

    model_type = "llada"
