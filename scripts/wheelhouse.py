"""Wheels of the suite's runtime for a GPU machine without internet whose Python already holds PyTorch.

    .venv/bin/python scripts/wheelhouse.py .whl --python 3.12 --have have.txt         # download (or build) them
    .venv/bin/python scripts/wheelhouse.py .whl --python 3.12 --have have.txt --list  # only print the pins

On such a machine (a cluster's compute node, a lent GPU box) `python3 -m pip list --format=freeze > have.txt` says
what it holds; ``--have`` takes that file (``name==version`` or bare names, one a line; ``#`` comments). The wheels
are the dependency closure of pyproject.toml's ``dependencies`` at the versions this checkout's virtualenv holds (the
interpreter running this script), for Linux x86-64, the target's CPython (``--python``) and glibc (``--glibc``),
less what the target has, less torch, triton and the ``nvidia-*`` libraries (the target's CUDA build stays). A
package published without a wheel for the target is built here (``pip wheel``) when it is pure Python, and refused
otherwise. On the target:

    bash benchmarks/gpu_tables.sh --wheels .whl      # or gpu_check.sh: installs them into a temporary folder first

or by hand: ``python3 -m pip install --no-index --no-deps --target /tmp/flowlm-site .whl/*.whl`` and
``export PYTHONPATH=/tmp/flowlm-site``. docs/gpu.md#a-gpu-machine-without-internet.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
# The target's own GPU build: never carried.
NEVER = re.compile(r"^(torch|triton|nvidia-.*)$")


def target_environment(python: str) -> dict[str, str]:
    """PEP 508 marker values of CPython ``python`` (``3.12``) on Linux x86-64."""
    if not re.fullmatch(r"3\.\d{1,2}", python):
        raise ValueError(f"--python takes a CPython version such as 3.12, got {python!r}")
    env = dict(default_environment())
    env.update(
        python_version=python,
        python_full_version=f"{python}.0",
        sys_platform="linux",
        platform_system="Linux",
        platform_machine="x86_64",
        os_name="posix",
        implementation_name="cpython",
        platform_python_implementation="CPython",
    )
    return env


def read_have(path: Path) -> set[str]:
    """The distribution names a ``pip list --format=freeze`` (or a names-only) file lists, canonicalized."""
    names = set()
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:(?:==|@|>=|~=)\s*\S.*)?$", line)
        if match is None:
            raise ValueError(f"{path}:{number}: not a package name or name==version: {line!r}")
        names.add(canonicalize_name(match.group(1)))
    return names


def project_roots(pyproject: Path) -> list[Requirement]:
    """pyproject.toml's ``[project] dependencies``."""
    return [Requirement(r) for r in tomllib.loads(pyproject.read_text())["project"]["dependencies"]]


def closure(roots: list[Requirement], env: dict[str, str], version_of, requires_of) -> dict[str, str]:
    """name → version of every distribution ``roots`` need under the markers ``env`` (extras followed), read from
    ``version_of(name)`` (None: not installed) and ``requires_of(name)`` (its Requires-Dist lines). A needed
    distribution that is not installed is an error naming who needs it."""
    found: dict[str, str] = {}
    missing: dict[str, str] = {}
    stack = [(r, "pyproject.toml") for r in roots]
    extras_done: set[tuple[str, str]] = set()
    while stack:
        req, needed_by = stack.pop()
        name = canonicalize_name(req.name)
        new_extras = [e for e in sorted(req.extras) if (name, e) not in extras_done]
        if name in found and not new_extras:
            continue
        version = found.get(name) or version_of(name)
        if version is None:
            missing.setdefault(name, needed_by)
            continue
        first = name not in found
        found[name] = version
        extras_done.update((name, e) for e in new_extras)
        for line in requires_of(name):
            dep = Requirement(line)
            wanted = [""] + new_extras if first else new_extras
            if dep.marker is not None and not any(dep.marker.evaluate({**env, "extra": e}) for e in wanted):
                continue
            stack.append((dep, name))
    if missing:
        listed = ", ".join(f"{n} (needed by {by})" for n, by in sorted(missing.items()))
        raise LookupError(f"not installed in this virtualenv, so no version to pin: {listed}; run `make venv` first")
    return found


def installed_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def installed_requires(name: str) -> list[str]:
    return md.distribution(name).requires or []


