"""The papers' Sudoku tables from the results CSVs (callbacks/results_csv.py): merged over every CSV of the results
folder, deduplicated per (row, seed), mean ± std over seeds, the papers' numbers beside each row, and one verdict
per claim computed from the numbers (docs/results.md)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import pandas as pd

from analysis.report import REPORT_HTML, REPORT_MD, Report, Section, _render_html, _render_markdown
from analysis.tables import reference_numbers
from flowlm.tasks.sudoku import clues_for

# A table row's identity; with `seed` the identity of one measurement (the latest `date` wins on duplicates).
KEY = ["board", "difficulty", "method", "variant", "sampler", "sampler_settings", "nfe_budget"]
MEASURES = ["accuracy", "valid_pct", "distinct_valid", "train_copy_pct", "auroc", "wrong_pct", "nfe"]
TRAINING = ["steps", "budget_steps", "wall_s", "final_val_loss"]
DIFFICULTIES = ("easy", "medium", "hard")
UNCOND_NFE = (1, 3, 9, 27, 36)  # the paper's 1 / 3 / 9 / 27 / 81 on a 36-cell board
LOW_NFE = 4  # the released PR setting: R = 4, N = 1
# Row order of the tables: model (method, variant) then sampler.
MODELS = [("MDM", "scratch"), ("FMLM+", "scratch"), ("FMLM+", "distill"), ("FMLM+", "init"), ("MLFM", "init")]
SAMPLERS = ["ancestral", "confidence", "pr", "a_priori", "mlfm", "mlfm_ccfg", "mlfm_ccfg_otp"]
PAPER_METHOD = {"MDLM": "MDM", "FMLM+": "FMLM+"}  # reference.yaml's model → the suite's method


class NoResultsError(ValueError):
    """The results folder holds no results CSV."""


def read_results(folder: str | Path) -> pd.DataFrame:
    """Every ``*.csv`` under ``folder`` (any depth), one frame; the same (row, seed) measured twice keeps its latest
    row (by ``date``)."""
    folder = Path(folder)
    files = sorted(folder.rglob("*.csv")) if folder.is_dir() else []
    if not files:
        raise NoResultsError(
            f"no results CSV under {folder.resolve()} (written by runs with callbacks.results_csv.dir)"
        )
    rows = pd.concat([pd.read_csv(f, keep_default_na=True).assign(file=str(f)) for f in files], ignore_index=True)
    missing = [c for c in [*KEY, "seed", "date"] if c not in rows]
    if missing:
        raise NoResultsError(f"results CSVs under {folder} lack the columns {missing}")
    rows["sampler_settings"] = rows["sampler_settings"].fillna("{}")
    rows["converged"] = rows["converged"].astype(str).str.lower().eq("true")
    rows = rows.sort_values("date", kind="stable").drop_duplicates([*KEY, "seed"], keep="last")
    return rows.reset_index(drop=True)


def aggregate(rows: pd.DataFrame) -> pd.DataFrame:
    """One line per KEY: mean, std (ddof 1; 0 for one seed) and seed count of every measure; training facts as
    means, ``converged`` as the number of converged seeds."""
    grouped = rows.groupby(KEY, sort=False, dropna=False)
    out = grouped.size().rename("n").to_frame()
    for m in MEASURES + TRAINING:
        if m in rows:
            values = pd.to_numeric(rows[m], errors="coerce")
            out[f"{m}_mean"] = values.groupby([rows[k] for k in KEY], sort=False, dropna=False).mean()
            out[f"{m}_std"] = values.groupby([rows[k] for k in KEY], sort=False, dropna=False).std().fillna(0.0)
    out["converged"] = grouped["converged"].sum()
    if "confidence_kind" in rows:  # the sampler's declared kind (flowlm/samplers), one per sampler
        out["confidence_kind"] = grouped["confidence_kind"].first()
    out["seeds"] = grouped["seed"].agg(lambda s: ",".join(str(v) for v in sorted(s.unique())))
    return out.reset_index()


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
    paper_nfe = dict(zip(UNCOND_NFE, (1, 3, 9, 27, 81), strict=True))
    lines = []
    for row in ref["rows"]:
        line = {"source": ref["label"], "model": row["model"], "sampler": row["sampler"]}
        for nfe in UNCOND_NFE:
            value = row["values"].get(paper_nfe[nfe])
            line[f"NFE {nfe}"] = "" if value is None else f"{value:.1f}" + ("" if nfe == paper_nfe[nfe] else " (81)")
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


def verdicts(agg: pd.DataFrame) -> pd.DataFrame:
    """One line per claim × task (× variant): the claim, the two figures compared, the verdict."""
    lines = []

    def add(claim: str, task: str, a_label: str, a: Cell | None, b_label: str, b: Cell | None) -> None:
        if a is None and b is None:
            return
        lines.append(
            {
                "claim": claim,
                "task": task,
                "compared": f"{a_label} {a if a else '—'} vs {b_label} {b if b else '—'}",
                "verdict": verdict(a, b),
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
                add(
                    "FMLM+ PR at 4 NFE beats the MDM at full NFE (its better sampler)",
                    d,
                    f"FMLM+ {v} PR@4",
                    at("FMLM+", v, "pr", LOW_NFE),
                    f"MDM@{full}",
                    best,
                )
        for nfe in (LOW_NFE,) if d != "uncond" else (3, 9):
            for v in ("scratch", "distill", "init"):
                add(
                    f"PR beats the a-priori loop on the same checkpoint at low NFE ({nfe})",
                    d,
                    f"FMLM+ {v} PR",
                    at("FMLM+", v, "pr", nfe),
                    "a-priori",
                    at("FMLM+", v, "a_priori", nfe),
                )
        nfe = LOW_NFE if d != "uncond" else 9
        for hi, lo in (("init", "distill"), ("distill", "scratch")):
            add(
                f"MDM-initialised > distilled > scratch (PR at {nfe} NFE)",
                d,
                f"{hi}",
                at("FMLM+", hi, "pr", nfe),
                f"{lo}",
                at("FMLM+", lo, "pr", nfe),
            )
        for hi, lo in (("mlfm_ccfg_otp", "mlfm_ccfg"), ("mlfm_ccfg", "mlfm")):
            add(
                f"MLFM: CCFG + OTP > CCFG > no guidance (NFE {full})",
                d,
                hi,
                at("MLFM", "init", hi, full),
                lo,
                at("MLFM", "init", lo, full),
            )
    return pd.DataFrame(lines, columns=["claim", "task", "compared", "verdict"])


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
    """'N rows, seeds {…}, from K files, commits …' for the report's header."""
    seeds = sorted(int(s) for s in rows["seed"].dropna().unique())
    commits = sorted({str(c)[:10] for c in rows.get("git_commit", pd.Series(dtype=str)).dropna()})
    return (
        f"{len(rows)} measured rows, seeds {seeds}, from {rows['file'].nunique()} CSV files; "
        f"code {', '.join(commits) or 'unknown'}"
    )


