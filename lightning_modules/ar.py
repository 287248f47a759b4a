"""Autoregressive baseline: the shared DiT with a causal mask, next-token cross-entropy (the papers' AR rows)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from flowlm.samplers.autoregressive import CausalDenoiser
from lightning_modules.base import FlowLMModule


class ARModule(FlowLMModule):
    """Position i reads [START], y_0 … y_{i−1} (causal attention) and predicts y_i; the loss covers the non-prompt
    positions. The DiT's time conditioning is fed a constant 0. Id ``data_vocab_size`` is [START]."""

    family = "ar"

    def __init__(self, *, data_vocab_size: int, seq_len: int, backbone: dict, optim: dict, seed: int = 0) -> None:
        super().__init__(data_vocab_size=data_vocab_size, seq_len=seq_len, backbone=backbone, optim=optim, seed=seed)
        self.save_hyperparameters()
        self.start_id = data_vocab_size
        self.net = self.build_backbone(data_vocab_size + 1, two_times=False, causal=True)

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits over the data vocabulary (B, L, |V|); position i is the prediction of tokens[:, i]."""
        start = torch.full_like(tokens[:, :1], self.start_id)
        inputs = torch.cat([start, tokens[:, :-1]], dim=1)
        return self.net(inputs, torch.zeros(tokens.shape[0], device=tokens.device))[..., : self.start_id]

    def denoiser(self) -> CausalDenoiser:
        """This model as the AR sampler sees it."""
        return CausalDenoiser(fn=self)

    def nll(self, batch: dict) -> Tensor:
        """Mean next-token NLL over the non-prompt positions of the batch."""
        tokens, prompt = batch["tokens"], batch["prompt_mask"]
        nll = F.cross_entropy(self(tokens).float().transpose(1, 2), tokens, reduction="none")
        loss_mask = batch.get("loss_mask", ~prompt)  # text data may leave PAD out of the loss
        return (nll * loss_mask).sum() / loss_mask.sum().clamp_min(1)

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        """Teacher-forced next-token cross-entropy."""
        loss = self.nll(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> Tensor:
        """Validation NLL (nats per generated token)."""
        loss = self.nll(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=batch["tokens"].shape[0])
        return loss
