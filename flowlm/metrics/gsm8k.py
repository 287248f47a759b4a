"""GSM8K scoring (methods.md §7): final-number extraction from natural-language answers, and sandboxed execution
of generated TinyGSM-style Python functions (``def simple_math_problem() -> int: ... return result``).

The sandbox (``run_program``) runs each program in a fresh ``python -I -S`` process (isolated: no site
packages, no PYTHON* variables, no script directory on the path) with an empty environment, resource limits (CPU
seconds, address space, 32 open files, no bytes written to any file, no child processes, no core dumps), a
wall-clock timeout that kills the whole process group, and, as a first filter, whitelisted imports and builtins
and an AST check against private attributes and frame access. That Python-level guard can be escaped (e.g.
``functools.update_wrapper`` hands out a module's globals); the boundary is the operating system's
(``sandbox="os"``, the default): the process has its own network namespace (no interface but a downed loopback:
no connection anywhere, 127.0.0.1 included), its own pid namespace (it sees and signals no other process) and IPC
namespace, a private mount namespace in which every mount is read-only, an empty tmpfs as its working folder (at
most 256 files), and no privilege: started by root, it runs as uid/gid 65534 (``nobody``) without groups; started
by another user, as that user (it can read what that user can read, and write nothing outside its scratch
folder). How, detected once per process (``isolation``): as root, util-linux ``unshare``; otherwise bubblewrap
(``bwrap``) if installed, else ``unshare`` in a user namespace. Where none works, ``sandbox="os"`` raises
``SandboxUnavailableError``; ``sandbox="python_only"`` runs with the Python-level guard and the limits alone, on
the caller's own responsibility. No seccomp filter is installed.

What is fed to the sandbox (``prepare_program``, ``execute_responses``) follows the released TinyGSM scorer of
FMLM+: the program starts at the first ``def ``, ends at the first textual
stop marker, is taken from inside a Markdown fence if one follows, and loses trailing lines until it compiles; it
runs with ``math`` available unimported; only ``simple_math_problem()`` is called (no fallback entry point); the
answer matches the gold within an absolute 1e-3 (``answers_match(..., rel_tol=0, abs_tol=1e-3)``); timeout 5 s.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Literal

__all__ = [
    "SANDBOXES",
    "ExecResult",
    "Isolation",
    "SandboxUnavailableError",
    "answers_match",
    "defines_name",
    "execute_responses",
    "extract_answer",
    "extract_program",
    "isolation",
    "parse_gold",
    "prepare_program",
    "run_program",
    "run_programs",
]

# Characters read as a minus sign: ASCII hyphen-minus, U+2212 MINUS SIGN, U+2012 FIGURE DASH, U+2013 EN DASH (what
# typesetting and some tokenizers turn "-5" into) and U+FF0D FULLWIDTH HYPHEN-MINUS. Not the em dash: "the answer—5"
# is punctuation.
_MINUS = "-\u2212\u2012\u2013\uff0d"
# A number as written in answers: optional sign (before or after '$'), thousands commas, decimals, an exponent
# ('5e3', '1.5E-3'); not the tail of a word or of another number ('x2', '5e3' is one number, '5-3' and '5 - 3'
# give 5 and 3, not 5 and -3: a dash after a number, spaced or not, is a binary minus or a range).
_NUMBER = re.compile(
    rf"(?<![\w.])(?P<sign>(?<![\d.]\s)[{_MINUS}]\s?)?\$?\s?(?P<sign2>(?<![\d.]\s)[{_MINUS}])?"
    rf"(?P<num>(?:\d{{1,3}}(?:,\d{{3}})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?:[eE][{_MINUS}+]?\d+)?)(?!\d)"
)
_FINAL = re.compile(r"####\s*(?P<rest>[^\n]*)")
_TO_ASCII_MINUS = str.maketrans(dict.fromkeys(_MINUS, "-"))


def _to_float(match: re.Match) -> float:
    value = float(match["num"].replace(",", "").translate(_TO_ASCII_MINUS))
    return -value if match["sign"] or match["sign2"] else value


def extract_answer(text: str) -> float | None:
    """The answer of a generated solution: the first number after ``####`` if present, else the last number.

    Handles thousands commas (``1,234``), signs (``-5``, ``-$5``, ``$-5``, and the Unicode minus ``−5`` or en dash
    ``–5``), decimals (``3.50``), exponents (``5e3``, ``1.5E-3``), currency (``$12``) and trailing text or a full
    stop (``#### 12 apples.``). A dash right after a number is not a sign (``5-3``, ``5 - 3``). None when there
    is no number.
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
    """|pred − gold| ≤ max(rel_tol · max(|pred|, |gold|), abs_tol), both read as the decimals they print as.

    The difference is taken between the shortest decimal forms (``repr``), not the binary floats, so a bound is
    met exactly as written (100.001 vs 100 is within 1e-3, as in the released TinyGSM scorer, whereas the float
    difference is 0.0010000000000047748). None, NaN and infinities never match.
    """
    if pred is None or gold is None or not (math.isfinite(pred) and math.isfinite(gold)):
        return False
    p, g = Decimal(repr(float(pred))), Decimal(repr(float(gold)))
    bound = max(Decimal(repr(float(rel_tol))) * max(abs(p), abs(g)), Decimal(repr(float(abs_tol))))
    return abs(p - g) <= bound


# Textual end markers the released scorer cuts at (its decoded samples keep special tokens as text).
_STOP_MARKERS = ("<|endoftext|>", "<|eot_id|>", "</s>")
_FENCE = "`" * 3
# The released scorer tries at most this many trailing-line cuts before giving up on compiling.
_MAX_LINE_CUTS = 50


def _from_def(text: str) -> str:
    start = text.find("def ")
    return text if start < 0 else text[start:]


def _fenced(text: str) -> str | None:
    """Inside of the first fenced block (after an optional ``python`` tag and whitespace), None without one."""
    opening = text.find(_FENCE)
    if opening < 0:
        return None
    start = opening + len(_FENCE)
    if text[start : start + 6].lower() == "python":
        start += 6
    while start < len(text) and text[start].isspace():
        start += 1
    closing = text.find(_FENCE, start)
    return None if closing < 0 else text[start:closing]


def _compiles(code: str) -> bool:
    try:
        with warnings.catch_warnings():  # generated code's SyntaxWarnings ('is' with a literal) are noise here
            warnings.simplefilter("ignore")
            compile(code, "<generated>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError, OverflowError, RecursionError, MemoryError):
        return False
    return True


def extract_program(text: str) -> str:
    """The program in a generated response, as the released TinyGSM scorer extracts it, in its order.

    Keep from the first ``def `` on; cut at the first end marker (``<|endoftext|>``, ``<|eot_id|>``, ``</s>``); if a
    fenced block (three backticks … three backticks) follows, keep its inside; keep from its first ``def `` on;
    strip; then drop trailing lines (up to 49) until the rest compiles. A text that never compiles comes back whole
    (stripped), so the sandbox reports its syntax error.
    Because the cut at ``def `` comes first, the opening fence of a fenced function is already gone and its closing
    fence is dropped by the compile step; the fence step only acts when two more fences follow the ``def `` (then
    the text between them is what runs, as in the released scorer).
    """
    text = _from_def(text)
    for marker in _STOP_MARKERS:
        text = text.split(marker, 1)[0]
    inside = _fenced(text)
    text = _from_def(text if inside is None else inside).strip()
    lines = text.splitlines()
    for cut in range(min(_MAX_LINE_CUTS, len(lines))):
        candidate = "\n".join(lines[: len(lines) - cut]).strip()
        if candidate and _compiles(candidate):
            return candidate
    return text


def defines_name(code: str, name: str) -> bool | None:
    """Whether module-level code binds ``name`` (def, class, assignment, import, loop target); None if unparsable.

    Bodies of functions, classes, lambdas and comprehensions are other scopes and are not searched; the blocks of
    ``if``/``for``/``while``/``try``/``with``/``match`` at module level are.
    """
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, OverflowError, RecursionError, MemoryError):
        return None
    scopes = (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if node.name == name:
                return True
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id == name:
            return True
        if isinstance(node, ast.alias) and (node.asname or node.name.split(".")[0]) == name:
            return True
        if not isinstance(node, scopes):
            stack.extend(ast.iter_child_nodes(node))
    return False


def _with_math(code: str) -> str:
    """``import math`` placed first (after any ``from __future__`` imports, which must lead)."""
    try:
        body = ast.parse(code).body
    except (SyntaxError, ValueError, OverflowError, RecursionError, MemoryError):
        return "import math\n" + code
    after = 0
    for i, node in enumerate(body):
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            after = node.end_lineno or 0
        elif not (i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            break  # past the docstring and the __future__ imports
    lines = code.splitlines(keepends=True)
    return "".join([*lines[:after], "import math\n", *lines[after:]])


def prepare_program(text: str) -> str:
    """The code the sandbox runs for a response: ``extract_program``, plus ``import math``.

    The released scorer executes in a namespace that already holds ``math``, so a program whose ``import math``
    stood before its ``def`` (and was cut away with the text there) still runs; the import reproduces that.
    """
    return _with_math(extract_program(text))


def execute_responses(
    texts: Sequence[str],
    *,
    entry: str = "simple_math_problem",
    entry_fallback: bool = False,
    sandbox: str = "os",
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    workers: int = 4,
) -> tuple[list[str], list[ExecResult]]:
    """Extract the program of each response and run it in the sandbox: (extracted programs, results).

    Defaults are the released TinyGSM protocol: only ``entry`` is called (a program that does not define it at
    module level is an ``error`` without running), 5 s timeout. ``entry_fallback=True``
    lets the sandbox call the last argument-free function (or a global ``result``/``answer``) instead.
    ``sandbox`` as in ``isolation``; an unavailable one raises before anything runs.
    """
    isolation(sandbox)
    programs = [extract_program(text) for text in texts]
    results: list[ExecResult | None] = [None] * len(programs)
    todo = []
    for i, code in enumerate(programs):
        if not entry_fallback and defines_name(code, entry) is False:
            results[i] = ExecResult("error", None, f"no function {entry!r} defined (entry_fallback is off)")
        else:
            todo.append(i)
    codes = [_with_math(programs[i]) for i in todo]
    ran = run_programs(codes, workers=workers, timeout_s=timeout_s, memory_mb=memory_mb, entry=entry, sandbox=sandbox)
    for i, result in zip(todo, ran, strict=True):
        results[i] = result
    return programs, results


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one sandboxed program: status, its numeric return value when ok, and a short message."""

    status: Literal["ok", "error", "timeout", "forbidden"]
    value: float | None = None
    message: str = ""


SANDBOXES = ("os", "python_only")


class SandboxUnavailableError(RuntimeError):
    """``sandbox="os"`` was asked for and no operating-system isolation can be set up on this machine."""


@dataclass(frozen=True)
class Isolation:
    """How programs are contained: a name (logged with the results), the command that wraps the interpreter
    (``{scratch}`` stands for the program's empty working folder) and the runner's own part of the setup
    (``_sandbox_runner.isolate``: ``none``, ``uid`` or ``userns``)."""

    name: str
    wrapper: tuple[str, ...] = ()
    setup: str = "none"

    def command(self, scratch: str) -> list[str]:
        """The wrapper for one program whose working folder is ``scratch``."""
        return [part.replace("{scratch}", scratch) for part in self.wrapper]


PYTHON_ONLY = Isolation("python_only")
_RUNNER = Path(__file__).with_name("_sandbox_runner.py")
_PROBE = "def simple_math_problem():\n    return 1\n"


def isolation(sandbox: str = "os") -> Isolation:
    """The isolation ``sandbox`` stands for: ``os``, the first operating-system isolation that runs a probe
    program here (detected once per process), or ``python_only`` (the Python-level guard and resource limits).

    Raises ``SandboxUnavailableError`` when ``os`` cannot be set up (naming what was tried and why it failed),
    ``ValueError`` for another name.
    """
    if sandbox not in SANDBOXES:
        raise ValueError(f"sandbox must be one of {list(SANDBOXES)}, got {sandbox!r}")
    if sandbox == "python_only":
        return PYTHON_ONLY
    found = _os_isolation()
    if isinstance(found, str):
        raise SandboxUnavailableError(
            f"no operating-system sandbox for generated programs can be set up on this machine ({found}). Run as "
            "root, allow user namespaces (sysctl user.max_user_namespaces > 0, and on Debian/Ubuntu "
            "kernel.unprivileged_userns_clone=1 or the AppArmor userns restriction lifted) or install bubblewrap; "
            "or accept the Python-level guard alone, which generated code can escape, with sandbox='python_only'"
        )
    return found


@functools.cache
def _os_isolation() -> Isolation | str:
    """The first candidate that runs the probe program, else why each failed (or that there is none)."""
    failures = []
    for candidate in _os_candidates():
        result = _spawn(_PROBE, candidate, timeout_s=30.0, memory_mb=512, entry="simple_math_problem")
        if result.status == "ok" and result.value == 1.0:
            return candidate
        failures.append(f"{candidate.name}: {result.message}")
    return "; ".join(failures) or "neither bwrap nor util-linux unshare is on PATH"


def _os_candidates() -> list[Isolation]:
    """Operating-system isolations to try, best first.

    As root: ``unshare`` (namespaces; the runner remounts read-only, then switches to uid 65534). Bubblewrap is
    not used as root: it would keep uid 0 (root's own 0600 files readable) unless started as 65534, who cannot
    read a root-only interpreter or checkout. Otherwise: ``bwrap`` (works where it is setuid, too), then
    ``unshare`` in a user namespace.
    """
    unshare, bwrap = shutil.which("unshare"), shutil.which("bwrap")
    spaces = ("--net", "--mount", "--pid", "--ipc", "--fork", "--kill-child", "--mount-proc", "--")
    if os.geteuid() == 0:
        return [Isolation("unshare, uid 65534", (unshare, *spaces), "uid")] if unshare else []
    found = []
    if bwrap:
        # --unshare-all: user (where permitted), net, pid, ipc, uts, cgroup namespaces; bwrap drops every
        # capability and sets no_new_privs; --ro-bind makes every submount read-only too
        layout = ("--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "{scratch}")
        found.append(
            Isolation("bwrap", (bwrap, "--unshare-all", "--die-with-parent", *layout, "--chdir", "{scratch}", "--"))
        )
    if unshare:
        found.append(Isolation("unshare, user namespace", (unshare, "--user", "--map-root-user", *spaces), "userns"))
    return found


def run_program(
    code: str,
    *,
    timeout_s: float = 2.0,
    memory_mb: int = 512,
    entry: str = "simple_math_problem",
    sandbox: str = "os",
) -> ExecResult:
    """Execute generated code in a sandboxed subprocess and return the value of its entry function.

    The entry is ``entry`` if defined, else the last top-level function callable without arguments, else a
    global ``result``/``answer``. Never raises on bad generated code: syntax errors, exceptions and
    non-numeric returns are ``error``, a whitelist violation ``forbidden``, running past ``timeout_s`` wall-clock
    (or the CPU limit, ``ceil(timeout_s) + 1`` s) ``timeout``; a memory bomb fails with MemoryError (``error``).
    ``sandbox`` as in ``isolation`` (raises ``SandboxUnavailableError`` when ``os`` cannot be set up).
    Isolation and resource limits are set up by the child itself before it runs the code, not in ``preexec_fn``,
    which CPython documents as unsafe in threaded parents (Lightning, torch, ``run_programs``' thread pool).
    """
    return _spawn(code, isolation(sandbox), timeout_s=timeout_s, memory_mb=memory_mb, entry=entry)


def run_programs(codes: Sequence[str], *, workers: int = 4, **kwargs) -> list[ExecResult]:
    """``run_program`` over many programs, ``workers`` sandboxes at a time (results in input order)."""
    isolation(kwargs.get("sandbox", "os"))  # detected (or refused) once, before the pool starts
    if workers <= 1 or len(codes) <= 1:
        return [run_program(code, **kwargs) for code in codes]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda code: run_program(code, **kwargs), codes))


def _spawn(
    code: str, how: Isolation, *, timeout_s: float, memory_mb: int, entry: str, python_guard: bool = True
) -> ExecResult:
    """Run ``code`` under ``how``; ``python_guard=False`` (tests of the OS layer only) skips the AST check,
    the restricted builtins and the import whitelist."""
    cpu_s = math.ceil(timeout_s) + 1
    guard = "python" if python_guard else "none"
    with tempfile.TemporaryDirectory(prefix="flowlm-sandbox-") as cwd:
        runner = [sys.executable, "-I", "-S", str(_RUNNER), str(cpu_s), str(int(memory_mb)), entry]
        command = [*how.command(cwd), *runner, how.setup, guard, _mount_namespace()]
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


def _mount_namespace() -> str:
    """This process's mount namespace (the runner refuses to remount in it), "-" where there is none to read."""
    try:
        return os.readlink("/proc/self/ns/mnt")
    except OSError:
        return "-"


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
