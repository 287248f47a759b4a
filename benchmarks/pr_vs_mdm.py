"""The papers' central claim at CPU scale: PR on FMLM+ vs MDM samplers on unconditional 6×6 Sudoku.

Trains, for every seed and the same step budget, the MDM (`sudoku_mdm_uncond_tiny`), FMLM+ from scratch
(`sudoku_fmlmp_scratch_uncond_tiny`) and FMLM+ initialised from that seed's MDM (`sudoku_fmlmp_init_uncond_tiny`),
evaluates % valid grids at every NFE budget for MDM ancestral / confidence and FMLM+ a-priori / PR, and prints the
table (mean ± std over seeds) with the smallest NFE at which PR reaches the best MDM sampler's validity at full NFE.

    .venv/bin/python benchmarks/pr_vs_mdm.py --steps 1500 --seeds 0 1 2
    .venv/bin/python benchmarks/pr_vs_mdm.py --steps 50 --seeds 0 --samples 256   # a smoke run

Everything is a config of conf/experiment/; the script only chooses step budget, seeds, NFE list and sample count.
Runs land in --out (default runs/bench_pr_vs_mdm), tracked in its own MLflow store; a rerun resumes finished runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

from runners.common import CONF_DIR
from runners.train import train

MODELS = [
    ("MDM", "sudoku_mdm_uncond_tiny"),
    ("FMLM+ scratch", "sudoku_fmlmp_scratch_uncond_tiny"),
    ("FMLM+ MDM-init", "sudoku_fmlmp_init_uncond_tiny"),
]


def main() -> None:
    """Train, evaluate, aggregate, print."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1500, help="training steps of every model (same budget)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--nfe", type=int, nargs="+", default=[1, 2, 3, 6, 12, 36])
    ap.add_argument("--samples", type=int, default=512, help="generated grids per sampler × NFE (multiple of 256)")
    ap.add_argument("--out", type=Path, default=Path("runs/bench_pr_vs_mdm"))
    args = ap.parse_args()
    nfe = "[" + ",".join(map(str, args.nfe)) + "]"
    common = [
        f"paths.root={args.out.resolve()}",
        f"trainer.max_steps={args.steps}",
        f"trainer.val_check_interval={args.steps}",
        f"eval.nfe={nfe}",
        f"eval.max_batches={max(1, args.samples // 256)}",
        "trainer.enable_progress_bar=false",
    ]
    rows, minutes = [], {}
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        for seed in args.seeds:
            for label, experiment in MODELS:
                start = time.perf_counter()
                result = train(compose("train", overrides=[f"experiment={experiment}", f"seed={seed}", *common]))
                minutes.setdefault(label, []).append((time.perf_counter() - start) / 60)
                rows += [{**r, "model": label, "seed": seed} for r in result["rows"]]
    print(report(rows, args.nfe, minutes))


def report(rows: list[dict], budgets: list[int], minutes: dict[str, list[float]]) -> str:
    """Mean ± std over seeds (the mean alone for one seed) of % valid per (model, sampler) and NFE budget, and the
    PR-vs-best-MDM NFE ratio."""
    keys = list(dict.fromkeys((r["model"], r["sampler"]) for r in rows))
    cell = {}
    lines = [
        "| model | sampler | " + " | ".join(f"NFE {b}" for b in budgets) + " |",
        "|---|---|" + "---|" * len(budgets),
    ]
    for model, sampler in keys:
        out = []
        for b in budgets:
            vals = [r["valid_pct"] for r in rows if (r["model"], r["sampler"], r["nfe_budget"]) == (model, sampler, b)]
            mean = statistics.fmean(vals)
            cell[model, sampler, b] = mean
            out.append(f"{mean:.1f} ± {statistics.stdev(vals):.1f}" if len(vals) > 1 else f"{mean:.1f}")
        lines.append(f"| {model} | {sampler} | " + " | ".join(out) + " |")
    full = max(budgets)
    best_mdm = max((cell["MDM", s, full], s) for m, s in keys if m == "MDM")
    lines.append(f"\nBest MDM sampler at full NFE {full}: {best_mdm[1]} with {best_mdm[0]:.1f} % valid.")
    for model in ("FMLM+ scratch", "FMLM+ MDM-init"):
        reached = [b for b in budgets if cell.get((model, "pr", b), -1) >= best_mdm[0]]
        if reached:
            lines.append(
                f"{model} PR reaches it at NFE {reached[0]}: {reached[0]}/{full} = 1/{full / reached[0]:.3g} "
                "of the NFE (paper's claim, scaled: ≤ 1/8)."
            )
        else:
            best_pr = max((cell[model, "pr", b], b) for b in budgets)
            lines.append(
                f"{model} PR does not reach it within the budgets (best {best_pr[0]:.1f} % at NFE {best_pr[1]})."
            )
    lines.append(
        "Minutes per training run (incl. evaluation): "
        + ", ".join(f"{k} {statistics.fmean(v):.1f}" for k, v in minutes.items())
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
