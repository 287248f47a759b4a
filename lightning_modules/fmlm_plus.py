"""FMLM+ (and FMLM): two-time flow map language models trained by progressive self-distillation (methods.md §3–4).

The loss is flowlm/objectives/fmlm_plus.py; this module draws its random inputs (pair kinds and times, context rates
and set, noise), runs the teacher passes in ``teacher_train_mode``, loads the MDM teacher and logs.

One code path for every variant:
  - ``context=True`` (FMLM+): per-token times; a context set of clean tokens (rate f ~ U(0, 1)) pinned at s = t = 1;
    ``context=False`` (FMLM): one global time per sequence (only the prompt is pinned).
  - scratch: nothing else; distilled: a ``shares.distill`` share trains δ_{0,0} on a frozen MDM teacher;
    MDM-initialised: ``init_from`` copies an MDM checkpoint's DiT (by name and shape, [MASK] rows dropped);
    ``init_from`` an FLM/FMLM checkpoint continues from it (FMLM from FLM, methods.md §3).
  - FLM is the diagonal-only special case (``shares.diagonal=1``, method=flm).

The network is the backbone family's (``BackboneKind.build(two_times=True)``): the suite's DiT, or a LLaMA-family
MDM inside ``LlamaFlowNet`` (flowlm/backbones/llama.py; ``adapter`` sets its adaLN width, what trains and LoRA), whose
pretrained ``source`` is then the MDM initialisation (docs/pretrained.md "FMLM+ on the LLaMA family"). A [MASK] inside
the data vocabulary (LLaDA, Dream) gets logit −∞ before the soft cap, on every path (dense, chunked, fused).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings

import torch
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from flowlm.objectives.base import LossOutput
from flowlm.objectives.flow import SOFT_CAP, log_delta, log_delta_
from flowlm.objectives.fmlm_plus import (
    DIAGONAL,
    KIND_NAMES,
    MDM_TEACHER_TIMES,
    batch_kinds_and_times,
    context_rates,
    context_set,
    fmlm_plus_loss,
)
from flowlm.ops.compiled import compiled_tails, tails_enabled
from flowlm.ops.summary import head_expectation
from flowlm.processes.gaussian_flow import (
    STATE_SPACES,
    EmbeddingSpace,
    GaussianFlowProcess,
    OneHotSpace,
    choose_space,
)
from flowlm.samplers.base import FlowDenoiser
from lightning_modules.base import BackboneKind, FlowLMModule, backbone_kind
from lightning_modules.checkpoints import (
    check_backbone_options,
    check_family,
    checkpoint_backbone,
    load_module,
    read_checkpoint,
)
from lightning_modules.sharding import is_sharded

SUMMARIES = ("chunked", "dense")  # how greedy drafts read the model: FMLMPlusModule.denoiser
FUSED_LOSSES = ("auto", True, False)  # FMLMPlusModule.fused_head: auto = by shape, where the head allows it


class FMLMPlusModule(FlowLMModule):
    """The DiT reads noisy one-hot vectors x ∈ R^{L×|V|} at per-token times (s, t) and outputs log δ_{s,t}(x)."""

    family = "flow"

    def __init__(
        self,
        *,
        data_vocab_size: int,
        seq_len: int,
        backbone: dict,
        optim: dict,
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
        seed: int = 0,
    ) -> None:
        super().__init__(data_vocab_size=data_vocab_size, seq_len=seq_len, backbone=backbone, optim=optim, seed=seed)
        self.save_hyperparameters()
        self.context = context
        self.shares = {"diagonal": 0.5, "boundary": 1 / 64, "distill": 0.0, **(shares or {})}
        if self.shares["distill"] > 0 and not teacher:
            raise ValueError("shares.distill > 0 needs an MDM teacher checkpoint (method.teacher=...)")
        self.init_from = init_from
        self.teacher_path = teacher
        self.teacher_train_mode = teacher_train_mode
        if mdm_teacher_time not in MDM_TEACHER_TIMES:
            raise ValueError(f"mdm_teacher_time must be one of {MDM_TEACHER_TIMES}, got {mdm_teacher_time!r}")
        self.mdm_teacher_time = mdm_teacher_time  # the time the distill rows' MDM teacher reads
        self.zero_t_embedding = zero_t_embedding
        self.antithetic = antithetic
        if state_space not in STATE_SPACES:
            raise ValueError(f"state_space must be one of {STATE_SPACES}, got {state_space!r}")
        self.state_space = state_space
        self.compile_tails = compile_tails  # the loss's soft-capped log-softmax compiled (forward and backward)
        if fused_loss not in FUSED_LOSSES:
            raise ValueError(f"fused_loss must be one of {FUSED_LOSSES}, got {fused_loss!r}")
        self.fused_loss = fused_loss  # the student's loss from the head's input (flowlm/ops/fused_ce.py)
        self.process = GaussianFlowProcess(vocab_size=data_vocab_size)
        # the DiT, or a LLaMA-family MDM in LlamaFlowNet with the ``adapter`` options (refused on a DiT)
        self.net = self.build_backbone(data_vocab_size, two_times=True, adapter=adapter)
        # a [MASK] inside the data vocabulary (LLaDA, Dream) is never predicted; the DiT's (id |V|) lies outside it
        self.mask_id = self.backbone_mask_id(self.net)
        self._space_cache: tuple | None = None  # (key of the embedding's storage and version, its state space)
        self.init_report: dict[str, list[str]] | None = None
        self._teacher = None  # a frozen MDM, kept out of the state dict

    # ------------------------------------------------------------------------------------------------ network
    def forward(
        self, x: Tensor, s: Tensor, t: Tensor, pinned: Tensor | None = None, *, embedded: bool = False
    ) -> Tensor:
        """log δ_{s,t}(x): (B, L, |V|) log-probabilities, soft-capped at 30, at per-token times (s, t); or, with
        ``pinned`` (B, L), at per-sequence times (s, t) with the pinned tokens at s = t = 1 (cheaper, see DiT).
        ``embedded``: x is already h = x·E (B, L, d), a state of the embedding space."""
        logits = self.net.forward_embeddings(x, s, t, pinned=pinned) if embedded else self.net(x, s, t, pinned=pinned)
        if self.mask_id < self.data_vocab_size:  # [MASK] inside the vocabulary: logit −∞, capped to −cap
            logits = logits.index_fill(-1, torch.tensor([self.mask_id], device=logits.device), -torch.inf)
        if torch.is_grad_enabled() or tails_enabled():  # compiled: one fused pass (flowlm/ops/compiled.py)
            return log_delta(logits)
        return log_delta_(logits)  # in place without autograd

    def never_mask(self, fn, *args: Tensor) -> Tensor:
        """``fn``'s log δ with a [MASK] inside the vocabulary at exactly −∞, what samplers draw from: a draw (PR at a
        temperature > 0) never emits it. ``forward`` leaves it at the soft cap's floor, log δ([MASK]) = −cap − lse_v
        g(l_v), which every training path (dense, fused, the semigroup targets) shares and a −∞ would turn into
        0 · ∞ = NaN in a soft target's CE; the other columns are not renormalised (the mass moved, e^{−cap − lse} ≤
        e^{−30 − max g}, is below float32 resolution for any max capped logit above −13). Greedy drafts read the
        argmax, which never picks [MASK] while any logit is finite."""
        log_probs = fn(*args)
        return log_probs.index_fill(-1, torch.tensor([self.mask_id], device=log_probs.device), -torch.inf)

    def states(self, kind: str | None = None) -> OneHotSpace | EmbeddingSpace:
        """The flow state space (``state_space``, or ``kind``): chosen by shape with ``auto`` (methods.md §4).
        The embedding space's factor is kept while the embedding's values are unchanged (one per evaluation)."""
        weight = self.net.token_embeddings.detach()
        key = (kind or self.state_space, weight.data_ptr(), weight._version, weight.device, weight.dtype)
        if self._space_cache is None or self._space_cache[0] != key:
            with torch.no_grad():
                self._space_cache = (key, choose_space(key[0], weight.float()))
        return self._space_cache[1]

    def summary(
        self, x: Tensor, s: Tensor, t: Tensor, pinned: Tensor | None = None, *, embedded: bool = False
    ) -> tuple[Tensor, Tensor]:
        """(max_v log δ_{s,t}(x), argmax_v) per position (B, L), ``forward``'s inputs: the output head and its soft
        cap in vocabulary chunks, never a (B, L, |V|) log δ (flowlm/ops/summary.py). The argmax is that of
        the logits (the cap is monotone), the first index on a tie."""
        log_max, argmax, _ = self._head_pass(x, s, t, pinned, embedded=embedded, mean=False)
        return log_max, argmax

    def lifted(
        self, x: Tensor, s: Tensor, t: Tensor, pinned: Tensor | None = None, *, embedded: bool = False
    ) -> Tensor:
        """δ_{s,t}(x)·E (B, L, d), the denoiser's mean in the embedding space (what a flow-map sub-step adds), from
        the head's vocabulary chunks: the same as ``states("embedding").lift(forward(...).exp())`` to float
        rounding, without a (B, L, |V|) tensor; the product with E is the one δ·E needs by its definition."""
        return self._head_pass(x, s, t, pinned, embedded=embedded, mean=True)[2]

    def head_input(
        self, x: Tensor, s: Tensor, t: Tensor, pinned: Tensor | None = None, *, embedded: bool = False
    ) -> Tensor:
        """``forward``'s network up to its output head's input (B, L, d): log δ = log_softmax(g(head(·)))."""
        h = x if embedded else self.net.input_embeddings(x)
        return self.net.head_features(h, s, t, pinned=pinned)

    def plain_head(self) -> torch.nn.Linear:
        """The output head, refused unless a plain Linear (an adapter's weight is not the whole head)."""
        head = self.net.output_head
        if type(head) is not torch.nn.Linear:
            raise TypeError(f"the chunked head pass needs a plain Linear output head, got {type(head).__name__}")
        return head

    def _head_pass(
        self, x: Tensor, s: Tensor, t: Tensor, pinned: Tensor | None, *, embedded: bool, mean: bool
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """``head_expectation`` of this network's soft-capped head at (x, s, t), with E as its table if ``mean``."""
        head = self.plain_head()
        features = self.head_input(x, s, t, pinned, embedded=embedded)
        table = self.net.token_embeddings if mean else None
        return head_expectation(features, head.weight, self.head_bias(head), cap=SOFT_CAP, table=table)

    def head_bias(self, head: torch.nn.Linear) -> Tensor | None:
        """The bias the chunked head passes add: the head's own, with a [MASK] inside the data vocabulary (LLaDA,
        Dream) at −∞ (what ``forward`` does to the logits; computed per call, never a parameter: an optimiser or EMA
        step on −∞ would give NaN)."""
        if self.mask_id >= self.data_vocab_size:
            return head.bias
        bias = head.weight.new_zeros(head.out_features) if head.bias is None else head.bias
        return bias.index_fill(0, torch.tensor([self.mask_id], device=bias.device), -torch.inf)

    def denoiser(self, space: str | None = None, *, summary: str = "chunked") -> FlowDenoiser:
        """This model as flow samplers see it, reading states of its state space (or of ``space``); greedy drafts
        read its ``summary`` (``summary="chunked"``) or off the full log δ (``"dense"``, the earlier path)."""
        if summary not in SUMMARIES:
            raise ValueError(f"summary must be one of {SUMMARIES}, got {summary!r}")
        states = self.states(space)
        fn = functools.partial(self, embedded=True) if states.embedded else self
        if self.mask_id < self.data_vocab_size:  # a [MASK] inside the vocabulary: never drawn (see never_mask)
            fn = functools.partial(self.never_mask, fn)
        summary_fn = lift_fn = None
        if summary == "chunked":
            summary_fn = functools.partial(self.summary, embedded=True) if states.embedded else self.summary
            if states.embedded:  # δ·E from the head's chunks; the one-hot space's δ is its own state (no product)
                lift_fn = functools.partial(self.lifted, embedded=True)
        return FlowDenoiser(
            fn=fn, vocab_size=self.data_vocab_size, pinned_fn=fn, space=states, summary_fn=summary_fn, lift_fn=lift_fn
        )

    # ------------------------------------------------------------------------------------------ MDM sources
    def validate_inputs(self) -> None:
        """Check the init/teacher checkpoints (family, vocabulary) before any compute."""
        for path, role in ((self.init_from, "init_from"), (self.teacher_path, "teacher")):
            if path:
                ckpt = read_checkpoint(path, data_vocab_size=self.data_vocab_size)  # a path or hub name
                families = ("mdm", "flow") if role == "init_from" else "mdm"  # init: an MDM, or an FLM/FMLM
                check_family(ckpt["flowlm"], path, family=families, data_vocab_size=self.data_vocab_size, role=role)
                if role == "init_from":  # a dry run on a copy: another backbone size fails here, not mid-fit
                    check_same_family(self.backbone_kind, checkpoint_backbone(ckpt), path)
                    timed = ckpt["flowlm"].get("family") == "flow" or ckpt["hyper_parameters"].get("time_conditioning")
                    check_backbone_options(ckpt, self.backbone_cfg, path, role=role, time_conditioned=bool(timed))
                    self.backbone_kind.copy_into(copy.deepcopy(self.net), ckpt["state_dict"])

    def on_fit_start(self) -> None:
        """Initialise from the MDM (fresh runs only) and load the frozen teacher."""
        if self.init_from and self.global_step == 0 and self.init_report is None:
            source = read_checkpoint(self.init_from, data_vocab_size=self.data_vocab_size)
            self.initialise_from(source["state_dict"])  # the source's EMA weights
            rank_zero_info(
                f"Initialised from {self.init_from}: copied {len(self.init_report['copied'])} tensors "
                f"({len(self.init_report['sliced'])} with the [MASK] row dropped), fresh: {self.init_report['fresh']}"
            )
            for lg in self.loggers:
                if isinstance(lg, MLFlowLogger) and self.trainer.is_global_zero:
                    lg.experiment.log_dict(lg.run_id, self.init_report, "init_from.json")
        if self.teacher_path and self._teacher is None:
            # a file, a sharded or export folder, or a foreign pretrained MDM (path or hub name)
            teacher = load_module(self.teacher_path, map_location=self.device, data_vocab_size=self.data_vocab_size)
            teacher.eval().requires_grad_(False)
            if getattr(teacher, "time_conditioning", False) and self.mdm_teacher_time == "zero":
                warnings.warn(
                    f"the MDM teacher {self.teacher_path} is time-conditioned and is fed time 0 (nothing masked) on "
                    "rows with [MASK]s: the released code's choice, made for a time-agnostic teacher; "
                    "method.mdm_teacher_time=rate feeds it each row's masking rate",
                    UserWarning,
                    stacklevel=2,
                )
            object.__setattr__(self, "_teacher", teacher)  # not a submodule: never saved, never optimised

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
    def flow_loss(
        self,
        batch: dict,
        kinds: Tensor,
        s: Tensor,
        t: Tensor,
        gen: torch.Generator | None,
        *,
        parts: bool = False,
        rates: Tensor | None = None,
    ) -> LossOutput:
        """The FMLM+ loss (flowlm/objectives/fmlm_plus.py) of one batch for given pair kinds (on the host: they
        pick the rows of the teacher passes without a device read), per-sequence times (B,) and context rates f (B,)
        (drawn from ``gen`` when not given); the context set and the noise are drawn here from ``gen``. With
        ``parts`` also each kind's mean per-token loss. With ``fused_loss`` the student pass stops at the head's input
        and the loss runs the head in blocks of rows (``fmlm_plus_loss``'s ``head``); the teachers are unchanged."""
        tokens, prompt = batch["tokens"], self.pin_unpredicted(batch["prompt_mask"])  # Dream: position 0 pinned
        b, length = tokens.shape
        if self.context:  # context set: each non-prompt token is clean with probability f ~ U(0, 1)
            f = torch.rand(b, generator=gen, device=tokens.device) if rates is None else rates.to(tokens.device)
            ctx = context_set(f, torch.rand(b, length, generator=gen, device=tokens.device), prompt)
        else:
            ctx = torch.zeros_like(prompt)
        process = self.training_process()
        noise = torch.randn(process.draw_shape(tokens), generator=gen, device=tokens.device)
        # log δ_{s,t}(x) at per-sequence times, the pinned tokens at s = t = 1 (two adaLN rows per sequence)
        student = functools.partial(self, embedded=True) if process.embedded else self
        head = self.fused_head()
        if head is not None:
            student = functools.partial(self.head_input, embedded=process.embedded)
        with (
            compiled_tails() if self.compile_tails else contextlib.nullcontext()
        ):  # log δ fused (flowlm/ops/compiled.py)
            return fmlm_plus_loss(
                student,
                tokens,
                prompt,
                kinds,
                s,
                t,
                context=ctx,
                noise=noise,
                process=process,
                **self.teachers(embedded=process.embedded),
                loss_mask=batch.get("loss_mask"),  # text data may leave PAD out of the loss
                parts=parts,
                head=head,
                every_pass=is_sharded(self),  # FSDP: every rank runs the teacher passes (on row 0 if none needs them)
            )

    def fused_head(self) -> tuple[Tensor, Tensor | None] | None:
        """(W, b) of the output head when this step's student loss runs fused from the head's input, else None: the
        one place it is chosen. ``fused_loss`` true: required (a head that is not a plain Linear, or a sharded head
        weight, is refused); false: never; auto: where the vocabulary is larger than the width (text, where the
        (B, L, |V|) log δ is the cost; Sudoku keeps the dense path), the head is a plain, unsharded Linear and
        ``compile_tails`` does not ask for the compiled dense log-softmax."""
        if self.fused_loss is False:
            return None
        linear = self.net.output_head
        plain = type(linear) is torch.nn.Linear and type(linear.weight.data) is torch.Tensor  # not a DTensor shard
        if self.fused_loss == "auto":  # compile_tails asks for the compiled dense log-softmax instead
            wide = linear.out_features > linear.in_features
            return (linear.weight, self.head_bias(linear)) if plain and wide and not self.compile_tails else None
        linear = self.plain_head()
        if type(linear.weight.data) is not torch.Tensor:  # a DTensor shard outside the network's forward
            raise ValueError("method.fused_loss needs the full head weight: not with a sharded (FSDP) DiT")
        return linear.weight, self.head_bias(linear)

    def training_process(self) -> GaussianFlowProcess:
        """The process of this step's states: over the vocabulary, or, when ``state_space`` chooses the embedding
        space, h = x·E with the noise z·R built from this step's E (differentiable: the factor of EᵀE is recomputed
        each step, O(|V|·d²), against the O(B·L·|V|·d) input product it saves). A sharded embedding (FSDP) is not
        a full matrix outside the network's forward: ``auto`` then keeps the one-hot states."""
        if self.state_space == "onehot":
            return self.process
        weight = self.net.token_embeddings
        full = type(weight.data) is torch.Tensor and tuple(weight.shape) == (self.data_vocab_size, self.net.d_model)
        if not full:
            if self.state_space == "embedding":
                raise ValueError("state_space=embedding needs the full embedding matrix: not with a sharded (FSDP) DiT")
            return self.process
        space = choose_space(self.state_space, weight)
        return GaussianFlowProcess(vocab_size=self.data_vocab_size, space=space) if space.embedded else self.process

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

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        """Diagonal CE + semigroup self-distillation (+ MDM distillation) on active tokens."""
        b = batch["tokens"].shape[0]
        kinds, s, t = self.sample_pairs(b, batch_idx)  # on the host
        rates = self.sample_context_rates(b, batch_idx).float()
        gen = self.step_generator(1, batch_idx, shared=False, device=self.device)
        # a blocking copy would sync the stream
        s, t, rates = (x.to(self.device, non_blocking=True) for x in (s, t, rates))
        out = self.flow_loss(batch, kinds, s, t, gen, parts=self.logs_this_step(), rates=rates)
        self.log("train/loss", out.loss, prog_bar=True)
        for name in KIND_NAMES:
            if name in out.parts:
                self.log(f"train/loss_{name}", out.parts[name])
        return out.loss

    def validation_step(self, batch: dict, batch_idx: int) -> Tensor:
        """Diagonal CE at fixed times and contexts (comparable across evaluations)."""
        b = batch["tokens"].shape[0]
        gen = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + batch_idx)
        s = (torch.arange(b, device=self.device) + 0.5) / b
        kinds = torch.full((b,), DIAGONAL)
        loss = self.flow_loss(batch, kinds, s, s, gen).loss
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=b)
        return loss


def check_same_family(kind: BackboneKind, source: dict, path: str) -> None:
    """Refuse an ``init_from`` whose backbone is of another family than this run's (a DiT MDM into a LLaMA-family
    FMLM+, or the reverse) before any compute: their tensors share no names."""
    if type(backbone_kind(source)) is not type(kind):
        there = source.get("_target_", "the suite's DiT")
        raise ValueError(
            f"init_from {path} was trained on another backbone family ({there}) than this run's backbone: initialise "
            "from an MDM of the same backbone (backbone=<its config>)"
        )
