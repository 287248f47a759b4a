"""`flowlm-export`: a run's checkpoint as a Hugging Face-style folder that the suite reads again by path
(init_from, teacher, flowlm-eval), round-tripped bit for bit (docs/pretrained.md, Export)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import lightning
import pytest
import torch
from conftest import FAST, compose_config
from fixtures.make_fixtures import TOKENIZER_DIR, build_tokenizer
from transformers import AutoTokenizer

from lightning_modules.checkpoints import LIVE_KEY, load_module, read_checkpoint
from lightning_modules.fmlm_plus import FMLMPlusModule
from lightning_modules.mdm import MDMModule
from lightning_modules.mlfm import MLFMModule
from runners.export import export, main

V, L = 12, 8
ROOT = Path(__file__).resolve().parents[2]
BACKBONE = {"d_model": 32, "n_layers": 2, "n_heads": 4, "cond_dim": 16, "dropout": 0.0}


def write_run_checkpoint(
    path: Path,
    *,
    seed: int = 0,
    data: dict | None = None,
    vocab: int = V,
    backbone: dict = BACKBONE,
    module_class: type = MDMModule,
    callbacks: dict | None = None,
    config: dict | None = None,
    options: dict | None = None,
) -> MDMModule:
    """A checkpoint as flowlm-train writes it: EMA weights in state_dict, live ones in current_model_state, the
    flowlm record (the run config with ``config``'s sections), a ModelCheckpoint score (and ``callbacks``' states);
    ``options``: the module's own arguments. Returns the module holding the EMA weights."""
    torch.manual_seed(seed)
    module = module_class(data_vocab_size=vocab, seq_len=L, backbone=backbone, optim={}, **(options or {}))
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    module.run_config = {
        "name": "tiny_mdm",
        "method": {"_target_": "lightning_modules.mdm.MDMModule"},
        **(config or {}),
    }
    if data is not None:
        module.run_config["data"] = data
    ckpt = {
        "epoch": 1,
        "global_step": 42,
        "pytorch-lightning_version": lightning.__version__,
        "state_dict": module.state_dict(),
        LIVE_KEY: {k: v + 1 for k, v in module.state_dict().items()},
        "hyper_parameters": dict(module.hparams),
        "callbacks": {
            "ModelCheckpoint{'monitor': 'val/loss'}": {"monitor": "val/loss", "best_model_score": 2.5},
            **(callbacks or {}),
        },
    }
    module.on_save_checkpoint(ckpt)
    torch.save(ckpt, path)
    return module


def test_export_round_trips_bit_for_bit(tmp_path):
    """The folder's weights are the checkpoint's EMA weights, exactly (dtype and values); loaded back by path it
    is the same module: equal state dicts and equal logits. The card and config say what the model is."""
    write_run_checkpoint(tmp_path / "last.ckpt")
    out = export(tmp_path / "last.ckpt", tmp_path / "export")
    transformers_files = {"configuration_flowlm.py", "modeling_flowlm.py", "flowlm_dit.py", "flowlm_loading.py"}
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "README.md", *transformers_files}
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


def test_export_keeps_the_runs_pad_token(tmp_path):
    """A run trained with data.pad_token=eos (no [PAD] id added) exports; its tokenizer pads with EOS there too."""
    from datamodules.sources import load_tokenizer

    size = len(load_tokenizer(TOKENIZER_DIR, "eos"))
    data = {"_target_": "datamodules.text.TextDataModule", "tokenizer": str(TOKENIZER_DIR), "pad_token": "eos"}
    write_run_checkpoint(tmp_path / "last.ckpt", data=data, vocab=size)
    out = export(tmp_path / "last.ckpt", tmp_path / "export")
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert len(tokenizer) == size and tokenizer.pad_token_id == tokenizer.eos_token_id is not None


