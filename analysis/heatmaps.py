"""Sweep heat-maps: the runs of one sweep that vary in two params, pivoted to a grid of a metric."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

# Params that differ between runs without being what a sweep varies: seeds, names, paths, checkpoints.
IGNORED_LEAVES = {
    "name",
    "run_name",
    "init_from",
    "teacher",
    "ckpt_path",
    "run_dir",
    "root",
    "data_dir",
    "cache_dir",
    "default_root_dir",
    "dirpath",
}


def varying_params(runs: pd.DataFrame) -> list[str]:
    """Param columns whose values differ among ``runs`` (seeds, names and paths left out, aliases merged)."""
    candidates = []
    for column in (c for c in runs.columns if c.startswith("params.")):
        leaf = column.rsplit("/", 1)[-1].removeprefix("params.")
        if leaf in IGNORED_LEAVES or leaf.endswith("seed"):
            continue
        if runs[column].astype(str).nunique() > 1:
            candidates.append(column)

    # The same setting can be logged under several names: Lightning logs a module's own hyper-parameters without
    # the config prefix (optim/lr beside method/optim/lr) and a sweep trial logs its overrides as trial/<key>
    # (trial/method.optim.lr). Columns with the same values run by run whose names end alike are one param: keep
    # the most qualified config name.
    def norm(column: str) -> str:
        return column.removeprefix("params.").removeprefix("trial/").replace(".", "/")

    def same(a: str, b: str) -> bool:
        na, nb = norm(a), norm(b)
        named_alike = na == nb or na.endswith("/" + nb) or nb.endswith("/" + na)
        return named_alike and runs[a].astype(str).equals(runs[b].astype(str))

    kept: list[str] = []
    for column in sorted(candidates, key=lambda c: (-len(norm(c)), "/trial/" in "/" + c.removeprefix("params."), c)):
        if not any(same(column, other) for other in kept):
            kept.append(column)
    return sorted(kept)


def label_trials(runs: pd.DataFrame) -> pd.DataFrame:
    """Runs of a sweep renamed by the values of the params their sweep varies (``name (rounds=4, threshold=0.9)``),
    so a trial's seeds pool into one line and different trials stay apart; other runs keep their name."""
    runs = runs.copy()
    for _, members in runs[runs["sweep"] != ""].groupby(["experiment", "sweep"], sort=False):
        varying = varying_params(members)
        if not varying:
            continue
        leaves = [c.rsplit("/", 1)[-1] for c in varying]
        keys = leaves if len(set(leaves)) == len(leaves) else [c.removeprefix("params.") for c in varying]
        values = members[varying].astype(str).itertuples(index=False)
        labels = [", ".join(f"{k}={v}" for k, v in zip(keys, row, strict=True)) for row in values]
        runs.loc[members.index, "name"] = [f"{n} ({label})" for n, label in zip(members["name"], labels, strict=True)]
    return runs


def sweep_grids(
    runs: pd.DataFrame,
    table: pd.DataFrame,
    metric: str,
    *,
    params: Sequence[str] | None = None,
    sampler: str | None = None,
    nfe_budget: int | None = None,
) -> list[dict]:
    """One grid per sweep (runs sharing a ``flowlm.sweep`` tag; else per experiment) × sampler, where the runs vary
    in exactly two params (or in the two ``params`` given). Each: {group, sampler, budget, x, y, grid}; the grid's
    cells are ``metric`` averaged over runs (seeds) at ``nfe_budget``, or at each run's largest budget if None.
    Grids with a single row or column are left out."""
    wanted = [_column_name(p) for p in params] if params else None
    if wanted is not None and len(wanted) != 2:
        raise ValueError(f"a heat-map needs exactly two params, got {list(params)}")
    out = []
    for group, members in runs.groupby([runs["experiment"], runs["sweep"]], sort=False):
        varying = varying_params(members)
        if wanted is not None:
            if not all(c in varying for c in wanted):
                continue
            axes = wanted
        elif len(varying) == 2:
            axes = varying
        else:
            continue
        rows = table[table["run_id"].isin(members["run_id"])].dropna(subset=[metric])
        for name in _samplers(rows, axes, sampler):
            cells = _cells(rows[rows["sampler"] == name], metric, nfe_budget)
            if cells.empty:
                continue
            cells = cells.merge(members[["run_id", *axes]], on="run_id")
            y, x = axes
            grid = cells.pivot_table(index=y, columns=x, values=metric, aggfunc="mean")
            grid = grid.reindex(index=_numeric_order(grid.index), columns=_numeric_order(grid.columns))
            if min(grid.shape) < 2:  # one row or one column is a line, not a sweep over two params
                continue
            grid.index.name, grid.columns.name = y.removeprefix("params."), x.removeprefix("params.")
            budget = f"NFE budget {nfe_budget}" if nfe_budget is not None else "each run's largest NFE budget"
            label = "/".join(g for g in group if g)
            out.append({"group": label, "sampler": name, "budget": budget, "x": x, "y": y, "grid": grid})
    return out


def _samplers(rows: pd.DataFrame, axes: Sequence[str], sampler: str | None) -> list[str]:
    if sampler is not None:
        return [sampler] if sampler in set(rows["sampler"]) else []
    present = list(dict.fromkeys(rows["sampler"]))
    # A sampling sweep over one sampler's options (eval/samplers/<name>/...) maps only that sampler.
    swept = [s for s in present if any(f"/samplers/{s}/" in a for a in axes)]
    return swept or present


def _cells(rows: pd.DataFrame, metric: str, nfe_budget: int | None) -> pd.DataFrame:
    if nfe_budget is not None:
        rows = rows[rows["nfe_budget"] == nfe_budget]
    else:
        rows = rows[rows["nfe_budget"] == rows.groupby("run_id")["nfe_budget"].transform("max")]
    return rows[["run_id", metric]]


def _column_name(param: str) -> str:
    # Accept the Hydra spelling (eval.samplers.pr.threshold) as well as MLflow's (eval/samplers/pr/threshold).
    return "params." + param.removeprefix("params.").replace(".", "/")


def _numeric_order(values: pd.Index) -> list:
    try:
        return sorted(values, key=float)
    except (TypeError, ValueError):
        return sorted(values, key=str)
