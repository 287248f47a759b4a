"""Shared pieces of the benchmark scripts: train experiment configs per seed, tabulate mean ± std over seeds."""

from __future__ import annotations

import argparse
import statistics
import time

from hydra import compose, initialize_config_dir
from probes import clock, elapsed, matmul_flops, median, now, peak_memory, sync  # noqa: F401 - importable here too

from flowlm.project import CONF_DIR
from runners.train import train


def train_models(models: list[tuple[str, str, list[str]]], seeds: list[int], common: list[str]):
    """Train (or resume) every (label, experiment, extra overrides) per seed; evaluation rows tagged with the
    label and seed, and the minutes each run took (training + evaluation)."""
    rows, minutes = [], {}
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        for seed in seeds:
            for label, experiment, extra in models:
                start = time.perf_counter()
                cfg = compose("train", overrides=[f"experiment={experiment}", f"seed={seed}", *common, *extra])
                result = train(cfg)
                minutes.setdefault(label, []).append((time.perf_counter() - start) / 60)
                rows += [{**r, "model": label, "seed": seed} for r in result["rows"]]
    return rows, minutes


def seed_table(rows: list[dict], budgets: list[int], metric: str) -> tuple[list[str], dict]:
    """Markdown lines, one per (model, sampler), cells mean ± std over seeds (the mean alone for one seed), and the
    means keyed by (model, sampler, budget)."""
    keys = list(dict.fromkeys((r["model"], r["sampler"]) for r in rows))
    cell = {}
    lines = [
        "| model | sampler | " + " | ".join(f"NFE {b}" for b in budgets) + " |",
        "|---|---|" + "---|" * len(budgets),
    ]
    for model, sampler in keys:
        out = []
        for b in budgets:
            vals = [r[metric] for r in rows if (r["model"], r["sampler"], r["nfe_budget"]) == (model, sampler, b)]
            if not vals:
                out.append("")
                continue
            mean = statistics.fmean(vals)
            cell[model, sampler, b] = mean
            out.append(f"{mean:.1f} ± {statistics.stdev(vals):.1f}" if len(vals) > 1 else f"{mean:.1f}")
        lines.append(f"| {model} | {sampler} | " + " | ".join(out) + " |")
    return lines, cell


def minutes_line(minutes: dict[str, list[float]]) -> str:
    """Mean minutes per training run of each model."""
    return "Minutes per training run (incl. evaluation): " + ", ".join(
        f"{k} {statistics.fmean(v):.1f}" for k, v in minutes.items()
    )


# ------------------------------------------------------------------------------------------------------------------
# Performance benchmarks (throughput.py, sampler_overhead.py, gpu_check.py): untrained modules built from
# conf/method + conf/backbone, synthetic batches, autocast as the trainer applies it, their command line; the
# timers, peak memory and FLOP counts are probes.py's.

PRECISIONS = ("bf16-mixed", "32-true")


def load_group_config(group: str, name: str):
    """conf/<group>/<name>.yaml with its (same-group) defaults list merged in, as Hydra composes it."""
    from pathlib import Path

    from omegaconf import OmegaConf

    node = OmegaConf.load(Path(CONF_DIR) / group / f"{name}.yaml")
    defaults = node.pop("defaults", [])
    merged = OmegaConf.create()
    for entry in defaults:
        if not isinstance(entry, str):  # another group's choice (a method's `override /family...`): not this node
            continue
        merged = OmegaConf.merge(merged, node if entry == "_self_" else load_group_config(group, entry))
    return merged if "_self_" in defaults else OmegaConf.merge(merged, node)


def build_module(method: str, *, backbone: str, vocab: int, seq_len: int, seed: int = 0, **overrides):
    """The suite's LightningModule of conf/method/<method>.yaml on conf/backbone/<backbone>.yaml, untrained.

    Weights do not matter for cost; a module that adapts a checkpoint (MLFM) is left on its random base (its
    ``init_from`` is a placeholder and the copy at fit start is skipped)."""
    from omegaconf import OmegaConf

    from runners.common import build

    cfg = OmegaConf.create(
        {
            "seed": seed,
            "backbone": load_group_config("backbone", backbone),
            "method": load_group_config("method", method),
        }
    )
    for key, value in overrides.items():
        OmegaConf.update(cfg, f"method.{key}", value, force_add=True)
    if method == "mlfm":
        cfg.method.init_from = "<benchmark: random weights>"
    module = build(cfg.method, data_vocab_size=vocab, seq_len=seq_len)
    if method == "mlfm":
        module.init_report = {"copied": [], "sliced": [], "fresh": []}  # skips the MDM copy in on_fit_start
    return module


