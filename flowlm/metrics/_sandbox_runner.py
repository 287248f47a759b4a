"""Child side of ``flowlm.metrics.gsm8k.run_program``; run as ``python -I -S _sandbox_runner.py CPU_S MEM_MB ENTRY
SETUP GUARD PARENT_MOUNT_NS``.

Never imported by the package. It reads generated code on stdin, finishes the operating-system isolation its
wrapper began (``SETUP``: ``uid`` or ``userns`` inside ``unshare``'s namespaces, ``none`` under bubblewrap or
without isolation), sets the resource limits, then runs the code (``GUARD=python``: with restricted builtins,
whitelisted imports as copies without submodules or private names, and an AST check; ``none``, for tests of the
operating-system layer alone: as plain Python), calls the entry function and writes one JSON line
``{"status", "value", "message"}`` to stdout.
"""

import ast
import builtins
import io
import json
import numbers
import os
import re
import resource
import sys
import types

ALLOWED_MODULES = frozenset(
    {
        "bisect",
        "cmath",
        "collections",
        "datetime",
        "decimal",
        "fractions",
        "functools",
        "heapq",
        "itertools",
        "math",
        "numbers",
        "random",
        "statistics",
    }
)
SAFE_BUILTINS = frozenset(
    """abs all any ascii bin bool bytes callable chr complex dict divmod enumerate filter float format frozenset
    hash hex int isinstance issubclass iter len list map max min next oct ord pow print property range repr
    reversed round set slice sorted staticmethod classmethod str sum tuple zip NotImplemented
    ArithmeticError AssertionError AttributeError Exception IndexError KeyError LookupError NameError
    NotImplementedError OverflowError RuntimeError StopIteration TypeError ValueError ZeroDivisionError""".split()
)
# Non-underscore attributes that reach frames, code objects or the class graph: the ways out of restricted globals.
FORBIDDEN_ATTRS = frozenset(
    """gi_frame gi_code gi_yieldfrom cr_frame cr_code cr_await ag_frame ag_code ag_await f_back f_globals
    f_locals f_builtins f_code tb_frame tb_next mro""".split()
)


# The uid and gid a program started by root runs as ('nobody' on Debian, Ubuntu and Fedora).
NOBODY = 65534
# Constants of mount(2), unshare(2) and prctl(2) (linux/mount.h, linux/sched.h, linux/prctl.h).
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 0x1, 0x2, 0x4, 0x8, 0x20, 0x1000
MS_NOATIME, MS_RELATIME, MS_STRICTATIME = 0x400, 0x200000, 0x1000000
# Per-mount options of /proc/self/mountinfo that a read-only remount keeps (a user namespace may not drop them).
KEPT_OPTIONS = {b"nosuid": MS_NOSUID, b"nodev": MS_NODEV, b"noexec": MS_NOEXEC, b"noatime": MS_NOATIME}
KEPT_OPTIONS |= {b"nodiratime": 0x800, b"relatime": MS_RELATIME, b"nosymfollow": 0x100}
CLONE_NEWUSER, PR_SET_NO_NEW_PRIVS = 0x10000000, 38
# The scratch folder: 1 MiB, and at most 256 files (empty ones cost kernel memory that RLIMIT_AS does not count).
SCRATCH = b"size=1m,nr_inodes=256,mode=0777"


class Forbidden(Exception):
    """The code uses something outside the sandbox's whitelist."""


def set_limits(cpu_s: int, memory_mb: int) -> None:
    """CPU seconds, address space, open files, no files written, no child processes, no core dumps."""
    limits = [
        (resource.RLIMIT_CPU, cpu_s),
        (resource.RLIMIT_AS, memory_mb * 2**20),
        (resource.RLIMIT_NOFILE, 32),
        (resource.RLIMIT_FSIZE, 0),
        (resource.RLIMIT_NPROC, 0),
        (resource.RLIMIT_CORE, 0),
    ]
    for kind, value in limits:
        _, hard = resource.getrlimit(kind)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        try:
            resource.setrlimit(kind, (value, value))
        except (ValueError, OSError):
            pass  # a platform without this limit: the others and the parent's wall-clock timeout remain


