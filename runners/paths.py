"""Where the suite lives and what it runs on: the project folder, its config tree, the commit of the code that runs,
and the CPU trainer's precision. A leaf module (nothing of the suite's own): the runners, sweeps and datamodules all
read the project folder from here."""

from __future__ import annotations

import subprocess
from pathlib import Path

from omegaconf import OmegaConf

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


def cpu_precision() -> str:
    """The CPU trainer's precision (conf/trainer/cpu.yaml): ``bf16-mixed`` where the CPU computes bf16 natively
    (oneDNN's bf16 kernels: AVX-512 or AMX; bf16 autocast then runs ≈ 2× faster than float32), else ``32-true``.
    On an AVX2-only CPU torch emulates bf16 matrix products, measured 28× slower than float32 (512 × 512 products,
    AMD EPYC with AVX2) and 7–10× for a whole Sudoku training step: docs/performance.md#cpu-precision."""
    import torch  # here, not at the top: this leaf module is read by processes that need no torch

    try:
        native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without the query: the safe choice
        native = False
    return "bf16-mixed" if native else "32-true"


# `${flowlm.cpu_precision:}` in conf/trainer/cpu.yaml; `trainer.precision=bf16-mixed` (or 32-true) still sets it.
OmegaConf.register_new_resolver("flowlm.cpu_precision", cpu_precision, replace=True)
