"""Test environment: offline Hugging Face, headless matplotlib, runs and caches under a temporary folder."""

import os

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


# Tiny data and budgets for end-to-end runs of any experiment config (9×9 configs keep their layout).
FAST = [
    "data.num_train=24",
    "data.num_val=8",
    "data.batch_size=8",
    "data.gen_workers=1",
    "trainer.accelerator=cpu",
    "trainer.devices=1",
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.log_every_n_steps=1",
    "eval.nfe=[2]",
    "eval.max_batches=1",
    "method.optim.warmup_steps=1",
]


def compose_config(config_name: str = "train", overrides: list[str] | None = None):
    """Compose a config from conf/ exactly as the console scripts would."""
    from hydra import compose, initialize_config_dir

    from runners.common import CONF_DIR

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
