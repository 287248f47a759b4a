"""Bad data files get an error that names the file, the line or record and the problem, before any compute: no
tokenisation, no generation, no run folder."""

from __future__ import annotations

import csv
import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import FAST, compose_config, gsm8k_datamodule
from fixtures.make_fixtures import HERE, TOKENIZER_DIR
from omegaconf import OmegaConf

from datamodules.text import TextDataModule
from datamodules.token_cache import TokenCacheDataModule
from flowlm.tasks.files import DataFileError
from runners.common import build
from runners.train import train

STORIES = HERE / "tinystories_sample.jsonl"
GSM8K = HERE / "gsm8k_sample.jsonl"


@pytest.fixture
def no_tokenising(monkeypatch):
    """Fail the test if any datamodule starts to tokenise."""

    def refuse(*args, **kwargs):
        raise AssertionError("tokenisation started before the bad file was reported")

    monkeypatch.setattr(TokenCacheDataModule, "_map", refuse)


def _text(tmp_path: Path, files, **kwargs) -> TextDataModule:
    args = {"val_split": None, "val_last_n": 2, "seq_len": 32, "batch_size": 2, "cache_dir": tmp_path / "cache"}
    return TextDataModule(files=str(files), tokenizer=str(TOKENIZER_DIR), **args | kwargs)


def _stories(lines: int = 6) -> list[bytes]:
    return STORIES.read_bytes().splitlines(keepends=True)[:lines]


# ------------------------------------------------------------------ Sudoku puzzle files (read at construction)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"puzzle,solution\n\xff\xfe\x00garbage\n", r"bad\.csv: line 2: not UTF-8 text \(byte 0xff at column 1\)"),
        (bytes(range(128, 256)) * 3, r"bad\.csv: line 1: not UTF-8 text"),
        (b'puzzle,solution\n"' + b"1" * 140_000 + b'",x\n', r"bad\.csv: line 2: not valid CSV \(field larger"),
    ],
)
def test_a_non_utf8_garbage_or_broken_sudoku_csv_names_the_file_and_line(content, match, runs_env):
    bad = runs_env / "bad.csv"
    bad.write_bytes(content)
    cfg = compose_config(overrides=["experiment=sudoku_mdm_medium", "scale=cpu", *FAST, f"data.eval_file={bad}"])
    with pytest.raises(DataFileError, match=match) as info:  # was: TypeError: function takes exactly 5 arguments
        train(cfg)
    assert any(isinstance(e, UnicodeDecodeError | csv.Error) for e in _chain(info.value))  # the original, chained
    assert not (runs_env / "runs").exists() and not (runs_env / "data").exists()  # nothing generated or written


def _chain(err: BaseException | None):
    while err is not None:
        yield err
        err = err.__cause__


def _raise_unicode_error(**kwargs):
    b"\xff".decode("utf-8")


def test_build_surfaces_an_error_it_cannot_rebuild_from_one_message():
    node = OmegaConf.create({"_target_": f"{__name__}._raise_unicode_error"})
    with pytest.raises(UnicodeDecodeError) as info:
        build(node)
    assert any("while building" in note for note in info.value.__notes__)


# ------------------------------------------------------------------ text files


def test_an_empty_jsonl_is_refused_when_the_datamodule_is_built(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataFileError, match=r"empty\.jsonl is empty \(0 bytes\)"):  # was a bare StopIteration
        _text(tmp_path, tmp_path / "empty.jsonl")


@pytest.mark.parametrize(
    ("name", "lines", "match"),
    [
        ("latin1.jsonl", [b'{"text": "caf\xe9 au lait"}\n'], r"latin1\.jsonl: line 4: not UTF-8 text \(byte 0xe9"),
        (
            "broken.jsonl",
            [b'{"text": "unterminated\n'],
            r"broken\.jsonl: line 4: invalid JSON at column 23: Invalid control",
        ),
        ("list.jsonl", [b"[1, 2]\n"], r"list\.jsonl: line 4: expected a JSON object, got list"),
        ("field.jsonl", [b'{"story": "x"}\n'], r"field\.jsonl: line 4: field 'text' is missing, not a string"),
        ("number.jsonl", [b'{"text": 7}\n'], r"number\.jsonl: line 4: field 'text' is of type int, not a string"),
        ("blank.jsonl", None, r"blank\.jsonl: no documents"),
        ("latin1.txt", [b"caf\xe9\n"], r"latin1\.txt: line 4: not UTF-8 text"),
        ("array.json", None, r"array\.json: record 2: field 'text' is missing"),
    ],
)
def test_a_bad_text_file_names_the_file_and_line_before_tokenising(tmp_path, no_tokenising, name, lines, match):
    path = tmp_path / name
    if name == "blank.jsonl":
        path.write_bytes(b"\n  \n\n")
    elif name == "array.json":
        path.write_text(json.dumps([{"text": "a story"}, {"title": "no text"}]))
    else:
        head = [b"a story\n", b"another\n", b"\n"] if name.endswith(".txt") else _stories(3)
        path.write_bytes(b"".join([*head, *lines, *_stories(2)]))
    dm = _text(tmp_path, path)  # cheap checks pass: the file exists, is readable and not empty
    with pytest.raises(DataFileError, match=match):
        dm.prepare_data()
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").glob("text_*/meta.json"))


def test_compressed_and_parquet_files_are_checked_too(tmp_path, no_tokenising):
    gz = tmp_path / "stories.jsonl.gz"
    gz.write_bytes(gzip.compress(b"".join([*_stories(3), b'{"text": "caf\xe9"}\n'])))
    with pytest.raises(DataFileError, match=r"stories\.jsonl\.gz: line 4: not UTF-8"):
        _text(tmp_path, gz).prepare_data()
    table = tmp_path / "stories.parquet"
    pq.write_table(pa.table({"story": ["a", "b", "c"]}), table)
    with pytest.raises(DataFileError, match=r"stories\.parquet: no column\(s\) \['text'\]; it has \['story'\]"):
        _text(tmp_path, table).prepare_data()


def test_a_good_file_still_loads(tmp_path):
    path = tmp_path / "good.jsonl"
    path.write_bytes(b"".join(_stories(8)))
    dm = _text(tmp_path, path)
    dm.setup()
    assert len(dm.train_set) == 6 and len(dm.val_set) == 2


def test_a_bad_gsm8k_eval_file_is_found_before_the_training_split_is_tokenised(tmp_path, no_tokenising):
    bad = tmp_path / "eval.jsonl"
    bad.write_bytes(GSM8K.read_bytes().splitlines(keepends=True)[0] + b'{"question": 3}\n')
    dm = gsm8k_datamodule(tmp_path, eval_files=str(bad))
    with pytest.raises(DataFileError, match=r"eval\.jsonl: line 2: field 'question' is of type int, not a string"):
        dm.prepare_data()
