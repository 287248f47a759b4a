"""Damaged caches and stored data name their file and the remedy (issue 39): a cut Sudoku cache (was
``zipfile.BadZipFile``), one whose contents were altered (trained silently), a cut token array (was "mmap length is
greater than file size"), a broken ``meta.json`` (was ``JSONDecodeError``), a cut Arrow file (was ``ArrowInvalid`` or
"Expected to be able to read N bytes", neither naming the file)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from datamodules.sudoku import SudokuDataModule
from datamodules.text import TextDataModule
from flowlm.tasks.files import DamagedFileError
from flowlm.tasks.sudoku import SudokuSpec, invalid_pairs
from tests.fixtures.make_fixtures import HERE, TOKENIZER_DIR

STORIES = HERE / "tinystories_sample.jsonl"


def _cut(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


# ------------------------------------------------------------------ Sudoku cache (.npz)
def _sudoku(tmp_path: Path) -> SudokuDataModule:
    return SudokuDataModule(
        box_rows=2, box_cols=2, difficulty="easy", num_train=32, num_val=8, batch_size=8, cache_dir=tmp_path
    )


@pytest.fixture
def sudoku_cache(tmp_path) -> Path:
    dm = _sudoku(tmp_path)
    dm.prepare_data()
    return dm.cache_path


def _rewrite(path: Path, change) -> None:
    with np.load(path) as f:
        arrays = {k: f[k] for k in f.files}
    change(arrays)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def test_a_cut_sudoku_cache_names_the_file_and_says_to_delete_it(sudoku_cache, tmp_path):
    _cut(sudoku_cache)
    with pytest.raises(
        DamagedFileError, match=rf"Sudoku cache {re.escape(str(sudoku_cache))} is damaged .*BadZip.*delete"
    ):
        _sudoku(tmp_path).setup("fit")


@pytest.mark.parametrize(
    ("what", "change"),
    [
        ("digits shifted", lambda a: a.update(train_solutions=a["train_solutions"] % 4 + 1)),  # still 1..4
        ("a solution cell changed", lambda a: a["val_solutions"].__setitem__((3, 0, 0), a["val_solutions"][3, 0, 1])),
        ("a clue changed", lambda a: a["train_puzzles"].__setitem__(5, np.where(a["train_puzzles"][5] > 0, 9, 0))),
    ],
)
def test_a_sudoku_cache_whose_contents_were_altered_is_refused_on_load(what, change, sudoku_cache, tmp_path):
    # Shifting every digit of a solution by one modulo n keeps it a valid grid, but no longer the one its clues
    # give; each change trained silently before.
    _rewrite(sudoku_cache, change)
    with pytest.raises(DamagedFileError, match=r"pair\(s\) are not a valid 4x4 .*altered or damaged: delete it"):
        _sudoku(tmp_path).setup("fit")


def test_invalid_pairs_finds_each_bad_row_and_passes_the_generated_ones(sudoku_cache):
    with np.load(sudoku_cache) as f:
        puzzles, solutions = f["train_puzzles"], f["train_solutions"]
    spec = SudokuSpec(2, 2)
    assert invalid_pairs(puzzles, solutions, spec).size == 0
    broken = solutions.copy()
    broken[4, 0, 0] = broken[4, 0, 1]  # a digit twice in a row
    broken[7, 0, 0] = 0  # an empty cell in a solution
    assert invalid_pairs(puzzles, broken, spec).tolist() == [4, 7]


# ------------------------------------------------------------------ token cache (meta.json, .npy)
def _text(tmp_path: Path, **kwargs) -> TextDataModule:
    args = {"val_split": None, "val_last_n": 2, "seq_len": 32, "batch_size": 2, "cache_dir": tmp_path / "cache"}
    return TextDataModule(files=str(STORIES), tokenizer=str(TOKENIZER_DIR), **args | kwargs)


@pytest.fixture
def token_cache(tmp_path) -> Path:
    dm = _text(tmp_path)
    dm.setup("fit")
    return dm.cache_path


@pytest.mark.parametrize(
    ("damage", "file", "what"),
    [
        (lambda p: p.write_text('{"packing": '), "meta.json", "JSONDecodeError"),  # was a bare JSONDecodeError
        (lambda p: p.write_text(json.dumps({"dtype": "uint16"})), "meta.json", "no 'splits' record"),
        (_cut, "train_tokens.npy", "mmap length is greater than file size"),  # was that message, without the file
        (lambda p: p.unlink(), "val_tokens.npy", "FileNotFoundError"),
    ],
)
def test_a_damaged_token_cache_names_its_file_and_says_to_delete_the_folder(damage, file, what, token_cache, tmp_path):
    damage(token_cache / file)
    expected = rf"token cache file {re.escape(str(token_cache / file))} .*{what}.*rm -r {re.escape(str(token_cache))}"
    with pytest.raises(DamagedFileError, match=expected):
        _text(tmp_path).setup("fit")
    shutil.rmtree(token_cache)  # the remedy works: the next setup tokenises again
    _text(tmp_path).setup("fit")


# ------------------------------------------------------------------ Arrow files (datasets' copies, save_to_disk)
def test_a_cut_arrow_copy_of_local_files_names_the_file(token_cache, tmp_path):
    (arrow,) = (tmp_path / "cache" / "hf").rglob("*.arrow")
    shutil.rmtree(token_cache)  # the documents are read again: from the Arrow copy datasets keeps of the files
    _cut(arrow)
    with pytest.raises(DamagedFileError, match=rf"{re.escape(str(arrow))} is damaged or cut short .*delete "):
        _text(tmp_path).setup("fit")


def test_a_cut_save_to_disk_folder_names_the_file(tmp_path):
    import datasets

    saved = tmp_path / "saved"
    datasets.Dataset.from_json(str(STORIES), cache_dir=str(tmp_path / "hf")).save_to_disk(str(saved))
    (arrow,) = saved.glob("*.arrow")
    _cut(arrow)
    with pytest.raises(DamagedFileError, match=rf"{re.escape(str(arrow))} is damaged .*save_to_disk"):
        TextDataModule(
            name=str(saved),
            val_split=None,
            val_last_n=2,
            seq_len=32,
            batch_size=2,
            tokenizer=str(TOKENIZER_DIR),
            cache_dir=tmp_path / "cache",
        ).setup("fit")
