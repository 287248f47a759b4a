"""The papers' central claim at CPU scale: PR on FMLM+ vs MDM samplers on unconditional 6×6 Sudoku.

Trains, for every seed and the same step budget, the MDM (`sudoku_mdm_uncond`), FMLM+ from scratch
(`sudoku_fmlm_plus_scratch_uncond`) and FMLM+ initialised from that seed's MDM (`sudoku_fmlm_plus_init_uncond`),
evaluates % valid grids at every NFE budget for MDM ancestral / confidence and FMLM+ a-priori / PR (the two commit
loops also with ``score=sampled``: LLaDA's ranking by the drawn token's probability), and prints the
table (mean ± std over seeds) with the smallest NFE at which PR reaches the best MDM sampler's validity at full NFE.

    .venv/bin/python benchmarks/pr_vs_mdm.py --steps 1500 --seeds 0 1 2
    .venv/bin/python benchmarks/pr_vs_mdm.py --steps 50 --seeds 0 --samples 256   # a smoke run
    # seeds in parallel processes (separate --out: one SQLite store each), then one table:
    .venv/bin/python benchmarks/pr_vs_mdm.py --seeds 1 --out runs/bench_s1 & ...
    .venv/bin/python benchmarks/pr_vs_mdm.py --seeds --combine runs/bench_s*/rows_*.json

Everything is a config of conf/experiment/; the script only chooses step budget, seeds, NFE list and sample count.
Runs land in --out (default runs/bench_pr_vs_mdm), tracked in its own MLflow store; a rerun resumes finished runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import minutes_line, seed_table, train_models

# Beside each commit loop at its default score (max probability, the released MDLM sampler), the same loop ranked
# by the drawn token's probability (LLaDA's rule; the two differ at the temperature 1 of unconditional tasks).
SAMPLED = {
    "MDM": ["+sampler@eval.samplers.confidence_sampled=confidence", "eval.samplers.confidence_sampled.score=sampled"],
    "FMLM+": ["+sampler@eval.samplers.a_priori_sampled=a_priori", "eval.samplers.a_priori_sampled.score=sampled"],
}
MODELS = [
    ("MDM", "sudoku_mdm_uncond", SAMPLED["MDM"]),
    ("FMLM+ scratch", "sudoku_fmlm_plus_scratch_uncond", SAMPLED["FMLM+"]),
    ("FMLM+ MDM-init", "sudoku_fmlm_plus_init_uncond", SAMPLED["FMLM+"]),
]


def main() -> None:
    """Train, evaluate, aggregate, print."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1500, help="training steps of every model (same budget)")
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument(
        "--models", nargs="+", default=[m[0] for m in MODELS], help="a subset of: " + ", ".join(m[0] for m in MODELS)
    )
    ap.add_argument("--combine", type=Path, nargs="*", default=[], help="rows JSON files of earlier invocations")
    ap.add_argument("--nfe", type=int, nargs="+", default=[1, 2, 3, 6, 12, 36])
    ap.add_argument("--samples", type=int, default=512, help="generated grids per sampler × NFE (multiple of 256)")
    ap.add_argument("--out", type=Path, default=Path("runs/bench_pr_vs_mdm"))
    args = ap.parse_args()
    nfe = "[" + ",".join(map(str, args.nfe)) + "]"
    common = [
        "scale=cpu",
        f"paths.root={args.out.resolve()}",
        f"trainer.max_steps={args.steps}",
        f"trainer.val_check_interval={args.steps}",
        f"eval.nfe={nfe}",
        f"eval.max_batches={max(1, args.samples // 256)}",
        "trainer.enable_progress_bar=false",
    ]
    rows, minutes = [], {}
    for path in args.combine:  # rows of earlier invocations (e.g. other seeds run in parallel)
        saved = json.loads(path.read_text())
        rows += saved["rows"]
        for k, v in saved["minutes"].items():
            minutes.setdefault(k, []).extend(v)
    if args.seeds:
        unknown = sorted(set(args.models) - {m[0] for m in MODELS})
        if unknown:
            ap.error(f"unknown models {unknown}")
        new_rows, new_minutes = train_models([m for m in MODELS if m[0] in args.models], args.seeds, common)
        tag = "-".join(m.split()[-1] for m in args.models)
        out = args.out / f"rows_seeds{'-'.join(map(str, args.seeds))}_steps{args.steps}_{tag}.json"
        out.write_text(json.dumps({"rows": new_rows, "minutes": new_minutes}))
        print(f"rows saved to {out} (combine them with --combine)")
        rows += new_rows
        for k, v in new_minutes.items():
            minutes.setdefault(k, []).extend(v)
    print(report(rows, args.nfe, minutes))


def report(rows: list[dict], budgets: list[int], minutes: dict[str, list[float]]) -> str:
    """Mean ± std over seeds (the mean alone for one seed) of % valid per (model, sampler) and NFE budget, and the
    PR-vs-best-MDM NFE ratio."""
    lines, cell = seed_table(rows, budgets, "valid_pct")
    full = max(budgets)
    best_mdm = max((v, s) for (m, s, b), v in cell.items() if m == "MDM" and b == full)
    lines.append(f"\nBest MDM sampler at full NFE {full}: {best_mdm[1]} with {best_mdm[0]:.1f} % valid.")
    present = list(dict.fromkeys(r["model"] for r in rows))
    seeds = {m: len({r["seed"] for r in rows if r["model"] == m}) for m in present}
    lines.append("Seeds per model: " + ", ".join(f"{m} {n}" for m, n in seeds.items()) + ".")
    for model in [m for m in ("FMLM+ scratch", "FMLM+ MDM-init") if m in present]:
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
    lines.append(minutes_line(minutes))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
