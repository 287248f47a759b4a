"""One process per run folder (a second launch of a running run is refused, naming the holder; the lock dies with its
process), and the test guard that keeps tests from writing into the checkout."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest

from flowlm.project import PROJECT_DIR
from runners.common import (
    LOCK_FILE,
    RUN_CONFIG,
    RunExistsError,
    RunLockedError,
    check_run_dir,
    held_run_dirs,
    lock_run_dir,
    release_run_dir,
    write_run_config,
)
from tests.conftest import FAST, compose_config
from tests.process_helpers import wait_for_flag

pytest_plugins = ["pytester"]

BIN = Path(sys.executable).parent
RUN = [
    "experiment=sudoku_mdm_uncond",
    "scale=cpu",
    *FAST,
    "logger=none",
    "eval.nfe=[2]",
    "trainer.enable_progress_bar=false",
]
# A process that takes the lock exactly as flowlm-train does, says so, and waits to be killed.
HOLD = (
    "import sys, time; from runners.common import lock_run_dir; "
    "lock_run_dir(sys.argv[1]); print('locked', flush=True); time.sleep(600)"
)


def _env() -> dict[str, str]:
    """The test's runs/data folders (inherited) and `tests.*` importable in a subprocess, one thread."""
    return {**os.environ, "PYTHONPATH": str(PROJECT_DIR), "OMP_NUM_THREADS": "1"}


@pytest.fixture
def holder():
    """Start processes that hold a run folder's lock (the folder is made); all are killed at the end."""
    procs: list[subprocess.Popen] = []

    def start(run_dir: Path) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(run_dir)], env=_env(), stdout=subprocess.PIPE, text=True, cwd=PROJECT_DIR
        )
        procs.append(proc)
        assert proc.stdout.readline().strip() == "locked", proc.communicate(timeout=60)
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait(timeout=60)


def _run_dir(cfg) -> Path:
    return Path(cfg.paths.run_dir).resolve()


def test_a_running_run_is_refused_before_compute_naming_its_holder(runs_env, holder):
    from runners.train import train

    cfg = compose_config(overrides=RUN)
    run_dir = _run_dir(cfg)
    proc = holder(run_dir)
    with pytest.raises(RunLockedError) as err:
        train(cfg)
    message = str(err.value)
    assert f"pid {proc.pid} on {socket.gethostname()}" in message, message
    assert "command: -c" in message and str(run_dir) in message and "started 20" in message, message
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE]  # nothing read or written but the lock
    assert not (runs_env / "data").exists()  # refused before the data were even generated
    assert run_dir not in held_run_dirs()


def test_a_run_begun_by_another_launch_after_the_check_is_refused_at_its_first_write(runs_env, holder):
    cfg = compose_config(overrides=RUN)
    run_dir = _run_dir(cfg)
    assert check_run_dir(cfg) is None  # no folder yet: a fresh run, locked when its folder is made
    proc = holder(run_dir)  # another launch makes the folder meanwhile
    with pytest.raises(RunLockedError, match=f"pid {proc.pid} "):
        write_run_config(cfg)
    proc.kill()
    proc.wait(timeout=60)
    (run_dir / RUN_CONFIG).write_text("name: other\n")  # what it wrote before it ended, a checkpoint too
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"")
    with pytest.raises(RunExistsError, match="started by another launch.*relaunch to resume"):
        write_run_config(cfg)
    assert (run_dir / RUN_CONFIG).read_text() == "name: other\n"


def test_the_lock_ends_with_a_sigkilled_holder(runs_env, holder):
    run_dir = runs_env / "runs" / "killed" / "seed0"
    proc = holder(run_dir)
    with pytest.raises(RunLockedError):
        lock_run_dir(run_dir)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert (run_dir / LOCK_FILE).exists()  # the file stays; its lock went with the process
    assert lock_run_dir(run_dir) is True
    assert f'"pid": {os.getpid()}' in (run_dir / LOCK_FILE).read_text()  # the new holder recorded itself


def test_two_runs_lock_independently_and_a_process_may_retake_its_own(runs_env, holder):
    one, two = runs_env / "runs" / "exp" / "seed0", runs_env / "runs" / "exp" / "seed1"
    holder(one)
    assert lock_run_dir(two) is True
    assert lock_run_dir(two) is False  # held already by this process (an in-process resume)
    with pytest.raises(RunLockedError):
        lock_run_dir(one)
    release_run_dir(two)
    assert two.resolve() not in held_run_dirs()
    holder(two)  # released: another process takes it


def test_a_finished_task_releases_its_run_folder(runs_env, holder):
    """run_trial (each console script's task, one sweep trial) drops the lock when the task ends, so a launcher
    that runs trial after trial in one process holds none of the finished ones."""
    from runners.trial import run_trial

    cfg = compose_config(overrides=RUN)
    run_dir = _run_dir(cfg)

    def task(cfg) -> dict:
        lock_run_dir(cfg.paths.run_dir)
        return {"rows": []}

    assert run_trial(task, cfg) is None
    assert run_dir not in held_run_dirs()
    holder(run_dir)


