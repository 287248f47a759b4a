"""A run's evaluation rows as one CSV file in the results folder, in one schema (docs/results.md#results-csv).

Each evaluation (re)writes ``<dir>/<task>/<name>_seed<seed>.csv``: one row per sampler × NFE budget, the task,
model, sampler settings, the NFE spent (mean and its spread over rows) and tokens per forward, metrics, the
confidence AUROC, and the convergence facts (callbacks/convergence.py). The file name is the run's identity, so a
resumed or rerun run replaces its rows; the report (``flowlm-report --config-name report_sudoku``) merges every CSV
under the folder, from any machine or day.
"""

from __future__ import annotations

import csv
import json
import math
import platform
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch.callbacks import Callback

from callbacks.convergence import Convergence
from callbacks.sampling_eval import SamplingEvaluation, confidence_kind
from flowlm.metrics.calibration import auroc
from flowlm.project import git_commit

METRICS = ("accuracy", "exact_match", "valid_pct", "distinct_valid", "train_copy_pct")
# The NFE's spread over the rows, tokens per forward and the budget's forced share (callbacks/sampling_eval.py
# COST_KEYS); blank in older CSVs.
SPREAD = ("nfe_std", "nfe_min", "nfe_p50", "nfe_p90", "nfe_max", "tpf", "forced_share")


def method_label(module: object) -> str:
    """The method's name in the tables: its module's ``label`` (the class name for a module without one)."""
    return getattr(module, "label", "") or type(module).__name__


COLUMNS = [
    "task", "board", "difficulty", "conditional", "method", "variant", "name", "sampler", "confidence_kind",
    "sampler_settings", "nfe_budget", "nfe", *SPREAD, "seed", "eval_seed", "samples", *METRICS, "auroc", "wrong_pct",
    "calibration_tokens", "sec_per_sample", "eval_step", "steps", "budget_steps", "wall_s", "final_val_loss",
    "converged", "precision", "device", "git_commit", "date",
]  # fmt: skip


def variant_of(method_cfg: dict) -> str:
    """'distill' (an MDM teacher), 'init' (initialised from a checkpoint) or 'scratch'."""
    if method_cfg.get("teacher"):
        return "distill"
    return "init" if method_cfg.get("init_from") else "scratch"


class ResultsCSV(Callback):
    """After every evaluation, writes the run's rows (latest evaluation) to ``<dir>/<task>/<name>_seed<seed>.csv``,
    with the training facts of that step (a validation that did not sample leaves the file as it is); ``dir`` None
    writes nothing."""

    def __init__(self, *, dir: str | None = None) -> None:  # noqa: A002 - the config key
        self.dir = Path(dir) if dir else None
        self.path: Path | None = None

    def on_validation_end(self, trainer, pl_module) -> None:  # noqa: D102
        if self.dir is None or trainer.sanity_checking or not trainer.is_global_zero:
            return
        evaluation = next((c for c in trainer.callbacks if isinstance(c, SamplingEvaluation)), None)
        if evaluation is None or not evaluation.results:
            return
        if evaluation.results[0]["step"] != trainer.global_step:  # a val-loss-only validation (eval.every_n_steps):
            return  # the rows keep the training facts of the step their metrics were measured at
        convergence = next((c for c in trainer.callbacks if isinstance(c, Convergence)), None)
        machine = {"precision": str(trainer.precision), "device": device_kind(pl_module.device)}
        rows = self.rows(pl_module.run_config, method_label(pl_module), evaluation, convergence, machine)
        cfg = pl_module.run_config
        self.path = self.dir / str(cfg["task"]) / f"{cfg['name']}_seed{cfg['seed']}.csv"
        write_rows(self.path, rows)

    @staticmethod
    def rows(
        cfg: dict,
        method_label: str,
        evaluation: SamplingEvaluation,
        convergence: Convergence | None,
        machine: dict | None = None,
    ) -> list:
        """The CSV rows of the evaluation's latest results; ``machine``: the training precision and device kind
        (rows from different machines merge into one table, and the report says when a table mixes them)."""
        data, method = cfg.get("data", {}), cfg.get("method", {})
        n = int(data.get("box_rows", 0)) * int(data.get("box_cols", 0))
        facts = convergence.record() if convergence is not None else {}
        common = {
            "task": cfg.get("task"),
            "board": f"{n}x{n}" if n else "",
            "difficulty": data.get("difficulty") if data.get("conditional", True) else "uncond",
            "conditional": bool(data.get("conditional", True)),
            "method": method_label,  # the module's ``label``
            "variant": variant_of(method),
            "name": cfg.get("name"),
            "seed": cfg.get("seed"),
            **{k: facts.get(k, "") for k in ("steps", "budget_steps", "wall_s", "final_val_loss", "converged")},
            **{k: (machine or {}).get(k, "") for k in ("precision", "device")},
            "git_commit": git_commit(),
            "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        samplers = cfg.get("eval", {}).get("samplers", {})
        out = []
        for result in evaluation.results:
            name, budget = result["sampler"], result["nfe_budget"]
            settings = {k: v for k, v in samplers.get(name, {}).items() if k != "_target_"}
            conf, correct = evaluation.calibration_arrays(name, budget)
            row = {
                **common,
                "sampler": name,
                "confidence_kind": confidence_kind(evaluation.samplers[name]),
                "sampler_settings": json.dumps(settings, sort_keys=True),
                "nfe_budget": budget,
                "nfe": result["nfe"],
                "eval_seed": getattr(evaluation, "seed", ""),  # the draws' seed; ``seed`` is the model's
                "samples": samples_evaluated(evaluation, name, budget),
                **{k: result.get(k, "") for k in SPREAD},
                **{m: result.get(m, "") for m in METRICS},
                **calibration_columns(conf, correct),
                "sec_per_sample": result["sec_per_sample"],
                "eval_step": result["step"],
            }
            out.append(row)
        return out


def samples_evaluated(evaluation: SamplingEvaluation, sampler: str, budget: int) -> int | str:
    """The rows (puzzles, grids) the latest evaluation sampled for ``sampler`` at ``budget``, over every rank: the
    count behind a row's percentages, for the report's intervals ('' when not known)."""
    # every row's NFE, gathered over ranks at the epoch's end (SamplingEvaluation.on_validation_epoch_end)
    state = getattr(evaluation, "_states", {}).get((sampler, budget))
    return len(state["spent"]) if state is not None and "spent" in state else ""


def device_kind(device: torch.device) -> str:
    """The kind of machine a run trained on, as a row names it: the GPU's name, else the CPU's model name
    (``/proc/cpuinfo``; the platform's processor string elsewhere)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return f"cpu: {line.split(':', 1)[1].strip()}"
    return f"cpu: {platform.processor() or platform.machine()}"


def calibration_columns(confidence: np.ndarray, correct: np.ndarray) -> dict:
    """AUROC of confidence for right vs wrong tokens, % wrong and the token count (blank without tokens)."""
    if len(confidence) == 0:
        return {"auroc": "", "wrong_pct": "", "calibration_tokens": 0}
    value = auroc(confidence, correct)
    return {
        "auroc": "" if math.isnan(value) else value,
        "wrong_pct": 100 * float((~correct).mean()),
        "calibration_tokens": len(confidence),
    }


def write_rows(path: Path, rows: list[dict]) -> None:
    """Write ``rows`` in COLUMNS order, atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".csv.tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)
