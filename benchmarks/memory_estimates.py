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
``FlowLMModule.validation_loss`` runs it. Not counted: the CUDA context and allocator slack
(≈ 1–3 GiB), NCCL buffers, the evaluation's sampling batches.
"""

from __future__ import annotations

import argparse
import math
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from hydra import compose, initialize_config_dir
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import flowlm.backbones.dit as dit
from flowlm.objectives.fmlm_plus import BOUNDARY, DIAGONAL, DISTILL, OFF_DIAGONAL
from flowlm.project import CONF_DIR
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
]


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


@dataclass
class Estimate:
    """One experiment's estimate per device."""

    experiment: str
    devices: int
    micro_batch: int
    accumulation: int
    seq_len: int
    params: int
    state_gib: float  # weights, gradients' buckets, AdamW, EMA: what lives across steps
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
        return (
            f"| {self.experiment} | {self.devices} | {self.micro_batch}{rows} | {self.accumulation} | "
            f"{self.params / 1e6:.0f} M | {self.peak_gib:.1f} | {self.val_rows}{chunks} | {self.val_peak_gib:.1f} | "
            f"{self.largest_gib:.2f} |"
        )


def composed(experiment: str, devices: int, *extra: str, trainer: str | None = None):
    """The experiment's paper-scale config on ``devices`` GPUs (``trainer``, default ddp; one device: gpu)."""
    trainer = trainer or ("ddp" if devices > 1 else "gpu")
    chosen = [f"trainer={trainer}"] + ([f"trainer.devices={devices}"] if trainer != "gpu" else [])
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("train", overrides=[f"experiment={experiment}", "scale=paper", *chosen, *extra])


def data_shape(cfg) -> tuple[int, int]:
    """(data vocabulary, L) of the experiment's data, without reading a tokenizer or a dataset."""
    if "sudoku" in cfg.data._target_.lower():
        datamodule = build(cfg.data)
        return datamodule.vocab_size, datamodule.seq_len
    tokenizer = cfg.data.get("tokenizer", "gpt2")
    if tokenizer != "gpt2":
        raise ValueError(f"{cfg.name}: the estimate knows GPT-2's vocabulary only, not {tokenizer!r}")
    return GPT2_VOCAB, int(cfg.data.seq_len)


def estimate(experiment: str, devices: int, micro_batch: int | None = None, *extra: str) -> Estimate:
    """One training step's peak per device of ``experiment`` on ``devices`` GPUs at ``micro_batch`` rows per forward
    (default: the shipped config's ``micro_batch_size``, else the global batch over the devices)."""
    cfg = composed(experiment, devices, *extra)
    global_batch = int(cfg.data.batch_size)
    micro = min(micro_batch or cfg.get("micro_batch_size") or global_batch, global_batch // devices)
    accumulation = accumulation_for(global_batch, devices, micro)
    vocab, length = data_shape(cfg)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake, fused_attention():
        module = build(cfg.method, data_vocab_size=vocab, seq_len=length).train()
        teacher_bytes = 0
        if getattr(module, "teacher_path", None):  # fmlm_plus_distill: the frozen MDM its on_fit_start loads
            teacher = _mdm_like(cfg, vocab, length).eval()
            object.__setattr__(module, "_teacher", teacher)
            teacher_bytes = sum(p.numel() * p.element_size() for p in teacher.parameters())
        trainable = [p for p in module.parameters() if p.requires_grad]
        weights = sum(p.numel() * p.element_size() for p in module.parameters())
        grads = sum(p.numel() * 4 for p in trainable)
        buckets = grads if devices > 1 else 0  # DDP's gradient buckets: one more fp32 copy of the gradients
        # across steps: the weights, the EMA's copy of the module (callbacks/ema.py), AdamW's two moments, buckets
        state = teacher_bytes + 2 * weights + 2 * grads + buckets
        optimizer = torch.optim.AdamW(trainable, lr=1e-4, foreach=True)
        batch, draws_for, target_rows = _micro_batch(module, micro, length, vocab, global_batch, "train")
        with LiveBytes() as live:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = module.loss(batch, draws_for()).loss
            loss.backward()
            del loss
            backward_peak, live.peak = live.peak, live.now
            optimizer.step()  # makes AdamW's moments (and its foreach temporaries) beside the gradients
        moments = 2 * grads
        # from the second step on the moments live through the forward and backward; the gradients, freed by
        # zero_grad(set_to_none=True), are made again in backward (held in ``backward_peak``)
        steps_peak = max(backward_peak + moments, live.peak)
        peak = teacher_bytes + 2 * weights + buckets + steps_peak  # + the weights' EMA copy and DDP's buckets
        # validation: each device draws for its share of the global validation batch, then runs the loss in chunks
        # of the micro batch (FlowLMModule.validation_loss; the run config's micro_batch_size, here ``micro``)
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
        val_peak = teacher_bytes + 2 * weights + moments + buckets + val_live.peak
    return Estimate(
        experiment=experiment,
        devices=devices,
        micro_batch=micro,
        accumulation=accumulation,
        seq_len=length,
        params=sum(p.numel() for p in module.parameters()),
        state_gib=state / GIB,
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
