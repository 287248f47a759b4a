"""Shared LightningModule machinery: optimiser + LR schedule, per-step seeded RNG, checkpoint metadata."""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import lightning as L
import torch
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.utilities import rank_zero_info
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn

from flowlm.backbones.dit import RELEASED_OPTIONS, build_dit
from flowlm.backbones.llama import BidirectionalLM, LlamaFlowNet
from flowlm.objectives.base import LossOutput
from flowlm.project import git_commit
from lightning_modules.checkpoints import copy_backbone
from lightning_modules.sharding import checkpoint_activations, compile_blocks, shard

# The commit of the code this process runs, read once (two git calls) and recorded in every checkpoint it writes.
code_commit = functools.cache(git_commit)

# Parameter names that never get weight decay (besides every vector: biases, norm gains).
NO_DECAY_KEYS = ("norm", "adaLN", "emb_s.", "emb_t.", "time_embed.", "block_mods.", "final_mod.", "layer_mods.")


def check_choice(name: str, value: Any, choices: tuple) -> Any:
    """``value`` if it is one of ``choices``, else a ValueError naming the option."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def plain(obj: Any) -> Any:
    """DictConfig/ListConfig → plain containers, so hyper-parameters pickle without OmegaConf."""
    if isinstance(obj, DictConfig) or OmegaConf.is_list(obj):
        return OmegaConf.to_container(obj, resolve=True)
    return obj


def rows_of(values: dict, part: slice, rows: int) -> dict:
    """``values`` (a batch or its draws) with every tensor cut to the rows ``part`` of a ``rows``-row batch; other
    values (a process, a name) as they are. A tensor that is not one row per sequence cannot be cut: ValueError."""
    out = {}
    for key, value in values.items():
        if isinstance(value, Tensor):
            if value.ndim == 0 or value.shape[0] != rows:
                raise ValueError(f"{key!r} of shape {tuple(value.shape)} is not one row per sequence of the {rows}")
            value = value[part]
        out[key] = value
    return out


# ---------------------------------------------------------------------------------------------------- backbones
class BackboneKind(ABC):
    """One family of backbone configs: how it becomes a network, where [MASK] is, what a checkpoint records."""

    time_agnostic: ClassVar[bool] = False  # the network ignores its times (a time-conditioned MDM is refused)

    @staticmethod
    @abstractmethod
    def matches(cfg: dict) -> bool:
        """Whether ``cfg`` is a config of this family."""

    @abstractmethod
    def build(self, cfg: dict, *, data_vocab_size: int, vocab_size: int, **extra: Any) -> nn.Module:
        """The network over ``vocab_size`` input rows for ``data_vocab_size`` data tokens, with a method's
        ``extra`` options (``two_times``, ``causal``); a backbone that cannot serve them: ValueError."""

    @abstractmethod
    def mask_id(self, net: nn.Module, data_vocab_size: int) -> int:
        """The [MASK] input id of ``net``."""

    @abstractmethod
    def record(self, cfg: dict, net: nn.Module) -> dict:
        """The backbone config a checkpoint saves: rebuilding from it gives a network of the same function."""

    def unpredicted_prefix(self, net: nn.Module) -> int:
        """How many leading positions ``net`` predicts nothing at (0; Dream's shifted logits: 1, position 0 has no
        preceding output): the losses keep them clean and unscored, as the prompt."""
        return 0

    def check_same_family(self, source: dict, path: str) -> None:
        """Refuse an ``init_from`` whose backbone config ``source`` is of another family than this one (a DiT MDM
        into a LLaMA-family FMLM+, or the reverse) before any compute: their tensors share no names."""
        if type(backbone_kind(source)) is not type(self):
            there = source.get("_target_", "the suite's DiT")
            raise ValueError(
                f"init_from {path} was trained on another backbone family ({there}) than this run's backbone: "
                "initialise from an MDM of the same backbone (backbone=<its config>)"
            )

    def copy_into(self, net: nn.Module, state: dict[str, Tensor]) -> dict[str, list[str]]:
        """Copy a source checkpoint's backbone (``state``: ``net.*`` tensors of an MDM or a flow model) into ``net``
        built by ``build``, by name and shape; what was copied, sliced ([MASK] rows dropped) and left fresh
        (``copy_backbone``: another backbone size is a ValueError)."""
        return copy_backbone(net, state)


class DiTKind(BackboneKind):
    """The suite's DiT (a config without ``_target_``: size + options); [MASK] = the extra last row, id |V|."""

    @staticmethod
    def matches(cfg: dict) -> bool:  # noqa: D102
        return "_target_" not in cfg

    def build(self, cfg: dict, *, data_vocab_size: int, vocab_size: int, **extra: Any) -> nn.Module:  # noqa: D102
        if extra.pop("adapter", None):
            raise ValueError(
                "method.adapter configures FMLM+'s adaLN on a LLaMA-family backbone; the DiT conditions its own blocks "
                "(backbone.cond_dim): leave method.adapter null"
            )
        return build_dit(vocab_size=vocab_size, **{**cfg, **extra})

    def mask_id(self, net: nn.Module, data_vocab_size: int) -> int:  # noqa: D102
        return data_vocab_size

    def record(self, cfg: dict, net: nn.Module) -> dict:  # noqa: D102
        # every DiT option it was built with, so a later change of a default cannot change it
        return {**RELEASED_OPTIONS, **cfg}


