"""Evaluate every configured sampler × NFE budget at validation, from the weights validation runs on (EMA)."""

from __future__ import annotations

import json
import math
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.trainer.states import TrainerFn
from torchmetrics import CatMetric, MeanMetric, Metric

from flowlm.ops.compiled import compiled_tails
from flowlm.samplers.base import CONFIDENCE_KINDS, SampleOutput, Sampler
from lightning_modules.sharding import full_parameters


class Unloaded:
    """A datamodule's layout before its data exist, to build a task metric early (the Sudoku metric reads the
    training set only to score)."""

    train_keys = frozenset()

    def __init__(self, datamodule) -> None:
        self._datamodule = datamodule

    def __getattr__(self, name: str):
        return getattr(self._datamodule, name)


class SamplingEvaluation(Callback):
    """Runs samplers on validation batches and logs task metrics, NFE spent, wall-clock and sample artifacts.

    The datamodule shards validation batches across ranks; task metrics and means are torchmetrics states,
    so they are reduced over all ranks before they are logged. Keys: ``eval/<sampler>/nfe<budget>/<metric>``.
    ``metric`` builds the task metric from the datamodule (e.g. Sudoku accuracy or validity).

    With ``calibration_tokens > 0`` and a task metric that defines ``token_correct``, the first
    ``calibration_tokens`` generated tokens of each sampler × budget (on rank 0; a sample, not a census) are kept
    as (confidence, correct) pairs and logged as ``eval/step<step>/calibration.npz`` (see ``save_calibration``).

    A task metric with ``artifact_rows()`` (per-sample texts, GSM8K answers) has its rows logged as JSONL,
    ``eval/step<step>/<sampler>_nfe<budget>.jsonl``: rank 0's rows (strings are not gathered across ranks).

    ``compile_tails``: run the samplers' passes over the logits compiled (``flowlm.ops.compiled``; seconds of
    compilation once per process, then one fused pass each: worth it at text vocabularies).

    Cost keys beside the task metric (``COST_KEYS``): ``nfe``, the NFE spent per row, averaged (an adaptive sampler
    spends its own per row, ``SampleOutput.row_nfe``; the budget is its cap); its spread over the rows, ``nfe_std``
    (ddof 0), ``nfe_min``, ``nfe_p50``, ``nfe_p90``, ``nfe_max``; ``tpf``, tokens per forward, the positions generated
    over the NFE spent, both summed over the rows (= generated positions per row / mean NFE; the mean of the rows'
    ratios, logged before 2026-12-06, read 2–6 % high); ``forced_share``, the share of an adaptive sampler's commits
    that its NFE budget forced beyond its rule (``SampleOutput.forced``; 0 for a fixed-step sampler, whose schedule is
    its rule: a line with a positive share is its rule capped by the budget, not the published rule alone);
    ``sec_per_sample``. The NFE
    histogram of every sampler × budget (rows per NFE value) is logged as ``eval/step<step>/nfe_histogram.json``.

    ``every_n_steps``: during fit, sample only at validations whose step is a multiple of it (the validation loss is
    still computed at every validation); null samples at every one. The final weights are always
    evaluated: the training runner validates once more after fit when the last validation did not sample, and a
    ``validate`` / evaluation run always samples. A 6×6 Sudoku MDM at the sweep's validation every 50 steps spent
    ≈ 45 % of its wall time sampling (2 batches × 4 sampler-budgets, measured from its MLflow timestamps).

    ``row_generators``: each row draws from its own generator, seeded seed · 2³² + (its index in the validation set),
    so a row's sample does not depend on the batch size, the rows beside it or the number of ranks (the MDM samplers,
    ``row_generators = True`` on the class); off (the default), batch i of rank r draws from one generator seeded
    seed · 1 000 003 + i · 1009 + r, the stream of every committed result. With per-row generators the samplers run
    in chunks of the run's ``micro_batch_size`` rows (``sample_rows``: the same samples); with one generator per batch
    they take the device's whole validation batch at once (chunks would draw other numbers).
    """

    def __init__(
        self,
        *,
        samplers: Mapping[str, Sampler],
        nfe: Sequence[int],
        metric: Callable[..., Metric],
        max_batches: int | None = None,
        seed: int = 0,
        num_logged_samples: int = 8,
        calibration_tokens: int = 0,
        compile_tails: bool = False,
        skip_unfit_budgets: bool = False,
        every_n_steps: int | None = None,
        row_generators: bool = False,
    ) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be ≥ 1 (or null: every validation), got {every_n_steps}")
        self.every_n_steps = every_n_steps
        if not samplers:
            raise ValueError("evaluation needs at least one sampler")
        if not nfe:
            raise ValueError("evaluation needs at least one NFE budget")
        # skip_unfit_budgets: a budget a sampler refuses (CCFG's 2 NFE per step at a budget of 1) is left out for
        # that sampler, noted in `skipped`, instead of an error (one budget list over several model families).
        self.skip_unfit_budgets = skip_unfit_budgets
        self.skipped: dict[tuple[str, int], str] = {}
        for name, sampler in samplers.items():
            if not isinstance(sampler, Sampler):
                raise TypeError(f"eval sampler {name!r} is a {type(sampler).__name__}, not a Sampler")
            confidence_kind(sampler)  # a declared kind, checked before any compute
            if row_generators and not getattr(sampler, "row_generators", False):
                raise ValueError(
                    f"eval.row_generators=true: sampler {name!r} ({type(sampler).__name__}) draws from one generator "
                    "per batch; per-row generators are taken by the MDM samplers only: set eval.row_generators=false"
                )
            for budget in nfe:
                self._check_budget(name, sampler, int(budget))
        self.samplers = dict(samplers)
        self.nfe = [int(n) for n in nfe]
        self.metric_factory = metric
        self.max_batches = max_batches
        self.seed = seed
        self.row_generators = row_generators
        self._rows_seen = 0  # this rank's validation rows sampled so far in the current validation
        self.num_logged_samples = num_logged_samples
        self.compile_tails = compile_tails  # torch.compile the passes over the logits (flowlm/ops/compiled.py)
        if calibration_tokens < 0:
            raise ValueError(f"calibration_tokens must be ≥ 0, got {calibration_tokens}")
        self.calibration_tokens = calibration_tokens
        self.results: list[dict] = []  # one row per (sampler, budget) of the latest evaluation
        self.primary: str | None = None  # the task metric's headline key (first one it reports)
        self._states: dict[tuple[str, int], dict] = {}
        self._sampling = True  # whether the current validation samples (``every_n_steps``)

    def check_model(self, pl_module) -> None:
        """Refuse, before any compute, a sampler that does not fit this model family."""
        for name, sampler in self.samplers.items():
            if sampler.family != pl_module.family:
                raise ValueError(
                    f"sampler {name!r} ({type(sampler).__name__}) samples '{sampler.family}' models, "
                    f"but the model is a '{pl_module.family}' model; choose samplers for it (e.g. eval=sudoku_mdm for "
                    "'mdm', eval=sudoku_flow for 'flow')"
                )

    def setup(self, trainer, pl_module, stage: str) -> None:  # noqa: D102
        self.check_model(pl_module)
        self._datamodule = trainer.datamodule
        self.check_data(self._datamodule)

    def check_data(self, datamodule) -> None:
        """Refuse budgets a sampler cannot honour on these sequences (e.g. fewer NFE than blocks), and a task
        metric that refuses its arguments (built once, e.g. GSM8K execution where no sandbox can be set up)."""
        self.metric_factory(datamodule=Unloaded(datamodule))
        free = getattr(datamodule, "seq_len", None)
        if free is None:
            return
        free -= getattr(datamodule, "prompt_len", 0)
        for name, sampler in self.samplers.items():
            for budget in self.nfe:
                self._check_budget(name, sampler, budget, free_positions=free)

    def _check_budget(self, name: str, sampler: Sampler, budget: int, **kwargs) -> None:
        try:
            sampler.check_budget(budget, **kwargs)
        except ValueError as err:
            if not self.skip_unfit_budgets:
                raise
            self.skipped[(name, budget)] = str(err)

    def samples_now(self, trainer) -> bool:
        """Whether this validation samples: always outside fit (the final weights), during fit per ``every_n_steps``."""
        if self.every_n_steps is None or trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking:
            return True
        return trainer.global_step % self.every_n_steps == 0

    def on_validation_epoch_start(self, trainer, pl_module) -> None:  # noqa: D102
        self._sampling = self.samples_now(trainer)
        if not self._sampling:  # the validation loss only: results and states stay those of the last sampling
            return
        self._rows_seen = 0
        self._states = {
            (name, budget): {
                "metric": self.metric_factory(datamodule=self._datamodule).to(pl_module.device),
                "nfe": MeanMetric().to(pl_module.device),
                "row_nfe": CatMetric().to(pl_module.device),  # every row's NFE, gathered over ranks: the spread
                "tpf": MeanMetric(nan_strategy="ignore").to(pl_module.device),  # weighted by each row's NFE
                "forced": MeanMetric(nan_strategy="ignore").to(pl_module.device),  # weighted by its commits
                "seconds": MeanMetric().to(pl_module.device),
                "samples": [],
                "calibration": CalibrationBuffer(self.calibration_tokens),
            }
            for name in self.samplers
            for budget in self.nfe
            if (name, budget) not in self.skipped
        }

    @torch.no_grad()
    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:  # noqa: D102
        if not self._sampling or (self.max_batches is not None and batch_idx >= self.max_batches):
            return
        # A sharded (FSDP2) model is gathered once for all samplers: ranks may run different numbers of forwards.
        with full_parameters(pl_module):
            self._sample_batch(trainer, pl_module, batch, batch_idx)

    def _sample_batch(self, trainer, pl_module, batch, batch_idx: int) -> None:
        model = pl_module.denoiser()
        tokens, prompt_mask = batch["tokens"], batch["prompt_mask"]
        first, self._rows_seen = self._rows_seen, self._rows_seen + tokens.shape[0]
        micro = (getattr(pl_module, "run_config", None) or {}).get("micro_batch_size")
        for (name, budget), state in self._states.items():
            gen = self.generators(tokens, batch_idx, first, trainer)
            start = _now(tokens.device)
            with trainer.precision_plugin.forward_context(), compiled_tails(self.compile_tails):
                out = sample_rows(self.samplers[name], model, tokens, prompt_mask, budget, gen, micro)
            seconds = _now(tokens.device) - start
            state["metric"].update(out.tokens, tokens)
            state["nfe"].update(out.mean_nfe(), weight=tokens.shape[0])  # per row (adaptive samplers: each its own)
            row_nfe, tpf = row_costs(out, prompt_mask)
            state["row_nfe"].update(row_nfe)
            state["tpf"].update(tpf, weight=row_nfe)  # Σ generated / Σ NFE
            if out.forced is not None:
                generated = (~prompt_mask).sum(-1).double()
                state["forced"].update(out.forced.double() / generated.clamp_min(1), weight=generated)
            state["seconds"].update(seconds / tokens.shape[0], weight=tokens.shape[0])
            room = self.num_logged_samples - len(state["samples"])
            if room > 0:
                state["samples"].extend(out.tokens[:room].cpu())
            calibration = state["calibration"]
            if trainer.is_global_zero and not calibration.full and hasattr(state["metric"], "token_correct"):
                correct, scored = state["metric"].token_correct(out.tokens, tokens)
                calibration.add(out.confidence, correct, scored)

    def generators(
        self, tokens: torch.Tensor, batch_idx: int, first: int, trainer
    ) -> torch.Generator | list[torch.Generator]:
        """A batch's random source: one generator (seed, batch index, rank), or with ``row_generators`` one per row,
        seeded from (seed, the row's validation-set index); ``first``: the rank's rows before this batch. Validation is
        not shuffled and Lightning's sampler deals rows to ranks in turn: local row j of rank r is row j·world + r."""
        rank = trainer.global_rank
        if not self.row_generators:
            return torch.Generator(device=tokens.device).manual_seed(self.seed * 1_000_003 + batch_idx * 1009 + rank)
        world = trainer.world_size
        return [
            torch.Generator(device=tokens.device).manual_seed(self.seed * 2**32 + (first + j) * world + rank)
            for j in range(tokens.shape[0])
        ]

    def on_validation_epoch_end(self, trainer, pl_module) -> None:  # noqa: D102
        if not self._sampling or not self._states or trainer.sanity_checking:
            return
        self.results = []
        for (name, budget), state in self._states.items():
            values = {k: float(v) for k, v in state["metric"].compute().items()}
            state["spent"] = _values(state["row_nfe"])  # on every rank: the gather is collective
            self.primary = self.primary or next(iter(values))
            row = {
                "sampler": name,
                "nfe_budget": budget,
                "nfe": float(state["nfe"].compute()),
                **nfe_spread(state["spent"]),
                "tpf": float(state["tpf"].compute()),
                "forced_share": _mean_or_zero(state["forced"]),
                "sec_per_sample": float(state["seconds"].compute()),
                **values,
                "step": trainer.global_step,
            }
            self.results.append(row)
            prefix = f"eval/{name}/nfe{budget}"
            for key in [*values, *COST_KEYS]:
                pl_module.log(f"{prefix}/{key}", row[key], sync_dist=False, rank_zero_only=True)
        if trainer.is_global_zero:
            self._log_artifacts(trainer)

    def calibration_arrays(self, sampler: str, budget: int) -> tuple[np.ndarray, np.ndarray]:
        """(confidence, correct) token pairs the latest evaluation kept for ``sampler`` at ``budget`` (rank 0)."""
        state = self._states.get((sampler, budget))
        return state["calibration"].arrays() if state else CalibrationBuffer(0).arrays()

    def table(self) -> str:
        """The latest results as a Markdown table (one row per sampler × budget)."""
        return format_table(self.results)

    def _log_artifacts(self, trainer) -> None:
        loggers = [lg for lg in trainer.loggers if isinstance(lg, MLFlowLogger)]
        if not loggers:
            return
        metric = next(iter(self._states.values()))["metric"]
        lines = []
        for (name, budget), state in self._states.items():
            lines.append(f"## {name}, NFE budget {budget}\n")
            lines.extend(metric.render(tok) + "\n" for tok in state["samples"])
        step = trainer.global_step
        # per-sample records of metrics that keep them (texts, GSM8K answers): rank 0's share, one file per
        # sampler × budget
        jsonl = {
            f"eval/step{step:07d}/{name}_nfe{budget}.jsonl": rows_to_jsonl(state["metric"].artifact_rows())
            for (name, budget), state in self._states.items()
            if hasattr(state["metric"], "artifact_rows")
        }
        buffers = {key: state["calibration"] for key, state in self._states.items() if len(state["calibration"])}
        histogram = {
            f"{name}/nfe{budget}": nfe_histogram(state["spent"]) for (name, budget), state in self._states.items()
        }
        with tempfile.TemporaryDirectory() as tmp:
            npz = save_calibration(Path(tmp) / "calibration.npz", buffers, self.samplers) if buffers else None
            for lg in loggers:
                lg.experiment.log_text(lg.run_id, self.table(), f"eval/step{step:07d}/table.md")
                lg.experiment.log_text(lg.run_id, "\n".join(lines), f"eval/step{step:07d}/samples.md")
                lg.experiment.log_dict(lg.run_id, histogram, f"eval/step{step:07d}/nfe_histogram.json")
                if npz is not None:
                    lg.experiment.log_artifact(lg.run_id, str(npz), f"eval/step{step:07d}")
                for path, text in jsonl.items():
                    lg.experiment.log_text(lg.run_id, text, path)


