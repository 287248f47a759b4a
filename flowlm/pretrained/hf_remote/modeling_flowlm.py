"""The transformers model of a flowlm export (shipped in the folder by ``flowlm-export``; it imports only torch,
transformers, the suite's DiT, copied beside it as ``flowlm_dit.py``, and ``flowlm_loading.py``, which refuses
weights that are not the network config.json describes):
``AutoModel.from_pretrained(folder, trust_remote_code=True)`` gives the network the suite trained, its weights under
the suite's own names (``net.*``), and its logits on the same inputs.

The family's conventions (docs/methods.md):
  - ``mdm``: ``model(input_ids, t=None)`` → logits over the data ids + [MASK] (B, L, |V| + 1); a time-agnostic MDM
    (the default) reads t = 0. Sampling removes the [MASK] column (SUBS).
  - ``flow`` (FLM, FMLM, FMLM+): ``model(x, s, t, pinned=None)``, x ids (B, L) or points of the simplex (B, L, |V|),
    per-token times (B, L) or per-sequence times (B,) with ``pinned`` (B, L) tokens at s = t = 1 → logits;
    ``model.log_delta(...)``: the denoiser log δ_{s,t}(x) = log_softmax(30·tanh(logits / 30)).
  - ``ar``: ``model(input_ids)`` → next-token logits (B, L, |V|): position i reads [START] (id |V|), y_0 … y_{i−1}.
"""

import torch
from transformers import PreTrainedModel
from transformers.modeling_outputs import MaskedLMOutput

from .configuration_flowlm import FlowLMConfig
from .flowlm_dit import Rotary, TimeEmbedding, build_dit
from .flowlm_loading import WeightsMatchConfig

SOFT_CAP = 30.0


class FlowLMModel(WeightsMatchConfig, PreTrainedModel):
    """The suite's DiT as a transformers model (see the module docstring for each family's call)."""

    config_class = FlowLMConfig
    base_model_prefix = "flowlm"
    main_input_name = "input_ids"

    def __init__(self, config: FlowLMConfig) -> None:
        super().__init__(config)
        self.net = build_dit(**config.dit)
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Weights come from the folder. The DiT's computed buffers (time frequencies, rotary frequencies; not saved)
        are computed again, as the DiT's own constructors compute them: transformers builds the model on the meta
        device and leaves them uninitialised."""
        if isinstance(module, Rotary):
            fresh = Rotary(2 * module.inv_freq.numel())
        elif isinstance(module, TimeEmbedding):
            fresh = TimeEmbedding(module.mlp[0].out_features, freq_dim=module.freq_dim)
        else:
            return
        for name, value in fresh.named_buffers(recurse=False):
            old = getattr(module, name)
            device = "cpu" if old.device.type == "meta" else old.device
            module.register_buffer(name, value.to(device), persistent=False)

    def forward(self, input_ids=None, s=None, t=None, pinned=None, x=None) -> MaskedLMOutput:
        family = self.config.family
        x = input_ids if x is None else x
        if family == "mdm":
            time = t if t is not None else torch.zeros(x.shape[0], device=x.device)
            if not self.config.time_conditioning:
                time = torch.zeros_like(time)
            return MaskedLMOutput(logits=self.net(x, time))
        if family == "flow":
            return MaskedLMOutput(logits=self.net(x, s, t, pinned=pinned))
        if family == "ar":
            start = torch.full_like(x[:, :1], self.config.data_vocab_size)
            inputs = torch.cat([start, x[:, :-1]], dim=1)
            zero = torch.zeros(x.shape[0], device=x.device)
            return MaskedLMOutput(logits=self.net(inputs, zero)[..., : self.config.data_vocab_size])
        raise ValueError(f"unknown flowlm family {family!r}")

    def log_delta(self, x, s, t, pinned=None) -> torch.Tensor:
        """A flow model's denoiser log δ_{s,t}(x) (B, L, |V|)."""
        logits = self(x=x, s=s, t=t, pinned=pinned).logits.float()
        return torch.log_softmax(SOFT_CAP * torch.tanh(logits / SOFT_CAP), dim=-1)
