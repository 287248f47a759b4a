"""The report: MLflow runs → tables and figures → one Markdown and one self-contained HTML file (+ PNG, CSV)."""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pandas as pd
from mlflow.tracking import MlflowClient

from analysis import plots
from analysis.aup import ACCURACY_METRICS
from analysis.calibration import pool_and_score
from analysis.heatmaps import label_trials, sweep_grids
from analysis.load import eval_table, load_calibration, load_runs, long_metrics, primary_metric, summarize
from analysis.tables import (
    aup_table,
    calibration_table,
    paper_table,
    reference_numbers,
    results_table,
    scale_label,
    task_key,
    to_html,
    to_markdown,
)
from flowlm.experiment_kind import mark_model_training
from flowlm.redaction import redact_uri

REPORT_MD, REPORT_HTML = "report.md", "report.html"
AUP_TEXT = (
    "d3LLM's weighted area under the accuracy–TPF curve (tokens per forward: positions generated / NFE a row spent, "
    "mean over rows), points more than 5 below the lowest-TPF point left out, accuracy weighted by "
    "min(exp(−3 (1 − y / y_max)), 1) with y_max the experiment's best (analysis/aup.py); higher is better. One line "
    "per run and sampler over its NFE budgets, one per sweep and sampler over all its trials."
)


@dataclass
class Section:
    """One block of the report: a heading, a paragraph, and optionally a table and/or a figure."""

    title: str
    text: str = ""
    table: pd.DataFrame | None = None
    image: Path | None = None
    level: int = 2


@dataclass
class Report:
    """What ``build_report`` wrote: the folder, the two documents, figures, tables, and the runs it read."""

    out: Path
    markdown: Path
    html: Path
    figures: list[Path] = field(default_factory=list)
    data: list[Path] = field(default_factory=list)  # CSV files of the numbers
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    runs: pd.DataFrame | None = None
    main_figure: Path | None = None  # the first experiment's speed–quality curve


def build_report(
    tracking_uri: str,
    out: str | Path,
    *,
    experiments: Sequence[str] | None = None,
    tags: Mapping[str, str] | None = None,
    filter_string: str | None = None,
    exclude_experiments: Sequence[str] = (),
    metric: str | None = None,
    reference: Mapping[str, str] | None = None,
    heatmap_params: Sequence[str] | None = None,
    heatmap_sampler: str | None = None,
    heatmap_nfe_budget: int | None = None,
    calibration_nfe_budget: int | None = None,
    title: str = "flowlm report",
) -> Report:
    """Read the matching runs and write, per experiment: the speed–quality curve, the results table, the papers'
    table beside the measured one (when methods.md §8 has the task), confidence calibration (when the runs logged
    it) and sweep heat-maps (when runs vary in two params). ``reference`` maps an experiment to a reference.yaml
    task where the data config does not say it."""
    unknown = {e: k for e, k in (reference or {}).items() if k not in reference_numbers()}
    if unknown:
        raise ValueError(
            f"unknown reference task(s) {unknown}; analysis/reference.yaml has {sorted(reference_numbers())}"
        )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs = load_runs(
        tracking_uri,
        experiments=experiments,
        tags=tags,
        filter_string=filter_string,
        exclude_experiments=exclude_experiments,
    )
    runs = label_trials(runs)
    long = long_metrics(runs)
    silent = sorted(set(runs["experiment"]) - set(long["experiment"]))
    runs = runs[runs["run_id"].isin(long["run_id"])]  # runs without evaluation (e.g. crashed early) add nothing
    report = Report(out=out, markdown=out / REPORT_MD, html=out / REPORT_HTML, runs=runs)
    report.data += [out / "metrics_long.csv", out / "runs.csv"]
    long.to_csv(report.data[0], index=False)
    runs[["experiment", "run_id", "name", "method", "seed", "sweep", "trial", "status"]].to_csv(
        report.data[1], index=False
    )
    sections = [
        Section(
            title,
            f"Generated {datetime.now(UTC):%Y-%m-%d %H:%M} UTC from `{redact_uri(tracking_uri)}`: {len(runs)} runs in "
            f"{long['experiment'].nunique()} experiment(s)"
            + (f", tags {dict(tags)}" if tags else "")
            + (f", filter `{filter_string}`" if filter_string else "")
            + (f"; experiments without evaluation metrics, left out: {', '.join(silent)}" if silent else "")
            + ". Values are the latest logged evaluation of each run; ± is the standard deviation over runs "
            "(seeds) of the same name; NFE is the number of network calls the sampler actually spent. "
            "Raw numbers: `metrics_long.csv`, `results_*.csv`, `runs.csv`.",
            level=1,
        )
    ]
    for experiment in _order(runs, experiments):
        runs_e = runs[runs["experiment"] == experiment]
        sections += _experiment_sections(
            report,
            experiment,
            runs_e,
            long[long["experiment"] == experiment],
            tracking_uri,
            metric=metric,
            reference=(reference or {}).get(experiment),
            heatmap=dict(params=heatmap_params, sampler=heatmap_sampler, nfe_budget=heatmap_nfe_budget),
            calibration_nfe_budget=calibration_nfe_budget,
        )
    report.markdown.write_text(_render_markdown(sections, out))
    report.html.write_text(_render_html(sections, title))
    return report


