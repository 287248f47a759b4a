"""MLflow → pandas: runs of chosen experiments (filtered by tags), their `eval/...` metrics in long format."""

from __future__ import annotations

import hashlib
import re
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from analysis.heatmaps import IGNORED_LEAVES, varying_params
from flowlm.redaction import redact_uri

# eval/<sampler>/nfe<budget>/<metric>, as callbacks.sampling_eval logs them.
EVAL_KEY = re.compile(r"^eval/(?P<sampler>[^/]+)/nfe(?P<nfe_budget>\d+)/(?P<metric>.+)$")
# Headline metric of a task, in order of preference (the first one an experiment logs is its primary metric).
PRIMARY_METRICS = ("accuracy", "valid_pct", "gen_ppl", "exact_match")
# Bookkeeping metrics logged beside every task metric (callbacks/sampling_eval.py COST_KEYS; runs logged before the
# NFE spread and TPF have only the first and the last).
COST_METRICS = ("nfe", "nfe_std", "nfe_min", "nfe_p50", "nfe_p90", "nfe_max", "tpf", "forced_share", "sec_per_sample")
RUN_COLUMNS = ["experiment", "run_id", "name", "method", "seed", "sweep", "trial", "setting"]
# Params that differ between runs of one setting: seeds (any key ending in `seed`), names, paths (the run folder
# holds the seed, a source checkpoint's path too), and knobs that change neither the model nor its scores.
SETTING_IGNORED_LEAVES = IGNORED_LEAVES | {
    "hf_cache_dir",
    "num_workers",
    "gen_workers",
    "num_proc",
    "val_batch_size",
    "enable_progress_bar",
    "enable_model_summary",
    "log_every_n_steps",
    "progress_every_s",
}


class NoRunsError(ValueError):
    """No run in the tracking store matches the request (or none holds evaluation metrics)."""


def load_runs(
    tracking_uri: str,
    *,
    experiments: Sequence[str] | None = None,
    tags: Mapping[str, str] | None = None,
    filter_string: str | None = None,
    exclude_experiments: Sequence[str] = (),
) -> pd.DataFrame:
    """One row per run, columns ``params.*``, ``tags.*``, ``metrics.*`` (latest values) plus RUN_COLUMNS.

    ``experiments`` are MLflow experiment names (a run's ``task``); none = every experiment except
    ``exclude_experiments``. ``tags`` keeps runs whose tags equal the given values (e.g. ``flowlm.sweep``);
    ``filter_string`` is any extra MLflow search filter. Raises NoRunsError with the available choices.
    """
    client = MlflowClient(tracking_uri=tracking_uri)
    known = {e.name: e for e in client.search_experiments(view_type=ViewType.ACTIVE_ONLY)}
    if experiments:
        unknown = [name for name in experiments if name not in known]
        if unknown:
            raise NoRunsError(
                f"unknown MLflow experiment(s) {unknown} in {redact_uri(tracking_uri)}; it holds: "
                f"{sorted(known) or 'none'}"
            )
        chosen = [known[name] for name in experiments]
    else:
        chosen = [e for name, e in known.items() if name not in exclude_experiments]
    clauses = [f"tags.`{key}` = '{value}'" for key, value in (tags or {}).items()]
    if filter_string:
        clauses.append(filter_string)
    names = {e.experiment_id: e.name for e in chosen}
    rows, token = [], None
    while chosen:
        page = client.search_runs(
            [e.experiment_id for e in chosen], " and ".join(clauses), max_results=1000, page_token=token
        )
        for run in page:
            row = {"run_id": run.info.run_id, "experiment": names[run.info.experiment_id]}
            row["status"], row["run_name"] = run.info.status, run.info.run_name
            row.update({f"params.{k}": v for k, v in run.data.params.items()})
            row.update({f"tags.{k}": v for k, v in run.data.tags.items()})
            row.update({f"metrics.{k}": v for k, v in run.data.metrics.items()})
            rows.append(row)
        token = page.token
        if not token:
            break
    if not rows:
        what = f"experiments {[e.name for e in chosen]}" if chosen else "any experiment"
        raise NoRunsError(
            f"no runs in {what} of {redact_uri(tracking_uri)} match tags={dict(tags or {})} filter={filter_string!r}"
        )
    runs = pd.DataFrame(rows)
    runs["name"] = _column(runs, "tags.flowlm.name").fillna(runs["run_name"])
    runs["method"] = _column(runs, "params.method/_target_").map(_short, na_action="ignore").fillna("")
    runs["seed"] = pd.to_numeric(_column(runs, "params.seed"), errors="coerce").astype("Int64")
    # "" rather than missing, so groupings keep runs outside any sweep.
    runs["sweep"] = _column(runs, "tags.flowlm.sweep").fillna("")
    runs["trial"] = _column(runs, "tags.flowlm.trial").fillna("")
    runs["setting"] = settings(runs)
    return label_settings(runs)


