"""Progress for a log file: when stdout is not a terminal (a SLURM log, CI, ``make demo > demo.log``) Lightning's bar
writes carriage-return updates into a block-buffered stream and nothing appears for minutes. ``LineProgress`` prints
one flushed line every ``every_s`` seconds instead (step / total, the progress-bar metrics such as train/loss,
steps/s, ETA), and a line when an evaluation starts and ends; a terminal keeps Lightning's bar."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from lightning.pytorch.callbacks.progress import ProgressBar


class LineProgress(ProgressBar):
    def __init__(self, every_s: float = 30.0, stream: TextIO | None = None) -> None:
        super().__init__()
        if every_s <= 0:
            raise ValueError(f"progress every_s must be > 0 seconds, got {every_s}")
        self.every_s = every_s
        self.stream = stream
        self._enabled = True
        self._t0 = self._last = 0.0
        self._step0 = 0

    def disable(self) -> None:  # Lightning calls this on every rank but the first
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def _write(self, line: str) -> None:
        if self._enabled:
            print(line, file=self.stream or sys.stdout, flush=True)

    def _total_steps(self, trainer: Any) -> int | float:
        return trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else trainer.estimated_stepping_batches

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._t0 = self._last = time.monotonic()
        self._step0 = trainer.global_step
        self._write(f"training: step {trainer.global_step}/{self._total_steps(trainer)}")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        now, step, total = time.monotonic(), trainer.global_step, self._total_steps(trainer)
        if now - self._last < self.every_s and step < total:
            return
        self._last = now
        rate = (step - self._step0) / max(now - self._t0, 1e-9)
        metrics = {k: v for k, v in self.get_metrics(trainer, pl_module).items() if k != "v_num"}
        parts = [f"step {step}/{total}", *(f"{k} {_fmt(v)}" for k, v in metrics.items()), f"{rate:.2f} steps/s"]
        if rate > 0 and step < total:
            parts.append(f"ETA {_duration((total - step) / rate)}")
        self._write(" · ".join(parts))

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self._val_t0 = time.monotonic()
            self._write(f"evaluation at step {trainer.global_step}: {self.total_val_batches} batches")

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            took = _duration(time.monotonic() - self._val_t0)
            self._write(f"evaluation at step {trainer.global_step} done in {took}")
            self._last = time.monotonic()  # the evaluation's time is not training's: the next line comes every_s later


def progress_callbacks(enabled: bool, every_s: float = 30.0, stream: TextIO | None = None) -> list[ProgressBar]:
    """The progress display to add to a Trainer's callbacks: ``[LineProgress]`` when the progress bar is enabled
    and ``stream`` (stdout) is not a terminal; otherwise none (Lightning's own bar, or nothing when disabled)."""
    stream = stream or sys.stdout
    return [LineProgress(every_s, stream)] if enabled and not stream.isatty() else []


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"
