"""Peak GPU memory per device of one training step of each paper experiment at its paper shape, estimated without a
GPU: the experiment's config composed at scale=paper for its documented device count, the module built and one
step (draw, loss under bf16 autocast, backward, AdamW) run on fake tensors (``FakeTensorMode``: shapes, no storage)
while a dispatch mode adds each new storage's bytes and subtracts them when it is freed.

  .venv/bin/python benchmarks/memory_estimates.py                      # the table of docs/experiments.md
  .venv/bin/python benchmarks/memory_estimates.py owt_mdm --devices 4 --micro-batch 64

What the step holds per device: the fp32 weights, gradients and AdamW's two moments, the EMA copy of the trainable
weights (callbacks/ema.py), under DDP the gradient buckets (one more fp32 copy of the gradients); the activations
saved for backward at the micro batch, bf16 where autocast casts. Attention is counted as the fused kernel a GPU
runs (FlexAttention with the DiT's soft cap, SDPA's flash kernel without): its inputs, output and log-sum-exp, not
the (B, H, L, L) scores the CPU's written path makes. FMLM+ micro-batches are built with as many jump (and distill)
rows as the global draw gives one micro-batch with probability 1 − 1e-9 (the exact hypergeometric quantile): the
rows whose teacher targets are (rows, L, |V|) tensors. A validation step: the device's share of the validation
batch, its draws made at once and its loss run without gradients in chunks of the micro batch, as
``FlowLMModule.validation_loss`` runs it. Vocabulary passes (the fused cross-entropy's blocks of rows, the chunked
summaries, the draws' tiles) are cut at a GPU's sizes (``vocab_sizes("cuda")``, not the CPU's cache-sized ones), and
the module takes the paths the run takes: a fake weight is whole, so a text FMLM+ run on DDP or one GPU draws in the
embedding space and runs its loss fused, as its ``state_space: auto`` and ``fused_loss: auto`` choose.

LLaMA-family backbones (LLaDA-8B, Dream-7B, SMDM-1028M) are built from their published shapes with random fake
weights (``random_backbone``: no download). Under FSDP2 (``trainer.strategy`` ModelParallelStrategy: one unit per
decoder layer, the rest of the network one root unit, bf16 all-gathers, frozen weights left out of the sharding) the
step runs on bf16 copies of the trainable weights, its forward inputs cast to bf16 as FSDP2's mixed precision
casts them, and a decoder layer's unsharded gradients freed as it reduce-scatters them; added per device: the fp32
trainable weights, their EMA, gradients and AdamW moments over the devices (1/N each), the frozen weights and their
EMA whole, and the gathered bf16 weights — the root unit's (kept through forward and backward) and two decoder layers
(the one running and the one prefetched) — plus one unit's reduce-scatter buffers (its bf16 gradients and their fp32
copy). Frozen weights (MLFM's MDM) have no gradients or moments on any strategy. A sharded embedding and head are not
whole outside the forward, so such a run draws one-hot states and runs the loss unfused (``flow_map.is_shard``).
Activation checkpointing is applied where the config asks for it (``activation_checkpointing: true``). Not counted:
the CUDA context and allocator slack (≈ 1–3 GiB), NCCL buffers, the evaluation's sampling batches.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from hydra import compose, initialize_config_dir
from omegaconf import open_dict
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import flowlm.backbones.dit as dit
import flowlm.models.flow_map as flow_map
import flowlm.ops.draws as draws_ops
import flowlm.ops.fused_ce as fused_ce
import flowlm.ops.summary as summary
from flowlm.backbones.llama import BidirectionalLM
from flowlm.objectives.fmlm_plus import BOUNDARY, DIAGONAL, DISTILL, OFF_DIAGONAL
from flowlm.project import CONF_DIR
from lightning_modules.sharding import checkpoint_activations, shard_units
from runners.common import build
from runners.train import accumulation_for

GIB = 2**30
LIMIT_GIB = 80.0  # an 80 GB H100 / A100
GPT2_VOCAB = 50258  # GPT-2's 50 257 ids + the [PAD] the text datamodules add (pad_token=add)
TAIL = 1e-9  # the jump rows of a micro-batch exceed the estimate's with at most this probability
# Every paper experiment at its documented device count (docs/experiments.md): the table's rows.
PAPER_RUNS = [
    ("sudoku_mdm_hard", 1),
    ("sudoku_fmlm_plus_scratch_hard", 1),
    ("sudoku_fmlm_plus_distill_hard", 1),
    ("sudoku_ar_medium", 1),
    ("tinystories_mdm", 1),
    ("tinystories_fmlm_plus_scratch", 1),
    ("tinystories_fmlm_plus_distill", 1),
    ("tinystories_ar", 1),
    ("owt_mdm", 8),
    ("owt_fmlm_plus_scratch", 8),
    ("owt_fmlm_plus_distill", 8),
    ("owt_ar", 8),
    ("owt_fmlm_plus_init_mdlm", 8),
    ("tinygsm_mdm", 8),
    ("tinygsm_fmlm_plus_scratch", 8),
    ("tinygsm_fmlm_plus_distill", 8),
    ("tinygsm_ar", 8),
    ("gsm8k_mdm", 1),
    ("gsm8k_ar", 1),
    ("sudoku_mlfm_hard", 1),
    ("gsm8k_mlfm", 1),
    ("owt_mlfm_mdlm", 8),
    ("gsm8k_mlfm_smdm", 8),  # FSDP2 (scale/gsm8k_mlfm_smdm/paper.yaml)
    ("tinygsm_fmlm_plus_init_llada", 8),  # FSDP2 (scale/tinygsm_llama/paper.yaml)
    ("tinygsm_fmlm_plus_init_dream", 8),
]
# The published shapes of the LLaMA-family sources (conf/backbone/llama/), as their loaders read them from
# config.json: the fields a loader's ``expect`` does not pin. LLaDA-8B: vocabulary 126 464 rows (= len(tokenizer),
# docs/pretrained.md), [MASK] 126 336, RoPE θ 5e5; Dream-7B: [MASK] 151 666, RoPE θ 1e6.
SOURCE_FIELDS = {
    "flowlm.pretrained.llada.load_llada": {"vocab_size": 126464, "mask_token_id": 126336, "rope_theta": 5e5},
    "flowlm.pretrained.dream.load_dream": {"mask_token_id": 151666, "rope_theta": 1e6},
}


class LiveBytes(TorchDispatchMode):
    """The bytes of live storages made inside the mode (``now``) and their maximum (``peak``); a storage counts once
    whatever views share it, until the last tensor on it is freed (tensor subclasses such as fake tensors keep their
    Python object while autograd holds them, so the finaliser runs when the storage really dies)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = self.largest = 0
        self._bytes: dict[int, int] = {}
        self._refs: dict[int, int] = {}

    def _free(self, key: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.now -= self._bytes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in self._bytes:
                    self._bytes[key], self._refs[key] = storage.nbytes(), 0
                    self.now += storage.nbytes()
                    self.largest = max(self.largest, storage.nbytes())
                self._refs[key] += 1
                weakref.finalize(t, self._free, key)
        self.peak = max(self.peak, self.now)
        return out


class _FusedAttention(torch.autograd.Function):
    """What a fused attention kernel allocates: the output and log-sum-exp forward (q, k, v, out, lse saved), the
    three input gradients backward; no score matrix."""

    @staticmethod
    def forward(ctx, q, k, v):  # noqa: D102
        out = torch.empty_like(q)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@contextmanager
def fused_attention():
    """The DiT's attention as the GPU runs it (FlexAttention / SDPA flash; dropout or a mask would take the written
    path on a GPU too, so those keep it)."""
    real = dit.attention

    def attention(q, k, v, *, dropout_p, is_causal, attn_mask=None, softcap=0.0):
        if dropout_p == 0 and attn_mask is None:
            return _FusedAttention.apply(q, k, v)
        return real(q, k, v, dropout_p=dropout_p, is_causal=is_causal, attn_mask=attn_mask, softcap=softcap)

    dit.attention = attention
    try:
        yield
    finally:
        dit.attention = real


def quantile_rows(micro: int, total: int, rows_of_kind: int, tail: float = TAIL) -> int:
    """The smallest k such that a micro-batch of ``micro`` rows drawn without replacement from ``total`` rows, of which
    ``rows_of_kind`` are of a kind, holds more than k of them with probability < ``tail`` (hypergeometric)."""
    denominator = math.comb(total, micro)
    above = 1.0
    for k in range(0, min(micro, rows_of_kind) + 1):
        above -= math.comb(rows_of_kind, k) * math.comb(total - rows_of_kind, micro - k) / denominator
        if above < tail:
            return k
    return min(micro, rows_of_kind)


def source_spec(backbone: dict) -> dict:
    """The ``BidirectionalLM`` arguments of a LLaMA-family loader config (``load_llada`` / ``load_dream`` /
    ``load_smdm``), from its published shapes (``expect``, ``SOURCE_FIELDS``, SMDM's named config): no file read."""
    from flowlm.pretrained import dream, llada, smdm

    target, expect = backbone["_target_"], dict(backbone.get("expect") or {})
    if target.endswith("load_smdm"):
        return smdm.backbone_spec(smdm.smdm_config(backbone.get("config", "1028M")))
    if target.endswith("load_llada"):
        return llada.backbone_spec(llada.llada_config({**expect, **SOURCE_FIELDS[target]}, expect))
    if target.endswith("load_dream"):
        return dream.backbone_spec(dream.dream_config({**expect, **SOURCE_FIELDS[target]}, expect))
    raise ValueError(f"the estimate knows no shapes for backbone {target}")


def random_backbone(*, spec: dict, dtype: str | None = None, source: str | None = None) -> BidirectionalLM:
    """A ``BidirectionalLM`` of ``spec`` with random weights in ``dtype`` (the loader's cast), what the estimate
    builds in place of the pretrained ``source`` (fake tensors: no storage, nothing read)."""
    net = BidirectionalLM(**spec)
    if dtype:  # the parameters, as the loader casts its state (RoPE's buffers stay float32)
        _cast_floating(net, getattr(torch, dtype), lambda p: True)
    return net


def is_fsdp2(cfg) -> bool:
    """Whether the composed run shards with FSDP2 (trainer=fsdp2, or a scale file that sets its strategy)."""
    strategy = cfg.trainer.get("strategy")
    return hasattr(strategy, "get") and "ModelParallelStrategy" in str(strategy.get("_target_", ""))


@contextmanager
def device_sizes(device: str = "cuda"):
    """Vocabulary passes cut as on ``device`` (``flowlm.ops.summary.vocab_sizes``): the fused cross-entropy's
    blocks of rows (a GPU's 1 335 rows at |V| = 50 258, the CPU's 166), the summaries' chunks, the draws' tiles."""
    real = summary.vocab_sizes
    owners = (summary, fused_ce, draws_ops)
    for owner in owners:
        owner.vocab_sizes = lambda _device, _real=real: _real(device)
    try:
        yield
    finally:
        for owner in owners:
            owner.vocab_sizes = real


@contextmanager
def fake_adapters():
    """PEFT's LoRA layers built on fake weights: PEFT moves each adapter to its base layer's device and dtype with
    ``Module.to``, which cannot swap fake parameters; here a move to the CPU, where everything is, is a no-op and
    the adapter's cast to its base layer's dtype is done parameter by parameter (PEFT's dtype rule)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    real, real_to = BaseTunerLayer._move_adapter_to_device_of_base_layer, nn.Module.to

    def to(self, *args, **kwargs):
        if (
            not kwargs
            and len(args) == 1
            and isinstance(args[0], torch.device | str)
            and torch.device(args[0]).type == "cpu"
        ):
            return self
        return real_to(self, *args, **kwargs)

    def move(self, adapter_name, device=None):
        dtype = self.get_base_layer().weight.dtype
        for name in (*self.adapter_layer_names, *self.other_param_names):
            layer = getattr(self, name, None)
            if isinstance(layer, nn.ModuleDict) and adapter_name in layer:
                _cast_floating(layer[adapter_name], dtype, lambda p: True)

    BaseTunerLayer._move_adapter_to_device_of_base_layer, nn.Module.to = move, to
    try:
        yield
    finally:
        BaseTunerLayer._move_adapter_to_device_of_base_layer, nn.Module.to = real, real_to


@contextmanager
def unvalidated_distributions():
    """``torch.distributions`` without argument checks: a check reads values (MLFM's γ-mixture CDF on the host's
    times), which fake tensors do not have; nothing it allocates changes."""
    before = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        torch.distributions.Distribution.set_default_validate_args(before)


def _cast_floating(module: nn.Module, dtype: torch.dtype, chosen) -> None:
    """Replace each floating parameter of ``module`` that ``chosen`` picks by a ``dtype`` copy (same requires_grad)."""
    for owner in module.modules():
        for name, p in list(owner._parameters.items()):
            if p is not None and p.is_floating_point() and p.dtype != dtype and chosen(p):
                owner._parameters[name] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)


@dataclass
class Footprint:
    """What lives on a device across steps, by strategy (bytes): the optimizer's state, the weights and their EMA."""

    weights: int  # the weights as held per device (FSDP2: the fp32 shards of the trainable ones, frozen ones whole)
    ema: int  # the EMA copy of every parameter (callbacks/ema.py: sharded like the weights under FSDP2)
    grads: int  # fp32 gradients of the trainable weights (sharded under FSDP2)
    moments: int  # AdamW's two fp32 moments of the trainable weights (sharded under FSDP2)
    buckets: int  # DDP's gradient buckets: one more fp32 copy of the gradients (0 on one device and under FSDP2)
    gathered: int  # FSDP2: the bf16 weights gathered during forward/backward (root unit + two decoder layers)
    reduce: int  # FSDP2: a unit's reduce-scatter buffers (a layer's bf16 gradients + fp32 copy; the root's copy)
    trainable: int  # parameters with gradients (count)
    params: int  # every parameter (count)

    @property
    def state(self) -> int:
        """What lives across steps: weights, EMA, moments, buckets (and FSDP2's gathered bf16 weights); the
        gradients are made again in each backward (``zero_grad(set_to_none=True)``)."""
        return self.weights + self.ema + self.moments + self.buckets + self.gathered


def footprint(module: nn.Module, devices: int, *, sharded: bool) -> Footprint:
    """``module``'s per-device footprint on ``devices`` GPUs: DDP / one GPU holds everything whole; FSDP2 shards the
    trainable weights, their gradients, moments and EMA over the devices and gathers a unit's weights in bf16 for its
    forward and backward (the root unit's for the whole step, a decoder layer's and the prefetched next one's).
    Frozen weights have no gradients or moments on any strategy, and FSDP2 leaves them whole (``ignored_params``)."""
    params = list(module.parameters())
    trainable = [p for p in params if p.requires_grad]
    frozen_bytes = sum(p.numel() * p.element_size() for p in params if not p.requires_grad)
    n_train = sum(p.numel() for p in trainable)
    if not sharded:
        weights = sum(p.numel() * p.element_size() for p in params)
        grads = 4 * n_train
        buckets = grads if devices > 1 else 0
        return Footprint(weights, weights, grads, 2 * grads, buckets, 0, 0, n_train, sum(p.numel() for p in params))
    layer = max((sum(p.numel() for p in u.parameters() if p.requires_grad) for u in shard_units(module)), default=0)
    in_units = sum(p.numel() for u in shard_units(module) for p in u.parameters() if p.requires_grad)
    root = n_train - in_units
    shard = 4 * n_train // devices  # one fp32 copy of the trainable weights over the devices
    return Footprint(
        weights=shard + frozen_bytes,
        ema=shard + frozen_bytes,
        grads=shard,
        moments=2 * shard,
        buckets=0,
        gathered=2 * (root + 2 * layer),
        # a layer's reduce-scatter: its bf16 gradients and their fp32 copy; the root unit's bf16 gradients live in
        # the measured backward (kept until its end), its fp32 copy is added
        reduce=max((2 + 4) * layer, 4 * root),
        trainable=n_train,
        params=sum(p.numel() for p in params),
    )


@contextmanager
def as_fsdp2(module: nn.Module):
    """``module``'s step as FSDP2 runs it under bf16-mixed: the trainable weights used in bf16 (the gathered copies;
    their fp32 shards are ``footprint``'s), each unit's floating forward inputs cast to bf16 (``MixedPrecisionPolicy``
    casts them), a decoder layer's gradients freed as they are made (reduce-scattered with the layer: ``footprint``'s
    ``reduce``; the root unit's stay until the end of backward), and the embedding and head seen as shards outside the
    forward (one-hot states, the unfused loss: ``flow_map.is_shard``)."""
    _cast_floating(module, torch.bfloat16, lambda p: p.requires_grad)
    units = shard_units(module)
    roots = [child for child in module.children() if any(True for _ in child.parameters())]

    def cast_inputs(_module, args, kwargs):
        def bf16(x):
            return x.to(torch.bfloat16) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

        return tuple(bf16(a) for a in args), {k: bf16(v) for k, v in kwargs.items()}

    handles = [m.register_forward_pre_hook(cast_inputs, with_kwargs=True) for m in (*units, *roots)]
    for unit in units:
        for p in unit.parameters():
            if p.requires_grad:
                handles.append(p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None)))
    real = flow_map.is_shard
    flow_map.is_shard = lambda weight: True
    try:
        yield
    finally:
        flow_map.is_shard = real
        for handle in handles:
            handle.remove()


