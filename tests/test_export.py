"""`flowlm-export`: a run's checkpoint as a Hugging Face-style folder that the suite reads again by path
(init_from, teacher, flowlm-eval), round-tripped bit for bit (docs/pretrained.md, Export)."""

from __future__ import annotations

import json
from pathlib import Path

import lightning
import pytest
import torch
from conftest import FAST, compose_config
from fixtures.make_fixtures import build_tokenizer
from transformers import AutoTokenizer

from lightning_modules.checkpoints import LIVE_KEY, load_module, read_checkpoint
from lightning_modules.fmlm_plus import FMLMPlusModule
from lightning_modules.mdm import MDMModule
from lightning_modules.mlfm import MLFMModule
from runners.export import export, main

V, L = 12, 8
BACKBONE = {"d_model": 32, "n_layers": 2, "n_heads": 4, "cond_dim": 16, "dropout": 0.0}


def write_run_checkpoint(path: Path, *, seed: int = 0, data: dict | None = None, vocab: int = V) -> MDMModule:
    """A checkpoint as flowlm-train writes it: EMA weights in state_dict, live ones in current_model_state, the
    flowlm record, a ModelCheckpoint score; returns the module holding the EMA weights."""
    torch.manual_seed(seed)
    module = MDMModule(data_vocab_size=vocab, seq_len=L, backbone=BACKBONE, optim={})
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    module.run_config = {"name": "tiny_mdm", "method": {"_target_": "lightning_modules.mdm.MDMModule"}}
    if data is not None:
        module.run_config["data"] = data
    ckpt = {
        "epoch": 1,
        "global_step": 42,
        "pytorch-lightning_version": lightning.__version__,
        "state_dict": module.state_dict(),
        LIVE_KEY: {k: v + 1 for k, v in module.state_dict().items()},
        "hyper_parameters": dict(module.hparams),
        "callbacks": {"ModelCheckpoint{'monitor': 'val/loss'}": {"monitor": "val/loss", "best_model_score": 2.5}},
    }
    module.on_save_checkpoint(ckpt)
    torch.save(ckpt, path)
    return module


def test_export_round_trips_bit_for_bit(tmp_path):
    """The folder's weights are the checkpoint's EMA weights, exactly (dtype and values); loaded back by path it
    is the same module: equal state dicts and equal logits. The card and config say what the model is."""
    write_run_checkpoint(tmp_path / "last.ckpt")
    out = export(tmp_path / "last.ckpt", tmp_path / "export")
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "README.md"}
    original, again = load_module(tmp_path / "last.ckpt"), load_module(out)
    assert type(again) is MDMModule
    mine, theirs = original.state_dict(), again.state_dict()
    assert mine.keys() == theirs.keys()
    for name, tensor in mine.items():
        assert theirs[name].dtype == tensor.dtype and torch.equal(theirs[name], tensor), name
    x = torch.randint(0, V + 1, (3, L))
    with torch.no_grad():
        assert torch.equal(original.eval()(x, torch.rand(3)), again.eval()(x, torch.rand(3)))
    ckpt = read_checkpoint(tmp_path / "last.ckpt")
    exported = read_checkpoint(out)
    assert not torch.equal(exported["state_dict"]["net.embed.weight"], ckpt[LIVE_KEY]["net.embed.weight"])
    config = json.loads((out / "config.json").read_text())
    assert config["family"] == "mdm" and config["mask_token_id"] == V and config["vocab_size"] == V + 1
    assert config["weights"] == "EMA" and config["global_step"] == 42 and config["backbone"]["attn_softcap"] == 50.0
    assert config["git_commit"] == ckpt["flowlm"]["git_commit"] != ""
    card = (out / "README.md").read_text()
    for text in ("lightning_modules.mdm.MDMModule", "| steps | 42", "val/loss", "2.5", config["git_commit"]):
        assert text in card, text


