"""`flowlm-export RUN_OR_CKPT OUT_DIR`: a run's checkpoint (its EMA weights) as a Hugging Face-style folder that the
suite reads again by path (``method.init_from``, ``method.teacher``, ``flowlm-eval ckpt_path=``): config.json,
model.safetensors, the tokenizer's files when the run had one, and a README.md model card (docs/pretrained.md,
Export). The format itself is flowlm/pretrained/export.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sqlite3
import warnings
from pathlib import Path

from flowlm.project import git_commit
from flowlm.redaction import redact
from runners.console import console_script
from runners.outputs import check_writable

# Families whose DiT has a [MASK] row (at id = data_vocab_size); a LLaMA-family network records its own [MASK].
MASKED_FAMILIES = ("mdm", "mlfm")
# The input embedding of each network layout: DiT, DiT in MLFM's adapter, LLaMA-family MDM, the latter in an adapter.
EMBEDDINGS = (
    "net.embed.weight",
    "net.base.embed.weight",
    "net.model.embed_tokens.weight",
    "net.base.model.embed_tokens.weight",
)
RUN_ID_FILE = "mlflow_run_id"  # in the run folder: the run's MLflow run (runners/mlflow_run.py)


def checkpoint_of(path: str | os.PathLike) -> Path | str:
    """A run folder → its ``checkpoints/last.ckpt``; anything else as given (a checkpoint file or folder)."""
    last = Path(path) / "checkpoints" / "last.ckpt"
    return last if last.exists() else path


def run_metrics(ckpt: dict) -> dict[str, float]:
    """The scores the checkpoint's callbacks recorded (ModelCheckpoint: monitored value, best and current)."""
    out: dict[str, float] = {}
    for name, state in (ckpt.get("callbacks") or {}).items():
        if not isinstance(state, dict) or not state.get("monitor"):
            continue
        for key in ("best_model_score", "current_score"):
            value = state.get(key)
            if value is not None and math.isfinite(float(value)):
                out[f"{state['monitor']} ({key}, {name.split('{')[0]})"] = float(value)
    return out


def run_records(path: str | os.PathLike, ckpt: dict, run_config: dict) -> dict[str, dict]:
    """The run's own records of the weights at the checkpoint's step: name → {value, step, source}.

    The last validation loss: the run folder's convergence.json (its ``final_val_loss`` when it describes this step),
    else the checkpoint's Convergence history (its last entry up to the step). The sampling scores
    (``eval/<sampler>/nfe<budget>/<metric>``, timing left out): the last evaluation up to the step in the run's
    MLflow run (``_mlflow_scores``), read only from a local SQLite store (``logger.tracking_uri=sqlite:///...``),
    never from a server. The run folder is the checkpoint's ``<run>/checkpoints/..``; a checkpoint elsewhere has only
    its own history."""
    from callbacks.convergence import CONVERGENCE_FILE

    step = ckpt.get("global_step")
    where = Path(path)
    run_dir = where.parent.parent if where.parent.name == "checkpoints" else None
    out: dict[str, dict] = {}
    record = _json(run_dir / CONVERGENCE_FILE) if run_dir else None
    if record and record.get("steps") == step and _finite(record.get("final_val_loss")):
        monitor = (record.get("rule") or {}).get("monitor", "val/loss")
        out[monitor] = {"value": float(record["final_val_loss"]), "step": step, "source": CONVERGENCE_FILE}
    else:
        history = next((s.get("history") for n, s in (ckpt.get("callbacks") or {}).items() if n == "Convergence"), [])
        seen = [(int(s), float(v)) for s, v in history or [] if step is None or int(s) <= step]
        if seen and _finite(seen[-1][1]):
            monitor = ((run_config.get("callbacks") or {}).get("convergence") or {}).get("monitor", "val/loss")
            out[monitor] = {"value": seen[-1][1], "step": seen[-1][0], "source": "checkpoint (Convergence history)"}
    store = _sqlite_store(run_config, run_dir) if run_dir else None
    if store and store.is_file() and (run_dir / RUN_ID_FILE).is_file():
        run_id = (run_dir / RUN_ID_FILE).read_text().strip()
        for key, value, at in _mlflow_scores(store, run_id, step):
            out[key] = {"value": value, "step": at, "source": f"MLflow run {run_id} ({store.name})"}
    return out


