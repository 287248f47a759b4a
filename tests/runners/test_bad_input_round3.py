"""Bad input refused before compute and stops reported as such (issue 39): SIGTERM ends a training or an evaluation
with status 143, NFE budgets must be integers ≥ 1 under a cap, run names are single safe folder names, and
`flowlm-eval` reports the checkpoint's step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from mlflow import MlflowClient
from omegaconf import OmegaConf

from flowlm.samplers import AncestralSampler, ConfidenceSampler
from flowlm.samplers.base import BUDGET_PER_POSITION
from lightning_modules.checkpoints import verify_checkpoint
from runners.common import SIGTERM_STATUS, check_run_name
from runners.evaluate import evaluate
from runners.train import train
from tests.conftest import FAST, compose_config, module_runs
from tests.process_helpers import launch_until_flag, subprocess_env
from tests.samplers.test_sampler_contract import FREE, SAMPLER_YAMLS, Counted, _run, _sampler

BIN = Path(sys.executable).parent
RUN = ["experiment=sudoku_mdm_uncond", "scale=cpu", *FAST, "eval.nfe=[2]"]  # 6×6 unconditional: 36 cells
CELLS = 36


def _mlflow_runs(root: Path) -> list:
    client = MlflowClient(f"sqlite:///{root / 'runs' / 'mlflow.db'}")
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


def _eval(ckpt: Path, *overrides: str):
    return evaluate(compose_config("eval", [f"ckpt_path={ckpt}", "eval.nfe=[2]", "eval.max_batches=1", *overrides]))


@pytest.fixture(scope="module")
def step2_ckpt(tmp_path_factory) -> Path:
    """last.ckpt of a 2-step run (its own runs folder)."""
    with module_runs(tmp_path_factory, "trained"):
        result = train(compose_config(overrides=[*RUN, "logger=none"]))
    assert result["global_step"] == 2
    return Path(result["run_dir"]) / "checkpoints" / "last.ckpt"


# ------------------------------------------------------------------ SIGTERM: exit status 143
class PauseUntilSigterm(L.Callback):
    """For a `flowlm-train` subprocess: at optimizer step ``step``, touch ``flag`` and wait (at most ``seconds``) for
    SIGTERM; Lightning's handler only records it, and the training loop stops at its next check."""

    def __init__(self, step: int, flag: str, seconds: float = 120.0) -> None:
        self.step, self.flag, self.seconds = step, Path(flag), seconds

    def on_train_batch_end(self, trainer: L.Trainer, *args, **kwargs) -> None:  # noqa: D102
        if trainer.global_step == self.step:
            self.flag.touch()
            deadline = time.monotonic() + self.seconds
            while not trainer.received_sigterm and time.monotonic() < deadline:
                time.sleep(0.05)


@pytest.mark.slow
def test_sigterm_ends_a_training_with_status_143_and_keeps_its_checkpoint(runs_env):
    flag = runs_env / "paused"
    cmd = [
        str(BIN / "flowlm-train"),
        *RUN,
        "data.num_train=64",  # 8 batches an epoch: step 3 is mid-epoch
        "trainer.max_steps=6",
        "trainer.enable_progress_bar=false",  # checkpoints at steps 2 and 4; stopped at step 3
        "+callbacks.pause._target_=tests.runners.test_bad_input_round3.PauseUntilSigterm",
        "+callbacks.pause.step=3",
        f"+callbacks.pause.flag={flag}",
    ]
    proc = launch_until_flag(cmd, runs_env, flag, never="the run never reached step 3")
    try:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == SIGTERM_STATUS == 143, out[-4000:]  # was 0: `flowlm-train ... && next` went on
    assert "stopped by SIGTERM" in out and "at step 3" in out, out[-4000:]
    last = runs_env / "runs" / "sudoku_mdm_uncond" / "cpu" / "seed0" / "checkpoints" / "last.ckpt"
    verify_checkpoint(last)  # the step-2 checkpoint is whole: the same command resumes from it
    assert torch.load(last, map_location="cpu", weights_only=False, mmap=True)["global_step"] == 2
    (run,) = _mlflow_runs(runs_env)
    assert run.info.status == "KILLED"


