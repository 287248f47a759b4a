"""SIGTERM stops a sampler before its next network call (issue 39): Lightning looks for SIGTERM only between batches,
and one batch of a large budget samples for minutes (flowlm/samplers/interrupt.py, runners/common.py)."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowlm.samplers import AncestralSampler
from flowlm.samplers.base import BUDGET_PER_POSITION, MaskedDenoiser
from flowlm.samplers.interrupt import interruptible, stop_check
from runners.common import SIGTERM_STATUS
from runners.train import train
from tests.conftest import compose_config, module_runs
from tests.process_helpers import launch_until_flag
from tests.runners.test_bad_input_round3 import CELLS, RUN

BIN = Path(sys.executable).parent
SECONDS_PER_CALL = 0.25  # 576 calls (the cap of a 6×6 board): 2.4 minutes of sampling in one batch


class SlowAncestral(AncestralSampler):
    """The ancestral sampler on a network that takes ``seconds`` per call (a large model's pace); it touches ``flag``
    when it starts sampling. For a `flowlm-eval` subprocess (``PYTHONPATH`` = the repository root)."""

    def __init__(self, *, flag: str, seconds: float, **options) -> None:
        super().__init__(**options)
        self.flag, self.seconds = Path(flag), seconds

    def sample(self, model, prompt, prompt_mask, steps, generator):  # noqa: D102
        fn = model.fn

        def slow(*args, **kwargs):
            time.sleep(self.seconds)
            return fn(*args, **kwargs)

        self.flag.touch()
        return super().sample(dataclasses.replace(model, fn=slow), prompt, prompt_mask, steps, generator)


@pytest.fixture(scope="module")
def step2_ckpt(tmp_path_factory) -> Path:
    with module_runs(tmp_path_factory, "trained"):
        result = train(compose_config(overrides=[*RUN, "logger=none"]))
    return Path(result["run_dir"]) / "checkpoints" / "last.ckpt"


@pytest.mark.slow
def test_sigterm_stops_an_evaluation_inside_a_long_sampling_loop_with_status_143(step2_ckpt, runs_env):
    flag = runs_env / "sampling"
    budget = BUDGET_PER_POSITION * CELLS
    sampler = "eval.samplers.ancestral"
    cmd = [
        str(BIN / "flowlm-eval"),
        f"ckpt_path={step2_ckpt}",
        f"eval.nfe=[{budget}]",
        "eval.max_batches=1",
        "logger=none",
        "trainer.enable_progress_bar=false",
        "~eval.samplers.confidence",
        f"{sampler}._target_=tests.runners.test_sigterm_in_sampling.SlowAncestral",
        f"{sampler}.cache=false",  # a network call at every one of the budget's steps
        f"+{sampler}.flag={flag}",
        f"+{sampler}.seconds={SECONDS_PER_CALL}",
    ]
    proc = launch_until_flag(cmd, runs_env, flag, never="the evaluation never started sampling")
    try:
        time.sleep(1.0)  # a few network calls into the loop
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            out = proc.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            out = None
        stopped_after = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # was: the loop ran on to the end of the batch (budget × SECONDS_PER_CALL = 144 s)
    assert out is not None, f"still sampling {stopped_after:.0f} s after SIGTERM"
    assert proc.returncode == SIGTERM_STATUS, out[-4000:]
    assert "stopped by SIGTERM" in out, out[-4000:]


def test_an_interruptible_view_calls_the_active_check_before_each_network_call():
    calls: list[str] = []
    view = MaskedDenoiser(fn=lambda x, t: calls.append("network") or x, mask_id=0)
    checked = interruptible(view)
    checked.fn(1, 0)  # no check active: the network only
    with stop_check(lambda: calls.append("check")):
        checked.fn(1, 0)
    checked.fn(1, 0)  # the check is gone with its block
    assert calls == ["network", "check", "network", "network"]
    assert interruptible(checked).fn is checked.fn  # wrapped once, however often a sampler passes it on