def _sqlite_store(run_config: dict, run_dir: Path) -> Path | None:
    """The run's MLflow SQLite store; a relative one (``FLOWLM_RUNS`` unset) from the launch's working folder, found
    as the run folder less the relative ``paths.run_dir`` it was launched with. None for any other store."""
    uri = str((run_config.get("logger") or {}).get("tracking_uri") or "")
    if not uri.startswith("sqlite:///"):
        return None
    store = Path(uri.removeprefix("sqlite:///"))
    launched = Path(str((run_config.get("paths") or {}).get("run_dir") or "/")).parts
    here = run_dir.resolve().parts
    if not store.is_absolute() and not Path(*launched).is_absolute() and here[-len(launched) :] == launched:
        store = Path(*here[: -len(launched)]) / store
    return store


def _mlflow_scores(store: Path, run_id: str, step: int | None) -> list[tuple[str, float, int]]:
    """(key, value, global step evaluated) of each eval/ metric's last finite value for the weights up to ``step`` in
    an MLflow SQLite store, opened read-only; none when it cannot be read (a warning). Lightning logs a validation
    during training at its global step − 1 and one after training (the final evaluation) at its global step, so
    a logged step s ≤ ``step`` is the evaluation at step min(s + 1, ``step``)."""
    query = (
        "SELECT key, value, step FROM metrics WHERE run_uuid = ? AND key LIKE 'eval/%' AND is_nan = 0 "
        "AND step <= ? ORDER BY step, timestamp"
    )
    last = 2**62 if step is None else step
    try:
        with contextlib.closing(sqlite3.connect(f"{store.resolve().as_uri()}?mode=ro", uri=True)) as db:
            rows = db.execute(query, (run_id, last)).fetchall()
    except sqlite3.Error as err:
        warnings.warn(
            f"the model card leaves out the run's sampling scores: {store} is unreadable ({err})", stacklevel=3
        )
        return []
    scores = {key: (float(value), min(int(at) + 1, last)) for key, value, at in rows}
    return [(k, v, at) for k, (v, at) in sorted(scores.items()) if not k.endswith("/sec_per_sample") and _finite(v)]


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _finite(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def network_facts(meta: dict, backbone: dict, state: dict) -> dict:
    """config.json's ``model_type`` (the backbone: ``flowlm-dit``, ``flowlm-llama``, ``flowlm-qwen2``), ``vocab_size``
    (rows of the input embedding) and ``mask_token_id`` (the [MASK] input id: the DiT's extra row |V| for MDM and
    MLFM, none for its FMLM+ and AR; a LLaMA-family network's own, inside the vocabulary for LLaDA and Dream)."""
    embed = next((state[key] for key in EMBEDDINGS if key in state), None)
    rows = None if embed is None else int(embed.shape[0])
    if "_target_" in backbone:  # TargetKind.record: the built BidirectionalLM's spec
        arch = backbone.get("arch", "llama")
        return {"model_type": f"flowlm-{arch}", "vocab_size": rows, "mask_token_id": backbone.get("mask_id")}
    mask = meta.get("data_vocab_size") if meta.get("family") in MASKED_FAMILIES else None
    return {"model_type": "flowlm-dit", "vocab_size": rows, "mask_token_id": mask}


def export(
    source: str | os.PathLike, out_dir: str | os.PathLike, *, trust_pickle: bool = False, merge_mlfm: bool = False
) -> Path:
    """Write the export folder of a run's checkpoint; ValueError for a non-checkpoint, an export, or a full
    ``out_dir``, OSError for an ``out_dir`` that cannot be written (the folder's checks come before the checkpoint is
    read; nothing is written before any check). ``trust_pickle``: unpickle a checkpoint file in full
    (``lightning_modules.checkpoints.load_torch_file``); ``merge_mlfm``: an MLFM export also gets ``merged/``, its
    base with the LoRA folded in."""
    # here, not at the top: `flowlm-export --help` needs neither torch nor Lightning
    from flowlm.pretrained import export as fmt
    from lightning_modules.checkpoints import LIVE_KEY, checkpoint_backbone, read_checkpoint

    out = Path(out_dir)
    check_writable("out_dir", out)  # before the checkpoint is read: a read-only folder was found after it
    fmt.check_target(out)
    path = checkpoint_of(source)
    ckpt = read_checkpoint(path, trust_pickle=trust_pickle)
    meta = ckpt["flowlm"]
    if (meta.get("source") or {}).get("format") == "flowlm-export":
        raise ValueError(f"{source} is already a flowlm export: copy the folder instead")
    if "state_dict" not in ckpt or "hyper_parameters" not in ckpt:
        raise ValueError(f"{path} holds no weights or hyper-parameters: not a trained module's checkpoint")
    if merge_mlfm and meta.get("family") != "mlfm":  # it was silently ignored
        raise ValueError(
            f"--merge-mlfm folds an MLFM's LoRA into its base, but {source} is a '{meta.get('family')}' checkpoint: "
            "leave --merge-mlfm out"
        )
    hparams = dict(ckpt["hyper_parameters"])
    if "backbone" in hparams:
        hparams["backbone"] = checkpoint_backbone(ckpt)  # every DiT option spelled out
    state = ckpt["state_dict"]
    meta = redact(meta)  # a recorded URI's password (a tracking store's) stays out of config.json and the card
    run_config = meta.get("config") or {}
    tokenizer = _tokenizer(run_config, meta)
    records = run_records(path, ckpt, run_config)
    config = {
        "architectures": [meta.get("class_path", "").rpartition(".")[2]],
        **network_facts(meta, hparams.get("backbone") or {}, state),
        "family": meta.get("family"),
        "class_path": meta.get("class_path"),
        "backbone": hparams.get("backbone"),
        "data_vocab_size": meta.get("data_vocab_size"),
        "seq_len": meta.get("seq_len"),
        "weights": "EMA" if LIVE_KEY in ckpt else "as saved (the run had no EMA)",
        "global_step": ckpt.get("global_step"),
        "epoch": ckpt.get("epoch"),
        "git_commit": meta.get("git_commit", "not recorded (checkpoint written before the record existed)"),
        "exported_with_commit": git_commit(),
        "metrics": {**run_metrics(ckpt), **{name: r["value"] for name, r in records.items()}},
        "metrics_recorded": records,
        "source_checkpoint": str(Path(path).resolve()) if Path(path).exists() else str(path),
        "hyper_parameters": hparams,
        "flowlm": {key: value for key, value in meta.items() if key != "source"},
    }
    writers = [] if tokenizer is None else [lambda folder: tokenizer.save_pretrained(str(folder))]
    remote = fmt.transformers_files(
        meta.get("family"),
        hparams.get("backbone") or {},
        meta.get("data_vocab_size"),
        time_conditioning=bool(hparams.get("time_conditioning")),
    )
    if remote is None:  # FMLM+ on a LLaMA-family MDM: the same, its own modeling file (flowlm-llama / -qwen2)
        alpha = _lora_options(hparams)["lora_alpha"]
        remote = fmt.llama_flow_files(meta.get("family"), hparams.get("backbone") or {}, state, lora_alpha=alpha)
    if remote is not None:  # a DiT MDM, flow or AR model: AutoModel.from_pretrained(out, trust_remote_code=True)
        config.update(remote[0])
        writers.append(remote[1])
    layout = fmt.source_layout(meta.get("family"), hparams.get("backbone") or {}, state)
    if meta.get("family") == "mlfm":  # the LoRA as a PEFT adapter over base/, the MDM; the time adaLN beside
        layout = fmt.mlfm_peft(state, **_mlfm_parts(hparams, meta, run_config), merge=merge_mlfm)
    if layout is not None:  # a LLaMA-family MDM: its source's tensor names and config keys
        state, keys, write = layout
        config.update(keys)
        writers.append(write)

    def files(folder: Path) -> None:
        for write in writers:
            write(folder)

    config = redact(config)
    fmt.write_export(out, state=state, config=config, card=model_card(config, run_config), files=files)
    return out


def _mlfm_parts(hparams: dict, meta: dict, run_config: dict) -> dict:
    """``mlfm_peft``'s arguments: the frozen MDM's record (as an MDM module's), LoraConfig's alpha and dropout (the
    adapter's options, else its defaults) and the named base (``init_from``, else the backbone's pretrained source)."""
    from lightning_modules.mdm import MDMModule

    lora = _lora_options(hparams)
    sizes = {"data_vocab_size": meta.get("data_vocab_size"), "seq_len": meta.get("seq_len")}
    mdm = f"{MDMModule.__module__}.{MDMModule.__qualname__}"
    base_record = {
        "family": "mdm",
        "class_path": mdm,
        **sizes,
        "backbone": hparams["backbone"],
        "hyper_parameters": {**sizes, "backbone": hparams["backbone"], "optim": {}, "time_conditioning": False},
        "flowlm": {"family": "mdm", "class_path": mdm, **sizes, "config": None},
    }
    source = (run_config.get("backbone") or {}).get("source")
    name = str(hparams.get("init_from") or source or "base")
    return {"hparams": hparams, "base_record": base_record, "lora": lora, "base_name": name}


def _lora_options(hparams: dict) -> dict:
    """LoraConfig's ``lora_alpha`` and ``lora_dropout`` of a run's adapter: its options, else the adapter class's
    defaults (``LlamaAdaLNAdapter`` on the LLaMA family, ``MLFMAdapter`` on the DiT)."""
    import inspect

    from flowlm.backbones.adapters import MLFMAdapter
    from flowlm.backbones.llama import LlamaAdaLNAdapter

    adapter_cls = LlamaAdaLNAdapter if "_target_" in (hparams.get("backbone") or {}) else MLFMAdapter
    defaults = inspect.signature(adapter_cls).parameters
    options = hparams.get("adapter") or {}
    return {key: options.get(key, defaults[key].default) for key in ("lora_alpha", "lora_dropout")}


def _tokenizer(run_config: dict, meta: dict):
    """The run's tokenizer (text data: ``data.tokenizer``, with its PAD as the data module set it:
    ``data.pad_token``), else None."""
    data = run_config.get("data") or {}
    name = data.get("tokenizer")
    if not name:
        return None
    from datamodules.sources import PAD_ADD, load_tokenizer  # DataUnavailableError, with the ways to provide it

    tokenizer = load_tokenizer(name, data.get("pad_token") or PAD_ADD)
    if len(tokenizer) != meta.get("data_vocab_size"):
        raise ValueError(
            f"the run's tokenizer {name!r} has {len(tokenizer)} tokens, the checkpoint {meta.get('data_vocab_size')}:"
            " it changed since the run; export from where the run's tokenizer is"
        )
    return tokenizer


def model_card(config: dict, run_config: dict) -> str:
    """README.md: what the model is, what it was trained on, for how long, how it scored, and from which code."""
    data = run_config.get("data") or {}
    method = run_config.get("method") or {}
    records = config["metrics_recorded"]
    rows = [f"| {k} | {v['value']:.6g} | {v['step']} | {v['source']} |" for k, v in records.items()]
    rows += [
        f"| {k} | {v:.6g} | | checkpoint (ModelCheckpoint) |" for k, v in config["metrics"].items() if k not in records
    ]
    metrics = "\n".join(rows) or "| (none recorded) | | | |"
    return f"""---
library_name: flowlm
tags: [flowlm, {config["family"]}, diffusion-language-model]
---
# {run_config.get("name", "flowlm model")}

A flowlm `{config["family"]}` model (`{config["class_path"]}`), exported by `flowlm-export` from
`{config["source_checkpoint"]}`. Weights: {config["weights"]} (`model.safetensors`, {_names(config)}).

| | |
|---|---|
| method | `{method.get("_target_", config["class_path"])}` |
| data | `{data.get("_target_", "not recorded")}` {json.dumps({k: v for k, v in data.items() if k != "_target_"})} |
| vocabulary | {config["data_vocab_size"]} data tokens; {config["vocab_size"]} rows; [MASK] {config["mask_token_id"]} |
| sequence length | {config["seq_len"]} |
| backbone | {json.dumps(config["backbone"])} |
| steps | {config["global_step"]} (epoch {config["epoch"]}) |
| git commit (training) | `{config["git_commit"]}` |
| git commit (export) | `{config["exported_with_commit"]}` |

## Metrics recorded by the run
The last validation loss and sampling scores at or before step {config["global_step"]} (`runners/export.py`,
`run_records`).

| metric | value | step | source |
|---|---|---|---|
{metrics}

## Use
`method.init_from=DIR`, `method.teacher=DIR` or `flowlm-eval ckpt_path=DIR` (DIR = this folder); in Python
`lightning_modules.checkpoints.load_module(DIR)`.{_transformers_use(config)}
"""


def _names(config: dict) -> str:
    layout = config.get("weights_layout")
    return "the module's own names" if layout is None else f"{layout.upper()}'s own names and config keys"


def _transformers_use(config: dict) -> str:
    """The model card's transformers line, for an export that transformers loads."""
    layout = config.get("weights_layout")
    if layout == "dream":
        return (
            "\nIn Dream's layout (Qwen2 names): `AutoModelForCausalLM.from_pretrained(DIR)` (transformers' Qwen2, "
            "bidirectional: `is_causal` false); Dream's shift: the prediction for position i is `logits[:, i - 1]`."
        )
    if layout is not None:
        return (
            f"\nIn {layout.upper()}'s layout (its tensor names and config keys): "
            "`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` (transformers' Llama, bidirectional)."
        )
    if "auto_map" not in config:
        return ""
    modeling = config["auto_map"]["AutoModel"].partition(".")[0]
    return (
        "\nWith transformers only (no flowlm installed): `AutoModel.from_pretrained(DIR, trust_remote_code=True)`; "
        f"the call for this family is in `{modeling}.py`."
    )


@console_script(hydra=False)
def main(argv: list[str] | None = None) -> None:
    """Console entry point (a user error ends it in one line: runners/console.py)."""
    parser = argparse.ArgumentParser(prog="flowlm-export", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="a run folder (its checkpoints/last.ckpt) or a checkpoint file/folder")
    parser.add_argument("out_dir", help="a new or empty folder")
    parser.add_argument(
        "--trust-pickle",
        action="store_true",
        help="unpickle the checkpoint in full (it can run code from the file): only for a file you trust",
    )
    parser.add_argument(
        "--merge-mlfm",
        action="store_true",
        help="MLFM: also write merged/, the base with the LoRA folded in (loads without peft; the base's size again)",
    )
    args = parser.parse_args(argv)
    out = export(args.source, args.out_dir, trust_pickle=args.trust_pickle, merge_mlfm=args.merge_mlfm)
    print(f"exported {args.source} to {out}")


if __name__ == "__main__":
    main()
