"""Semi-AR MDM decoding with Fast-dLLM's block KV cache (``cache: none | prefix | dual``): seconds per decode, side by
side in one process, against the FLOP ratio each cache should give.

A randomly initialised MDM (the suite's DiT, GPT-2's vocabulary by default) completes ``--batch`` sequences: a
``--prompt-len`` prompt, ``--answer-len`` positions to generate in blocks of ``--block``, ``--steps`` steps per block
(NFE = blocks × steps for every cache). Repetitions are interleaved (the order rotates) and the medians compared.
The FLOP estimate counts, per layer, the token-linear work (QKV, attention output, MLP: 12·d² per token) and the
attention (2·n·L·d for n queries over L keys), and the head (2·d·|V| per position): a full pass is n = L; a prefix
step n = the block and what follows it; a dual step n = the block. The block's first step is a full pass either way.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/block_cache.py                       # the GSM8K shape, tiny
    .venv/bin/python benchmarks/block_cache.py --prompt-len 32 --answer-len 32 --block 8 --vocab 64 --reps 1  # smoke
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flowlm.backbones.dit import SIZES
from flowlm.samplers import SemiARConfidenceSampler
from lightning_modules.mdm import MDMModule

CACHES = ("none", "prefix", "dual")


def flops(cache: str, *, length: int, prompt: int, block: int, steps: int, d: int, layers: int, vocab: int) -> float:
    """Forward FLOPs of one decode (per sequence) by the estimate in the module docstring."""

    def window(n: int) -> float:
        return layers * (12 * d * d * n + 4 * n * length * d) + 2 * d * vocab * n

    total = 0.0
    for start in range(prompt, length, block):
        total += window(length)  # the block's first step
        n = {"none": length, "prefix": length - start, "dual": min(block, length - start)}[cache]
        total += (steps - 1) * window(n)
    return total


def main() -> None:
    """Time the three caches, print the medians, their ratios and the FLOP ratios."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--answer-len", type=int, default=256)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--steps", type=int, default=8, help="steps per block")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    length = args.prompt_len + args.answer_len
    torch.manual_seed(0)
    module = MDMModule(data_vocab_size=args.vocab, seq_len=length, backbone={"size": args.size}, optim={}).eval()
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.02)
    model = module.denoiser()
    prompt = torch.randint(0, args.vocab, (args.batch, length))
    mask = (torch.arange(length) < args.prompt_len).expand(args.batch, -1)
    nfe = args.steps * -(-args.answer_len // args.block)
    samplers = {c: SemiARConfidenceSampler(block_length=args.block, cache=c) for c in CACHES}
    times: dict[str, list[float]] = {c: [] for c in CACHES}
    with torch.no_grad():
        for rep in range(args.reps):
            for c in CACHES[rep % 3 :] + CACHES[: rep % 3]:
                start = time.perf_counter()
                out = samplers[c](model, prompt=prompt, prompt_mask=mask, nfe=nfe, generator=None)
                times[c].append(time.perf_counter() - start)
                assert out.nfe == nfe
    size = SIZES[args.size]
    shape = {"length": length, "prompt": args.prompt_len, "block": args.block, "steps": args.steps}
    work = {c: flops(c, **shape, d=size["d_model"], layers=size["n_layers"], vocab=args.vocab) for c in CACHES}
    base = statistics.median(times["none"])
    setting = f"prompt {args.prompt_len} + answer {args.answer_len}, blocks of {args.block}, {args.steps} steps each"
    threads = torch.get_num_threads()
    print(f"{args.size} DiT, |V| {args.vocab}, {setting} (NFE {nfe}), batch {args.batch}, {threads} threads")
    print("| cache | s / decode (median) | speed-up | FLOP ratio (the limit) | speed-up / limit |")
    print("|---|---|---|---|---|")
    for c in CACHES:
        med = statistics.median(times[c])
        limit = work["none"] / work[c]
        print(f"| {c} | {med:.3f} | {base / med:.2f}× | {limit:.2f}× | {base / med / limit:.2f} |")


if __name__ == "__main__":
    main()
