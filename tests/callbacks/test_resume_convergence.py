"""A run with ``callbacks.convergence.stop=true`` that crashes and is relaunched stops where the uninterrupted run
stops, with the same convergence history and the same weights: the checkpoint of a step that is validated is
written after that validation (callbacks/checkpoint.py), so the point is in the checkpoint and the resumed loop
neither repeats nor skips it."""

import json
from pathlib import Path

import pytest
import torch
from conftest import FAST, compose_config, isolate_runs
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn

from callbacks.convergence import CONVERGENCE_FILE
from runners.train import train

# 24 training puzzles in batches of 8: 3 steps an epoch. A validation and a checkpoint every 2 steps (debug=fast).
# The lax rule (any gain < 1000 % counts) converges at the 4th validation, whatever the losses: step 8 of at most 16.
# A resume that lost a validation point stops one validation later (step 10).
RUN = [
    "experiment=sudoku_mdm_easy",
    "scale=cpu",
    *FAST,
    "logger=none",
    "eval.nfe=[1]",
    "trainer.max_steps=16",
    "trainer.enable_progress_bar=false",
    "callbacks.convergence.stop=true",
    "callbacks.convergence.min_evals=4",
    "callbacks.convergence.rel_tol=10",
]
STOP = 8


class Crash(RuntimeError):
    """The simulated crash."""


class StepTrace(Callback):
    """Records, in a JSON file, the optimizer step after every training batch and at every validation of the fit;
    with ``crash_after``, raises ``Crash`` once that step has trained (before any checkpoint of it)."""

    def __init__(self, path: str, crash_after: int | None = None) -> None:
        self.path, self.crash_after = Path(path), crash_after
        self.events: list[list] = []

    def _add(self, kind: str, step: int) -> None:
        self.events.append([kind, step])
        self.path.write_text(json.dumps(self.events))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: D102
        self._add("train", trainer.global_step)
        if trainer.global_step == self.crash_after:
            raise Crash(f"crash after step {trainer.global_step}")

    def on_validation_end(self, trainer, pl_module) -> None:  # noqa: D102
        if trainer.state.fn == TrainerFn.FITTING:
            self._add("val", trainer.global_step)


def launch(root: Path, name: str, crash_after: int | None = None) -> tuple[dict, list]:
    """Train (or resume) run ``name`` under ``root``; its result and the launch's (kind, step) events."""
    trace = root / f"{name}-{crash_after}.json"
    target = f"{__name__}.{StepTrace.__name__}"
    hooks = [f"+callbacks.trace._target_={target}", f"+callbacks.trace.path={trace}"]
    if crash_after is not None:
        hooks.append(f"+callbacks.trace.crash_after={crash_after}")
    result = None
    try:
        result = train(compose_config(overrides=[*RUN, f"run_name={name}", *hooks]))
    except Crash:
        assert crash_after is not None
    return result, [tuple(e) for e in json.loads(trace.read_text())]


def saved(root: Path, name: str) -> tuple[dict, list]:
    """A run's last.ckpt and the convergence history saved in it."""
    ckpt = torch.load(root / "runs" / "sudoku_mdm_easy" / name / "checkpoints" / "last.ckpt", weights_only=False)
    (state,) = (v for k, v in ckpt["callbacks"].items() if k.startswith("Convergence"))
    return ckpt, state["history"]


def record(root: Path, name: str) -> dict:
    """A run's convergence.json without the wall time."""
    facts = json.loads((root / "runs" / "sudoku_mdm_easy" / name / CONVERGENCE_FILE).read_text())
    return {k: v for k, v in facts.items() if k != "wall_s"}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run (its folder holds the data the crashed runs share)."""
    root = tmp_path_factory.mktemp("resume_convergence")
    mp = pytest.MonkeyPatch()
    isolate_runs(mp, root)
    result, events = launch(root, "straight")
    yield root, result, events
    mp.undo()


@pytest.mark.parametrize("crash_after", [5, 7], ids=["mid-epoch", "after-an-epoch-end-checkpoint"])
def test_a_crashed_and_resumed_run_stops_like_the_uninterrupted_one(straight, crash_after):
    """Crash after step 5 (last checkpoint: step 4, an epoch's first batch) or 7 (step 6, an epoch's last batch)."""
    root, result, events = straight
    name = f"crash{crash_after}"
    _, first = launch(root, name, crash_after)
    survived, kept = saved(root, name)  # what the crash left, read before the relaunch replaces it
    resumed, second = launch(root, name)

    # The uninterrupted run: every step trained once, every second one validated once, stopped at the 4th.
    assert result["global_step"] == STOP
    assert events == [e for s in range(1, STOP + 1) for e in [("train", s), ("val", s)][: 2 - s % 2]]
    checkpointed = crash_after - 1
    assert first[-1] == ("train", crash_after) and survived["global_step"] == checkpointed
    # The relaunch stops at the same step. It redid the lost step and went on: no validation repeated or skipped,
    # no batch skipped.
    assert resumed["global_step"] == STOP
    assert second == [e for e in events if e[1] > checkpointed]
    ckpt, history = saved(root, "straight")
    after, resumed_history = saved(root, name)
    assert [s for s, _ in history] == [2, 4, 6, 8]  # last.ckpt holds the point of its own step ...
    assert kept == history[: checkpointed // 2]  # ... and so did the checkpoint the crash left
    assert resumed_history == history  # the same steps and, to the bit, the same val losses
    assert record(root, name) == record(root, "straight")
    # Bitwise: per-step seeded draws, a resumable data order and one thread's deterministic CPU kernels make the
    # relaunch recompute exactly the uninterrupted run's steps (tests/integration/test_equivalence.py: the same
    # after SIGKILL).
    assert after["global_step"] == ckpt["global_step"] == STOP
    for part in ("state_dict", "current_model_state"):  # EMA and live weights
        assert after[part].keys() == ckpt[part].keys()
        for key, value in ckpt[part].items():
            assert torch.equal(after[part][key], value), (part, key)
