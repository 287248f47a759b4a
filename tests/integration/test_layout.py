"""The layout the house rules ask for: the core package imports neither Lightning nor Hydra, and the suite's own
modules import each other without a cycle (imports inside functions included: a lazy import hides a cycle from
the interpreter, not from a reader)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = "flowlm"
PACKAGES = (CORE, "runners", "sweeps", "callbacks", "lightning_modules", "datamodules", "analysis")
FRAMEWORKS = ("lightning", "pytorch_lightning", "hydra", "omegaconf")


def module_files(packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name → file, for every ``.py`` file of the given top-level packages."""
    out = {}
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imported_names(path: Path, module: str) -> list[str]:
    """Every name ``path`` imports, anywhere in the file, spelled in full (``from a import b`` gives ``a.b``)."""
    is_package = path.name == "__init__.py"
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package, one level up per extra dot
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names += [f"{source}.{alias.name}" for alias in node.names]
    return names


def import_graph(packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """Module → the suite's modules it imports (``from a import f``, f not a module: the edge goes to ``a``)."""
    files = module_files(packages)
    graph = {}
    for module, path in files.items():
        edges = set()
        for name in imported_names(path, module):
            if name in files:
                edges.add(name)
            elif name.rpartition(".")[0] in files:
                edges.add(name.rpartition(".")[0])
        edges.discard(module)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted; empty when acyclic."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_no_import_cycles():
    """No two of the suite's modules import each other, directly or through others."""
    graph = import_graph()
    assert len(graph) > 50, "the walk found too few modules: is ROOT the checkout?"
    found = cycles(graph)
    described = [" ↔ ".join(c) + " (" + "; ".join(f"{m} → {sorted(graph[m] & set(c))}" for m in c) + ")" for c in found]
    assert not found, "import cycles:\n" + "\n".join(described)


def test_cycle_finder_sees_a_cycle():
    """The check itself: a three-module ring and a pair are found, a chain is not."""
    ring = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d", "a"}, "f": {"a"}}
    assert cycles(ring) == [["a", "b", "c"], ["d", "e"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_core_imports_no_framework():
    """No file under flowlm/ imports Lightning, Hydra or OmegaConf, nor the suite's framework-side packages."""
    banned = FRAMEWORKS + tuple(p for p in PACKAGES if p != CORE)
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}"
        for module, path in module_files((CORE,)).items()
        for name in imported_names(path, module)
        if name.split(".")[0] in banned
    ]
    assert not offenders, "\n".join(offenders)


def test_leaf_modules_import_nothing_of_the_suite():
    """The project folder, the git commit and the experiment kind sit in leaves that anything may import."""
    graph = import_graph()
    for leaf in ("flowlm.project", "flowlm.experiment_kind"):
        assert graph[leaf] == set(), f"{leaf} imports {sorted(graph[leaf])}"


def test_the_floors_contract_holds():
    """import-linter's contracts in pyproject.toml (the README's floors): no import runs back up a floor, the
    siblings on a floor do not import each other, and the report reads the core only."""
    import subprocess
    import sys

    linter = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(linter), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "2 kept, 0 broken" in proc.stdout


def test_the_floors_contract_sees_an_import_back_up(tmp_path):
    """The check itself: the same contracts over a copy with one import from flowlm/ up into runners/ break."""
    import shutil
    import subprocess
    import sys

    for name in ("pyproject.toml", *(p for p in PACKAGES)):
        src = ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / name)
    target = tmp_path / "flowlm" / "project.py"
    target.write_text(target.read_text() + "\nimport runners.trial  # noqa\n")
    linter = Path(sys.executable).with_name("lint-imports")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([str(linter), "--no-cache"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert proc.returncode != 0 and "flowlm.project -> runners.trial" in proc.stdout, proc.stdout[-3000:]


def test_every_method_module_has_the_one_shape():
    """Each LightningModule of a method names its family and table label and gives the two hooks (``draw``,
    ``loss``); none writes its own training or validation step (``FlowLMModule`` runs and logs them), and the
    FMLM+ module stays within its room (its model view and recipe live in flowlm/)."""
    import inspect

    from lightning_modules.ar import ARModule
    from lightning_modules.base import FlowLMModule
    from lightning_modules.fmlm_plus import FMLMPlusModule
    from lightning_modules.mdm import MDMModule
    from lightning_modules.mlfm import MLFMModule

    modules = (ARModule, FMLMPlusModule, MDMModule, MLFMModule)
    assert {cls.label for cls in modules} == {"AR", "FMLM+", "MDM", "MLFM"}
    assert len({cls.family for cls in modules}) == 4
    for cls in modules:
        assert not inspect.isabstract(cls), cls
        for hook in ("draw", "loss"):
            assert hook in vars(cls), (cls, hook)
        for step in ("training_step", "validation_step"):
            assert getattr(cls, step) is getattr(FlowLMModule, step), (cls, step)
    assert len((ROOT / "lightning_modules" / "fmlm_plus.py").read_text().splitlines()) <= 250
