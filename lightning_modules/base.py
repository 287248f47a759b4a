"""Shared LightningModule machinery: optimiser + LR schedule, per-step seeded RNG, checkpoint metadata."""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from flowlm.backbones.dit import RELEASED_OPTIONS, DiT, build_dit
from lightning_modules.sharding import compile_blocks, shard
from runners.paths import git_commit

# The commit of the code this process runs, read once (two git calls) and recorded in every checkpoint it writes.
code_commit = functools.cache(git_commit)

# Parameter names that never get weight decay (besides every vector: biases, norm gains).
NO_DECAY_KEYS = ("norm", "adaLN", "emb_s.", "emb_t.", "time_embed.", "block_mods.", "final_mod.")


def plain(obj: Any) -> Any:
    """DictConfig/ListConfig → plain containers, so hyper-parameters pickle without OmegaConf."""
    if isinstance(obj, DictConfig) or OmegaConf.is_list(obj):
        return OmegaConf.to_container(obj, resolve=True)
    return obj


class FlowLMModule(L.LightningModule):
    """Base of every method's module: it owns the backbone and the optimiser; subclasses own the math.

    ``family`` names the kind of model ("mdm", ...): samplers and checkpoint loaders check it before compute.
    """

    family: ClassVar[str] = ""

    def __init__(
        self,
        *,
        data_vocab_size: int,
        seq_len: int,
        backbone: dict,
        optim: dict,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.data_vocab_size = data_vocab_size
        self.seq_len = seq_len
        self.backbone_cfg = plain(backbone)
        self.optim_cfg = {"lr": 3e-4, "betas": (0.9, 0.999), "weight_decay": 0.0, "warmup_steps": 2500}
        self.optim_cfg.update(plain(optim))
        self.seed = seed

    def validate_inputs(self) -> None:
        """Check external inputs (teacher / init checkpoints) before any compute; nothing to check by default."""

    def build_backbone(self, vocab_size: int, **extra: Any) -> DiT:
        """The shared DiT with this run's size/overrides and a method-specific vocabulary."""
        return build_dit(vocab_size=vocab_size, **{**self.backbone_cfg, **extra})

    def optimizer_groups(self) -> list[dict]:
        """Trainable parameters in two AdamW groups: weight decay on matrices only, none on biases, norms, time
        embeddings and adaLN modulations (frozen parameters, e.g. an adapted MDM's, are left out)."""
        decay, no_decay = [], []
        for name, param in self.named_parameters():
            if not param.requires_grad:
                continue
            exempt = param.ndim < 2 or any(key in name for key in NO_DECAY_KEYS)
            (no_decay if exempt else decay).append(param)
        return [
            {"params": decay, "weight_decay": self.optim_cfg["weight_decay"]},
            {"params": no_decay, "weight_decay": 0.0},
        ]

    def configure_optimizers(self) -> dict:
        """AdamW, linear warm-up then constant LR (the released recipes); clipping is the trainer's."""
        cfg = self.optim_cfg
        opt = torch.optim.AdamW(self.optimizer_groups(), lr=cfg["lr"], betas=tuple(cfg["betas"]))
        warmup = max(int(cfg["warmup_steps"]), 1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # Randomness: generators seeded from (seed, step, micro-batch, rank, stream) make a training step's draws a
    # pure function of where it is in the run, identical after a resume and independent across ranks.
    def step_generator(self, stream: int, batch_idx: int, *, shared: bool, device: torch.device | None = None):
        """A generator for this step. ``shared`` ones depend on the optimizer step only, so every rank and every
        micro-batch of an accumulation group draws the same numbers (for draws over the global batch)."""
        key = (
            (self.seed, self.global_step, stream)
            if shared
            else (self.seed, self.global_step, batch_idx, self.global_rank, stream)
        )
        gen = torch.Generator(device=device or "cpu")
        gen.manual_seed(hash(key) & 0x7FFF_FFFF_FFFF_FFFF)
        return gen

    def global_batch_slice(self, local_batch: int, batch_idx: int) -> tuple[int, int]:
        """(global batch size, offset of this micro-batch in it) across ranks and gradient accumulation."""
        if self._trainer is None:
            return local_batch, 0
        world = self.trainer.world_size
        accum = self.trainer.accumulate_grad_batches
        micro = batch_idx % accum
        return local_batch * world * accum, (self.global_rank * accum + micro) * local_batch

    def global_rand(self, shape: tuple[int, ...], batch_idx: int, stream: int) -> torch.Tensor:
        """Uniforms of shape (local batch, ...) for this micro-batch: its rows of one draw over the global batch.

        Every rank draws the whole global batch with a shared generator and keeps its slice, so the numbers each
        example gets do not depend on the world size or accumulation (1 process ≡ N processes, tested). The draw
        costs world × accumulation times a local one: use it for (B, L)-sized draws, not (B, L, V) ones.
        """
        n_global, offset = self.global_batch_slice(shape[0], batch_idx)
        gen = self.step_generator(stream, batch_idx, shared=True, device=self.device)
        return torch.rand((n_global, *shape[1:]), generator=gen, device=self.device)[offset : offset + shape[0]]

    def logs_this_step(self) -> bool:
        """Whether Lightning sends this training step's logged values to the loggers: extra metrics that need a
        host read are computed only then (Lightning reads the logged values back at that step anyway)."""
        connector = getattr(self._trainer, "_logger_connector", None)
        return connector is None or bool(connector.should_update_logs)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Seed the global RNG (dropout) from the step too, so a resumed run repeats the interrupted one exactly."""
        torch.manual_seed(hash((self.seed, self.global_step, batch_idx, self.global_rank, -1)) & 0x7FFF_FFFF_FFFF_FFFF)

    def configure_model(self) -> None:
        """Shard and/or compile the DiT blocks, once the strategy has set up the processes (Lightning calls this
        before building the optimiser, at every fit/validate: it is idempotent).

        Under ``ModelParallelStrategy`` (trainer=fsdp2, ``self.device_mesh`` set) each DiT block and then the DiT
        (or adapter) get FSDP2's ``fully_shard``, in bf16 when the trainer runs bf16-mixed (lightning_modules/
        sharding.py). With ``compile: true`` at the top of the run config each block is compiled in place, after
        sharding; a run config without the key, or a checkpoint loaded for evaluation, runs eagerly."""
        if self.device_mesh is not None:
            shard(self, self.device_mesh, precision=self._trainer.precision if self._trainer else None)
        if (getattr(self, "run_config", None) or {}).get("compile", False):
            compile_blocks(self)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Record what this checkpoint is, so loaders can refuse the wrong kind before any compute; the backbone
        config is saved with every DiT option it was built with, so a later change of a default cannot change it."""
        hparams = checkpoint.get("hyper_parameters")
        if isinstance(hparams, dict) and "backbone" in hparams:
            hparams["backbone"] = {**RELEASED_OPTIONS, **plain(hparams["backbone"])}
        checkpoint.setdefault("flowlm", {}).update(
            {
                "family": self.family,
                "class_path": f"{type(self).__module__}.{type(self).__qualname__}",
                "data_vocab_size": self.data_vocab_size,
                "seq_len": self.seq_len,
                "config": getattr(self, "run_config", None),
                "git_commit": code_commit(),  # the code that wrote it (flowlm-export's model card)
            }
        )
