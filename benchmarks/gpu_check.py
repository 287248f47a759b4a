"""GPU performance check (issue 8), under 10 minutes on one H100/H200: host syncs per training step, training
tokens/s and model FLOPs utilisation of the `small` backbone with and without ``torch.compile`` (bf16 autocast),
Lightning vs bare loop, the attention soft-cap's fused FlexAttention path against the written-out form and uncapped
SDPA, and the sampler-overhead ratios, on the GPU.

    bash benchmarks/gpu_check.sh                       # what to run on a GPU machine (checks CUDA, then this)
    .venv/bin/python benchmarks/gpu_check.py --peak-tflops 165   # a card not in the table below
    .venv/bin/python benchmarks/gpu_check.py --dry-run           # CPU, tiny sizes: exercises every path here

MFU = tokens/s × FLOPs per token / peak, with FLOPs per training token = 6·N + 12·n_layers·L·d: N = the weights of
the matmuls applied to every token (block qkv/out/MLP Linears and the output head; MDM reads ids, so the input
embedding is a lookup without FLOPs, and its time-agnostic adaLN runs once per sequence), 12·n_layers·L·d the
attention scores and weighted sum (QKᵀ and AV, 2·2·L·d per token and layer forward, ×3 with the backward; full
non-causal L). Peak = the card's dense bf16 tensor throughput: H100 SXM and H200 989 TFLOP/s, A100 312; any other
card needs ``--peak-tflops``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}  # dense bf16, SXM parts (H100 PCIe: 756 via the flag)


class Figures:
    """The check's log lines and each section's figures, written whole to ``path`` (``--json``) after every line and
    every section, atomically (a temporary file renamed over it): a run stopped by its timeout, a crash or Ctrl-C
    keeps every figure measured so far, its ``status`` saying ``running``, ``stopped: ...`` or ``done``."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.lines: list[str] = []
        self.figures: dict = {}
        self.sections: list[str] = []  # the sections finished, in order
        self.status = "running"
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.write()  # an unwritable path fails now, not after ten minutes of measuring

    def log(self, line: str) -> None:
        """Print ``line`` and keep it (written at once: a section's lines come before its figures)."""
        print(line, flush=True)
        self.lines.append(line)
        self.write()

    def set(self, **figures) -> None:
        """Record figures that are not a section (the device, its peak)."""
        self.figures.update(figures)
        self.write()

    def section(self, name: str, figures: dict) -> None:
        """Record a finished section's figures and write them."""
        self.figures[name] = figures
        self.sections.append(name)
        self.write()

    def finish(self, status: str) -> None:
        """The run's end: ``done``, or ``stopped: <why>`` (figures of unfinished sections are absent)."""
        self.status = status
        self.write()

    def write(self) -> None:
        if self.path is None:
            return
        record = {"status": self.status, "sections_done": self.sections, "lines": self.lines, **self.figures}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1, default=str))
        os.replace(tmp, self.path)  # a reader (or a kill mid-write) never sees half a file


def stop_on_sigterm(signum, frame) -> None:
    """SIGTERM (gpu_check.sh's `timeout 600`) as an exception, so that the figures file says where it stopped."""
    raise SystemExit(128 + signum)


def fail(message: str) -> None:
    """Stop with a clear message and a non-zero status."""
    print(f"gpu_check: {message}", file=sys.stderr)
    raise SystemExit(2)


def peak_tflops(name: str, override: float | None) -> float | None:
    """The card's bf16 dense peak: ``--peak-tflops`` if given, else from the device name (None if unknown)."""
    if override:
        return override
    for key, value in PEAK_TFLOPS.items():
        if key in name.upper():
            if key == "H100" and "PCIE" in name.upper():
                return None  # 756 TFLOP/s dense: a different part; ask rather than overstate the MFU
            return value
    return None


