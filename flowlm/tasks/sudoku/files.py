"""Sudoku as text: the one-line cell format of puzzle files, readable renders, and the puzzle-file reader."""

from __future__ import annotations

import csv
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from torch import Tensor

from flowlm.tasks.files import DataFileError, json_records, text_lines
from flowlm.tasks.sudoku.solver import is_valid_grid
from flowlm.tasks.sudoku.spec import SudokuSpec

# Cell characters in files and renders: digit d ↦ SYMBOLS[d]; 10..16 are letters A..G.
SYMBOLS = ".123456789ABCDEFG"


def grid_to_string(grid: np.ndarray | Tensor) -> str:
    """Flat one-line form, row-major: '0' for empty, 1-9 then A-G for 10-16 (the puzzle-file format)."""
    return "".join("0" if v == 0 else SYMBOLS[v] for v in np.asarray(grid).reshape(-1).tolist())


def render(grid: np.ndarray | Tensor, spec: SudokuSpec | None = None) -> str:
    """Readable multi-line grid with box separators, '.' = empty (box shape near-square if not given)."""
    grid = np.asarray(grid)
    n = grid.shape[0]
    if spec is None:
        box_rows = max(d for d in range(1, int(n**0.5) + 1) if n % d == 0)
        spec = SudokuSpec(box_rows, n // box_rows)
    lines = []
    rule = "-+-".join("-" * (2 * spec.box_cols - 1) for _ in range(n // spec.box_cols))
    for r in range(n):
        if r and r % spec.box_rows == 0:
            lines.append(rule)
        row = [SYMBOLS[v] if 0 <= v <= 16 else "?" for v in grid[r].tolist()]
        lines.append(" | ".join(" ".join(row[c : c + spec.box_cols]) for c in range(0, n, spec.box_cols)))
    return "\n".join(lines)


_CHAR_VALUES = (
    {".": 0, "0": 0}
    | {ch: d for d, ch in enumerate(SYMBOLS) if d}
    | {ch.lower(): d for d, ch in enumerate(SYMBOLS) if d >= 10}
)


def _parse_cells(text: object, spec: SudokuSpec, where: str, field: str) -> np.ndarray:
    n = spec.n
    if not isinstance(text, str):
        raise DataFileError(f"{where}: {field} must be a string of {n * n} cell characters, got {type(text).__name__}")
    text = text.strip()
    if len(text) != n * n:
        side = round(len(text) ** 0.5)
        hint = f" (that is a {side}x{side} grid)" if side * side == len(text) and side > 0 else ""
        raise DataFileError(
            f"{where}: {field} has {len(text)} cells{hint}, but box shape {spec.name} needs n² = {n * n}; "
            f"the data seems to be for a box shape other than the one configured"
        )
    values = []
    for pos, ch in enumerate(text):
        v = _CHAR_VALUES.get(ch)
        if v is None or v > n:
            raise DataFileError(
                f"{where}: {field} has invalid character {ch!r} at position {pos}; allowed for n = {n}: "
                f"'0' or '.' for empty and {SYMBOLS[1 : n + 1]!r} (letters A.. stand for 10..16)"
            )
        values.append(v)
    return np.array(values, dtype=np.int8).reshape(n, n)


def _records(path: Path) -> Iterator[tuple[int, dict]]:
    suffix = path.suffix.lower()
    if suffix == ".csv":
        with path.open("rb") as f:
            reader = csv.DictReader(line for _, line in text_lines(f, path))
            try:
                if reader.fieldnames is None:
                    return
                missing = {"puzzle", "solution"} - set(reader.fieldnames)
                if missing:
                    raise DataFileError(
                        f"{path}: line 1: CSV header lacks column(s) {sorted(missing)}; found {reader.fieldnames}"
                    )
                for row in reader:
                    yield reader.line_num, row
            except csv.Error as e:
                raise DataFileError(f"{path}: line {reader.reader.line_num}: not valid CSV ({e})") from e
    elif suffix in (".jsonl", ".json-lines"):
        with path.open("rb") as f:
            yield from json_records(f, path)
    else:
        raise DataFileError(f"{path}: unknown file type {path.suffix!r}; supported: .csv, .jsonl, .json-lines")


def read_puzzle_file(path: str | Path, spec: SudokuSpec) -> tuple[np.ndarray, np.ndarray]:
    """(puzzles, solutions), (N, n, n) int8, from a CSV (columns puzzle, solution) or JSONL file.

    Cells are row-major characters: '0' or '.' empty, '1'-'9', then 'A'-'G' (any case) for 10-16.
    Every problem raises a DataFileError (a ValueError) naming the file and line.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Sudoku puzzle file not found: {path}")
    puzzles, solutions = [], []
    for line_num, record in _records(path):
        where = f"{path}: line {line_num}"
        for key in ("puzzle", "solution"):
            if record.get(key) is None:
                raise DataFileError(f"{where}: missing {key!r} (each record needs 'puzzle' and 'solution')")
        puzzle = _parse_cells(record["puzzle"], spec, where, "puzzle")
        solution = _parse_cells(record["solution"], spec, where, "solution")
        if not is_valid_grid(solution, spec):
            raise DataFileError(
                f"{where}: solution is not a valid {spec.name} grid (some row, column or box repeats "
                f"a digit or has an empty cell)"
            )
        clash = (puzzle != 0) & (puzzle != solution)
        if clash.any():
            r, c = (int(x) for x in np.argwhere(clash)[0])
            raise DataFileError(
                f"{where}: puzzle clue {puzzle[r, c]} at row {r + 1}, column {c + 1} disagrees with "
                f"the solution's {solution[r, c]}"
            )
        puzzles.append(puzzle)
        solutions.append(solution)
    if not puzzles:
        raise DataFileError(f"{path}: file is empty (no puzzle records)")
    return np.stack(puzzles), np.stack(solutions)
