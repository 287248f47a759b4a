"""MLFM in the Sudoku comparison: on conditional 6×6 Sudoku (easy), the MDM's own samplers and the MLFM adapted
from that same MDM, at every NFE budget, for CCFG scales w ∈ {0, 1, 2, 4} without and with OTP (ε = 0.05).

Trains, per seed, `sudoku_mdm_easy` (ancestral / confidence evaluated), then `sudoku_mlfm_easy` initialised
from its last checkpoint and evaluated with `eval=sudoku_mlfm_grid`; prints % of puzzles solved, mean ± std over
seeds, with the NFE actually spent per sample (CCFG costs 2 NFE per step, so at an odd budget it spends one less).

    .venv/bin/python benchmarks/mlfm_sudoku.py --mdm-steps 1500 --mlfm-steps 1000 --seeds 0
    .venv/bin/python benchmarks/mlfm_sudoku.py --mdm-steps 20 --mlfm-steps 20 --samples 128   # a smoke run

Everything is a config of conf/experiment/; runs land in --out with their own MLflow store; reruns resume.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from common import minutes_line, seed_table, train_models


def main() -> None:
    """Train the MDM, adapt the MLFM, evaluate both, print one table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mdm-steps", type=int, default=1500)
    ap.add_argument("--mlfm-steps", type=int, default=1000)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--nfe", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    ap.add_argument("--samples", type=int, default=512, help="puzzles per sampler × NFE (multiple of 128)")
    ap.add_argument("--out", type=Path, default=Path("runs/bench_mlfm_sudoku"))
    args = ap.parse_args()
    common = [
        "scale=cpu",
        f"paths.root={args.out.resolve()}",
        "eval.nfe=[" + ",".join(map(str, args.nfe)) + "]",
        f"eval.max_batches={max(1, args.samples // 128)}",
        f"data.num_val={max(128, args.samples)}",
        "trainer.enable_progress_bar=false",
    ]
    models = [
        (
            "MDM",
            "sudoku_mdm_easy",
            [f"trainer.max_steps={args.mdm_steps}", f"trainer.val_check_interval={args.mdm_steps}"],
        ),
        (
            "MLFM",
            "sudoku_mlfm_easy",
            [
                "eval=sudoku_mlfm_grid",
                f"trainer.max_steps={args.mlfm_steps}",
                f"trainer.val_check_interval={args.mlfm_steps}",
            ],
        ),
    ]
    rows, minutes = train_models(models, args.seeds, common)
    print(report(rows, args.nfe, minutes))


def report(rows: list[dict], budgets: list[int], minutes: dict[str, list[float]]) -> str:
    """% solved (mean ± std over seeds) and the NFE spent per sampler."""
    lines, _ = seed_table(rows, budgets, "accuracy")
    spent = {}
    for r in rows:
        spent.setdefault((r["model"], r["sampler"]), {}).setdefault(r["nfe_budget"], []).append(r["nfe"])
    odd = sorted(
        {f"{s}: {statistics.fmean(v):g} at {b}" for (m, s), d in spent.items() for b, v in d.items() if v[0] != b}
    )
    lines.append(
        "\nCells: % of puzzles solved (valid grid keeping every clue). NFE spent below the budget: "
        + ("; ".join(odd) or "none")
    )
    lines.append(minutes_line(minutes))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