def test_sigterm_ends_an_evaluation_with_status_143(step2_ckpt, runs_env, monkeypatch):
    real = AncestralSampler.__call__

    def signalled(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # Lightning's handler records it: the loop stops after this batch
        return real(self, *args, **kwargs)

    monkeypatch.setattr(AncestralSampler, "__call__", signalled)
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # never SIGTERM's default action on pytest itself
    try:
        with pytest.raises(SystemExit) as stopped:
            _eval(step2_ckpt, "data.num_val=16", "eval.max_batches=2")  # 2 batches: SIGTERM stops after the first
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped.value.code == 143  # was None: exit status 0
    (run,) = _mlflow_runs(runs_env)
    assert run.info.status == "KILLED"


# ------------------------------------------------------------------ NFE budgets
@pytest.mark.parametrize(
    ("nfe", "match"),
    [
        ("[1.5]", r"eval.nfe holds 1.5, which is not an NFE budget: each must be an integer ≥ 1"),  # was: NFE 1
        ("abc", r"eval.nfe must be a list of NFE budgets, such as eval.nfe=\[4,16\]; got 'abc'"),  # invalid literal
        ("[0]", r"eval.nfe holds 0, which is not an NFE budget"),
        ("[-1]", r"eval.nfe holds -1, which is not an NFE budget"),
        ("[4,true]", r"eval.nfe holds True, which is not an NFE budget"),
    ],
)
def test_a_budget_that_is_not_an_integer_of_at_least_1_is_refused_before_anything_is_written(nfe, match, runs_env):
    with pytest.raises(ValueError, match=match):
        train(compose_config(overrides=[*RUN, f"eval.nfe={nfe}"]))
    assert not (runs_env / "runs").exists()


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("eval.nfe=[1.5]", r"eval.nfe holds 1.5, which is not an NFE budget"),
        ("eval.nfe=abc", r"eval.nfe must be a list of NFE budgets"),
        ("name=../escape", r"name='../escape' is refused"),
        ("run_name=a/../b", r"run_name's part '..' must be one folder name"),
    ],
)
def test_flowlm_eval_refuses_the_same_before_reading_the_checkpoint(override, match, step2_ckpt, runs_env):
    with pytest.raises(ValueError, match=match):
        _eval(step2_ckpt, override)
    assert list(runs_env.iterdir()) == []


def test_a_huge_budget_is_refused_by_training_and_evaluation_before_any_sampling(step2_ckpt, runs_env, monkeypatch):
    cap = BUDGET_PER_POSITION * CELLS
    _eval(step2_ckpt, f"eval.nfe=[{cap}]", "logger=none")  # the cap itself is a budget

    def sampled(self, *args, **kwargs):
        raise AssertionError(f"{type(self).__name__} sampled at NFE {kwargs['nfe']}")

    for cls in (AncestralSampler, ConfidenceSampler):
        monkeypatch.setattr(cls, "__call__", sampled)
    match = rf"NFE budget 100000000 is above the cap of {cap} for {CELLS} positions to generate .*eval.nfe"
    with pytest.raises(ValueError, match=match):
        train(compose_config(overrides=[*RUN, "eval.nfe=[2,100000000]"]))
    with pytest.raises(ValueError, match=match):  # was: an 18-minute loop on this board
        _eval(step2_ckpt, "eval.nfe=[100000000]")
    assert not (runs_env / "runs").exists()  # no run folder, no MLflow run


CAPPED = [p for p in SAMPLER_YAMLS if p.stem != "ar"]  # AR spends one NFE per position whatever the budget


@pytest.mark.parametrize("path", CAPPED, ids=[p.stem for p in CAPPED])
def test_every_refining_sampler_refuses_a_budget_above_the_cap_before_any_call(path):
    sampler = _sampler(path, {}, 0.0)
    cap = BUDGET_PER_POSITION * FREE
    with pytest.raises(ValueError, match=rf"NFE budget {cap + 1} is above the cap of {cap} for {FREE} positions"):
        sampler.check_budget(cap + 1, free_positions=FREE)
    model = Counted(sampler.family)
    with pytest.raises(ValueError, match=f"above the cap of {cap}"):  # a direct call too (FREE = the length)
        _run(sampler, model, cap + 1)
    assert model.calls == 0


# ------------------------------------------------------------------ run names
@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("name=../escape", r"name='../escape' is refused: name must be one folder name"),  # was: outside runs/
        ("name=a/b", r"name='a/b' is refused"),  # was: nested
        ("name=.hidden", r"name='.hidden' is refused"),  # was: hidden
        ("name=", r"name='' is refused"),
        ("run_name=../../x", r"run_name='../../x' is refused: run_name's part '..' must be one folder name"),
        ("run_name=cpu/.hidden", r"run_name's part '.hidden'"),
        ("run_name=/abs", r"run_name's part ''"),
    ],
)
def test_an_unsafe_run_name_is_refused_before_anything_is_written(override, match, runs_env):
    with pytest.raises(ValueError, match=match + ".*letters, digits and _ . - \\+ = , @"):
        train(compose_config(overrides=[*RUN, override]))
    assert list(runs_env.iterdir()) == []


