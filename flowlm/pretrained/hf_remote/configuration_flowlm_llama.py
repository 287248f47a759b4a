"""The transformers configuration of a flowlm FMLM+ export on a LLaMA-family MDM (shipped by ``flowlm-export``;
transformers only): the decoder's sizes under transformers' Llama / Qwen2 names with ``is_causal`` false
(bidirectional attention), and ``flow``, what the flow network adds to it:

  - ``head_rows``: |V|, the data vocabulary the flow states and logits run over (the embedding may have more rows:
    SMDM's [MASK]);
  - ``cond_dim``, ``freq_dim``: the time embeddings' widths (sinusoid(freq_dim) → Linear → SiLU → Linear(cond_dim));
  - ``shift_logits``: Dream's convention (hidden position j predicts token j + 1);
  - ``lora``: ``{"r", "alpha", "targets"}`` when the decoder was trained through LoRA factors, else null.

``mask_token_id``: [MASK]; inside |V| (LLaDA, Dream) its logit is −∞ in ``log_delta``.
"""

from transformers import LlamaConfig, Qwen2Config


class FlowLMLlamaConfig(LlamaConfig):
    """FMLM+ on a bidirectional Llama decoder (SMDM, LLaDA layouts)."""

    model_type = "flowlm-llama"
    flow: dict | None = None
    mask_token_id: int | None = None
    is_causal: bool = False


class FlowLMQwen2Config(Qwen2Config):
    """FMLM+ on a bidirectional Qwen2 decoder (Dream's layout)."""

    model_type = "flowlm-qwen2"
    flow: dict | None = None
    mask_token_id: int | None = None
    is_causal: bool = False
