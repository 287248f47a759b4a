"""GSM8K scoring (methods.md §7): final-number extraction from natural-language answers, and sandboxed execution
of generated TinyGSM-style Python functions (``def simple_math_problem() -> int: ... return result``).

The sandbox (``run_program``) runs each program in a fresh ``python -I -S`` process (isolated: no site
packages, no PYTHON* variables, no script directory on the path) with an empty environment, a fresh temporary
working directory, resource limits (CPU seconds, address space, open files, no file writes, no child processes,
no core dumps), a wall-clock timeout that kills the whole process group, whitelisted imports and builtins and an
AST check against private attributes and frame access. It guards against accidents of generated code (infinite
loops, memory bombs, stray file or network access); it is not a security boundary against a determined
adversary: run untrusted code at scale inside a container as well.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = ["ExecResult", "answers_match", "extract_answer", "parse_gold", "run_program", "run_programs"]

# A number as written in answers: optional sign (before or after '$'), thousands commas, decimals; not the tail
# of a word or of another number ('x2', '5-3' gives 5 and 3, not 5 and -3).
_NUMBER = re.compile(
    r"(?<![\w.])(?P<sign>-\s?)?\$?\s?(?P<sign2>-)?"
    r"(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?!\d)"
)
_FINAL = re.compile(r"####\s*(?P<rest>[^\n]*)")


def _to_float(match: re.Match) -> float:
    value = float(match["num"].replace(",", ""))
    return -value if match["sign"] or match["sign2"] else value


def extract_answer(text: str) -> float | None:
    """The answer of a generated solution: the first number after ``####`` if present, else the last number.

    Handles thousands commas (``1,234``), signs (``-5``, ``-$5``, ``$-5``), decimals (``3.50``), currency
    (``$12``) and trailing text or a full stop (``#### 12 apples.``). None when there is no number.
    """
    final = _FINAL.search(text)
    if final:
        first = _NUMBER.search(final["rest"])
        if first:
            return _to_float(first)
    numbers = list(_NUMBER.finditer(text))
    return _to_float(numbers[-1]) if numbers else None


def parse_gold(answer: str | float | int) -> float:
    """The gold number of a GSM8K answer (its ``#### N`` line) or an already numeric answer."""
    if isinstance(answer, int | float):
        return float(answer)
    final = _FINAL.search(answer)
    first = _NUMBER.search(final["rest"]) if final else None
    if first is None:
        raise ValueError(f"no '#### N' final answer in gold answer {answer[-80:]!r}")
    return _to_float(first)


def answers_match(pred: float | None, gold: float | None, *, rel_tol: float = 1e-6, abs_tol: float = 1e-6) -> bool:
    """Equal up to a small tolerance (floating-point noise of executed programs, 12 vs 12.0); None never matches."""
    if pred is None or gold is None or not math.isfinite(pred):
        return False
    return math.isclose(pred, gold, rel_tol=rel_tol, abs_tol=abs_tol)


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one sandboxed program: status, its numeric return value when ok, and a short message."""

    status: Literal["ok", "error", "timeout", "forbidden"]
    value: float | None = None
    message: str = ""


_RUNNER = Path(__file__).with_name("_sandbox_runner.py")


def run_program(
    code: str, *, timeout_s: float = 2.0, memory_mb: int = 512, entry: str = "simple_math_problem"
) -> ExecResult:
    """Execute generated code in a sandboxed subprocess and return the value of its entry function.

    The entry is ``entry`` if defined, else the last top-level function callable without arguments, else a
    global ``result``/``answer``. Never raises on bad generated code: syntax errors, exceptions and
    non-numeric returns are ``error``, a whitelist violation ``forbidden``, running past ``timeout_s`` wall-clock
    (or the CPU limit, ``ceil(timeout_s) + 1`` s) ``timeout``; a memory bomb fails with MemoryError (``error``).
    Resource limits are set by the child itself before it reads the code, not in ``preexec_fn``, which CPython
    documents as unsafe in threaded parents (Lightning, torch, ``run_programs``' thread pool).
    """
    cpu_s = math.ceil(timeout_s) + 1
    command = [sys.executable, "-I", "-S", str(_RUNNER), str(cpu_s), str(int(memory_mb)), entry]
    with tempfile.TemporaryDirectory(prefix="flowlm-sandbox-") as cwd:
        try:
            proc = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=cwd,
                env={},
                start_new_session=True,  # its own process group, so a timeout kills everything it started
                close_fds=True,
            )
        except OSError as err:
            return ExecResult("error", None, f"could not start the sandbox: {err}")
        try:
            out, err = proc.communicate(code.encode("utf-8", "replace"), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return ExecResult("timeout", None, f"no result within {timeout_s:g} s")
    return _result(proc.returncode, out, err)


def run_programs(codes: Sequence[str], *, workers: int = 4, **kwargs) -> list[ExecResult]:
    """``run_program`` over many programs, ``workers`` sandboxes at a time (results in input order)."""
    if workers <= 1 or len(codes) <= 1:
        return [run_program(code, **kwargs) for code in codes]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda code: run_program(code, **kwargs), codes))


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # already gone
    proc.communicate()


def _result(returncode: int, out: bytes, err: bytes) -> ExecResult:
    if returncode == -signal.SIGXCPU:
        return ExecResult("timeout", None, "CPU time limit reached")
    lines = out.decode("utf-8", "replace").strip().splitlines()
    try:
        payload = json.loads(lines[-1])
        return ExecResult(payload["status"], payload["value"], payload["message"])
    except (IndexError, ValueError, KeyError, TypeError):
        tail = err.decode("utf-8", "replace").strip()[-200:]
        return ExecResult("error", None, f"sandbox exited with code {returncode} and no result: {tail}")
