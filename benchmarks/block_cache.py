"""Semi-AR MDM decoding with Fast-dLLM's block KV cache (``cache: none | prefix | dual``): seconds per decode, side by
side in one process, against the FLOP ratio each cache should give, and seconds per NFE in units of one full forward
of the same network on ids (measured in the same run: the figure that travels between machines).

A randomly initialised MDM completes ``--batch`` sequences: a ``--prompt-len`` prompt, ``--answer-len`` positions to
generate in blocks of ``--block``, ``--steps`` steps per block (NFE = blocks × steps for every cache). The network
(``--backbone``): the suite's DiT of ``--size``, or a tiny LLaMA-family MDM (transformers' Llama layers, SMDM's
layout, ``--llama-width`` wide, 4 layers, 4 heads, SwiGLU 8/3 × the width). Repetitions are interleaved (the order
rotates) and the medians compared. The FLOP estimate counts, per layer and computed position, the token-linear work
(2 × the layer's multiply-adds per token: QKV, attention output, MLP) and the attention (4·n·L·d for n queries over
L keys), and the head (2·d·|V| per position): a full pass is n = L; a prefix step n = the block and what follows it;
a dual step n = the block. The block's first step is a full pass either way. Two estimates of the head: at the
block's positions only, every step, whatever the cache (what the decoder reads, and since 2026-12-06 what it runs:
the head in vocabulary chunks at the block's slots, through the cache too), the limit; and at every position a pass
runs (the estimate before 2026-12-06, when the cached passes returned logits over their window), for continuity.
``--before`` adds the cached rows as they ran before 2026-12-06 (the windowed passes' logits over the whole window,
merged into a (B, L, |V|) buffer), side by side in the same run. ``--row-major`` adds the three caches with the
head's weight handed to its chunked product as the network holds it, (|V|, d) row-major, as before 2026-12-06 (night)
(``column_major`` off: each chunk's product then reads the transposed rows), each against its own ``none``.
``--parts`` also times a decode's parts alone in the same process (a full pass to the head's input, each block's
prefix and dual window, the chunked head at the block's rows, medians) and prints the limit they make — the decode's
seconds were each step its parts at their own measured speed, the sampler's work and cache effects left out — beside
the FLOP limit: a limit that sees each product's own rate (a 32-row window's small products and elementwise work).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/block_cache.py                       # the GSM8K shape, tiny DiT
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/block_cache.py --backbone llama --reps 1   # a tiny LLaMA
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/block_cache.py --prompt-len 128 --answer-len 128 --before --reps 1
    .venv/bin/python benchmarks/block_cache.py --prompt-len 32 --answer-len 32 --block 8 --vocab 64 --reps 1  # smoke
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flowlm.backbones.dit import SIZES
from flowlm.samplers import SemiARConfidenceSampler
from flowlm.samplers.block_cache import BlockCachedReader
from lightning_modules.mdm import MDMModule

CACHES = ("none", "prefix", "dual")


class LogitsWindows(SemiARConfidenceSampler):
    """The cached decoder as it ran before 2026-12-06: the windowed passes' logits over the whole window (the head
    at every position a pass runs), merged into a (B, L, |V|) buffer; without cache it reads the head as now."""

    def network(self, model, length):  # noqa: D102
        if self.cache == "none":
            return super().network(model, length)
        reader = BlockCachedReader(model, self.cache, self.refresh, length)
        return reader, reader


class RowMajorHead(SemiARConfidenceSampler):
    """The decoder with the head's weight as the network holds it, (|V|, d) row-major (before 2026-12-06, night)."""

    column_major = False


def flops(
    cache: str,
    *,
    length: int,
    prompt: int,
    block: int,
    steps: int,
    d: int,
    layers: int,
    vocab: int,
    linear: int,
    head_at_block: bool = True,
) -> float:
    """Forward FLOPs of one decode (per sequence) by the estimate in the module docstring; ``linear``: a layer's
    multiply-adds per token; ``head_at_block``: the head at the block's positions only (else at every position run)."""

    def window(n: int) -> float:
        head = min(block, length - start) if head_at_block else n
        return layers * (2 * linear * n + 4 * n * length * d) + 2 * d * vocab * head

    total = 0.0
    for start in range(prompt, length, block):
        total += window(length)  # the block's first step
        n = {"none": length, "prefix": length - start, "dual": min(block, length - start)}[cache]
        total += (steps - 1) * window(n)
    return total


