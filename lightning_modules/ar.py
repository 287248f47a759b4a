"""Autoregressive baseline: the shared DiT with a causal mask, next-token cross-entropy (the papers' AR rows)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from flowlm.models.ar import CausalModel
from flowlm.objectives.ar import ar_loss
from flowlm.objectives.base import LossOutput
from lightning_modules.base import FlowLMModule


class ARModule(FlowLMModule):
    """Position i reads [START], y_0 … y_{i−1} (causal attention) and predicts y_i; the loss covers the non-prompt
    positions. Id ``data_vocab_size`` is [START] (flowlm/models/ar.py)."""

    family = "ar"
    label = "AR"

    def __init__(self, **common: Any) -> None:
        super().__init__(**common)  # FlowLMModule's: data_vocab_size, seq_len, backbone, optim, seed
        self.save_hyperparameters()
        self.start_id = self.data_vocab_size
        self.net = self.build_backbone(self.data_vocab_size + 1, two_times=False, causal=True)
        self.view = CausalModel(self.net, self.start_id)

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits over the data vocabulary (B, L, |V|); position i is the prediction of tokens[:, i]."""
        return self.view(tokens)

    def draw(self, batch: dict, batch_idx: int, *, stage: str) -> dict:
        """Teacher forcing draws nothing."""
        return {}

    def loss(self, batch: dict, draws: dict, *, parts: bool = False) -> LossOutput:
        """Mean next-token NLL over the non-prompt positions of the batch (nats per generated token)."""
        return ar_loss(self(batch["tokens"]), batch["tokens"], self.scored(batch))

    def scored(self, batch: dict) -> Tensor:
        """The positions the NLL averages over: off the prompt (text data may leave PAD out: ``loss_mask``)."""
        return batch.get("loss_mask", ~batch["prompt_mask"])

    def loss_count(self, batch: dict, draws: dict) -> Tensor:
        """The scored positions (the mean's denominator)."""
        return self.scored(batch).sum()
