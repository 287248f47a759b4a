"""Sudoku of any box shape (methods.md §7): one module per job, the public names re-exported here.

- ``spec``: the box shape (``SudokuSpec``) and the difficulties' clue counts (``clues_for``);
- ``solver``: ``solve``, ``count_solutions`` (bitmask depth-first search), ``is_valid_grid`` and its batched
  checks ``valid_grid_rows``, ``invalid_pairs``;
- ``generator``: ``random_full_grid``, ``make_puzzle`` and the data sets (``generate``, deterministic per seed);
- ``layout``: grids ↔ token sequences (``SudokuLayout``);
- ``files``: the puzzle-file format (``grid_to_string``, ``read_puzzle_file``) and readable renders (``render``).

A grid is an ``np.ndarray`` of shape (n, n), dtype int8, 0 = empty and 1..n the digits, n = box_rows·box_cols.
The generator follows the papers: a random full grid by randomized backtracking, then cells removed in random
order while the solution stays unique, down to exactly the difficulty's clue count.
"""

from flowlm.tasks.sudoku.files import SYMBOLS, grid_to_string, read_puzzle_file, render
from flowlm.tasks.sudoku.generator import (
    GENERATOR_VERSION,
    KNOWN_GRID_COUNTS,
    MAX_CONSECUTIVE_DUPLICATES,
    MAX_PUZZLE_ATTEMPTS,
    generate,
    make_puzzle,
    random_full_grid,
)
from flowlm.tasks.sudoku.layout import SudokuLayout
from flowlm.tasks.sudoku.solver import count_solutions, invalid_pairs, is_valid_grid, solve, valid_grid_rows
from flowlm.tasks.sudoku.spec import DIFFICULTY_CLUES_9X9, SudokuSpec, clues_for

__all__ = [
    "DIFFICULTY_CLUES_9X9",
    "GENERATOR_VERSION",
    "KNOWN_GRID_COUNTS",
    "MAX_CONSECUTIVE_DUPLICATES",
    "MAX_PUZZLE_ATTEMPTS",
    "SYMBOLS",
    "SudokuLayout",
    "SudokuSpec",
    "clues_for",
    "count_solutions",
    "generate",
    "grid_to_string",
    "invalid_pairs",
    "is_valid_grid",
    "make_puzzle",
    "random_full_grid",
    "read_puzzle_file",
    "render",
    "solve",
    "valid_grid_rows",
]
