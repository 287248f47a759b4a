"""Generated Sudoku (methods.md §7) as token batches ``{"tokens", "prompt_mask"}``, cached as one .npz."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from datamodules.base import GlobalBatchDataModule, check_ints, check_optional_ints
from flowlm.metrics.sudoku import grid_hashes
from flowlm.tasks.files import DamagedFileError
from flowlm.tasks.sudoku import (
    DIFFICULTY_CLUES_9X9,
    GENERATOR_VERSION,
    KNOWN_GRID_COUNTS,
    SudokuLayout,
    SudokuSpec,
    clues_for,
    generate,
    grid_to_string,
    invalid_pairs,
    read_puzzle_file,
)

log = logging.getLogger(__name__)

_ARRAYS = ("train_puzzles", "train_solutions", "val_puzzles", "val_solutions")


class TokenDataset(Dataset):
    """Rows of pre-encoded token and prompt-mask tensors, served as dicts (default collate stacks them)."""

    def __init__(self, tokens: Tensor, prompt_mask: Tensor) -> None:
        self.tokens, self.prompt_mask = tokens, prompt_mask

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"tokens": self.tokens[index], "prompt_mask": self.prompt_mask[index]}


class SudokuDataModule(GlobalBatchDataModule):
    """Seeded, deduplicated Sudoku train/val sets (val disjoint from train); batch sizes are global."""

    def __init__(
        self,
        *,
        box_rows: int = 3,
        box_cols: int = 3,
        conditional: bool = True,
        difficulty: str | None = "medium",
        num_train: int = 48_000,
        num_val: int = 2_000,
        seed: int = 0,
        cache_dir: str | os.PathLike = "data_cache",
        batch_size: int = 256,
        val_batch_size: int | None = None,
        eval_file: str | os.PathLike | None = None,
        num_workers: int = 0,
        gen_workers: int = 1,
        pin_memory: bool = True,
    ) -> None:
        super().__init__()
        # Not sent to the logger: the runner logs the data config (params data/*), and Lightning's merge with the
        # model's hparams would refuse any run whose training seed differs from the data seed.
        self.save_hyperparameters(logger=False)
        self._spec = SudokuSpec(box_rows, box_cols)
        if conditional:
            if difficulty not in DIFFICULTY_CLUES_9X9:
                allowed = sorted(DIFFICULTY_CLUES_9X9)
                raise ValueError(f"conditional Sudoku needs difficulty in {allowed}, got {difficulty!r}")
        else:
            if eval_file is not None:
                raise ValueError("eval_file holds puzzles, so it only applies to conditional Sudoku")
            if difficulty not in (None, "medium"):
                # "medium" is the signature default; only another explicit value reveals a mistaken intent.
                warnings.warn(f"difficulty={difficulty!r} is ignored for unconditional Sudoku", stacklevel=2)
            difficulty = None
        check_ints(
            ("num_train", num_train, 0 if eval_file is not None else 1),  # evaluating a file needs no training set
            ("num_val", num_val, 0),
            ("seed", seed, 0),
            ("batch_size", batch_size, 1),
            ("num_workers", num_workers, 0),
            ("gen_workers", gen_workers, 1),
        )
        check_optional_ints(("val_batch_size", val_batch_size))
        cap = KNOWN_GRID_COUNTS.get((box_rows, box_cols))
        if not conditional and cap is not None and num_train + num_val > cap:
            raise ValueError(
                f"num_train + num_val = {num_train + num_val} distinct {self._spec.name} grids requested, "
                f"but only {cap} exist"
            )
        self.conditional = conditional
        self.difficulty = difficulty
        self.num_train, self.num_val, self.seed = num_train, num_val, seed
        self.cache_dir = Path(cache_dir)
        self.batch_size, self.val_batch_size = batch_size, val_batch_size
        self.num_workers, self.gen_workers, self.pin_memory = num_workers, gen_workers, pin_memory
        self._layout = SudokuLayout(self._spec, conditional)
        # Read now so that a bad file fails before any generation or training compute.
        self.eval_file = None if eval_file is None else Path(eval_file)
        self._eval = None if self.eval_file is None else read_puzzle_file(self.eval_file, self._spec)
        self._data: dict[str, np.ndarray] | None = None
        self.train_set: TokenDataset | None = None
        self.val_set: TokenDataset | None = None

    # --------------------------------------------------------------------------------------------------------
    # Identity of the generated data.

    def _generation_args(self) -> dict[str, Any]:
        # Everything that changes the generated arrays, nothing else (gen_workers does not: per-item seeds).
        return {
            "version": GENERATOR_VERSION,
            "box_rows": self._spec.box_rows,
            "box_cols": self._spec.box_cols,
            "conditional": self.conditional,
            "difficulty": self.difficulty,
            "num_train": self.num_train,
            "num_val": self.num_val,
            "seed": self.seed,
        }

    @property
    def cache_path(self) -> Path:
        """The .npz holding this configuration's generated train and val arrays."""
        args = self._generation_args()
        digest = hashlib.sha256(json.dumps(args, sort_keys=True).encode()).hexdigest()[:10]
        n = self._spec.n
        kind = self.difficulty if self.conditional else "uncond"
        name = f"sudoku{n}x{n}_b{self._spec.box_rows}x{self._spec.box_cols}_{kind}"
        return self.cache_dir / f"{name}_{self.num_train}+{self.num_val}_seed{self.seed}_{digest}.npz"

    # --------------------------------------------------------------------------------------------------------
    # Lightning hooks.

    def prepare_data(self) -> None:
        """Generate train, then val disjoint from it, and cache both; a cached file skips all generation."""
        path = self.cache_path
        if path.is_file():
            log.info("Sudoku data cache hit: %s", path)
            return
        start = time.perf_counter()
        common = {"conditional": self.conditional, "difficulty": self.difficulty, "workers": self.gen_workers}
        train_p, train_s = generate(self._spec, num=self.num_train, seed=self.seed, **common)
        train_keys = {(p if self.conditional else s).tobytes() for p, s in zip(train_p, train_s, strict=True)}
        # A separate seed stream for val; `exclude` makes it disjoint from train whatever the streams produce.
        val_seed = int(np.random.SeedSequence([self.seed, 1]).generate_state(1)[0])
        val_p, val_s = generate(self._spec, num=self.num_val, seed=val_seed, exclude=train_keys, **common)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        try:
            with open(tmp, "wb") as f:  # a file object stops np.savez from appending another ".npz"
                np.savez(f, train_puzzles=train_p, train_solutions=train_s, val_puzzles=val_p, val_solutions=val_s)
            os.replace(tmp, path)  # atomic: a concurrent or interrupted writer never leaves a half file
        finally:
            tmp.unlink(missing_ok=True)
        log.info(
            "Generated %d+%d %s Sudoku in %.1f s → %s",
            self.num_train,
            self.num_val,
            self._spec.name,
            time.perf_counter() - start,
            path,
        )

    def setup(self, stage: str | None = None) -> None:
        """Load the cached arrays (generating them if prepare_data was skipped) and encode them to tokens."""
        if self._data is not None:
            return
        path = self.cache_path
        if not path.is_file():
            self.prepare_data()
        data = self._read_cache(path)
        if self._eval is not None:
            data["val_puzzles"], data["val_solutions"] = self._eval
            train = {p.tobytes() for p in data["train_puzzles"]}
            overlap = sum(p.tobytes() in train for p in data["val_puzzles"])
            if overlap:
                warnings.warn(
                    f"{overlap} of {len(data['val_puzzles'])} puzzles in {self.eval_file} are also training puzzles",
                    stacklevel=2,
                )
        self._data = data
        self.train_set = TokenDataset(*self._layout.encode(data["train_puzzles"], data["train_solutions"]))
        self.val_set = TokenDataset(*self._layout.encode(data["val_puzzles"], data["val_solutions"]))
        self._train_keys = {s.tobytes() for s in data["train_solutions"]}
        self.check_train_size(stage)

    def _read_cache(self, path: Path) -> dict[str, np.ndarray]:
        """The cached arrays, checked: a file cut short or overwritten, arrays of other shapes, or contents that are
        not valid (puzzle, solution) pairs raise a DataFileError naming the file; deleting it regenerates it."""
        remedy = f"delete it (rm {path}): the next run regenerates it"
        try:
            with np.load(path, allow_pickle=False) as f:
                data = {k: f[k] for k in _ARRAYS}
        except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as e:
            raise DamagedFileError(f"Sudoku cache {path} is damaged ({type(e).__name__}: {e}); {remedy}") from e
        expected = {"train": self.num_train, "val": self.num_val}
        n = self._spec.n
        for key, array in data.items():
            if array.shape != (expected[key.split("_")[0]], n, n) or array.dtype.kind not in "iu":
                raise DamagedFileError(
                    f"Sudoku cache {path}: {key} is {array.dtype} of shape {array.shape}, not integers of shape "
                    f"{(expected[key.split('_')[0]], n, n)}; {remedy}"
                )
        for split in expected:
            bad = invalid_pairs(data[f"{split}_puzzles"], data[f"{split}_solutions"], self._spec)
            if bad.size:
                row = int(bad[0])
                raise DamagedFileError(
                    f"Sudoku cache {path}: {bad.size} {split} pair(s) are not a valid {self._spec.name} solution "
                    f"with a puzzle it solves, the first row {row} (solution "
                    f"{grid_to_string(data[f'{split}_solutions'][row])}); the file was altered or damaged: {remedy}"
                )
        return data

    # --------------------------------------------------------------------------------------------------------
    # What models, samplers and metrics need to know.

    @property
    def spec(self) -> SudokuSpec:
        """Box shape."""
        return self._spec

    @property
    def layout(self) -> SudokuLayout:
        """Token layout (encode/decode between grids and sequences)."""
        return self._layout

    @property
    def vocab_size(self) -> int:
        """Vocabulary of the layout (models add their own [MASK] on top)."""
        return self._layout.vocab_size

    @property
    def seq_len(self) -> int:
        """Tokens per sequence."""
        return self._layout.seq_len

    @property
    def prompt_len(self) -> int:
        """Leading prompt positions per sequence (0 when unconditional)."""
        return self._layout.prompt_len

    def _loaded(self) -> dict[str, np.ndarray]:
        if self._data is None:
            raise RuntimeError("call prepare_data() and setup() first")
        return self._data

    @property
    def train_keys(self) -> set[bytes]:
        """Keys (int8 ``tobytes()``, as `flowlm.metrics.sudoku.grid_keys`) of the training solution grids."""
        self._loaded()
        return self._train_keys

    @property
    def train_hashes(self) -> Tensor:
        """Sorted int64 hashes (`grid_hashes`) of the training solution grids, for `torch.isin`."""
        return grid_hashes(torch.from_numpy(self._loaded()["train_solutions"])).sort().values

    def describe(self) -> dict[str, Any]:
        """Flat parameters for logging."""
        return {
            "task": "sudoku",
            "box_rows": self._spec.box_rows,
            "box_cols": self._spec.box_cols,
            "n": self._spec.n,
            "conditional": self.conditional,
            "difficulty": self.difficulty,
            "clues": clues_for(self._spec, self.difficulty) if self.conditional else None,
            "num_train": self.num_train,
            "num_val": self.num_val if self._eval is None else len(self._eval[0]),
            "seed": self.seed,
            "batch_size": self.batch_size,
            "val_batch_size": self.val_batch_size,
            "eval_file": None if self.eval_file is None else str(self.eval_file),
            "vocab_size": self.vocab_size,
            "seq_len": self.seq_len,
            "prompt_len": self.prompt_len,
            "cache_file": str(self.cache_path),
        }