COST_KEYS = ("nfe", "nfe_std", "nfe_min", "nfe_p50", "nfe_p90", "nfe_max", "tpf", "forced_share", "sec_per_sample")


def sample_rows(
    sampler: Sampler,
    model,
    tokens: torch.Tensor,
    prompt_mask: torch.Tensor,
    budget: int,
    generator: torch.Generator | list[torch.Generator],
    micro: int | None,
) -> SampleOutput:
    """``sampler`` on the batch; with per-row generators in chunks of at most ``micro`` rows (the run's
    ``micro_batch_size``), which sample the same tokens (a row draws from its own generator only). One generator for
    the batch is consumed across its rows: chunking would change every sample, so that batch runs whole."""
    rows = tokens.shape[0]
    if not isinstance(generator, list) or not micro or micro >= rows:
        return sampler(model, prompt=tokens, prompt_mask=prompt_mask, nfe=budget, generator=generator)
    outs = [
        sampler(model, prompt=tokens[i : i + micro], prompt_mask=prompt_mask[i : i + micro], nfe=budget,
                generator=generator[i : i + micro])
        for i in range(0, rows, micro)
    ]  # fmt: skip
    return joined(outs)


def joined(outs: Sequence[SampleOutput]) -> SampleOutput:
    """One output of row chunks sampled apart: rows stacked; where the chunks spent different NFE and report none
    per row, each row gets its chunk's (so ``mean_nfe`` is the calls spent per row)."""
    nfe = [out.nfe for out in outs]
    row_nfe = None
    if any(out.row_nfe is not None for out in outs) or len(set(nfe)) > 1:
        row_nfe = torch.cat(
            [out.row_nfe if out.row_nfe is not None else torch.full_like(out.tokens[:, 0], out.nfe) for out in outs]
        )
    forced = None if any(out.forced is None for out in outs) else torch.cat([out.forced for out in outs])
    return SampleOutput(
        tokens=torch.cat([out.tokens for out in outs]),
        confidence=torch.cat([out.confidence for out in outs]),
        nfe=max(nfe),
        row_nfe=row_nfe,
        forced=forced,
    )


