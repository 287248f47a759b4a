"""The report's figures (matplotlib, headless): speed–quality curves, sweep heat-maps, calibration ROC."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never open a window (also under a desktop session)

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from flowlm.metrics.calibration import roc_curve  # noqa: E402

MARKERS = "osD^vP*X<>"
LABELS = {
    "valid_pct": "% valid grids",
    "accuracy": "accuracy (%)",
    "exact_match": "exact match (%)",
    "gen_ppl": "generative perplexity (lower is better)",
}


def curve_points(summary: pd.DataFrame) -> list[dict]:
    """The speed–quality lines, one per (run name, sampler), sorted by x: x = the mean NFE actually spent (the
    budget where none was logged), so an adaptive sampler sits at the NFE its rows needed, not at its cap; xerr = the
    spread of the rows' NFE (``nfe_std``, 0 where not logged), y ± yerr = the metric's mean ± std over runs; seconds
    per sample where logged (NaN otherwise); ``adaptive``: some point spent other than its budget or varied by row."""
    lines = []
    for (name, sampler), part in summary.groupby(["name", "sampler"], sort=False):
        spent = part["nfe"] if "nfe" in part else pd.Series(np.nan, index=part.index)
        x = spent.where(spent.notna(), part["nfe_budget"]).astype(float)
        spread = part["nfe_std"] if "nfe_std" in part else pd.Series(np.nan, index=part.index)
        seconds = part["sec_per_sample"] if "sec_per_sample" in part else pd.Series(np.nan, index=part.index)
        order = np.argsort(x.to_numpy(), kind="stable")
        xerr = spread.fillna(0.0).to_numpy(float)[order]
        adaptive = bool((np.abs(x - part["nfe_budget"]) > 1e-9).any() or (xerr > 0).any())
        lines.append(
            {
                "name": name,
                "sampler": sampler,
                "x": x.to_numpy()[order],
                "xerr": xerr,
                "y": part["mean"].to_numpy(float)[order],
                "yerr": part["std"].to_numpy(float)[order],
                "seconds": seconds.to_numpy(float)[order],
                "n": int(part["n"].max()),
                "adaptive": adaptive,
            }
        )
    return lines


def speed_quality(summary: pd.DataFrame, metric: str, path: Path, title: str) -> Path:
    """NFE actually spent (log x) vs ``metric``: one line per (run name, sampler), mean ± std over runs; adaptive
    samplers (dashed, open markers) at their mean NFE with the rows' NFE spread as a horizontal bar. A second panel
    plots the same against wall-clock seconds per sample where the runs logged it."""
    lines = curve_points(summary)
    timed = any(np.isfinite(line["seconds"]).any() for line in lines)
    fig, axes = plt.subplots(1, 2 if timed else 1, figsize=(14 if timed else 8.5, 4.8), dpi=120, squeeze=False)
    names = list(dict.fromkeys(summary["name"]))
    colors = plt.get_cmap("tab10" if len(lines) <= 10 else "tab20")
    for i, line in enumerate(lines):
        style = dict(
            color=colors(i % colors.N),
            marker=MARKERS[names.index(line["name"]) % len(MARKERS)],
            ls="--" if line["adaptive"] else "-",
            mfc="none" if line["adaptive"] else None,
            capsize=3,
            lw=1.6,
            ms=5,
        )
        label = f"{line['name']} · {line['sampler']} (n={line['n']})" + (" · adaptive" if line["adaptive"] else "")
        axes[0, 0].errorbar(line["x"], line["y"], yerr=line["yerr"], xerr=line["xerr"], label=label, **style)
        if timed:
            keep = np.isfinite(line["seconds"])
            axes[0, 1].errorbar(line["seconds"][keep], line["y"][keep], yerr=line["yerr"][keep], **style)
    ax = axes[0, 0]
    ax.set_xscale("log")
    ticks = sorted(
        {float(b) for b in summary["nfe_budget"]} | {float(x) for ln in lines if ln["adaptive"] for x in ln["x"]}
    )
    ax.set_xticks(ticks, [f"{t:.3g}" for t in ticks], fontsize=7 if len(ticks) > 8 else None)
    ax.minorticks_off()
    ax.set_xlabel("NFE actually spent, mean over rows (log scale; adaptive: ± row std)")
    ax.set_ylabel(LABELS.get(metric, metric) + " — mean ± std over runs")
    ax.set_title(title)
    if timed:
        wall = axes[0, 1]
        seconds = np.concatenate([line["seconds"] for line in lines])
        seconds = seconds[np.isfinite(seconds) & (seconds > 0)]
        wide = seconds.size > 0 and seconds.max() > 10 * seconds.min()  # log scale only over a decade or more
        wall.set_xscale("log" if wide else "linear")
        wall.set_xlabel("wall-clock seconds per sample" + (" (log scale)" if wide else ""))
        wall.set_title("the same against wall-clock time", fontsize=10)
        wall.grid(alpha=0.3)
    ax.grid(alpha=0.3)
    axes[0, -1].legend(*ax.get_legend_handles_labels(), fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes[0, -1].get_legend().set_frame_on(False)
    return _save(fig, path)


def heatmap(grid: pd.DataFrame, path: Path, title: str, value_label: str) -> Path:
    """A pivot table (rows = one swept param, columns = the other) as an annotated heat-map."""
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * grid.shape[1], 1.2 + 0.6 * grid.shape[0]), dpi=120)
    values = grid.to_numpy(dtype=float)
    image = ax.imshow(values, cmap="viridis", aspect="auto")
    ax.set_xticks(range(grid.shape[1]), [str(c) for c in grid.columns], rotation=45, ha="right")
    ax.set_yticks(range(grid.shape[0]), [str(i) for i in grid.index])
    ax.set_xlabel(str(grid.columns.name))
    ax.set_ylabel(str(grid.index.name))
    finite = values[np.isfinite(values)]
    middle = (finite.max() + finite.min()) / 2 if finite.size else 0.0
    for (r, c), v in np.ndenumerate(values):
        if np.isfinite(v):
            ax.text(c, r, f"{v:.3g}", ha="center", va="center", fontsize=8, color="w" if v < middle else "k")
    fig.colorbar(image, ax=ax, label=value_label)
    ax.set_title(title, fontsize=9)
    return _save(fig, path)


def calibration(scored: pd.DataFrame, path: Path, title: str, nfe_budget: int) -> Path:
    """Left: ROC curves at one NFE budget; right: AUROC by NFE budget. Solid = a-posteriori, dashed = a-priori."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6), dpi=120)
    colors = plt.get_cmap("tab10")
    for i, ((name, sampler, kind), part) in enumerate(scored.groupby(["name", "sampler", "kind"], sort=False)):
        style = dict(color=colors(i % 10), ls="-" if kind == "a-posteriori" else "--")
        label = f"{name} · {sampler} ({kind})"
        at = part[part["nfe_budget"] == nfe_budget]
        if len(at) and np.isfinite(at["auroc"].iloc[0]):
            fpr, tpr = roc_curve(at["confidence"].iloc[0], at["correct"].iloc[0])
            left.plot(fpr, tpr, label=f"{label}: AUROC {at['auroc'].iloc[0]:.3f}", **style)
        part = part.sort_values("nfe_budget")
        right.plot(part["nfe_budget"], part["auroc"], marker="o", label=label, **style)
    left.plot([0, 1], [0, 1], color="0.6", lw=0.8, ls=":")
    left.set_xlabel("false-positive rate (wrong tokens above the threshold)")
    left.set_ylabel("true-positive rate (right tokens above the threshold)")
    left.set_title(f"ROC of per-token confidence, NFE budget {nfe_budget}", fontsize=10)
    left.legend(fontsize=7, loc="lower right")
    right.set_xscale("log")
    budgets = sorted(scored["nfe_budget"].unique())
    right.set_xticks(budgets, [str(b) for b in budgets])
    right.minorticks_off()
    right.axhline(0.5, color="0.6", lw=0.8, ls=":")
    right.set_xlabel("NFE budget (log scale)")
    right.set_ylabel("AUROC (right vs wrong tokens)")
    right.set_title("AUROC by NFE budget (0.5 = confidence says nothing)", fontsize=10)
    right.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    return _save(fig, path)


