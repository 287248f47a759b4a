"""The convergence protocol (docs/results.md#the-protocol), the same for every model of a comparison.

Rule, checked at each validation: with ``history`` the (step, val loss) pairs so far and ``s`` the latest step,
the run has converged when the best val loss of the last ``window`` share of the steps (steps > (1 − window)·s)
improved on the best val loss before that window by less than ``rel_tol`` of that best, or by less than
``progress_tol`` of everything the run has improved since its first validation (first = the first val loss):

    gain     = (best_before − best_window) / |best_before|             < rel_tol        (relative), or
    progress = (best_before − best_window) / (first − best_window)     < progress_tol   (share of the descent)

with at least ``min_evals`` validations and one before the window. Otherwise training goes on to the step cap
(``trainer.max_steps``); a run that reaches the cap unconverged says so (``converged = false``).

Why two scales: a loss that plateaus at a positive value (text) stops on the relative gain; a loss that decays
towards 0 (Sudoku: the solution is determined by the clues) keeps a relative gain of 10–20 % per window long after
its accuracy has saturated (measured: 17 % at 6 000 steps with 97 % of puzzles solved, docs/results.md), so it stops
when the last fifth of its steps bought under 1 % of its whole descent. ``progress_tol=None`` keeps the relative
rule alone (the rule before 2026-12-02).

A run initialised from or distilled from another run (``init_from`` / ``teacher``) counts the source's steps in its
budget: ``budget_steps = steps + source steps`` (the source's ``convergence.json``, else its checkpoint's step).
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.trainer.states import TrainerFn

from lightning_modules.checkpoints import load_torch_file

CONVERGENCE_FILE = "convergence.json"  # in the run folder: what a run derived from this one reads


@dataclass(frozen=True)
class Verdict:
    """The rule's outcome at one validation: converged or not, the two bests it compared and their gain."""

    converged: bool
    best_before: float
    best_window: float
    gain: float  # (best_before − best_window) / |best_before|; NaN when there is nothing to compare yet
    progress: float = float("nan")  # (best_before − best_window) / (first − best_window): the window's share


def check_convergence(
    history: Sequence[tuple[int, float]],
    *,
    window: float = 0.2,
    rel_tol: float = 0.01,
    progress_tol: float | None = 0.01,
    min_evals: int = 3,
) -> Verdict:
    """Apply the rule above to (step, val loss) pairs in step order."""
    if not 0 < window < 1:
        raise ValueError(f"window must be in (0, 1), got {window}")
    if rel_tol <= 0:
        raise ValueError(f"rel_tol must be > 0, got {rel_tol}")
    if progress_tol is not None and progress_tol <= 0:
        raise ValueError(f"progress_tol must be > 0 or None, got {progress_tol}")
    nan = float("nan")
    if len(history) < max(min_evals, 2):
        return Verdict(False, nan, nan, nan)
    last = history[-1][0]
    start = (1 - window) * last  # the window: steps > (1 − window)·s
    before = [loss for step, loss in history if step <= start]
    inside = [loss for step, loss in history if step > start]
    if not before or not inside:
        return Verdict(False, nan, nan, nan)
    best_before, best_window = min(before), min(inside)
    gain = (best_before - best_window) / abs(best_before) if best_before != 0 else math.inf
    descent = history[0][1] - best_window  # everything improved since the first validation
    progress = (best_before - best_window) / descent if descent > 0 else math.inf
    converged = gain < rel_tol or (progress_tol is not None and progress < progress_tol)
    return Verdict(bool(converged), best_before, best_window, float(gain), float(progress))


def source_steps(path: str | None) -> int:
    """Training steps of the run a checkpoint ``path`` comes from (``<run>/checkpoints/<file>``): its
    ``convergence.json`` budget (a chain counts every link), else the checkpoint's ``global_step``; 0 for None and,
    with a warning, for a source that is no local file (a hub name: trained outside the suite)."""
    if not path:
        return 0
    ckpt = Path(path)
    record = ckpt.parent.parent / CONVERGENCE_FILE
    if record.is_file():
        return int(json.loads(record.read_text())["budget_steps"])
    if ckpt.is_file():
        return int(load_torch_file(ckpt).get("global_step", 0))  # weights_only, the suite's types allowed
    if ckpt.is_dir():  # a sharded or exported checkpoint, or a pretrained model's folder: the budget cannot be told
        warnings.warn(
            f"no {CONVERGENCE_FILE} beside {ckpt} (a sharded checkpoint without its run's record, or a pretrained "
            "model's folder trained outside the suite): its steps are not counted in budget_steps",
            RuntimeWarning,
            stacklevel=2,
        )
        return 0
    # Not a local file or folder: a pretrained source by hub name (docs/pretrained.md), trained outside the suite
    warnings.warn(
        f"{path} is not a local checkpoint (a hub name?): its training steps are not counted in budget_steps",
        RuntimeWarning,
        stacklevel=2,
    )
    return 0