@dataclass
class Estimate:
    """One experiment's estimate per device."""

    experiment: str
    devices: int
    micro_batch: int
    accumulation: int
    seq_len: int
    params: int
    trainable: int  # parameters with gradients (MLFM: the adapter's)
    sharded: bool  # FSDP2
    state_gib: float  # weights, gradients' buckets, AdamW, EMA (FSDP2: + the gathered bf16 units): across steps
    gathered_gib: float  # FSDP2: the bf16 weights gathered for the running units (0 elsewhere)
    peak_gib: float  # the training step's peak: state + activations + gradients
    val_rows: int  # the validation batch per device
    val_micro: int  # rows per validation forward (``micro_batch_size``, a cap: FlowLMModule.validation_loss)
    val_peak_gib: float  # a validation step's peak: state + the share's draws + a no-grad loss at ``val_micro`` rows
    largest_gib: float  # the largest single tensor
    target_rows: int  # FMLM+: jump + distill rows in the micro-batch (0 elsewhere)

    def row(self) -> str:
        """This estimate as a row of the docs' table."""
        rows = f" ({self.target_rows} target rows)" if self.target_rows else ""
        chunks = f" ({self.val_micro} a forward)" if self.val_micro < self.val_rows else ""
        devices = f"{self.devices} (FSDP2)" if self.sharded else f"{self.devices}"
        params = f"{self.params / 1e9:.2f} B" if self.params >= 1e9 else f"{self.params / 1e6:.0f} M"
        if self.trainable < self.params:
            params += f" ({self.trainable / 1e6:.0f} M trained)"
        return (
            f"| {self.experiment} | {devices} | {self.micro_batch}{rows} | {self.accumulation} | "
            f"{params} | {self.peak_gib:.1f} | {self.val_rows}{chunks} | {self.val_peak_gib:.1f} | "
            f"{self.largest_gib:.2f} |"
        )


