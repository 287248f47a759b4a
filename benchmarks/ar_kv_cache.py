"""KV-cached vs full-forward decoding in the AR baseline sampler: seconds per batch of L-token samples.

A randomly initialised AR model (the shared DiT, causal) generates ``--batch`` sequences of ``--seq-len`` tokens
after a ``--prompt-len`` prompt, greedily, once through the KV cache and once with one full forward per token
(``kv_cache: false``); repetitions are interleaved (the order alternates) and the medians are compared.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/ar_kv_cache.py --seq-len 256 --reps 3
    .venv/bin/python benchmarks/ar_kv_cache.py --seq-len 64 --reps 1 --vocab 64   # a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flowlm.samplers.autoregressive import AutoregressiveSampler
from lightning_modules.ar import ARModule


def main() -> None:
    """Time both decoders, print the medians and their ratio."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=0)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=50257, help="data vocabulary (GPT-2's by default, as OWT)")
    ap.add_argument("--size", default="tiny", help="backbone size (tiny/mini/small)")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    module = ARModule(data_vocab_size=args.vocab, seq_len=args.seq_len, backbone={"size": args.size}, optim={}).eval()
    for p in module.parameters():  # leave the zero-initialised output behind, so greedy tokens vary
        torch.nn.init.normal_(p, std=0.02)
    model = module.denoiser()
    prompt = torch.randint(0, args.vocab, (args.batch, args.seq_len))
    mask = (torch.arange(args.seq_len) < args.prompt_len).expand(args.batch, -1)
    samplers = {name: AutoregressiveSampler(temperature=0.0, kv_cache=name == "cached") for name in ("cached", "full")}
    seconds: dict[str, list[float]] = {name: [] for name in samplers}
    tokens = {}
    for rep in range(args.reps):
        for name in samplers if rep % 2 == 0 else reversed(samplers):
            start = time.perf_counter()
            out = samplers[name](model, prompt=prompt, prompt_mask=mask, nfe=args.seq_len, generator=None)
            seconds[name].append(time.perf_counter() - start)
            tokens[name] = out.tokens
    cached, full = statistics.median(seconds["cached"]), statistics.median(seconds["full"])
    print(
        f"AR decoding, {args.size} DiT, |V| = {args.vocab}, batch {args.batch}, L = {args.seq_len} "
        f"(prompt {args.prompt_len}), {torch.get_num_threads()} threads, {args.reps} interleaved reps"
    )
    print(f"full forward per token: {full:.2f} s (runs: {', '.join(f'{s:.2f}' for s in seconds['full'])})")
    print(f"KV cache:               {cached:.2f} s (runs: {', '.join(f'{s:.2f}' for s in seconds['cached'])})")
    print(
        f"speed-up (full / cached): {full / cached:.1f}x; same tokens: {torch.equal(tokens['cached'], tokens['full'])}"
    )


if __name__ == "__main__":
    main()