def training_curves(points: pd.DataFrame, path: Path, title: str) -> Path:
    """Accuracy (conditional) / % valid (unconditional) against the training step, one panel per task: one line per
    model × sampler × NFE budget (``analysis.sudoku_tables.curve_points``: columns task, model, sampler, nfe_budget,
    step, mean, min, max, n), the mean over seeds with the seeds' min–max as a band."""
    tasks = list(dict.fromkeys(points["task"]))
    fig, axes = plt.subplots(1, max(len(tasks), 1), figsize=(5.2 * max(len(tasks), 1), 4.4), dpi=120, squeeze=False)
    colors = plt.get_cmap("tab10")
    for ax, task in zip(axes[0], tasks, strict=False):
        part = points[points["task"] == task]
        for i, ((model, sampler, nfe), line) in enumerate(part.groupby(["model", "sampler", "nfe_budget"], sort=False)):
            line = line.sort_values("step")
            style = dict(color=colors(i % 10), marker=MARKERS[i % len(MARKERS)], ms=4, lw=1.5)
            ax.plot(line["step"], line["mean"], label=f"{model} · {sampler} @{nfe} (n={int(line['n'].max())})", **style)
            ax.fill_between(line["step"], line["min"], line["max"], color=style["color"], alpha=0.18, lw=0)
        ax.set_title(str(task))
        ax.set_xlabel("training step (the model's own)")
        ax.set_ylabel(LABELS["valid_pct" if task == "uncond" else "accuracy"] + " — mean, band: min–max over seeds")
        ax.set_ylim(-2, 102)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(title)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path
