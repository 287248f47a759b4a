"""Masked diffusion model (MDLM-style, absorbing process, SUBS ELBO): methods.md §2."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from flowlm.models.mdm import MaskedModel
from flowlm.objectives.base import LossOutput
from flowlm.objectives.mdm import mdm_elbo_loss
from flowlm.processes.masking import MaskingProcess
from lightning_modules.base import FlowLMModule


class MDMModule(FlowLMModule):
    """The network sees data ids plus a [MASK] id (the last row); by default it is time-agnostic (MDLM/SMDM)."""

    family = "mdm"
    label = "MDM"

    def __init__(
        self,
        *,
        eps: float = 1e-3,
        time_conditioning: bool = False,
        **common: Any,
    ) -> None:
        super().__init__(**common)  # FlowLMModule's: data_vocab_size, seq_len, backbone, optim, seed
        self.save_hyperparameters()
        self.net = self.build_backbone(self.data_vocab_size + 1, two_times=False)
        # [MASK]: the DiT's extra last row (id |V|); a LLaMA-family backbone's own (SMDM: its extra embedding row,
        # the head predicts the data tokens only; LLaDA/Dream: an id inside the vocabulary, logit −∞, §2 SUBS)
        self.mask_id = self.backbone_mask_id(self.net)
        if time_conditioning and self.backbone_kind.time_agnostic:
            raise ValueError("method.time_conditioning=true needs a DiT backbone: the LLaMA-family MDMs ignore t")
        self.time_conditioning = time_conditioning
        self.process = MaskingProcess(mask_id=self.mask_id, eps=eps)
        self.view = MaskedModel(self.net, self.data_vocab_size, self.mask_id, time_conditioning)

    def forward(self, x: Tensor, t: Tensor) -> Tensor:
        """Logits over data ids + [MASK] (B, L, V+1; a LLaMA-family head: B, L, V); t is ignored (fed as 0)
        unless time-conditioned."""
        return self.view(x, t)

    def draw(self, batch: dict, batch_idx: int, *, stage: str) -> dict:
        """Times t (B,) and the masks' uniforms u (B, L): in training a stratified t and u drawn over the global
        batch (any world size: the same draws)."""
        tokens = batch["tokens"]
        b = tokens.shape[0]
        if stage == "train":
            t = self.sample_times(b, batch_idx).to(self.device, non_blocking=True)
            return {"t": t, "u": self.global_rand(tuple(tokens.shape), batch_idx, stream=1)}
        t = self.process.sample_t(b, generator=self.fixed_generator(batch_idx), device=self.device)
        return self.draws_at(batch, t, self.fixed_generator(batch_idx, self.device))

    def sample_times(self, local_batch: int, batch_idx: int) -> Tensor:
        """This micro-batch's slice of one stratified draw of t over the global batch (all ranks, accumulation)."""
        n_global, offset = self.global_batch_slice(local_batch, batch_idx)
        gen = self.step_generator(0, batch_idx, shared=True)
        return self.process.sample_t(n_global, offset=offset, count=local_batch, generator=gen)

    def draws_at(self, batch: dict, t: Tensor, generator: torch.Generator | None) -> dict:
        """The draws at given times t (B,), the masks' uniforms from ``generator``."""
        tokens = batch["tokens"]
        return {"t": t, "u": torch.rand(tokens.shape, generator=generator, device=tokens.device)}

    def loss(self, batch: dict, draws: dict, *, parts: bool = False) -> LossOutput:
        """The ELBO at times t, x_t masked where u < 1 − α_t off the prompt."""
        tokens, prompt_mask = batch["tokens"], self.pin_unpredicted(batch["prompt_mask"])
        t = draws["t"]
        noised = self.process.noise(tokens, t, prompt_mask, draws=draws["u"])
        weight = self.process.schedule.loss_weight(t)  # −α'_t/(1−α_t) = 1/t
        loss_mask = self.scored(batch)
        logits = self.view.data_logits(self(noised.state, t))
        return mdm_elbo_loss(logits, tokens, noised.noised & loss_mask, weight, loss_mask, None)

    def scored(self, batch: dict) -> Tensor:
        """The positions the ELBO averages over: off the prompt (text data may leave PAD out: ``loss_mask``)."""
        return batch.get("loss_mask", ~self.pin_unpredicted(batch["prompt_mask"]))

    def loss_count(self, batch: dict, draws: dict) -> Tensor:
        """The scored positions, masked or not (the ELBO's denominator)."""
        return self.scored(batch).sum()