def _experiment_sections(
    report: Report,
    experiment: str,
    runs: pd.DataFrame,
    long: pd.DataFrame,
    tracking_uri: str,
    *,
    metric: str | None,
    reference: str | None,
    heatmap: dict,
    calibration_nfe_budget: int | None,
) -> list[Section]:
    slug = _slug(experiment)
    table = eval_table(long)
    metric = metric or primary_metric(long)
    if metric not in table:
        raise ValueError(f"experiment {experiment!r} logged no {metric!r}; it has {sorted(set(long['metric']))}")
    summary = summarize(table, metric)
    report.data.append(report.out / f"results_{slug}.csv")
    summary.to_csv(report.data[-1], index=False)
    measured = scale_label(runs)
    names = ", ".join(dict.fromkeys(runs["name"]))
    sections = [Section(f"Experiment `{experiment}`", f"{len(runs)} runs ({names}); {measured}; metric `{metric}`.")]

    figure = plots.speed_quality(
        summary, metric, report.out / f"speed_quality_{slug}.png", f"{experiment}: {metric} vs NFE ({measured})"
    )
    report.figures.append(figure)
    report.main_figure = report.main_figure or figure
    sections.append(
        Section(
            "Speed–quality",
            "One line per run name and sampler; x = NFE actually spent (log scale), error bars = std over runs.",
            image=figure,
            level=3,
        )
    )
    results = results_table(summary, metric)
    report.tables[f"results/{experiment}"] = results
    sections.append(Section(f"{metric} by NFE budget", f"Cells: mean ± std over runs ({measured}).", results, level=3))
    if metric in ACCURACY_METRICS:
        aup = aup_table(summary, metric)
        report.tables[f"aup/{experiment}"] = aup
        sections.append(Section("AUP: accuracy under parallelism", AUP_TEXT, aup, level=3))

    key = reference or task_key(runs)
    if key is not None and key in reference_numbers():
        ref = reference_numbers()[key]
        if ref["metric"] == metric:
            paper = paper_table(summary, metric, key, measured)
            report.tables[f"paper/{experiment}"] = paper
            sections.append(
                Section(
                    f"Papers' table beside the measured runs (`{key}`)",
                    f"Paper rows: methods.md §8, {ref['scale']}. Measured rows ({measured}): this suite's runs, "
                    "usually far smaller boards, models and training, so not the papers' setting; compare shapes "
                    "(how quality grows with NFE, which sampler leads), not values. On Sudoku, one NFE per cell "
                    "is 81 on 9×9 but 36 on 6×6.",
                    paper,
                    level=3,
                )
            )

    calibration = load_calibration(tracking_uri, runs)
    if len(calibration):
        scored = pool_and_score(calibration)
        budget = calibration_nfe_budget or _middle_budget(scored)
        figure = plots.calibration(
            scored, report.out / f"calibration_{slug}.png", f"{experiment}: confidence vs correctness", budget
        )
        report.figures.append(figure)
        cal = calibration_table(scored)
        report.tables[f"calibration/{experiment}"] = cal
        report.data.append(report.out / f"calibration_{slug}.csv")
        scored.drop(columns=["confidence", "correct"]).to_csv(report.data[-1], index=False)
        sections.append(
            Section(
                "Confidence calibration (a-priori vs a-posteriori)",
                "How well each sampler's per-token confidence (the probability it committed a token with) separates "
                "right from wrong tokens: ROC and AUROC, tokens pooled over runs. A-priori: scored before the rest "
                "of the sequence exists (MDM confidence, FMLM+ δ₀,₀); a-posteriori: scored on a finished draft "
                "(FMLM+ PR). Right = equals the solution (conditional Sudoku) or clashes with no cell of its row, "
                "column and box (unconditional). Cells: AUROC (share of wrong tokens).",
                cal,
                figure,
                level=3,
            )
        )

    for item in sweep_grids(runs, table, metric, **heatmap):
        name = _slug(f"heatmap_{item['group']}_{item['sampler']}")
        caption = f"{item['group']} · {item['sampler']}: {metric} at {item['budget']}"
        figure = plots.heatmap(item["grid"], report.out / f"{name}.png", caption, metric)
        report.figures.append(figure)
        grid = item["grid"].map(lambda v: "" if pd.isna(v) else f"{v:.1f}")
        grid = grid.reset_index().rename(columns={grid.index.name: f"{grid.index.name} \\ {grid.columns.name}"})
        grid.columns = [str(c) for c in grid.columns]
        report.tables[f"heatmap/{item['group']}/{item['sampler']}"] = grid
        sections.append(Section(f"Sweep heat-map: {caption}", "Mean over runs per cell.", grid, figure, level=3))
    return sections