def sdpa_report(head_dim: int, device: torch.device) -> str:
    """Which SDPA kernels are enabled, and whether the flash kernel runs for this head size in bf16."""
    if device.type != "cuda":
        return "SDPA: CPU (the DiT pins the math kernel on CPU); flash check n/a"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    enabled = {
        "flash": torch.backends.cuda.flash_sdp_enabled(),
        "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
        "math": torch.backends.cuda.math_sdp_enabled(),
    }
    q = torch.randn(2, 4, 128, head_dim, device=device, dtype=torch.bfloat16)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q, q, q)
        flash = f"flash kernel runs for head_dim {head_dim} in bf16"
    except RuntimeError as err:
        flash = f"flash kernel NOT usable for head_dim {head_dim} in bf16 ({str(err).splitlines()[0][:120]})"
    return f"SDPA enabled backends {enabled}; {flash}"


def train_section(args, device, peak, log, deadline) -> dict:
    """MDM training tokens/s and MFU in the bare loop, eager then compiled; then Lightning vs bare for the methods."""
    import throughput as T
    from common import build_module, synthetic_batch, train_flops_per_token

    out: dict = {}
    batches = [synthetic_batch(args.batch, args.seq_len, args.vocab, device=device, seed=k) for k in range(4)]
    tokens = args.batch * args.seq_len
    for compiled in (False, True) if not args.no_compile else (False,):
        if time.monotonic() > deadline:
            log("training: time budget spent, compiled run skipped")
            break
        module = build_module("mdm", backbone=args.backbone, vocab=args.vocab, seq_len=args.seq_len).to(device)
        module.optim_cfg["warmup_steps"] = 1
        flops = train_flops_per_token(module, seq_len=args.seq_len, dense_input=False, per_token_times=False)
        label = "compiled" if compiled else "eager"
        if compiled:
            try:
                module.net = torch.compile(module.net)
            except Exception as err:  # noqa: BLE001 — any failure means: report it and keep the eager figures
                log(f"torch.compile unavailable: {type(err).__name__}: {err}")
                break
        loss = T.loss_function("mdm", module)
        kw = {"steps": args.steps, "warmup": args.warmup, "precision": args.precision, "device": device}
        start = time.monotonic()
        try:
            T.run_bare(module, loss, batches, **kw)  # the first run compiles (and warms the allocator)
            runs = [T.run_bare(module, loss, batches, **kw)[0] for _ in range(args.reps)]
        except Exception as err:  # noqa: BLE001 — e.g. no C++/Triton toolchain for inductor
            log(f"{label}: failed ({type(err).__name__}: {str(err).splitlines()[0][:200]})")
            continue
        sec = sorted(runs)[len(runs) // 2]
        tok_s = tokens / sec
        mfu = tok_s * flops / (peak * 1e12) if peak else None
        out[label] = {"tokens_per_s": tok_s, "step_s": sec, "flops_per_token": flops, "mfu": mfu}
        mfu_text = f"MFU {100 * mfu:.1f} %" if mfu is not None else "MFU n/a (no peak)"
        log(
            f"train mdm {label}: {tok_s:,.0f} tokens/s ({1e3 * sec:.1f} ms/step), {flops / 1e9:.3f} GFLOP/token, "
            f"{mfu_text} [{time.monotonic() - start:.0f} s incl. warm-up/compile]"
        )
        del module
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "eager" in out and "compiled" in out:
        log(
            f"ratio compiled/eager tokens/s [mdm]: {out['compiled']['tokens_per_s'] / out['eager']['tokens_per_s']:.3f}"
        )
    if time.monotonic() < deadline:
        targs = T.parser().parse_args(
            [
                *("--backbone", args.backbone, "--batch", str(args.batch), "--seq-len", str(args.seq_len)),
                *("--vocab", str(args.vocab), "--steps", str(args.steps), "--warmup", str(args.warmup)),
                *("--reps", str(args.reps), "--precision", args.precision, "--device", str(device)),
                *("--methods", *args.methods, *(["fmlm_plus_compiled"] if "fmlm_plus" in args.methods else [])),
            ]
        )
        out["lightning_vs_bare"] = T.measure(targs, log=log)  # FMLM+ also with method.compile_tails
    else:
        log("training: time budget spent, Lightning-vs-bare comparison skipped")
    return out


def softcap_section(args, device, log) -> dict:
    """The released DiT's attention soft-cap (50): the fused FlexAttention path the DiT takes on CUDA against the
    written-out form (largest difference in bf16) and their forward + backward times, beside uncapped SDPA flash."""
    from flowlm.backbones.dit import SIZES, flex_capped_attention, written_capped_attention

    if device.type != "cuda":
        log("attention soft-cap: the FlexAttention path is CUDA-only (tests/integration/test_protocol.py: on the CPU)")
        return {}
    size = SIZES[args.backbone]
    heads, head_dim = size["n_heads"], size["d_model"] // size["n_heads"]
    shape = (args.batch, heads, args.seq_len, head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    forms = {
        "flex": lambda: flex_capped_attention(q, k, v, cap=50.0, is_causal=False),
        "written": lambda: written_capped_attention(q, k, v, cap=50.0, dropout_p=0.0, is_causal=False, attn_mask=None),
        "sdpa_uncapped": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
    }
    out: dict = {}
    try:
        diff = (forms["flex"]().float() - forms["written"]().float()).abs().max().item()
    except Exception as err:  # noqa: BLE001 — report and keep the other figures
        log(f"attention soft-cap: flex path failed ({type(err).__name__}: {str(err).splitlines()[0][:200]})")
        return out
    for name, form in forms.items():
        for _ in range(3):  # warm-up (and compilation of the flex kernel)
            form().sum().backward()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.reps * 5):
            form().sum().backward()
        torch.cuda.synchronize()
        out[name] = (time.perf_counter() - start) / (args.reps * 5)
    out["max_abs_diff"] = diff
    log(
        f"attention soft-cap at {shape} bf16: flex vs written max |diff| {diff:.2e}; forward+backward ms: "
        + ", ".join(f"{k} {1e3 * out[k]:.2f}" for k in forms)
        + f"; flex / uncapped SDPA {out['flex'] / out['sdpa_uncapped']:.2f}"
    )
    return out


def sampler_section(args, device, log) -> dict:
    """The sampler-overhead ratios on this device."""
    import sampler_overhead as S

    sargs = S.parser().parse_args(
        [
            *("--backbone", args.backbone, "--batch", str(args.sampler_batch), "--seq-len", str(args.seq_len)),
            *("--vocab", str(args.vocab), "--nfe", str(args.sampler_nfe), "--reps", str(args.reps)),
            *("--precision", args.precision, "--device", str(device), "--memory"),
        ]
    )
    return S.measure(sargs, log=log)


def sync_section(args, device, log) -> dict:
    """Host syncs per training step (the module's loss with its draws, backward, clipping, AdamW) of each method,
    counted by CUDA's sync debug mode over 3 steps after a warm-up one; on a CPU,
    tests/samplers/test_host_syncs.py counts the ops that would sync (Lightning's loop and callbacks included)."""
    if device.type != "cuda":
        log("host syncs per training step: counted on CUDA only (on a CPU: tests/samplers/test_host_syncs.py)")
        return {}
    from common import build_module, synthetic_batch

    out = {}
    for method in args.methods:
        module = build_module(method, backbone=args.backbone, vocab=args.vocab, seq_len=args.seq_len).to(device)
        batch = synthetic_batch(args.batch, args.seq_len, args.vocab, prompt_len=args.seq_len // 8, device=device)
        syncs = count_step_syncs(method, module, batch, steps=3)
        out[method] = len(syncs) / 3
        log(f"host syncs per training step [{method}]: {len(syncs) / 3:g}" + (f" ({syncs[0][:100]})" if syncs else ""))
        del module
        torch.cuda.empty_cache()
    return out


def count_step_syncs(method: str, module, batch: dict, *, steps: int) -> list[str]:
    """The sync warnings of ``steps`` bf16 training steps (after one untimed), as CUDA's debug mode reports them."""
    import warnings

    from throughput import loss_function

    loss_of = loss_function(method, module)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params)

    def step(i: int) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_of(batch, i)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(0)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for i in range(1, steps + 1):
                step(i)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message).lower()]


