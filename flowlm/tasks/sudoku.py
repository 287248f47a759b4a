"""Sudoku of any box shape: solver, generator, token layout and puzzle-file reader (methods.md §7).

A grid is an ``np.ndarray`` of shape (n, n), dtype int8, 0 = empty and 1..n the digits, n = box_rows·box_cols.
The generator follows the papers: a random full grid by randomized backtracking, then cells removed in random
order while the solution stays unique, down to exactly the difficulty's clue count.
"""

from __future__ import annotations

import csv
import multiprocessing
from collections.abc import Callable, Iterator, Set
from dataclasses import dataclass
from functools import cache
from multiprocessing.pool import Pool
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from flowlm.tasks.files import DataFileError, json_records, text_lines

DIFFICULTY_CLUES_9X9: dict[str, int] = {"easy": 40, "medium": 35, "hard": 30}

# Bump when generation changes in a way that alters its output for a given seed (it is part of cache keys).
GENERATOR_VERSION = 1

# Number of distinct full grids per box shape, where it is small enough to exhaust (2×2 boxes: 288).
KNOWN_GRID_COUNTS: dict[tuple[int, int], int] = {(2, 2): 288}

# Give up after this many duplicate draws in a row: the requested set very likely does not exist.
MAX_CONSECUTIVE_DUPLICATES = 10_000

# A conditional item gives up after this many fresh grids that all got stuck above the clue count (in practice
# only 16×16 'hard' does; 4×4 to 12×12 succeed on the first grid almost always).
MAX_PUZZLE_ATTEMPTS = 20

# Cell characters in files and renders: digit d ↦ SYMBOLS[d]; 10..16 are letters A..G.
SYMBOLS = ".123456789ABCDEFG"


@dataclass(frozen=True)
class SudokuSpec:
    """Box shape of a Sudoku: boxes of box_rows × box_cols cells, grid side n = box_rows · box_cols."""

    box_rows: int
    box_cols: int

    def __post_init__(self) -> None:
        if not (isinstance(self.box_rows, int) and isinstance(self.box_cols, int)):
            raise ValueError(f"box_rows and box_cols must be ints, got {self.box_rows!r} × {self.box_cols!r}")
        if self.box_rows < 1 or self.box_cols < 1:
            raise ValueError(f"box_rows and box_cols must be >= 1, got {self.box_rows} × {self.box_cols}")
        if not 2 <= self.n <= 16:
            raise ValueError(
                f"grid side n = box_rows·box_cols must be in 2..16, got {self.box_rows}×{self.box_cols} = {self.n}"
            )

    @property
    def n(self) -> int:
        """Grid side length (= number of digits)."""
        return self.box_rows * self.box_cols

    @property
    def name(self) -> str:
        """Readable shape, e.g. '9x9 (3x3 boxes)'."""
        return f"{self.n}x{self.n} ({self.box_rows}x{self.box_cols} boxes)"


def clues_for(spec: SudokuSpec, difficulty: str) -> int:
    """Clue count of a difficulty, scaled from the 9×9 protocol by cell count: round(clues_9x9 · n² / 81)."""
    if difficulty not in DIFFICULTY_CLUES_9X9:
        raise ValueError(f"unknown difficulty {difficulty!r}; allowed: {sorted(DIFFICULTY_CLUES_9X9)}")
    return round(DIFFICULTY_CLUES_9X9[difficulty] * spec.n**2 / 81)


