"""Masked diffusion model (MDLM-style, absorbing process, SUBS ELBO): methods.md §2."""

from __future__ import annotations

import torch
from torch import Tensor

from flowlm.objectives.base import LossOutput
from flowlm.objectives.mdm import mdm_elbo_loss
from flowlm.processes.masking import MaskingProcess, stratified_times
from flowlm.samplers.base import MaskedDenoiser
from lightning_modules.base import FlowLMModule, drop_mask_logit


class MDMModule(FlowLMModule):
    """The network sees data ids plus a [MASK] id (the last row); by default it is time-agnostic (MDLM/SMDM)."""

    family = "mdm"

    def __init__(
        self,
        *,
        data_vocab_size: int,
        seq_len: int,
        backbone: dict,
        optim: dict,
        eps: float = 1e-3,
        time_conditioning: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__(data_vocab_size=data_vocab_size, seq_len=seq_len, backbone=backbone, optim=optim, seed=seed)
        self.save_hyperparameters()
        self.net = self.build_backbone(data_vocab_size + 1, two_times=False)
        # [MASK]: the DiT's extra last row (id |V|); a LLaMA-family backbone's own (SMDM: its extra embedding row,
        # the head predicts the data tokens only; LLaDA/Dream: an id inside the vocabulary, logit −∞, §2 SUBS)
        self.mask_id = self.backbone_mask_id(self.net)
        if time_conditioning and self.backbone_kind.time_agnostic:
            raise ValueError("method.time_conditioning=true needs a DiT backbone: the LLaMA-family MDMs ignore t")
        self.time_conditioning = time_conditioning
        self.process = MaskingProcess(mask_id=self.mask_id, eps=eps)

    def forward(self, x: Tensor, t: Tensor) -> Tensor:
        """Logits over data ids + [MASK] (B, L, V+1; a LLaMA-family head: B, L, V); t is ignored (fed as 0)
        unless time-conditioned."""
        s = t if self.time_conditioning else torch.zeros_like(t)
        return self.net(x, s)

    def data_logits(self, logits: Tensor) -> Tensor:
        """Logits over the data vocabulary (B, L, V), [MASK] removed (SUBS, §2)."""
        return drop_mask_logit(logits, self.data_vocab_size, self.mask_id)

    def denoiser(self) -> MaskedDenoiser:
        """This model as MDM samplers see it: logits over the data vocabulary ([MASK] removed, SUBS)."""
        return MaskedDenoiser(
            fn=lambda x, t: self.data_logits(self(x, t)),
            mask_id=self.mask_id,
            time_conditioned=self.time_conditioning,
        )

    def mdm_loss(
        self, batch: dict, t: Tensor, generator: torch.Generator | None, *, u: Tensor | None = None
    ) -> LossOutput:
        """ELBO on one batch at times t (B,); masks from ``u`` (B, L) when given, else drawn with ``generator``."""
        tokens, prompt_mask = batch["tokens"], self.pin_unpredicted(batch["prompt_mask"])
        noised = self.process.noise(tokens, t, prompt_mask, generator=generator, draws=u)
        logits = self(noised.state, t)
        weight = self.process.schedule.loss_weight(t)  # −α'_t/(1−α_t) = 1/t
        loss_mask = batch.get("loss_mask", ~prompt_mask)  # text data may leave PAD out of the loss
        return mdm_elbo_loss(self.data_logits(logits), tokens, noised.noised & loss_mask, weight, loss_mask, None)

    def sample_times(self, local_batch: int, batch_idx: int) -> Tensor:
        """This micro-batch's slice of one stratified draw of t over the global batch (all ranks, accumulation)."""
        n_global, offset = self.global_batch_slice(local_batch, batch_idx)
        gen = self.step_generator(0, batch_idx, shared=True)
        return stratified_times(n_global, offset=offset, count=local_batch, eps=self.process.eps, generator=gen)

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        """Stratified t and the masks' uniforms drawn over the global batch (any world size: same draws), then
        the ELBO."""
        tokens = batch["tokens"]
        t = self.sample_times(tokens.shape[0], batch_idx).to(self.device, non_blocking=True)
        loss = self.mdm_loss(batch, t, None, u=self.global_rand(tuple(tokens.shape), batch_idx, stream=1)).loss
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> Tensor:
        """ELBO with a fixed stratified t grid and fixed masks, so validation losses are comparable."""
        b = batch["tokens"].shape[0]
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + batch_idx)
        t = stratified_times(b, offset=0, count=b, eps=self.process.eps, generator=gen).to(self.device)
        mask_gen = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + batch_idx)
        loss = self.mdm_loss(batch, t, mask_gen).loss
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=b)
        return loss
