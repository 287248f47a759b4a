"""Sharded training: the FSDP (GPU) config, FSDP2 on 2 CPU processes (gloo), its sharded checkpoints read by a
single-process evaluation and by a resumed run."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import mlflow
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from tests.process_helpers import gloo_rank, rank_outputs, subprocess_env

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]
RUN = Path("sudoku_mdm_uncond") / "cpu" / "seed0"
TINY = [
    "experiment=sudoku_mdm_uncond",
    "scale=cpu",
    "data.num_train=64",
    "data.num_val=16",
    "data.batch_size=16",
    "trainer.val_check_interval=4",
    "eval.nfe=[2]",
    "eval.max_batches=1",
    "trainer.enable_progress_bar=false",
]
FSDP2_CPU = ["trainer=fsdp2", "trainer.accelerator=cpu", "trainer.devices=2"]


class GatherWeights(Callback):
    """Test helper for a `flowlm-train` subprocess: rank 0 saves the full (gathered) weights, live ones at the last
    optimizer step (what the checkpoint written then holds as live weights) and EMA ones at the end of training (the
    EMA callback has copied its average into the model by then)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.gathered: dict[str, dict] = {}

    def _gather(self, trainer, pl_module, key: str) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(pl_module, options=options)  # collective: every rank calls it
        if trainer.is_global_zero:
            self.gathered[key] = {k: v.clone() for k, v in state.items()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: D102
        if trainer.global_step == trainer.max_steps:
            self._gather(trainer, pl_module, "live")

    def on_train_end(self, trainer, pl_module) -> None:  # noqa: D102
        self._gather(trainer, pl_module, "ema")
        if trainer.is_global_zero:
            torch.save(self.gathered, self.path)


def _run(cmd: list[str], root: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=subprocess_env(root), capture_output=True, text=True, timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


# ---------------------------------------------------------------------------------------------------- configs
def test_fsdp2_config_builds_its_strategy_without_a_gpu():
    from conftest import compose_config
    from hydra.utils import instantiate
    from lightning.pytorch.strategies import ModelParallelStrategy

    cfg = compose_config("train", [*FSDP2_CPU, "trainer.devices=3"])
    strategy = instantiate(cfg.trainer.strategy)
    assert isinstance(strategy, ModelParallelStrategy)
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (3, 1)


# ------------------------------------------------------------------------------- sharding in one process
@pytest.fixture
def one_process_group(tmp_path):
    """A gloo process group of one rank (FSDP2 works at world size 1), torn down after the test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _tiny_mdm():
    from lightning_modules.mdm import MDMModule

    backbone = {"d_model": 32, "n_layers": 2, "n_heads": 4, "cond_dim": 32, "mlp_ratio": 2, "dropout": 0.0}
    return MDMModule(data_vocab_size=6, seq_len=9, backbone=backbone, optim={"warmup_steps": 1})


def test_configure_model_shards_blocks_then_the_dit_once(one_process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    module = _tiny_mdm()
    module.configure_model()  # no mesh (cpu/gpu/ddp trainers): nothing happens
    assert not any(isinstance(m, FSDPModule) for m in module.modules())
    names = list(module.state_dict())
    module.net.embed.weight.requires_grad_(False)  # frozen parameters stay replicated
    module._device_mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    module.configure_model()
    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    assert units == [module.net, *module.net.blocks]
    module.configure_model()  # idempotent: Lightning calls it again for validate
    assert [m for m in module.modules() if isinstance(m, FSDPModule)] == units
    assert list(module.state_dict()) == names  # checkpoints keep their keys
    assert isinstance(module.net.blocks[0].qkv.weight, DTensor)
    assert not isinstance(module.net.embed.weight, DTensor)


def test_compile_falls_back_with_a_warning(monkeypatch):
    from lightning_modules import sharding

    module = _tiny_mdm()
    module.run_config = {"compile": True}
    monkeypatch.setattr(sharding, "compile_unavailable", lambda device: "no compiler in this test")
    with pytest.warns(UserWarning, match="no compiler in this test"):
        module.configure_model()
    assert all(getattr(b, "_compiled_call_impl", None) is None for b in module.net.blocks)


def test_compile_is_in_place_and_idempotent():
    module = _tiny_mdm()
    module.run_config = {"compile": True}
    names = list(module.state_dict())
    module.configure_model()
    compiled = [b._compiled_call_impl for b in module.net.blocks]
    assert all(c is not None for c in compiled)
    module.configure_model()
    assert [b._compiled_call_impl for b in module.net.blocks] == compiled
    assert list(module.state_dict()) == names


def _unequal_forwards(rank: int, init_file: str, out_dir: str) -> None:
    """Worker of the test below: 1 or 3 evaluation forwards per rank inside full_parameters, then a training step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lightning_modules.sharding import full_parameters

    with gloo_rank(rank, init_file):
        torch.manual_seed(0)  # the same initial weights on both ranks, and in the unsharded reference
        module, reference = _tiny_mdm(), _tiny_mdm()
        reference.load_state_dict(module.state_dict())
        module._device_mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
        module.configure_model()
        x, t = torch.randint(0, 7, (3, 9)), torch.rand(3)
        with torch.no_grad(), full_parameters(module):
            outs = [module(x, t) for _ in range(1 + 2 * rank)]  # ranks disagree on the number of forwards
        equal = all(torch.equal(o, reference(x, t)) for o in outs)
        module(x, t).sum().backward()  # training works again: every unit resharded, hooks intact
        sharded = isinstance(module.net.embed.weight, DTensor) and module.net.embed.weight.grad is not None
        Path(out_dir, f"rank{rank}").write_text(f"{equal} {sharded}")


@pytest.mark.slow
def test_ranks_may_run_different_numbers_of_forwards_inside_full_parameters(tmp_path):
    what = "ranks with different numbers of forwards"  # a hang fails the test instead of blocking it
    assert rank_outputs(_unequal_forwards, tmp_path, timeout_s=120, what=what) == ["True True"] * 2


# ------------------------------------------------------------------------ sharded checkpoint folders
def _write_sharded(path: Path, state: dict, meta: dict) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": as intended here
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"state_dict": state}, checkpoint_id=path, no_dist=True)
    torch.save(meta, path / "meta.pt")