def test_export_serves_init_from_and_teacher(tmp_path):
    """By path, the export initialises FMLM+ and MLFM and serves as FMLM+'s teacher exactly as the checkpoint does."""
    write_run_checkpoint(tmp_path / "last.ckpt", seed=1)
    out = export(tmp_path / "last.ckpt", tmp_path / "export")
    nets = {}
    for source in (tmp_path / "last.ckpt", out):
        torch.manual_seed(0)  # the same fresh emb_t and LoRA A
        flow = FMLMPlusModule(
            data_vocab_size=V, seq_len=L, backbone=BACKBONE, optim={}, init_from=str(source), teacher=str(source)
        )
        flow.validate_inputs()
        flow.on_fit_start()
        mlfm = MLFMModule(data_vocab_size=V, seq_len=L, backbone=BACKBONE, optim={}, init_from=str(source))
        mlfm.validate_inputs()
        mlfm.on_fit_start()
        nets[source] = (flow.net.state_dict(), flow._teacher.state_dict(), mlfm.net.base.state_dict())
    for mine, theirs in zip(nets[tmp_path / "last.ckpt"], nets[out], strict=True):
        assert all(torch.equal(theirs[k], v) for k, v in mine.items())
    assert len(flow.init_report["copied"]) > 10


def test_export_writes_the_runs_tokenizer(tmp_path):
    """A text run's tokenizer (with the [PAD] the data add) goes into the folder; one of another size is refused."""
    build_tokenizer().save_pretrained(str(tmp_path / "tok"))
    from datamodules.sources import load_tokenizer

    size = len(load_tokenizer(tmp_path / "tok"))
    data = {"_target_": "datamodules.text.TextDataModule", "tokenizer": str(tmp_path / "tok")}
    write_run_checkpoint(tmp_path / "last.ckpt", data=data, vocab=size)
    out = export(tmp_path / "last.ckpt", tmp_path / "export")
    assert (out / "tokenizer.json").is_file()
    assert len(AutoTokenizer.from_pretrained(str(out))) == size
    write_run_checkpoint(tmp_path / "other.ckpt", data=data, vocab=size + 1)
    with pytest.raises(ValueError, match="has .* tokens, the checkpoint"):
        export(tmp_path / "other.ckpt", tmp_path / "export2")


def test_export_refuses_wrong_inputs_before_writing(tmp_path, capsys):
    """A non-checkpoint, an export, a missing file and a non-empty folder are refused; nothing is written."""
    torch.save({"state_dict": {}}, tmp_path / "bogus.ckpt")
    with pytest.raises(ValueError, match="not a flowlm checkpoint"):
        export(tmp_path / "bogus.ckpt", tmp_path / "a")
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        export(tmp_path / "missing.ckpt", tmp_path / "a")
    assert not (tmp_path / "a").exists()
    write_run_checkpoint(tmp_path / "last.ckpt")
    main([str(tmp_path / "last.ckpt"), str(tmp_path / "b")])  # the console script
    assert "exported" in capsys.readouterr().out
    with pytest.raises(ValueError, match="already a flowlm export"):
        export(tmp_path / "b", tmp_path / "c")
    with pytest.raises(ValueError, match="is not empty"):
        export(tmp_path / "last.ckpt", tmp_path / "b")
    assert not (tmp_path / "c").exists()


@pytest.mark.slow
def test_flowlm_eval_scores_an_export_as_its_checkpoint(runs_env):
    """A trained run, exported (given as its run folder), scores the same under flowlm-eval as its checkpoint."""
    from runners.evaluate import evaluate
    from runners.train import train

    result = train(compose_config(overrides=["experiment=sudoku_mdm_uncond", "scale=cpu", *FAST, "logger=none"]))
    out = export(result["run_dir"], runs_env / "export")
    rows = {}
    for path in (Path(result["run_dir"], "checkpoints", "last.ckpt"), out):
        overrides = [f"ckpt_path={path}", "eval.nfe=[2]", "eval.max_batches=1", "logger=none"]
        cfg = compose_config("eval", overrides=overrides)
        rows[path] = [{k: v for k, v in row.items() if k != "sec_per_sample"} for row in evaluate(cfg)["rows"]]
    first, second = rows.values()
    assert first and first == second  # every score but the timing
