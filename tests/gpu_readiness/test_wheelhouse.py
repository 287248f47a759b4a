"""A GPU machine without internet (docs/gpu.md#a-gpu-machine-without-internet): scripts/wheelhouse.py pins the
dependency closure of pyproject.toml for the target's Python, less what the target holds and its own GPU build;
benchmarks/wheels.sh (``--wheels`` of gpu_tables.sh and gpu_check.sh) installs such wheels and puts them on the path.
Nothing here downloads: the pins come from this virtualenv's metadata, the installed wheel is made in the test."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from flowlm.project import PROJECT_DIR

ROOT = Path(PROJECT_DIR)
SCRIPT = ROOT / "scripts" / "wheelhouse.py"
# The pins read this virtualenv's metadata, installed for this interpreter's markers: ask for the same Python.
HERE = f"{sys.version_info.major}.{sys.version_info.minor}"


def _module():
    spec = importlib.util.spec_from_file_location("wheelhouse", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


wheelhouse = _module()

# A made-up index: name → (version, Requires-Dist lines).
GRAPH = {
    "app": ("1.0", ["lib>=1", "old-backport; python_version < '3.12'", "extra-dep; extra == 'full'", "opt[fast]"]),
    "lib": ("2.0", ["leaf"]),
    "old-backport": ("0.1", []),
    "extra-dep": ("3.0", []),
    "opt": ("1.5", ["speedup; extra == 'fast'", "plain"]),
    "speedup": ("0.9", []),
    "plain": ("1.1", []),
    "leaf": ("4.0", []),
}


def _closure(roots, python, graph=GRAPH):
    return wheelhouse.closure(
        [Requirement(r) for r in roots],
        wheelhouse.target_environment(python),
        lambda n: graph[n][0] if n in graph else None,
        lambda n: graph[n][1],
    )


def test_the_closure_follows_markers_of_the_targets_python_and_the_extras_asked_for():
    assert _closure(["app"], "3.12") == {
        "app": "1.0", "lib": "2.0", "leaf": "4.0", "opt": "1.5", "speedup": "0.9", "plain": "1.1"
    }  # fmt: skip
    # the backport only below 3.12; the extra only when asked for
    assert "old-backport" in _closure(["app"], "3.11")
    assert "extra-dep" in _closure(["app[full]"], "3.12")
    assert "speedup" not in _closure(["opt"], "3.12")
    # an extra asked for on a second path to an already found package is still followed
    assert "speedup" in _closure(["opt", "app"], "3.12") and "speedup" in _closure(["app", "opt"], "3.12")


def test_a_needed_package_not_installed_here_is_named_with_who_needs_it():
    graph = {**GRAPH, "lib": ("2.0", ["leaf", "ghost"])}
    with pytest.raises(LookupError, match=r"ghost \(needed by lib\)"):
        _closure(["app"], "3.12", graph)


def test_the_pins_are_this_virtualenvs_closure_less_the_targets_packages_and_its_gpu_build():
    import importlib.metadata as md

    pins = wheelhouse.wheel_pins(HERE, {"mlflow", "pandas"})
    assert pins["hydra-core"] == md.version("hydra-core")
    assert pins["omegaconf"] == md.version("omegaconf")
    assert "antlr4-python3-runtime" in pins  # hydra's parser: an sdist-only package, built into a wheel here
    assert "mlflow-skinny" in pins  # mlflow's own dependency, not listed as had
    assert not {"mlflow", "pandas", "torch", "triton"} & set(pins)
    assert not any(n.startswith("nvidia-") for n in pins)
    everything = wheelhouse.wheel_pins(HERE, set())
    assert {"mlflow", "pandas"} <= set(everything) and set(pins) < set(everything)


def _run(*args, **kw):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, **kw)


def test_the_command_lists_pins_and_refuses_bad_input_in_one_line(tmp_path):
    have = tmp_path / "have.txt"
    have.write_text("# pip list --format=freeze\nmlflow==3.1.0\nPandas\ntorch @ file:///wheels/torch.whl\n")
    listed = _run(str(tmp_path / "whl"), "--python", HERE, "--have", str(have), "--list")
    assert listed.returncode == 0, listed.stderr
    names = {line.split("==")[0] for line in listed.stdout.split()}
    assert "hydra-core" in names and not {"mlflow", "pandas", "torch"} & names
    assert not (tmp_path / "whl").exists()  # --list downloads nothing

    have.write_text("mlflow==3.1.0\nthis is not a package\n")
    bad = _run(str(tmp_path / "whl"), "--python", HERE, "--have", str(have), "--list")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert "have.txt:2" in bad.stderr and "not a package name" in bad.stderr
    python = _run(str(tmp_path / "whl"), "--python", "twelve", "--list")
    assert python.returncode == 2 and "--python takes a CPython version" in python.stderr
    assert python.stderr.count("\n") == 1
    glibc = _run(str(tmp_path / "whl"), "--glibc", "2.5", "--list")
    assert glibc.returncode == 2 and "--glibc takes" in glibc.stderr and glibc.stderr.count("\n") == 1


def _wheel(folder: Path, name: str, version: str, body: str) -> Path:
    """A minimal pure-Python wheel: ``name`` (a module package) with ``VALUE = body``."""
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"VALUE = {body!r}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    out = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(out, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return out


def _use_wheels(folder: Path, tmp_path: Path, then: str) -> subprocess.CompletedProcess:
    script = f'source benchmarks/wheels.sh; use_wheels "{folder}" "{sys.executable}" || exit $?; {then}'
    env = {"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path), "HOME": str(tmp_path)}
    return subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, env=env)


def test_use_wheels_installs_the_folders_wheels_first_on_the_path(tmp_path):
    folder = tmp_path / "whl"
    folder.mkdir()
    _wheel(folder, "flowlm_carried_probe", "0.1", "carried")
    then = f'"{sys.executable}" -c "import flowlm_carried_probe as m; print(m.VALUE)"; echo "$PYTHONPATH"'
    done = _use_wheels(folder, tmp_path, then)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-2] == "carried"
    site = tmp_path / f"flowlm-site-{os.getuid()}"
    assert done.stdout.splitlines()[-1] == f"{site}:{ROOT}"  # the wheels, then the checkout (not installed there)
    assert "1 wheels of" in done.stdout
    assert (site / "flowlm_carried_probe").is_dir()


def test_use_wheels_refuses_a_folder_without_wheels_in_one_line(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    refused = _use_wheels(empty, tmp_path, "echo went on")
    assert refused.returncode == 2 and "went on" not in refused.stdout
    assert refused.stderr.count("\n") == 1 and "holds no .whl file" in refused.stderr
    (empty / "broken-1.0-py3-none-any.whl").write_text("not a zip")
    failed = _use_wheels(empty, tmp_path, "echo went on")
    assert failed.returncode == 1 and "went on" not in failed.stdout and "failed" in failed.stderr


def test_the_target_glibc_bounds_the_wheel_tags():
    tags = wheelhouse.platforms("2.28")
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in tags and "manylinux2014_x86_64" in tags
    assert "manylinux_2_31_x86_64" not in tags
    for bad in ("2.5", "2.x", "3.28"):
        with pytest.raises(ValueError, match="--glibc"):
            wheelhouse.platforms(bad)


class FakePip:
    """subprocess.run for ``pip download`` / ``pip wheel``: packages in ``sdist_only`` have no wheel for the target
    (download fails naming the first of them) and build into ``built_tag`` wheels; ``broken`` fails otherwise."""

    def __init__(self, sdist_only=(), built_tag="py3-none-any", broken=False):
        self.sdist_only, self.built_tag, self.broken, self.calls = list(sdist_only), built_tag, broken, []

    def __call__(self, cmd, **kw):
        verb = cmd[cmd.index("--disable-pip-version-check") + 1]
        specs = [a for a in cmd if "==" in a]
        self.calls.append((verb, specs))
        if verb == "download":
            if self.broken:
                return subprocess.CompletedProcess(cmd, 1, "", "ERROR: HTTP error 503 while getting index\n")
            for spec in specs:
                if spec.split("==")[0] in self.sdist_only:
                    err = f"ERROR: No matching distribution found for {spec}\n"
                    return subprocess.CompletedProcess(cmd, 1, "", err)
            out = Path(cmd[cmd.index("-d") + 1])
            for spec in specs:
                (out / f"{spec.replace('==', '-')}-py3-none-any.whl").write_text("")
            return subprocess.CompletedProcess(cmd, 0, "", "")
        name, version = specs[0].split("==")
        (Path(cmd[cmd.index("-w") + 1]) / f"{name}-{version}-{self.built_tag}.whl").write_text("")
        return subprocess.CompletedProcess(cmd, 0, "", "")


def test_a_package_without_a_wheel_is_built_here_and_the_rest_downloaded_in_one_call(tmp_path, monkeypatch):
    fake = FakePip(sdist_only=["antlr4-python3-runtime"])
    monkeypatch.setattr(wheelhouse.subprocess, "run", fake)
    pins = {"antlr4-python3-runtime": "4.9.3", "hydra-core": "1.3.8", "omegaconf": "2.3.1"}
    built = wheelhouse.download(pins, tmp_path / "w", "3.12", "2.28")
    assert built == ["antlr4-python3-runtime==4.9.3"]
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == [
        "antlr4-python3-runtime-4.9.3-py3-none-any.whl", "hydra-core-1.3.8-py3-none-any.whl",
        "omegaconf-2.3.1-py3-none-any.whl",
    ]  # fmt: skip
    assert [verb for verb, _ in fake.calls] == ["download", "wheel", "download"]
    assert fake.calls[2][1] == ["hydra-core==1.3.8", "omegaconf==2.3.1"]


def test_a_compiled_sdist_or_a_failing_index_is_an_error_not_a_loop(tmp_path, monkeypatch):
    monkeypatch.setattr(
        wheelhouse.subprocess, "run", FakePip(sdist_only=["fastext"], built_tag="cp311-cp311-linux_x86_64")
    )
    with pytest.raises(RuntimeError, match="fastext==1.0: only an sdist with compiled code"):
        wheelhouse.download({"fastext": "1.0", "plain": "2.0"}, tmp_path / "a", "3.12", "2.28")
    fake = FakePip(broken=True)
    monkeypatch.setattr(wheelhouse.subprocess, "run", fake)
    with pytest.raises(RuntimeError, match="pip download failed: ERROR: HTTP error 503"):
        wheelhouse.download({"plain": "2.0"}, tmp_path / "b", "3.12", "2.28")
    assert len(fake.calls) == 1