def randomise_zero_init(module, std: float = 0.05, seed: int = 0) -> None:
    """Give the zero-initialised layers (adaLN, output head, LoRA B) small random weights, so an untrained model's
    outputs are not exactly uniform (samplers then take their ordinary paths: ties, thresholds, promotions)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            if param.is_floating_point() and not param.any():
                param.copy_(torch.randn(param.shape, generator=gen) * std)


def synthetic_batch(batch: int, seq_len: int, vocab: int, *, prompt_len: int = 0, device="cpu", seed: int = 0):
    """Uniform random tokens (B, L) with the first ``prompt_len`` positions as prompt: a training batch dict."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq_len), generator=gen)
    prompt_mask = torch.zeros(batch, seq_len, dtype=torch.bool)
    prompt_mask[:, :prompt_len] = True
    return {"tokens": tokens.to(device), "prompt_mask": prompt_mask.to(device)}


# On a CPU without bf16 kernels, bf16 autocast's matrix products by float32 BLAS (flowlm/ops/bf16_products.py), as the
# runs compute them; benchmarks/cpu_bf16.py turns it off for its row of torch's own bf16 loop.
BF16_RULE = True


def autocast(precision: str, device):
    """The forward context Lightning's precision plugin applies: bf16 autocast for bf16-mixed (its products by
    float32 BLAS on a CPU without bf16 kernels, ``BF16_RULE``), nothing for fp32."""
    import contextlib

    import torch

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "bf16-mixed":
        kind = torch.device(device).type
        if kind == "cpu" and BF16_RULE:  # as a run computes (runners.common.cpu_choices)
            from flowlm.ops.bf16_products import bf16_products_in_float32, native_bf16_kernels

            if not native_bf16_kernels():
                stack = contextlib.ExitStack()
                stack.enter_context(torch.autocast(kind, dtype=torch.bfloat16))
                stack.enter_context(bf16_products_in_float32())
                return stack
        return torch.autocast(kind, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def matmul_params(module, *, dense_input: bool, per_token_times: bool) -> int:
    """Weights of the matmuls a forward pass applies to every token: block and head Linears (LoRA included), the
    input projection x·E when the input is a vector over the vocabulary (flow models; a lookup costs no FLOPs),
    and the time MLPs / adaLN modulations only when times are per token (per-sequence times run them once per
    sequence)."""
    import torch

    time_keys = ("emb_s.", "emb_t.", "time_embed.", "adaLN_modulation", "block_mods.", "final_mod.")
    total = 0
    for name, sub in module.named_modules():
        if isinstance(sub, torch.nn.Linear):
            if any(key in name + "." for key in time_keys) and not per_token_times:
                continue
            total += sub.weight.numel()
        elif isinstance(sub, torch.nn.Embedding) and dense_input:
            total += sub.weight.numel()
    return total


def train_flops_per_token(module, *, seq_len: int, dense_input: bool, per_token_times: bool) -> float:
    """Model FLOPs of one training token (forward + backward): 6·N + 12·n_layers·L·d (PaLM's formula; N from
    ``matmul_params``; the attention term counts QKᵀ and AV over the full, non-causal L)."""
    net = module.net.base if hasattr(module.net, "base") else module.net
    n = matmul_params(module.net, dense_input=dense_input, per_token_times=per_token_times)
    return 6.0 * n + 12.0 * len(net.blocks) * seq_len * net.d_model


def add_model_args(ap, *, batch: int) -> None:
    """The options every model benchmark shares: backbone, batch shape (default: the CPU demo's 6×6 Sudoku, 36 cells,
    6 digits), repetitions, precision, device, seed."""
    ap.add_argument("--backbone", default="tiny", help="conf/backbone/<name>.yaml: tiny, mini, small")
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--seq-len", type=int, default=36)
    ap.add_argument("--vocab", type=int, default=6, help="data vocabulary (MDM/MLFM add [MASK])")
    ap.add_argument("--prompt-len", type=int, default=0, help="leading prompt positions (never noised)")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions (medians are compared)")
    ap.add_argument(
        "--precision", default="auto", choices=("auto", *PRECISIONS), help="auto: the trainer's (resolve_precision)"
    )
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    ap.add_argument("--seed", type=int, default=0)


def resolve_precision(args) -> None:
    """``--precision auto`` → what the trainer would run: bf16-mixed on a GPU; on a CPU ``cpu_precision`` (bf16-mixed
    only where the CPU has bf16 kernels; emulated bf16 would time the emulation, not the model)."""
    import torch

    from runners.resolvers import cpu_precision

    if args.precision == "auto":
        args.precision = "bf16-mixed" if torch.device(args.device).type == "cuda" else cpu_precision()


def require_device(script: str, device: str) -> None:
    """Stop with a clear message when a CUDA device is asked for and none is visible."""
    import torch

    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"{script}: --device cuda but no CUDA device is available")


def model_parser(description: str | None, *, batch: int) -> argparse.ArgumentParser:
    """A parser with the options every model benchmark shares (``add_model_args``), the script's docstring as its
    description."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, batch=batch)
    return ap


def parse_model_args(ap: argparse.ArgumentParser, script: str) -> argparse.Namespace:
    """The command line parsed; a missing CUDA device stops ``script``; ``--precision auto`` resolved."""
    args = ap.parse_args()
    require_device(script, args.device)
    resolve_precision(args)
    return args
