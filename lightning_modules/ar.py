"""Autoregressive baseline: the shared DiT with a causal mask, next-token cross-entropy (the papers' AR rows)."""

from __future__ import annotations

import torch
from torch import Tensor

from flowlm.backbones.dit import KVCache
from flowlm.objectives.ar import ar_loss
from flowlm.objectives.base import LossOutput
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
        inputs = self.shifted_inputs(tokens, 0, tokens.shape[1])
        return self.net(inputs, torch.zeros(tokens.shape[0], device=tokens.device))[..., : self.start_id]

    def shifted_inputs(self, tokens: Tensor, start: int, stop: int) -> Tensor:
        """The network inputs at positions start … stop − 1: [START] at 0, tokens[:, i − 1] at i."""
        if start > 0:
            return tokens[:, start - 1 : stop - 1]
        first = torch.full_like(tokens[:, :1], self.start_id)
        return torch.cat([first, tokens[:, : stop - 1]], dim=1)

    def new_cache(self, max_len: int) -> KVCache:
        """An empty KV cache for decoding up to ``max_len`` positions."""
        return self.net.new_cache(max_len)

    def extend(self, tokens: Tensor, stop: int, cache: KVCache) -> Tensor:
        """Logits (B, stop − cache.length, |V|) of positions cache.length … stop − 1, as ``forward(tokens)`` gives
        there, feeding only those positions' inputs (tokens[:, cache.length − 1 : stop − 1]) through the cache,
        which advances to ``stop``. The time is the same constant 0 per sequence as in ``forward``, so every
        adaLN modulation is the identical (B, 1, ·) vector in both paths."""
        inputs = self.shifted_inputs(tokens, cache.length, stop)
        time = torch.zeros(tokens.shape[0], device=tokens.device)
        return self.net.forward_cached(inputs, time, cache)[..., : self.start_id]

    def denoiser(self) -> CausalDenoiser:
        """This model as the AR sampler sees it (with incremental KV-cached decoding)."""
        return CausalDenoiser(fn=self, new_cache=self.new_cache, extend=self.extend)

    def nll(self, batch: dict) -> LossOutput:
        """Mean next-token NLL over the non-prompt positions of the batch."""
        tokens, prompt = batch["tokens"], batch["prompt_mask"]
        loss_mask = batch.get("loss_mask", ~prompt)  # text data may leave PAD out of the loss
        return ar_loss(self(tokens), tokens, loss_mask)

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        """Teacher-forced next-token cross-entropy."""
        loss = self.nll(batch).loss
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> Tensor:
        """Validation NLL (nats per generated token)."""
        loss = self.nll(batch).loss
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=batch["tokens"].shape[0])
        return loss