def test_sharded_folder_is_read_as_one_checkpoint_and_damage_is_refused(tmp_path):
    from lightning_modules.checkpoints import LIVE_KEY, read_checkpoint, read_checkpoint_meta, verify_checkpoint

    ema, live = {"net.w": torch.ones(3, 2)}, {"net.w": torch.zeros(3, 2)}
    folder = tmp_path / "last.ckpt"
    _write_sharded(folder, {**ema, LIVE_KEY: live}, {"flowlm": {"family": "mdm"}, "global_step": 4})
    verify_checkpoint(folder)
    assert read_checkpoint_meta(folder) == {"family": "mdm"}
    ckpt = read_checkpoint(folder)
    assert torch.equal(ckpt["state_dict"]["net.w"], ema["net.w"]) and list(ckpt["state_dict"]) == ["net.w"]
    assert torch.equal(ckpt[LIVE_KEY]["net.w"], live["net.w"]) and ckpt["global_step"] == 4

    shard = next(folder.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])  # a save cut short
    with pytest.raises(ValueError, match="incomplete sharded checkpoint"):
        verify_checkpoint(folder)
    shard.unlink()
    with pytest.raises(ValueError, match="is missing"):
        verify_checkpoint(folder)
    (folder / "meta.pt").unlink()
    with pytest.raises(ValueError, match="not a sharded checkpoint"):
        read_checkpoint(folder)
    foreign = tmp_path / "foreign"
    _write_sharded(foreign, ema, {"global_step": 1})
    with pytest.raises(ValueError, match="not a flowlm checkpoint"):
        verify_checkpoint(foreign)


