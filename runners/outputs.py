"""Where a command writes its results, checked before any compute (docs/reliability.md, "Bad input is refused before
compute"): every console script that writes an output folder (``flowlm-export``'s OUT_DIR, ``flowlm-eval
results_csv=``, ``flowlm-train callbacks.results_csv.dir=``, ``flowlm-mt-bench out_dir=``, ``flowlm-lm-eval
--output_path``, an Optuna sweep's SQLite storage) asks ``check_writable`` first. A read-only folder was found only
when the results were written, after the model was loaded and every sample drawn. Light: no torch, Hydra or
Lightning, so an entry module may import it at its top."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def check_writable(option: str, folder: str | os.PathLike, *, files: Iterable[str | os.PathLike] = ()) -> Path:
    """Refuse, in one line naming ``option`` (the setting that gives the folder) and ``folder``, an output folder this
    process cannot write: the folder when it exists, else the nearest folder above it that does (the command makes
    the rest), must be a folder with write and search permission on a writable filesystem; each of ``files`` that
    exists (a file the command appends to in place) must be writable. Returns the folder; nothing is made here."""
    where = Path(folder).expanduser()
    existing = where
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise NotADirectoryError(f"{option}: {where} cannot be made: {existing} is a file; give a folder for {option}")
    if not os.access(existing, os.W_OK | os.X_OK):  # False on a read-only filesystem too, even for root
        raise PermissionError(
            f"{option}: {where} cannot be written: {existing} is not writable (read-only filesystem or permissions); "
            f"make it writable or give another {option}. Checked before any compute: nothing was run or written"
        )
    for file in files:
        path = Path(file)
        if path.exists() and not os.access(path, os.W_OK):
            raise PermissionError(
                f"{option}: {path} cannot be written (read-only filesystem or permissions); make it writable or give "
                f"another {option}. Checked before any compute: nothing was run or written"
            )
    return where
