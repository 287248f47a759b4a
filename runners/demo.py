"""`flowlm-demo`, the main job: train every listed experiment, evaluate all samplers by NFE, print one table."""

from __future__ import annotations

import time

import hydra
from hydra import compose
from omegaconf import DictConfig, OmegaConf

from runners.common import CONF_DIR, is_rank_zero, pivot_table
from runners.train import train


def demo(cfg: DictConfig) -> list[dict]:
    """Run each entry of ``cfg.runs`` through ``train`` and gather the rows into one table."""
    rows, by_metric, summary = [], {}, []
    for overrides in cfg.runs:
        run_cfg = compose(config_name="train", overrides=[*overrides, *cfg.overrides])
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
    return rows


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="demo")
def main(cfg: DictConfig) -> None:
    """Console entry point."""
    OmegaConf.resolve(cfg)
    demo(cfg)


if __name__ == "__main__":
    main()