class Convergence(Callback):
    """Records the convergence protocol at every validation and, with ``stop``, ends training once converged.

    Logged to MLflow: metrics ``convergence/steps``, ``convergence/budget_steps``, ``convergence/wall_s``,
    ``convergence/final_val_loss``, ``convergence/gain`` and the tag ``flowlm.converged`` (true / false); written to
    ``<run dir>/convergence.json`` as well (``record``). Wall time is the fit's, evaluations included, summed over
    resumed launches.
    """

    def __init__(
        self,
        *,
        monitor: str = "val/loss",
        window: float = 0.2,
        rel_tol: float = 0.01,
        progress_tol: float | None = 0.01,
        min_evals: int = 3,
        stop: bool = False,
        run_dir: str | None = None,
    ) -> None:
        # bad settings fail here, before any compute
        check_convergence([], window=window, rel_tol=rel_tol, progress_tol=progress_tol)
        self.monitor, self.window, self.rel_tol, self.min_evals = monitor, window, rel_tol, min_evals
        self.progress_tol = progress_tol
        self.stop = stop
        self.run_dir = Path(run_dir) if run_dir else None
        self.history: list[tuple[int, float]] = []
        self.wall_before = 0.0  # seconds of earlier launches (restored from the checkpoint)
        self._start: float | None = None
        self.source = 0
        self.verdict = Verdict(False, float("nan"), float("nan"), float("nan"))

    def on_fit_start(self, trainer, pl_module) -> None:  # noqa: D102
        self._start = time.monotonic()
        paths = [getattr(pl_module, "init_from", None), getattr(pl_module, "teacher_path", None)]
        self.source = max(source_steps(p) for p in paths)  # init and teacher are the same MDM in this suite

    def on_train_start(self, trainer, pl_module) -> None:  # noqa: D102
        # A relaunch of a run that had converged and stopped resumes at its last step: it stops again at once
        # instead of training on to the cap.
        if self.stop and self.verdict.converged:
            trainer.should_stop = True

    def wall_s(self) -> float:
        """Seconds of fitting so far, every launch of the run."""
        return self.wall_before + (time.monotonic() - self._start if self._start is not None else 0.0)

    def on_validation_end(self, trainer, pl_module) -> None:  # noqa: D102
        if trainer.sanity_checking or self.monitor not in trainer.callback_metrics:
            return
        step, loss = trainer.global_step, float(trainer.callback_metrics[self.monitor])
        if self.history and self.history[-1][0] == step:  # the final evaluation repeats the last step's
            self.history[-1] = (step, loss)
        else:
            self.history.append((step, loss))
        self.verdict = self._verdict()
        if self.stop and self.verdict.converged and trainer.state.fn == TrainerFn.FITTING:
            trainer.should_stop = True
        if trainer.is_global_zero:
            self._log(trainer)

    def _verdict(self) -> Verdict:
        return check_convergence(
            self.history,
            window=self.window,
            rel_tol=self.rel_tol,
            progress_tol=self.progress_tol,
            min_evals=self.min_evals,
        )

    def record(self) -> dict:
        """The run's convergence facts: steps, budget, wall time, final val loss, converged, and the rule."""
        steps = self.history[-1][0] if self.history else 0
        return {
            "converged": self.verdict.converged,
            "steps": steps,
            "source_steps": self.source,
            "budget_steps": steps + self.source,
            "wall_s": round(self.wall_s(), 1),
            "final_val_loss": self.history[-1][1] if self.history else float("nan"),
            "rule": {
                "monitor": self.monitor,
                "window": self.window,
                "rel_tol": self.rel_tol,
                "progress_tol": self.progress_tol,
                "min_evals": self.min_evals,
            },
            **{k: v for k, v in asdict(self.verdict).items() if k != "converged"},
        }

    def _log(self, trainer) -> None:
        record = self.record()
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
            (self.run_dir / CONVERGENCE_FILE).write_text(json.dumps(finite, indent=1))  # strict JSON: NaN → null
        for lg in trainer.loggers:
            if isinstance(lg, MLFlowLogger):
                step = trainer.global_step
                for key in ("steps", "budget_steps", "wall_s", "final_val_loss", "gain", "progress"):
                    if math.isfinite(record[key]):
                        lg.experiment.log_metric(lg.run_id, f"convergence/{key}", record[key], step=step)
                lg.experiment.set_tag(lg.run_id, "flowlm.converged", str(record["converged"]).lower())

    def state_dict(self) -> dict:  # noqa: D102
        return {"history": list(self.history), "wall_s": self.wall_s()}

    def load_state_dict(self, state_dict: dict) -> None:  # noqa: D102
        self.history = [(int(s), float(v)) for s, v in state_dict.get("history", [])]
        self.wall_before = float(state_dict.get("wall_s", 0.0))
        self.verdict = self._verdict()
