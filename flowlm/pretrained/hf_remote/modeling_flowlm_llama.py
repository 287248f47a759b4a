"""The transformers model of a flowlm FMLM+ export on a LLaMA-family MDM (shipped by ``flowlm-export``; torch and
transformers only, with two files beside it: ``flowlm_dit.py``, the suite's DiT file, for its time embedding and
pinned conditioning, and ``flowlm_adaln.py``, the adaLN hooks). ``AutoModel.from_pretrained(folder,
trust_remote_code=True)`` builds the suite's ``LlamaFlowNet`` under its own module tree, so the weights keep the
suite's names: ``net.base.model.*`` (transformers' ``LlamaModel`` / ``Qwen2Model``, run bidirectionally through
transformers' own mask code: ``is_causal`` false), ``net.base.lm_head`` (|V| rows), ``net.emb_s``, ``net.emb_t``,
``net.layer_mods`` (and PEFT's ``base_layer`` / ``lora_A`` / ``lora_B`` names when the decoder trained through LoRA).

    model(x=x, s=s, t=t, pinned=None).logits  # (B, L, |V|); x ids (B, L) or vectors over |V| (B, L, |V|)
    model.log_delta(x, s, t, pinned=None)     # log δ_{s,t}(x) = log_softmax(30·tanh(logits / 30))

The flow map (methods.md §4): times s ≤ t per token (B, L) or per sequence (B,); with ``pinned`` (B, L) the times
are per sequence and the pinned tokens sit at s = t = 1. c = SiLU(emb_s(s) + emb_t(t)); per layer l the chunks
W_l c modulate transformers' layer (``flowlm_adaln.py``). A vector input is h = x·E over E = the embedding's first
|V| rows, in float32. Dream (``flow.shift_logits``): hidden position j predicts token j + 1, so its output is read at
j + 1 (logits = cat(raw[:, :1], raw[:, :-1])) and it is conditioned on token j + 1's times (c_j ← c_{j+1}).
A [MASK] inside |V| (LLaDA, Dream) gets logit −∞ in ``log_delta`` (before the cap), as the suite's ``FlowMapModel``.
"""

import torch
from torch import nn
from torch.nn import functional as F
from transformers import LlamaModel, Qwen2Model
from transformers.modeling_outputs import MaskedLMOutput
from transformers.models.llama.modeling_llama import LlamaPreTrainedModel
from transformers.models.qwen2.modeling_qwen2 import Qwen2PreTrainedModel

from .configuration_flowlm_llama import FlowLMLlamaConfig, FlowLMQwen2Config
from .flowlm_adaln import LayerModulation
from .flowlm_dit import PinnedCondition, TimeEmbedding, modulation
from .flowlm_loading import WeightsMatchConfig

SOFT_CAP = 30.0


class LoRALinear(nn.Module):
    """A Linear with a LoRA update under PEFT's names, at inference: y = W x + (α / r) · B A x."""

    def __init__(self, base_layer: nn.Linear, r: int, alpha: float) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base_layer.in_features, r, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(r, base_layer.out_features, bias=False)})
        self.scaling = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = self.lora_B["default"](self.lora_A["default"](x.to(self.lora_A["default"].weight.dtype)))
        return self.base_layer(x) + update * self.scaling


class Decoder(nn.Module):
    """The MDM: transformers' decoder (``model``) + an untied head over |V| (``lm_head``)."""

    def __init__(self, config, decoder_cls: type) -> None:
        super().__init__()
        self.model = decoder_cls(config)
        self.lm_head = nn.Linear(config.hidden_size, config.flow["head_rows"], bias=False)
        lora = config.flow.get("lora")
        for name in lora["targets"] if lora else ():
            parent, _, leaf = name.rpartition(".")
            owner = self.get_submodule(parent)
            setattr(owner, leaf, LoRALinear(getattr(owner, leaf), lora["r"], lora["alpha"]))