class PauseAt(L.Callback):
    """Touch ``flag`` at optimizer step ``step`` (a checkpoint is on disk by then) and wait there to be killed."""

    def __init__(self, step: int, flag: str) -> None:
        self.step, self.flag = step, Path(flag)

    def on_train_batch_end(self, trainer: L.Trainer, *args, **kwargs) -> None:  # noqa: D102
        if trainer.global_step == self.step:
            self.flag.touch()
            time.sleep(600)


class StartStep(L.Callback):
    """Write the step that training starts from (0 for a fresh run, the checkpoint's step for a resume)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_start(self, trainer: L.Trainer, *args, **kwargs) -> None:  # noqa: D102
        self.path.write_text(str(trainer.global_step))


@pytest.mark.slow
def test_a_second_flowlm_train_is_refused_and_the_relaunch_after_a_sigkill_resumes(runs_env):
    from runners.train import train

    flag = runs_env / "paused"
    pause = ["+callbacks.pause._target_=tests.runners.test_run_lock.PauseAt", "+callbacks.pause.step=3"]
    cmd = [str(BIN / "flowlm-train"), *RUN, "trainer.max_steps=4"]
    first = subprocess.Popen(
        [*cmd, *pause, f"+callbacks.pause.flag={flag}"],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=PROJECT_DIR,
    )
    run_dir = runs_env / "runs" / "sudoku_mdm_uncond" / "cpu" / "seed0"
    last = run_dir / "checkpoints" / "last.ckpt"
    try:
        wait_for_flag(first, flag, timeout_s=300, poll_s=0.2, never="the first launch never reached step 3")
        saved = last.stat().st_mtime_ns
        second = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300, cwd=PROJECT_DIR)
        out = second.stdout + second.stderr
        assert second.returncode != 0, out[-4000:]
        assert "is being trained by another process" in out and f"pid {first.pid} on {socket.gethostname()}" in out
        assert "flowlm-train" in out and "Restoring states" not in out, out[-4000:]  # refused before any compute
        assert last.stat().st_mtime_ns == saved and first.poll() is None  # the first run goes on untouched
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    finally:
        first.kill()
        first.communicate()
    start = runs_env / "start"
    relaunch = compose_config(
        overrides=[*RUN, "trainer.max_steps=4", "+callbacks.start._target_=tests.runners.test_run_lock.StartStep"]
        + [f"+callbacks.start.path={start}"]
    )
    assert train(relaunch)["global_step"] == 4
    assert start.read_text() == "2"  # resumed from the step-2 checkpoint the killed launch left


# ------------------------------------------------------------------ the checkout guard (tests/conftest.py)
INNER = """
import os
from pathlib import Path


def test_writes_runs_into_the_checkout():
    out = Path(os.environ["FLOWLM_TEST_CHECKOUT"]) / "runs" / "x"
    out.mkdir(parents=True)
    (out / "last.ckpt").write_bytes(b"")


def test_runs_and_data_default_to_its_tmp_path(tmp_path):
    assert os.environ["FLOWLM_RUNS"] == str(tmp_path / "runs")
    assert os.environ["FLOWLM_DATA"] == str(tmp_path / "data")
    Path(os.environ["FLOWLM_RUNS"], "y").mkdir(parents=True)


def test_writes_nothing():
    pass
"""


def test_a_test_that_writes_into_the_checkout_fails(pytester, monkeypatch):
    """A session of the suite's conftest, guarding a scratch checkout: the writing test fails and is named, its
    neighbours pass, and forgotten runs/data folders land in each test's tmp_path."""
    monkeypatch.setenv("FLOWLM_TEST_CHECKOUT", str(pytester.path))
    monkeypatch.setenv("FLOWLM_RUNS", str(pytester.path / "runs"))  # inherited values are not kept
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest("-p", "tests.conftest", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(
        ["*ERROR at teardown of test_writes_runs_into_the_checkout*", "*wrote into the checkout*", "*created runs*"]
    )
    assert os.environ["FLOWLM_RUNS"] == str(pytester.path / "runs")  # the inner session restored the environment


def test_a_module_fixture_that_writes_into_the_checkout_at_teardown_fails_the_session(pytester, monkeypatch):
    monkeypatch.setenv("FLOWLM_TEST_CHECKOUT", str(pytester.path))
    pytester.makepyfile(
        test_inner="""
import os
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def leaves_a_file():
    yield
    Path(os.environ["FLOWLM_TEST_CHECKOUT"], "mlflow.db").write_bytes(b"")


def test_uses_it(leaves_a_file):
    pass
"""
    )
    result = pytester.runpytest("-p", "tests.conftest", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*the test session wrote into the checkout*created mlflow.db*"])
