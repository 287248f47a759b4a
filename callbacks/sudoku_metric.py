"""Sudoku scores as a torchmetrics Metric (rank-synced): conditional accuracy or unconditional validity."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor
from torchmetrics import Metric

from flowlm.metrics.sudoku import respects_clues, valid_grids
from flowlm.tasks.sudoku import SudokuLayout, render


class SudokuMetric(Metric):
    """Conditional: accuracy = % of puzzles whose generated solution is a valid grid that keeps every clue
    (equal to whole-solution match for unique puzzles; exact match is reported too).
    Unconditional: % valid grids, the number of distinct valid grids and the % of samples copying a training grid.
    """

    full_state_update = False

    def __init__(self, *, datamodule=None, layout: SudokuLayout | None = None, train_keys=frozenset()) -> None:
        super().__init__()
        if layout is None:
            if datamodule is None:
                raise ValueError("SudokuMetric needs a layout or a Sudoku datamodule")
            layout, train_keys = datamodule.layout, datamodule.train_keys
        self.layout = layout
        self.train_keys = train_keys
        self.add_state("total", default=torch.tensor(0), dist_reduce_fx="sum")
        self.add_state("correct", default=torch.tensor(0), dist_reduce_fx="sum")
        self.add_state("exact", default=torch.tensor(0), dist_reduce_fx="sum")
        self.add_state("valid_grids", default=[], dist_reduce_fx="cat")

    def update(self, pred_tokens: Tensor, target_tokens: Tensor) -> None:  # noqa: D102
        _, grids = self.layout.decode(pred_tokens)
        clues, solutions = self.layout.decode(target_tokens)
        valid = valid_grids(grids, self.layout.spec)
        self.total += grids.shape[0]
        if self.layout.conditional:
            self.correct += (valid & respects_clues(clues, grids)).sum()
            self.exact += (grids == solutions).flatten(1).all(-1).sum()
        else:
            self.correct += valid.sum()
            self.valid_grids.append(grids[valid].flatten(1).to(torch.int8))

    def compute(self) -> dict[str, Tensor]:  # noqa: D102
        total = self.total.clamp_min(1).float()
        if self.layout.conditional:
            return {"accuracy": 100 * self.correct / total, "exact_match": 100 * self.exact / total}
        grids = self.valid_grids
        if isinstance(grids, list):
            grids = torch.cat(grids) if grids else torch.zeros(0, self.layout.spec.n**2, dtype=torch.int8)
        distinct = torch.unique(grids, dim=0).shape[0] if grids.numel() else 0
        n = self.layout.spec.n
        rows = grids.cpu().numpy().reshape(-1, n, n).astype(np.int8)
        copies = sum(row.tobytes() in self.train_keys for row in rows)
        return {
            "valid_pct": 100 * self.correct / total,
            "distinct_valid": torch.tensor(float(distinct)),
            "train_copy_pct": torch.tensor(100.0 * copies) / total.cpu(),
        }

    def render(self, tokens: Tensor) -> str:
        """One sample as readable text (puzzle and solution for conditional tasks)."""
        clues, grid = self.layout.decode(tokens[None])
        text = render(grid[0], self.layout.spec)
        if self.layout.conditional:
            text = render(clues[0], self.layout.spec) + "\n→\n" + text
        return text