def parser() -> argparse.ArgumentParser:
    """Command-line options; ``--dry-run`` swaps in CPU-sized values."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backbone", default="small")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50258, help="GPT-2's vocabulary + [PAD] (OWT, TinyGSM)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--methods", nargs="+", default=["mdm", "fmlm_plus", "mlfm"])
    ap.add_argument("--precision", default="bf16-mixed")
    ap.add_argument("--sampler-batch", type=int, default=16)
    ap.add_argument("--sampler-nfe", type=int, default=16)
    ap.add_argument("--peak-tflops", type=float, default=None, help="the card's dense bf16 peak, if not in the table")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile run")
    ap.add_argument("--budget-s", type=float, default=540, help="skip later sections once this much time is spent")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here, after every line and section")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny backbone and sizes: check the paths, not the GPU")
    return ap


def main() -> None:
    """Check the device, then measure training and sampling; print figures and a README line."""
    args = parser().parse_args()
    if args.dry_run:
        args.device, args.backbone, args.batch, args.seq_len, args.vocab = "cpu", "tiny", 2, 16, 32
        args.steps, args.warmup, args.reps, args.sampler_batch, args.sampler_nfe = 4, 1, 1, 2, 4
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        fail(
            "no CUDA device is visible to torch (torch.cuda.is_available() is False); run on a GPU machine with a "
            "CUDA build of torch (README), or pass --dry-run for the CPU smoke mode"
        )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    peak = peak_tflops(name, args.peak_tflops)
    if device.type == "cuda" and peak is None:
        fail(f"unknown peak bf16 throughput for {name!r}; pass --peak-tflops (dense bf16 TFLOP/s of this card)")
    start = time.monotonic()
    deadline = start + args.budget_s
    out = Figures(args.json)
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        run_sections(args, device, name, peak, out, deadline)
    except BaseException as err:
        why = f"exit {err.code} (SIGTERM: 143)" if isinstance(err, SystemExit) else f"{type(err).__name__}: {err}"[:200]
        out.finish(f"stopped: {why} after {time.monotonic() - start:.0f} s; sections done: {', '.join(out.sections)}")
        raise
    out.log(f"# gpu_check done in {time.monotonic() - start:.0f} s")
    out.finish("done")


def run_sections(args, device: torch.device, name: str, peak: float | None, out: Figures, deadline: float) -> None:
    """The check's sections in order, each one's figures written as it finishes (``Figures``)."""
    log = out.log
    from common import build_module
    from throughput import quiet_lightning

    from runners.common import use_tf32

    quiet_lightning()
    use_tf32(device.type, True)  # as every run on CUDA: fp32 leftovers (optimizer, norms) on tensor cores
    probe = build_module("mdm", backbone=args.backbone, vocab=args.vocab, seq_len=args.seq_len).net
    version = f"torch {torch.__version__}" + (f", CUDA {torch.version.cuda}" if device.type == "cuda" else "")
    log(
        f"# gpu_check {datetime.date.today()} on {name} ({version}); peak bf16 "
        f"{f'{peak:g} TFLOP/s' if peak else 'n/a'}; backbone {args.backbone} (d {probe.d_model} × "
        f"{len(probe.blocks)} blocks, {sum(p.numel() for p in probe.parameters()) / 1e6:.1f}M parameters at vocab "
        f"{args.vocab}), batch {args.batch} × seq {args.seq_len}, {args.precision}"
        + (" (dry run)" if args.dry_run else "")
    )
    log(sdpa_report(probe.d_model // probe.blocks[0].n_heads, device))
    del probe
    out.set(device=name, peak_tflops=peak)
    out.section("syncs", sync_section(args, device, log))
    out.section("train", train_section(args, device, peak, log, deadline))
    out.section("softcap", softcap_section(args, device, log))
    if time.monotonic() < deadline:
        out.section("samplers", sampler_section(args, device, log))
    else:
        log("samplers: time budget spent, sampler-overhead ratios skipped")


if __name__ == "__main__":
    main()