def composed(experiment: str, devices: int, *extra: str, trainer: str | None = None):
    """The experiment's paper-scale config on ``devices`` GPUs (``trainer``, default ddp; one device: gpu), a
    LLaMA-family source replaced by a random network of its shapes (``random_backbone``)."""
    trainer = trainer or ("ddp" if devices > 1 else "gpu")
    chosen = [f"trainer={trainer}"] + ([f"trainer.devices={devices}"] if trainer != "gpu" else [])
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[f"experiment={experiment}", "scale=paper", *chosen, *extra])
    backbone = cfg.get("backbone")
    if backbone is not None and "_target_" in backbone and backbone["_target_"].startswith("flowlm.pretrained."):
        random = {
            "_target_": f"{__name__}.random_backbone",
            "spec": source_spec(dict(backbone)),
            "dtype": backbone.get("dtype"),
            "source": str(backbone.get("source")),
        }
        with open_dict(cfg):
            cfg.backbone = random
    return cfg


def data_shape(cfg) -> tuple[int, int]:
    """(data vocabulary, L) of the experiment's data, without reading a tokenizer or a dataset: a LLaMA-family
    backbone's head rows (its tokenizer's ids: docs/pretrained.md), else GPT-2's."""
    if "sudoku" in cfg.data._target_.lower():
        datamodule = build(cfg.data)
        return datamodule.vocab_size, datamodule.seq_len
    if "spec" in cfg.backbone:
        return int(cfg.backbone.spec.head_rows), int(cfg.data.seq_len)
    tokenizer = cfg.data.get("tokenizer", "gpt2")
    if tokenizer != "gpt2":
        raise ValueError(f"{cfg.name}: the estimate knows GPT-2's vocabulary only, not {tokenizer!r}")
    return GPT2_VOCAB, int(cfg.data.seq_len)


