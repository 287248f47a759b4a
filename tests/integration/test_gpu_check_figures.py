"""benchmarks/gpu_check.py keeps its figures through a timeout (issue 51 item 4): the ``--json`` file is rewritten
after every line and every finished section, so a run stopped by gpu_check.sh's ``timeout 600`` (SIGTERM) keeps
what it measured and says where it stopped."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_check import Figures  # noqa: E402  (benchmarks/ is not a package)


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def test_each_line_and_section_is_on_disk_as_soon_as_it_is_made(tmp_path, capsys):
    path = tmp_path / "out" / "gpu_check.json"
    figures = Figures(path)
    assert read(path) == {"status": "running", "sections_done": [], "lines": []}  # the path is checked up front
    figures.log("train mdm eager: 1,000 tokens/s")
    assert read(path)["lines"] == ["train mdm eager: 1,000 tokens/s"] and "train mdm eager" in capsys.readouterr().out
    figures.set(device="CPU", peak_tflops=None)
    figures.section("syncs", {"mdm": 1.0})
    on_disk = read(path)
    assert on_disk["syncs"] == {"mdm": 1.0} and on_disk["sections_done"] == ["syncs"] and on_disk["device"] == "CPU"
    assert on_disk["status"] == "running"
    figures.section("train", {"eager": {"tokens_per_s": 1000.0}})
    figures.finish("stopped: exit 143 (SIGTERM: 143)")
    on_disk = read(path)
    assert on_disk["sections_done"] == ["syncs", "train"] and on_disk["train"]["eager"]["tokens_per_s"] == 1000.0
    assert on_disk["status"].startswith("stopped") and "samplers" not in on_disk
    assert [p.name for p in path.parent.iterdir()] == ["gpu_check.json"]  # no temporary file left behind


def test_without_a_path_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    figures = Figures(None)
    figures.log("a line")
    figures.section("syncs", {})
    figures.finish("done")
    assert list(tmp_path.iterdir()) == [] and figures.lines == ["a line"]


@pytest.mark.slow
def test_a_dry_run_stopped_midway_keeps_the_sections_it_finished(tmp_path):
    """The CPU dry run, sent SIGTERM (what `timeout 600` sends) once its training section is on disk."""
    path = tmp_path / "gpu_check.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--json", str(path)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if path.exists() and "train" in read(path)["sections_done"]:
                break
            time.sleep(0.2)
        assert proc.poll() is None, "the dry run ended before it could be stopped midway"
        partial = read(path)
        assert partial["status"] == "running" and partial["sections_done"][:2] == ["syncs", "train"]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0, out
    stopped = read(path)
    assert stopped["status"].startswith("stopped: exit 143"), stopped["status"]
    assert stopped["sections_done"] in (["syncs", "train"], ["syncs", "train", "softcap"])
    assert stopped["train"]["eager"]["tokens_per_s"] > 0 and stopped["device"] == "CPU"
    assert "samplers" not in stopped and any(line.startswith("train mdm eager") for line in stopped["lines"])
    assert not any(line.startswith("# gpu_check done") for line in stopped["lines"])
