"""A Sudoku's box shape and the clue counts of the difficulties (methods.md §7)."""

from __future__ import annotations

from dataclasses import dataclass

DIFFICULTY_CLUES_9X9: dict[str, int] = {"easy": 40, "medium": 35, "hard": 30}


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
