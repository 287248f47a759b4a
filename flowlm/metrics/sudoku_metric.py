"""Sudoku scores as a torchmetrics Metric (rank-synced): conditional accuracy or unconditional validity."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics import Metric

from flowlm.metrics.sudoku import respects_clues, valid_grids
from flowlm.tasks.sudoku import SudokuLayout, SudokuSpec, render


def percent(count: Tensor | int, total: int) -> Tensor:
    """100 · count / total from the integers, as the float64 nearest the exact quotient (a CPU scalar)."""
    return torch.tensor(100 * int(count) / total, dtype=torch.float64)


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

    def compute(self) -> dict[str, Tensor]:
        """The percentages of the counts, in float64 on the CPU (``percent``): 1 939 of 2 000 is 96.95, where a
        float32 quotient writes 96.94999694824219 and a table rounding it prints 96.9."""
        total = max(int(self.total), 1)
        if self.layout.conditional:
            return {"accuracy": percent(self.correct, total), "exact_match": percent(self.exact, total)}
        grids = self.valid_grids
        if isinstance(grids, list):
            grids = torch.cat(grids) if grids else torch.zeros(0, self.layout.spec.n**2, dtype=torch.int8)
        distinct = torch.unique(grids, dim=0).shape[0] if grids.numel() else 0
        n = self.layout.spec.n
        rows = grids.cpu().numpy().reshape(-1, n, n).astype(np.int8)
        copies = sum(row.tobytes() in self.train_keys for row in rows)
        return {
            "valid_pct": percent(self.correct, total),
            "distinct_valid": torch.tensor(float(distinct), dtype=torch.float64),
            "train_copy_pct": percent(copies, total),
        }

    def token_correct(self, pred_tokens: Tensor, target_tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Per-token correctness for confidence calibration: ``(correct, scored)``, both (B, L) bool.

        Only generated grid cells are scored (not separators, BOS or the prompt). Conditional: a cell is correct
        when it equals the (unique) solution. Unconditional, where no reference grid exists: a cell is correct
        when its digit occurs exactly once in its row, its column and its box (both cells of a clash are wrong,
        since neither can be blamed alone; a non-digit is wrong).
        """
        _, grids = self.layout.decode(pred_tokens)
        if self.layout.conditional:
            cells = grids == self.layout.decode(target_tokens)[1]
        else:
            cells = clash_free_cells(grids, self.layout.spec)
        # The layout keeps the token position of every solution cell, row-major (SudokuLayout.decode uses it).
        positions = self.layout._solution_pos.to(pred_tokens.device)
        correct = torch.zeros(pred_tokens.shape, dtype=torch.bool, device=pred_tokens.device)
        scored = torch.zeros_like(correct)
        correct[:, positions] = cells.flatten(1)
        scored[:, positions] = True
        return correct, scored

    def render(self, tokens: Tensor) -> str:
        """One sample as readable text (puzzle and solution for conditional tasks)."""
        clues, grid = self.layout.decode(tokens[None])
        text = render(grid[0], self.layout.spec)
        if self.layout.conditional:
            text = render(clues[0], self.layout.spec) + "\n→\n" + text
        return text


def clash_free_cells(grids: Tensor, spec: SudokuSpec) -> Tensor:
    """(B, n, n) bool: the cell holds a digit 1..n that occurs exactly once in its row, column and box."""
    b, n = grids.shape[0], spec.n
    digits = F.one_hot(grids.long().clamp(0, n), n + 1)[..., 1:]  # (B, n, n, n); an empty cell is all zero
    rows = digits.sum(2, keepdim=True)
    cols = digits.sum(1, keepdim=True)
    shape = (b, n // spec.box_rows, spec.box_rows, n // spec.box_cols, spec.box_cols, n)
    boxes = digits.reshape(shape).sum((2, 4), keepdim=True).expand(shape).reshape(b, n, n, n)
    alone = (rows == 1) & (cols == 1) & (boxes == 1)
    return (digits.bool() & alone).any(-1)