def built(experiment: str, devices: int, *extra: str):
    """(config, module in train mode, its ``Footprint``, whether FSDP2) of ``experiment`` on ``devices`` GPUs, on fake
    tensors: call inside a ``FakeTensorMode`` (with ``fake_adapters``)."""
    cfg = composed(experiment, devices, *extra)
    vocab, length = data_shape(cfg)
    module = build(cfg.method, data_vocab_size=vocab, seq_len=length).train()
    if cfg.get("activation_checkpointing"):
        checkpoint_activations(module)
    sharded = is_fsdp2(cfg)
    return cfg, module, footprint(module, devices, sharded=sharded), sharded


def estimate(
    experiment: str, devices: int, micro_batch: int | None = None, *extra: str, sizes_for: str = "cuda"
) -> Estimate:
    """One training step's peak per device of ``experiment`` on ``devices`` GPUs at ``micro_batch`` rows per forward
    (default: the shipped config's ``micro_batch_size``, else the global batch over the devices), its vocabulary
    passes cut as on ``sizes_for`` (a GPU's, by default)."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake, fused_attention(), device_sizes(sizes_for), fake_adapters(), unvalidated_distributions():
        cfg, module, foot, sharded = built(experiment, devices, *extra)
        global_batch = int(cfg.data.batch_size)
        micro = min(micro_batch or cfg.get("micro_batch_size") or global_batch, global_batch // devices)
        accumulation = accumulation_for(global_batch, devices, micro)
        vocab, length = data_shape(cfg)
        teacher_bytes = 0
        if getattr(module, "teacher_path", None):  # fmlm_plus_distill: the frozen MDM its on_fit_start loads
            teacher = _mdm_like(cfg, vocab, length).eval()
            object.__setattr__(module, "_teacher", teacher)
            teacher_bytes = sum(p.numel() * p.element_size() for p in teacher.parameters())
        with as_fsdp2(module) if sharded else contextlib.nullcontext():
            trainable = [p for p in module.parameters() if p.requires_grad]
            optimizer = None if sharded else torch.optim.AdamW(trainable, lr=1e-4, foreach=True)
            batch, draws_for, target_rows = _micro_batch(module, micro, length, vocab, global_batch, "train")
            with LiveBytes() as live:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = module.loss(batch, draws_for()).loss
                loss.backward()
                del loss
                backward_peak, live.peak = live.peak, live.now
                if optimizer is not None:
                    optimizer.step()  # makes AdamW's moments (and its foreach temporaries) beside the gradients
            if sharded:
                # the step's peak: the live activations and the root unit's bf16 gradients, beside the sharded state
                # and one unit's reduce-scatter buffers; AdamW then runs on 1/N shards (its temporaries are a shard's)
                steps_peak = backward_peak + foot.grads + foot.moments + foot.reduce
            else:
                # from the second step on the moments live through the forward and backward; the gradients, freed by
                # zero_grad(set_to_none=True), are made again in backward (held in ``backward_peak``)
                steps_peak = max(backward_peak + foot.moments, live.peak)
            base = teacher_bytes + foot.weights + foot.ema + foot.buckets + foot.gathered
            peak = base + steps_peak
            # validation: each device draws for its share of the global validation batch, then runs the loss in
            # chunks of the micro batch (FlowLMModule.validation_loss; the run config's micro_batch_size, ``micro``)
            val_rows = int(cfg.data.get("val_batch_size") or global_batch) // devices
            val_micro = min(micro, val_rows)
            val_batch, val_draws, _ = _micro_batch(module.eval(), val_rows, length, vocab, global_batch, "val")
            module.run_config = {"micro_batch_size": val_micro}
            _host_kinds_in_chunks(module)
            del batch, draws_for
            for p in trainable:
                p.grad = None
            with LiveBytes() as val_live, torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                module.validation_loss(val_batch, val_draws())
            val_peak = base + foot.moments + val_live.peak
    return Estimate(
        experiment=experiment,
        devices=devices,
        micro_batch=micro,
        accumulation=accumulation,
        seq_len=length,
        params=foot.params,
        trainable=foot.trainable,
        sharded=sharded,
        state_gib=(teacher_bytes + foot.state) / GIB,
        gathered_gib=foot.gathered / GIB,
        peak_gib=peak / GIB,
        val_rows=val_rows,
        val_micro=val_micro,
        val_peak_gib=val_peak / GIB,
        largest_gib=max(live.largest, val_live.largest) / GIB,
        target_rows=target_rows,
    )


def _host_kinds_in_chunks(module) -> None:
    """FMLM+ reads its pair kinds on the host (``kinds.tolist()``); a chunk's kinds, cut from the share's inside the
    fake mode, are fake: give each chunk real ones, the validation's diagonal."""
    if getattr(module, "shares", None) is None:
        return
    loss = module.loss

    def host_loss(batch, draws, **kwargs):
        with unset_fake_temporarily():
            kinds = torch.full((batch["tokens"].shape[0],), DIAGONAL)
        return loss(batch, {**draws, "kinds": kinds}, **kwargs)

    module.loss = host_loss


