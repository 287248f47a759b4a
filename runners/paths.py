"""Where the suite lives: the project folder, its config tree, and the commit of the code that runs. A leaf module
(the standard library only): the runners, sweeps and datamodules all read the project folder from here."""

from __future__ import annotations

import subprocess
from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parent.parent
CONF_DIR = str(PROJECT_DIR / "conf")


def git_commit() -> str:
    """The commit of the code that runs (with ``-dirty`` when the work tree has changes), or 'unknown'."""
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