@pytest.mark.parametrize(
    ("layout", "module_class", "model_type", "rows", "mask"),
    [
        ("llada", MDMModule, "llada", V, 3),  # [MASK] inside the vocabulary; the source's layout
        ("dream", MDMModule, "qwen2", V, 3),  # Dream's layout: transformers' Qwen2
        ("smdm", MDMModule, "smdm", V + 1, V),  # [MASK] = the extra embedding row
        ("llada", FMLMPlusModule, "flowlm-llama", V, 3),  # LlamaFlowNet: the base's embedding and [MASK]
    ],
)
def test_export_config_describes_a_llama_family_network(tmp_path, layout, module_class, model_type, rows, mask):
    """config.json names the backbone, the input embedding's rows and the network's own [MASK] id; the export loads
    back as the same module."""
    from tests.pretrained.test_fmlm_plus_llama import tiny_llama

    backbone = tiny_llama(layout, V)
    write_run_checkpoint(tmp_path / "last.ckpt", backbone=backbone, module_class=module_class)
    out = export(tmp_path / "last.ckpt", tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["vocab_size"], config["mask_token_id"]) == (model_type, rows, mask)
    assert f"{rows} rows; [MASK] {mask}" in (out / "README.md").read_text()
    mine, theirs = load_module(tmp_path / "last.ckpt").state_dict(), load_module(out).state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(theirs[k], v) for k, v in mine.items())


@pytest.mark.parametrize("layout", ["smdm", "llada", "dream", "llada_padded"])
def test_a_llama_family_mdm_exports_in_its_sources_layout(tmp_path, layout):
    """The weights carry exactly the source's tensor names and shapes, config.json the keys its loader reads: the
    suite's SMDM / LLaDA / Dream loader reads the folder into the module's network bit for bit."""
    from safetensors import safe_open

    from flowlm.pretrained import dream, llada, smdm
    from tests.pretrained.test_fmlm_plus_llama import tiny_llama

    module = write_run_checkpoint(tmp_path / "last.ckpt", backbone=tiny_llama(layout, V))
    out = export(tmp_path / "last.ckpt", tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    source = layout.removesuffix("_padded")
    assert config["weights_layout"] == source
    if source == "smdm":
        cfg, net = smdm.smdm_config(config["litgpt_config"]), smdm.load_smdm(out, config=config["litgpt_config"])
        expected = smdm.expected_keys(cfg)
    else:
        reader = llada if source == "llada" else dream
        cfg = reader.llada_config(config) if source == "llada" else reader.dream_config(config)
        net, expected = getattr(reader, f"load_{source}")(out), reader.expected_keys(cfg)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()} == expected
    mine, theirs = module.net.state_dict(), net.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(theirs[k].dtype == v.dtype and torch.equal(theirs[k], v) for k, v in mine.items())
    assert net.spec == module.net.spec


