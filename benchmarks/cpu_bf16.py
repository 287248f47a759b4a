"""The tables sweep's training step under bf16 on a CPU without bf16 kernels: torch's own bf16 products against the
same products by float32 BLAS (flowlm/ops/bf16_products.py, what a run computes there), beside float32.

Three bare loops (``throughput.run_bare``: draw + loss + backward + clip + AdamW) on copies of one module and the
same batches, interleaved: float32; bf16 autocast with its matrix products by float32 BLAS (the rule); bf16 autocast
with torch's own bf16 products (fewer steps: it is the slow one). The limit: the step's matrix-product FLOPs at this
machine's float32 rate of a 2048² matmul (the products run there under the rule). Printed: seconds per step, over
float32 and over the limit, and one forward's loss under each on the same weights, batch and draw (the rule's against
torch's bf16, float32's beside it).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/cpu_bf16.py                        # sudoku_mdm_easy, batch 128
    .venv/bin/python benchmarks/cpu_bf16.py --experiment sudoku_fmlm_plus_scratch_easy --steps 5
"""

from __future__ import annotations

import argparse
import copy

import common
import torch
from common import autocast
from probes import matmul_flops, median
from sweep_step import matmul_rate, module_and_batches
from throughput import quiet_lightning, run_bare

from flowlm.ops.bf16_products import native_bf16_kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experiment", default="sudoku_mdm_easy", help="a model of the tables sweep")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=2, help="interleaved repetitions of the three loops")
    ap.add_argument("--steps", type=int, default=10, help="timed steps of the float32 and rule loops")
    ap.add_argument("--torch-steps", type=int, default=2, help="timed steps of torch's bf16 loop")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of each loop")
    ap.add_argument("override", nargs="*", help="more Hydra overrides of the sweep's config")
    args = ap.parse_args()
    if native_bf16_kernels():
        print("this CPU has bf16 kernels: runs use them (the rule is not installed); nothing to compare")
        return
    quiet_lightning()
    args.window = 50  # module_and_batches reads the sweep's arguments
    cfg, module, batches = module_and_batches(args)
    device = torch.device("cpu")
    loops = {  # name: (precision, the rule on, timed steps)
        "float32": ("32-true", True, args.steps),
        "rule": ("bf16-mixed", True, args.steps),
        "torch": ("bf16-mixed", False, args.torch_steps),
    }
    seconds: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(args.reps):
        for name, (precision, rule, steps) in loops.items():
            trained = copy.deepcopy(module)

            def loss(batch: dict, i: int, m=trained):
                return m.loss(batch, m.draw(batch, i, stage="train")).loss

            common.BF16_RULE = rule
            kw = {"steps": args.warmup + steps, "warmup": args.warmup, "precision": precision, "device": device}
            seconds[name].append(run_bare(trained, loss, batches, **kw)[0])
    # one forward's loss on the same batch and draw under each: the rule's distance from torch's bf16 against
    # float32's. The DiT's zero-initialised layers (adaLN gates, output) would make every loss log |V| whatever the
    # precision, so a copy of the module has them drawn at random (std 0.02) first
    weights = copy.deepcopy(module)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in weights.parameters():
            if not p.any():
                p.copy_(0.02 * torch.randn(p.shape, generator=generator))
    losses: dict[str, float] = {}
    for name, (precision, rule, _) in loops.items():
        common.BF16_RULE = rule
        with torch.no_grad(), autocast(precision, device):
            losses[name] = float(weights.loss(batches[0], weights.draw(batches[0], 0, stage="train")).loss)
    common.BF16_RULE = True
    probe = copy.deepcopy(module)

    def one_step() -> None:
        with autocast("32-true", device):
            value = probe.loss(batches[0], probe.draw(batches[0], 0, stage="train")).loss
        value.backward()

    flops = matmul_flops(one_step)
    rate = matmul_rate("32-true")
    limit = flops / rate
    fp32 = median(seconds["float32"])
    print(
        f"# {args.experiment} seed {args.seed}, batch {cfg.data.batch_size}, torch threads {torch.get_num_threads()}, "
        f"{args.reps} interleaved reps, no bf16 kernels on this CPU; step {flops / 1e9:.1f} GFLOP (matmuls, forward "
        f"+ backward), float32 matmul rate {rate / 1e9:.0f} GFLOP/s (2048², best of 5)"
    )
    print("| bare step | s/step | × float32 | × FLOP limit | loss, one forward |")
    print("|---|---|---|---|---|")
    print(f"| FLOP limit (float32 rate) | {limit:.4f} | {limit / fp32:.2f} | 1.00 | |")
    for name, label in (
        ("float32", "float32 (32-true)"),
        ("rule", "bf16-mixed, products by float32 BLAS (what runs compute here)"),
        ("torch", "bf16-mixed, torch's own bf16 products"),
    ):
        s = median(seconds[name])
        print(f"| {label} | {s:.4f} | {s / fp32:.2f} | {s / limit:.2f} | {losses[name]:.5f} |")
    print(
        "the rule's loss against torch's bf16: "
        f"{abs(losses['rule'] - losses['torch']) / abs(losses['torch']):.1e} relative; float32 against torch's bf16: "
        f"{abs(losses['float32'] - losses['torch']) / abs(losses['torch']):.1e}"
    )


if __name__ == "__main__":
    main()
