"""Issue 49 (bad input, faults and leaks, round four): booleans are booleans (a crafted checkpoint given with
``trust_pickle=no`` is refused, its payload never runs), ``--mlflow_tracking_uri none`` is untracked, results rows
are keyed by what made them, secrets in tracking URIs are never written, numbers are checked for what they are
(docs/reliability.md)."""

# ruff: noqa: F811 - the fixtures imported from the modules that define them are test arguments here
from __future__ import annotations

import json
import sys

import pytest

from flowlm.options import as_bool, as_int
from lightning_modules.checkpoints import UntrustedCheckpointError, load_module, read_checkpoint, read_checkpoint_meta
from runners import lm_harness, mt_bench
from runners.lm_harness import FlowLM
from tests.pretrained.test_safe_loading import crafted
from tests.runners.test_lm_harness import TASKS, local_tasks  # noqa: F401 - a fixture
from tests.runners.test_lm_harness import checkpoints as lm_checkpoints  # noqa: F401 - a fixture
from tests.runners.test_mt_bench import SMALL, checkpoints, config, questions, write_answers  # noqa: F401 - fixtures


# ------------------------------------------------------------------------------------------------ booleans
@pytest.mark.parametrize(
    ("value", "expected"),
    [(True, True), (False, False), (1, True), (0, False), ("no", False), ("No", False), ("OFF", False),
     ("0", False), ("false", False), ("yes", True), ("on", True), ("1", True), ("True", True), (" true ", True)],
)  # fmt: skip
def test_the_usual_spellings_are_booleans(value, expected):
    assert as_bool("trust_pickle", value) is expected


@pytest.mark.parametrize("value", ["maybe", "", "nope", 2, -1, 0.0, 1.5, None, [], "yes please"])
def test_anything_else_is_refused_in_one_line_naming_the_option(value):
    with pytest.raises(ValueError, match=r"^trust_pickle must be true or false .*got") as refused:
        as_bool("trust_pickle", value)
    assert "\n" not in str(refused.value) and "trust_pickle=false" in str(refused.value)


@pytest.fixture
def crafted_checkpoint(tmp_path):
    """(checkpoint, marker): a flowlm checkpoint whose unpickling writes ``marker``."""
    marker = tmp_path / "marker"
    return crafted(tmp_path / "crafted.ckpt", marker), marker


@pytest.mark.parametrize("no", ["no", "No", "off", "0", "false", 0, False])
def test_a_crafted_checkpoint_with_trust_pickle_no_is_refused_by_every_reader(crafted_checkpoint, no):
    path, marker = crafted_checkpoint
    for reader in (read_checkpoint, read_checkpoint_meta, load_module):
        with pytest.raises(UntrustedCheckpointError):
            reader(path, trust_pickle=no)
    assert not marker.exists()


def test_lm_eval_model_args_trust_pickle_no_is_refused_and_the_payload_never_runs(crafted_checkpoint, tmp_path):
    """The command line's path (``tracked``: the MLflow run is made from the checkpoint's record) and the model's
    own (``FlowLM``, what ``lm_eval.simple_evaluate`` builds from the parsed model_args)."""
    path, marker = crafted_checkpoint
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"

    def never(model=None, model_args=None):
        pytest.fail("the evaluation ran")

    with pytest.raises(UntrustedCheckpointError):
        lm_harness.tracked(never, store)(model="flowlm", model_args=f"checkpoint={path},trust_pickle=no")
    with pytest.raises(UntrustedCheckpointError):
        FlowLM(checkpoint=str(path), trust_pickle="no", device="cpu")
    assert not marker.exists()
    with pytest.raises(ValueError, match="trust_pickle must be true or false") as refused:
        lm_harness.tracked(never, store)(model="flowlm", model_args=f"checkpoint={path},trust_pickle=maybe")
    assert "\n" not in str(refused.value)
    with pytest.raises(ValueError, match="trust_pickle must be true or false"):
        FlowLM(checkpoint=str(path), trust_pickle="maybe", device="cpu")
    assert not marker.exists()


def test_mt_bench_generate_trust_pickle_no_is_refused_and_the_payload_never_runs(
    crafted_checkpoint, questions, tmp_path
):
    path, marker = crafted_checkpoint
    common = [f"ckpt_path={path}", f"questions={questions}", "step=generate", "logger=none"]
    with pytest.raises(UntrustedCheckpointError):
        mt_bench.run(config(tmp_path, *common, "generate.trust_pickle=no"))
    assert not marker.exists()
    with pytest.raises(ValueError, match="^generate.trust_pickle must be true or false") as refused:
        mt_bench.run(config(tmp_path, *common, "generate.trust_pickle=maybe"))
    assert "\n" not in str(refused.value) and not marker.exists()


def test_mt_bench_overwrite_no_does_not_replace_written_answers(checkpoints, questions, tmp_path):
    answers = write_answers(tmp_path, "tiny_mdm")
    before = answers.read_text()
    common = [f"ckpt_path={checkpoints['mdm']}", f"questions={questions}", "step=generate", *SMALL]
    with pytest.raises(FileExistsError, match="overwrite=true"):
        mt_bench.run(config(tmp_path, *common, "overwrite=no"))
    with pytest.raises(ValueError, match="^overwrite must be true or false"):
        mt_bench.run(config(tmp_path, *common, "overwrite=perhaps"))
    assert answers.read_text() == before


# ------------------------------------------------------------------------------------------------ integers
@pytest.mark.parametrize("value", [1.5, "abc", "1.5", True, None])
def test_a_seed_that_is_not_an_integer_is_refused_naming_seed(value):
    with pytest.raises(ValueError, match=r"^seed must be an integer") as refused:
        as_int("seed", value)
    assert "\n" not in str(refused.value)


def test_integer_seeds_and_their_strings_pass():
    assert as_int("seed", 7) == 7 and as_int("seed", "7") == 7 and as_int("seed", "-3") == -3
    with pytest.raises(ValueError, match="≥ 0"):
        as_int("seed", -3, minimum=0)


# ------------------------------------------------------------------------------------------------ untracked
@pytest.mark.parametrize("none", ["none", "None"])
def test_lm_eval_mlflow_tracking_uri_none_evaluates_untracked(
    lm_checkpoints, local_tasks, runs_env, tmp_path, monkeypatch, none
):
    """`flowlm-lm-eval --mlflow_tracking_uri none` (documented: untracked) crashed with "'NoneType' object has no
    attribute 'get'"; it evaluates, writes lm-eval's results and makes no MLflow store."""
    out = tmp_path / "out"
    argv = ["flowlm-lm-eval", "--model", "flowlm", "--tasks", "flowlm_choice", "--include_path", str(TASKS)]
    argv += ["--model_args", f"checkpoint={lm_checkpoints['run']},mc_samples=2", "--limit", "2"]
    argv += ["--device", "cpu", "--batch_size", "16", "--output_path", str(out), "--mlflow_tracking_uri", none]
    monkeypatch.setattr(sys, "argv", argv)
    lm_harness.main()
    (written,) = out.rglob("results_*.json")
    assert "flowlm_choice" in json.loads(written.read_text())["results"]
    assert not list(runs_env.rglob("mlflow.db")) and not list(runs_env.rglob("mlruns"))
