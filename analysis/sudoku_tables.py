"""The papers' Sudoku tables from the results CSVs (callbacks/results_csv.py): merged over every CSV of the results
folder, deduplicated per (row, seed), mean ± std over seeds, the papers' numbers beside each row, and one verdict
per claim computed from the numbers (docs/results.md)."""

from __future__ import annotations

import csv
import io
import json
import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import ROUND_HALF_UP, Decimal
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
    "forced_share", "sec_per_sample",
]  # fmt: skip
CAPPED = ", capped"  # a line whose NFE budget forced commits beyond its rule (forced_share > 0): not the rule alone
TRAINING = ["steps", "budget_steps", "wall_s", "final_val_loss"]
DIFFICULTIES = ("easy", "medium", "hard")
UNCOND_NFE = (1, 3, 9, 27, 36)  # the paper's 1 / 3 / 9 / 27 / 81 on a 36-cell board
PAPER_NFE = dict(zip(UNCOND_NFE, (1, 3, 9, 27, 81), strict=True))  # an unconditional NFE here → the paper's
WALL = "wall ms / sample (per NFE)"  # the adaptive table's sampling time: what the saved calls buy in time
LOW_NFE = 4  # the released PR setting: R = 4, N = 1
# Row order of the tables: model (method, variant) then sampler.
MODELS = [("MDM", "scratch"), ("FMLM+", "scratch"), ("FMLM+", "distill"), ("FMLM+", "init"), ("MLFM", "init")]
SAMPLERS = ["ancestral", "confidence", "pr", "a_priori", "mlfm", "mlfm_ccfg", "mlfm_ccfg_otp"]
PAPER_METHOD = {"MDLM": "MDM", "FMLM+": "FMLM+"}  # reference.yaml's model → the suite's method
PAPER_VARIANT = "scratch"  # the paper's Sudoku FMLM+ (the released script sets no init nor teacher): the headline
VARIANTS = ("scratch", "distill", "init")  # FMLM+'s rows: the paper's variant first, then the strategy rows
ADAPTIVE = ("threshold", "threshold_margin", "eb")  # decoders whose budget is a cap: rows of their own
PAPER_CELLS = 81  # the cells of the paper's 9×9 unconditional board (its tokens per call: 81 / NFE)
PROPORTIONS = ("accuracy", "valid_pct")  # percentages of puzzles / grids: Wilson intervals from the pooled count
# percentages of a row's samples, read as exact counts of them (exact_percentages)
SAMPLE_PERCENTAGES = (*PROPORTIONS, "train_copy_pct")
# Rows written before the `samples` column: the fixed-budget protocol (issue 47, from commit adf19c9 on) samples every
# val puzzle (2 000); earlier rows sampled the CPU scale's two evaluation batches (2 × 128 puzzles, 2 × 256 grids).
PROTOCOL_START = "2026-12-06T07:47:26Z"
DEFAULT_SAMPLES = 2000
EARLIER_SAMPLES = {"conditional": 256, "uncond": 512}


class NoResultsError(ValueError):
    """The results folder holds no results CSV."""


class ResultsCSVWarning(UserWarning):
    """A CSV under the results folder, or rows of one, that the report skipped; the message names the file."""


