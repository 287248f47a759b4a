"""FMLM+ (and FMLM, FLM): two-time flow map language models trained by progressive self-distillation (methods.md §3–4).

The recipe (pair kinds and times, context rates and set, the targets and the loss) is flowlm/objectives/fmlm_plus.py;
the network read as the flow map (log δ_{s,t}, head summaries, state space) is flowlm/models/flow_map.py. This module
draws a step's random inputs, runs the teacher passes in ``teacher_train_mode``, loads the MDM sources and logs.

One code path for every variant:
  - ``context=True`` (FMLM+): per-token times; a context set of clean tokens (rate f ~ U(0, 1)) pinned at s = t = 1;
    ``context=False`` (FMLM): one global time per sequence (only the prompt is pinned).
  - scratch: nothing else; distilled: a ``shares.distill`` share trains δ_{0,0} on a frozen MDM teacher;
    MDM-initialised: ``init_from`` copies an MDM checkpoint's backbone (by name and shape, [MASK] rows dropped);
    ``init_from`` an FLM/FMLM checkpoint continues from it (FMLM from FLM, methods.md §3).
  - FLM is the diagonal-only special case (``shares.diagonal=1``, method=flm).

The network is the backbone family's (``BackboneKind.build(two_times=True)``): the suite's DiT, or a LLaMA-family
MDM inside ``LlamaFlowNet`` whose pretrained ``source`` is then the MDM initialisation (docs/pretrained.md).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import Any

import torch
from torch import Tensor

from flowlm.models.flow_map import FUSED_LOSSES, FlowMapModel
from flowlm.objectives.base import LossOutput
from flowlm.objectives.fmlm_plus import (
    DIAGONAL,
    MDM_TEACHER_TIMES,
    batch_kinds_and_times,
    context_rates,
    context_set,
    fmlm_plus_loss,
)
from flowlm.ops.compiled import compiled_tails
from flowlm.processes.gaussian_flow import STATE_SPACES
from lightning_modules.base import FlowLMModule, check_choice
from lightning_modules.checkpoints import (
    check_backbone_options,
    check_family,
    checkpoint_backbone,
    load_teacher,
    read_checkpoint,
)
from lightning_modules.sharding import is_sharded


class FMLMPlusModule(FlowLMModule):
    """The network reads noisy one-hot vectors x ∈ R^{L×|V|} at per-token times (s, t) and outputs log δ_{s,t}(x)."""

    family = "flow"
    label = "FMLM+"

    def __init__(
        self,
        *,
        context: bool = True,
        shares: dict | None = None,
        init_from: str | None = None,
        teacher: str | None = None,
        teacher_train_mode: bool = True,
        mdm_teacher_time: str = "zero",
        zero_t_embedding: bool = False,
        antithetic: bool = True,
        state_space: str = "auto",
        compile_tails: bool = False,
        fused_loss: str | bool = "auto",
        adapter: dict | None = None,
        **common: Any,
    ) -> None:
        super().__init__(**common)  # FlowLMModule's: data_vocab_size, seq_len, backbone, optim, seed
        self.save_hyperparameters()
        self.context = context
        self.shares = {"diagonal": 0.5, "boundary": 1 / 64, "distill": 0.0, **(shares or {})}
        if self.shares["distill"] > 0 and not teacher:
            raise ValueError("shares.distill > 0 needs an MDM teacher checkpoint (method.teacher=...)")
        self.init_from = init_from
        self.teacher_path = teacher
        self.teacher_train_mode = teacher_train_mode
        self.mdm_teacher_time = check_choice("mdm_teacher_time", mdm_teacher_time, MDM_TEACHER_TIMES)
        self.zero_t_embedding = zero_t_embedding
        self.antithetic = antithetic
        self.state_space = check_choice("state_space", state_space, STATE_SPACES)
        self.compile_tails = compile_tails  # the loss's soft-capped log-softmax compiled (forward and backward)
        self.fused_loss = check_choice("fused_loss", fused_loss, FUSED_LOSSES)  # from the head's input (ops/fused_ce)
        # the DiT, or a LLaMA-family MDM in LlamaFlowNet with the ``adapter`` options (refused on a DiT)
        self.net = self.build_backbone(self.data_vocab_size, two_times=True, adapter=adapter)
        # a [MASK] inside the data vocabulary (LLaDA, Dream) is never predicted; the DiT's (id |V|) lies outside it
        self.mask_id = self.backbone_mask_id(self.net)
        self.view = FlowMapModel(
            self.net, data_vocab_size=self.data_vocab_size, mask_id=self.mask_id, state_space=state_space
        )
        self.init_report: dict[str, list[str]] | None = None
        self._teacher = None  # a frozen MDM, kept out of the state dict

    def forward(
        self, x: Tensor, s: Tensor, t: Tensor, pinned: Tensor | None = None, *, embedded: bool = False
    ) -> Tensor:
        """log δ_{s,t}(x) (B, L, |V|) at per-token times, or per-sequence times with ``pinned`` tokens at s = t = 1;
        ``embedded``: x is h = x·E (flowlm/models/flow_map.py)."""
        return self.view(x, s, t, pinned, embedded=embedded)

    # ------------------------------------------------------------------------------------------ MDM sources
    def validate_inputs(self) -> None:
        """Check the init/teacher checkpoints (family, vocabulary) before any compute."""
        for path, role in ((self.init_from, "init_from"), (self.teacher_path, "teacher")):
            if path:
                ckpt = read_checkpoint(path, data_vocab_size=self.data_vocab_size)  # a path or hub name
                families = ("mdm", "flow") if role == "init_from" else "mdm"  # init: an MDM, or an FLM/FMLM
                check_family(ckpt["flowlm"], path, family=families, data_vocab_size=self.data_vocab_size, role=role)
                if role == "init_from":  # a dry run on a copy: another backbone size fails here, not mid-fit
                    self.backbone_kind.check_same_family(checkpoint_backbone(ckpt), path)
                    timed = ckpt["flowlm"].get("family") == "flow" or ckpt["hyper_parameters"].get("time_conditioning")
                    check_backbone_options(ckpt, self.backbone_cfg, path, role=role, time_conditioned=bool(timed))
                    self.backbone_kind.copy_into(copy.deepcopy(self.net), ckpt["state_dict"])

    def on_fit_start(self) -> None:
        """Initialise from the MDM (fresh runs only) and load the frozen teacher."""
        if self.init_from and self.starts_fresh() and self.init_report is None:
            source = read_checkpoint(self.init_from, data_vocab_size=self.data_vocab_size)
            self.initialise_from(source["state_dict"])  # the source's EMA weights
            report = self.init_report
            message = f"copied {len(report['copied'])} tensors ({len(report['sliced'])} with the [MASK] row dropped)"
            self.log_init_report(f"Initialised from {self.init_from}: {message}, fresh: {report['fresh']}", report)
        if self.teacher_path and self._teacher is None:  # not a submodule: never saved, never optimised
            teacher = load_teacher(self.teacher_path, self.device, self.data_vocab_size, self.mdm_teacher_time)
            object.__setattr__(self, "_teacher", teacher)

    def initialise_from(self, state: dict[str, Tensor]) -> dict[str, list[str]]:
        """Copy an MDM's DiT ([MASK] rows dropped; the new t-embedding fresh) or an FLM/FMLM's; on the LLaMA family
        the MDM's decoder and head into the flow network's base (``TargetKind.copy_into``; adaLN and times fresh).

        The released code leaves the new emb_t at its random initialisation (``zero_t_embedding=False``, the
        default). With ``zero_t_embedding`` its last layer is zeroed: emb_t ≡ 0, the conditioning equals the MDM's,
        and with every time at 0 the initialised network computes the MDM's logits exactly, up to its input: ε·E for
        a noised token instead of the [MASK] embedding (tested).
        """
        self.init_report = self.backbone_kind.copy_into(self.net, state)
        if self.zero_t_embedding and any(name.startswith("emb_t.") for name in self.init_report["fresh"]):
            last = self.net.emb_t.mlp[-1]
            with torch.no_grad():
                last.weight.zero_()
                last.bias.zero_()
        return self.init_report

    # ---------------------------------------------------------------------------------------------- training
    def draw(self, batch: dict, batch_idx: int, *, stage: str) -> dict:
        """Training: this micro-batch's slice of one global draw of pair kinds (exact counts, on the host), times and
        context rates, then ``draws_at``. Validation: the diagonal at a fixed grid of times, fixed draws."""
        b = batch["tokens"].shape[0]
        if stage != "train":
            s = (torch.arange(b, device=self.device) + 0.5) / b
            return self.draws_at(batch, torch.full((b,), DIAGONAL), s, s, self.fixed_generator(batch_idx, self.device))
        kinds, s, t = self.sample_pairs(b, batch_idx)
        rates = self.sample_context_rates(b, batch_idx).float()
        gen = self.step_generator(1, batch_idx, shared=False, device=self.device)
        s, t, rates = (x.to(self.device, non_blocking=True) for x in (s, t, rates))  # a blocking copy would sync
        return self.draws_at(batch, kinds, s, t, gen, rates=rates)

    def draws_at(
        self, batch: dict, kinds: Tensor, s: Tensor, t: Tensor, gen: torch.Generator | None, *,
        rates: Tensor | None = None,
    ) -> dict:  # fmt: skip
        """The draws for given pair kinds (on the host: they pick the rows of the teacher passes without a device
        read) and per-sequence times (B,): the context set at rates f (drawn from ``gen`` when not given), the
        states' process of this step and its standard normal noise, from ``gen``."""
        tokens, prompt = batch["tokens"], self.pin_unpredicted(batch["prompt_mask"])  # Dream: position 0 pinned
        b, length = tokens.shape
        if self.context:  # context set: each non-prompt token is clean with probability f ~ U(0, 1)
            f = torch.rand(b, generator=gen, device=tokens.device) if rates is None else rates.to(tokens.device)
            ctx = context_set(f, torch.rand(b, length, generator=gen, device=tokens.device), prompt)
        else:
            ctx = torch.zeros_like(prompt)
        process = self.view.training_process()
        noise = torch.randn(process.draw_shape(tokens), generator=gen, device=tokens.device)
        return {"kinds": kinds, "s": s, "t": t, "context": ctx, "noise": noise, "process": process}

    def loss(self, batch: dict, draws: dict, *, parts: bool = False) -> LossOutput:
        """The FMLM+ loss (flowlm/objectives/fmlm_plus.py); with ``parts`` each kind's mean per-token loss. With a
        ``fused_head`` the student pass stops at the head's input and the loss runs the head in blocks of rows."""
        process = draws["process"]
        student = functools.partial(self, embedded=True) if process.embedded else self
        head = self.fused_head()
        if head is not None:
            student = functools.partial(self.view.head_input, embedded=process.embedded)
        teachers = self.teachers(embedded=process.embedded)
        prompt = self.pin_unpredicted(batch["prompt_mask"])
        with compiled_tails() if self.compile_tails else contextlib.nullcontext():  # flowlm/ops/compiled.py
            return fmlm_plus_loss(
                student, batch["tokens"], prompt, **draws, **teachers, loss_mask=batch.get("loss_mask"), parts=parts,
                head=head, every_pass=is_sharded(self),  # FSDP: every rank runs the teacher passes
            )  # fmt: skip

    def loss_count(self, batch: dict, draws: dict) -> Tensor:
        """|A ∩ scored|, the tokens the loss averages over: off the prompt and the context set (and text PAD)."""
        active = ~self.pin_unpredicted(batch["prompt_mask"]) & ~draws["context"]
        return (active & batch.get("loss_mask", active)).sum()

    def fused_head(self) -> tuple[Tensor, Tensor | None] | None:
        """(W, b) of the output head when this step's student loss runs fused from the head's input, else None: the
        one place it is chosen (``FlowMapModel.fused_head`` by ``fused_loss`` and ``compile_tails``)."""
        return self.view.fused_head(self.fused_loss, compiled=self.compile_tails)

    def teachers(self, *, embedded: bool = False) -> dict:
        """The objective's teachers: this model for the semigroup passes (``teacher_pass``, reading states h = x·E
        when ``embedded``), the frozen MDM (when loaded) for the distill rows."""
        mdm = self._teacher
        return {
            "teacher": functools.partial(self.teacher_pass, embedded=True) if embedded else self.teacher_pass,
            "mdm_teacher": None if mdm is None else mdm.denoiser().fn,  # logits over the data vocabulary
            "mask_id": None if mdm is None else mdm.mask_id,
            "mdm_teacher_time": self.mdm_teacher_time,
        }

    def teacher_pass(self, x: Tensor, s: Tensor, t: Tensor, pinned: Tensor, *, embedded: bool = False) -> Tensor:
        """log δ_{s,t}(x) as the semigroup target's teacher: this model in ``teacher_train_mode`` (the released code
        runs these passes in train mode, dropout on), its own mode restored after."""
        was_training = self.training
        self.train(self.teacher_train_mode)
        try:
            return self(x, s, t, pinned, embedded=True) if embedded else self(x, s, t, pinned)
        finally:
            self.train(was_training)

    def sample_pairs(self, local_batch: int, batch_idx: int) -> tuple[Tensor, Tensor, Tensor]:
        """This micro-batch's slice of one global draw of pair kinds (exact counts) and times."""
        n_global, offset = self.global_batch_slice(local_batch, batch_idx)
        return batch_kinds_and_times(
            n_global,
            offset=offset,
            count=local_batch,
            generator=self.step_generator(0, batch_idx, shared=True),
            antithetic=self.antithetic,
            **self.shares,
        )

    def sample_context_rates(self, local_batch: int, batch_idx: int) -> Tensor:
        """This micro-batch's slice of one global draw of context rates f ~ U(0, 1) (stratified with
        ``antithetic``, as the released code draws them), on the host."""
        n_global, offset = self.global_batch_slice(local_batch, batch_idx)
        gen = self.step_generator(2, batch_idx, shared=True)
        return context_rates(n_global, offset=offset, count=local_batch, generator=gen, antithetic=self.antithetic)
