"""Issue 49, numbers and stores checked for what they are before any compute: lm-eval's ``max_length`` against the
model's context (``max_length=4096`` on a 64-position model ran for minutes on rows it never saw), a read-only Optuna
storage in a sweep (a Hydra UserWarning, then sqlalchemy's message)."""

# ruff: noqa: F811 - the fixtures imported from the modules that define them are test arguments here
from __future__ import annotations

import subprocess

import pytest

from lightning_modules.mdm import MDMModule
from runners import lm_harness
from tests.process_helpers import subprocess_env
from tests.runners import test_lm_harness
from tests.runners.test_lm_harness import L, V, checkpoints, write_checkpoint  # noqa: F401 - a fixture
from tests.runners.test_output_folders import read_only  # noqa: F401 - a fixture
from tests.runners.test_user_errors import command

# A LLaMA-family MDM whose decoder serves 128 positions, trained on rows of L = 64.
LLAMA = {
    "_target_": "flowlm.backbones.llama.BidirectionalLM",
    **{"hidden_size": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "intermediate_size": 64},
    **{"max_positions": 128, "embed_rows": V + 1, "head_rows": V, "mask_id": V},
}


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    """(path, path of the same weights whose run config does not spell out max_positions: a pretrained source's)."""
    root = tmp_path_factory.mktemp("llama_limits")
    patch = pytest.MonkeyPatch()
    patch.setattr(test_lm_harness, "BACKBONE", LLAMA)  # write_checkpoint's network
    try:
        spelled = write_checkpoint(root / "llama.ckpt", MDMModule, record={"backbone": LLAMA})
        source = {"_target_": "flowlm.pretrained.llada.load_llada", "source": "somewhere"}
        unsaid = write_checkpoint(root / "source.ckpt", MDMModule, record={"backbone": source})
    finally:
        patch.undo()
    return spelled, unsaid


def test_a_max_length_beyond_a_dits_rows_is_refused_before_the_weights_are_read(checkpoints, tmp_path, monkeypatch):
    """A DiT's context is the rows it was trained on (rotary positions, no table): refused from the run config's
    record before the weights are read, or, for a record without the backbone, once the network is built."""
    dit = write_checkpoint(tmp_path / "dit.ckpt", MDMModule, record={"backbone": test_lm_harness.BACKBONE})
    with pytest.raises(ValueError, match=f"max_length=4096 is longer than {checkpoints['mdm']}'s context of {L} "):
        lm_harness.FlowLM(checkpoint=str(checkpoints["mdm"]), device="cpu", max_length=4096)
    monkeypatch.setattr(lm_harness, "load_module", lambda *a, **k: pytest.fail("the weights were read"))
    with pytest.raises(ValueError, match=f"^flowlm: model_args max_length=4096 is longer than {dit}'s context") as no:
        lm_harness.FlowLM(checkpoint=str(dit), device="cpu", max_length=4096)
    message = str(no.value)
    assert "\n" not in message and f"give max_length ≤ {L}, or leave it out (the checkpoint's seq_len, {L})" in message


def test_a_llama_family_model_serves_up_to_its_decoders_positions(llama_checkpoint, monkeypatch):
    """Its limit is the decoder's max_positions (128), not the rows it was trained on (64): from the run config
    before the weights are read, else from the built network (a pretrained source's config is not in the record)."""
    spelled, unsaid = llama_checkpoint
    assert lm_harness.FlowLM(checkpoint=str(spelled), device="cpu", max_length=128).max_length == 128
    with pytest.raises(ValueError, match=r"max_length=129 is longer than .*context of 128 positions \(its decoder"):
        lm_harness.FlowLM(checkpoint=str(unsaid), device="cpu", max_length=129)
    monkeypatch.setattr(lm_harness, "load_module", lambda *a, **k: pytest.fail("the weights were read"))
    with pytest.raises(ValueError, match=r"max_length=4096 is longer than .*context of 128 positions \(its decoder"):
        lm_harness.FlowLM(checkpoint=str(spelled), device="cpu", max_length=4096)


# ------------------------------------------------------------------------------------------------ Optuna storage
@pytest.mark.parametrize("entry", ["flowlm-train", "flowlm-eval"])
def test_a_read_only_optuna_storage_stops_the_sweep_in_one_line_before_any_trial(tmp_path, read_only, entry):
    """Hydra turned the sweep callback's error into a UserWarning and went on, and the sweeper failed on the storage
    with sqlalchemy's traceback; now the command ends in one line naming hydra.sweeper.storage, exit status 2,
    nothing run: no trial folder, no MLflow store. FLOWLM_TRACEBACK=1 shows the traceback."""
    folder = read_only("ro")
    args = [entry, "-m", "hparams_search=optuna", f"hydra.sweeper.storage=sqlite:///{folder}/optuna.db"]
    args += ["hydra.sweeper.n_trials=1", "optimized_metric=eval/confidence/nfe2/valid_pct"]
    args += ["experiment=sudoku_mdm_easy", "scale=cpu"] if entry == "flowlm-train" else [f"ckpt_path={tmp_path}/x"]
    env = subprocess_env(tmp_path, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    proc = subprocess.run(command(*args), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    where = proc.stderr[-3000:]
    assert proc.returncode == 2, where
    assert proc.stderr.rstrip("\n").splitlines()[-1] == (
        f"{entry}: error: hydra.sweeper.storage: {folder} cannot be written: {folder} is not writable (read-only "
        f"filesystem or permissions); make it writable or give another hydra.sweeper.storage. Checked before any "
        "compute: nothing was run or written"
    ), where
    assert "Traceback" not in proc.stderr and "UserWarning" not in proc.stderr, where
    runs = tmp_path / "runs"
    assert not list(runs.rglob("trial-*")) and not list(runs.rglob("mlflow.db")), sorted(runs.rglob("*"))
    if entry == "flowlm-eval":
        debug = subprocess.run(
            command(*args), cwd=tmp_path, env={**env, "FLOWLM_TRACEBACK": "1"}, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
        assert debug.returncode == 1 and "Traceback" in debug.stderr and "check_writable" in debug.stderr