def imports(code: str) -> set[str]:
    """The whitelisted modules ``code`` imports (the only ones the Python-level guard lets it import)."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names & ALLOWED_MODULES


def isolate(setup: str, preload: set[str], parent_mounts: str) -> None:
    """Inside ``unshare``'s new mount, network, pid and IPC namespaces: every mount read-only, an empty tmpfs as
    the working directory, then no privilege left: ``uid`` (started as root) switches to uid/gid 65534 without
    groups, ``userns`` (started as the root of a user namespace) enters a nested user namespace, which holds no
    capability over the mounts and network set up here. No new privileges either way (setuid files run as is).
    The modules in ``preload`` are imported first, while readable: uid 65534 cannot read a root-only interpreter
    prefix (``/root/.pyenv``). ``parent_mounts`` is the parent's mount namespace: the same one here (no
    ``unshare --mount`` around this process) is refused before anything is remounted, which would be the host's."""
    if setup == "none":
        return
    if os.readlink("/proc/self/ns/mnt") == parent_mounts:
        raise OSError(f"not in a mount namespace of its own ({parent_mounts}): nothing remounted")
    for name in sorted(preload):
        __import__(name)
    import ctypes  # here, not at the top: a few ms that runs without this setup need not pay

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
    libc.prctl.argtypes = (ctypes.c_int, *[ctypes.c_ulong] * 4)

    def call(result: int, what: str, tolerated: tuple[int, ...] = ()) -> None:
        errno = ctypes.get_errno()
        if result != 0 and errno not in tolerated:
            raise OSError(errno, f"{what}: {os.strerror(errno)}")

    with open("/proc/self/mountinfo", "rb") as f:
        mounts = [line.split()[4:6] for line in f]
    for point, options in mounts:
        path = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), point)  # octal escapes: "\040" is " "
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for option in options.split(b","):
            flags |= KEPT_OPTIONS.get(option, 0)
        flags |= 0 if flags & (MS_NOATIME | MS_RELATIME) else MS_STRICTATIME
        # a mount point this process cannot reach (ENOENT, EACCES) is out of the program's reach as well
        call(libc.mount(None, path, None, flags, None), f"read-only remount of {path!r}", (2, 13))
    scratch = os.fsencode(os.getcwd())
    call(libc.mount(b"tmpfs", scratch, b"tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, SCRATCH), "scratch tmpfs")
    os.chdir(scratch)  # into the new tmpfs, before the parents' permissions (root's 0700 temp folder) apply
    if setup == "uid":
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
    else:
        call(libc.unshare(CLONE_NEWUSER), "nested user namespace")
    call(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def check(tree: ast.AST) -> None:
    """Raise Forbidden for imports off the whitelist, private/dunder or frame attributes, unsafe builtins."""
    bound = {"__name__"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names:
                if getattr(node, "level", 0) or name.split(".")[0] not in ALLOWED_MODULES:
                    raise Forbidden(f"import of {name or '.'!r} is not allowed")
        elif isinstance(node, ast.Attribute) and (node.attr.startswith("_") or node.attr in FORBIDDEN_ATTRS):
            raise Forbidden(f"attribute {node.attr!r} is not allowed")
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in bound:
            if node.id.startswith("__") or (hasattr(builtins, node.id) and node.id not in SAFE_BUILTINS):
                raise Forbidden(f"name {node.id!r} is not allowed")


def sandbox_globals() -> dict:
    """Globals for the generated code: whitelisted builtins and an importer of whitelisted module copies."""
    real_import = builtins.__import__
    copies: dict[str, types.ModuleType] = {}

    def restricted_import(name, globals=None, locals=None, fromlist=(), level=0):
        top = name.split(".")[0]
        if level or top not in ALLOWED_MODULES:
            raise ImportError(f"import of {name!r} is not allowed")
        if top not in copies:
            module = real_import(top)
            # a copy without submodules or private names: e.g. fractions.sys would lead straight to os
            copy = types.ModuleType(top)
            for key, value in vars(module).items():
                if not key.startswith("_") and not isinstance(value, types.ModuleType):
                    setattr(copy, key, value)
            copies[top] = copy
        return copies[top]

    safe = {name: getattr(builtins, name) for name in SAFE_BUILTINS}
    safe["__import__"] = restricted_import
    safe["__build_class__"] = builtins.__build_class__  # class statements
    return {"__builtins__": safe, "__name__": "__sandbox__"}


def entry_point(tree: ast.Module, scope: dict, entry: str):
    """The function to call: ``entry`` if defined, else the last top-level function without required args."""
    if callable(scope.get(entry)):
        return scope[entry]
    for node in reversed(tree.body):
        if isinstance(node, ast.FunctionDef) and len(node.args.args) == len(node.args.defaults):
            if not node.args.posonlyargs and not node.args.kwonlyargs and callable(scope.get(node.name)):
                return scope[node.name]
    for name in ("result", "answer"):  # a script that only assigns its answer
        if name in scope:
            return lambda value=scope[name]: value
    return None


def as_number(value) -> float:
    """The returned answer as a float (bools, ints, Fractions, Decimals, numeric strings like '$1,234')."""
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, str):
        return float(value.strip().replace(",", "").replace("$", "").rstrip("."))
    raise TypeError(f"returned a {type(value).__name__}, not a number")


def run(code: str, entry: str, guard: bool = True) -> dict:
    """Check, execute and call the generated code; every failure becomes a status, never an exception.

    ``guard=False`` skips the Python-level guard (AST check, restricted builtins and imports): only for tests of
    the operating-system isolation alone.
    """
    try:
        tree = ast.parse(code, "<generated>")
        if guard:
            check(tree)
    except Forbidden as err:
        return {"status": "forbidden", "value": None, "message": str(err)}
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        return {"status": "error", "value": None, "message": f"{type(err).__name__}: {err}"}
    scope = sandbox_globals() if guard else {"__name__": "__sandbox__"}
    stdout = sys.stdout
    sys.stdout = io.StringIO()  # the program's prints must not mix with the JSON result
    try:
        exec(compile(tree, "<generated>", "exec"), scope)
        fn = entry_point(tree, scope, entry)
        if fn is None:
            return {"status": "error", "value": None, "message": f"no function {entry!r} (or other) to call"}
        return {"status": "ok", "value": as_number(fn()), "message": ""}
    except BaseException as err:  # noqa: BLE001 - generated code may raise anything, SystemExit included
        try:
            message = f"{type(err).__name__}: {err}"
        except BaseException:  # noqa: BLE001 - a user-defined __str__ may fail too
            message = type(err).__name__
        return {"status": "error", "value": None, "message": message}
    finally:
        sys.stdout = stdout


def main() -> None:
    """Read the code from stdin; isolation and limits, then run it; print one JSON line."""
    cpu_s, memory_mb, entry, setup, guard, parent_mounts = int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:7]
    code = sys.stdin.buffer.read().decode("utf-8", "replace")
    try:
        isolate(setup, imports(code), parent_mounts)
    except OSError as err:  # fail closed: the code does not run
        result = {"status": "error", "value": None, "message": f"sandbox setup failed: {err}"}
    else:
        set_limits(cpu_s, memory_mb)
        result = run(code, entry, guard=guard == "python")
    result["message"] = result["message"][:300]
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
