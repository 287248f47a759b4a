"""Sudoku solver: bitmask candidates, depth-first search that always branches on the most constrained cell.

A grid is an ``np.ndarray`` of shape (n, n), dtype int8, 0 = empty and 1..n the digits, n = box_rows·box_cols.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np

from flowlm.tasks.sudoku.spec import SudokuSpec


@dataclass(frozen=True)
class _Geometry:
    n: int
    full: int
    row: tuple[int, ...]
    col: tuple[int, ...]
    box: tuple[int, ...]


@cache
def _geometry(spec: SudokuSpec) -> _Geometry:
    n = spec.n
    cells = range(n * n)
    return _Geometry(
        n=n,
        full=(1 << n) - 1,
        row=tuple(i // n for i in cells),
        col=tuple(i % n for i in cells),
        box=tuple((i // n // spec.box_rows) * spec.box_rows + (i % n) // spec.box_cols for i in cells),
    )


class _Budget(Exception):
    """Raised inside the search when the node budget is spent."""


def _search(
    values: list[int],
    geo: _Geometry,
    *,
    limit: int,
    orders: list[list[int]] | None = None,
    forbid: tuple[int, int] | None = None,
    max_nodes: int | None = None,
) -> tuple[int, list[int] | None]:
    """Count solutions of a flat puzzle up to `limit`; also return the first found.

    orders: per-cell digit order (randomized search); forbid: (cell, bitmask) of digits barred from that cell.
    """
    R, C, B, full = geo.row, geo.col, geo.box, geo.full
    rows, cols, boxes = [0] * geo.n, [0] * geo.n, [0] * geo.n
    empties: list[int] = []
    for i, v in enumerate(values):
        if v:
            bit = 1 << (v - 1)
            r, c, b = R[i], C[i], B[i]
            if (rows[r] | cols[c] | boxes[b]) & bit:
                return 0, None  # the clues already clash
            rows[r] |= bit
            cols[c] |= bit
            boxes[b] |= bit
        else:
            empties.append(i)
    allowed = [full] * len(values)
    if forbid is not None:
        allowed[forbid[0]] &= ~forbid[1]
    values = list(values)
    ne = len(empties)
    count = 0
    first: list[int] | None = None
    nodes = 0

    def dfs(k: int) -> bool:
        nonlocal count, first, nodes
        if k == ne:
            count += 1
            if first is None:
                first = values.copy()
            return count >= limit
        nodes += 1
        if max_nodes is not None and nodes > max_nodes:
            raise _Budget
        best_j, best_m, best_cnt = -1, 0, 99
        for j in range(k, ne):
            i = empties[j]
            m = allowed[i] & ~(rows[R[i]] | cols[C[i]] | boxes[B[i]])
            cnt = m.bit_count()
            if cnt < best_cnt:
                if cnt == 0:
                    return False
                best_j, best_m, best_cnt = j, m, cnt
                if cnt == 1:
                    break
        # Swapping the chosen cell to position k keeps empties[k+1:] the still-open cells for the recursion.
        empties[k], empties[best_j] = empties[best_j], empties[k]
        i = empties[k]
        r, c, b = R[i], C[i], B[i]
        if orders is None:
            bits = []
            m = best_m
            while m:
                bit = m & -m
                m ^= bit
                bits.append(bit)
        else:
            bits = [1 << (d - 1) for d in orders[i] if best_m >> (d - 1) & 1]
        for bit in bits:
            rows[r] |= bit
            cols[c] |= bit
            boxes[b] |= bit
            values[i] = bit.bit_length()
            if dfs(k + 1):
                return True
            rows[r] ^= bit
            cols[c] ^= bit
            boxes[b] ^= bit
        values[i] = 0
        return False

    dfs(0)
    return count, first


def _check_grid(grid: np.ndarray, spec: SudokuSpec, what: str = "grid") -> np.ndarray:
    grid = np.asarray(grid)
    n = spec.n
    if grid.shape != (n, n):
        raise ValueError(f"{what} must have shape ({n}, {n}) for box shape {spec.name}, got {grid.shape}")
    if grid.size and (grid.min() < 0 or grid.max() > n):
        raise ValueError(f"{what} values must be in 0..{n} (0 = empty), got {grid.min()}..{grid.max()}")
    return grid


def solve(grid: np.ndarray, spec: SudokuSpec, rng: np.random.Generator | None = None) -> np.ndarray | None:
    """One solution of a puzzle (random among several if rng is given), or None if it has none."""
    grid = _check_grid(grid, spec, "puzzle")
    n = spec.n
    orders = None
    if rng is not None:
        orders = rng.permuted(np.tile(np.arange(1, n + 1), (n * n, 1)), axis=1).tolist()
    _, first = _search(grid.reshape(-1).tolist(), _geometry(spec), limit=1, orders=orders)
    return None if first is None else np.array(first, dtype=np.int8).reshape(n, n)


def count_solutions(grid: np.ndarray, spec: SudokuSpec, limit: int = 2) -> int:
    """Number of solutions of a puzzle, counting stops at `limit` (limit=2 answers 'is it unique?')."""
    grid = _check_grid(grid, spec, "puzzle")
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    count, _ = _search(grid.reshape(-1).tolist(), _geometry(spec), limit=limit)
    return count


def is_valid_grid(grid: np.ndarray, spec: SudokuSpec) -> bool:
    """True if every row, column and box of a full grid is a permutation of 1..n."""
    grid = np.asarray(grid)
    return grid.shape == (spec.n, spec.n) and bool(valid_grid_rows(grid[None], spec)[0])


def valid_grid_rows(grids: np.ndarray, spec: SudokuSpec) -> np.ndarray:
    """(N,) bool over (N, n, n) grids: every row, column and box sorted is 1..n (a 0 or an out-of-range digit fails)."""
    n, rows = spec.n, grids.shape[0]
    boxes = grids.reshape(rows, n // spec.box_rows, spec.box_rows, n // spec.box_cols, spec.box_cols)
    boxes = boxes.transpose(0, 1, 3, 2, 4).reshape(rows, n, n)
    units = np.concatenate([grids, grids.transpose(0, 2, 1), boxes], axis=1)  # (N, 3n, n)
    return (np.sort(units, axis=-1) == np.arange(1, n + 1)).all(axis=(1, 2))


def invalid_pairs(puzzles: np.ndarray, solutions: np.ndarray, spec: SudokuSpec) -> np.ndarray:
    """Indices of the (puzzle, solution) rows, (N, n, n) each, whose solution is not a valid grid or whose puzzle
    has a clue (a non-zero cell) the solution contradicts."""
    clues_kept = ((puzzles == 0) | (puzzles == solutions)).all(axis=(1, 2))
    return np.flatnonzero(~(valid_grid_rows(solutions, spec) & clues_kept))
