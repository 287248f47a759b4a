"""The papers' Sudoku tables from the results CSVs (callbacks/results_csv.py): merged over every CSV of the results
folder, deduplicated per (row, seed), mean ± std over seeds, the papers' numbers beside each row, and one verdict
per claim computed from the numbers (docs/results.md)."""

from __future__ import annotations

import csv
import io
import json
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import pandas as pd

from analysis import plots
from analysis.aup import aup_lines
from analysis.report import REPORT_HTML, REPORT_MD, Report, Section, _inline, _render_html, _render_markdown
from analysis.tables import reference_numbers
from flowlm.removed import REMOVED_SAMPLER_OPTIONS
from flowlm.tasks.sudoku import SudokuLayout, clues_for

# Options the adaptive MDM samplers gained after rows were recorded (issue 37's block cache), at the values that
# decode as before (their defaults: flowlm/samplers/mdm_adaptive.py AdaptiveMDMSampler): rows that name them at
# these values and rows written before them are one sampler. Another value (a cache, blocks) is another sampler.
ADDED_SAMPLER_OPTIONS = {"block_length": None, "cache": "none", "refresh": None}
# Options added at a value that decodes as before at temperature 0 only (issue 48: the threshold sampler reads the
# drawn token's p at T > 0, where it read max p; at T = 0 both are max p): merged with earlier rows at T = 0 only.
ADDED_GREEDY_OPTIONS = {"confidence": "sampled"}
# A table row's identity; with `seed` the identity of one measurement (the latest `date` wins on duplicates).
KEY = ["board", "difficulty", "method", "variant", "sampler", "sampler_settings", "nfe_budget"]
MEASURES = [
    "accuracy", "valid_pct", "distinct_valid", "train_copy_pct", "auroc", "wrong_pct", "nfe", "nfe_std", "tpf",
    "forced_share",
]  # fmt: skip
CAPPED = ", capped"  # a line whose NFE budget forced commits beyond its rule (forced_share > 0): not the rule alone
TRAINING = ["steps", "budget_steps", "wall_s", "final_val_loss"]
DIFFICULTIES = ("easy", "medium", "hard")
UNCOND_NFE = (1, 3, 9, 27, 36)  # the paper's 1 / 3 / 9 / 27 / 81 on a 36-cell board
PAPER_NFE = dict(zip(UNCOND_NFE, (1, 3, 9, 27, 81), strict=True))  # an unconditional NFE here → the paper's
LOW_NFE = 4  # the released PR setting: R = 4, N = 1
# Row order of the tables: model (method, variant) then sampler.
MODELS = [("MDM", "scratch"), ("FMLM+", "scratch"), ("FMLM+", "distill"), ("FMLM+", "init"), ("MLFM", "init")]
SAMPLERS = ["ancestral", "confidence", "pr", "a_priori", "mlfm", "mlfm_ccfg", "mlfm_ccfg_otp"]
PAPER_METHOD = {"MDLM": "MDM", "FMLM+": "FMLM+"}  # reference.yaml's model → the suite's method


class NoResultsError(ValueError):
    """The results folder holds no results CSV."""


class ResultsCSVWarning(UserWarning):
    """A CSV under the results folder, or rows of one, that the report skipped; the message names the file."""


REQUIRED = [*KEY, "seed", "date"]  # a results CSV's header holds these (callbacks/results_csv.py COLUMNS)
NUMERIC = ["nfe_budget", "seed", "eval_seed", "eval_step", "samples", *MEASURES, *TRAINING]  # blank or a number
DATE_FORMAT = "%Y-%m-%dT%H:%M:%SZ"  # callbacks/results_csv.py's `date`
ROWS_CSV = "rows.csv"  # the report's merged rows: the results schema, so never read back (report_folders)
STEP = "eval_step"  # the training step of the weights a row sampled (the curve's checkpoints, the final weights)
# Rows of an earlier protocol, kept for the record and out of the tables (results/sudoku/superseded/README.md).
SUPERSEDED = "superseded"


def report_folders(folder: Path) -> set[Path]:
    """The folders under ``folder`` holding a report this module wrote (report.md beside rows.csv, e.g. one copied
    from another machine)."""
    return {p.parent for p in folder.rglob(REPORT_MD) if (p.parent / ROWS_CSV).is_file()}


def read_results(folder: str | Path, *, skip: Iterable[str | Path] = ()) -> pd.DataFrame:
    """Every results CSV under ``folder`` (any depth), one frame; the same (row, seed) measured twice keeps its latest
    row (by ``date``) drawn with the model's own seed (``eval_seed``), another seed's only where there is none. Not
    read: the folders in ``skip`` (the report's own ``out``), any folder holding a report (report_folders), and, each
    named in a ResultsCSVWarning, a file that is empty, not UTF-8 or whose header is not the results schema, and the
    rows of a file with a wrong field count (a cut line), a non-number in a numeric column (a decimal comma) or a
    date not in DATE_FORMAT. ``attrs["skipped"]``: 'path (why)' of each. A (row, seed) is measured once per
    checkpoint (``eval_step``, the run's ``steps`` where blank): the curve's points are rows of their own. A folder named SUPERSEDED below ``folder``
    holds rows of an earlier protocol: not read (read it as ``folder`` itself to see them)."""
    folder = Path(folder)
    skip = [Path(s).resolve() for s in skip]
    skip += [p.resolve() for p in folder.rglob(SUPERSEDED) if p.is_dir()] if folder.is_dir() else []
    reports = report_folders(folder) if folder.is_dir() else set()
    files = [
        f
        for f in (sorted(folder.rglob("*.csv")) if folder.is_dir() else [])
        if not any(f.is_relative_to(r) for r in reports) and not any(f.resolve().is_relative_to(s) for s in skip)
    ]
    if not files:
        raise NoResultsError(
            f"no results CSV under {folder.resolve()} (written by runs with callbacks.results_csv.dir)"
        )
    frames, skipped = [], []
    for f in files:
        frame, short, detail = _read_results_csv(f)
        if detail:
            warnings.warn(f"{f}: {detail}", ResultsCSVWarning, stacklevel=2)
            skipped.append(f"{f.relative_to(folder)} ({short})")
        if frame is not None:
            frames.append(frame.assign(file=str(f)))
    if not frames:
        raise NoResultsError(f"no readable results CSV under {folder.resolve()}: skipped {', '.join(skipped)}")
    rows = pd.concat(frames, ignore_index=True)
    rows["sampler_settings"] = rows["sampler_settings"].fillna("{}").map(current_settings)
    rows["converged"] = rows["converged"].astype(str).str.lower().eq("true")
    # the checkpoint's step: a row written before the curves (eval_step blank) was the run's final weights
    step = pd.to_numeric(rows["eval_step"], errors="coerce") if STEP in rows else pd.Series(float("nan"), rows.index)
    rows[STEP] = step.fillna(pd.to_numeric(rows["steps"], errors="coerce"))
    # one row per model seed: the model's own draws (eval_seed blank, in older CSVs, or the seed) over an evaluation
    # at another seed (flowlm-eval seed=N, whose rows name it), then the latest
    own = rows["eval_seed"].isna() | (rows["eval_seed"] == rows["seed"]) if "eval_seed" in rows else True
    rows = rows.assign(_own=own).sort_values(["_own", "date"], kind="stable")
    rows = rows.drop_duplicates([*KEY, "seed", STEP], keep="last").drop(columns="_own").reset_index(drop=True)
    rows.attrs["skipped"] = skipped
    return rows


