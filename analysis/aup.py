"""AUP, accuracy under parallelism (d3LLM, arXiv 2601.07568): the weighted area under a decoder's accuracy–TPF
curve, one number for how much parallelism (tokens per forward) it buys without losing accuracy."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

ALPHA = 3.0  # d3LLM's penalty factor α
DROP = 5.0  # points more than this many accuracy points below the lowest-TPF point are left out
ACCURACY_METRICS = ("accuracy", "valid_pct", "exact_match")  # percentages, higher is better: AUP is defined on these


def aup(
    tpf: Sequence[float],
    accuracy: Sequence[float],
    *,
    y_max: float | None = None,
    alpha: float = ALPHA,
    drop: float | None = DROP,
) -> float:
    """AUP of the points (ρ_i, y_i): ρ the tokens per forward (> 0), y the accuracy in % ([0, 100]).

    Sorted so that ρ_1 < ρ_2 < … < ρ_m (an equal ρ twice is an error: merge such points first); kept are the points
    with y_i ≥ y_min = y_1 − 5 (y_1: the accuracy at the lowest TPF). With W(y) = min(exp(−α (1 − y / y_max)), 1):

        AUP = ρ_1 y_1 + ½ Σ_{i=2}^{m} (ρ_i − ρ_{i−1}) (y_i W(y_i) + y_{i−1} W(y_{i−1}))

    as d3LLM defines it (its blog's AUP section: α = 3, y_max the highest accuracy any method reached on the task,
    the first rectangle unweighted). ``y_max`` defaults to this curve's best; it may not lie below it. ``drop``
    None keeps every point (lines scored over the same budgets: a cut would leave one line its slow end alone).
    """
    rho, y = np.asarray(tpf, dtype=float), np.asarray(accuracy, dtype=float)
    if rho.ndim != 1 or rho.shape != y.shape or rho.size == 0:
        raise ValueError(f"AUP needs as many TPF as accuracy values, at least one: got {rho.shape} and {y.shape}")
    if not (np.isfinite(rho).all() and np.isfinite(y).all()):
        raise ValueError("AUP needs finite TPF and accuracy values")
    if (rho <= 0).any():
        raise ValueError(f"tokens per forward must be > 0, got {rho.min()}")
    if ((y < 0) | (y > 100)).any():
        raise ValueError(f"accuracy is a percentage in [0, 100], got values in [{y.min()}, {y.max()}]")
    order = np.argsort(rho, kind="stable")
    rho, y = rho[order], y[order]
    if (np.diff(rho) == 0).any():
        raise ValueError(f"AUP needs distinct TPF values (a curve), got {rho.tolist()}: merge equal ones first")
    best = float(y.max()) if y_max is None else float(y_max)
    if best < y.max():
        raise ValueError(f"y_max {best} lies below this curve's best accuracy {y.max()}")
    keep = y >= y[0] - drop if drop is not None else np.ones_like(y, dtype=bool)
    rho, y = rho[keep], y[keep]
    weighted = y * weight(y, best, alpha)
    return float(rho[0] * y[0] + 0.5 * np.sum(np.diff(rho) * (weighted[1:] + weighted[:-1])))


def weight(y: np.ndarray, y_max: float, alpha: float = ALPHA) -> np.ndarray:
    """W(y) = min(exp(−α (1 − y / y_max)), 1); 1 everywhere when y_max = 0 (every accuracy is 0)."""
    if y_max <= 0:
        return np.ones_like(y)
    return np.minimum(np.exp(-alpha * (1 - y / y_max)), 1.0)


def curve(tpf: pd.Series, accuracy: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """The (TPF, accuracy) points of one decoder, missing values dropped, equal TPF merged to their mean accuracy
    (an adaptive decoder whose budgets all exceed what its rows need decodes the same at each)."""
    points = pd.DataFrame({"tpf": tpf.to_numpy(float), "y": accuracy.to_numpy(float)}).dropna()
    merged = points.groupby("tpf", sort=True)["y"].mean()
    return merged.index.to_numpy(float), merged.to_numpy(float)


def aup_lines(points: pd.DataFrame, keys: Sequence[str], metric: str, *, drop: float | None = DROP) -> pd.DataFrame:
    """AUP per line of ``points`` (grouped by ``keys``; columns ``tpf`` and ``metric``: one point each), with y_max the
    best ``metric`` over all of ``points`` (one task). Columns: keys, ``points``, ``tpf_min``, ``tpf_max``, ``aup``
    (NaN for a line without TPF, e.g. results logged before TPF was); ``drop`` as in ``aup``."""
    columns = [*keys, "points", "tpf_min", "tpf_max", "aup"]
    if metric not in ACCURACY_METRICS:
        raise ValueError(f"AUP is defined on accuracies in % ({ACCURACY_METRICS}), not {metric!r}")
    if points.empty:
        return pd.DataFrame(columns=columns)
    tpf = points["tpf"] if "tpf" in points else pd.Series(np.nan, index=points.index)
    y_max = float(points[metric].max())
    lines = []
    for key, part in points.assign(tpf=tpf).groupby(list(keys), sort=False, dropna=False):
        rho, y = curve(part["tpf"], part[metric])
        value = aup(rho, y, y_max=y_max, drop=drop) if len(rho) else math.nan
        low, high = (rho.min(), rho.max()) if len(rho) else (math.nan, math.nan)
        lines.append([*(key if isinstance(key, tuple) else (key,)), len(rho), low, high, value])
    return pd.DataFrame(lines, columns=columns)
