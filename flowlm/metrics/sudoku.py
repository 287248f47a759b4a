"""Sudoku metrics on batches of grids (methods.md §7): validity, clue agreement, keys for distinct/copies.

Grids are (B, n, n) integer tensors, 0 = empty, 1..n digits; everything is vectorised over the batch.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from flowlm.tasks.sudoku import SudokuSpec

# Two primes just under 2³¹: each weighted sum stays far below 2⁶³; the pair packs into one int64 (62 bits).
_HASH_PRIMES = (2_147_483_647, 2_147_483_629)
_HASH_BASES = (1_000_003, 999_983)


def _units(grids: Tensor, spec: SudokuSpec) -> Tensor:
    """(B, 3n, n): every row, column and box of each grid as one line of n cells."""
    b, n = grids.shape[0], spec.n
    boxes = grids.reshape(b, n // spec.box_rows, spec.box_rows, n // spec.box_cols, spec.box_cols)
    boxes = boxes.permute(0, 1, 3, 2, 4).reshape(b, n, n)
    return torch.cat([grids, grids.transpose(1, 2), boxes], dim=1)


def valid_grids(grids: Tensor, spec: SudokuSpec) -> Tensor:
    """(B,) bool: every row, column and box is a permutation of 1..n (zeros or out-of-range digits fail)."""
    n = spec.n
    if grids.ndim != 3 or grids.shape[1:] != (n, n):
        raise ValueError(f"expected grids of shape (B, {n}, {n}), got {tuple(grids.shape)}")
    digits = torch.arange(1, n + 1, device=grids.device)
    # n cells holding each of the n digits once is a permutation; a 0 or n+1 leaves some digit missing.
    counts = (_units(grids.long(), spec).unsqueeze(-1) == digits).sum(dim=2)  # (B, 3n, n digits)
    return (counts == 1).flatten(1).all(dim=1)


def respects_clues(puzzles: Tensor, grids: Tensor) -> Tensor:
    """(B,) bool: every non-zero puzzle cell holds the same digit in the grid."""
    if puzzles.shape != grids.shape:
        raise ValueError(f"puzzles {tuple(puzzles.shape)} and grids {tuple(grids.shape)} differ in shape")
    return ((puzzles == 0) | (puzzles == grids)).flatten(1).all(dim=1)


def grid_keys(grids: Tensor | np.ndarray) -> list[bytes]:
    """Exact per-grid keys, ``int8 grid.tobytes()``: the same keys generation and the datamodule use."""
    array = grids.detach().cpu().numpy() if isinstance(grids, Tensor) else np.asarray(grids)
    array = array.astype(np.int8, copy=False)
    return [g.tobytes() for g in array]


def grid_hashes(grids: Tensor) -> Tensor:
    """(B,) int64 hash of each grid, on the grids' device, for rank-synced distinct/copy counts.

    Two polynomial hashes modulo primes p₁, p₂ ≈ 2³¹ packed into 62 bits. Two different grids collide only if
    both differences vanish mod p; treating that as chance, P ≈ 1/(p₁p₂) ≈ 2⁻⁶² per pair, so among 10⁵ grids
    (5·10⁹ pairs) the expected number of collisions is about 10⁻⁹.
    """
    flat = grids.long().flatten(1)
    length = flat.shape[1]
    out = torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device)
    for prime, base in zip(_HASH_PRIMES, _HASH_BASES, strict=True):
        # base^i mod p stays < 2³¹, a cell ≤ 16 < 2⁵, and ≤ 256 terms sum < 2⁴⁴: no int64 overflow anywhere.
        weights = [1]
        for _ in range(length - 1):
            weights.append(weights[-1] * base % prime)
        w = torch.tensor(weights, dtype=torch.long, device=flat.device)
        out = out * (1 << 31) + (flat * w).sum(dim=1) % prime
    return out
