"""The transformers configuration of a flowlm export in SMDM's layout (shipped by ``flowlm-export``; transformers
only): ``config.json`` holds lit-gpt's ``Config`` fields under ``litgpt_config`` (SMDM's own code and the suite's
reader take them) and the same sizes under transformers' Llama names, which this class reads."""

from transformers import LlamaConfig


class SMDMConfig(LlamaConfig):
    """A Llama decoder run bidirectionally (``is_causal`` false): ``vocab_size`` embedding rows, the last one [MASK],
    ``litgpt_config["padded_vocab_size"]`` head rows (no [MASK] logit)."""

    model_type = "smdm"
