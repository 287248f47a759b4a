"""Progress lines when stdout is not a terminal: flushed, throttled, on rank 0 only; a terminal keeps the bar."""

from __future__ import annotations

import io
import re

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from callbacks.progress import LineProgress, progress_callbacks


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        loss = self.lin(batch[0]).pow(2).mean()
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.lin(batch[0]).pow(2).mean(), prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(progress: LineProgress, tmp_path, max_steps: int = 6, val_every: int = 3) -> list[str]:
    data = DataLoader(TensorDataset(torch.randn(64, 2)), batch_size=4)
    trainer = L.Trainer(
        max_steps=max_steps,
        val_check_interval=val_every,
        check_val_every_n_epoch=None,
        limit_val_batches=2,
        num_sanity_val_steps=1,
        callbacks=[progress],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(_Tiny(), train_dataloaders=data, val_dataloaders=data)
    return progress.stream.getvalue().splitlines()


def test_choice_follows_the_stream_and_the_trainer_flag():
    assert [type(c) for c in progress_callbacks(True, 5, io.StringIO())] == [LineProgress]
    assert progress_callbacks(True, 5, _Tty()) == []  # a terminal: Lightning's own bar
    assert progress_callbacks(False, 5, io.StringIO()) == []  # enable_progress_bar=false: nothing
    with pytest.raises(ValueError, match="every_s"):
        LineProgress(0)


def test_a_line_per_interval_with_step_loss_rate_and_eta(tmp_path):
    lines = _fit(LineProgress(every_s=1e-9, stream=io.StringIO()), tmp_path)
    steps = [line for line in lines if line.startswith("step ")]
    assert lines[0] == "training: step 0/6"
    assert [int(re.match(r"step (\d+)/6", line).group(1)) for line in steps] == [1, 2, 3, 4, 5, 6]
    assert all("train/loss " in line and " steps/s" in line for line in steps)
    assert all("ETA " in line for line in steps[:-1]) and "ETA" not in steps[-1]
    # two evaluations (steps 3 and 6), each announced and closed; the sanity check is not reported
    evals = [line for line in lines if line.startswith("evaluation")]
    heads = [e.split(" done")[0].split(":")[0] for e in evals]
    assert heads == ["evaluation at step 3"] * 2 + ["evaluation at step 6"] * 2
    assert evals[0].endswith(": 2 batches") and " done in " in evals[1]


def test_lines_are_throttled_but_the_last_step_is_always_reported(tmp_path):
    lines = _fit(LineProgress(every_s=3600, stream=io.StringIO()), tmp_path)
    assert [line.split(" ·")[0] for line in lines if line.startswith("step ")] == ["step 6/6"]


def test_other_ranks_print_nothing(tmp_path):
    progress = LineProgress(every_s=1e-9, stream=io.StringIO())
    progress.disable()
    assert _fit(progress, tmp_path) == []