def network(args: argparse.Namespace, length: int) -> tuple[MDMModule, dict]:
    """The random MDM (weights N(0, 0.02²)) and its shape for the FLOP estimate (d, layers, linear)."""
    if args.backbone == "dit":
        size = SIZES[args.size]
        backbone, d, layers = {"size": args.size}, size["d_model"], size["n_layers"]
        linear = 12 * d * d  # QKV 3d², output d², MLP 2 × 4d²
    else:
        d, layers, inner = args.llama_width, 4, 8 * args.llama_width // 3
        backbone = {
            "_target_": "flowlm.backbones.llama.BidirectionalLM",
            **{"hidden_size": d, "n_layers": layers, "n_heads": 4, "intermediate_size": inner},
            **{"embed_rows": args.vocab + 1, "head_rows": args.vocab, "mask_id": args.vocab, "max_positions": length},
        }
        linear = 4 * d * d + 3 * d * inner  # Q, K, V, O; SwiGLU gate, up, down
    torch.manual_seed(0)
    module = MDMModule(data_vocab_size=args.vocab, seq_len=length, backbone=backbone, optim={}).eval()
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return module, {"d": d, "layers": layers, "linear": linear}


def full_forward_seconds(model, prompt: torch.Tensor, reps: int) -> float:
    """The median time of one full forward of the network on ids (B, L), after a warm-up call."""
    t = torch.zeros(prompt.shape[0])
    model.fn(prompt, t)
    times = []
    for _ in range(max(reps, 3)):
        start = time.perf_counter()
        model.fn(prompt, t)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def median_seconds(call, reps: int) -> float:
    """The median seconds of ``call()`` over ``reps`` runs after a warm-up."""
    call()
    times = []
    for _ in range(max(reps, 5)):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def parts_seconds(model, prompt: torch.Tensor, args: argparse.Namespace, decode: dict) -> dict[str, float]:
    """Each cache's decode timed as the sum of its parts, each alone (``--parts``): a full pass, the windows at each
    block's start, the chunked head at the block's rows (as the decoders hand it the weight), and the parts' medians."""
    from flowlm.ops.summary import chunked_head_summary

    length, first, block, steps = decode["length"], decode["prompt"], decode["block"], decode["steps"]
    read = model.windowed(length, head=True)
    t = torch.zeros(prompt.shape[0])
    x = prompt.clone()
    x[:, first:] = model.mask_id
    features, weight, bias = read(x, t, 0, None)
    weight = weight.t().contiguous().t()  # as ``column_major_head`` hands it
    rows = features[:, first : first + block].reshape(-1, features.shape[-1])
    reps = 2 * args.reps + 3
    full, head = (
        median_seconds(lambda: read(x, t, 0, None), reps),
        median_seconds(lambda: chunked_head_summary(rows, weight, bias), reps),
    )
    flat = features.reshape(-1, features.shape[-1])
    every = median_seconds(lambda: chunked_head_summary(flat, weight, bias), 3)  # the head at every position
    total = {"none": 0.0, "prefix": 0.0, "dual": 0.0}
    parts = {"full pass": full, "head at the block": head, "head at every position": every}
    for start in range(first, length, block):
        stop = min(start + block, length)
        window = {
            "none": full,
            "prefix": median_seconds(lambda lo=start: read(x[:, lo:], t, lo, None), reps),
            "dual": median_seconds(lambda lo=start, hi=stop: read(x[:, lo:hi], t, lo, None), reps),
        }
        for c in total:
            total[c] += full + head + (steps - 1) * (window[c] + head)
        if start == first:
            parts |= {f"prefix window at {start}": window["prefix"], f"dual window at {start}": window["dual"]}
    return total | {"parts": parts}