def setting_params(runs: pd.DataFrame) -> list[str]:
    """The param columns that define a run's setting: all but SETTING_IGNORED_LEAVES and seeds. A leaf is the last
    part of the key (``method/optim/lr`` → ``lr``; a sweep trial's override ``trial/method.optim.lr`` → ``lr``)."""
    kept = []
    for column in (c for c in runs.columns if c.startswith("params.")):
        leaf = re.split(r"[/.]", column.removeprefix("params."))[-1]
        if leaf not in SETTING_IGNORED_LEAVES and not leaf.endswith("seed"):
            kept.append(column)
    return sorted(kept)


def settings(runs: pd.DataFrame) -> pd.Series:
    """Per run, a short key of its setting: its sweep and its configuration without the seed (``setting_params``).
    Runs of one name and one setting are seeds of that setting; a name with several settings (a grid's trials and
    the base run, a run relaunched under its name with other overrides) is several lines of a report."""
    columns = setting_params(runs)
    values = runs[columns].astype("string").fillna("") if columns else pd.DataFrame(index=runs.index)
    keys = []
    for sweep, row in zip(runs["sweep"], values.itertuples(index=False), strict=True):
        text = "\n".join([f"sweep={sweep}", *(f"{c}={v}" for c, v in zip(columns, row, strict=True))])
        keys.append(hashlib.sha1(text.encode()).hexdigest()[:10])
    return pd.Series(keys, index=runs.index, dtype="object")


def label_settings(runs: pd.DataFrame) -> pd.DataFrame:
    """Give the settings that share a name (in one experiment) names of their own, so that no report line pools
    them: a sweep's runs get ``<name> [sweep <sweep>]`` beside runs outside it or in another sweep; runs outside any
    sweep get the params that tell their settings apart, ``<name> (lr=0.003)``. Runs within one sweep keep their
    name here: the report labels a sweep's trials by its swept values (``analysis.heatmaps.label_trials``)."""
    runs = runs.copy()
    for _, members in runs.groupby(["experiment", "name"], sort=False):
        if members["setting"].nunique() < 2:
            continue
        if members["sweep"].nunique() > 1:
            swept = members[members["sweep"] != ""]
            runs.loc[swept.index, "name"] = swept["name"] + " [sweep " + swept["sweep"] + "]"
        plain = members[members["sweep"] == ""]
        if plain["setting"].nunique() < 2:
            continue
        firsts = plain.drop_duplicates("setting")
        defining = set(setting_params(firsts))
        differ = [c for c in varying_params(firsts) if c in defining]  # aliases of one param merged
        leaves = [re.split(r"[/.]", c.removeprefix("params."))[-1] for c in differ]
        keys = leaves if len(set(leaves)) == len(leaves) else [c.removeprefix("params.") for c in differ]
        values = firsts[differ].astype("string").fillna("–").itertuples(index=False)
        label = {
            setting: ", ".join(f"{k}={v}" for k, v in zip(keys, row, strict=True)) or f"setting {setting}"
            for setting, row in zip(firsts["setting"], values, strict=True)
        }
        runs.loc[plain.index, "name"] = [
            f"{n} ({label[s]})" for n, s in zip(plain["name"], plain["setting"], strict=True)
        ]
    return runs