def test_the_cli_refuses_an_escaping_name_before_hydra_makes_its_folder(tmp_path):
    """Hydra creates its output folder (the run folder, ``paths.run_dir``) before the task runs: the rule guards the
    folder's composition (``${flowlm.run_dir:...}``), so nothing appears outside the runs folder (it wrote
    ``escape/cpu/seed0/.hydra`` and ``train.log`` before)."""
    cmd = [str(BIN / "flowlm-train"), *RUN, "name=../escape"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "name='../escape' is refused" in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "escape").exists() and not (tmp_path / "runs").exists(), sorted(tmp_path.rglob("*"))


@pytest.mark.parametrize("run_name", ["cpu/seed0", "20240131-235959", "sudoku/trial-0123abcdef", "lr=0.1,bs=8", "é"])
def test_the_run_names_in_use_are_accepted(run_name):
    check_run_name(OmegaConf.create({"name": "sudoku_mdm_uncond", "run_name": run_name}))


# ------------------------------------------------------------------ the step flowlm-eval reports
def test_flowlm_eval_reports_the_checkpoints_step(step2_ckpt, runs_env, capsys):
    result = _eval(step2_ckpt)
    out = capsys.readouterr().out
    assert "evaluation at step 2:" in out, out  # was: "evaluation at step 0"
    assert {row["step"] for row in result["rows"]} == {2}  # and its rows, artifact folders (step0000002)
    history = MlflowClient(f"sqlite:///{runs_env / 'runs' / 'mlflow.db'}").get_metric_history(
        result["mlflow_run_id"], "eval/ancestral/nfe2/nfe"
    )
    assert [m.step for m in history] == [2]  # its metrics are logged at the checkpoint's step


def test_flowlm_eval_writes_its_rows_beside_the_runs_own(step2_ckpt, runs_env, tmp_path):
    """``results_csv``: the rows of a re-evaluated checkpoint land in <folder>/<task>/<name>_seed<seed>_eval.csv with
    the run's identity and convergence facts, labelled with the data evaluated on."""
    import csv

    from callbacks.results_csv import COLUMNS

    folder = tmp_path / "results"
    _eval(step2_ckpt, f"results_csv={folder}", "logger=none")
    (path,) = folder.rglob("*_eval.csv")
    assert path.name == "sudoku_mdm_uncond_seed0_eval.csv"
    with path.open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == COLUMNS and {r["sampler"] for r in rows} == {"ancestral", "confidence"}
    assert {(r["name"], r["method"], r["difficulty"], r["nfe_budget"], r["eval_step"]) for r in rows} == {
        ("sudoku_mdm_uncond", "MDM", "uncond", "2", "2")
    }
    assert rows[0]["steps"] == "2" and rows[0]["precision"] in {"32-true", "bf16-mixed"}


def test_flowlm_eval_adds_a_settings_rows_to_the_checkpoints_file_and_replaces_its_own(step2_ckpt, runs_env, tmp_path):
    """The trials of a sampling-only sweep write to one checkpoint's file: each keeps the others' rows (a γ grid had
    left only its last trial's), and evaluating a setting again replaces its rows instead of doubling them."""
    import csv

    folder = tmp_path / "results"
    for score in ("max_prob", "sampled", "sampled"):
        _eval(step2_ckpt, f"results_csv={folder}", "logger=none", f"eval.samplers.confidence.score={score}")
    (path,) = folder.rglob("*_eval.csv")
    with path.open() as f:
        rows = [(r["sampler"], '"score": "sampled"' in r["sampler_settings"]) for r in csv.DictReader(f)]
    assert sorted(rows) == [("ancestral", False), ("confidence", False), ("confidence", True)]


@pytest.mark.parametrize(
    ("given", "recorded", "expected"),
    [(None, 1.0, 1.0), (None, None, 0.0), (0.5, 1.0, 0.5), (0.0, 1.0, 0.0)],
)
def test_flowlm_eval_samples_an_unconditional_checkpoint_at_its_runs_temperature(given, recorded, expected):
    """An unconditional checkpoint evaluated with argmax decoding repeats one sample in every row (a 6×6 Sudoku MDM
    scored 100 % valid at 36 NFE that way): left unset, the temperature is the checkpoint run's; set, the user's."""
    from omegaconf import OmegaConf

    from runners.evaluate import inherit_temperature

    cfg = OmegaConf.create(
        {"a_priori_temperature": given, "eval": {"sampler": {"temperature": "${oc.select:a_priori_temperature,0.0}"}}}
    )
    config = {} if recorded is None else {"a_priori_temperature": recorded}
    inherit_temperature(cfg, {"config": config})
    assert cfg.eval.sampler.temperature == expected
