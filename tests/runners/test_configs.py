"""The config tree's own rules: a derived experiment states its source in its own file (scripts/tables_campaign.sh
reads that line) and the Sudoku tables sweep trains every source before the runs built on it; an experiment
evaluates at its method family's budgets; the CPU scale reads its data from data/cpu/, not from tests/; and
scripts/dump_configs.py, the equivalence check of a refactor of conf/, runs."""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import compose_config
from omegaconf import OmegaConf

import runners  # noqa: F401  (registers the ${flowlm.*} resolvers the configs use)
from flowlm.project import CONF_DIR, PROJECT_DIR

CONF = Path(CONF_DIR)
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
# scripts/tables_campaign.sh's source_of: the `source:` line of the experiment's own file.
SOURCE_LINE = re.compile(r"^source: *([A-Za-z0-9_]*)", re.M)
# Experiments whose eval.nfe is not their scale's budgets of their method family, and why.
OWN_BUDGETS = {
    "owt_ar": "one NFE per token",
    "tinystories_ar": "one NFE per token",
    "tinygsm_ar": "one NFE per token",
    "gsm8k_ar": "one NFE per token",
    "owt_mlfm_mdlm": "the MDM's budgets (no OWT MLFM protocol)",
    "demo_mdm": "the demo's budgets",
    "demo_fmlm_plus": "the demo's budgets",
}


@functools.cache
def composed(experiment: str, scale: str):
    return compose_config(overrides=[f"experiment={experiment}", f"scale={scale}"])


def source_line(experiment: str) -> str | None:
    found = SOURCE_LINE.search((CONF / "experiment" / f"{experiment}.yaml").read_text())
    return found.group(1) if found and found.group(1) not in ("", "null") else None


def swept(search: str) -> list[str]:
    listed = OmegaConf.load(CONF / "hparams_search" / f"{search}.yaml").hydra.sweeper.params.experiment
    return [e.strip() for e in listed.split(",")]


@pytest.mark.parametrize("search", ["sudoku_tables", "sudoku_tables_quick"])
def test_the_tables_sweep_trains_each_source_first(search):
    """Hydra's basic sweeper runs the jobs in the order of `experiment`: an MDM before every run initialised from,
    distilled from or adapted from it (their `source`), which reads its checkpoint."""
    order = swept(search)
    for i, experiment in enumerate(order):
        source = composed(experiment, "cpu").source
        assert source == source_line(experiment), f"{experiment}: its file must state `source: {source}` itself"
        if source is not None:
            assert source in order[:i], f"{search}: {experiment} runs before its source {source}"


def test_every_experiment_states_its_source_in_its_own_file():
    """The campaign script decides from an experiment file's own `source:` line whether a model is needed later:
    a source inherited from a parent experiment would be invisible to it."""
    for experiment in EXPERIMENTS:
        assert composed(experiment, "cpu").source == source_line(experiment), experiment


@pytest.mark.slow
@pytest.mark.parametrize("scale", ["paper", "cpu"])
def test_an_experiment_evaluates_at_its_familys_budgets(scale):
    """eval.nfe is written once per task (`${scale.budgets.${family}}`), not per experiment; the exceptions say why."""
    for experiment in EXPERIMENTS:
        cfg = composed(experiment, scale)
        nfe = OmegaConf.to_container(cfg.eval.nfe, resolve=True)
        if experiment not in OWN_BUDGETS:
            assert nfe == OmegaConf.to_container(cfg.scale.budgets, resolve=True)[cfg.family], experiment


def test_the_cpu_scale_reads_data_cpu_not_tests():
    """The CPU scale's data, tokenizers, evaluator and tiny pretrained MDMs live in data/cpu/ (tests/fixtures/ holds
    the code that writes them); every path conf/ names there exists."""
    named = set()
    for path in CONF.rglob("*.yaml"):
        for line in path.read_text(encoding="utf-8").splitlines():
            value = line.split(" #", 1)[0] if not line.lstrip().startswith("#") else ""
            assert "tests/" not in value, f"{path.relative_to(CONF)}: {line.strip()}"
            named.update(re.findall(r"data/cpu/[\w./-]+", value))
    assert len(named) >= 8, named
    missing = sorted(p for p in named if not (PROJECT_DIR / p).exists())
    assert not missing, f"conf/ names files that data/cpu/ lacks: {missing}"


@pytest.mark.slow
def test_dump_configs_dumps_and_diffs(tmp_path):
    """scripts/dump_configs.py composes and resolves (a few of) the combinations; a dump diffs clean against itself
    and a changed value is reported."""
    script = str(PROJECT_DIR / "scripts" / "dump_configs.py")
    dump = subprocess.run(
        [sys.executable, script, "dump", str(tmp_path / "a"), "--only", "demo"], capture_output=True, text=True
    )
    assert dump.returncode == 0, dump.stderr
    files = sorted((tmp_path / "a").glob("*.json"))
    assert "demo.json" in {f.name for f in files} and len(files) >= 4
    record = json.loads((tmp_path / "a" / "train__experiment=demo_fmlm_plus__scale=cpu.json").read_text())
    assert record["config"]["method"]["init_from"] == "runs/demo_mdm/cpu/seed0/checkpoints/last.ckpt"
    assert record["config"]["trainer"]["precision"] == "${flowlm.cpu_precision:}"  # a runtime value: as written
    assert record["hydra"]["choices"]["family"] == "flow"
    same = subprocess.run([sys.executable, script, "diff", str(tmp_path / "a"), str(tmp_path / "a")])
    assert same.returncode == 0
    (tmp_path / "b").mkdir()
    for f in files:
        (tmp_path / "b" / f.name).write_text(f.read_text().replace('"max_steps": 300', '"max_steps": 301'))
    changed = subprocess.run(
        [sys.executable, script, "diff", str(tmp_path / "a"), str(tmp_path / "b")], capture_output=True, text=True
    )
    assert changed.returncode == 1 and "config.trainer.max_steps: 300 → 301" in changed.stdout
