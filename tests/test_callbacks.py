"""EMA averaging and the Sudoku metric on hand-made inputs."""

import numpy as np
import pytest
import torch

from callbacks.ema import EMA
from callbacks.sudoku_metric import SudokuMetric
from flowlm.tasks.sudoku import SudokuLayout, SudokuSpec

GRID = np.array([[1, 2, 3, 4], [3, 4, 1, 2], [2, 1, 4, 3], [4, 3, 2, 1]], dtype=np.int8)
OTHER = np.array([[1, 2, 3, 4], [3, 4, 1, 2], [2, 3, 4, 1], [4, 1, 2, 3]], dtype=np.int8)


def test_ema_update_with_and_without_warmup():
    avg, cur = [torch.zeros(3)], [torch.ones(3)]
    EMA(decay=0.9, warmup=False)._update(avg, cur, torch.tensor(5))
    torch.testing.assert_close(avg[0], torch.full((3,), 0.1))
    avg = [torch.zeros(3)]
    EMA(decay=0.999, warmup=True)._update(avg, cur, torch.tensor(1))  # decay_1 = 2/11
    torch.testing.assert_close(avg[0], torch.full((3,), 1 - 2 / 11))
    with pytest.raises(ValueError, match="decay"):
        EMA(decay=1.0)


def test_unconditional_validity_distinct_and_copies():
    layout = SudokuLayout(SudokuSpec(2, 2), conditional=False)
    bad = GRID.copy()
    bad[0, 0], bad[0, 1] = bad[0, 1], bad[0, 0]  # swaps break the columns
    tokens, _ = layout.encode(np.stack([GRID, GRID, OTHER, bad]), np.stack([GRID, GRID, OTHER, bad]))
    metric = SudokuMetric(layout=layout, train_keys={GRID.tobytes()})
    metric.update(tokens, tokens)
    out = metric.compute()
    assert out["valid_pct"].item() == 75.0
    assert out["distinct_valid"].item() == 2
    assert out["train_copy_pct"].item() == 50.0


def test_conditional_accuracy_needs_valid_grid_and_clues():
    layout = SudokuLayout(SudokuSpec(2, 2), conditional=True)
    puzzle = GRID * (np.arange(16).reshape(4, 4) % 3 == 0)
    target, _ = layout.encode(np.stack([puzzle] * 3), np.stack([GRID] * 3))
    pred = target.clone()
    # second sample: a valid grid that breaks a clue; third: leaves a [MASK]-like id in a cell
    other, _ = layout.encode(puzzle[None], OTHER[None])
    pred[1] = other[0]
    pred[2, layout.prompt_len] = 99
    metric = SudokuMetric(layout=layout)
    metric.update(pred, target)
    out = metric.compute()
    clue_broken = ((puzzle != 0) & (puzzle != OTHER)).any()
    assert clue_broken
    assert out["accuracy"].item() == pytest.approx(100 / 3)
    assert out["exact_match"].item() == pytest.approx(100 / 3)
    assert "→" in metric.render(target[0])  # puzzle → solution
