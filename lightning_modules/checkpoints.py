"""Reading flowlm checkpoints and converting between method families (MDM → FMLM+ initialisation)."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import torch
from torch import Tensor, nn


def read_checkpoint(path: str | os.PathLike) -> dict:
    """The whole checkpoint dict (memory-mapped), with clear errors for missing or foreign files."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as err:  # noqa: BLE001 - any unpickling failure means the same thing here
        raise ValueError(f"{path} is not a readable PyTorch checkpoint ({type(err).__name__}: {err})") from err
    if not isinstance(ckpt, dict) or "flowlm" not in ckpt:
        raise ValueError(f"{path} is not a flowlm checkpoint (no 'flowlm' record): it was not written by flowlm-train")
    return ckpt


def read_checkpoint_meta(path: str | os.PathLike) -> dict:
    """The ``flowlm`` record of a checkpoint (family, class, vocabulary, config)."""
    return read_checkpoint(path)["flowlm"]


def import_class(path: str) -> type:
    """Import ``package.module.Class``."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def check_family(
    meta: dict, path: str | os.PathLike, *, family: str | tuple[str, ...], data_vocab_size: int, role: str
) -> None:
    """Refuse a checkpoint of another family (or one of several) or vocabulary before any compute."""
    families = (family,) if isinstance(family, str) else family
    if meta.get("family") not in families:
        expected = " or ".join(f"'{f}'" for f in families)
        raise ValueError(f"{role} {path} is a '{meta.get('family')}' checkpoint, expected a {expected} one")
    if meta.get("data_vocab_size") != data_vocab_size:
        raise ValueError(
            f"{role} {path} was trained on a vocabulary of {meta.get('data_vocab_size')} data tokens, "
            f"this run has {data_vocab_size}"
        )


# Rows of these tensors index the vocabulary; an MDM has one more row ([MASK], the last one).
VOCAB_ROWS = ("embed.weight", "final.linear.weight", "final.linear.bias")


def copy_backbone(net: nn.Module, state: dict[str, Tensor], *, prefix: str = "net.") -> dict[str, list[str]]:
    """Copy a checkpoint's DiT into ``net`` by name and shape; returns what was copied, sliced and left fresh.

    From an MDM the [MASK] rows (one extra vocabulary row) are dropped; parameters with no counterpart (an MDM has
    no second time embedding ``emb_t``) keep their fresh initialisation. A parameter present in both with another
    shape means another backbone: a ValueError names them.
    """
    report: dict[str, list[str]] = {"copied": [], "sliced": [], "fresh": []}
    mismatched = []
    own = net.state_dict()
    with torch.no_grad():
        for name, param in own.items():
            source = state.get(prefix + name)
            if source is None:
                report["fresh"].append(name)
                continue
            if name in VOCAB_ROWS and source.shape[0] == param.shape[0] + 1:
                source = source[: param.shape[0]]
                report["sliced"].append(name)
            if source.shape != param.shape:
                mismatched.append(f"{name}: MDM {tuple(source.shape)} vs {tuple(param.shape)}")
                continue
            param.copy_(source)
            report["copied"].append(name)
    if mismatched:
        raise ValueError("the source checkpoint has another backbone size: " + "; ".join(mismatched[:6]))
    return report
