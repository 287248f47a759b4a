"""`flowlm-report`: MLflow runs → speed–quality curves, the papers' tables, heat-maps, calibration → one report."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from omegaconf import DictConfig, OmegaConf

from flowlm.project import CONF_DIR
from runners.common import check_switches
from runners.console import console_script

if TYPE_CHECKING:
    from analysis.report import Report


def report(cfg: DictConfig) -> tuple[Report, str | None]:
    """Build the report ``cfg`` describes; log it to MLflow unless ``log_to_mlflow`` is false.

    Returns the report and the MLflow run id holding it (None when not logged). A config with ``results_dir``
    (conf/report_sudoku.yaml) builds the papers' Sudoku tables from the results CSVs there instead.
    """
    # here, not at the top: MLflow, pandas and matplotlib are not needed for `flowlm-report --help`
    from analysis.report import build_report, log_report
    from analysis.sudoku_tables import build_sudoku_report

    check_switches(cfg, ("log_to_mlflow",))  # `log_to_mlflow=no` is a truthy string: it logged

    if cfg.get("results_dir"):
        built = build_sudoku_report(Path(cfg.results_dir).expanduser(), Path(cfg.out).expanduser(), title=cfg.title)
        print(f"Report: {built.markdown} and {built.html.name} ({len(built.data)} CSV files)", flush=True)
        return built, None
    # One progress bar per downloaded calibration file says nothing useful here.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    root = Path(cfg.paths.root).expanduser().resolve()
    cfg.paths.root = str(root)  # the default SQLite URI and artifact folder must not depend on the cwd
    OmegaConf.resolve(cfg)
    check_store(cfg.tracking_uri)
    built = build_report(
        cfg.tracking_uri,
        Path(cfg.out).expanduser().resolve(),
        experiments=list(cfg.experiments) or None,
        tags=_flat_tags(OmegaConf.to_container(cfg.tags)),
        filter_string=cfg.filter,
        exclude_experiments=[cfg.report_experiment],
        metric=cfg.metric,
        reference=dict(cfg.reference),
        heatmap_params=list(cfg.heatmap.params) if cfg.heatmap.params else None,
        heatmap_sampler=cfg.heatmap.sampler,
        heatmap_nfe_budget=cfg.heatmap.nfe_budget,
        calibration_nfe_budget=cfg.calibration.nfe_budget,
        title=cfg.title,
    )
    run_id = None
    if cfg.log_to_mlflow:
        location = cfg.artifact_location if cfg.tracking_uri.startswith("sqlite:") else None
        run_id = log_report(
            built,
            cfg.tracking_uri,
            experiment=cfg.report_experiment,
            artifact_location=location,
            name=f"{cfg.name}/{cfg.run_name}",
        )
    where = f"; MLflow run {run_id} (experiment {cfg.report_experiment!r})" if run_id else ""
    print(f"Report: {built.markdown} and {built.html.name} ({len(built.figures)} figures){where}", flush=True)
    return built, run_id


def check_store(tracking_uri: str) -> None:
    """Refuse a SQLite store that does not exist: reading it, MLflow made its folder and an empty database, and the
    report then said "no runs in experiments ['Default']" (a mistyped path looked like an empty store)."""
    if tracking_uri.startswith("sqlite:///"):
        path = Path(tracking_uri[len("sqlite:///") :].split("?")[0])
        if not path.is_file():
            raise FileNotFoundError(
                f"tracking_uri: no MLflow store at {path} ({tracking_uri}): give the store the runs were logged to "
                "(tracking_uri=sqlite:///<runs>/mlflow.db, or $MLFLOW_TRACKING_URI); nothing was made"
            )


def _flat_tags(tags: dict, prefix: str = "") -> dict[str, str]:
    # `+tags.flowlm.sweep=x` on the command line nests {flowlm: {sweep: x}}; MLflow tag keys are dotted strings.
    flat = {}
    for key, value in tags.items():
        if isinstance(value, dict):
            flat.update(_flat_tags(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = str(value)
    return flat


@console_script
@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="report")
def main(cfg: DictConfig) -> None:
    """Console entry point."""
    report(cfg)


if __name__ == "__main__":
    main()