def main() -> None:
    """Time the three caches, print the medians, their ratios and the FLOP ratios."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--answer-len", type=int, default=256)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--steps", type=int, default=8, help="steps per block")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--backbone", choices=("dit", "llama"), default="dit")
    ap.add_argument("--size", default="tiny", help="the DiT's size")
    ap.add_argument("--llama-width", type=int, default=128, help="the tiny LLaMA's hidden size")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--before", action="store_true", help="add the cached rows as they ran before 2026-12-06")
    ap.add_argument("--row-major", action="store_true", help="add the caches with the head's weight row-major")
    ap.add_argument("--parts", action="store_true", help="also the limit made of the decode's parts timed alone")
    args = ap.parse_args()
    length = args.prompt_len + args.answer_len
    module, shape = network(args, length)
    model = module.denoiser()
    prompt = torch.randint(0, args.vocab, (args.batch, length))
    mask = (torch.arange(length) < args.prompt_len).expand(args.batch, -1)
    nfe = args.steps * -(-args.answer_len // args.block)
    samplers = {c: SemiARConfidenceSampler(block_length=args.block, cache=c) for c in CACHES}
    if args.before:
        samplers |= {f"{c} (before)": LogitsWindows(block_length=args.block, cache=c) for c in CACHES[1:]}
    if args.row_major:
        samplers |= {f"{c} (row-major)": RowMajorHead(block_length=args.block, cache=c) for c in CACHES}
    rows = list(samplers)
    times: dict[str, list[float]] = {c: [] for c in rows}
    with torch.no_grad():
        full = full_forward_seconds(model, prompt, args.reps)
        for rep in range(args.reps):
            turn = rep % len(rows)
            for c in rows[turn:] + rows[:turn]:
                start = time.perf_counter()
                out = samplers[c](model, prompt=prompt, prompt_mask=mask, nfe=nfe, generator=None)
                times[c].append(time.perf_counter() - start)
                assert out.nfe == nfe
    decode = {"length": length, "prompt": args.prompt_len, "block": args.block, "steps": args.steps}
    if args.parts:
        with torch.no_grad():
            parts = parts_seconds(model, prompt, args, decode)
    work = {c: flops(c, **decode, **shape, vocab=args.vocab) for c in CACHES}
    old = {c: flops(c, **decode, **shape, vocab=args.vocab, head_at_block=False) for c in CACHES}

    def base(row: str) -> float:  # the row's own none: "none (row-major)" for the row-major rows
        own = "none" + row[len(row.split()[0]) :]
        return statistics.median(times[own if own in times else "none"])

    setting = f"prompt {args.prompt_len} + answer {args.answer_len}, blocks of {args.block}, {args.steps} steps each"
    threads = torch.get_num_threads()
    net = f"{args.size} DiT" if args.backbone == "dit" else f"tiny LLaMA (d {shape['d']}, {shape['layers']} layers)"
    print(f"{net}, |V| {args.vocab}, {setting} (NFE {nfe}), batch {args.batch}, {threads} threads")
    print(f"one full forward on ids: {full:.4f} s")
    print(
        "| cache | s / decode (median) | s / NFE ÷ full forward | speed-up | FLOP ratio (limit) | speed-up / limit "
        "| FLOP ratio, head at every position run | speed-up / it |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for c in rows:
        med, kind = statistics.median(times[c]), c.split()[0]
        limit, was = work["none"] / work[kind], old["none"] / old[kind]
        gain = base(c) / med
        cells = f"{med:.3f} | {med / nfe / full:.2f} | {gain:.2f}× | {limit:.2f}× | {gain / limit:.2f}"
        print(f"| {c} | {cells} | {was:.2f}× | {gain / was:.2f} |")
    if args.parts:
        alone = ", ".join(f"{name} {seconds * 1e3:.2f} ms" for name, seconds in parts["parts"].items())
        print(f"the parts alone (medians): {alone}")
        b, d, first = args.batch, shape["d"], args.prompt_len
        layers = {n: b * shape["layers"] * (2 * shape["linear"] * n + 4 * n * length * d) for n in (length, args.block)}
        head_rows = {"head at the block": b * args.block, "head at every position": b * length}
        rates = {"full pass's layers": layers[length] / parts["parts"]["full pass"]}
        rates[f"dual window's layers ({args.block} positions)"] = (
            layers[args.block] / parts["parts"][f"dual window at {first}"]
        )
        rates |= {f"{name} ({n} rows)": 2 * d * args.vocab * n / parts["parts"][name] for name, n in head_rows.items()}
        print("GFLOP/s: " + ", ".join(f"{name} {rate / 1e9:.1f}" for name, rate in rates.items()))
        print("| cache | s / decode, its parts summed | parts limit | speed-up / parts limit | FLOP limit |")
        print("|---|---|---|---|---|")
        for c in CACHES:
            limit = parts["none"] / parts[c]
            gain = base(c) / statistics.median(times[c])
            print(f"| {c} | {parts[c]:.3f} | {limit:.2f}× | {gain / limit:.2f} | {work['none'] / work[c]:.2f}× |")


if __name__ == "__main__":
    main()