REQUIRED = [*KEY, "seed", "date"]  # a results CSV's header holds these (callbacks/results_csv.py COLUMNS)
NUMERIC = ["nfe_budget", "seed", "eval_seed", "eval_step", "samples", *MEASURES, *TRAINING]  # blank or a number
DATE_FORMAT = "%Y-%m-%dT%H:%M:%SZ"  # callbacks/results_csv.py's `date`
ROWS_CSV = "rows.csv"  # the report's merged rows: the results schema, so never read back (report_folders)
STEP = "eval_step"  # the training step of the weights a row sampled (the curve's checkpoints, the final weights)
# Rows of an earlier protocol, kept for the record and out of the tables (results/sudoku/superseded/README.md): a
# folder named so, or so and a suffix (superseded-steps6000/: rows of an earlier budget, scripts/tables_campaign.sh
# collect), below the folder read.
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
    rows of a file with a wrong field count (a cut line), a non-number in a numeric column (a decimal comma), a
    percentage outside 0–100 or a date not in DATE_FORMAT. ``attrs["skipped"]``: 'path (why)' of each. A (row,
    seed) is measured once per checkpoint (``eval_step``, the run's ``steps`` where blank): the curve's points are
    rows of their own. A folder named SUPERSEDED (or SUPERSEDED and a suffix, e.g. superseded-steps6000) below
    ``folder`` holds rows of an earlier protocol: not read (read it as ``folder`` itself to see them)."""
    folder = Path(folder)
    skip = [Path(s).resolve() for s in skip]
    skip += [p.resolve() for p in folder.rglob(SUPERSEDED + "*") if p.is_dir()] if folder.is_dir() else []
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
    steps = pd.to_numeric(rows["steps"], errors="coerce") if "steps" in rows else step * float("nan")
    rows[STEP] = step.fillna(steps)
    # one row per model seed: the model's own draws (eval_seed blank, in older CSVs, or the seed) over an evaluation
    # at another seed (flowlm-eval seed=N, whose rows name it), then the latest
    own = rows["eval_seed"].isna() | (rows["eval_seed"] == rows["seed"]) if "eval_seed" in rows else True
    rows = rows.assign(_own=own).sort_values(["_own", "date"], kind="stable")
    rows = rows.drop_duplicates([*KEY, "seed", STEP], keep="last").drop(columns="_own").reset_index(drop=True)
    rows = exact_percentages(rows)
    rows.attrs["skipped"] = skipped
    return rows


def exact_percentages(rows: pd.DataFrame) -> pd.DataFrame:
    """``rows`` with each percentage of samples (SAMPLE_PERCENTAGES) as the float64 nearest 100·k/n, k its count of
    the row's recorded ``samples`` n: rows written before flowlm.metrics.sudoku_metric computed in float64 carry the
    float32 quotient (1 939 of 2 000: 96.94999694824219, printed 96.9 where the count is 96.95 %). A value farther
    than float32's error from every k/n (a sample count that is not its denominator) is left as written."""
    if "samples" not in rows:
        return rows
    n = pd.to_numeric(rows["samples"], errors="coerce")
    rows = rows.copy()
    for m in SAMPLE_PERCENTAGES:
        if m not in rows:
            continue
        value = pd.to_numeric(rows[m], errors="coerce")
        ok = value.notna() & n.notna() & (n > 0)
        exact = 100 * counts_of(value[ok], n[ok]) / n[ok]
        close = (exact - value[ok]).abs() <= 1e-4  # float32's error at 100 is ~4e-6
        rows.loc[exact.index[close], m] = exact[close]
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
    count = values.get("samples", "").strip()
    if count and not float(count) > 0:  # NaN or ≤ 0: no count a percentage (or its interval) could be of
        return f"samples {count} is not a count of puzzles / grids"
    for column in PROPORTIONS:  # a percentage of puzzles / grids (its Wilson interval needs 0 ≤ hits ≤ samples)
        value = values.get(column, "").strip()
        if value and not math.isnan(float(value)) and not 0.0 <= float(value) <= 100.0:  # NaN: not measured
            return f"{column} {value} is not a percentage (0–100)"
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
    (ddof 1; 0 for one seed) and seed count of every measure; per proportion (PROPORTIONS) the pooled count over
    seeds (``<m>_hits`` of ``<m>_total`` samples: ``samples_of``), the per-seed values and sample counts
    (``<m>_by_seed``, ``<m>_samples_by_seed``, JSON);
    ``tpf_mean`` the cells filled per call (``cells_per_call``); training facts as means, and each seed's own
    training steps (``steps_by_seed``, JSON, where recorded); ``nfe_seed_max`` the most NFE one seed spent on
    average; ``samples_assumed`` the rows whose sample count is a default."""
    rows = final_rows(rows).reset_index(drop=True)
    samples, recorded = samples_of(rows)
    rows = rows.assign(_samples=samples, _assumed=~recorded)
    lines = []
    for key, part in rows.groupby(KEY, sort=False, dropna=False):
        line = dict(zip(KEY, key, strict=True))
        line["n"] = len(part)
        for m in MEASURES + TRAINING:
            if m in part:
                values = pd.to_numeric(part[m], errors="coerce")
                line[f"{m}_mean"] = values.mean()
                line[f"{m}_std"] = 0.0 if values.count() < 2 else values.std()
                line[f"{m}_n"] = int(values.count())  # the seeds that measured it (an AUROC undefined on one: not)
        nfe = pd.to_numeric(part["nfe"], errors="coerce")
        line["tpf_mean"] = cells_per_call(line["board"], line["difficulty"], nfe, part["_samples"])
        line["tpf_std"] = 0.0
        # the most NFE one seed spent on average (an adaptive sampler's spend varies by seed): "within a budget"
        # means within it on every seed (best_within_nfe)
        line["nfe_seed_max"] = nfe.max()
        for m in PROPORTIONS:
            values = pd.to_numeric(part[m], errors="coerce") if m in part else pd.Series(float("nan"), part.index)
            got = values.notna()
            line[f"{m}_hits"], line[f"{m}_total"] = pooled_count(values[got], part.loc[got, "_samples"])
            line[f"{m}_by_seed"] = json.dumps(
                {int(s): float(v) for s, v in zip(part["seed"][got], values[got], strict=True)}
            )
            line[f"{m}_samples_by_seed"] = json.dumps(  # each seed's own count: one seed's Wilson interval
                {int(s): int(v) for s, v in zip(part["seed"][got], part.loc[got, "_samples"], strict=True)}
            )
        steps = (
            pd.to_numeric(part["steps"], errors="coerce") if "steps" in part else pd.Series(float("nan"), part.index)
        )
        line["steps_by_seed"] = json.dumps(  # each seed's own training steps, where recorded (verdicts pair equals)
            {int(s): int(v) for s, v in zip(part["seed"], steps, strict=True) if pd.notna(v)}
        )
        precision = part["precision"] if "precision" in part else pd.Series("", index=part.index)
        line["precision_by_seed"] = json.dumps(  # each seed's training precision, where recorded (paired alike)
            {
                int(s): str(v).strip()
                for s, v in zip(part["seed"], precision, strict=True)
                if pd.notna(v) and str(v).strip()
            }
        )
        line["samples_assumed"] = int(part["_assumed"].sum())
        # the calibration's counts over the seeds that recorded them: the tokens scored and the wrong ones among them
        # (an AUROC from a handful of wrong tokens ranks that handful; with none it is undefined)
        tokens, wrong = (
            pd.to_numeric(part[c], errors="coerce") if c in part else pd.Series(float("nan"), part.index)
            for c in ("calibration_tokens", "wrong_pct")
        )
        scored = tokens.notna() & (tokens > 0) & wrong.notna()
        wrong_sum, line["calibration_tokens_sum"] = pooled_count(wrong[scored], tokens[scored])
        line["wrong_tokens_sum"] = wrong_sum
        if "confidence_kind" in part:  # the sampler's declared kind (flowlm/samplers), one per sampler
            line["confidence_kind"] = part["confidence_kind"].iloc[0]
        line["seeds"] = ",".join(str(v) for v in sorted(part["seed"].unique()))
        lines.append(line)
    return pd.DataFrame(lines)


def pooled_count(percent: pd.Series, counts: pd.Series) -> tuple[int, int]:
    """Percentages of per-seed counts pooled: (the hits, each seed's rounded to a whole, summed; the counts summed)."""
    return int(counts_of(percent, counts).sum()), int(counts.sum())


def counts_of(percent: pd.Series, samples: pd.Series) -> pd.Series:
    """The whole counts behind percentages of ``samples``: percent / 100 × samples, rounded."""
    return (percent / 100 * samples).round()


def samples_of(rows: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """Per row, the puzzles / grids its percentages count (the ``samples`` column) and whether the row recorded it;
    a row without it (CSVs before the column) counts DEFAULT_SAMPLES when written under the fixed-budget protocol
    (from PROTOCOL_START on: every val puzzle, 2 000), else EARLIER_SAMPLES (the CPU scale's two evaluation batches:
    256 puzzles, 512 grids)."""
    given = (
        pd.to_numeric(rows["samples"], errors="coerce") if "samples" in rows else pd.Series(float("nan"), rows.index)
    )
    earlier = rows["date"].astype(str) < PROTOCOL_START
    old = rows["difficulty"].map(lambda d: EARLIER_SAMPLES["uncond" if d == "uncond" else "conditional"])
    default = old.where(earlier, DEFAULT_SAMPLES)
    return given.fillna(default).astype(int), given.notna()


def cells_per_call(board: str, difficulty: str, nfe: pd.Series, samples: pd.Series) -> float:
    """Tokens per forward as the tables count it: the cells a row fills (``empty_cells``: not the clue copies and
    separators it also writes) over the mean NFE, a ratio of sums over the seeds' rows (NaN without NFE)."""
    ok = nfe.notna() & (nfe > 0)
    if not ok.any():
        return float("nan")
    weights = samples[ok].astype(float)
    return empty_cells(board, difficulty) * float(weights.sum()) / float((nfe[ok] * weights).sum())


def with_tpf(rows: pd.DataFrame) -> pd.DataFrame:
    """``rows`` with tokens per forward in every row: the cells it fills (``empty_cells``) over its mean NFE, the
    rows' ratio of sums. The logged ``tpf`` counts every generated position (clue copies and separators included)
    and averages per row: it is not what the tables show."""
    cells = pd.Series([empty_cells(b, d) for b, d in zip(rows["board"], rows["difficulty"], strict=True)])
    return rows.assign(
        tpf=cells.set_axis(rows.index) / pd.to_numeric(rows["nfe"], errors="coerce").where(lambda v: v > 0)
    )


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


Z95 = 1.959964  # the normal quantile of a two-sided 95 % interval
# t quantiles (two-sided 95 %, by degrees of freedom) for the paired intervals; between entries the next lower df's
# (wider): scipy is not a dependency of the suite
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086,
       25: 2.060, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}  # fmt: skip


def t95(df: int) -> float:
    """The two-sided 95 % quantile of Student's t at ``df`` ≥ 1 degrees of freedom (T95; normal beyond 120)."""
    if df < 1:
        raise ValueError(f"a t interval needs at least 1 degree of freedom, got {df}")
    return T95[max(k for k in T95 if k <= df)] if df <= 120 else Z95


def wilson(hits: int, total: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of ``hits`` successes in ``total`` trials, in % (95 % by default)."""
    if total <= 0:
        raise ValueError(f"a Wilson interval needs at least one trial, got {total}")
    p = hits / total
    denominator = 1 + z**2 / total
    centre = (p + z**2 / (2 * total)) / denominator
    half = z * math.sqrt(p * (1 - p) / total + z**2 / (4 * total**2)) / denominator
    return 100 * max(centre - half, 0.0), 100 * min(centre + half, 1.0)


def rounded(value: float, decimals: int = 1) -> str:
    """``value`` to ``decimals`` places, half up from its shortest decimal form (``repr``), as a table rounds by hand:
    96.95 → 97.0 and 0.15 → 0.2, where float formatting rounds the binary value (0.15 → 0.1); NaN → 'nan'."""
    if not math.isfinite(value):
        return f"{value:.{decimals}f}"
    return str(Decimal(repr(float(value))).quantize(Decimal(1).scaleb(-decimals), rounding=ROUND_HALF_UP))


@dataclass(frozen=True)
class Cell:
    """One aggregated value: mean, std over seeds, seed count; for a proportion the pooled count (``hits`` of
    ``total`` samples over the seeds) and the per-seed values; the NFE spent (mean over seeds, the most one seed
    spent) and the budget."""

    mean: float
    std: float
    n: int
    hits: int | None = None
    total: int | None = None
    by_seed: tuple[tuple[int, float], ...] = ()
    nfe: float | None = None
    nfe_max: float | None = None
    budget: float | None = None
    steps_by_seed: tuple[tuple[int, int], ...] = ()  # each seed's own training steps, where recorded
    precision_by_seed: tuple[tuple[int, str], ...] = ()  # each seed's training precision, where recorded
    samples_by_seed: tuple[tuple[int, int], ...] = ()  # each seed's sample count (a proportion's per-seed total)

    def interval(self) -> tuple[float, float] | None:
        """The Wilson 95 % interval of the pooled count, in % (None for a measure that is no proportion)."""
        return None if not self.total else wilson(int(self.hits or 0), int(self.total))

    def seed_interval(self, seed: int) -> tuple[float, float] | None:
        """The Wilson 95 % interval of one seed's own count, in % (its value × its samples); None for a measure
        that is no proportion. A cell without per-seed counts (written before them) takes the pooled total's share
        of its seeds, each seed having evaluated as many samples."""
        if not self.total:
            return None
        total = dict(self.samples_by_seed).get(seed) or round(self.total / max(len(self.by_seed), 1))
        return wilson(round(self.seeds()[seed] / 100 * total), total)

    def format(self, decimals: int = 1) -> str:
        """'mean ± std [Wilson 95 %]' with ``decimals``; the mean alone for one seed (whose std is no spread)."""
        r = lambda v: rounded(v, decimals)  # noqa: E731
        text = f"{r(self.mean)} ± {r(self.std)}" if self.n > 1 else r(self.mean)
        ci = self.interval()
        return text + (f" [{r(ci[0])}–{r(ci[1])}]" if ci else "")

    def spent(self) -> str:
        """' · NFE 3.6 (seed max 3.9)' where the NFE spent differs from the budget (an adaptive cell), else ''."""
        if self.nfe is None or self.budget is None or pd.isna(self.nfe) or abs(self.nfe - self.budget) < 0.05:
            return ""
        return f" · NFE {self.nfe:.1f} (seed max {self.nfe_max:.1f})"

    def seeds(self) -> dict[int, float]:
        """The per-seed values."""
        return dict(self.by_seed)

    def steps(self) -> dict[int, int]:
        """Each seed's own training steps, where recorded."""
        return dict(self.steps_by_seed)

    def precisions(self) -> dict[int, str]:
        """Each seed's training precision (bf16-mixed, 32-true, ...), where recorded."""
        return dict(self.precision_by_seed)

    def __str__(self) -> str:
        return self.format(1)


def _cell_of(line: pd.Series, metric: str) -> Cell:
    """The Cell of one aggregated line's ``metric``."""
    pooled = metric in PROPORTIONS and line.get(f"{metric}_total")
    by_seed = json.loads(line[f"{metric}_by_seed"]) if pooled else {}
    number = lambda key: None if key not in line or pd.isna(line[key]) else float(line[key])  # noqa: E731
    return Cell(
        float(line[f"{metric}_mean"]),
        float(line[f"{metric}_std"]),
        int(line["n"]) if pd.isna(line.get(f"{metric}_n", float("nan"))) else int(line[f"{metric}_n"]),
        hits=int(line[f"{metric}_hits"]) if pooled else None,
        total=int(line[f"{metric}_total"]) if pooled else None,
        by_seed=tuple(sorted((int(s), float(v)) for s, v in by_seed.items())),
        nfe=number("nfe_mean"),
        nfe_max=number("nfe_seed_max"),
        budget=number("nfe_budget"),
        steps_by_seed=tuple(sorted((int(s), int(v)) for s, v in json.loads(line.get("steps_by_seed") or "{}").items())),
        precision_by_seed=tuple(
            sorted((int(s), str(v)) for s, v in json.loads(line.get("precision_by_seed") or "{}").items())
        ),
        samples_by_seed=tuple(
            sorted((int(s), int(v)) for s, v in json.loads(line.get(f"{metric}_samples_by_seed") or "{}").items())
        ),
    )


def cell(agg: pd.DataFrame, metric: str, **where) -> Cell | None:
    """The aggregated ``metric`` of the one line matching ``where`` (None when not measured)."""
    line = _line_of(agg, metric, **where)
    measured = line is not None and f"{metric}_mean" in line and pd.notna(line[f"{metric}_mean"])
    return _cell_of(line, metric) if measured else None


def _line_of(agg: pd.DataFrame, metric: str, **where) -> pd.Series | None:
    """The aggregated line ``cell`` reads ``metric`` from; where none measured it, the first line matching ``where``
    (None without one)."""
    pick = agg
    for key, value in where.items():
        pick = pick[pick[key] == value]
    measured = pick.dropna(subset=[f"{metric}_mean"]) if f"{metric}_mean" in pick else pick.iloc[0:0]
    return None if pick.empty else (measured if not measured.empty else pick).iloc[0]


def _label(method: str, variant: str) -> str:
    return method if method in ("MDM", "MLFM") else f"{method} {variant}"


def role(method: str, variant: str) -> str:
    """A model's place in the tables: the paper's variant of FMLM+ (from scratch: the headline), the MDM baseline,
    or one of the suite's strategy rows (initialised, distilled, MLFM)."""
    if method == "MDM":
        return "baseline"
    return "headline (the paper's variant)" if (method, variant) == ("FMLM+", PAPER_VARIANT) else "strategy row"


def _models(agg: pd.DataFrame) -> list[tuple[str, str, str]]:
    """(method, variant, sampler) present, in the tables' order."""
    present = set(zip(agg["method"], agg["variant"], agg["sampler"], strict=True))
    order = [(m, v, s) for m, v in MODELS for s in SAMPLERS if (m, v, s) in present]
    return order + sorted(present - set(order))


def _fixed(agg: pd.DataFrame) -> pd.DataFrame:
    """The lines of fixed-step samplers (the adaptive decoders have their own table: adaptive_table)."""
    return agg[~agg["sampler"].isin(ADAPTIVE)]


def _shown(got: Cell | None) -> str:
    return "" if got is None else str(got) + got.spent()


def conditional_table(agg: pd.DataFrame) -> pd.DataFrame:
    """Accuracy % [Wilson 95 %] of the fixed-step samplers: one line per model × sampler; per difficulty NFE 4, NFE =
    the empty cells and NFE = the generated positions (one call each: the MDM's, the paper's MDLM regime), the NFE
    spent where it differs from the budget. The papers' rows (9×9) first, their NFE named (MDLM's 128 on 89
    positions under one call per position)."""
    cond = _fixed(agg[agg["difficulty"].isin(DIFFICULTIES)])
    board = cond["board"].iloc[0] if len(cond) else "6x6"
    budgets = {d: (LOW_NFE, empty_cells(board, d), generated_positions(board, d)) for d in DIFFICULTIES}
    names = {d: (f"{d} @4", f"{d} @{b[1]} (empty cells)", f"{d} @{b[2]} (one call per position)")
             for d, b in budgets.items()}  # fmt: skip
    lines = []
    for d in DIFFICULTIES:  # the papers' rows: the same layout, their NFE named where it is not 4
        for ref in reference_numbers()[f"sudoku_{d}"]["rows"]:
            line = next(
                (x for x in lines if x["model"] == ref["model"] and x["sampler"] == (ref["sampler"] or "")), None
            )
            if line is None:
                line = {"source": reference_numbers()[f"sudoku_{d}"]["label"], "model": ref["model"], "role": "paper"}
                line["sampler"] = ref["sampler"] or ""
                lines.append(line)
            for nfe, value in ref["values"].items():
                column = names[d][0] if nfe == LOW_NFE else names[d][2]
                line[column] = f"{value:.1f}" + ("" if nfe == LOW_NFE else f" (NFE {nfe})")
    for method, variant, sampler in _models(cond):
        line = {"source": f"measured, {board}", "model": _label(method, variant), "role": role(method, variant)}
        line["sampler"] = sampler
        for d in DIFFICULTIES:
            for column, nfe in zip(names[d], budgets[d], strict=True):
                where = dict(method=method, variant=variant, sampler=sampler, difficulty=d, nfe_budget=nfe)
                line[column] = _shown(cell(cond, "accuracy", **where))
        lines.append(line)
    columns = ["source", "model", "role", "sampler", *(c for d in DIFFICULTIES for c in names[d])]
    return pd.DataFrame(lines, columns=columns).fillna("")


def adaptive_table(agg: pd.DataFrame) -> pd.DataFrame:
    """The adaptive decoders (ADAPTIVE: threshold, margin, EB) in rows of their own, one per task × model ×
    sampler × settings × cap: the NFE spent (mean over seeds; the most one seed spent), cells per call, the sampling
    wall time per sample (mean over seeds; in brackets per NFE spent: what one call costs, against a fixed-step
    sampler's) and accuracy / % valid [Wilson 95 %]."""
    columns = ["task", "model", "sampler", "cap", "NFE spent (mean; seed max)", "TPF", WALL, "accuracy / % valid"]
    lines = []
    for d in [*DIFFICULTIES, "uncond"]:
        part = agg[(agg["difficulty"] == d) & agg["sampler"].isin(ADAPTIVE)]
        metric = "valid_pct" if d == "uncond" else "accuracy"
        for _, line in part.sort_values(["method", "variant", "sampler", "nfe_budget"]).iterrows():
            got = _cell_of(line, metric) if not pd.isna(line.get(f"{metric}_mean")) else None
            lines.append(
                {
                    "task": d,
                    "model": _label(line["method"], line["variant"]),
                    "sampler": _sampler_label(agg[agg["difficulty"] == d], line),
                    "cap": int(line["nfe_budget"]),
                    "NFE spent (mean; seed max)": f"{line['nfe_mean']:.2f}; {line['nfe_seed_max']:.2f}",
                    "TPF": "" if pd.isna(line["tpf_mean"]) else f"{line['tpf_mean']:.2f}",
                    WALL: wall_per_sample(line),
                    "accuracy / % valid": "" if got is None else str(got),
                }
            )
    return pd.DataFrame(lines, columns=columns)


def wall_per_sample(line: pd.Series) -> str:
    """'54.1 (28.2)': an aggregate line's sampling wall time per sample in ms, and per NFE spent; '' where no row
    recorded it."""
    seconds = line.get("sec_per_sample_mean")
    if seconds is None or pd.isna(seconds):
        return ""
    return f"{1e3 * seconds:.1f} ({1e3 * seconds / line['nfe_mean']:.1f})"


def fixed_step_wall(agg: pd.DataFrame) -> str:
    """' Fixed-step samplers, per NFE: easy MDM ancestral 1.6 ms, …': each task × model × fixed-step sampler's
    sampling wall time per sample and NFE spent, over its budgets (mean), beside which the adaptive decoders' per-NFE
    cost reads; '' where no row recorded it."""
    fixed = agg[~agg["sampler"].isin(ADAPTIVE)]
    if "sec_per_sample_mean" not in fixed:
        return ""
    fixed = fixed.assign(_per=fixed["sec_per_sample_mean"] / fixed["nfe_mean"]).dropna(subset=["_per"])
    parts = [
        f"{d} {_label(method, variant)} {sampler} {1e3 * part['_per'].mean():.1f} ms"
        for (d, method, variant, sampler), part in fixed.groupby(["difficulty", "method", "variant", "sampler"])
    ]
    return f" Fixed-step samplers of the same rows, per NFE: {', '.join(parts)}." if parts else ""


def tokens_per_call_nfe(paper_nfe: int, board: str = "6x6") -> int:
    """The fewest calls on this unconditional board that fill no more cells a call than ``paper_nfe`` did on the
    paper's 81 (9 a call at NFE 9 ↔ 36 / 4 on 6×6; its 27 a call at NFE 3 ↔ 2 calls, 18 a call): never more
    parallel than the paper's setting."""
    return max(1, math.ceil(empty_cells(board, "uncond") * paper_nfe / PAPER_CELLS - 1e-9))


def unconditional_table(agg: pd.DataFrame) -> pd.DataFrame:
    """Budgets mapped absolutely: per fixed-step model × sampler and NFE 1 / 3 / 9 / 27 / 36, '% valid [Wilson 95 %]
    · distinct valid · % copies of training grids'; the papers' % valid at the same NFE (their 81 under 36)."""
    unc = _fixed(agg[agg["difficulty"] == "uncond"])
    ref = reference_numbers()["sudoku_uncond"]
    lines = []
    for row in ref["rows"]:
        line = {"source": ref["label"], "model": row["model"], "role": "paper", "sampler": row["sampler"]}
        for nfe in UNCOND_NFE:
            value = row["values"].get(PAPER_NFE[nfe])
            line[f"NFE {nfe}"] = "" if value is None else f"{value:.1f}" + ("" if nfe == PAPER_NFE[nfe] else " (81)")
        lines.append(line)
    board = unc["board"].iloc[0] if len(unc) else "6x6"
    for method, variant, sampler in _models(unc):
        line = {"source": f"measured, {board}", "model": _label(method, variant), "role": role(method, variant)}
        line["sampler"] = sampler
        for nfe in UNCOND_NFE:
            where = dict(method=method, variant=variant, sampler=sampler, nfe_budget=nfe)
            valid = cell(unc, "valid_pct", **where)
            distinct, copies = cell(unc, "distinct_valid", **where), cell(unc, "train_copy_pct", **where)
            line[f"NFE {nfe}"] = (
                "" if valid is None else f"{valid} · {distinct.mean:.0f} · {rounded(copies.mean)}{valid.spent()}"
            )
        lines.append(line)
    columns = ["source", "model", "role", "sampler", *(f"NFE {n}" for n in UNCOND_NFE)]
    return pd.DataFrame(lines, columns=columns).fillna("")


def tokens_per_call_table(agg: pd.DataFrame) -> pd.DataFrame:
    """Budgets mapped by tokens per call: one column per paper NFE (1 / 3 / 9 / 27 / 81 on 81 cells), the papers' %
    valid at it and the measured % valid [Wilson 95 %] at the 6×6 NFE filling as many cells a call
    (tokens_per_call_nfe; blank where that budget was not measured)."""
    unc = _fixed(agg[agg["difficulty"] == "uncond"])
    board = unc["board"].iloc[0] if len(unc) else "6x6"
    cells = empty_cells(board, "uncond")
    ref = reference_numbers()["sudoku_uncond"]
    paper = sorted({int(n) for row in ref["rows"] for n in row["values"]})
    names = {
        p: f"paper NFE {p} ({PAPER_CELLS / p:.3g} a call) ↔ NFE {tokens_per_call_nfe(p, board)} "
        f"({cells / tokens_per_call_nfe(p, board):.3g} a call)"
        for p in paper
    }
    lines = []
    for row in ref["rows"]:
        line = {"source": ref["label"], "model": row["model"], "role": "paper", "sampler": row["sampler"]}
        line.update({names[p]: f"{v:.1f}" for p, v in row["values"].items()})
        lines.append(line)
    for method, variant, sampler in _models(unc):
        line = {"source": f"measured, {board}", "model": _label(method, variant), "role": role(method, variant)}
        line["sampler"] = sampler
        for p in paper:
            where = dict(method=method, variant=variant, sampler=sampler, nfe_budget=tokens_per_call_nfe(p, board))
            line[names[p]] = _shown(cell(unc, "valid_pct", **where))
        lines.append(line)
    return pd.DataFrame(lines, columns=["source", "model", "role", "sampler", *names.values()]).fillna("")


def training_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Per task × model × seed, the final weights' training facts: own steps, total steps (an MDM-based model counts
    its MDM's), wall time and final val loss (the convergence rule is a recorded diagnostic, not shown here)."""
    columns = ["task", "model", "seed", "own steps", "total steps", "wall (min)", "final val loss"]
    final = final_rows(rows)
    lines = []
    order = {d: i for i, d in enumerate([*DIFFICULTIES, "uncond"])}
    keys = ["difficulty", "method", "variant", "seed"]
    for (d, method, variant, seed), part in sorted(
        final.groupby(keys, sort=False), key=lambda kv: (order.get(kv[0][0], 9), _model_rank(kv[0][1:3]), kv[0][3])
    ):
        number = lambda c, part=part: pd.to_numeric(part[c], errors="coerce").dropna()  # noqa: E731
        own, total, wall, loss = number("steps"), number("budget_steps"), number("wall_s"), number("final_val_loss")
        lines.append(
            {
                "task": d,
                "model": _label(method, variant),
                "seed": int(seed),
                "own steps": "" if own.empty else f"{own.max():.0f}",
                "total steps": "" if total.empty else f"{total.max():.0f}",
                "wall (min)": "" if wall.empty else f"{wall.max() / 60:.1f}",
                "final val loss": "" if loss.empty else f"{loss.iloc[0]:.4f}",
            }
        )
    return pd.DataFrame(lines, columns=columns)


def _model_rank(model: tuple[str, str]) -> int:
    """A model's place in MODELS (unknown ones last)."""
    return MODELS.index(model) if model in MODELS else len(MODELS)


FULL = "@empty cells"  # the calibration's full budget: NFE = the cells to fill (18 on easy 6×6; 36 unconditional)


def calibration_table(agg: pd.DataFrame) -> pd.DataFrame:
    """AUROC of per-token confidence for right vs wrong tokens, per task × model × sampler, at NFE 4 and NFE = the
    empty cells (mean ± std over seeds), with the wrong tokens among those scored, summed over the seeds (``—``
    where none was wrong: no AUROC); rows that recorded no token count give the % wrong instead."""
    if "auroc_mean" not in agg:
        return pd.DataFrame(columns=["task", "model", "sampler", "confidence", "@4", FULL])
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
            for column, nfe in (("@4", LOW_NFE), (FULL, full)):
                got, wrong = (
                    cell(part, "auroc", **where, nfe_budget=nfe),
                    cell(part, "wrong_pct", **where, nfe_budget=nfe),
                )
                counts = _line_of(part, "auroc", **where, nfe_budget=nfe)  # the line `cell` read, or the first
                tokens = 0 if counts is None else int(counts.get("calibration_tokens_sum", 0) or 0)
                if tokens:
                    value = "—" if got is None else got.format(3)
                    line[column] = f"{value} ({int(counts['wrong_tokens_sum'])} of {tokens} tokens wrong)"
                else:
                    line[column] = "" if got is None else f"{got.format(3)} ({wrong.mean:.0f} % wrong)"
            lines.append(line)
    return pd.DataFrame(lines, columns=["task", "model", "sampler", "confidence", "@4", FULL])


def aup_budgets(board: str, difficulty: str) -> tuple[int, ...]:
    """The NFE budgets every line of a task is scored over (AUP): conditional 4 and the empty cells (every model
    has both; the MDM's one call per position is the MDM's alone), unconditional 1 / 3 / 9 / 27 / 36."""
    return UNCOND_NFE if difficulty == "uncond" else (LOW_NFE, empty_cells(board, difficulty))


def aup_table(agg: pd.DataFrame) -> pd.DataFrame:
    """AUP (analysis/aup.py) per task × model × sampler (× settings, where a sampler ran with several) over the same
    budgets for every line (aup_budgets: an adaptive decoder's points at those caps, where its TPF is what it
    spent): accuracy (conditional) or % valid (unconditional) against cells per call (``tpf_mean``), means over
    seeds, y_max = the task's best point; every point kept (``AUP``) and d3LLM's 5-point cut (``AUP, d3LLM cut``),
    which leaves a line whose few-NFE points fall 5 below its slowest with that point alone. ``comparable``: 'yes',
    or the budgets a line lacks."""
    columns = ["task", "model", "sampler", "points", "TPF", "AUP", "AUP, d3LLM cut", "comparable"]
    lines = []
    for d in [*DIFFICULTIES, "uncond"]:
        metric = "valid_pct" if d == "uncond" else "accuracy"
        part = agg[agg["difficulty"] == d]
        if part.empty or f"{metric}_mean" not in part:
            continue
        budgets = aup_budgets(part["board"].iloc[0], d)
        part = part[part["nfe_budget"].isin(budgets)]
        points = part.rename(columns={f"{metric}_mean": metric, "tpf_mean": "tpf"}).dropna(subset=[metric])
        keys = ["method", "variant", "sampler", "sampler_settings"]
        every = aup_lines(points, keys, metric, drop=None)
        cut = aup_lines(points, keys, metric).set_index(keys)["aup"]
        for method, variant, sampler in _models(points):
            mine = every[(every["method"] == method) & (every["variant"] == variant) & (every["sampler"] == sampler)]
            labels = settings_labels(list(mine["sampler_settings"]))
            for line in mine.itertuples(index=False):
                label = labels[line.sampler_settings]
                own = points[
                    (points["method"] == method) & (points["variant"] == variant) & (points["sampler"] == sampler)
                    & (points["sampler_settings"] == line.sampler_settings)
                ]  # fmt: skip
                missing = [b for b in budgets if b not in set(own["nfe_budget"])]
                d3 = cut.get((method, variant, sampler, line.sampler_settings), math.nan)
                lines.append(
                    {
                        "task": d,
                        "model": _label(method, variant),
                        "sampler": f"{sampler} {label}" if label else sampler,
                        "points": line.points,
                        "TPF": "" if pd.isna(line.tpf_min) else f"{line.tpf_min:.3g}–{line.tpf_max:.3g}",
                        "AUP": "" if pd.isna(line.aup) else f"{line.aup:.1f}",
                        "AUP, d3LLM cut": "" if pd.isna(d3) else f"{d3:.1f}",
                        "comparable": "yes" if not missing else "no: no point at NFE " + ", ".join(map(str, missing)),
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
    9, PR at 9 (the paper's headline budget) and at its 9 tokens a call mapped to the board (4 on 6×6, 9 on 9×9)."""
    if difficulty == "uncond":
        pr = dict.fromkeys((9, tokens_per_call_nfe(9, board)))  # in order, without repeats (9×9: 9 alone)
        return {"MDM": (empty_cells(board, difficulty), 9), "FMLM+": tuple(pr)}
    return {"MDM": (generated_positions(board, difficulty), LOW_NFE), "FMLM+": (LOW_NFE,)}


# A run's Hydra family (conf/family: its samplers and budgets) → the method its rows carry (the module's `label`).
CURVE_FAMILIES = {"mdm": "MDM", "flow": "FMLM+"}


def run_curve_nfe(run_config: dict) -> list[int]:
    """The budgets scripts/sudoku_curve.sh samples a run's kept checkpoints at (``run_config``: its run_config.yaml):
    the headline budgets of its method's curves (``curve_nfe``) that its own evaluation has (whose rows at the final
    weights are each curve's last point); a run with none of them (a family the report draws no curve of: MLFM) at
    NFE 4, where its evaluation has it, and at its evaluation's largest budget."""
    data, budgets = run_config["data"], run_config["eval"]["nfe"]
    n = int(data["box_rows"]) * int(data["box_cols"])
    difficulty = data.get("difficulty") if data.get("conditional", True) else "uncond"
    method = CURVE_FAMILIES.get(run_config.get("family"))
    drawn = curve_nfe(f"{n}x{n}", difficulty)[method] if method else ()
    return sorted(b for b in drawn if b in budgets) or sorted({b for b in budgets if b == LOW_NFE} | {max(budgets)})


def curve_points(rows: pd.DataFrame) -> pd.DataFrame:
    """Accuracy (conditional) / % valid (unconditional) against the training step (``eval_step``: the model's own
    steps) of the headline lines (``curve_nfe``, ``CURVE_SAMPLERS``): per task × model × sampler × NFE × step, the
    mean, min and max over seeds, the seeds, and the pooled count's proportion with its Wilson 95 % interval
    (``pooled``, ``wilson_lo``, ``wilson_hi``: the puzzles / grids the seeds' points sampled, summed; the sampling
    noise of the point, not the spread between seeds); the final weights' rows are the last point."""
    columns = ["task", "board", "model", "method", "variant", "sampler", "nfe_budget", "step", "mean", "min", "max"]
    columns += ["n", "seeds", "pooled", "wilson_lo", "wilson_hi"]
    lines = []
    rows = rows.assign(_samples=samples_of(rows)[0])
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
            hits, total = pooled_count(at, part.loc[at.index, "_samples"])
            lines.append(
                [d, board, _label(method, variant), method, variant, sampler, int(nfe), int(step), at.mean(), at.min(),
                 at.max(), len(at), ",".join(map(str, seeds)), 100 * hits / total, *wilson(hits, total)]
            )  # fmt: skip
    order = {d: i for i, d in enumerate([*DIFFICULTIES, "uncond"])}
    table = pd.DataFrame(lines, columns=columns)
    return table.sort_values(
        ["task", "model", "sampler", "nfe_budget", "step"], key=lambda c: c.map(order) if c.name == "task" else c
    ).reset_index(drop=True)


def curve_gains(points: pd.DataFrame) -> pd.DataFrame:
    """One line per curve: its final step and value, the point at the last checkpoint at or before 3/4 of the final
    step (``LAST_QUARTER``) measured on the same seeds, and the gain between them in points (NaN where the curve has
    no such point), with its 95 % interval from the two points' sampling noise (``gain_lo``, ``gain_hi``: Newcombe's
    hybrid score interval of a difference, from each point's pooled Wilson interval; the checkpoints' 512 puzzles
    against the final 2 000; not the spread between seeds)."""
    columns = ["task", "board", "model", "sampler", "NFE", "points", "final step", "final", "step at 3/4", "at 3/4"]
    columns += ["gain", "gain_lo", "gain_hi"]
    lines = []
    keys = ["task", "board", "model", "sampler", "nfe_budget"]
    for (task, board, model, sampler, nfe), curve in points.groupby(keys, sort=False):
        final = curve.iloc[-1]
        # the same seeds at both points: seeds whose runs ended at other steps (an earlier protocol's early stop) are
        # no one curve
        earlier = curve[(curve["step"] <= LAST_QUARTER * final["step"]) & (curve["seeds"] == final["seeds"])]
        quarter = earlier.iloc[-1] if len(earlier) else None
        lines.append(
            [task, board, model, sampler, nfe, len(curve), int(final["step"]), final["mean"],
             None if quarter is None else int(quarter["step"]), None if quarter is None else quarter["mean"],
             float("nan") if quarter is None else final["mean"] - quarter["mean"],
             *((float("nan"),) * 2 if quarter is None else _newcombe(final, quarter))]
        )  # fmt: skip
    return pd.DataFrame(lines, columns=columns)


def _newcombe(later: pd.Series, earlier: pd.Series) -> tuple[float, float]:
    """The 95 % interval of ``later − earlier`` (two curve points, independent samples) by Newcombe's hybrid score
    method: the difference of the means widened by each point's Wilson interval about its pooled proportion."""
    gain = later["mean"] - earlier["mean"]
    down = math.hypot(later["pooled"] - later["wilson_lo"], earlier["wilson_hi"] - earlier["pooled"])
    up = math.hypot(later["wilson_hi"] - later["pooled"], earlier["pooled"] - earlier["wilson_lo"])
    return gain - down, gain + up


def curve_table(gains: pd.DataFrame) -> pd.DataFrame:
    """``curve_gains`` for the report: values to one decimal, the gain signed with its 95 % sampling interval ('—'
    without a point at 3/4)."""
    table = gains.drop(columns="board")
    table["final"] = table["final"].map(rounded)
    table["at 3/4"] = table["at 3/4"].map(lambda v: "" if pd.isna(v) else rounded(v))
    table["step at 3/4"] = table["step at 3/4"].map(lambda v: "" if pd.isna(v) else f"{int(v)}")
    table["gain"] = [
        "—" if pd.isna(g) else f"{g:+.1f}" + ("" if pd.isna(lo) else f" [{lo:+.1f}, {hi:+.1f}]")
        for g, lo, hi in zip(table["gain"], table.pop("gain_lo"), table.pop("gain_hi"), strict=True)
    ]
    return table.rename(columns={"gain": "gain over the last quarter (points) [95 % sampling interval]"})


def budget_candidates(points: pd.DataFrame) -> pd.DataFrame:
    """Issue 47's budget, chosen from a curve trained past the budget (scripts/sudoku_budget_study.sh; the tables'
    own run's points before it): for every step B of the easy MDM's curves at one call per generated position, the
    point at the last checkpoint at or before 3/4 of B on the same seeds and the gain from there to B; ``accepted``
    where the gain is < BUDGET_GAIN points. The budget to choose is the smallest B every curve accepts
    (``chosen_budget``)."""
    columns = ["sampler", "NFE", "budget", "step at 3/4", "at 3/4", "at budget", "gain", "accepted"]
    easy = points[(points["task"] == "easy") & (points["model"] == "MDM")]
    one = [nfe == generated_positions(b, "easy") for nfe, b in zip(easy["nfe_budget"], easy["board"], strict=True)]
    lines = []
    for (sampler, nfe), curve in easy[pd.Series(one, index=easy.index, dtype=bool)].groupby(["sampler", "nfe_budget"]):
        for _, at in curve.iterrows():
            earlier = curve[(curve["step"] <= LAST_QUARTER * at["step"]) & (curve["seeds"] == at["seeds"])]
            if earlier.empty:
                continue
            quarter = earlier.iloc[-1]
            gain = at["mean"] - quarter["mean"]
            lines.append([sampler, int(nfe), int(at["step"]), int(quarter["step"]), quarter["mean"], at["mean"], gain,
                          bool(gain < BUDGET_GAIN)])  # fmt: skip
    return pd.DataFrame(lines, columns=columns).sort_values(["budget", "sampler"]).reset_index(drop=True)


def chosen_budget(candidates: pd.DataFrame, *, confirmed: bool = True) -> int | None:
    """The smallest budget from which on every measured step's curves (every sampler) gain < BUDGET_GAIN over their
    last quarter, from ``budget_candidates`` — one accepted step between rejected ones is a gain within the points'
    error, not a plateau; ``confirmed``: with at least one later step accepted too (else the last step may be
    named alone, provisionally). None where no step qualifies yet."""
    accepted = candidates.groupby("budget")["accepted"].all().sort_index()
    rejected_after = accepted[::-1].eq(False).cummax()[::-1]  # some step at or after this one is rejected
    stable = accepted[~rejected_after]
    if confirmed:
        stable = stable[stable.index < accepted.index.max()]
    return int(stable.index.min()) if len(stable) else None


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
    said = ", ".join(
        f"{r.sampler} {r.gain:+.1f}" + (f" [{r.gain_lo:+.1f}, {r.gain_hi:+.1f}]" if "gain_lo" in easy else "")
        for r in easy.itertuples()
    )
    ok = bool((easy["gain"] < BUDGET_GAIN).all())
    return f"Budget check ({rule}): {said} → " + (
        "accepted." if ok else "NOT accepted: the models were still learning."
    )


# ---------------------------------------------------------------- verdicts
REPRODUCES, FAILS, INCONCLUSIVE = "reproduces", "does not reproduce at this scale", "inconclusive"
# the same verdicts for a comparison the papers do not state (the suite's stronger baselines): nothing to reproduce
HOLDS, DOES_NOT_HOLD = "holds", "does not hold at this scale"
NOT_COMPARED = "not compared"  # the two sides trained unequal steps (``verdict``)


def trained_steps(c: Cell) -> str:
    """A cell's own training steps over its seeds, '20000' or '6000/20000'."""
    return "/".join(map(str, sorted(set(c.steps().values()))))


def trained_precision(c: Cell) -> str:
    """A cell's training precisions over its seeds, '32-true' or '32-true/bf16-mixed'."""
    return "/".join(sorted(set(c.precisions().values())))


def alike(a: dict, b: dict, seed: int) -> bool:
    """Whether seed ``seed`` trained alike on both sides of a comparison by the per-seed facts ``a`` and ``b`` (steps
    or precision): equal where both recorded it, alike where either did not."""
    return a.get(seed, b.get(seed)) == b.get(seed, a.get(seed))


def unequal_training(a: Cell, b: Cell) -> str | None:
    """'not compared (...)' where two cells' recorded own steps share no count, or their recorded training precisions
    none (issue 47: a model retrained to a new budget beside one not yet retrained; docs/protocol.md); else None."""
    steps_a, steps_b = a.steps(), b.steps()
    if steps_a and steps_b and not set(steps_a.values()) & set(steps_b.values()):
        return f"{NOT_COMPARED} (unequal training: {trained_steps(a)} against {trained_steps(b)} steps)"
    prec_a, prec_b = a.precisions(), b.precisions()
    if prec_a and prec_b and not set(prec_a.values()) & set(prec_b.values()):
        return f"{NOT_COMPARED} (unequal precision: {trained_precision(a)} against {trained_precision(b)})"
    return None


def verdict(better: Cell | None, worse: Cell | None) -> str:
    """The claim 'better > worse', from the per-seed differences of the seeds measured on both sides (paired):
    with two or more, reproduces when the 95 % t-interval of the mean difference lies above 0, does not reproduce
    when below; where it covers 0, the seeds' own intervals as with one seed when every paired seed is decided by
    them, all alike (said so: a second seed that agrees with a first one never weakens its verdict), else
    inconclusive. With one paired seed, only where that seed's own Wilson 95 % intervals on the two sides do not
    overlap (with none, each side's pooled interval): reproduces / does not reproduce (said so), else inconclusive.
    At equal training only (issue 47): a seed pairs where both sides trained the same own steps (or either did not
    record them), and two cells whose recorded steps share no count are not compared (a model retrained to a new
    budget beside one not yet retrained). Likewise the training precision (the protocol's bf16-mixed; float32 in a
    run that asked for it): a seed pairs where both sides trained in the same precision (or either did not record
    it), and two cells whose recorded precisions share none are not compared (docs/protocol.md)."""
    if better is None or worse is None:
        return "not measured"
    if unequal := unequal_training(better, worse):
        return unequal
    steps_a, steps_b = better.steps(), worse.steps()
    prec_a, prec_b = better.precisions(), worse.precisions()
    a, b = better.seeds(), worse.seeds()
    common = sorted(s for s in set(a) & set(b) if alike(steps_a, steps_b, s) and alike(prec_a, prec_b, s))
    if len(common) >= 2:
        diffs = [a[s] - b[s] for s in common]
        mean = sum(diffs) / len(diffs)
        sd = math.sqrt(sum((x - mean) ** 2 for x in diffs) / (len(diffs) - 1))
        half = t95(len(diffs) - 1) * sd / math.sqrt(len(diffs))
        said = f"paired Δ {mean:+.1f} [{mean - half:+.1f}, {mean + half:+.1f}], {len(common)} seeds"
        if mean - half > 0:
            return f"{REPRODUCES} ({said})"
        if mean + half < 0:
            return f"{FAILS} ({said})"
        # few seeds (t95(1) = 12.7): where every paired seed is decided by its own intervals, and all alike, the
        # verdict is theirs, so that a seed agreeing with the one that decided alone never weakens it
        apart = {_apart(better.seed_interval(s), worse.seed_interval(s)) for s in common}
        if apart in ({1}, {-1}):
            every = "the t-interval covers 0, but on every paired seed the Wilson 95 % intervals do not overlap"
            return f"{REPRODUCES if apart == {1} else FAILS} ({said}: {every})"
        return f"{INCONCLUSIVE} ({said})"
    seeds = "one paired seed" if common else "no seed on both sides"
    if common:  # that seed's own intervals, not pooled with seeds the other side lacks, said beside the verdict
        seed = common[0]
        ci_a, ci_b = better.seed_interval(seed), worse.seed_interval(seed)
        if ci_a is not None and ci_b is not None:
            seeds = (
                f"one paired seed, {seed}: {rounded(a[seed])} [{rounded(ci_a[0])}–{rounded(ci_a[1])}] against "
                f"{rounded(b[seed])} [{rounded(ci_b[0])}–{rounded(ci_b[1])}]"
            )
    else:
        ci_a, ci_b = better.interval(), worse.interval()
    if ci_a is None or ci_b is None:
        return f"{INCONCLUSIVE} ({seeds}, no interval)"
    if apart := _apart(ci_a, ci_b):
        return f"{REPRODUCES if apart > 0 else FAILS} ({seeds}: the Wilson 95 % intervals do not overlap)"
    return f"{INCONCLUSIVE} ({seeds}: the Wilson 95 % intervals overlap)"


def _apart(ci_a: tuple[float, float] | None, ci_b: tuple[float, float] | None) -> int:
    """+1 where interval ``ci_a`` lies wholly above ``ci_b``, -1 wholly below, 0 where they overlap or either is
    missing (a measure that is no proportion)."""
    if ci_a is None or ci_b is None:
        return 0
    return 1 if ci_a[0] > ci_b[1] else -1 if ci_a[1] < ci_b[0] else 0


def fail_verdict(failing: Cell | None, pr: Cell | None, below: float) -> str:
    """The claim 'failing fails (% valid < ``below``) where PR does not': reproduces when the failing line's Wilson
    95 % interval lies under ``below`` and PR's above it; does not reproduce when the failing line's lies at or above
    it (it does not fail) or PR's under it (PR fails too); inconclusive otherwise (an interval straddles it). Not
    compared where the two lines trained unequally (``unequal_training``)."""
    if failing is None or pr is None:
        return "not measured"
    if unequal := unequal_training(failing, pr):
        return unequal
    f, p = failing.interval(), pr.interval()
    if f is None or p is None:
        return f"{INCONCLUSIVE} (no interval)"
    said = f"Wilson 95 %: {f[0]:.1f}–{f[1]:.1f} vs PR {p[0]:.1f}–{p[1]:.1f}, threshold {below:g} %"
    if f[1] < below < p[0]:
        return f"{REPRODUCES} ({said})"
    if f[0] >= below:
        return f"{FAILS} (it does not fail: {said})"
    if p[1] < below:
        return f"{FAILS} (PR fails too: {said})"
    return f"{INCONCLUSIVE} ({said})"


PAPER, SUITE = "paper", "suite"  # a verdict's scope: where the paper states the claim / the suite's own finding
# The claims judged, by id; where the papers state each: the `claims` of reference.yaml's tasks.
CLAIMS = {
    "pr_beats_mdm": "FMLM+ PR at 4 NFE beats the paper's MDM row: MDLM (ancestral) at one call per generated position",
    "pr_beats_mdm_confidence": "FMLM+ PR at 4 NFE beats the MDM's confidence sampler at one call per generated "
    "position ({nfe} NFE): the suite's stronger baseline",
    "pr_beats_fast_mdm": "FMLM+ PR at 4 NFE beats the MDM's best decoder at ≤ PR's mean NFE on every seed (fast "
    "decoders included): the suite's stronger baseline",
    "pr_beats_a_priori": "PR beats the a-priori loop on the same checkpoint at low NFE ({nfe})",
    "mdm_a_priori_fail": "MDMs and FMLM+ with a-priori confidence fail catastrophically where PR does not ({nfe})",
    "init_distill_scratch": "MDM-initialised > distilled > scratch (PR at {nfe} NFE)",
    "mlfm_guidance": "MLFM: CCFG + OTP > CCFG > no guidance (NFE {nfe})",
}
ABSOLUTE, PER_CALL = "absolute", "by tokens per call"  # the unconditional budgets' two mappings


def stated(claim: str) -> dict[str, dict]:
    """Where the papers state ``claim`` (a CLAIMS id): reference.yaml task → {compared: {model, better first: the
    NFE the paper shows it at, null where it gives none}, source}."""
    return {task: ref["claims"][claim] for task, ref in reference_numbers().items() if claim in ref.get("claims", {})}


def scope(claim: str, difficulty: str, nfe: int, *, paper_nfe: int | None = None, variant: str | None = None) -> str:
    """PAPER when the paper states ``claim`` on this task at this NFE (the first compared model's; an unconditional
    NFE read as the paper's, PAPER_NFE, unless ``paper_nfe`` names it) for the paper's FMLM+ (``variant`` None or
    PAPER_VARIANT), else SUITE: the suite's own finding, not a reproduction verdict (a strategy row's too)."""
    where = stated(claim).get(f"sudoku_{difficulty}")
    if where is None or variant not in (None, PAPER_VARIANT):
        return SUITE
    nfes = next(iter(where["compared"].values()))
    if paper_nfe is None:
        paper_nfe = PAPER_NFE.get(nfe, nfe) if difficulty == "uncond" else nfe
    return PAPER if nfes is None or paper_nfe in nfes else SUITE


def stated_text(claim: str) -> str:
    """Where the papers state ``claim``, e.g. 'sudoku_easy, sudoku_medium: FMLM+ PR @4 > MDLM @128 (FMLM+ / PR
    paper, conditional generation table)'; tasks with the same statement share one entry."""
    tasks_of: dict[str, list[str]] = {}
    for task, where in stated(claim).items():
        models = [
            model + ("" if nfe is None else " @" + "/".join(map(str, nfe))) for model, nfe in where["compared"].items()
        ]
        if "fails_below" in where:  # the first compared model does not fail; the others do
            text = f"{', '.join(models[1:])} < {where['fails_below']:g} % where {models[0]} is not"
        else:
            text = " > ".join(models)
        tasks_of.setdefault(f"{text} ({where['source']})", []).append(task)
    return "; ".join(f"{', '.join(tasks)}: {text}" for text, tasks in tasks_of.items()) or "not stated by the papers"


def _line(part: pd.DataFrame, metric: str, method: str, variant: str | None, sampler: str, nfe: int) -> Cell | None:
    where = dict(method=method, sampler=sampler, nfe_budget=nfe) | ({} if variant is None else {"variant": variant})
    return cell(part, metric, **where)


def verdicts(agg: pd.DataFrame) -> pd.DataFrame:
    """One line per claim × task (× variant, × budget mapping): the claim, the row judged (the paper's FMLM+ or a
    strategy row), the two figures compared, the verdict, its scope (PAPER: judged where the paper states the claim,
    on the paper's variant; SUITE: the suite's own finding) and where the paper states it. A claim of the paper's
    (scope PAPER) has its line on every task the tables cover, *not measured* until its rows exist; the suite's own
    comparisons appear once either side is measured."""
    lines = []

    def add(claim, nfe, task, a_label, a, b_label, b, *, variant=None, paper_nfe=None, judged=None, keep=False):
        # ``nfe``: the claimed-better side's, which decides the scope; ``keep``: a line even when neither side was
        # measured (a budget the paper states the claim at)
        where = scope(claim, task, nfe, paper_nfe=paper_nfe, variant=variant)
        if a is None and b is None and not keep and where != PAPER:
            return
        said = judged if judged is not None else verdict(a, b)
        if f"sudoku_{task}" not in stated(claim):  # not a paper's claim here: it holds or not, nothing reproduces
            for paper_word, own in ((REPRODUCES, HOLDS), (FAILS, DOES_NOT_HOLD)):
                if said.startswith(paper_word):
                    said = own + said[len(paper_word) :]
        lines.append(
            {
                "claim": CLAIMS[claim].format(nfe=nfe),
                "task": task,
                "row": "" if variant is None else role("FMLM+", variant),
                "compared": f"{a_label} {a if a else '—'}{a.spent() if a else ''} vs {b_label} {b if b else '—'}"
                + (b.spent() if b else ""),
                "verdict": said,
                "scope": where,
                "stated": stated_text(claim),
            }
        )

    boards = agg["board"].dropna() if "board" in agg else pd.Series(dtype=object)
    for d in [*DIFFICULTIES, "uncond"]:
        part = agg[agg["difficulty"] == d]
        metric = "valid_pct" if d == "uncond" else "accuracy"
        # a task without rows yet: the board of the rows there are (the paper's claims are listed, not measured)
        board = part["board"].iloc[0] if not part.empty else (boards.iloc[0] if not boards.empty else "6x6")
        full, one = empty_cells(board, d), generated_positions(board, d)
        at = lambda m, v, s, nfe, part=part, metric=metric: _line(part, metric, m, v, s, nfe)  # noqa: E731
        if d != "uncond":
            for v in VARIANTS:
                pr = at("FMLM+", v, "pr", LOW_NFE)
                label = f"FMLM+ {v} PR@4"
                add("pr_beats_mdm", LOW_NFE, d, label, pr, f"MDM ancestral@{one}", at("MDM", None, "ancestral", one),
                    variant=v)  # fmt: skip
                add("pr_beats_mdm_confidence", one, d, label, pr, f"MDM confidence@{one}",
                    at("MDM", None, "confidence", one), variant=v)  # fmt: skip
                spent = cell(part, "nfe", method="FMLM+", variant=v, sampler="pr", nfe_budget=LOW_NFE)
                bound = min(LOW_NFE, spent.mean) if spent is not None else LOW_NFE  # PR's mean NFE (early stop)
                fast = best_within_nfe(part, metric, "MDM", bound, pr.seeds() if pr is not None else ())
                if fast is not None:
                    add("pr_beats_fast_mdm", LOW_NFE, d, label, pr, fast[0], fast[1], variant=v)
            for v in VARIANTS:
                pr, prior = at("FMLM+", v, "pr", LOW_NFE), at("FMLM+", v, "a_priori", LOW_NFE)
                add("pr_beats_a_priori", LOW_NFE, d, f"FMLM+ {v} PR", pr, "a-priori", prior, variant=v)
        else:
            _uncond_verdicts(add, at, board)
        nfe = LOW_NFE if d != "uncond" else 9
        for hi, lo in (("init", "distill"), ("distill", "scratch")):
            add("init_distill_scratch", nfe, d, hi, at("FMLM+", hi, "pr", nfe), lo, at("FMLM+", lo, "pr", nfe))
        for hi, lo in (("mlfm_ccfg_otp", "mlfm_ccfg"), ("mlfm_ccfg", "mlfm")):
            add("mlfm_guidance", full, d, hi, at("MLFM", "init", hi, full), lo, at("MLFM", "init", lo, full))
    return pd.DataFrame(lines, columns=["claim", "task", "row", "compared", "verdict", "scope", "stated"])


def _uncond_verdicts(add, at, board: str) -> None:
    """The unconditional claims at every NFE the paper states them, under both mappings of its budgets: absolute
    (the same NFE; its 81 as 36) and by tokens per call (tokens_per_call_nfe)."""
    for claim in ("pr_beats_a_priori", "mdm_a_priori_fail"):
        where = stated(claim).get("sudoku_uncond")
        if where is None:
            continue
        paper_nfes = next(iter(where["compared"].values())) or []
        for p in paper_nfes:
            absolute = next((n for n, q in PAPER_NFE.items() if q == p), None)
            for mapping, nfe in ((ABSOLUTE, absolute), (PER_CALL, tokens_per_call_nfe(p, board))):
                if nfe is None:
                    continue
                said = f"paper NFE {p} → NFE {nfe}, {mapping}"
                for v in VARIANTS:
                    pr = at("FMLM+", v, "pr", nfe)
                    prior = at("FMLM+", v, "a_priori", nfe)
                    if claim == "pr_beats_a_priori":
                        add(claim, said, "uncond", f"FMLM+ {v} PR", pr, "a-priori", prior, variant=v, paper_nfe=p,
                            keep=v == PAPER_VARIANT)  # fmt: skip
                        continue
                    below = float(where["fails_below"])
                    failing = [(f"FMLM+ {v} a-priori", prior)]
                    if v == PAPER_VARIANT:  # the paper's MDLM rows, against the paper's FMLM+
                        failing = [(f"MDM {s}", at("MDM", None, s, nfe)) for s in ("ancestral", "confidence")] + failing
                    for label, line in failing:
                        add(claim, said, "uncond", f"{label}@{nfe}", line, f"FMLM+ {v} PR@{nfe}", pr, variant=v,
                            paper_nfe=p, judged=fail_verdict(line, pr, below), keep=v == PAPER_VARIANT)  # fmt: skip


def best_within_nfe(
    part: pd.DataFrame, metric: str, method: str, nfe: float, seeds: Iterable[int] = ()
) -> tuple[str, Cell] | None:
    """The ``method``'s best line (any sampler, settings and budget) whose mean NFE spent is at most ``nfe`` on every
    seed: a fixed-step sampler at that budget, or an adaptive one (threshold, EB) whose rows needed no more on average,
    whatever its cap (a line whose seeds average under ``nfe`` while one seed spent more is out: not equal calls); its
    label ('MDM eb@18 (3.9 NFE)', the mean over seeds, the settings named where a sampler ran with several) and its
    own cell. None when none is measured. With ``seeds`` (the seeds the compared line has), the line measured on
    the most of them wins, then the best mean on them: the strongest baseline on the seeds a verdict pairs, not one
    that is best only on seeds the other side lacks; without, the best mean over all of its seeds."""
    spent = "nfe_seed_max" if "nfe_seed_max" in part else "nfe_mean"
    lines = part[(part["method"] == method) & (part[spent] <= nfe + 1e-9)] if spent in part else part[:0]
    lines = lines.dropna(subset=[f"{metric}_mean"]) if f"{metric}_mean" in lines else lines[:0]
    wanted = set(seeds)

    def rank(got: Cell) -> tuple[int, float]:  # more of the wanted seeds first, then the mean on them
        on = [v for s, v in got.seeds().items() if s in wanted]
        return (len(on), sum(on) / len(on)) if on else (0, got.mean)

    best: tuple[str, Cell] | None = None
    for _, line in lines.iterrows():
        got = _cell_of(line, metric)
        if best is None or rank(got) > rank(best[1]):
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
    kinds = table["verdict"].str.split(" \\(", regex=True).str[0].value_counts()
    order = [REPRODUCES, HOLDS, FAILS, DOES_NOT_HOLD, INCONCLUSIVE, NOT_COMPARED, "not measured"]
    return {k: int(kinds[k]) for k in sorted(kinds.index, key=lambda k: order.index(k) if k in order else 9)}


def headline(agg: pd.DataFrame) -> list[str]:
    """The headline figures per task: the paper's FMLM+ (from scratch) PR against the paper's MDM row (ancestral at
    one call per generated position, conditional; the same NFE, unconditional), and the suite's stronger baselines
    beside it (the confidence sampler at that NFE; conditional, the MDM's best decoder at ≤ 4 NFE)."""
    out = []
    for d in [*DIFFICULTIES, "uncond"]:
        part = agg[agg["difficulty"] == d]
        if part.empty:
            continue
        metric = "valid_pct" if d == "uncond" else "accuracy"
        board = part["board"].iloc[0]
        pr_nfe, mdm_nfe = (9, 9) if d == "uncond" else (LOW_NFE, generated_positions(board, d))
        pr = _line(part, metric, "FMLM+", PAPER_VARIANT, "pr", pr_nfe)
        paper_row = _line(part, metric, "MDM", None, "ancestral", mdm_nfe)
        stronger = _line(part, metric, "MDM", None, "confidence", mdm_nfe)
        text = f"{d}: FMLM+ scratch PR@{pr_nfe} {pr or '—'} %{_seeds_of(pr)} vs the paper's row, MDM "
        text += f"ancestral@{mdm_nfe} {paper_row or '—'} %{_seeds_of(paper_row)}"
        if pr and paper_row and pr.steps() and paper_row.steps() and trained_steps(pr) != trained_steps(paper_row):
            text += f" (unequal training so far: {trained_steps(pr)} against {trained_steps(paper_row)} steps)"
        elif (
            pr
            and paper_row
            and pr.precisions()
            and paper_row.precisions()
            and (trained_precision(pr) != trained_precision(paper_row))
        ):
            text += f" (unequal precision so far: {trained_precision(pr)} against {trained_precision(paper_row)})"
        text += f"; the suite's stronger baselines: MDM confidence@{mdm_nfe} {stronger or '—'} %{_seeds_of(stronger)}"
        if d != "uncond":
            fast = best_within_nfe(part, metric, "MDM", LOW_NFE, pr.seeds() if pr is not None else ())
            text += f", {fast[0]} {fast[1]} %{_seeds_of(fast[1])}" if fast else ", no MDM decoder at ≤ 4 NFE measured"
        else:
            per_call = tokens_per_call_nfe(9, board)
            mapped = _line(part, metric, "FMLM+", PAPER_VARIANT, "pr", per_call)
            text += f"; by tokens per call (the paper's 9 ↔ {per_call}): PR@{per_call} {mapped or 'not measured'}"
        out.append(text)
    return out


def _seeds_of(c: Cell | None) -> str:
    """' (seed 0)' / ' (seeds 0, 1)': the seeds a headline cell holds (the two sides may hold different ones)."""
    if c is None or not c.seeds():
        return ""
    seeds = sorted(c.seeds())
    return f" (seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))})"


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


def samples_note(rows: pd.DataFrame) -> str:
    """One sentence on the rows whose sample count is a default (samples_of), '' when every row recorded it."""
    final = final_rows(rows)
    counts, recorded = samples_of(final)
    assumed = counts[~recorded]
    if assumed.empty:
        return ""
    by = ", ".join(f"{n} rows as {k}" for k, n in sorted(assumed.value_counts().items()))
    return (
        f" Rows without a recorded `samples` count (CSVs written before the column): {by} (the fixed-budget "
        f"protocol's {DEFAULT_SAMPLES} val puzzles / grids from {PROTOCOL_START[:10]} on, earlier the CPU scale's "
        f"{EARLIER_SAMPLES['conditional']} puzzles / {EARLIER_SAMPLES['uncond']} grids)."
    )


def build_sudoku_report(
    results_dir: str | Path, out: str | Path, *, title: str = "flowlm: the papers' Sudoku tables"
) -> Report:
    """Merge every results CSV under ``results_dir`` (not ``out``'s nor another report's: read_results) and write,
    in this order, the headline, the verdicts, the tables (conditional, unconditional under both budget mappings,
    the adaptive decoders, calibration, training), the accuracy-versus-training curves and AUP to ``out``
    (report.md, report.html, curves.png, one CSV per table, the merged rows); print what was read and each table's
    mixed-machines note."""
    out = Path(out)
    rows = read_results(results_dir, skip=[out])
    agg = aggregate(rows)
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out=out, markdown=out / REPORT_MD, html=out / REPORT_HTML)
    points = curve_points(rows)
    gains = curve_gains(points)
    tables = {
        "verdicts": verdicts(agg),
        "conditional": conditional_table(agg),
        "unconditional": unconditional_table(agg),
        "tokens_per_call": tokens_per_call_table(agg),
        "adaptive": adaptive_table(agg),
        "calibration": calibration_table(agg),
        "training": training_table(rows),
        "curves": curve_table(gains),
        "aup": aup_table(agg),
    }
    figure = None
    if len(points):
        figure = plots.training_curves(points, out / "curves.png", "Accuracy versus training (headline lines)")
        report.figures.append(figure)
    rows.drop(columns=["file"]).to_csv(out / ROWS_CSV, index=False)
    agg.to_csv(out / "aggregate.csv", index=False)
    points.to_csv(out / "curve_points.csv", index=False)
    report.data += [out / ROWS_CSV, out / "aggregate.csv", out / "curve_points.csv"]
    for name, table in tables.items():
        table.to_csv(out / f"{name}.csv", index=False)
        report.data.append(out / f"{name}.csv")
    report.tables = tables
    final = final_rows(rows)
    fixed = final[~final["sampler"].isin(ADAPTIVE)]
    cond, unc = fixed[fixed["difficulty"].isin(DIFFICULTIES)], fixed[fixed["difficulty"] == "uncond"]
    full = [empty_cells(b, d) for b, d in zip(final["board"], final["difficulty"], strict=True)]
    scored = final[(final["nfe_budget"] == LOW_NFE) | (final["nfe_budget"] == pd.Series(full, index=final.index))]
    notes = {  # the rows each table is made of
        "verdicts": machines_note(final),
        "conditional": machines_note(cond),
        "unconditional": machines_note(unc),
        "tokens_per_call": "",  # the same rows as the unconditional table's
        "adaptive": machines_note(final[final["sampler"].isin(ADAPTIVE)]),
        "calibration": machines_note(scored),
        "training": machines_note(final.drop_duplicates(["difficulty", "method", "variant", "seed"])),  # per model
        "curves": "",  # the rows' machines are named under the tables
        "aup": "",  # the accuracies' mix is named under their own tables
    }
    judged = tables["verdicts"]
    counts = {}
    for kind in (PAPER, SUITE):
        part = judged[judged["scope"] == kind]
        counts[kind] = ", ".join(f"{k}: {v}" for k, v in verdict_counts(part).items()) if len(part) else "none"
    board = final["board"].iloc[0] if len(final) else "6x6"
    one = {d: generated_positions(board, d) for d in DIFFICULTIES}
    per_call = ", ".join(f"{p} → {tokens_per_call_nfe(p, board)}" for p in PAPER_NFE.values())
    sections = [
        Section(
            title,
            f"Generated {datetime.now(UTC):%Y-%m-%d %H:%M} UTC from `{results_dir}`: {seeds_summary(rows)}. "
            "Cells: mean ± std over seeds (the mean alone for one seed) [the Wilson 95 % interval of the correct "
            "count pooled over seeds: accuracy % × samples, summed]; a cell whose sampler spent other than its "
            "budget adds `· NFE mean (seed max)`. The tables and verdicts read the final weights' rows "
            "(`eval_step` = the run's steps); the earlier checkpoints' rows are the curves. Measured rows are this "
            "suite's CPU-scale runs (6×6 boards, `tiny` DiT), not the papers' setting (9×9, paper-scale models, "
            "labelled beside). FMLM+ from scratch is the headline row (the paper's variant); initialised, distilled "
            "and MLFM are the suite's strategy rows." + samples_note(rows),
            level=1,
        ),
        Section("Headline", "; ".join(headline(agg)) or "no row measured"),
        Section(
            "Verdicts",
            "Each claim of the papers against the measured numbers, from the per-seed differences of the seeds "
            "measured on both sides (paired): reproduces when the 95 % t-interval of the mean difference lies above "
            "0, does not reproduce when below, inconclusive when it covers 0 unless every paired seed's own "
            "Wilson 95 % intervals on the two sides do not overlap, all alike (then their verdict, said so); with "
            "one paired seed only where that seed's own intervals do not overlap (with none, the two cells' pooled "
            "intervals; the verdict says which). Seeds pair only at "
            "equal own training steps and precision, and two lines trained to different budgets (a model retrained "
            "to the new budget beside one not yet retrained) or in different precisions are not compared. The "
            f"paper's MDM row is MDLM: the ancestral sampler at one call per generated position (NFE {one['easy']} "
            "on 6×6, its 128 on 89 positions); the confidence sampler there and the MDM's best decoder at ≤ PR's "
            "mean NFE on every seed are the suite's stronger baselines, judged beside it (scope `suite`). \"Fail "
            "catastrophically\": % valid under 5 % (Wilson interval under it) where PR's lies above. Unconditional "
            "claims are judged at "
            "every NFE the paper states, under both mappings of its budgets (absolute; by tokens per call). Scope "
            "`paper`: judged on the task and NFE where the paper states the claim, on the paper's variant "
            "(`stated`: its task, models and NFE, analysis/reference.yaml), a reproduction verdict; scope `suite`: "
            "judged elsewhere or on a strategy row, the suite's own finding; a comparison the papers do not state on "
            "that task (the stronger baselines; a claim stated on another task) holds or does not hold rather than "
            "reproduces. "
            f"Reproduction verdicts: {counts[PAPER]}. The suite's own findings: {counts[SUITE]}. Every verdict is "
            f"at the models' training budget: {budget_check(gains)}",
            judged,
        ),
        Section(
            "Conditional Sudoku: accuracy % (methods.md §8, conditional table)",
            "Fixed-step samplers at NFE 4 (PR: R = 4, N = 1, the released setting), NFE = the empty cells and, for "
            "the MDM, one call per generated position (36 cells + 5 separators on 6×6: the paper's MDLM regime, "
            "128 calls on 9×9's 89 positions, shown in that column). The adaptive decoders are in their own table "
            "below.",
            tables["conditional"],
        ),
        Section(
            "Unconditional Sudoku, budgets mapped absolutely: % valid · distinct valid grids · % copies of training "
            "grids",
            "NFE 1 / 3 / 9 / 27 / 36 on a 36-cell board beside the paper's same NFE on 81 cells (its 81 under 36): "
            "the same number of calls, more cells a call in the paper. Paper rows: % valid only.",
            tables["unconditional"],
        ),
        Section(
            "Unconditional Sudoku, budgets mapped by tokens per call: % valid",
            f"Each paper NFE beside the fewest 6×6 calls that fill no more cells a call than the paper's (36 / NFE "
            f"against 81 / NFE, rounded up: {per_call}); blank where that budget was not measured.",
            tables["tokens_per_call"],
        ),
        Section(
            "Adaptive decoders (their own rows)",
            "Threshold, margin and EB decode until their rule is met, under a cap: each line at its cap with the NFE "
            "it actually spent (mean over seeds; the most one seed spent on average), cells filled per call (TPF), "
            "the sampling wall time per sample (ms, and per NFE spent: the run's machine, shared, so compare within a "
            "model and machine) and accuracy / % valid." + fixed_step_wall(agg),
            tables["adaptive"],
        ),
        Section(
            "Calibration: a-priori vs a-posteriori confidence (AUROC, right vs wrong tokens)",
            "AUROC of the per-token confidence a sampler committed with, for telling right tokens from wrong ones "
            "(1 = perfect ranking, 0.5 = none); right = equals the solution (conditional) or clashes with no "
            "cell of its row, column and box (unconditional). Mean ± std over seeds (the mean alone for one "
            "seed); in brackets the wrong tokens among those scored (each seed's first `eval.calibration_tokens` "
            "generated tokens), summed over the seeds: an AUROC from a few wrong tokens ranks only those few, and "
            "where none was wrong (or none right) it is undefined (—).",
            tables["calibration"],
        ),
        Section(
            "Training, per seed",
            "Each model's final weights: its own optimizer steps, the total (an initialised, distilled or MLFM "
            "model counts its MDM's steps too), the fit's wall time (evaluations included) and the final val loss "
            "(each method's own objective: not comparable across methods).",
            tables["training"],
        ),
        Section(
            "Accuracy versus training",
            "Accuracy (conditional) / % valid (unconditional) of the headline lines against the model's own "
            "training step: each checkpoint kept at an eighth of the budget, sampled offline (the rows' "
            "`eval_step`; the final weights' rows are the last point), mean over seeds, band: min–max "
            "(curve_points.csv). Per curve, the gain over the last quarter of the steps: the final point less the "
            "last checkpoint at ≤ 3/4 of the final step, with its 95 % sampling interval (Newcombe's, from the two "
            "points' pooled Wilson intervals: a checkpoint's 512 puzzles against the final 2 000; the spread between "
            f"seeds is not in it). {budget_check(gains)}",
            tables["curves"],
            image=figure,
        ),
        Section(
            "AUP: accuracy under parallelism (d3LLM)",
            "The weighted area under each decoder's curve of accuracy (conditional) or % valid (unconditional) "
            "against tokens per forward (TPF: the cells a row fills / the mean NFE, a ratio of sums over seeds), over "
            "the same NFE budgets for every line (conditional 4 and the empty cells; unconditional 1 / 3 / 9 / 27 / "
            "36; an adaptive decoder at those caps, where its TPF is what it spent), each point weighted by "
            "min(exp(−3 (1 − y / y_max)), 1), y_max the task's best (analysis/aup.py). `AUP` keeps every point; "
            "`AUP, d3LLM cut` leaves out points more than 5 below the slowest point's (d3LLM's rule, which leaves a "
            "line whose few-NFE points fall off with its slow end alone). `comparable`: whether the line has every "
            "budget. Higher is better.",
            tables["aup"],
        ),
    ]
    order = ["", "", "verdicts", "conditional", "unconditional", "tokens_per_call", "adaptive", "calibration"]
    order += ["training", "curves", "aup"]
    markdown, page = _render([(s, notes.get(k, "")) for s, k in zip(sections, order, strict=True)], out, title)
    report.markdown.write_text(markdown)
    report.html.write_text(page)
    summary = [f"Read {results_dir}: {seeds_summary(rows)}"]
    summary += [f"{name} table: {note}" for name, note in notes.items() if note]
    print("\n".join(summary), flush=True)
    return report
