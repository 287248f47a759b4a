"""Line-based data files (CSV, JSON Lines, plain text) read with errors that name the file, the line and the problem."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from flowlm.project import PROJECT_DIR  # shipped fixtures named in configs resolve under it


def project_path(path: str | os.PathLike) -> Path:
    """An absolute path: as given if absolute or present relative to the working directory, else under the project
    root (so the shipped fixture configs work from any working directory)."""
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists() or glob.glob(str(p)):
        return p.resolve()
    return PROJECT_DIR / p


class DataFileError(ValueError):
    """A data file does not hold what it should; the message names the file, the line or record, and the problem."""


class DamagedFileError(DataFileError):
    """A cache or stored data file that cannot be read as written (cut short, overwritten, altered); the message names
    the file and the remedy (a cache: delete it, and the next run rebuilds it)."""


def text_lines(raw: Iterable[bytes], path: str | os.PathLike) -> Iterator[tuple[int, str]]:
    """(line number, line) of a binary stream decoded as UTF-8, a leading byte-order mark dropped; a line that is
    not UTF-8 raises DataFileError (Python's UnicodeDecodeError names neither the file nor the line)."""
    for num, line in enumerate(raw, start=1):
        try:
            yield num, line.decode("utf-8-sig" if num == 1 else "utf-8")
        except UnicodeDecodeError as e:
            raise DataFileError(
                f"{path}: line {num}: not UTF-8 text (byte {line[e.start]:#04x} at column {e.start + 1}); "
                "save the file as UTF-8"
            ) from e


def json_records(raw: Iterable[bytes], path: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    """(line number, object) of each non-blank line of a JSON Lines stream; a line that is not UTF-8 or not one
    JSON object raises DataFileError."""
    for num, line in text_lines(raw, path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataFileError(f"{path}: line {num}: invalid JSON at column {e.colno}: {e.msg}") from e
        if not isinstance(record, dict):
            raise DataFileError(f"{path}: line {num}: expected a JSON object, got {type(record).__name__}")
        yield num, record
