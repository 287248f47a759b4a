"""The suite's portable checkpoint folder (docs/pretrained.md, Export): what ``flowlm-export`` writes and the suite
reads back by path (``init_from``, ``teacher``, ``flowlm-eval``).

A folder of ``config.json`` (the architecture, the method family, [MASK] id, vocabulary, the run's
hyper-parameters and ``flowlm`` record), ``model.safetensors`` (the checkpoint's ``state_dict``, the EMA weights
when an EMA ran, under the module's own names ``net.*``, dtypes as saved), ``README.md`` (a model card) and the
tokenizer's files when the run had a tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import Tensor

MARK = "flowlm_export"  # config.json key holding the format version
VERSION = 1
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
CARD = "README.md"


def is_export(path: Path) -> bool:
    """A folder written by ``write_export`` (its config.json carries ``flowlm_export``)."""
    config = path / CONFIG
    if not (path.is_dir() and config.is_file()):
        return False
    try:
        return MARK in json.loads(config.read_text())
    except (OSError, ValueError):
        return False


def write_export(folder: Path, *, state: dict[str, Tensor], config: dict, card: str) -> None:
    """Write config.json (with the format mark), model.safetensors (contiguous copies of ``state``) and README.md
    into ``folder`` (created; it must not hold files yet). ValueError for a config that is not JSON."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    if any(folder.iterdir()):
        raise ValueError(f"export folder {folder} is not empty: give a new or empty folder")
    try:
        text = json.dumps({MARK: VERSION, **config}, indent=2, sort_keys=False, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ValueError(f"the checkpoint's config is not JSON ({err}): it cannot be exported as is") from err
    save_file({name: t.detach().cpu().contiguous() for name, t in state.items()}, str(folder / WEIGHTS))
    (folder / CONFIG).write_text(text + "\n")
    (folder / CARD).write_text(card)


def read_export(folder: Path) -> tuple[dict, dict[str, Tensor]]:
    """(config, weights) of an export folder; ValueError for another format version or missing weights."""
    from safetensors.torch import load_file

    config = json.loads((folder / CONFIG).read_text())
    if config.get(MARK) != VERSION:
        raise ValueError(f"{folder} is a flowlm export of version {config.get(MARK)}, this suite reads {VERSION}")
    if not (folder / WEIGHTS).is_file():
        raise ValueError(f"{folder} is a flowlm export without its {WEIGHTS}")
    return config, load_file(str(folder / WEIGHTS))
