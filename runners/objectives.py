"""What a sweep optimises: ``optimized_metric``, evaluation keys ``eval/<sampler>/nfe<budget>/<metric>``.

A key is checked against the evaluation that will run (its samplers, budgets and metric names) before any compute,
and read back from the evaluation's result rows afterwards.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence

from callbacks.sampling_eval import COST_KEYS, Unloaded

# As callbacks.sampling_eval logs them (and analysis.load parses them).
KEY = re.compile(r"^eval/(?P<sampler>[^/]+)/nfe(?P<budget>\d+)/(?P<metric>[^/]+)$")
# Logged beside every task metric, for every sampler × budget: the NFE spent and its spread, TPF, seconds.
ALWAYS_LOGGED = COST_KEYS


class ObjectiveError(ValueError):
    """``optimized_metric`` names a value that the evaluation never logs: a mistake of the sweep, not of a trial."""


def objective_keys(spec: str | Sequence[str] | None) -> list[str]:
    """``optimized_metric`` as a list of keys (one per objective; none when unset)."""
    if spec is None:
        return []
    if isinstance(spec, str):
        return [spec]
    return [str(key) for key in spec]


def parse_key(key: str) -> tuple[str, int, str]:
    """(sampler, NFE budget, metric) of an evaluation key, or an ObjectiveError that shows the expected form."""
    match = KEY.match(key)
    if match is None:
        raise ObjectiveError(
            f"optimized_metric {key!r} is not an evaluation key eval/<sampler>/nfe<budget>/<metric> "
            "(e.g. eval/pr/nfe8/accuracy)"
        )
    return match["sampler"], int(match["budget"]), match["metric"]


def check_objectives(spec: str | Sequence[str] | None, evaluation, datamodule) -> None:
    """Refuse, before compute, objectives naming a sampler, budget or metric this evaluation does not log."""
    keys = objective_keys(spec)
    if not keys:
        return
    names = metric_names(evaluation, datamodule)
    for key in keys:
        sampler, budget, metric = parse_key(key)
        if sampler not in evaluation.samplers:
            runs = sorted(evaluation.samplers)
            raise ObjectiveError(f"optimized_metric {key!r}: no sampler {sampler!r} in this evaluation; it runs {runs}")
        if budget not in evaluation.nfe:
            raise ObjectiveError(
                f"optimized_metric {key!r}: NFE budget {budget} is not evaluated; eval.nfe = {list(evaluation.nfe)}"
            )
        if names is not None and metric not in names:
            raise ObjectiveError(f"optimized_metric {key!r}: this evaluation logs {sorted(names)}, not {metric!r}")


def metric_names(evaluation, datamodule) -> set[str] | None:
    """Names the evaluation logs per sampler × budget, read from an empty task metric; None if it cannot tell."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torchmetrics warns that compute() runs before update()
            names = set(evaluation.metric_factory(datamodule=Unloaded(datamodule)).compute())
    except Exception:  # a metric that cannot compute empty: the key is checked against the results instead
        return None
    return names | set(ALWAYS_LOGGED)


def objective_values(spec: str | Sequence[str] | None, rows: Sequence[dict]) -> list[float]:
    """The objectives read from evaluation result rows (one row per sampler × budget), in ``spec`` order."""
    values = []
    for key in objective_keys(spec):
        sampler, budget, metric = parse_key(key)
        hit = [r for r in rows if r.get("sampler") == sampler and r.get("nfe_budget") == budget]
        if not hit or metric not in hit[-1]:
            logged = [
                f"eval/{r['sampler']}/nfe{r['nfe_budget']}/{m}"
                for r in rows
                for m, v in r.items()
                if isinstance(v, float)  # the metrics, NFE and timing of a row; not its sampler, budget or step
            ]
            raise ObjectiveError(f"optimized_metric {key!r} was not logged; the evaluation logged {logged[:12]}")
        values.append(float(hit[-1][metric]))
    return values
