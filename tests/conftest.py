"""Test environment: offline Hugging Face, headless matplotlib, runs and caches under a temporary folder, and a
guard that fails a test which writes into the checkout."""

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

# Unit tests use tiny models: one thread avoids OpenMP spin contention on a 2-core machine (measured: a
# 2-layer d=32 step took 2 ms on one thread and 10–500 ms on two while another process was busy).
torch.set_num_threads(1)


def isolate_runs(mp: pytest.MonkeyPatch, root) -> None:
    """FLOWLM_RUNS / FLOWLM_DATA under ``root`` and no inherited MLflow server."""
    mp.setenv("FLOWLM_RUNS", str(root / "runs"))
    mp.setenv("FLOWLM_DATA", str(root / "data"))
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.fixture
def runs_env(tmp_path, monkeypatch):
    """A test-local runs/data folder."""
    isolate_runs(monkeypatch, tmp_path)
    return tmp_path


@contextlib.contextmanager
def module_runs(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[Path]:
    """For a module-scoped fixture: ``isolate_runs`` under a new folder ``name`` (yielded), undone on leaving."""
    root = tmp_path_factory.mktemp(name)
    mp = pytest.MonkeyPatch()
    isolate_runs(mp, root)
    try:
        yield root
    finally:
        mp.undo()


# ------------------------------------------------------------------ nothing is written into the checkout
# A test whose runs or data landed in the checkout (the defaults runs/ and data_cache/) would resume or overwrite
# a user's real run of the same name. Every test gets runs/data folders under its tmp_path unless a fixture chose
# others, and a test after which the checkout holds new, changed or removed files fails, naming them.
_GUARD = pytest.StashKey[dict]()
_UNWATCHED_DIRS = frozenset({".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", ".mypy_cache"})
# Untracked sources a person may be writing while the suite runs (a new test file) are not a test's doing.
_SOURCE_SUFFIXES = (".py", ".md", ".ipynb")


def _tracked_files(root: Path) -> frozenset[str]:
    """Paths that git tracks under ``root`` (relative to it); edits of these are a person's, not a test's."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every file is watched
        return frozenset()
    return frozenset(out.decode().split("\0")) - {""}


def checkout_snapshot(root: Path, tracked: frozenset[str], skip: frozenset[str]) -> dict[str, tuple[int, int] | None]:
    """Every folder (→ None) and untracked file (→ mtime, size) under ``root``, tool caches and ``skip`` aside."""
    found: dict[str, tuple[int, int] | None] = {}
    start = len(str(root)) + 1
    stack = [str(root)]
    while stack:
        try:
            entries = os.scandir(stack.pop())
        except (FileNotFoundError, NotADirectoryError):  # removed since it was listed
            continue
        with entries:
            for entry in entries:
                rel = entry.path[start:]
                if entry.is_dir(follow_symlinks=False):
                    if entry.name not in _UNWATCHED_DIRS and entry.path not in skip:
                        found[rel] = None
                        stack.append(entry.path)
                elif rel not in tracked and not entry.name.endswith(_SOURCE_SUFFIXES):
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    found[rel] = (st.st_mtime_ns, st.st_size)
    return found


def _changes(before: dict, after: dict) -> list[str]:
    """What differs, a new folder standing for everything in it."""
    created = after.keys() - before.keys()
    lines = [f"created {p}" for p in sorted(created) if os.path.dirname(p) not in created]
    lines += [f"removed {p}" for p in sorted(before.keys() - after.keys())]
    lines += [f"modified {p}" for p in sorted(before.keys() & after.keys()) if before[p] != after[p]]
    return lines


def _snapshot(state: dict) -> dict:
    return checkout_snapshot(state["root"], state["tracked"], state["skip"])


def pytest_configure(config: pytest.Config) -> None:
    """Forget inherited runs/data/tracking locations (a user's real ones) and take the checkout's first snapshot."""
    mp = pytest.MonkeyPatch()
    for name in ("FLOWLM_RUNS", "FLOWLM_DATA", "MLFLOW_TRACKING_URI"):
        mp.delenv(name, raising=False)
    # FLOWLM_TEST_CHECKOUT: another folder to guard (the guard's own test runs a session on a scratch folder).
    root = Path(os.environ.get("FLOWLM_TEST_CHECKOUT") or Path(__file__).resolve().parents[1]).resolve()
    temp = [config.option.basetemp, os.environ.get("PYTEST_DEBUG_TEMPROOT"), tempfile.gettempdir()]
    skip = frozenset(str(Path(t).resolve()) for t in temp if t)  # pytest's temporary folders, were they inside
    state = {"mp": mp, "root": root, "tracked": _tracked_files(root), "skip": skip}
    state["last"] = _snapshot(state)
    config.stash[_GUARD] = state


def pytest_unconfigure(config: pytest.Config) -> None:
    """Give back the environment the session started with."""
    state = config.stash.get(_GUARD, None)
    if state is not None:
        state["mp"].undo()


def _release_run_locks() -> None:
    # The test process is a harness, not a launch: a run it trained in-process (a module fixture) must stay open
    # to the `flowlm-train` subprocesses of later tests.
    common = sys.modules.get("runners.common")
    for run_dir in common.held_run_dirs() if common else []:
        common.release_run_dir(run_dir)


@pytest.fixture(autouse=True)
def checkout_guard(request: pytest.FixtureRequest):
    """Runs/data under the test's tmp_path unless a fixture chose a folder; fail if the test changed the checkout."""
    # Subprocesses inherit the redirect; the snapshot catches the rest (a script's default --out, a relative path).
    state = request.config.stash[_GUARD]
    mp = pytest.MonkeyPatch()
    for name, sub in (("FLOWLM_RUNS", "runs"), ("FLOWLM_DATA", "data")):
        if name not in os.environ:
            mp.setenv(name, str(request.getfixturevalue("tmp_path") / sub))
    _release_run_locks()
    yield
    mp.undo()
    _release_run_locks()
    after = _snapshot(state)
    changes, state["last"] = _changes(state["last"], after), after
    if changes:
        shown = "\n  ".join(changes[:20]) + ("\n  ..." if len(changes) > 20 else "")
        pytest.fail(
            f"this test (or a fixture it set up) wrote into the checkout {state['root']}:\n  {shown}\n"
            "Write under tmp_path (runs_env / isolate_runs for runs and data, an --out for scripts).",
            pytrace=False,
        )


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Writes after the last test's check (module and session fixtures' teardown) fail the session."""
    state = session.config.stash.get(_GUARD, None)
    if state is None:
        return
    changes = _changes(state["last"], _snapshot(state))
    if changes:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"the test session wrote into the checkout {state['root']}: " + "; ".join(changes))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# Tiny data and budgets for end-to-end runs of any Sudoku experiment config (9×9 configs keep their layout):
# conf/debug/fast.yaml. SHORT (conf/debug/short.yaml) leaves the data as configured (text experiments).
FAST = ["debug=fast"]
SHORT = ["debug=short"]


def cpu_run(experiment: str, *extra: str) -> list[str]:
    """Overrides of a tiny untracked CPU run of ``experiment`` (FAST, no logger), then ``extra``."""
    return [f"experiment={experiment}", "scale=cpu", *FAST, "logger=none", *extra]


def compose_config(config_name: str = "train", overrides: list[str] | None = None):
    """Compose a config from conf/ exactly as the console scripts would."""
    from hydra import compose, initialize_config_dir

    from flowlm.project import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name=config_name, overrides=overrides or [])


def random_ar_module(*, vocab: int, seq_len: int, seed: int = 0):
    """A 2-block tiny AR model with every weight drawn from N(0, 0.2²) (zero-initialised layers too), in eval mode."""
    from lightning_modules.ar import ARModule

    torch.manual_seed(seed)
    module = ARModule(data_vocab_size=vocab, seq_len=seq_len, backbone={"size": "tiny", "n_layers": 2}, optim={})
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return module.eval()


def gsm8k_datamodule(tmp_path: Path, **options):
    """``GSM8KDataModule`` on the fixture GSM8K problems (training and evaluation), the shipped tiny tokenizer, L = 256
    (every example fits), batch 4, its cache under ``tmp_path``; ``options`` add to or replace these."""
    from fixtures.make_fixtures import HERE, TOKENIZER_DIR

    from datamodules.gsm8k import GSM8KDataModule

    problems = str(HERE / "gsm8k_sample.jsonl")
    args = {
        "train_files": problems,
        "eval_files": problems,
        "tokenizer": str(TOKENIZER_DIR),
        "seq_len": 256,
        "min_response_tokens": 8,
        "cache_dir": tmp_path / "cache",
        "batch_size": 4,
        **options,
    }
    return GSM8KDataModule(**args)


def validating_trainer(**extra):
    """A stand-in for a Lightning trainer in a validation pass on one process (rank 0, not sanity checking), enough
    for SamplingEvaluation's hooks; ``extra`` attributes beside (global_step, loggers, …)."""
    import contextlib
    from types import SimpleNamespace

    from lightning.pytorch.trainer.states import TrainerFn

    return SimpleNamespace(
        precision_plugin=SimpleNamespace(forward_context=contextlib.nullcontext),
        global_rank=0,
        world_size=1,
        is_global_zero=True,
        sanity_checking=False,
        state=SimpleNamespace(fn=TrainerFn.VALIDATING),
        **extra,
    )