def test_a_llama_network_in_no_sources_layout_keeps_the_suites_names(tmp_path):
    """SMDM's layout fixes RoPE θ = 1e4: another θ is exported under the module's names (net.*), read back as such."""
    from tests.pretrained.test_fmlm_plus_llama import tiny_llama

    write_run_checkpoint(tmp_path / "last.ckpt", backbone={**tiny_llama("smdm", V), "rope_theta": 5e5})
    out = export(tmp_path / "last.ckpt", tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "flowlm-llama" and "weights_layout" not in config
    mine, theirs = load_module(tmp_path / "last.ckpt").state_dict(), load_module(out).state_dict()
    assert all(torch.equal(theirs[k], v) for k, v in mine.items())


def test_a_source_layout_export_missing_a_tensor_is_refused_naming_it(tmp_path):
    """A LLaDA-layout folder whose weights lack one block tensor is refused before the module is built."""
    from safetensors.torch import load_file, save_file

    from tests.pretrained.test_fmlm_plus_llama import tiny_llama

    write_run_checkpoint(tmp_path / "last.ckpt", backbone=tiny_llama("llada", V))
    out = export(tmp_path / "last.ckpt", tmp_path / "export")
    state = load_file(str(out / "model.safetensors"))
    del state["model.transformer.blocks.1.ff_out.weight"]
    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing 1 keys.*blocks\.1\.ff_out"):
        load_module(out)


def test_export_config_of_a_dit_flow_model_has_no_mask(tmp_path):
    """FMLM+ on the DiT reads no [MASK]: its embedding has the data rows only."""
    write_run_checkpoint(tmp_path / "last.ckpt", module_class=FMLMPlusModule)
    config = json.loads((export(tmp_path / "last.ckpt", tmp_path / "export") / "config.json").read_text())
    assert (config["model_type"], config["vocab_size"], config["mask_token_id"]) == ("flowlm-dit", V, None)


def test_model_card_carries_the_runs_last_scores(runs_env):
    """With the default callbacks and logger (a local MLflow store), the card and config.json carry the run's last
    validation loss (convergence.json) and its sampling scores (the MLflow run), each with its step."""
    import mlflow

    from runners.train import train

    result = train(compose_config(overrides=["experiment=sudoku_mdm_uncond", "scale=cpu", *FAST]))
    run = Path(result["run_dir"])
    out = export(run, runs_env / "export")
    config, card = json.loads((out / "config.json").read_text()), (out / "README.md").read_text()
    step = result["global_step"]
    final = json.loads((run / "convergence.json").read_text())["final_val_loss"]
    assert config["metrics_recorded"]["val/loss"] == {"value": final, "step": step, "source": "convergence.json"}
    logged = mlflow.MlflowClient(f"sqlite:///{runs_env / 'runs' / 'mlflow.db'}").get_run(result["mlflow_run_id"])
    scores = {k: v for k, v in logged.data.metrics.items() if k.startswith("eval/") and "sec_per_sample" not in k}
    assert len(scores) >= 4 and {k: config["metrics"][k] for k in scores} == scores
    assert all(config["metrics_recorded"][k]["step"] == step for k in scores)
    for key in ("val/loss", *scores):
        assert f"| {key} | {config['metrics'][key]:.6g} | {step} |" in card, key


def test_model_card_falls_back_on_the_checkpoints_own_history(tmp_path):
    """A checkpoint outside its run folder: the card's val loss is the last of the checkpoint's Convergence
    history up to its step."""
    history = {"Convergence": {"history": [(40, 3.0), (42, 2.0)], "wall_s": 1.0}}
    write_run_checkpoint(tmp_path / "step42.ckpt", callbacks=history)
    config = json.loads((export(tmp_path / "step42.ckpt", tmp_path / "export") / "config.json").read_text())
    assert config["metrics_recorded"]["val/loss"] == {
        "value": 2.0,
        "step": 42,
        "source": "checkpoint (Convergence history)",
    }


def test_model_card_reads_a_relative_mlflow_store(tmp_path):
    """A run launched with relative paths (FLOWLM_RUNS unset) finds its store beside its run folder, from any
    working folder: each eval/ score of the last evaluation up to the checkpoint's step (Lightning logs one during
    training at step − 1), of its own MLflow run, timing and NaN left out."""
    import sqlite3

    run = tmp_path / "launch" / "runs" / "tiny" / "cpu" / "seed0"
    (run / "checkpoints").mkdir(parents=True)
    config = {"logger": {"tracking_uri": "sqlite:///runs/mlflow.db"}, "paths": {"run_dir": "runs/tiny/cpu/seed0"}}
    write_run_checkpoint(run / "checkpoints" / "last.ckpt", config=config)
    (run / "mlflow_run_id").write_text("r1\n")
    acc = "eval/a/nfe2/accuracy"
    rows = [(acc, 10.0, "r1", 20, 0), (acc, 50.0, "r1", 41, 0), (acc, 90.0, "r1", 43, 0), (acc, 70.0, "r2", 41, 0)]
    rows += [("eval/a/nfe2/sec_per_sample", 0.1, "r1", 41, 0), ("eval/a/nfe2/nfe", 0.0, "r1", 41, 1)]
    with sqlite3.connect(tmp_path / "launch" / "runs" / "mlflow.db") as db:  # MLflow's metrics table, its columns
        db.execute(
            "CREATE TABLE metrics (key TEXT, value FLOAT, timestamp BIGINT, run_uuid TEXT, step BIGINT, is_nan BOOL)"
        )
        db.executemany("INSERT INTO metrics VALUES (?, ?, 0, ?, ?, ?)", rows)
    config = json.loads((export(run, tmp_path / "export") / "config.json").read_text())
    assert {k: v for k, v in config["metrics_recorded"].items() if k.startswith("eval/")} == {
        acc: {"value": 50.0, "step": 42, "source": "MLflow run r1 (mlflow.db)"}
    }


def test_an_export_killed_while_writing_its_weights_is_retried(tmp_path):
    """An export SIGKILLed while safetensors writes (its hidden temporary file half written) leaves nothing that
    refuses the retry; the retried folder holds exactly the export."""
    write_run_checkpoint(tmp_path / "last.ckpt")
    out = tmp_path / "export"
    code = f"""
import os, signal
from pathlib import Path
import safetensors.torch

def killed(tensors, filename, metadata=None):  # what safetensors does, cut short: a hidden temporary file
    (Path(filename).parent / ".tmpk1ll3d").write_bytes(b"partial")
    os.kill(os.getpid(), signal.SIGKILL)

safetensors.torch.save_file = killed
from runners.export import export
export({str(tmp_path / "last.ckpt")!r}, {str(out)!r})
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert out.is_dir() and not (out / "config.json").exists()
    export(tmp_path / "last.ckpt", out)
    transformers_files = {"configuration_flowlm.py", "modeling_flowlm.py", "flowlm_dit.py", "flowlm_loading.py"}
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "README.md", *transformers_files}


def test_every_exported_file_gets_the_same_mode(tmp_path):
    """The weights are not left 0600 (safetensors' temporary file): every file has a new file's mode here."""
    build_tokenizer().save_pretrained(str(tmp_path / "tok"))
    from datamodules.sources import load_tokenizer

    data = {"_target_": "datamodules.text.TextDataModule", "tokenizer": str(tmp_path / "tok")}
    write_run_checkpoint(tmp_path / "last.ckpt", data=data, vocab=len(load_tokenizer(tmp_path / "tok")))
    old = os.umask(0o022)
    try:
        out = export(tmp_path / "last.ckpt", tmp_path / "export")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert "tokenizer.json" in modes and set(modes.values()) == {0o644}, modes


def test_a_truncated_export_is_reported_corrupt(tmp_path):
    """A cut config.json (even to nothing) or model.safetensors is 'corrupt', not 'not an export'."""
    write_run_checkpoint(tmp_path / "last.ckpt")
    out = export(tmp_path / "last.ckpt", tmp_path / "export")
    config, weights = (out / "config.json").read_bytes(), (out / "model.safetensors").read_bytes()
    for cut in (len(config) // 2, 0):
        (out / "config.json").write_bytes(config[:cut])
        with pytest.raises(ValueError, match="is corrupt: its config.json is not valid JSON"):
            load_module(out)
    (out / "config.json").write_bytes(config)
    (out / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    with pytest.raises(ValueError, match="corrupt flowlm export: its model.safetensors is unreadable"):
        read_checkpoint(out)


@pytest.mark.parametrize("layout", ["dit", "llada"])
def test_an_mlfm_export_is_a_peft_adapter_that_round_trips(tmp_path, layout):
    """The folder is a PEFT adapter (LoRA factors under PEFT's names, the targets, r and alpha of the run) over
    base/, the time adaLN in model.safetensors; the suite reads it back as the same module, bit for bit."""
    from safetensors import safe_open

    from tests.pretrained.test_fmlm_plus_llama import tiny_llama

    backbone, options = (BACKBONE, {"init_from": "mdm.ckpt"}) if layout == "dit" else (tiny_llama(layout, V), {})
    options["adapter"] = {"lora_alpha": 5.0, "lora_rank": 3}
    module = write_run_checkpoint(tmp_path / "last.ckpt", backbone=backbone, module_class=MLFMModule, options=options)
    out = export(tmp_path / "last.ckpt", tmp_path / "export")
    adapter = json.loads((out / "adapter_config.json").read_text())
    prefix = "net." if layout == "dit" else ""
    assert (adapter["peft_type"], adapter["r"], adapter["lora_alpha"]) == ("LORA", 3, 5.0)
    assert sorted(adapter["target_modules"]) == sorted(prefix + name for name in module.net.lora_names)
    with safe_open(str(out / "adapter_model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert len(names) == 2 * len(module.net.lora_names)
    assert all(name.startswith("base_model.model." + prefix) and ".default" not in name for name in names)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert not any(key.startswith("base.") for key in f.keys())  # the time adaLN only
    mine, theirs = load_module(tmp_path / "last.ckpt").state_dict(), load_module(out).state_dict()
    assert mine.keys() == theirs.keys()
    assert all(theirs[k].dtype == v.dtype and torch.equal(theirs[k], v) for k, v in mine.items())