def build_sudoku_report(
    results_dir: str | Path, out: str | Path, *, title: str = "flowlm: the papers' Sudoku tables"
) -> Report:
    """Merge every results CSV under ``results_dir`` and write the conditional, unconditional, calibration and
    verdict tables to ``out`` (report.md, report.html, one CSV per table, the merged rows)."""
    rows = read_results(results_dir)
    agg = aggregate(rows)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out=out, markdown=out / REPORT_MD, html=out / REPORT_HTML)
    tables = {
        "conditional": conditional_table(agg),
        "unconditional": unconditional_table(agg),
        "calibration": calibration_table(agg),
        "verdicts": verdicts(agg),
    }
    rows.drop(columns=["file"]).to_csv(out / "rows.csv", index=False)
    agg.to_csv(out / "aggregate.csv", index=False)
    report.data += [out / "rows.csv", out / "aggregate.csv"]
    for name, table in tables.items():
        table.to_csv(out / f"{name}.csv", index=False)
        report.data.append(out / f"{name}.csv")
    report.tables = tables
    counts = verdict_counts(tables["verdicts"]) if len(tables["verdicts"]) else {}
    sections = [
        Section(
            title,
            f"Generated {datetime.now(UTC):%Y-%m-%d %H:%M} UTC from `{results_dir}`: {seeds_summary(rows)}. Cells: "
            "mean ± std over seeds (the mean alone for one seed). Measured rows are this suite's CPU-scale runs "
            "(6×6 boards, `tiny` DiT), not the papers' setting (9×9, paper-scale models, labelled beside). "
            "Training: the step budget (an MDM-based model counts its MDM's steps; own steps in brackets), wall "
            "time, final val loss and whether the convergence rule (docs/results.md#convergence-protocol) was met "
            "before the step cap.",
            level=1,
        ),
        Section(
            "Headline",
            "; ".join(headline(agg)) or "no conditional row measured",
        ),
        Section(
            "Verdicts",
            "Each claim of the papers against the measured numbers: reproduces when the means differ in the claimed "
            "direction by more than the two std together, does not reproduce when they differ the other way by as "
            "much, inconclusive otherwise (or with one seed). Counts: "
            + (", ".join(f"{k}: {v}" for k, v in counts.items()) or "no claim measured")
            + ".",
            tables["verdicts"],
        ),
        Section(
            "Conditional Sudoku: accuracy % (methods.md §8, conditional table)",
            "NFE 4 (PR: R = 4, N = 1, the released setting) and NFE = the number of empty cells (full). Paper rows: "
            "9×9, MDLM at 128 NFE.",
            tables["conditional"],
        ),
        Section(
            "Unconditional Sudoku: % valid · distinct valid grids · % copies of training grids",
            "NFE 1 / 3 / 9 / 27 / 36 on a 36-cell board (the paper's 1 / 3 / 9 / 27 / 81 on 81 cells; its 81 is shown "
            "under 36). Paper rows: % valid only.",
            tables["unconditional"],
        ),
        Section(
            "Calibration: a-priori vs a-posteriori confidence (AUROC, right vs wrong tokens)",
            "AUROC of the per-token confidence a sampler committed with, for telling right tokens from wrong ones "
            "(1 = perfect ranking, 0.5 = none); right = equals the solution (conditional) or clashes with no cell "
            "of its row, column and box (unconditional). Mean ± std over seeds (the mean alone for one seed).",
            tables["calibration"],
        ),
    ]
    report.markdown.write_text(_render_markdown(sections, out))
    report.html.write_text(_render_html(sections, title))
    return report