def _mdm_like(cfg, vocab: int, length: int):
    """A frozen MDM teacher of the experiment's backbone (what ``method.teacher`` loads)."""
    from lightning_modules.mdm import MDMModule

    mdm = MDMModule(data_vocab_size=vocab, seq_len=length, backbone=dict(cfg.backbone), optim={})
    for p in mdm.parameters():
        p.requires_grad_(False)
    return mdm


def _micro_batch(module, rows: int, length: int, vocab: int, global_batch: int, stage: str):
    """``rows`` sequences of token ids without a prompt (every position noised: the most a loss scores) and a function
    drawing their step's inputs: the module's own draw, or for FMLM+ in training one with the high-quantile number of
    jump and distill rows (its validation: the diagonal)."""
    tokens = torch.randint(0, vocab, (rows, length))
    prompt = torch.zeros(rows, length, dtype=torch.bool)
    batch = {"tokens": tokens, "prompt_mask": prompt}
    shares = getattr(module, "shares", None)
    if shares is None:
        return batch, lambda: module.draw(batch, 0, stage=stage), 0
    from flowlm.objectives.fmlm_plus import split_counts

    jumps = distill = 0
    if stage == "train":
        counts = split_counts(global_batch, **shares)  # diagonal, boundary, off-diagonal, distill over the batch
        jumps = quantile_rows(rows, global_batch, counts[BOUNDARY] + counts[OFF_DIAGONAL])
        distill = min(rows - jumps, quantile_rows(rows, global_batch, counts[DISTILL])) if counts[DISTILL] else 0
    with unset_fake_temporarily():  # pair kinds are host data the loss reads (``soft_targets``: ``kinds.tolist()``)
        kinds = torch.full((rows,), DIAGONAL)
        kinds[:jumps] = OFF_DIAGONAL
        kinds[jumps : jumps + distill] = DISTILL
        s = torch.where(kinds == OFF_DIAGONAL, 0.2, torch.where(kinds == DISTILL, 0.0, 0.5))
        t = torch.where(kinds == OFF_DIAGONAL, 0.8, torch.where(kinds == DISTILL, 0.0, 0.5))
    gen = torch.Generator().manual_seed(0)
    return batch, lambda: module.draws_at(batch, kinds, s, t, gen), jumps + distill


def main() -> None:
    """Print the docs' table (or one experiment's estimate)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("experiments", nargs="*", help="experiments (default: every paper run of the table)")
    parser.add_argument("--devices", type=int, help="device count (default: each experiment's documented one)")
    parser.add_argument("--micro-batch", type=int, help="rows per forward (default: the shipped config's)")
    args = parser.parse_args()
    runs = [(e, args.devices or dict(PAPER_RUNS).get(e, 1)) for e in args.experiments] or PAPER_RUNS
    print(
        "| experiment | devices | micro batch | accumulation | parameters | peak GiB | validation rows | "
        "validation peak GiB | largest tensor GiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for experiment, devices in runs:
        print(estimate(experiment, devices, args.micro_batch).row(), flush=True)


if __name__ == "__main__":
    main()