def current_settings(text: str) -> str:
    """Recorded sampler settings without the options that leave the sampler as it was: a removed option at its kept
    value (``REMOVED_SAMPLER_OPTIONS``) and an added one at the value that decodes as before it existed
    (``ADDED_SAMPLER_OPTIONS``; ``ADDED_GREEDY_OPTIONS`` at temperature 0), so rows recorded on either side of the
    change are one sampler (their seeds aggregate together)."""
    try:
        settings = json.loads(text)
    except ValueError:
        return text
    if not isinstance(settings, dict):
        return text
    unchanged = {**REMOVED_SAMPLER_OPTIONS, **ADDED_SAMPLER_OPTIONS}
    if settings.get("temperature") == 0:
        unchanged.update(ADDED_GREEDY_OPTIONS)
    kept = {k: v for k, v in settings.items() if k not in unchanged or unchanged[k] != v}
    return text if len(kept) == len(settings) else json.dumps(kept, sort_keys=True)


def _read_results_csv(path: Path) -> tuple[pd.DataFrame | None, str, str]:
    """The good rows of one CSV (None: the whole file is skipped), and what was skipped, in short and in full ('' when
    nothing was)."""
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            header = next(reader, [])
            if not any(h.strip() for h in header):
                return None, "empty", "empty file, skipped"
            missing = [c for c in REQUIRED if c not in header]
            if missing:
                return None, "not a results CSV", f"not a results CSV (its header lacks {missing}), skipped"
            good, bad = [], []
            for record in reader:
                if not record:  # a blank line: pandas skips it too
                    continue
                problem = _row_problem(header, record)
                if problem:
                    bad.append(f"line {reader.line_num}: {problem}")
                else:
                    good.append(record)
    except UnicodeDecodeError as err:
        return None, "not UTF-8", f"not UTF-8 text ({err.reason} at byte {err.start}), skipped"
    except csv.Error as err:
        return None, "not a readable CSV", f"not a readable CSV ({err}), skipped"
    text = io.StringIO()
    csv.writer(text).writerows([header, *good])
    text.seek(0)
    frame = pd.read_csv(text, keep_default_na=True, dtype={"precision": str, "device": str})
    if not bad:
        return frame, "", ""
    counts = f"{len(bad)} of {len(bad) + len(good)} rows"
    return frame, f"{counts} skipped", f"skipped {counts}: {'; '.join(bad)}"


def _row_problem(header: list[str], record: list[str]) -> str:
    """Why a CSV record is not a results row ('' when it is)."""
    if len(record) != len(header):
        return f"{len(record)} fields where the header has {len(header)} (a cut line?)"
    values = dict(zip(header, record, strict=True))
    for column in NUMERIC:
        value = values.get(column, "").strip()
        if value and not _is_number(value):
            comma = " (a decimal comma?)" if _is_number(value.replace(",", ".", 1)) else ""
            return f"{column} {value!r} is not a number{comma}"
    try:
        datetime.strptime(values["date"], DATE_FORMAT)
    except ValueError:
        return f"date {values['date']!r} is not {DATE_FORMAT} (a cut line?)"
    return ""