def log_report(
    report: Report,
    tracking_uri: str,
    *,
    experiment: str = "reports",
    artifact_location: str | None = None,
    name: str = "report",
) -> str:
    """Log the report's files as artifacts (``report/``) of a new run in the ``experiment`` MLflow experiment,
    tagged with the report's name and the experiments it read; returns the run id. Only the files this build
    wrote are logged (a reused folder may hold older figures)."""
    client = MlflowClient(tracking_uri=tracking_uri)
    found = client.get_experiment_by_name(experiment)
    experiment_id = found.experiment_id if found else client.create_experiment(experiment, artifact_location)
    mark_model_training(client, experiment_id)  # a model-training experiment for MLflow's UI
    sources = sorted(set(report.runs["experiment"])) if report.runs is not None else []
    run = client.create_run(
        experiment_id,
        run_name=name,
        tags={
            "flowlm.name": name,
            "flowlm.kind": "report",
            "flowlm.report.experiments": ",".join(sources)[:5000],
            "flowlm.report.runs": str(0 if report.runs is None else len(report.runs)),
        },
    )
    for path in [report.markdown, report.html, *report.figures, *report.data]:
        client.log_artifact(run.info.run_id, str(path), "report")
    client.set_terminated(run.info.run_id)
    return run.info.run_id


def _order(runs: pd.DataFrame, experiments: Sequence[str] | None) -> list[str]:
    # The order asked for; else comparisons before sweeps, the most run names first: the first
    # experiment's speed–quality curve is the report's main figure.
    present = list(dict.fromkeys(runs["experiment"]))
    if experiments:
        return [e for e in experiments if e in present]
    swept = runs.groupby("experiment")["sweep"].agg(lambda s: bool((s != "").any()))
    return sorted(present, key=lambda e: (swept[e], -runs[runs["experiment"] == e]["name"].nunique(), e))


def _middle_budget(scored: pd.DataFrame) -> int:
    # The ROC panel shows one budget: the middle one among those where every line has both right and wrong tokens.
    lines = scored.groupby(["name", "sampler"]).ngroups
    ok = scored[np.isfinite(scored["auroc"])].groupby("nfe_budget").size()
    budgets = sorted(ok[ok == lines].index) or sorted(scored["nfe_budget"].unique())
    return int(budgets[(len(budgets) - 1) // 2])


def _render_markdown(sections: list[Section], out: Path) -> str:
    parts = []
    for s in sections:
        parts.append("#" * s.level + " " + s.title)
        if s.text:
            parts.append(s.text)
        if s.image is not None:
            parts.append(f"![{s.title}]({s.image.relative_to(out).as_posix()})")
        if s.table is not None:
            parts.append(to_markdown(s.table))
    return "\n\n".join(parts) + "\n"


def _render_html(sections: list[Section], title: str) -> str:
    body = []
    for s in sections:
        body.append(f"<h{s.level}>{_inline(s.title)}</h{s.level}>")
        if s.text:
            body.append(f"<p>{_inline(s.text)}</p>")
        if s.image is not None:
            data = base64.b64encode(s.image.read_bytes()).decode()
            body.append(f'<img alt="{html.escape(s.title)}" src="data:image/png;base64,{data}">')
        if s.table is not None:
            body.append(to_html(s.table))
    style = (
        "body{font-family:sans-serif;max-width:1200px;margin:2em auto;padding:0 1em}"
        "table{border-collapse:collapse;margin:1em 0;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px}"
        "th{background:#f3f3f3}img{max-width:100%}code{background:#f3f3f3;padding:0 3px}"
    )
    return (
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{style}</style></head><body>{''.join(body)}</body></html>\n"
    )


def _inline(text: str) -> str:
    # Markdown `code` spans are the only inline markup the sections use.
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "x"