class FlowNet(nn.Module):
    """The suite's ``LlamaFlowNet`` at inference: the decoder with per-layer (s, t) adaLN (module docstring)."""

    def __init__(self, config, decoder_cls: type) -> None:
        super().__init__()
        flow = config.flow
        self.base = Decoder(config, decoder_cls)
        self.emb_s = TimeEmbedding(flow["cond_dim"], freq_dim=flow["freq_dim"])
        self.emb_t = TimeEmbedding(flow["cond_dim"], freq_dim=flow["freq_dim"])
        self.layer_mods = nn.ModuleList(
            nn.Linear(flow["cond_dim"], 6 * config.hidden_size) for _ in range(config.num_hidden_layers)
        )
        self.vocab_size, self.shift = flow["head_rows"], bool(flow["shift_logits"])
        self.modulation = LayerModulation(self.base.model.layers)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Ids → E[x]; vectors over |V| → x·E[:|V|] in float32, returned in the embedding's dtype."""
        weight = self.base.model.embed_tokens.weight
        if not x.is_floating_point():
            return self.base.model.embed_tokens(x)
        if x.shape[-1] != self.vocab_size:
            raise ValueError(f"x has last dim {x.shape[-1]}, the flow's vocabulary |V| = {self.vocab_size}")
        with torch.autocast(device_type=x.device.type, enabled=False):
            return (x.float() @ weight[: self.vocab_size].float()).to(weight.dtype)

    def condition(self, s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """c = SiLU(emb_s(s) + emb_t(t)): (B, 1, cond) for times (B,), (B, L, cond) for (B, L)."""
        s, t = (u[:, None] if u.dim() == 1 else u for u in (s, t))
        return F.silu(self.emb_s(s) + self.emb_t(t))

    def flow_condition(self, s, t, pinned, batch: int, length: int):
        """The conditioning of every position: per token/sequence, or the pinned table; moved left for Dream."""
        if pinned is None:
            c = self.condition(s, t)
        else:
            if pinned.shape != (batch, length) or s.dim() > 1 or t.dim() > 1:
                raise ValueError("with `pinned` (B, L), the times are per sequence: (B,)")
            one = torch.ones(1, device=pinned.device)
            rows = 2 * torch.arange(batch, device=pinned.device)[:, None] + pinned.long()
            c = PinnedCondition(self.condition(s, t), self.condition(one, one), rows)
        if self.shift:  # hidden j predicts token j + 1: it reads that token's times
            if isinstance(c, PinnedCondition):
                c = c._replace(rows=torch.cat([c.rows[:, 1:], c.rows[:, -1:]], dim=1))
            elif c.shape[1] > 1:
                c = torch.cat([c[:, 1:], c[:, -1:]], dim=1)
        return c

    def forward(self, x: torch.Tensor, s: torch.Tensor, t: torch.Tensor, pinned=None) -> torch.Tensor:
        """Logits (B, L, |V|) for ids or vectors x at times (s, t) [pinned]."""
        h = self.embed(x)
        c = self.flow_condition(s, t, pinned, h.shape[0], h.shape[1])
        mods = [modulation(mod, c).to(h.dtype).chunk(6, dim=-1) for mod in self.layer_mods]
        with self.modulation.applied(mods):
            out = self.base.model(inputs_embeds=h, use_cache=False).last_hidden_state
        if self.shift:  # the prediction for position i is the output at i − 1
            out = torch.cat([out[:, :1], out[:, :-1]], dim=1)
        return self.base.lm_head(out)


class FlowLMFlowMixin(WeightsMatchConfig):
    """What the Llama and Qwen2 models share: the flow network under ``net``, its call and its log δ."""

    decoder_cls: type
    base_model_prefix = "net"
    main_input_name = "input_ids"

    def __init__(self, config) -> None:
        super().__init__(config)
        self.net = FlowNet(config, self.decoder_cls)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """Weights come from the folder; the time embeddings' frequencies (a buffer, not saved) are computed again
        as the suite's constructor computes them (transformers builds the model on the meta device); the rest as
        transformers' Llama / Qwen2 (RoPE frequencies)."""
        if not isinstance(module, TimeEmbedding):
            super()._init_weights(module)
            return
        fresh = TimeEmbedding(module.mlp[0].out_features, freq_dim=module.freq_dim)
        device = "cpu" if module.freqs.device.type == "meta" else module.freqs.device
        module.register_buffer("freqs", fresh.freqs.to(device), persistent=False)

    def forward(self, input_ids=None, s=None, t=None, pinned=None, x=None) -> MaskedLMOutput:
        """Logits (B, L, |V|) of ids ``input_ids`` or ``x`` (ids or vectors over |V|) at times (s, t) [pinned]."""
        x = input_ids if x is None else x
        if x is None or s is None or t is None:
            raise ValueError("a flow map reads x (or input_ids) and both times s and t")
        return MaskedLMOutput(logits=self.net(x, s, t, pinned=pinned))

    def log_delta(self, x, s, t, pinned=None) -> torch.Tensor:
        """The denoiser log δ_{s,t}(x) (B, L, |V|), float32; a [MASK] inside |V| at logit −∞ before the cap."""
        logits = self(x=x, s=s, t=t, pinned=pinned).logits.float()
        mask = self.config.mask_token_id
        if mask is not None and mask < logits.shape[-1]:
            logits = logits.index_fill(-1, torch.tensor([mask], device=logits.device), -torch.inf)
        return torch.log_softmax(SOFT_CAP * torch.tanh(logits / SOFT_CAP), dim=-1)


class FlowLMLlamaFlowModel(FlowLMFlowMixin, LlamaPreTrainedModel):
    """FMLM+ on transformers' Llama decoder, bidirectional (SMDM, LLaDA layouts)."""

    config_class = FlowLMLlamaConfig
    decoder_cls = LlamaModel


class FlowLMQwen2FlowModel(FlowLMFlowMixin, Qwen2PreTrainedModel):
    """FMLM+ on transformers' Qwen2 decoder, bidirectional, shifted logits (Dream's layout)."""

    config_class = FlowLMQwen2Config
    decoder_cls = Qwen2Model
