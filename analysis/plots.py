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


def speed_quality(summary: pd.DataFrame, metric: str, path: Path, title: str) -> Path:
    """NFE actually spent (log x) vs ``metric``: one line per (run name, sampler), mean ± std over runs (seeds)."""
    fig, ax = plt.subplots(figsize=(8.5, 4.8), dpi=120)
    names = list(dict.fromkeys(summary["name"]))
    colors = plt.get_cmap("tab10" if summary.groupby(["name", "sampler"]).ngroups <= 10 else "tab20")
    for i, ((name, sampler), part) in enumerate(summary.groupby(["name", "sampler"], sort=False)):
        part = part.sort_values("nfe")
        x = part["nfe"].where(part["nfe"].notna(), part["nfe_budget"])
        ax.errorbar(
            x,
            part["mean"],
            yerr=part["std"],
            label=f"{name} · {sampler} (n={int(part['n'].max())})",
            color=colors(i % colors.N),
            marker=MARKERS[names.index(name) % len(MARKERS)],
            capsize=3,
            lw=1.6,
            ms=5,
        )
    ax.set_xscale("log")
    budgets = sorted(summary["nfe_budget"].unique())
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.minorticks_off()
    ax.set_xlabel("NFE actually spent (log scale)")
    ax.set_ylabel(LABELS.get(metric, metric) + " — mean ± std over runs")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
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


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path
