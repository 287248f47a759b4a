"""Sudoku generation, as in the papers: a random full grid by randomized backtracking, then cells removed in random
order while the solution stays unique, down to exactly the difficulty's clue count. Data sets use per-item seeds,
so the result depends only on `seed`, not on the number of workers.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator, Set
from multiprocessing.pool import Pool

import numpy as np

from flowlm.tasks.sudoku.solver import _Budget, _check_grid, _geometry, _search, is_valid_grid
from flowlm.tasks.sudoku.spec import DIFFICULTY_CLUES_9X9, SudokuSpec, clues_for

# Bump when generation changes in a way that alters its output for a given seed (it is part of cache keys).
GENERATOR_VERSION = 1

# Number of distinct full grids per box shape, where it is small enough to exhaust (2×2 boxes: 288).
KNOWN_GRID_COUNTS: dict[tuple[int, int], int] = {(2, 2): 288}

# Give up after this many duplicate draws in a row: the requested set very likely does not exist.
MAX_CONSECUTIVE_DUPLICATES = 10_000

# A conditional item gives up after this many fresh grids that all got stuck above the clue count (in practice
# only 16×16 'hard' does; 4×4 to 12×12 succeed on the first grid almost always).
MAX_PUZZLE_ATTEMPTS = 20


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
