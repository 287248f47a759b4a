"""Sudoku grids ↔ token sequences (methods.md §7)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from flowlm.tasks.sudoku.spec import SudokuSpec


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