class TargetKind(BackboneKind):
    """A ``_target_`` config (conf/backbone/llama/): a ``BidirectionalLM`` built or loaded from a pretrained source
    (``load_smdm``/``load_llada``/``load_dream`` with ``source: <path or hub name>``). The backbone fixes the
    vocabulary: its head predicts the data tokens (SMDM: [MASK] = the extra embedding row; LLaDA/Dream: [MASK]
    inside the vocabulary, never predicted). With ``two_times`` (FMLM+) the MDM is wrapped in ``LlamaFlowNet``
    (zero-initialised per-token (s, t) adaLN, ``adapter`` options): building it from a pretrained source is the MDM
    initialisation."""

    time_agnostic = True

    def unpredicted_prefix(self, net: nn.Module) -> int:  # noqa: D102
        return 1 if net.shift_logits else 0

    @staticmethod
    def matches(cfg: dict) -> bool:  # noqa: D102
        return "_target_" in cfg

    def build(self, cfg: dict, *, data_vocab_size: int, vocab_size: int, **extra: Any) -> nn.Module:  # noqa: D102
        from hydra.utils import instantiate

        two_times, adapter = bool(extra.pop("two_times", False)), extra.pop("adapter", None)
        # input rows: an MDM reads ids with [MASK] (|V| + 1 rows), the flow network vectors over the data vocabulary
        rows = data_vocab_size if two_times else data_vocab_size + 1
        if vocab_size != rows or any(extra.values()) or (adapter and not two_times):
            raise ValueError(
                f"backbone {cfg['_target_']} is a bidirectional, time-agnostic MDM: it serves MDM, MLFM and FMLM+ "
                f"(two_times, over the data vocabulary), not a network with {extra} over {vocab_size} rows (a causal "
                "network, AR, needs a DiT backbone)"
            )
        net = instantiate(cfg)
        if not isinstance(net, BidirectionalLM):
            raise ValueError(f"backbone {cfg['_target_']} built a {type(net).__name__}, not a BidirectionalLM")
        net.train()  # a loader returns its model for inference (eval mode); here it is a module's network
        if not net.covers_data(data_vocab_size):
            raise ValueError(
                f"the data have a vocabulary of {data_vocab_size} tokens but backbone {cfg['_target_']} predicts "
                f"{net.head_rows} (head rows; [MASK] = id {net.mask_id}): use the backbone's tokenizer, or for a "
                f"random backbone set backbone.head_rows={data_vocab_size} (and embed_rows, mask_id to match)"
            )
        return LlamaFlowNet(net, data_vocab_size=data_vocab_size, **(adapter or {})) if two_times else net

    def mask_id(self, net: nn.Module, data_vocab_size: int) -> int:  # noqa: D102
        return net.mask_id

    def copy_into(self, net: nn.Module, state: dict[str, Tensor]) -> dict[str, list[str]]:
        """``copy_backbone`` into the FMLM+ network (``LlamaFlowNet``): an MDM checkpoint's ``net.<name>`` tensors go
        to ``base.<name>`` (``.base_layer`` inside a LoRA-wrapped Linear), a flow checkpoint of the same network's
        keep their names; the time embeddings and the adaLN stay fresh (zero adaLN: the network is the MDM). An MDM
        head padded beyond the data (LLaDA, Dream; the flow's was cut by ``build``) gives its first rows (reported
        as sliced). An MDM with tensors this base has no counterpart for, or without some it has (another depth or
        width), is refused."""
        sliced = []
        if not any(key.startswith("net.base.") for key in state):  # an MDM's BidirectionalLM: its own names
            own = {plain: name for name, plain in net.base_state_names().items()}
            state = {f"net.base.{own.get(k[4:], k[4:])}" if k.startswith("net.") else k: v for k, v in state.items()}
            head, rows = state.get("net.base.lm_head.weight"), net.base.head_rows
            if head is not None and head.shape[0] > rows > net.base.mask_id:
                state["net.base.lm_head.weight"] = head[:rows]
                sliced.append("base.lm_head.weight")
        report = copy_backbone(net, state, partial_modules=bool(net.lora_names))
        report["sliced"] += sliced
        missing = [name for name in report["fresh"] if name.startswith("base.") and ".lora_" not in name]
        if missing:  # with LoRA, copy_backbone leaves these to the caller
            raise ValueError(f"the source checkpoint has another backbone size: it lacks {missing[:3]}")
        return report

    def record(self, cfg: dict, net: nn.Module) -> dict:  # noqa: D102
        # the built network's own spec, on the meta device: a checkpoint reloads without its pretrained source and
        # without a random initialisation (FlowLMModule.load_state_dict assigns the saved tensors)
        target = f"{BidirectionalLM.__module__}.{BidirectionalLM.__qualname__}"
        return {"_target_": target, **net.spec, "device": "meta"}


