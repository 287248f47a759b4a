"""MLFM: a masked language flow model adapted from a pretrained MDM (methods.md §6).

The MDM's DiT is frozen and read on continuous embeddings: masked positions hold a Brownian-bridge state between
the [MASK] embedding (t = 0) and the clean token's (t = 1), one t per sequence; the adapter (time adaLN + LoRA,
flowlm/backbones/adapters.py) learns the t dependence. Loss: CE on the clean token at masked positions.

The MDM comes from ``init_from`` (an MDM checkpoint of this suite), or, on the LLaMA family, from the backbone
config itself: ``backbone=llama/smdm_1028m`` with ``init_from: null`` adapts the pretrained SMDM as loaded (the
MLFM paper's setup; docs/pretrained.md).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from torch import Tensor, nn

from flowlm.backbones.adapters import MLFMAdapter
from flowlm.backbones.llama import BidirectionalLM, LlamaMLFMAdapter
from flowlm.models.bridge import BridgeModel
from flowlm.objectives.base import LossOutput
from flowlm.objectives.mlfm import mlfm_inputs, mlfm_loss
from flowlm.processes.bridge import BridgeProcess
from lightning_modules.base import FlowLMModule
from lightning_modules.checkpoints import check_backbone_options, check_family, copy_backbone, read_checkpoint


class MLFMModule(FlowLMModule):
    """Frozen MDM + adapter; the MDM is ``init_from`` (an MDM checkpoint of the same backbone), or a LLaMA-family
    backbone config's own weights (a pretrained ``source``) when ``init_from`` is null."""

    family = "mlfm"
    label = "MLFM"

    def __init__(
        self,
        *,
        init_from: str | None = None,
        adapter: dict | None = None,
        bridge: dict | None = None,
        aux_mse_weight: float = 0.0,
        full_response_mask_prob: float = 0.0,
        **common: Any,
    ) -> None:
        super().__init__(**common)  # FlowLMModule's: data_vocab_size, seq_len, backbone, optim, seed
        self.save_hyperparameters()
        pretrained = "_target_" in self.backbone_cfg  # a LLaMA-family MDM, built or loaded by its config
        if not init_from and not pretrained:
            raise ValueError(
                "MLFM adapts a pretrained MDM: set method.init_from to an MDM checkpoint (or use a pretrained "
                "LLaMA-family backbone, e.g. backbone=llama/smdm_1028m, with method.init_from=null)"
            )
        if not init_from and "source" not in self.backbone_cfg and self.backbone_cfg.get("device") != "meta":
            warnings.warn(
                f"MLFM with init_from=null adapts backbone {self.backbone_cfg['_target_']} as built: a random MDM "
                "(no pretrained source); only smoke runs (scale=cpu) mean this",
                stacklevel=2,
            )
        if aux_mse_weight < 0 or not 0 <= full_response_mask_prob <= 1:
            raise ValueError("aux_mse_weight must be ≥ 0 and full_response_mask_prob in [0, 1]")
        self.init_from = init_from
        self.aux_mse_weight = aux_mse_weight
        self.full_response_mask_prob = full_response_mask_prob
        self.process = BridgeProcess(**(bridge or {}))
        base = self.build_backbone(self.data_vocab_size + 1, two_times=False)
        self.mask_id = self.backbone_mask_id(base)  # DiT: |V|; LLaMA family: the backbone's own (base.py)
        # the family's adapter (time adaLN + LoRA, §6): LlamaMLFMAdapter on the LLaMA family, MLFMAdapter on a DiT
        adapter_cls = LlamaMLFMAdapter if isinstance(base, BidirectionalLM) else MLFMAdapter
        self.net = adapter_cls(base, **(adapter or {}))
        self.view = BridgeModel(self.net, self.process, self.data_vocab_size, self.mask_id)
        self.init_report: dict[str, list[str]] | None = None

    def forward(self, z: Tensor, t: Tensor) -> Tensor:
        """Logits over data ids + [MASK] for embeddings z (B, L, d) at bridge times t (B,) (flowlm/models/bridge.py;
        validate_inputs refuses a time-conditioned MDM)."""
        return self.view(z, t)

    # --------------------------------------------------------------------------------------------- MDM source
    def validate_inputs(self) -> None:
        """The source must be a time-agnostic MDM of this vocabulary and backbone size (checked before compute);
        with ``init_from`` null the backbone config's own MDM is adapted (its loader checked it when building)."""
        if not self.init_from:
            return
        ckpt = read_checkpoint(self.init_from, data_vocab_size=self.data_vocab_size)  # a path or hub name
        check_family(
            ckpt["flowlm"], self.init_from, family="mdm", data_vocab_size=self.data_vocab_size, role="init_from"
        )
        if ckpt.get("hyper_parameters", {}).get("time_conditioning", False):
            raise ValueError(
                f"init_from {self.init_from} is a time-conditioned MDM; MLFM feeds the MDM's conditioning a constant "
                "and needs a time-agnostic one (method.time_conditioning=false, the default)"
            )
        check_backbone_options(ckpt, self.backbone_cfg, self.init_from, role="init_from", time_conditioned=False)
        self._copy_mdm(copy.deepcopy(self.net), ckpt["state_dict"])  # a dry run: another size fails here

    def on_fit_start(self) -> None:
        """Copy the MDM's weights into the frozen base (fresh runs only; a resumed run has them already)."""
        if self.init_from and self.starts_fresh() and self.init_report is None:
            source = read_checkpoint(self.init_from, data_vocab_size=self.data_vocab_size)
            self.init_report = self._copy_mdm(self.net, source["state_dict"])
            trainable = sum(p.numel() for p in self.parameters() if p.requires_grad)
            total = sum(p.numel() for p in self.parameters())
            message = f"copied {len(self.init_report['copied'])} MDM tensors; trainable {trainable:,} of {total:,}"
            self.log_init_report(
                f"MLFM adapted from {self.init_from}: {message} parameters",
                {**self.init_report, "trainable": trainable},
            )

    @staticmethod
    def _copy_mdm(adapter: nn.Module, state: dict[str, Tensor]) -> dict[str, list[str]]:
        """MDM tensors (``net.<name>``) → the adapter's base (PEFT renames wrapped Linears ``<name>.base_layer``)."""
        names = adapter.base_state_names()
        renamed = {"net." + own: state[f"net.{src}"] for own, src in names.items() if f"net.{src}" in state}
        unused = sorted({key for key in state if key.startswith("net.")} - {f"net.{src}" for src in names.values()})
        if unused:  # a deeper (or other) MDM: its extra tensors would be silently dropped
            raise ValueError(
                f"the source checkpoint has another backbone size: {len(unused)} MDM tensor(s) with no counterpart "
                f"here ({', '.join(unused[:3])}, ...)"
            )
        report = copy_backbone(adapter.base, renamed, partial_modules=True)  # LoRA tensors: checked below
        if report["sliced"] or any(".lora_" not in name for name in report["fresh"]):
            raise ValueError(f"the MDM checkpoint does not cover the adapted backbone: missing {report['fresh'][:4]}")
        return report

    # ---------------------------------------------------------------------------------------------- training
    def draw(self, batch: dict, batch_idx: int, *, stage: str) -> dict:
        """The bridge inputs (``draws_at``) from this step's generators, or fixed ones at validation."""
        if stage == "train":
            gens = (
                self.step_generator(0, batch_idx, shared=False),
                self.step_generator(1, batch_idx, shared=False, device=self.device),
            )
        else:
            gens = self.fixed_generator(batch_idx), self.fixed_generator(batch_idx, self.device)
        return self.draws_at(batch, *gens)

    def draws_at(self, batch: dict, gen_cpu: torch.Generator, gen: torch.Generator | None) -> dict:
        """The recipe's inputs (``mlfm_inputs``: masks from the cosine schedule, the whole response with probability
        ``full_response_mask_prob``, the bridge state z at t) from the two generators."""
        z, t, masked = mlfm_inputs(
            batch["tokens"],
            self.pin_unpredicted(batch["prompt_mask"]),
            self.process,
            self.net.embeddings,  # m = E[mask_id]: the last row (DiT, SMDM) or one inside (LLaDA, Dream)
            self.mask_id,
            full_response_mask_prob=self.full_response_mask_prob,
            gen_cpu=gen_cpu,
            gen=gen,
        )
        return {"z": z, "t": t, "masked": masked}

    def loss(self, batch: dict, draws: dict, *, parts: bool = False) -> LossOutput:
        """CE on the clean token at the masked positions (+ ``aux_mse_weight`` · MSE of x̂₁)."""
        logits = self.view.data_logits(draws["z"], draws["t"])
        return mlfm_loss(
            logits, batch["tokens"], self.scored(batch, draws), None, embeddings=self.net.embeddings,
            aux_weight=self.aux_mse_weight,
        )  # fmt: skip

    @staticmethod
    def scored(batch: dict, draws: dict) -> Tensor:
        """The masked positions the loss scores (text data may leave PAD out: ``loss_mask``)."""
        return draws["masked"] & batch.get("loss_mask", draws["masked"])

    def loss_count(self, batch: dict, draws: dict) -> Tensor:
        """The sequences with a scored position (the per-sequence mean is averaged over them)."""
        return self.scored(batch, draws).any(-1).sum()
