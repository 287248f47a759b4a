"""lm-eval likelihood requests per second with rows the length of the item (``FlowLM(rows=item)``) against rows of
``max_length`` with a [MASK] tail (``rows=max_length``), side by side in one process, on one fixed item set.

A randomly initialised LLaMA-family MDM (transformers' Llama layers in SMDM's layout, ``--width`` wide, ``--layers``
layers, 4 heads, SwiGLU 8/3 × the width; [MASK] the extra embedding row) on the repository's tiny tokenizer (512 ids
+ [PAD]) is written as flowlm-train writes a checkpoint (a temporary folder) and loaded by ``runners.lm_harness.FlowLM``
twice, once per layout, the same ``--mc-samples``, ``--batch-size`` and seed. The item set: ``--items``
context / continuation pairs cut from the TinyStories sample, each item (context + continuation) cut at 10–60 tokens
(``--min-len``/``--max-len``), the continuation at least 4 (never enumerated exactly at 8 samples or fewer); the
lengths the model encodes (BOS included, re-encoding may move a cut by a token) are printed.
Both layouts score the same lm-eval ``Instance``s through ``FlowLM.loglikelihood`` (the ELBO and the greedy check);
repetitions are interleaved (the order alternates) and the medians compared.

The limit: the network positions a layout runs per request, counted on an untimed first pass (every id the
embedding reads: the Monte-Carlo rows and the greedy call alike), item against max_length: the speed-up if the cost
were proportional to positions. The FLOP limit adds the attention, quadratic in the row (per layer 4·L·d a position
of a row of L, beside 2 × the layer's multiply-adds per token, and the head's 2·d·|V|): the speed-up if the cost
were proportional to forward FLOPs; at max_length 1 024 the attention is most of a max_length row's work.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/likelihood_rows.py                      # 48 items, max_length 256
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/likelihood_rows.py --max-length 1024 --reps 2
    .venv/bin/python benchmarks/likelihood_rows.py --items 4 --max-length 64 --width 32 --layers 1 --reps 1  # smoke
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from lm_eval.api.instance import Instance

from datamodules.sources import load_tokenizer
from lightning_modules.checkpoints import checkpoint_of
from lightning_modules.mdm import MDMModule
from runners.lm_harness import FlowLM

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "data" / "cpu" / "tiny_tokenizer"
STORIES = ROOT / "data" / "cpu" / "tinystories_sample.jsonl"
LAYOUTS = ("max_length", "item")


def write_checkpoint(path: Path, *, vocab: int, length: int, width: int, layers: int) -> Path:
    """A tiny LLaMA-family MDM checkpoint as flowlm-train writes it (hyper-parameters, the flowlm record with a text
    data config on the tiny tokenizer), weights N(0, 0.02²)."""
    backbone = {
        "_target_": "flowlm.backbones.llama.BidirectionalLM",
        **{"hidden_size": width, "n_layers": layers, "n_heads": 4, "intermediate_size": 8 * width // 3},
        **{"embed_rows": vocab + 1, "head_rows": vocab, "mask_id": vocab, "max_positions": length},
    }
    torch.manual_seed(0)
    module = MDMModule(data_vocab_size=vocab, seq_len=length, backbone=backbone, optim={})
    with torch.no_grad():
        for p in module.parameters():
            torch.nn.init.normal_(p, std=0.02)
    module.run_config = {
        "name": "likelihood_rows_llama",
        "data": {"_target_": "datamodules.gsm8k.GSM8KDataModule", "tokenizer": str(TOKENIZER), "seq_len": length},
    }
    torch.save(checkpoint_of(module, global_step=0), path)
    return path


def item_set(tokenizer, n: int, lo: int, hi: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` (context, continuation) texts cut from the stories' token ids at seeded places: lengths uniform in
    [lo, hi] tokens, the continuation 4 to half the item (the texts are decoded ids: re-encoding may move a length by a
    token or two; the script reports the lengths the model encodes)."""
    ids = []
    for line in STORIES.read_text().splitlines()[:200]:
        ids += tokenizer(json.loads(line)["text"], add_special_tokens=False)["input_ids"]
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        total = rng.randint(lo, hi)
        cont = rng.randint(4, max(4, total // 2))
        start = rng.randrange(len(ids) - total)
        context, continuation = ids[start : start + total - cont], ids[start + total - cont : start + total]
        items.append((tokenizer.decode(context), " " + tokenizer.decode(continuation).lstrip()))
    return items


def counted_positions(lm: FlowLM, requests: list[Instance]) -> tuple[int, int, int]:
    """(positions, Σ rows × length², network calls) one pass over ``requests`` runs: the ids (B, L) any embedding of
    the module reads."""
    seen = [0, 0, 0]

    def hook(_module, args):
        rows, length = args[0].shape
        seen[0] += rows * length
        seen[1] += rows * length * length
        seen[2] += 1

    handles = [m.register_forward_pre_hook(hook) for m in lm.module.modules() if isinstance(m, torch.nn.Embedding)]
    try:
        lm.loglikelihood(requests, disable_tqdm=True)
    finally:
        for handle in handles:
            handle.remove()
    return seen[0], seen[1], seen[2]


def forward_flops(positions: int, squares: int, *, width: int, layers: int, vocab: int) -> float:
    """Forward FLOPs of the counted rows: per layer 2 × the token-linear multiply-adds (Q, K, V, O; SwiGLU gate, up,
    down) a position and the attention's 4·L·d a position of a row of L; the head's 2·d·|V| a position."""
    linear = 4 * width * width + 3 * width * (8 * width // 3)
    return layers * (2 * linear * positions + 4 * width * squares) + 2 * width * vocab * positions


def main() -> None:
    """Time both layouts on the item set, print the table and the ratio lines."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=48)
    ap.add_argument("--min-len", type=int, default=10, help="shortest item (context + continuation), tokens")
    ap.add_argument("--max-len", type=int, default=60, help="longest item, tokens")
    ap.add_argument("--max-length", type=int, default=256, help="the checkpoint's seq_len and FlowLM's max_length")
    ap.add_argument("--mc-samples", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=64, help="FlowLM's batch_size: rows per network call")
    ap.add_argument("--width", type=int, default=128, help="the tiny LLaMA's hidden size")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if not 4 < args.min_len <= args.max_len <= args.max_length:
        raise SystemExit(
            f"likelihood_rows.py: need 4 < --min-len ≤ --max-len ≤ --max-length, got {args.min_len}, {args.max_len}, "
            f"{args.max_length}"
        )
    torch.set_num_threads(1)
    vocab = len(load_tokenizer(str(TOKENIZER), "add"))
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(
            Path(tmp) / "llama.ckpt", vocab=vocab, length=args.max_length, width=args.width, layers=args.layers
        )
        common = {"mc_samples": args.mc_samples, "batch_size": args.batch_size, "device": "cpu", "seed": 0}
        lms = {rows: FlowLM(checkpoint=str(ckpt), rows=rows, **common) for rows in LAYOUTS}
    tokenizer = lms["item"].tokenizer
    pairs = item_set(tokenizer, args.items, args.min_len, args.max_len)
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    lengths = [sum(map(len, lms["item"]._encode_pair(c, x))) for c, x in pairs]
    counts = {rows: counted_positions(lm, requests) for rows, lm in lms.items()}  # also the warm-up pass
    times: dict[str, list[float]] = {rows: [] for rows in LAYOUTS}
    values: dict[str, list] = {}
    for rep in range(args.reps):
        for rows in LAYOUTS if rep % 2 == 0 else LAYOUTS[::-1]:
            start = time.perf_counter()
            values[rows] = lms[rows].loglikelihood(requests, disable_tqdm=True)
            times[rows].append(time.perf_counter() - start)
    assert all(len(v) == len(requests) for v in values.values())

    n = len(requests)
    rate = {rows: n / statistics.median(times[rows]) for rows in LAYOUTS}
    per_request = {rows: counts[rows][0] / n for rows in LAYOUTS}
    base = "max_length"
    shape = {"width": args.width, "layers": args.layers, "vocab": vocab}
    work = {rows: forward_flops(*counts[rows][:2], **shape) for rows in LAYOUTS}
    print(
        f"# lm-eval likelihood rows: {n} loglikelihood requests, items {min(lengths)}–{max(lengths)} tokens (mean "
        f"{statistics.fmean(lengths):.1f}), max_length {args.max_length}, mc_samples {args.mc_samples}, batch_size "
        f"{args.batch_size}; tiny LLaMA {args.layers} × {args.width}, |V| {vocab}; {torch.get_num_threads()} thread, "
        f"{args.reps} interleaved repetitions (medians)"
    )
    columns = ("rows", "s / pass", "requests / s", "positions / request", "network calls", "speed-up", "limit")
    print("| " + " | ".join(columns) + " | speed-up / limit | FLOP limit | speed-up / FLOP limit |")
    print("|---" * (len(columns) + 3) + "|")
    for rows in LAYOUTS:
        speed = rate[rows] / rate[base]
        limit = per_request[base] / per_request[rows]
        print(
            f"| {rows} | {statistics.median(times[rows]):.3f} | {rate[rows]:.2f} | {per_request[rows]:.1f} | "
            f"{counts[rows][2]} | {speed:.2f}× | {limit:.2f}× | {speed / limit:.3f} | {work[base] / work[rows]:.2f}× | "
            f"{speed * work[rows] / work[base]:.3f} |"
        )
    print(f"mean item length: {statistics.fmean(lengths):.3f} tokens; max_length {args.max_length}")
    print(f"row positions per request: item {per_request['item']:.3f}, max_length {per_request[base]:.3f}")
    speed, limit = rate["item"] / rate[base], per_request[base] / per_request["item"]
    flop = work[base] / work["item"]
    print(
        f"ratio item/max_length requests per second: {speed:.3f} (limit {limit:.3f}: {speed / limit:.3f} of it; "
        f"FLOP limit {flop:.3f}: {speed / flop:.3f} of it)"
    )


if __name__ == "__main__":
    main()
