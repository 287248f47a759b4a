"""Tables of the report: measured results by NFE budget, the papers' tables beside them, calibration AUROC."""

from __future__ import annotations

import html
from functools import cache
from pathlib import Path

import pandas as pd
import yaml

from analysis.aup import aup_lines

REFERENCE_FILE = Path(__file__).with_name("reference.yaml")
# Decimals shown per metric (others: 1, as in the papers' percentage tables).
DECIMALS = {"gen_ppl": 2, "auroc": 3}


@cache
def reference_numbers() -> dict:
    """The papers' reference numbers (methods.md §8) by task key, from reference.yaml."""
    return yaml.safe_load(REFERENCE_FILE.read_text())


def task_key(runs: pd.DataFrame) -> str | None:
    """The reference.yaml task of these runs (from their data config), or None if the papers have no such table."""
    target = _first(runs, "params.data/_target_")
    if target is None or "sudoku" not in target.lower():
        return None
    if str(_first(runs, "params.data/conditional")).lower() == "false":
        return "sudoku_uncond"
    difficulty = _first(runs, "params.data/difficulty")
    return f"sudoku_{difficulty}" if difficulty in ("easy", "medium", "hard") else None


def scale_label(runs: pd.DataFrame) -> str:
    """How the runs' rows are labelled beside the papers', e.g. 'measured, 6×6' (their data config's box shape)."""
    rows, cols = _first(runs, "params.data/box_rows"), _first(runs, "params.data/box_cols")
    if rows is None or cols is None:
        return "measured"
    n = int(rows) * int(cols)
    return f"measured, {n}×{n}"


def fmt(value: float, std: float | None = None, n: int = 1, metric: str = "") -> str:
    """'mean ± std' with the metric's decimals (the mean alone for a single run); '' for a missing value."""
    if value is None or pd.isna(value):
        return ""
    d = DECIMALS.get(metric, 1)
    return f"{value:.{d}f} ± {std:.{d}f}" if n > 1 and std is not None else f"{value:.{d}f}"


def results_table(summary: pd.DataFrame, metric: str) -> pd.DataFrame:
    """One line per (run name, sampler), one column per NFE budget: 'mean ± std' over runs; the NFE actually spent
    is added in brackets where it differs from the budget."""
    budgets = sorted(summary["nfe_budget"].unique())
    lines = []
    for (name, sampler), part in summary.groupby(["name", "sampler"], sort=False):
        line = {"run": name, "sampler": sampler, "runs": int(part["n"].max())}
        for _, row in part.iterrows():
            cell = fmt(row["mean"], row["std"], row["n"], metric)
            if pd.notna(row["nfe"]) and abs(row["nfe"] - row["nfe_budget"]) > 1e-9:
                cell += f" (NFE {row['nfe']:.3g})"
            line[f"NFE {row['nfe_budget']}"] = cell
        lines.append(line)
    return pd.DataFrame(lines, columns=["run", "sampler", "runs", *(f"NFE {b}" for b in budgets)]).fillna("")


def aup_table(summary: pd.DataFrame, metric: str) -> pd.DataFrame:
    """AUP (analysis/aup.py) of each run name × sampler over its NFE budgets, and of each sweep × sampler over all
    its trials and budgets (a τ or γ grid: one curve); y_max = the best ``metric`` of the experiment. Columns: run,
    sampler, points, TPF (range), AUP ('n/a' without TPF: runs logged before it)."""
    points = summary.rename(columns={"mean": metric})
    swept = points[points["sweep"].fillna("") != ""] if "sweep" in points else points[:0]
    pooled = swept.assign(name="sweep " + swept["sweep"] + " (all trials)")
    lines = aup_lines(pd.concat([points, pooled], ignore_index=True), ["name", "sampler"], metric)
    rows = []
    for line in lines.itertuples(index=False):
        tpf = "" if pd.isna(line.tpf_min) else f"{line.tpf_min:.3g}–{line.tpf_max:.3g}"
        rows.append([line.name, line.sampler, line.points, tpf, "n/a" if pd.isna(line.aup) else f"{line.aup:.1f}"])
    return pd.DataFrame(rows, columns=["run", "sampler", "points", "TPF", "AUP"])


def paper_table(summary: pd.DataFrame, metric: str, key: str, measured: str) -> pd.DataFrame:
    """The papers' rows for task ``key`` with the measured rows of the same sampler under each; columns = union of
    NFE budgets. ``measured`` labels the measured rows' scale (they are not the papers' setting)."""
    ref = reference_numbers()[key]
    if ref["metric"] != metric:
        raise ValueError(f"reference table {key!r} reports {ref['metric']}, the runs report {metric}")
    mine = summary[summary["nfe_budget"].notna()]
    budgets = sorted({int(b) for row in ref["rows"] for b in row["values"]} | set(mine["nfe_budget"].astype(int)))
    paper = ref.get("label", "paper")
    lines = []
    samplers = list(dict.fromkeys([r["sampler"] for r in ref["rows"] if r["sampler"]] + list(mine["sampler"])))
    for sampler in samplers:
        for row in ref["rows"]:
            if row["sampler"] == sampler:
                cells = {f"NFE {b}": fmt(v, metric=metric) for b, v in row["values"].items()}
                lines.append({"source": paper, "model / run": row["model"], "sampler": sampler, **cells})
        for name, part in mine[mine["sampler"] == sampler].groupby("name", sort=False):
            cells = {
                f"NFE {int(r['nfe_budget'])}": fmt(r["mean"], r["std"], r["n"], metric) for _, r in part.iterrows()
            }
            lines.append({"source": measured, "model / run": name, "sampler": sampler, **cells})
    for row in ref["rows"]:
        if not row["sampler"]:
            cells = {f"NFE {b}": fmt(v, metric=metric) for b, v in row["values"].items()}
            lines.append({"source": paper, "model / run": row["model"], "sampler": "(not in flowlm)", **cells})
    columns = ["source", "model / run", "sampler", *(f"NFE {b}" for b in budgets)]
    return pd.DataFrame(lines, columns=columns).fillna("")


def calibration_table(auroc: pd.DataFrame) -> pd.DataFrame:
    """AUROC of confidence for telling right from wrong tokens: one line per (run, sampler, kind), one column per
    NFE budget; cells 'AUROC (share of wrong tokens)'."""
    budgets = sorted(auroc["nfe_budget"].unique())
    lines = []
    for (name, sampler, kind), part in auroc.groupby(["name", "sampler", "kind"], sort=False):
        line = {"run": name, "sampler": sampler, "confidence": kind}
        for _, row in part.iterrows():
            value = "n/a" if pd.isna(row["auroc"]) else f"{row['auroc']:.3f}"
            line[f"NFE {row['nfe_budget']}"] = f"{value} ({100 * row['wrong']:.0f} % wrong)"
        lines.append(line)
    return pd.DataFrame(lines, columns=["run", "sampler", "confidence", *(f"NFE {b}" for b in budgets)]).fillna("")


def to_markdown(table: pd.DataFrame) -> str:
    """A table of strings as GitHub Markdown."""
    head = "| " + " | ".join(map(str, table.columns)) + " |"
    rule = "|" + "---|" * len(table.columns)
    body = ["| " + " | ".join(str(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join([head, rule, *body])


def to_html(table: pd.DataFrame) -> str:
    """A table of strings as an HTML table (escaped)."""
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in table.columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>"
        for row in table.itertuples(index=False)
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _first(runs: pd.DataFrame, column: str):
    if column not in runs:
        return None
    values = runs[column].dropna()
    return values.iloc[0] if len(values) else None
