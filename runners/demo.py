"""`flowlm-demo`, the main job: train every listed experiment, evaluate all samplers by NFE, print one table, and
build the report (figures, tables, calibration) of what it ran."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import hydra
from hydra import compose
from omegaconf import DictConfig, OmegaConf

from flowlm.project import CONF_DIR
from runners.common import is_rank_zero, pivot_table
from runners.console import console_script
from runners.report import report
from runners.train import train

if TYPE_CHECKING:
    from analysis.report import Report


def demo(cfg: DictConfig) -> list[dict]:
    """Run each entry of ``cfg.runs`` through ``train`` and gather the rows into one table."""
    rows, by_metric, summary, run_cfgs, facts = [], {}, [], [], []
    for overrides in cfg.runs:
        run_cfg = compose(config_name="train", overrides=[*overrides, *cfg.overrides])
        run_cfgs.append(run_cfg)
        start = time.perf_counter()
        result = train(run_cfg)
        minutes = (time.perf_counter() - start) / 60
        rows += result["rows"]
        by_metric.setdefault(result["metric"], []).extend(result["rows"])
        summary.append(f"{run_cfg.name}: {result['global_step']} steps in {minutes:.1f} min")
        facts.append((str(run_cfg.name), result["global_step"], result.get("converged")))
    if is_rank_zero():
        print("=" * 100)
        print("Demo summary (" + "; ".join(summary) + ")")
        for metric, metric_rows in by_metric.items():
            print(f"\n{metric} by NFE budget — cell: value (NFE actually spent)")
            print(pivot_table(metric_rows, metric))
            line = verdict(metric_rows, metric, facts, setting(run_cfgs[0]))
            if line:
                print("\n" + line)
        print("=" * 100, flush=True)
        if cfg.get("report"):
            demo_report(run_cfgs, cfg.report)
    return rows


def setting(cfg: DictConfig) -> str:
    """The task and scale in words: '6×6 unconditional Sudoku, tiny DiT (4 × 128)'."""
    data, backbone = cfg.get("data", {}), cfg.get("backbone", {})
    n = int(data.get("box_rows", 0)) * int(data.get("box_cols", 0))
    task = f"{n}×{n} {'conditional' if data.get('conditional', True) else 'unconditional'} Sudoku" if n else cfg.task
    size = f"{backbone.get('n_layers', '?')} × {backbone.get('d_model', '?')}"
    return f"{task}, DiT {size}"


def verdict(rows: list[dict], metric: str, facts: list[tuple[str, int, bool | None]], where: str) -> str:
    """One line stating what the table shows and at which scale: the first run (the MDM) against each later one,
    best sampler against best sampler, at the budget where the later run leads most and at the largest budget."""
    names = list(dict.fromkeys(r["run"] for r in rows))
    if len(names) < 2:
        return ""
    best = {}  # (run, budget) → (value, sampler)
    for r in rows:
        key = (r["run"], r["nfe_budget"])
        if key not in best or r[metric] > best[key][0]:
            best[key] = (float(r[metric]), r["sampler"])
    base, parts = names[0], []
    for other in names[1:]:
        budgets = sorted(b for run, b in best if run == other and (base, b) in best)
        if not budgets:
            continue
        lead = max(budgets, key=lambda b: best[(other, b)][0] - best[(base, b)][0])
        for b in dict.fromkeys([lead, budgets[-1]]):
            (v, sv), (m, sm) = best[(other, b)], best[(base, b)]
            parts.append(f"at NFE {b}, {other} ({sv}) {v:.1f} against {base} ({sm}) {m:.1f}")
    scale = "; ".join(
        f"{name} {steps} steps, {'converged' if done else 'not converged'} by the suite's rule"
        if done is not None
        else f"{name} {steps} steps"
        for name, steps, done in facts
    )
    return (
        f"What this shows ({metric}, best sampler per run): " + "; ".join(parts) + f". Scale: {where}, one seed, "
        f"{scale}: minutes of CPU training, not the papers' protocol (the converged tables: docs/results.md)."
    )


def demo_report(run_cfgs: list[DictConfig], overrides: list[str]) -> Report | None:
    """`flowlm-report` over the experiments (MLflow tasks) of the demo's runs, in their tracking store."""
    tracked = [c for c in run_cfgs if c.get("logger")]
    if not tracked:
        print("No report: the demo's runs were not tracked (logger=none).", flush=True)
        return None
    tasks = list(dict.fromkeys(str(c.task) for c in tracked))
    cfg = compose(config_name="report", overrides=[*overrides])
    # The runs resolved their store and root already (train() makes them absolute): read exactly that store.
    cfg.paths.root = str(tracked[0].paths.root)
    cfg.tracking_uri = str(tracked[0].logger.tracking_uri)
    cfg.experiments = tasks
    built, _ = report(cfg)
    return built


@console_script
@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="demo")
def main(cfg: DictConfig) -> None:
    """Console entry point."""
    OmegaConf.resolve(cfg)
    demo(cfg)


if __name__ == "__main__":
    main()