# ------------------------------------------------------------------------------------------------------------
# Solver: bitmask candidates, depth-first search that always branches on the most constrained cell.


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
    n = spec.n
    if grid.shape != (n, n):
        return False
    digits = np.arange(1, n + 1)
    boxes = grid.reshape(n // spec.box_rows, spec.box_rows, n // spec.box_cols, spec.box_cols)
    boxes = boxes.transpose(0, 2, 1, 3).reshape(n, n)
    return all((np.sort(g, axis=1) == digits).all() for g in (grid, grid.T, boxes))


def random_full_grid(spec: SudokuSpec, rng: np.random.Generator) -> np.ndarray:
    """A random valid full grid by randomized backtracking (random cell tie-break and digit order)."""
    n = spec.n
    geo = _geometry(spec)
    while True:
        orders = rng.permuted(np.tile(np.arange(1, n + 1), (n * n, 1)), axis=1).tolist()
        try:
            # A generous node budget and a restart guard the rare heavy-tailed runs on 12×12 and 16×16.
            _, first = _search([0] * (n * n), geo, limit=1, orders=orders, max_nodes=50 * n * n)
        except _Budget:
            continue
        assert first is not None
        return np.array(first, dtype=np.int8).reshape(n, n)


def make_puzzle(
    solution: np.ndarray,
    spec: SudokuSpec,
    n_clues: int,
    rng: np.random.Generator,
    max_nodes: int = 20_000,
) -> np.ndarray | None:
    """Remove cells in random order while the solution stays unique; None if stuck above n_clues clues.

    max_nodes bounds each uniqueness check; a check that runs out keeps its clue (only 16×16 ever gets there).
    """
    solution = _check_grid(solution, spec, "solution")
    n = spec.n
    if not 0 <= n_clues <= n * n:
        raise ValueError(f"n_clues must be in 0..{n * n}, got {n_clues}")
    if not is_valid_grid(solution, spec):
        raise ValueError("solution is not a valid full grid")
    geo = _geometry(spec)
    values = solution.reshape(-1).tolist()
    clues = n * n
    for i in rng.permutation(n * n).tolist():
        if clues == n_clues:
            break
        v = values[i]
        values[i] = 0
        # The puzzle before this removal had exactly one solution, so the reduced one is unique iff no
        # solution puts another digit in cell i: a single find-one search, usually refuted in a few nodes.
        try:
            found, _ = _search(values, geo, limit=1, forbid=(i, 1 << (v - 1)), max_nodes=max_nodes)
        except _Budget:
            found = 1  # undecided within budget: keeping the clue is always safe for uniqueness
        if found:
            values[i] = v  # a cell that cannot go now can never go later (fewer clues only add solutions)
        else:
            clues -= 1
    if clues != n_clues:
        return None
    return np.array(values, dtype=np.int8).reshape(n, n)


# ------------------------------------------------------------------------------------------------------------
# Data-set generation: per-item seeds, so the result depends only on `seed`, not on the number of workers.


def _item(args: tuple[int, int, bool, int | None, int, int]) -> tuple[np.ndarray, np.ndarray]:
    box_rows, box_cols, conditional, n_clues, seed, index = args
    spec = SudokuSpec(box_rows, box_cols)
    # Item `index` gets the index-th child of SeedSequence(seed), the stream SeedSequence.spawn would give.
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(index,)))
    for _ in range(MAX_PUZZLE_ATTEMPTS):
        solution = random_full_grid(spec, rng)
        if not conditional:
            return np.zeros_like(solution), solution
        assert n_clues is not None
        puzzle = make_puzzle(solution, spec, n_clues, rng)
        if puzzle is not None:
            return puzzle, solution
    raise ValueError(
        f"{MAX_PUZZLE_ATTEMPTS} random {spec.name} grids in a row got stuck above {n_clues} clues; "
        f"this box shape cannot reach that difficulty with this generator, choose an easier one"
    )


