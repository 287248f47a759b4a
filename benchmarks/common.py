"""Shared pieces of the benchmark scripts: train experiment configs per seed, tabulate mean ± std over seeds."""

from __future__ import annotations

import statistics
import time

from hydra import compose, initialize_config_dir

from runners.common import CONF_DIR
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