def test_resume_refuses_a_damaged_sharded_last_ckpt(tmp_path):
    from conftest import compose_config
    from omegaconf import OmegaConf

    from runners.common import RUN_CONFIG, RunExistsError, check_run_dir

    cfg = compose_config("train", [f"paths.root={tmp_path}", "experiment=sudoku_mdm_uncond", "scale=cpu"])
    run_dir = Path(cfg.paths.run_dir)
    run_dir.mkdir(parents=True)
    OmegaConf.save(cfg, run_dir / RUN_CONFIG, resolve=True)
    last = run_dir / "checkpoints" / "last.ckpt"
    _write_sharded(last, {"net.w": torch.ones(4)}, {"flowlm": {"family": "mdm"}})
    with pytest.raises(RunExistsError, match="resume with that trainer"):
        check_run_dir(cfg)  # trainer=cpu cannot read shards
    cfg.trainer = compose_config("train", FSDP2_CPU).trainer
    assert check_run_dir(cfg) == last
    (last / ".metadata").unlink()
    with pytest.raises(RunExistsError, match="shard index"):
        check_run_dir(cfg)


# ------------------------------------------------------------------ FSDP2 on two CPU processes (gloo)
@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory):
    """One 4-step FSDP2 run on 2 CPU processes; its root folder and the weights gathered at its end."""
    root = tmp_path_factory.mktemp("fsdp2")
    gathered = root / "gathered.pt"
    gather = [
        "+callbacks.gather._target_=tests.lightning_modules.test_fsdp.GatherWeights",
        f"+callbacks.gather.path={gathered}",
    ]
    proc = _run([str(BIN / "flowlm-train"), *TINY, *FSDP2_CPU, "trainer.max_steps=4", *gather], root)
    return root, proc, torch.load(gathered, weights_only=False)