def _stream(
    spec: SudokuSpec,
    conditional: bool,
    n_clues: int | None,
    seed: int,
    remaining: Callable[[], int],
    pool: Pool | None,
    workers: int,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Items 0, 1, 2, ... in order, computed in chunks a bit larger than what is still missing."""
    start = 0
    while True:
        # 5 % spare covers the usual duplicates, so a second small round is rare; sizes never change results.
        chunk = max(16, int(remaining() * 1.05) + 16)
        args = [(spec.box_rows, spec.box_cols, conditional, n_clues, seed, i) for i in range(start, start + chunk)]
        start += chunk
        if pool is None:
            yield from map(_item, args)
        else:
            yield from pool.imap(_item, args, chunksize=max(1, min(64, chunk // (4 * workers))))


def generate(
    spec: SudokuSpec,
    *,
    conditional: bool,
    difficulty: str | None,
    num: int,
    seed: int,
    exclude: Set[bytes] = frozenset(),
    workers: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """`num` distinct (puzzle, solution) pairs, (num, n, n) int8 each, deterministic given seed.

    Distinct means no repeated puzzle (conditional) or no repeated grid (unconditional; puzzles are then all
    zeros); no key (`.tobytes()` of the puzzle, resp. the solution) is in `exclude`.
    """
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    n = spec.n
    if conditional:
        if difficulty is None:
            raise ValueError(f"conditional Sudoku needs a difficulty, one of {sorted(DIFFICULTY_CLUES_9X9)}")
        n_clues: int | None = clues_for(spec, difficulty)
    else:
        if difficulty is not None:
            raise ValueError("unconditional Sudoku has no difficulty; pass difficulty=None")
        n_clues = None
        cap = KNOWN_GRID_COUNTS.get((spec.box_rows, spec.box_cols))
        if cap is not None and num + len(exclude) > cap:
            raise ValueError(
                f"asked for {num} distinct {spec.name} grids disjoint from {len(exclude)} excluded ones, "
                f"but only {cap} distinct grids of this shape exist"
            )
    puzzles = np.zeros((num, n, n), dtype=np.int8)
    solutions = np.zeros((num, n, n), dtype=np.int8)
    if num == 0:
        return puzzles, solutions
    seen = set(exclude)
    got = dups = 0

    def remaining() -> int:
        return num - got

    # spawn, not fork: the caller may hold torch/CUDA threads; scripts calling this need a __main__ guard.
    pool = multiprocessing.get_context("spawn").Pool(workers) if workers > 1 else None
    try:
        for puzzle, solution in _stream(spec, conditional, n_clues, seed, remaining, pool, workers):
            key = (puzzle if conditional else solution).tobytes()
            if key in seen:
                dups += 1
                bounded = conditional or (spec.box_rows, spec.box_cols) not in KNOWN_GRID_COUNTS
                if bounded and dups >= MAX_CONSECUTIVE_DUPLICATES:
                    kind = f"{difficulty} puzzles" if conditional else "grids"
                    raise ValueError(
                        f"gave up after {dups} duplicate draws in a row with {got} of {num} distinct "
                        f"{spec.name} {kind} found ({len(exclude)} excluded): fewer distinct ones likely "
                        f"exist than requested"
                    )
                continue
            dups = 0
            seen.add(key)
            puzzles[got], solutions[got] = puzzle, solution
            got += 1
            if got == num:
                break
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    return puzzles, solutions


# ------------------------------------------------------------------------------------------------------------
# Token layout.


class SudokuLayout:
    """Grids ↔ token sequences.

    Conditional (paper, 9×9): vocab n+3 = {0 empty, 1..n digits, SEP = n+1, BOS = n+2}; sequence
    ``[BOS] puzzle rows joined by SEP [BOS] solution rows joined by SEP``, L = 2(n² + n) = 180; the prompt is
    the first n² + n + 1 = 91 positions (both BOS included).
    Unconditional: vocab n, token = digit − 1, L = n², no prompt.
    """

    def __init__(self, spec: SudokuSpec, conditional: bool) -> None:
        self.spec = spec
        self.conditional = conditional
        n = spec.n
        if conditional:
            self.vocab_size = n + 3
            self.sep_id, self.bos_id = n + 1, n + 2
            half = n * n + n
            self.seq_len = 2 * half
            self.prompt_len = half + 1
            # Within one half: position 0 is BOS, row r starts at 1 + r(n+1), separators sit between rows.
            cells = torch.tensor([1 + r * (n + 1) + c for r in range(n) for c in range(n)])
            self._puzzle_pos, self._solution_pos = cells, cells + half
            template = torch.full((self.seq_len,), self.sep_id, dtype=torch.long)
            template[[0, half]] = self.bos_id
        else:
            self.vocab_size = n
            self.sep_id = self.bos_id = None
            self.seq_len = n * n
            self.prompt_len = 0
            self._puzzle_pos = None
            self._solution_pos = torch.arange(n * n)
            template = torch.zeros(self.seq_len, dtype=torch.long)
        self._template = template

    def encode(self, puzzles: np.ndarray | Tensor, solutions: np.ndarray | Tensor) -> tuple[Tensor, Tensor]:
        """Token ids (N, L) long and prompt mask (N, L) bool from (N, n, n) puzzles and solutions."""
        n = self.spec.n
        puzzles, solutions = torch.as_tensor(puzzles).long(), torch.as_tensor(solutions).long()
        if solutions.ndim != 3 or solutions.shape[1:] != (n, n) or puzzles.shape != solutions.shape:
            raise ValueError(
                f"expected puzzles and solutions of shape (N, {n}, {n}), got "
                f"{tuple(puzzles.shape)} and {tuple(solutions.shape)}"
            )
        if solutions.numel() and (solutions.min() < 1 or solutions.max() > n):
            raise ValueError(f"solution cells must be digits 1..{n}")
        if puzzles.numel() and (puzzles.min() < 0 or puzzles.max() > n):
            raise ValueError(f"puzzle cells must be in 0..{n} (0 = empty)")
        num = solutions.shape[0]
        tokens = self._template.expand(num, -1).clone()
        if self.conditional:
            tokens[:, self._puzzle_pos] = puzzles.reshape(num, n * n)
            tokens[:, self._solution_pos] = solutions.reshape(num, n * n)
        else:
            tokens[:, self._solution_pos] = solutions.reshape(num, n * n) - 1
        prompt_mask = torch.zeros(num, self.seq_len, dtype=torch.bool)
        prompt_mask[:, : self.prompt_len] = True
        return tokens, prompt_mask

    def decode(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """(puzzles, solutions) as (B, n, n) long tensors; a cell holding any non-digit token decodes to 0."""
        n = self.spec.n
        if tokens.ndim != 2 or tokens.shape[1] != self.seq_len:
            raise ValueError(f"expected tokens of shape (B, {self.seq_len}), got {tuple(tokens.shape)}")
        tokens = tokens.long()
        batch = tokens.shape[0]

        def cells(pos: Tensor, offset: int) -> Tensor:
            digits = tokens[:, pos.to(tokens.device)] + offset
            # Samplers may leave mask ids or separators in cell positions; those are "no digit", not errors.
            return torch.where((digits >= 1) & (digits <= n), digits, 0).reshape(batch, n, n)

        if self.conditional:
            return cells(self._puzzle_pos, 0), cells(self._solution_pos, 0)
        solutions = cells(self._solution_pos, 1)
        return torch.zeros_like(solutions), solutions


# ------------------------------------------------------------------------------------------------------------
# Text: rendering and puzzle files.


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
