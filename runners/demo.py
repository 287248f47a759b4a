"""`flowlm-demo`, the main job: train every listed experiment, evaluate all samplers by NFE, print one table, and
build the report (figures, tables, calibration) of what it ran."""

from __future__ import annotations

import time

import hydra
from hydra import compose
from omegaconf import DictConfig, OmegaConf

from analysis.report import Report
from runners.common import is_rank_zero, pivot_table
from runners.paths import CONF_DIR
from runners.report import report
from runners.train import train


def demo(cfg: DictConfig) -> list[dict]:
    """Run each entry of ``cfg.runs`` through ``train`` and gather the rows into one table."""
    rows, by_metric, summary, run_cfgs = [], {}, [], []
    for overrides in cfg.runs:
        run_cfg = compose(config_name="train", overrides=[*overrides, *cfg.overrides])
        run_cfgs.append(run_cfg)
        start = time.perf_counter()
        result = train(run_cfg)
        minutes = (time.perf_counter() - start) / 60
        rows += result["rows"]
        by_metric.setdefault(result["metric"], []).extend(result["rows"])
        summary.append(f"{run_cfg.name}: {result['global_step']} steps in {minutes:.1f} min")
    if is_rank_zero():
        print("=" * 100)
        print("Demo summary (" + "; ".join(summary) + ")")
        for metric, metric_rows in by_metric.items():
            print(f"\n{metric} by NFE budget — cell: value (NFE actually spent)")
            print(pivot_table(metric_rows, metric))
        print("=" * 100, flush=True)
        if cfg.get("report"):
            demo_report(run_cfgs, cfg.report)
    return rows


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


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="demo")
def main(cfg: DictConfig) -> None:
    """Console entry point."""
    OmegaConf.resolve(cfg)
    demo(cfg)


if __name__ == "__main__":
    main()