@pytest.mark.slow
def test_fsdp2_trains_on_two_cpu_processes_into_sharded_checkpoints(fsdp2_run):
    from lightning_modules.checkpoints import LIVE_KEY, read_checkpoint, verify_checkpoint

    root, proc, gathered = fsdp2_run
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in proc.stdout + proc.stderr
    assert "| sudoku_mdm_uncond | confidence |" in proc.stdout
    last = root / "runs" / RUN / "checkpoints" / "last.ckpt"
    assert last.is_dir() and len(list(last.glob("*.distcp"))) == 2  # one shard per rank
    # Written to its own folder, then last.ckpt switched to it atomically (callbacks/checkpoint.py).
    assert last.is_symlink() and last.readlink() == Path("last.ckpt.step0000004")
    verify_checkpoint(last)
    ckpt = read_checkpoint(last)
    assert ckpt["global_step"] == 4 and ckpt["flowlm"]["family"] == "mdm"
    for key, weights in (("state_dict", "ema"), (LIVE_KEY, "live")):
        assert ckpt[key].keys() == gathered[weights].keys()
        for name, value in gathered[weights].items():
            assert torch.equal(ckpt[key][name], value), (key, name)
    assert any(not torch.equal(ckpt["state_dict"][k], ckpt[LIVE_KEY][k]) for k in ckpt["state_dict"])  # EMA ≠ live
    mlflow.set_tracking_uri(f"sqlite:///{root / 'runs' / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["sudoku_uncond_6x6"])
    assert len(runs) == 1 and runs.iloc[0]["metrics.eval/confidence/nfe2/nfe"] <= 2  # sampled on the sharded model


@pytest.mark.slow
def test_fsdp2_checkpoint_evaluates_in_one_process(fsdp2_run):
    from lightning_modules.checkpoints import load_module

    root, _, gathered = fsdp2_run
    last = root / "runs" / RUN / "checkpoints" / "last.ckpt"
    module = load_module(last)  # what flowlm-eval runs
    state = module.state_dict()
    assert state.keys() == gathered["ema"].keys()
    for name, value in gathered["ema"].items():
        assert type(state[name]) is torch.Tensor and torch.equal(state[name], value), name  # full, unsharded
    cmd = [str(BIN / "flowlm-eval"), f"ckpt_path={last}", "eval.nfe=[2]", "eval.max_batches=1"]
    proc = _run([*cmd, "trainer.enable_progress_bar=false"], root)
    assert "| sudoku_mdm_uncond | confidence |" in proc.stdout


@pytest.mark.slow
def test_fsdp2_run_resumes_from_its_sharded_checkpoint(fsdp2_run):
    """Last in this file: it continues the shared run in place (a copied run folder would resume too, but Lightning's
    ModelCheckpoint then writes last-v1.ckpt beside the old last.ckpt, as it does for any moved run)."""
    from lightning_modules.checkpoints import read_checkpoint_meta

    root, _, _ = fsdp2_run
    proc = _run([str(BIN / "flowlm-train"), *TINY, *FSDP2_CPU, "trainer.max_steps=6"], root)
    last = root / "runs" / RUN / "checkpoints" / "last.ckpt"
    assert "Restored all states from the checkpoint" in proc.stdout + proc.stderr
    # The link moved to the step-6 folder and the step-4 one is gone.
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt", "last.ckpt.step0000006"]
    assert last.readlink() == Path("last.ckpt.step0000006")
    meta = torch.load(last / "meta.pt", weights_only=False)
    assert meta["global_step"] == 6 and meta["averaging_state"]["n_averaged"] == 6
    assert read_checkpoint_meta(last)["family"] == "mdm"


@pytest.mark.slow
def test_fmlm_plus_on_a_pretrained_llama_trains_under_fsdp2_while_ranks_draw_different_pair_kinds(tmp_path):
    """tinygsm_fmlm_plus_init_llada's paper-scale strategy (FSDP2 per decoder layer, activation checkpointing,
    micro-batches) on its CPU-scale folder, 2 gloo processes: with one row per micro-batch a rank often holds no
    off-diagonal row, yet FSDP2's all-gathers need every rank to run the same forwards, so the semigroup passes run
    on every call (``every_pass``; without it this run hangs, so the test has a deadline and kills the ranks)."""
    import os
    import signal

    cmd = [str(BIN / "flowlm-train"), "experiment=tinygsm_fmlm_plus_init_llada", "scale=cpu", "debug=short"]
    cmd += ["data.batch_size=4", "micro_batch_size=1", "activation_checkpointing=true", "eval.max_batches=1"]
    cmd += ["data.num_workers=0", "data.num_proc=null", "data.seq_len=256", "data.min_response_tokens=16"]
    cmd += ["data.train_files=data/cpu/tinygsm_sample.jsonl", "data.eval_files=data/cpu/gsm8k_sample.jsonl"]
    cmd += [*FSDP2_CPU, "trainer.max_steps=2", "trainer.enable_progress_bar=false"]
    proc = subprocess.Popen(
        cmd, env=subprocess_env(tmp_path), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # its own process group: both ranks are killed at the deadline
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail("FSDP2 FMLM+ run hung (ranks ran different forwards): " + err[-2000:])
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in out + err
    assert "weights broadcast from rank 0" in out + err  # rank 1 never read the LLaDA folder
    assert "| tinygsm_fmlm_plus_init_llada | pr |" in out
    last = tmp_path / "runs" / "tinygsm_fmlm_plus_init_llada" / "cpu" / "seed0" / "checkpoints" / "last.ckpt"
    assert last.is_dir() and len(list(last.glob("*.distcp"))) == 2  # sharded: one file per rank


def test_a_sharded_embedding_and_head_keep_fmlm_plus_on_one_hot_states_and_the_unfused_loss(one_process_group):
    """``flow_map.is_shard``: a DTensor shard is not the whole matrix (one-hot states, the unfused loss); the same
    module unsharded (a plain weight, as a fake one in benchmarks/memory_estimates.py) draws in the embedding space
    (|V| = 64 > d = 32) and runs its loss fused."""
    from torch.distributed.device_mesh import init_device_mesh

    from flowlm.models.flow_map import is_shard
    from lightning_modules.fmlm_plus import FMLMPlusModule

    backbone = {"d_model": 32, "n_layers": 2, "n_heads": 4, "cond_dim": 32, "mlp_ratio": 2, "dropout": 0.0}
    module = FMLMPlusModule(data_vocab_size=64, seq_len=9, backbone=backbone, optim={"warmup_steps": 1})
    assert not is_shard(module.net.token_embeddings) and module.view.training_process().embedded
    assert module.fused_head() is not None
    module._device_mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    module.configure_model()
    assert is_shard(module.net.token_embeddings) and is_shard(module.net.output_head.weight)
    assert not module.view.training_process().embedded and module.fused_head() is None