def long_metrics(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per run × sampler × NFE budget × metric parsed from ``eval/<sampler>/nfe<budget>/<metric>``."""
    frames = []
    for column in runs.columns:
        match = EVAL_KEY.match(column.removeprefix("metrics.")) if column.startswith("metrics.") else None
        if match is None:
            continue
        part = runs[RUN_COLUMNS].assign(value=runs[column]).dropna(subset=["value"])
        frames.append(
            part.assign(nfe_budget=int(match["nfe_budget"]), sampler=match["sampler"], metric=match["metric"])
        )
    if not frames:
        raise NoRunsError(f"none of the {len(runs)} runs logged eval/<sampler>/nfe<budget>/<metric> metrics")
    order = [*RUN_COLUMNS, "sampler", "nfe_budget", "metric", "value"]
    return pd.concat(frames, ignore_index=True)[order].sort_values(order[:-1], ignore_index=True)


def eval_table(long: pd.DataFrame) -> pd.DataFrame:
    """Wide form of ``long_metrics``: one row per run × sampler × budget, one column per metric."""
    keys = [*RUN_COLUMNS, "sampler", "nfe_budget"]
    wide = long.groupby([*keys, "metric"], dropna=False, sort=False)["value"].last().unstack("metric")
    wide = wide.reset_index()
    wide.columns.name = None
    return wide


def primary_metric(long: pd.DataFrame) -> str:
    """The headline metric these rows report (first of PRIMARY_METRICS present, else the first task metric)."""
    present = list(dict.fromkeys(long["metric"]))
    for name in PRIMARY_METRICS:
        if name in present:
            return name
    task = [m for m in present if m not in COST_METRICS]
    if not task:
        raise NoRunsError("the runs logged only NFE and timing, no task metric")
    return task[0]


def summarize(table: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Per experiment × name × setting × sampler × budget (runs of one setting differ only in their seed:
    ``settings``): mean, std (ddof 1; 0 for one run), run count of ``metric`` and the mean NFE actually spent and
    seconds per sample (and, where logged, its spread over rows and the tokens per forward); the runs' sweep."""
    keys = ["experiment", "name", "setting", "sampler", "nfe_budget"]
    rows = table.dropna(subset=[metric])
    grouped = rows.groupby(keys, sort=False)
    out = grouped[metric].agg(mean="mean", std="std", n="count")
    out["std"] = out["std"].fillna(0.0)
    for cost in COST_METRICS:
        out[cost] = grouped[cost].mean() if cost in rows else np.nan
    out["method"] = grouped["method"].first()
    out["sweep"] = grouped["sweep"].first()
    out["seeds"] = grouped["seed"].agg(lambda s: ",".join(str(v) for v in sorted(s.dropna().unique())))
    return out.reset_index().sort_values(keys, ignore_index=True)


def load_calibration(tracking_uri: str, runs: pd.DataFrame) -> pd.DataFrame:
    """Token-level (confidence, correct) pairs of each run's latest ``eval/step*/calibration.npz``.

    One row per run × sampler × budget, with arrays ``confidence`` and ``correct`` and the sampler's confidence
    ``kind`` ('a-priori' / 'a-posteriori'); empty when no run logged calibration data.
    """
    client = MlflowClient(tracking_uri=tracking_uri)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for _, run in runs.iterrows():
            path = _latest_calibration(client, run["run_id"])
            if path is None:
                continue
            local = client.download_artifacts(run["run_id"], path, tmp)
            with np.load(local) as data:
                group = data["group"]
                for i, (sampler, budget, kind) in enumerate(
                    zip(data["samplers"], data["budgets"], data["kinds"], strict=True)
                ):
                    pick = group == i
                    rows.append(
                        {
                            **{c: run[c] for c in RUN_COLUMNS},
                            "sampler": str(sampler),
                            "nfe_budget": int(budget),
                            "kind": str(kind),
                            "confidence": data["confidence"][pick].astype(np.float64),
                            "correct": data["correct"][pick].astype(bool),
                        }
                    )
            Path(local).unlink()
    return pd.DataFrame(rows, columns=[*RUN_COLUMNS, "sampler", "nfe_budget", "kind", "confidence", "correct"])


def _latest_calibration(client: MlflowClient, run_id: str) -> str | None:
    steps = sorted((f.path for f in client.list_artifacts(run_id, "eval") if f.is_dir), reverse=True)
    for step in steps:
        for item in client.list_artifacts(run_id, step):
            if item.path.endswith("calibration.npz"):
                return item.path
    return None


def _column(frame: pd.DataFrame, name: str) -> pd.Series:
    return frame[name] if name in frame else pd.Series(pd.NA, index=frame.index, dtype="object")


def _short(target: str) -> str:
    # lightning_modules.mdm.MDMModule → MDMModule: the class says the method family, the path adds nothing.
    return str(target).rsplit(".", 1)[-1]