def wheel_pins(python: str, have: set[str]) -> dict[str, str]:
    """name → version of the wheels to carry: the closure less ``have`` and the target's GPU build."""
    found = closure(
        project_roots(ROOT / "pyproject.toml"), target_environment(python), installed_version, installed_requires
    )
    return {n: v for n, v in sorted(found.items()) if n not in have and not NEVER.match(n)}


def platforms(glibc: str) -> list[str]:
    """The Linux x86-64 wheel tags a target with glibc ``glibc`` (``2.28``) installs, newest first."""
    match = re.fullmatch(r"2\.(\d{2})", glibc)
    if match is None or int(match.group(1)) < 17:
        raise ValueError(f"--glibc takes the target's glibc version, 2.17 or later (`ldd --version`), got {glibc!r}")
    newest = int(match.group(1))
    return [f"manylinux_2_{n}_x86_64" for n in range(newest, 16, -1)] + ["manylinux2014_x86_64", "manylinux1_x86_64"]


def download(pins: dict[str, str], out: Path, python: str, glibc: str) -> list[str]:
    """Each pin's wheel for the target into ``out``, in one pip call; a package without a wheel for the target
    (pip names it) is built here when it is pure Python, and the call goes on with the rest. The names built here."""
    out.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    tags = ["--python-version", python, "--implementation", "cp"]
    tags += [a for p in platforms(glibc) for a in ("--platform", p)]
    remaining, built = dict(pins), []
    while remaining:
        specs = [f"{n}=={v}" for n, v in remaining.items()]
        got = subprocess.run(
            [*pip, "download", "-q", "--no-deps", "--only-binary=:all:", *tags, "-d", str(out), *specs],
            capture_output=True,
            text=True,
        )
        if got.returncode == 0:
            break
        tail = (got.stderr.strip().splitlines() or ["(no output)"])[-1]
        match = re.search(r"No matching distribution found for ([A-Za-z0-9._-]+)==", got.stderr)
        name = canonicalize_name(match.group(1)) if match else None
        if name not in remaining:
            raise RuntimeError(f"pip download failed: {tail}")
        spec = f"{name}=={remaining.pop(name)}"
        with tempfile.TemporaryDirectory() as tmp:  # no wheel for the target: build one, if it is pure Python
            made = subprocess.run([*pip, "wheel", "-q", "--no-deps", "-w", tmp, spec], capture_output=True, text=True)
            wheels = list(Path(tmp).glob("*.whl"))
            if made.returncode != 0 or len(wheels) != 1:
                raise RuntimeError(f"{spec}: no wheel for CPython {python} on glibc {glibc} and none built ({tail})")
            if not wheels[0].name.endswith("-none-any.whl"):
                raise RuntimeError(f"{spec}: only an sdist with compiled code ({wheels[0].name}): build on the target")
            wheels[0].replace(out / wheels[0].name)
        built.append(spec)
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder for the wheels")
    parser.add_argument("--python", default="3.12", help="the target's CPython version (default 3.12)")
    parser.add_argument("--glibc", default="2.28", help="the target's glibc (`ldd --version`; default 2.28)")
    parser.add_argument("--have", type=Path, help="the target's `pip list --format=freeze` (or names, one a line)")
    parser.add_argument("--list", action="store_true", help="print the pins only, download nothing")
    args = parser.parse_args(argv)
    try:
        platforms(args.glibc)  # a bad --glibc is refused before anything
        have = read_have(args.have) if args.have else set()
        pins = wheel_pins(args.python, have)
    except (OSError, ValueError, LookupError) as err:
        print(f"wheelhouse: {err}", file=sys.stderr)
        return 2
    if args.list:
        print("\n".join(f"{n}=={v}" for n, v in pins.items()))
        return 0
    try:
        built = download(pins, args.out, args.python, args.glibc)
    except (OSError, RuntimeError) as err:
        print(f"wheelhouse: {err}", file=sys.stderr)
        return 1
    size = sum(p.stat().st_size for p in args.out.glob("*.whl"))
    note = f"; built here (pure Python, no wheel published): {', '.join(built)}" if built else ""
    print(f"wheelhouse: {len(pins)} wheels for CPython {args.python}, {size / 2**20:.1f} MiB in {args.out}{note}")
    print(f"on the target: bash benchmarks/gpu_tables.sh --wheels {args.out}  (or gpu_check.sh --wheels {args.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