BACKBONE_KINDS: tuple[BackboneKind, ...] = (TargetKind(), DiTKind())


def backbone_kind(cfg: dict) -> BackboneKind:
    """The family of a backbone config (first match in ``BACKBONE_KINDS``)."""
    return next(kind for kind in BACKBONE_KINDS if kind.matches(cfg))


# ------------------------------------------------------------------------------------------------------ module
class FlowLMModule(L.LightningModule, ABC):
    """Base of every method's module: it owns the backbone, the optimiser and the training loop; a method gives two
    hooks, ``draw`` (this step's random inputs) and ``loss`` (the objective on them → ``LossOutput``), with
    ``loss_count`` (the tokens or sequences the loss averages over: validation in micro batches), and a model view
    (flowlm/models/) that samplers read through ``denoiser``.

    ``family`` names the kind of model ("mdm", ...): samplers and checkpoint loaders check it before compute;
    ``label`` is the method's name in result tables.
    """

    family: ClassVar[str] = ""
    label: ClassVar[str] = ""

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
        if isinstance(backbone, nn.Module):  # Hydra built the `_target_` backbone node itself
            raise ValueError(
                f"{type(self).__name__} got a built {type(backbone).__name__} as its backbone: the method config "
                "needs `_recursive_: false` (conf/method/mdm.yaml) so that the module builds its backbone"
            )
        self.backbone_cfg = plain(backbone)
        self.backbone_kind = backbone_kind(self.backbone_cfg)
        self._backbone_record: dict | None = None
        self.optim_cfg = {"lr": 3e-4, "betas": (0.9, 0.999), "weight_decay": 0.0, "warmup_steps": 2500}
        self.optim_cfg.update(plain(optim))
        self.seed = seed

    # ------------------------------------------------- the hooks: draw, loss and the count the loss averages
    @abstractmethod
    def draw(self, batch: dict, batch_idx: int, *, stage: str) -> dict:
        """This step's random inputs (times, masks, noise, …) for ``loss``: at ``stage="train"`` drawn from the
        step's generators (``step_generator``, ``global_rand``: the same after a resume and for any world size), at
        ``"val"`` fixed per batch (``fixed_generator``), so validation losses are comparable across evaluations."""

    @abstractmethod
    def loss(self, batch: dict, draws: dict, *, parts: bool = False) -> LossOutput:
        """The method's objective on ``batch`` at ``draws``; with ``parts`` its named parts too (logged)."""

    @abstractmethod
    def loss_count(self, batch: dict, draws: dict) -> Tensor:
        """How many terms ``loss`` averages over on ``batch`` at ``draws`` (its scored tokens, or sequences): the
        weight of its value when a batch's loss is combined from row chunks (``validation_loss``)."""

    def denoiser(self, *args: Any, **kwargs: Any) -> Any:
        """This model as its samplers see it (the model view's ``denoiser``)."""
        return self.view.denoiser(*args, **kwargs)

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        """``loss`` at ``draw``; logged as ``train/loss`` and ``train/loss_<part>``."""
        out = self.loss(batch, self.draw(batch, batch_idx, stage="train"), parts=self.logs_this_step())
        self.log("train/loss", out.loss, prog_bar=True)
        for name, value in out.parts.items():
            self.log(f"train/loss_{name}", value)
        return out.loss

    def validation_step(self, batch: dict, batch_idx: int) -> Tensor:
        """``validation_loss`` at fixed draws; logged as ``val/loss``, averaged over ranks."""
        loss = self.validation_loss(batch, self.draw(batch, batch_idx, stage="val"))
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=batch["tokens"].shape[0])
        return loss

    def validation_loss(self, batch: dict, draws: dict) -> Tensor:
        """``loss`` on ``batch`` at ``draws``, run in chunks of at most ``micro_batch_size`` rows (the run config's
        top-level key, as training's; unset: one forward), so that a device's validation share holds the activations
        of one micro batch, not of the whole share. The draws are made once for the whole batch and cut with it, so
        every row sees the numbers it sees unchunked; the chunks' losses are averaged weighted by ``loss_count``, which
        is the whole batch's loss up to float rounding (a mean over scored tokens or sequences)."""
        rows = batch["tokens"].shape[0]
        micro = (getattr(self, "run_config", None) or {}).get("micro_batch_size")
        if not micro or micro >= rows:
            return self.loss(batch, draws).loss
        total, count = None, None
        for start in range(0, rows, micro):
            part = slice(start, start + micro)
            chunk, chunk_draws = rows_of(batch, part, rows), rows_of(draws, part, rows)
            n = self.loss_count(chunk, chunk_draws)
            weighted = self.loss(chunk, chunk_draws).loss * n  # the chunk's sum of terms
            total, count = (weighted, n) if total is None else (total + weighted, count + n)
        return total / count.clamp_min(1)  # every objective's mean: 0 when nothing is scored

    def fixed_generator(self, batch_idx: int, device: torch.device | str = "cpu") -> torch.Generator:
        """A generator seeded by (seed, validation batch): the same draws at every evaluation."""
        return torch.Generator(device=device).manual_seed(self.seed * 1_000_003 + batch_idx)

    def validate_inputs(self) -> None:
        """Check external inputs (teacher / init checkpoints) before any compute; nothing to check by default."""

    def build_backbone(self, vocab_size: int, **extra: Any) -> nn.Module:
        """This run's backbone over ``vocab_size`` input rows (a DiT with this run's size/overrides, or a LLaMA-family
        MDM built or loaded from its config); a data vocabulary the backbone does not predict is refused here."""
        net = self.backbone_kind.build(
            self.backbone_cfg, data_vocab_size=self.data_vocab_size, vocab_size=vocab_size, **extra
        )
        self._backbone_record = self.backbone_kind.record(self.backbone_cfg, net)
        self._unpredicted = self.backbone_kind.unpredicted_prefix(net)
        return net

    def pin_unpredicted(self, prompt_mask: Tensor) -> Tensor:
        """``prompt_mask`` with the positions the backbone predicts nothing at (``unpredicted_prefix``) added: a
        loss keeps them clean and never scores them (Dream: position 0, its BOS in the released training)."""
        k = getattr(self, "_unpredicted", 0)
        if k == 0:
            return prompt_mask
        return prompt_mask | (torch.arange(prompt_mask.shape[-1], device=prompt_mask.device) < k)

    def backbone_mask_id(self, net: nn.Module) -> int:
        """The [MASK] input id of a network built by ``build_backbone`` (DiT: |V|; LLaMA family: its own)."""
        return self.backbone_kind.mask_id(net, self.data_vocab_size)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """As nn.Module's; a backbone rebuilt on the meta device from a checkpoint's record (``TargetKind``) gets
        the saved tensors assigned, then its RoPE buffers (not saved) rebuilt."""
        on_meta = any(p.is_meta for p in self.parameters())
        out = super().load_state_dict(state_dict, strict=strict, assign=assign or on_meta)
        if on_meta:
            for module in self.modules():
                if isinstance(module, BidirectionalLM):
                    module.materialize_rotary(module.model.embed_tokens.weight.device)
        return out

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

    # The checkpoint this fit resumes (runners/train.py sets it before fit): strategies that restore after setup
    # (FSDP2, DeepSpeed) do not know it yet at on_fit_start, where one device and DDP already have trainer.ckpt_path.
    resuming_from: str | None = None

    def starts_fresh(self) -> bool:
        """Whether this fit starts a run rather than resuming one from its checkpoint: the moment to copy weights from
        a source (``init_from``). Not ``global_step == 0``: on one device and under DDP Lightning calls
        ``on_fit_start`` after it has loaded a resumed run's weights and before it restores the step counter, so that
        guard copied the source over the resumed weights at every relaunch."""
        if self.resuming_from is not None:
            return False
        return self._trainer is None or self.trainer.ckpt_path is None

    def log_init_report(self, message: str, report: dict) -> None:
        """Say what an initialisation from a source checkpoint copied, and log ``report`` to MLflow (init_from.json)."""
        rank_zero_info(message)
        for lg in self.loggers:
            if isinstance(lg, MLFlowLogger) and self.trainer.is_global_zero:
                lg.experiment.log_dict(lg.run_id, report, "init_from.json")

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
        sharding; a run config without the key, or a checkpoint loaded for evaluation, runs eagerly. With
        ``activation_checkpointing: true`` each block / decoder layer recomputes its activations in backward
        (applied first, before sharding)."""
        if (getattr(self, "run_config", None) or {}).get("activation_checkpointing", False):
            checkpoint_activations(self)
        if self.device_mesh is not None:
            shard(self, self.device_mesh, precision=self._trainer.precision if self._trainer else None)
        if (getattr(self, "run_config", None) or {}).get("compile", False):
            compile_blocks(self)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Record what this checkpoint is, so loaders can refuse the wrong kind before any compute; the backbone
        config is saved as its family records it (``BackboneKind.record``): a DiT with every option it was built
        with, so a later change of a default cannot change it; a LLaMA-family MDM as the built network's spec."""
        hparams = checkpoint.get("hyper_parameters")
        if isinstance(hparams, dict) and "backbone" in hparams:
            hparams["backbone"] = self._backbone_record or self.backbone_kind.record(plain(hparams["backbone"]), None)
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
