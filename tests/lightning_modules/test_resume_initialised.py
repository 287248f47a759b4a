"""An MDM-initialised run that crashes and is relaunched goes on from its own weights: the copy from the MDM is made
once, at the start of a fresh run. Lightning calls ``on_fit_start`` after it has loaded a resumed run's weights and
before it restores the step counter, so a guard on ``global_step == 0`` copied the MDM over the resumed weights at
every relaunch (the campaign's easy FMLM+ of seed 1: val loss 0.057 at step 500, 0.147 at the first validation after
its resume, as at step 100)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import FAST, compose_config, isolate_runs

from runners.train import train
from tests.callbacks.test_resume_convergence import Crash

COMMON = [*FAST, "scale=cpu", "logger=none", "eval.nfe=[1]", "trainer.enable_progress_bar=false"]
# FMLM+ from the MDM, 6 steps; a validation and a checkpoint every 2 (debug=fast); the crash after step 5 loses it
INIT = ["experiment=sudoku_fmlm_plus_init_easy", *COMMON, "eval.samplers.pr.rounds=1", "trainer.max_steps=6"]
SOURCE_STEPS = 4


def _launch(name: str, crash_after: int | None = None) -> dict | None:
    hooks = []
    if crash_after is not None:
        target = "tests.callbacks.test_resume_convergence.StepTrace"
        hooks = [f"+callbacks.trace._target_={target}", f"+callbacks.trace.path={name}.json"]
        hooks.append(f"+callbacks.trace.crash_after={crash_after}")
    try:
        return train(compose_config(overrides=[*INIT, f"run_name={name}", *hooks]))
    except Crash:
        return None


def _weights(root: Path, name: str) -> dict:
    ckpt = torch.load(
        root / "runs" / "sudoku_fmlm_plus_init_easy" / name / "checkpoints" / "last.ckpt", weights_only=False
    )
    return {"step": ckpt["global_step"], "ema": ckpt["state_dict"], "live": ckpt["current_model_state"]}


@pytest.mark.slow
def test_a_resumed_initialised_run_goes_on_from_its_own_weights(tmp_path, monkeypatch):
    isolate_runs(monkeypatch, tmp_path)
    monkeypatch.chdir(tmp_path)  # the trace files
    source = train(
        compose_config(overrides=["experiment=sudoku_mdm_easy", *COMMON, f"trainer.max_steps={SOURCE_STEPS}"])
    )
    assert source["global_step"] == SOURCE_STEPS
    straight = _launch("straight")
    assert straight["global_step"] == 6
    assert _launch("crashed", crash_after=5) is None
    assert _weights(tmp_path, "crashed")["step"] == 4
    resumed = _launch("crashed")
    assert resumed["global_step"] == 6
    a, b = _weights(tmp_path, "straight"), _weights(tmp_path, "crashed")
    for part in ("ema", "live"):
        assert a[part].keys() == b[part].keys()
        for key, value in a[part].items():
            assert torch.equal(value, b[part][key]), (part, key)


def test_a_strategy_that_restores_after_setup_is_told_by_the_runner():
    """Under FSDP2 or DeepSpeed Lightning restores the checkpoint after ``on_fit_start``, so ``trainer.ckpt_path`` is
    still None there: the runner's ``resuming_from`` decides (the copy would be overwritten by the restore, but
    reported and logged as an initialisation of a resumed run)."""
    from types import SimpleNamespace

    from lightning_modules.base import FlowLMModule

    trainer = SimpleNamespace(ckpt_path=None)
    module = SimpleNamespace(resuming_from=None, _trainer=trainer, trainer=trainer)
    assert FlowLMModule.starts_fresh(module)
    module.resuming_from = "runs/x/checkpoints/last.ckpt"
    assert not FlowLMModule.starts_fresh(module)
    module.resuming_from, trainer.ckpt_path = None, "runs/x/checkpoints/last.ckpt"  # one device, DDP
    assert not FlowLMModule.starts_fresh(module)