def row_costs(out: SampleOutput, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row (B,): the NFE it spent (``row_nfe``, else the call's ``nfe``) and its tokens per forward,
    TPF = #{positions not in the prompt} / NFE, NaN for a row that spent none (nothing to generate)."""
    generated = (~prompt_mask).sum(-1).double()
    spent = torch.full_like(generated, float(out.nfe)) if out.row_nfe is None else out.row_nfe.double()
    return spent, torch.where(spent > 0, generated / spent.clamp_min(1), torch.nan)


def nfe_spread(row_nfe: np.ndarray) -> dict[str, float]:
    """The spread of the rows' NFE: std (ddof 0), min, median, 90th percentile (linear interpolation), max; NaN
    without rows."""
    if row_nfe.size == 0:
        return dict.fromkeys(("nfe_std", "nfe_min", "nfe_p50", "nfe_p90", "nfe_max"), math.nan)
    p50, p90 = np.percentile(row_nfe, [50, 90])
    return {
        "nfe_std": float(row_nfe.std()),
        "nfe_min": float(row_nfe.min()),
        "nfe_p50": float(p50),
        "nfe_p90": float(p90),
        "nfe_max": float(row_nfe.max()),
    }


def nfe_histogram(row_nfe: np.ndarray) -> dict[str, int]:
    """Rows per NFE value, in increasing NFE ('3': 120); integral values written without a decimal point."""
    values, counts = np.unique(row_nfe, return_counts=True)
    label = lambda v: str(int(v)) if float(v).is_integer() else f"{v:g}"
    return {label(v): int(c) for v, c in zip(values, counts, strict=True)}


def _mean_or_zero(metric: MeanMetric) -> float:
    """A MeanMetric's value (synced over ranks), 0 before any update (a sampler that reports no such count)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchmetrics warns that compute() runs before update()
        value = float(metric.compute())
    return 0.0 if math.isnan(value) else value


def _values(metric: CatMetric) -> np.ndarray:
    """A CatMetric's values (synced over ranks) as float64; empty before any update."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchmetrics warns that compute() runs before update()
        values = metric.compute()
    return values.double().cpu().numpy() if isinstance(values, torch.Tensor) else np.zeros(0)


class CalibrationBuffer:
    """The first ``cap`` scored tokens' (confidence, correct) pairs, in arrival order (row-major per batch)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._confidence: list[np.ndarray] = []
        self._correct: list[np.ndarray] = []
        self._count = 0

    def __len__(self) -> int:
        return self._count

    @property
    def full(self) -> bool:
        """True once ``cap`` tokens are held (always for cap 0: nothing is collected)."""
        return self._count >= self.cap

    def add(self, confidence: torch.Tensor, correct: torch.Tensor, scored: torch.Tensor) -> None:
        """Keep the scored positions of a (B, L) batch until the cap is reached."""
        room = self.cap - self._count
        if room <= 0:
            return
        conf = confidence[scored].float().cpu().numpy()[:room]
        self._confidence.append(conf.astype(np.float32))
        self._correct.append(correct[scored].cpu().numpy().astype(bool)[: len(conf)])
        self._count += len(conf)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(confidence float32 (N,), correct bool (N,))."""
        if not self._confidence:
            return np.zeros(0, np.float32), np.zeros(0, bool)
        return np.concatenate(self._confidence), np.concatenate(self._correct)


def confidence_kind(sampler: Sampler) -> str:
    """The sampler's declared confidence kind: 'a-posteriori' if it scores tokens of a finished draft (PR, flow-map
    endpoints), 'a-priori' if it scores a token before the rest of the sequence exists (MDM confidence, δ_{0,0});
    anything else is a clear error."""
    kind = sampler.confidence_kind
    if kind not in CONFIDENCE_KINDS:
        raise ValueError(
            f"{type(sampler).__name__} declares confidence_kind {kind!r}; a sampler declares one of {CONFIDENCE_KINDS}"
        )
    return kind


def save_calibration(
    path: Path, buffers: Mapping[tuple[str, int], CalibrationBuffer], samplers: Mapping[str, Sampler]
) -> Path:
    """Write the (confidence, correct) pairs of every sampler × budget to one compact npz.

    Token arrays ``confidence`` (float32), ``correct`` (bool), ``group`` (int32 index); per group ``samplers``,
    ``budgets`` and ``kinds`` ('a-priori' / 'a-posteriori').
    """
    conf, correct, group, names, budgets, kinds = [], [], [], [], [], []
    for i, ((name, budget), buffer) in enumerate(buffers.items()):
        c, ok = buffer.arrays()
        conf.append(c)
        correct.append(ok)
        group.append(np.full(len(c), i, np.int32))
        names.append(name)
        budgets.append(budget)
        kinds.append(confidence_kind(samplers[name]))
    np.savez_compressed(
        path,
        confidence=np.concatenate(conf),
        correct=np.concatenate(correct),
        group=np.concatenate(group),
        samplers=np.array(names),
        budgets=np.array(budgets, np.int64),
        kinds=np.array(kinds),
    )
    return path


def rows_to_jsonl(rows: Sequence[Mapping]) -> str:
    """One JSON object per line (non-ASCII kept; NaN/inf written as null so strict JSON readers accept them)."""
    clean = lambda v: None if isinstance(v, float) and not math.isfinite(v) else v
    return "".join(json.dumps({k: clean(v) for k, v in row.items()}, ensure_ascii=False) + "\n" for row in rows)


def format_table(rows: list[dict]) -> str:
    """Rows of dicts (same keys) as a Markdown table, floats to 4 significant digits."""
    if not rows:
        return "(no results)"
    keys = list(rows[0])
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
