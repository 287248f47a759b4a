"""`flowlm-export RUN_OR_CKPT OUT_DIR`: a run's checkpoint (its EMA weights) as a Hugging Face-style folder that the
suite reads again by path (``method.init_from``, ``method.teacher``, ``flowlm-eval ckpt_path=``): config.json,
model.safetensors, the tokenizer's files when the run had one, and a README.md model card (docs/pretrained.md,
Export). The format itself is flowlm/pretrained/export.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

from flowlm.pretrained import export as fmt
from lightning_modules.checkpoints import LIVE_KEY, checkpoint_backbone, read_checkpoint
from runners.paths import git_commit

# Families whose network has a [MASK] row (at id = data_vocab_size).
MASKED_FAMILIES = ("mdm", "mlfm")


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


def export(source: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write the export folder of a run's checkpoint; ValueError for a non-checkpoint, an export, or a full
    ``out_dir`` (all before anything is written)."""
    path = checkpoint_of(source)
    ckpt = read_checkpoint(path)
    meta = ckpt["flowlm"]
    if (meta.get("source") or {}).get("format") == "flowlm-export":
        raise ValueError(f"{source} is already a flowlm export: copy the folder instead")
    if "state_dict" not in ckpt or "hyper_parameters" not in ckpt:
        raise ValueError(f"{path} holds no weights or hyper-parameters: not a trained module's checkpoint")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"export folder {out} is not empty: give a new or empty folder")
    hparams = dict(ckpt["hyper_parameters"])
    if "backbone" in hparams:
        hparams["backbone"] = checkpoint_backbone(ckpt)  # every DiT option spelled out
    state = ckpt["state_dict"]
    family = meta.get("family")
    run_config = meta.get("config") or {}
    tokenizer = _tokenizer(run_config, meta)
    embed = state.get("net.embed.weight", state.get("net.base.embed.weight"))
    config = {
        "architectures": [meta.get("class_path", "").rpartition(".")[2]],
        "model_type": "flowlm-dit",
        "family": family,
        "class_path": meta.get("class_path"),
        "backbone": hparams.get("backbone"),
        "data_vocab_size": meta.get("data_vocab_size"),
        "vocab_size": None if embed is None else int(embed.shape[0]),
        "mask_token_id": meta.get("data_vocab_size") if family in MASKED_FAMILIES else None,
        "seq_len": meta.get("seq_len"),
        "weights": "EMA" if LIVE_KEY in ckpt else "as saved (the run had no EMA)",
        "global_step": ckpt.get("global_step"),
        "epoch": ckpt.get("epoch"),
        "git_commit": meta.get("git_commit", "not recorded (checkpoint written before the record existed)"),
        "exported_with_commit": git_commit(),
        "metrics": run_metrics(ckpt),
        "source_checkpoint": str(Path(path).resolve()) if Path(path).exists() else str(path),
        "hyper_parameters": hparams,
        "flowlm": {key: value for key, value in meta.items() if key != "source"},
    }
    fmt.write_export(out, state=state, config=config, card=model_card(config, run_config))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out


def _tokenizer(run_config: dict, meta: dict):
    """The run's tokenizer (text data: ``data.tokenizer``, with its [PAD] as the data module adds it), else None."""
    name = (run_config.get("data") or {}).get("tokenizer")
    if not name:
        return None
    from datamodules.sources import load_tokenizer  # DataUnavailableError, with the ways to provide it, offline

    tokenizer = load_tokenizer(name)
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
    metrics = "\n".join(f"| {k} | {v:.6g} |" for k, v in config["metrics"].items()) or "| (none recorded) | |"
    return f"""---
library_name: flowlm
tags: [flowlm, {config["family"]}, diffusion-language-model]
---
# {run_config.get("name", "flowlm model")}

A flowlm `{config["family"]}` model (`{config["class_path"]}`), exported by `flowlm-export` from
`{config["source_checkpoint"]}`. Weights: {config["weights"]} (`model.safetensors`, the module's own names).

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

## Metrics recorded in the checkpoint
| metric | value |
|---|---|
{metrics}

## Use
`method.init_from=DIR`, `method.teacher=DIR` or `flowlm-eval ckpt_path=DIR` (DIR = this folder); in Python
`lightning_modules.checkpoints.load_module(DIR)`.
"""


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    parser = argparse.ArgumentParser(prog="flowlm-export", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="a run folder (its checkpoints/last.ckpt) or a checkpoint file/folder")
    parser.add_argument("out_dir", help="a new or empty folder")
    args = parser.parse_args(argv)
    out = export(args.source, args.out_dir)
    print(f"exported {args.source} to {out}")


if __name__ == "__main__":
    main()