def _is_number(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return "_" not in value  # float() reads '1_0'; pandas does not


def final_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows of each run's final weights (``eval_step`` equal to the run's ``steps``, or either blank): the
    tables' and verdicts' rows; the earlier checkpoints' rows are the accuracy-versus-training curve's points."""
    step = pd.to_numeric(rows[STEP], errors="coerce") if STEP in rows else pd.Series(float("nan"), rows.index)
    steps = pd.to_numeric(rows["steps"], errors="coerce") if "steps" in rows else step * float("nan")
    return rows[step.isna() | steps.isna() | (step >= steps)]


def aggregate(rows: pd.DataFrame) -> pd.DataFrame:
    """One line per KEY over the final weights' rows (``final_rows``: a curve's point never joins a cell): mean, std
    (ddof 1; 0 for one seed) and seed count of every measure (``tpf`` completed by ``with_tpf``); training facts as
    means, ``converged`` as the number of converged seeds."""
    rows = with_tpf(final_rows(rows).reset_index(drop=True))
    grouped = rows.groupby(KEY, sort=False, dropna=False)
    out = grouped.size().rename("n").to_frame()
    for m in MEASURES + TRAINING:
        if m in rows:
            values = pd.to_numeric(rows[m], errors="coerce")
            out[f"{m}_mean"] = values.groupby([rows[k] for k in KEY], sort=False, dropna=False).mean()
            out[f"{m}_std"] = values.groupby([rows[k] for k in KEY], sort=False, dropna=False).std().fillna(0.0)
    # the most NFE one seed spent on average (an adaptive sampler's spend varies by seed): "within a budget" means
    # within it on every seed (best_within_nfe)
    out["nfe_seed_max"] = (
        pd.to_numeric(rows["nfe"], errors="coerce").groupby([rows[k] for k in KEY], sort=False, dropna=False).max()
    )
    out["converged"] = grouped["converged"].sum()
    if "confidence_kind" in rows:  # the sampler's declared kind (flowlm/samplers), one per sampler
        out["confidence_kind"] = grouped["confidence_kind"].first()
    out["seeds"] = grouped["seed"].agg(lambda s: ",".join(str(v) for v in sorted(s.unique())))
    return out.reset_index()


def with_tpf(rows: pd.DataFrame) -> pd.DataFrame:
    """``rows`` with tokens per forward in every row: the logged ``tpf`` (the mean over rows of generated positions
    / NFE spent), else, for rows of CSVs written before TPF was, generated positions / mean NFE: the same for
    fixed-step samplers, at most the logged mean for adaptive ones (Jensen: mean(g / n) ≥ g / mean(n))."""
    generated = pd.Series([generated_positions(b, d) for b, d in zip(rows["board"], rows["difficulty"], strict=True)])
    derived = generated.set_axis(rows.index) / pd.to_numeric(rows["nfe"], errors="coerce").where(lambda v: v > 0)
    logged = pd.to_numeric(rows["tpf"], errors="coerce") if "tpf" in rows else derived * float("nan")
    return rows.assign(tpf=logged.fillna(derived))


def generated_positions(board: str, difficulty: str) -> int:
    """Positions a sampler generates per row on an n×n board: its sequence less the prompt (flowlm.tasks.sudoku's
    SudokuLayout: the solution half's cells and separators when conditional, the n² cells otherwise)."""
    n = int(str(board).split("x")[0])
    layout = SudokuLayout(SimpleNamespace(n=n), conditional=difficulty != "uncond")  # the layout reads only n
    return layout.seq_len - layout.prompt_len


def empty_cells(board: str, difficulty: str) -> int:
    """Cells to fill on an n×n board: n² unconditional, n² − clues (flowlm.tasks.sudoku.clues_for) otherwise."""
    n = int(str(board).split("x")[0])
    if difficulty == "uncond":
        return n * n
    return n * n - clues_for(SimpleNamespace(n=n), difficulty)  # clues_for reads only the board size


@dataclass(frozen=True)
class Cell:
    """One aggregated value: mean, std over seeds, seed count."""

    mean: float
    std: float
    n: int

    def format(self, decimals: int = 1) -> str:
        """'mean ± std' with ``decimals``; the mean alone for one seed (whose std is no spread)."""
        return f"{self.mean:.{decimals}f} ± {self.std:.{decimals}f}" if self.n > 1 else f"{self.mean:.{decimals}f}"

    def __str__(self) -> str:
        return self.format(1)


def cell(agg: pd.DataFrame, metric: str, **where) -> Cell | None:
    """The aggregated ``metric`` of the one line matching ``where`` (None when not measured)."""
    pick = agg
    for key, value in where.items():
        pick = pick[pick[key] == value]
    pick = pick.dropna(subset=[f"{metric}_mean"]) if f"{metric}_mean" in pick else pick.iloc[0:0]
    if pick.empty:
        return None
    row = pick.iloc[0]
    return Cell(float(row[f"{metric}_mean"]), float(row[f"{metric}_std"]), int(row["n"]))


def _label(method: str, variant: str) -> str:
    return method if method in ("MDM", "MLFM") else f"{method} {variant}"


def _models(agg: pd.DataFrame) -> list[tuple[str, str, str]]:
    """(method, variant, sampler) present, in the tables' order."""
    present = set(zip(agg["method"], agg["variant"], agg["sampler"], strict=True))
    order = [(m, v, s) for m, v in MODELS for s in SAMPLERS if (m, v, s) in present]
    return order + sorted(present - set(order))


def _training(agg: pd.DataFrame, **where) -> str:
    """'budget steps (own steps), wall, final val loss, converged k/n' of a model on one task."""
    pick = agg
    for key, value in where.items():
        pick = pick[pick[key] == value]
    if pick.empty or "budget_steps_mean" not in pick:
        return ""
    r = pick.iloc[0]
    own = "" if r["budget_steps_mean"] == r["steps_mean"] else f" ({r['steps_mean']:.0f} own)"
    flag = "converged" if r["converged"] == r["n"] else f"NOT converged in {int(r['n'] - r['converged'])}/{r['n']}"
    return (
        f"{r['budget_steps_mean']:.0f} steps{own}, {r['wall_s_mean'] / 60:.1f} min, "
        f"val loss {r['final_val_loss_mean']:.3f}, {flag}"
    )


def conditional_table(agg: pd.DataFrame) -> pd.DataFrame:
    """Accuracy %: one line per model × sampler; per difficulty NFE 4, NFE = empty cells, and the training facts.
    The papers' rows (9×9) first, labelled with their scale."""
    cond = agg[agg["difficulty"].isin(DIFFICULTIES)]
    board = cond["board"].iloc[0] if len(cond) else "6x6"
    full = {d: empty_cells(board, d) for d in DIFFICULTIES}
    lines = []
    for d in DIFFICULTIES:  # the papers' rows: the same layout, their NFE named where it is not 4
        for ref in reference_numbers()[f"sudoku_{d}"]["rows"]:
            line = next(
                (x for x in lines if x["model"] == ref["model"] and x["sampler"] == (ref["sampler"] or "")), None
            )
            if line is None:
                line = {"source": reference_numbers()[f"sudoku_{d}"]["label"], "model": ref["model"]}
                line["sampler"] = ref["sampler"] or ""
                lines.append(line)
            for nfe, value in ref["values"].items():
                column = f"{d} @4" if nfe == LOW_NFE else f"{d} @full"
                line[column] = f"{value:.1f}" + ("" if nfe == LOW_NFE else f" (NFE {nfe})")
    for method, variant, sampler in _models(cond):
        line = {"source": f"measured, {board}", "model": _label(method, variant), "sampler": sampler}
        for d in DIFFICULTIES:
            for column, nfe in ((f"{d} @4", LOW_NFE), (f"{d} @full", full[d])):
                got = cell(
                    cond, "accuracy", method=method, variant=variant, sampler=sampler, difficulty=d, nfe_budget=nfe
                )
                line[column] = "" if got is None else str(got)
            line[f"{d} training"] = _training(cond, method=method, variant=variant, difficulty=d)
        lines.append(line)
    columns = ["source", "model", "sampler"]
    columns += [f"{d} {c}" for d in DIFFICULTIES for c in ("@4", "@full", "training")]
    table = pd.DataFrame(lines, columns=columns).fillna("")
    return table.rename(columns={f"{d} @full": f"{d} @{full[d]} (full)" for d in DIFFICULTIES})


def unconditional_table(agg: pd.DataFrame) -> pd.DataFrame:
    """Per model × sampler and NFE 1 / 3 / 9 / 27 / 36: '% valid · distinct valid · % copies of training grids'; the
    papers' % valid (9×9, NFE 81 under 36) first."""
    unc = agg[agg["difficulty"] == "uncond"]
    ref = reference_numbers()["sudoku_uncond"]
    lines = []
    for row in ref["rows"]:
        line = {"source": ref["label"], "model": row["model"], "sampler": row["sampler"]}
        for nfe in UNCOND_NFE:
            value = row["values"].get(PAPER_NFE[nfe])
            line[f"NFE {nfe}"] = "" if value is None else f"{value:.1f}" + ("" if nfe == PAPER_NFE[nfe] else " (81)")
        lines.append(line)
    board = unc["board"].iloc[0] if len(unc) else "6x6"
    for method, variant, sampler in _models(unc):
        line = {"source": f"measured, {board}", "model": _label(method, variant), "sampler": sampler}
        for nfe in UNCOND_NFE:
            where = dict(method=method, variant=variant, sampler=sampler, nfe_budget=nfe)
            valid = cell(unc, "valid_pct", **where)
            distinct, copies = cell(unc, "distinct_valid", **where), cell(unc, "train_copy_pct", **where)
            line[f"NFE {nfe}"] = "" if valid is None else f"{valid} · {distinct.mean:.0f} · {copies.mean:.1f}"
        line["training"] = _training(unc, method=method, variant=variant)
        lines.append(line)
    columns = ["source", "model", "sampler", *(f"NFE {n}" for n in UNCOND_NFE), "training"]
    return pd.DataFrame(lines, columns=columns).fillna("")


def calibration_table(agg: pd.DataFrame) -> pd.DataFrame:
    """AUROC of per-token confidence for right vs wrong tokens, per task × model × sampler, at NFE 4 and full NFE
    (mean ± std over seeds; % wrong tokens in brackets)."""
    if "auroc_mean" not in agg:
        return pd.DataFrame(columns=["task", "model", "sampler", "confidence", "@4", "@full"])
    lines = []
    for d in [*DIFFICULTIES, "uncond"]:
        part = agg[agg["difficulty"] == d]
        if part.empty:
            continue
        full = empty_cells(part["board"].iloc[0], d)
        for method, variant, sampler in _models(part):
            where = dict(method=method, variant=variant, sampler=sampler)
            kind = part[(part["method"] == method) & (part["sampler"] == sampler)]["confidence_kind"].iloc[0]
            line = {"task": d, "model": _label(method, variant), "sampler": sampler, "confidence": kind}
            for column, nfe in (("@4", LOW_NFE), ("@full", full)):
                got, wrong = (
                    cell(part, "auroc", **where, nfe_budget=nfe),
                    cell(part, "wrong_pct", **where, nfe_budget=nfe),
                )
                line[column] = "" if got is None else f"{got.format(3)} ({wrong.mean:.0f} % wrong)"
            lines.append(line)
    return pd.DataFrame(lines, columns=["task", "model", "sampler", "confidence", "@4", "@full"])


def aup_table(agg: pd.DataFrame) -> pd.DataFrame:
    """AUP (analysis/aup.py) per task × model × sampler (× settings, where a sampler ran with several) over its NFE
    budgets: accuracy (conditional) or % valid (unconditional) against tokens per forward, means over seeds; y_max =
    the task's best line."""
    columns = ["task", "model", "sampler", "points", "TPF", "AUP"]
    lines = []
    for d in [*DIFFICULTIES, "uncond"]:
        metric = "valid_pct" if d == "uncond" else "accuracy"
        part = agg[agg["difficulty"] == d]
        if part.empty or f"{metric}_mean" not in part:
            continue
        points = part.rename(columns={f"{metric}_mean": metric, "tpf_mean": "tpf"}).dropna(subset=[metric])
        got = aup_lines(points, ["method", "variant", "sampler", "sampler_settings"], metric)
        for method, variant, sampler in _models(points):
            mine = got[(got["method"] == method) & (got["variant"] == variant) & (got["sampler"] == sampler)]
            labels = settings_labels(list(mine["sampler_settings"]))
            for line in mine.itertuples(index=False):
                label = labels[line.sampler_settings]
                lines.append(
                    {
                        "task": d,
                        "model": _label(method, variant),
                        "sampler": f"{sampler} {label}" if label else sampler,
                        "points": line.points,
                        "TPF": "" if pd.isna(line.tpf_min) else f"{line.tpf_min:.3g}–{line.tpf_max:.3g}",
                        "AUP": "" if pd.isna(line.aup) else f"{line.aup:.1f}",
                    }
                )
    return pd.DataFrame(lines, columns=columns)


# ---------------------------------------------------------------- accuracy versus training
CURVE_SAMPLERS = {"MDM": ("ancestral", "confidence"), "FMLM+": ("pr",)}  # the headline lines' samplers
LAST_QUARTER = 0.75  # the gain over the last quarter of the steps: final point minus the point at ≤ 3/4 of them
BUDGET_GAIN = 1.0  # the budget is accepted where the easy MDM gains less than this (points) at one token per call


def curve_nfe(board: str, difficulty: str) -> dict[str, tuple[int, ...]]:
    """The headline NFE budgets of the curves per method: conditional, the MDM at one call per generated position
    (the paper's MDLM regime) and at 4, PR at 4 (R = 4, N = 1); unconditional, the MDM at one call per cell and at
    9, PR at 9 (the paper's headline budget) and 4 (its 9 tokens a call mapped to 36 cells)."""
    if difficulty == "uncond":
        return {"MDM": (empty_cells(board, difficulty), 9), "FMLM+": (9, LOW_NFE)}
    return {"MDM": (generated_positions(board, difficulty), LOW_NFE), "FMLM+": (LOW_NFE,)}


def curve_points(rows: pd.DataFrame) -> pd.DataFrame:
    """Accuracy (conditional) / % valid (unconditional) against the training step (``eval_step``: the model's own
    steps) of the headline lines (``curve_nfe``, ``CURVE_SAMPLERS``): per task × model × sampler × NFE × step, the
    mean, min and max over seeds and the seeds; the final weights' rows are the last point."""
    columns = ["task", "board", "model", "method", "variant", "sampler", "nfe_budget", "step", "mean", "min", "max"]
    columns += ["n", "seeds"]
    lines = []
    for (d, board, method, variant, sampler, nfe), part in rows.groupby(
        ["difficulty", "board", "method", "variant", "sampler", "nfe_budget"], sort=False
    ):
        if sampler not in CURVE_SAMPLERS.get(method, ()) or nfe not in curve_nfe(board, d).get(method, ()):
            continue
        values = pd.to_numeric(part["valid_pct" if d == "uncond" else "accuracy"], errors="coerce")
        for step, at in values.groupby(pd.to_numeric(part[STEP], errors="coerce"), sort=True):
            at = at.dropna()
            if at.empty:
                continue
            seeds = sorted(int(x) for x in part.loc[at.index, "seed"])
            lines.append(
                [d, board, _label(method, variant), method, variant, sampler, int(nfe), int(step), at.mean(), at.min(),
                 at.max(), len(at), ",".join(map(str, seeds))]
            )  # fmt: skip
    order = {d: i for i, d in enumerate([*DIFFICULTIES, "uncond"])}
    table = pd.DataFrame(lines, columns=columns)
    return table.sort_values(
        ["task", "model", "sampler", "nfe_budget", "step"], key=lambda c: c.map(order) if c.name == "task" else c
    ).reset_index(drop=True)


def curve_gains(points: pd.DataFrame) -> pd.DataFrame:
    """One line per curve: its final step and value, the point at the last checkpoint at or before 3/4 of the final
    step (``LAST_QUARTER``), and the gain between them in points (NaN where the curve has no such point)."""
    columns = ["task", "board", "model", "sampler", "NFE", "points", "final step", "final", "step at 3/4", "at 3/4"]
    columns += ["gain"]
    lines = []
    keys = ["task", "board", "model", "sampler", "nfe_budget"]
    for (task, board, model, sampler, nfe), curve in points.groupby(keys, sort=False):
        final = curve.iloc[-1]
        earlier = curve[curve["step"] <= LAST_QUARTER * final["step"]]
        quarter = earlier.iloc[-1] if len(earlier) else None
        lines.append(
            [task, board, model, sampler, nfe, len(curve), int(final["step"]), final["mean"],
             None if quarter is None else int(quarter["step"]), None if quarter is None else quarter["mean"],
             float("nan") if quarter is None else final["mean"] - quarter["mean"]]
        )  # fmt: skip
    return pd.DataFrame(lines, columns=columns)


def curve_table(gains: pd.DataFrame) -> pd.DataFrame:
    """``curve_gains`` for the report: values to one decimal, the gain signed ('—' without a point at 3/4)."""
    table = gains.drop(columns="board")
    table["final"] = table["final"].map(lambda v: f"{v:.1f}")
    table["at 3/4"] = table["at 3/4"].map(lambda v: "" if pd.isna(v) else f"{v:.1f}")
    table["step at 3/4"] = table["step at 3/4"].map(lambda v: "" if pd.isna(v) else f"{int(v)}")
    table["gain"] = table["gain"].map(lambda v: "—" if pd.isna(v) else f"{v:+.1f}")
    return table.rename(columns={"gain": "gain over the last quarter (points)"})


def budget_check(gains: pd.DataFrame) -> str:
    """Whether the training budget is accepted: the easy MDM's curves at one call per generated position gain less
    than BUDGET_GAIN points over the last quarter of the steps (issue 47); one sentence."""
    easy = gains[(gains["task"] == "easy") & (gains["model"] == "MDM")]
    one = [nfe == generated_positions(board, "easy") for nfe, board in zip(easy["NFE"], easy["board"], strict=True)]
    easy = easy[pd.Series(one, index=easy.index, dtype=bool)].dropna(subset=["gain"])
    rule = (
        f"the easy MDM's curves at one call per generated position gain < {BUDGET_GAIN:g} point over the last quarter"
    )
    if easy.empty:
        return f"Budget check ({rule}): not measured yet (no easy MDM curve with a point at 3/4 of its steps)."
    said = ", ".join(f"{r.sampler} {r.gain:+.1f}" for r in easy.itertuples())
    ok = bool((easy["gain"] < BUDGET_GAIN).all())
    return f"Budget check ({rule}): {said} → " + (
        "accepted." if ok else "NOT accepted: the models were still learning."
    )


# ---------------------------------------------------------------- verdicts
REPRODUCES, FAILS, INCONCLUSIVE = "reproduces", "does not reproduce at this scale", "inconclusive"


def verdict(better: Cell | None, worse: Cell | None) -> str:
    """The claim 'better > worse': reproduces if the means differ by more than the two stds together, does not if
    they differ the other way by as much, else inconclusive (overlapping ± std); one seed is always inconclusive."""
    if better is None or worse is None:
        return "not measured"
    if min(better.n, worse.n) < 2:
        return f"{INCONCLUSIVE} (one seed, no ± std)"
    margin = better.std + worse.std
    if better.mean - worse.mean > margin:
        return REPRODUCES
    if worse.mean - better.mean > margin:
        return FAILS
    return f"{INCONCLUSIVE} (overlapping ± std)"


PAPER, SUITE = "paper", "suite"  # a verdict's scope: where the paper states the claim / the suite's own finding
# The claims judged, by id; where the papers state each: the `claims` of reference.yaml's tasks.
CLAIMS = {
    "pr_beats_mdm": "FMLM+ PR at 4 NFE beats the MDM at full NFE (its better sampler)",
    "pr_beats_fast_mdm": "FMLM+ PR at 4 NFE beats the MDM's best decoder at ≤ 4 mean NFE (PR's own if lower; "
    "adaptive ones by their mean NFE, within it on every seed)",
    "pr_beats_a_priori": "PR beats the a-priori loop on the same checkpoint at low NFE ({nfe})",
    "init_distill_scratch": "MDM-initialised > distilled > scratch (PR at {nfe} NFE)",
    "mlfm_guidance": "MLFM: CCFG + OTP > CCFG > no guidance (NFE {nfe})",
}


def stated(claim: str) -> dict[str, dict]:
    """Where the papers state ``claim`` (a CLAIMS id): reference.yaml task → {compared: {model, better first: the
    NFE the paper shows it at, null where it gives none}, source}."""
    return {task: ref["claims"][claim] for task, ref in reference_numbers().items() if claim in ref.get("claims", {})}


def scope(claim: str, difficulty: str, nfe: int) -> str:
    """PAPER when the paper states ``claim`` on this task at this NFE (the first compared model's; an unconditional
    NFE read as the paper's, PAPER_NFE), else SUITE: the suite's own finding, not a reproduction verdict."""
    where = stated(claim).get(f"sudoku_{difficulty}")
    if where is None:
        return SUITE
    nfes = next(iter(where["compared"].values()))
    paper_nfe = PAPER_NFE.get(nfe, nfe) if difficulty == "uncond" else nfe
    return PAPER if nfes is None or paper_nfe in nfes else SUITE


def stated_text(claim: str) -> str:
    """Where the papers state ``claim``, e.g. 'sudoku_easy, sudoku_medium: FMLM+ PR @4 > MDLM @128 (FMLM+ / PR
    paper, conditional generation table)'; tasks with the same statement share one entry."""
    tasks_of: dict[str, list[str]] = {}
    for task, where in stated(claim).items():
        models = " > ".join(
            model + ("" if nfe is None else " @" + "/".join(map(str, nfe))) for model, nfe in where["compared"].items()
        )
        tasks_of.setdefault(f"{models} ({where['source']})", []).append(task)
    return "; ".join(f"{', '.join(tasks)}: {text}" for text, tasks in tasks_of.items()) or "not stated by the papers"


def verdicts(agg: pd.DataFrame) -> pd.DataFrame:
    """One line per claim × task (× variant): the claim, the two figures compared, the verdict, its scope (PAPER:
    judged where the paper states the claim; SUITE: the suite's own finding) and where the paper states it."""
    lines = []

    def add(claim: str, nfe: int, task: str, a_label: str, a: Cell | None, b_label: str, b: Cell | None) -> None:
        # ``nfe``: the claimed-better side's, which decides the scope
        if a is None and b is None:
            return
        lines.append(
            {
                "claim": CLAIMS[claim].format(nfe=nfe),
                "task": task,
                "compared": f"{a_label} {a if a else '—'} vs {b_label} {b if b else '—'}",
                "verdict": verdict(a, b),
                "scope": scope(claim, task, nfe),
                "stated": stated_text(claim),
            }
        )

    for d in [*DIFFICULTIES, "uncond"]:
        part = agg[agg["difficulty"] == d]
        if part.empty:
            continue
        metric = "valid_pct" if d == "uncond" else "accuracy"
        full = empty_cells(part["board"].iloc[0], d)
        at = lambda m, v, s, nfe, part=part, metric=metric: cell(
            part, metric, method=m, variant=v, sampler=s, nfe_budget=nfe
        )  # noqa: E731
        if d != "uncond":
            mdm = [c for c in (at("MDM", "scratch", s, full) for s in ("ancestral", "confidence")) if c]
            best = max(mdm, key=lambda c: c.mean) if mdm else None
            for v in ("scratch", "distill", "init"):
                add("pr_beats_mdm", LOW_NFE, d, f"FMLM+ {v} PR@4", at("FMLM+", v, "pr", LOW_NFE), f"MDM@{full}", best)
            for v in ("scratch", "distill", "init"):
                pr = at("FMLM+", v, "pr", LOW_NFE)
                spent = cell(part, "nfe", method="FMLM+", variant=v, sampler="pr", nfe_budget=LOW_NFE)
                bound = min(LOW_NFE, spent.mean) if spent is not None else LOW_NFE  # PR's mean NFE (early stop)
                fast = best_within_nfe(part, metric, "MDM", bound)
                if fast is not None:
                    label = f"FMLM+ {v} PR@4" + (f" ({bound:.1f} NFE)" if bound < LOW_NFE else "")
                    add("pr_beats_fast_mdm", LOW_NFE, d, label, pr, fast[0], fast[1])
        for nfe in (LOW_NFE,) if d != "uncond" else (3, 9):
            for v in ("scratch", "distill", "init"):
                add(
                    "pr_beats_a_priori",
                    nfe,
                    d,
                    f"FMLM+ {v} PR",
                    at("FMLM+", v, "pr", nfe),
                    "a-priori",
                    at("FMLM+", v, "a_priori", nfe),
                )
        nfe = LOW_NFE if d != "uncond" else 9
        for hi, lo in (("init", "distill"), ("distill", "scratch")):
            add("init_distill_scratch", nfe, d, hi, at("FMLM+", hi, "pr", nfe), lo, at("FMLM+", lo, "pr", nfe))
        for hi, lo in (("mlfm_ccfg_otp", "mlfm_ccfg"), ("mlfm_ccfg", "mlfm")):
            add("mlfm_guidance", full, d, hi, at("MLFM", "init", hi, full), lo, at("MLFM", "init", lo, full))
    return pd.DataFrame(lines, columns=["claim", "task", "compared", "verdict", "scope", "stated"])


def best_within_nfe(part: pd.DataFrame, metric: str, method: str, nfe: float) -> tuple[str, Cell] | None:
    """The ``method``'s best line (any sampler, settings and budget) whose mean NFE spent is at most ``nfe`` on every
    seed: a fixed-step sampler at that budget, or an adaptive one (threshold, EB) whose rows needed no more on average,
    whatever its cap (a line whose seeds average under ``nfe`` while one seed spent more is out: not equal calls); its
    label ('MDM eb@18 (3.9 NFE)', the mean over seeds, the settings named where a sampler ran with several) and its
    own cell. None when none is measured."""
    spent = "nfe_seed_max" if "nfe_seed_max" in part else "nfe_mean"
    lines = part[(part["method"] == method) & (part[spent] <= nfe + 1e-9)] if spent in part else part[:0]
    lines = lines.dropna(subset=[f"{metric}_mean"]) if f"{metric}_mean" in lines else lines[:0]
    best: tuple[str, Cell] | None = None
    for _, line in lines.iterrows():
        got = Cell(float(line[f"{metric}_mean"]), float(line[f"{metric}_std"]), int(line["n"]))
        if best is None or got.mean > best[1].mean:
            label = f"{method} {_sampler_label(part, line)}@{line['nfe_budget']} ({line['nfe_mean']:.1f} NFE)"
            best = (label, got)
    return best


def _sampler_label(part: pd.DataFrame, line: pd.Series) -> str:
    """The line's sampler, with the settings that tell it apart where ``part`` holds it under several ('eb
    gamma=0.3'), and ', capped' where its budget forced commits beyond its rule ('threshold, capped')."""
    if "sampler_settings" not in part:
        return str(line["sampler"])
    same = part[(part["method"] == line["method"]) & (part["sampler"] == line["sampler"])]
    labels = settings_labels(list(dict.fromkeys(same["sampler_settings"].fillna("{}"))))
    label = labels.get(line.get("sampler_settings") or "{}", "")
    name = f"{line['sampler']} {label}" if label else str(line["sampler"])
    return name + (CAPPED if capped(line) else "")


def capped(line: pd.Series) -> bool:
    """Whether the line's NFE budget forced commits beyond its decoding rule on some seed's rows (a positive mean
    ``forced_share``; rows written before the column say nothing and are not marked)."""
    share = line.get("forced_share_mean")
    return share is not None and not pd.isna(share) and share > 0


def settings_labels(settings: list[str]) -> dict[str, str]:
    """Per sampler-settings JSON, the keys whose values differ among ``settings``, as 'k=v, …' ('' for one)."""
    parsed = {text: json.loads(text) for text in settings}
    keys = sorted({k for d in parsed.values() for k in d})
    differ = [k for k in keys if len({json.dumps(d.get(k)) for d in parsed.values()}) > 1]
    return {text: ", ".join(f"{k}={d.get(k)}" for k in differ) for text, d in parsed.items()}


def verdict_counts(table: pd.DataFrame) -> dict[str, int]:
    """How many lines reproduce / do not / are inconclusive / were not measured."""
    kinds = table["verdict"].str.split(" \\(", regex=True).str[0]
    return {k: int(v) for k, v in kinds.value_counts().items()}


def headline(agg: pd.DataFrame) -> list[str]:
    """A few figures for the README: FMLM+ init PR@4 and the MDM's best at full NFE per difficulty."""
    out = []
    for d in DIFFICULTIES:
        part = agg[agg["difficulty"] == d]
        if part.empty:
            continue
        full = empty_cells(part["board"].iloc[0], d)
        pr = cell(part, "accuracy", method="FMLM+", variant="init", sampler="pr", nfe_budget=LOW_NFE)
        mdm = [cell(part, "accuracy", method="MDM", sampler=s, nfe_budget=full) for s in ("ancestral", "confidence")]
        mdm = [c for c in mdm if c]
        best = max(mdm, key=lambda c: c.mean) if mdm else None
        out.append(f"{d}: FMLM+ init PR@4 {pr or '—'} % vs MDM@{full} {best or '—'} %")
    return out


def seeds_summary(rows: pd.DataFrame) -> str:
    """'N rows, seeds {…}, from K files, commits …' for the report's header; the files skipped (read_results) named."""
    seeds = sorted(int(s) for s in rows["seed"].dropna().unique())
    commits = sorted({str(c)[:10] for c in rows.get("git_commit", pd.Series(dtype=str)).dropna()})
    skipped = rows.attrs.get("skipped", [])
    return (
        f"{len(rows)} measured rows, seeds {seeds}, from {rows['file'].nunique()} CSV files; "
        f"code {', '.join(commits) or 'unknown'}"
        + (f"; skipped (named in the warnings): {', '.join(skipped)}" if skipped else "")
    )


MACHINE = ("precision", "device")  # callbacks/results_csv.py's; blank or absent (older CSVs): not recorded


def machines_note(rows: pd.DataFrame) -> str:
    """One line naming the precisions and devices of ``rows`` with their row counts when they hold more than one of
    either (a row without them counts as 'not recorded'); '' otherwise."""
    counts = {}
    for column in MACHINE:
        values = rows[column] if column in rows else pd.Series("", index=rows.index, dtype=str)
        values = values.fillna("").astype(str).str.strip().replace("", "not recorded")
        counts[column] = sorted(values.value_counts().items(), key=lambda kv: (-kv[1], kv[0]))
    if all(len(c) <= 1 for c in counts.values()):
        return ""
    named = "; ".join(
        f"{column} " + ", ".join(f"{v} ({n} row{'s' * (n != 1)})" for v, n in c) for column, c in counts.items()
    )
    return f"Mixed machines in this table: {named}."


def _render(sections: list[tuple[Section, str]], out: Path, title: str) -> tuple[str, str]:
    """report.md and report.html of the (section, note) pairs: a note, if any, as one line under its table."""
    markdown, body = [], []
    for section, note in sections:
        markdown.append(_render_markdown([section], out)[:-1] + (f"\n\n{note}" if note else ""))
        page = _render_html([section], title)
        body.append(page[page.index("<body>") + len("<body>") : page.rindex("</body>")])
        body.append(f"<p>{_inline(note)}</p>" if note else "")
    page = _render_html([], title)
    end = page.rindex("</body>")
    return "\n\n".join(markdown) + "\n", page[:end] + "".join(body) + page[end:]


def build_sudoku_report(
    results_dir: str | Path, out: str | Path, *, title: str = "flowlm: the papers' Sudoku tables"
) -> Report:
    """Merge every results CSV under ``results_dir`` (not ``out``'s nor another report's: read_results) and write the
    conditional, unconditional, calibration and verdict tables to ``out`` (report.md, report.html, one CSV per table,
    the merged rows); print what was read and each table's mixed-machines note."""
    out = Path(out)
    rows = read_results(results_dir, skip=[out])
    agg = aggregate(rows)
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out=out, markdown=out / REPORT_MD, html=out / REPORT_HTML)
    tables = {
        "conditional": conditional_table(agg),
        "unconditional": unconditional_table(agg),
        "calibration": calibration_table(agg),
        "aup": aup_table(agg),
        "verdicts": verdicts(agg),
    }
    points = curve_points(rows)
    gains = curve_gains(points)
    tables["curves"] = curve_table(gains)
    points.to_csv(out / "curve_points.csv", index=False)
    report.data.append(out / "curve_points.csv")
    figure = None
    if len(points):
        figure = plots.training_curves(points, out / "curves.png", "Accuracy versus training (headline lines)")
        report.figures.append(figure)
    rows.drop(columns=["file"]).to_csv(out / ROWS_CSV, index=False)
    agg.to_csv(out / "aggregate.csv", index=False)
    report.data += [out / ROWS_CSV, out / "aggregate.csv"]
    for name, table in tables.items():
        table.to_csv(out / f"{name}.csv", index=False)
        report.data.append(out / f"{name}.csv")
    report.tables = tables
    notes = {  # the rows each table is made of
        "conditional": machines_note(rows[rows["difficulty"].isin(DIFFICULTIES)]),
        "unconditional": machines_note(rows[rows["difficulty"] == "uncond"]),
        "calibration": machines_note(rows),
        "curves": "",  # the rows' machines are named under the tables
        "aup": "",  # TPF does not depend on the machine; the accuracies' mix is named under their own tables
        "verdicts": machines_note(rows),
    }
    judged = tables["verdicts"]
    counts = {}
    for kind in (PAPER, SUITE):
        part = judged[judged["scope"] == kind]
        counts[kind] = ", ".join(f"{k}: {v}" for k, v in verdict_counts(part).items()) if len(part) else "none"
    sections = [
        (
            Section(
                title,
                f"Generated {datetime.now(UTC):%Y-%m-%d %H:%M} UTC from `{results_dir}`: {seeds_summary(rows)}. "
                "Cells: mean ± std over seeds (the mean alone for one seed). Measured rows are this suite's CPU-scale "
                "runs (6×6 boards, `tiny` DiT), not the papers' setting (9×9, paper-scale models, labelled beside). "
                "Training: the step budget (an MDM-based model counts its MDM's steps; own steps in brackets), wall "
                "time, final val loss and whether the convergence rule (docs/results.md#convergence-protocol) was "
                "met before the step cap.",
                level=1,
            ),
            "",
        ),
        (Section("Headline", "; ".join(headline(agg)) or "no conditional row measured"), ""),
        (
            Section(
                "Verdicts",
                "Each claim of the papers against the measured numbers: reproduces when the means differ in the "
                "claimed direction by more than the two std together, does not reproduce when they differ the other "
                "way by as much, inconclusive otherwise (or with one seed). Scope `paper`: judged on the task and "
                "NFE where the paper states the claim (`stated`: its task, models and NFE, analysis/reference.yaml), "
                "a reproduction verdict; scope `suite`: judged elsewhere, the suite's own finding, not a reproduction "
                f"verdict. Reproduction verdicts: {counts[PAPER]}. The suite's own findings: {counts[SUITE]}.",
                judged,
            ),
            notes["verdicts"],
        ),
        (
            Section(
                "Conditional Sudoku: accuracy % (methods.md §8, conditional table)",
                "NFE 4 (PR: R = 4, N = 1, the released setting) and NFE = the number of empty cells (full). Paper "
                "rows: 9×9, MDLM at 128 NFE.",
                tables["conditional"],
            ),
            notes["conditional"],
        ),
        (
            Section(
                "Unconditional Sudoku: % valid · distinct valid grids · % copies of training grids",
                "NFE 1 / 3 / 9 / 27 / 36 on a 36-cell board (the paper's 1 / 3 / 9 / 27 / 81 on 81 cells; its 81 is "
                "shown under 36). Paper rows: % valid only.",
                tables["unconditional"],
            ),
            notes["unconditional"],
        ),
        (
            Section(
                "Calibration: a-priori vs a-posteriori confidence (AUROC, right vs wrong tokens)",
                "AUROC of the per-token confidence a sampler committed with, for telling right tokens from wrong ones "
                "(1 = perfect ranking, 0.5 = none); right = equals the solution (conditional) or clashes with no "
                "cell of its row, column and box (unconditional). Mean ± std over seeds (the mean alone for one "
                "seed).",
                tables["calibration"],
            ),
            notes["calibration"],
        ),
        (
            Section(
                "Accuracy versus training",
                "Accuracy (conditional) / % valid (unconditional) of the headline lines against the model's own "
                "training step: each checkpoint kept at an eighth of the budget, sampled offline (the rows' "
                "`eval_step`; the final weights' rows are the last point), mean over seeds, band: min–max "
                f"(curve_points.csv). Per curve, the gain over the last quarter of the steps: the final point less the "
                f"last checkpoint at ≤ 3/4 of the final step. {budget_check(gains)}",
                tables["curves"],
                image=figure,
            ),
            "",
        ),
        (
            Section(
                "AUP: accuracy under parallelism (d3LLM)",
                "The weighted area under each decoder's curve of accuracy (conditional) or % valid (unconditional) "
                "against tokens per forward (TPF: positions generated / NFE a row spent, mean over rows; rows of "
                "older CSVs: positions / mean NFE), over the NFE budgets measured; points more than 5 below the "
                "lowest-TPF point left out, each weighted by min(exp(−3 (1 − y / y_max)), 1), y_max the task's "
                "best (analysis/aup.py). Higher is better; a single budget gives ρ₁y₁ alone.",
                tables["aup"],
            ),
            notes["aup"],
        ),
    ]
    markdown, page = _render(sections, out, title)
    report.markdown.write_text(markdown)
    report.html.write_text(page)
    summary = [f"Read {results_dir}: {seeds_summary(rows)}"]
    summary += [f"{name} table: {note}" for name, note in notes.items() if note]
    print("\n".join(summary), flush=True)
    return report
