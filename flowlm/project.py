"""Where the suite lives: the checkout's folder, its config tree, and the commit of the code that runs. A leaf of the
ground floor (the standard library only): every floor above may read the project folder from here."""

from __future__ import annotations

import subprocess
from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parent.parent  # the checkout: the folder holding flowlm/ and conf/
CONF_DIR = str(PROJECT_DIR / "conf")


def git_commit() -> str:
    """The commit of the code this process runs (with ``-dirty`` when the work tree had changes), or 'unknown'.
    Read once, when the process first asks, and kept: a checkout updated while a run trains (a campaign's clone
    pulling new commits) does not change what the run records."""
    global _COMMIT
    if _COMMIT is None:
        _COMMIT = _read_commit()
    return _COMMIT


def _read_commit() -> str:
    try:
        sha = subprocess.run(
            ["git", "-C", str(PROJECT_DIR), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(PROJECT_DIR), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


_COMMIT: str | None = None
