"""The suite's portable checkpoint folder (docs/pretrained.md, Export): what ``flowlm-export`` writes and the suite
reads back by path (``init_from``, ``teacher``, ``flowlm-eval``).

A folder of ``config.json`` (the architecture, the method family, [MASK] id, vocabulary, the run's
hyper-parameters and ``flowlm`` record), ``model.safetensors`` (the checkpoint's ``state_dict``, the EMA weights
when an EMA ran, under the module's own names ``net.*``, dtypes as saved), ``README.md`` (a model card) and the
tokenizer's files when the run had a tokenizer. A DiT network of the MDM, flow or AR family also gets the
transformers files (``transformers_files``): ``AutoModel.from_pretrained(folder, trust_remote_code=True)`` loads it.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

from torch import Tensor

import flowlm.backbones.dit as dit_module

MARK = "flowlm_export"  # config.json key holding the format version
VERSION = 1
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
CARD = "README.md"
PARTIAL = ".flowlm-export-partial"  # the folder an export is written into before it is moved into place
REMOTE = Path(__file__).with_name("hf_remote")  # the transformers configuration and model shipped in an export
REMOTE_FILES = ("configuration_flowlm.py", "modeling_flowlm.py")
AUTO_FAMILIES = ("mdm", "flow", "ar")  # DiT families transformers loads (MLFM's adapter and the LLaMA family: not yet)


def transformers_files(
    family: str | None, backbone: dict, data_vocab_size: int, *, time_conditioning: bool = False
) -> tuple[dict, Callable[[Path], None]] | None:
    """(config.json keys, a writer of the files) that make an export of a DiT network loadable by transformers'
    ``AutoModel`` with ``trust_remote_code``: ``auto_map``, ``dit`` (the DiT's constructor arguments as the module
    built it: |V| + 1 input rows with [MASK] or [START], two times for a flow model, causal for AR) and the
    configuration, the model and the suite's DiT source (``flowlm_dit.py``, torch only) beside the weights. None for
    another backbone or family."""
    if "_target_" in backbone or family not in AUTO_FAMILIES:
        return None
    dit = {**backbone, "vocab_size": data_vocab_size + (family != "flow"), "two_times": family == "flow"}
    if family == "ar":
        dit["causal"] = True
    keys = {
        "architectures": ["FlowLMModel"],
        "auto_map": {"AutoConfig": "configuration_flowlm.FlowLMConfig", "AutoModel": "modeling_flowlm.FlowLMModel"},
        "dit": dit,
        "time_conditioning": time_conditioning,
    }

    def write(folder: Path) -> None:
        for name in REMOTE_FILES:
            shutil.copyfile(REMOTE / name, folder / name)
        shutil.copyfile(dit_module.__file__, folder / "flowlm_dit.py")

    return keys, write


def is_export(path: Path) -> bool:
    """A folder written by ``write_export`` (its config.json carries ``flowlm_export``)."""
    config = path / CONFIG
    if not (path.is_dir() and config.is_file()):
        return False
    try:
        return MARK in json.loads(config.read_text())
    except (OSError, ValueError):
        return False


def check_target(folder: Path) -> None:
    """ValueError unless ``folder`` is new, or an empty folder but for the leftovers of an interrupted export; the
    message names what it holds (hidden files too)."""
    if not folder.exists():
        return
    if not folder.is_dir():
        raise ValueError(f"export folder {folder} is a file: give a new or empty folder")
    held = sorted(p.name for p in folder.iterdir() if not p.name.startswith(PARTIAL))
    if held:
        shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
        raise ValueError(f"export folder {folder} is not empty ({shown}): give a new or empty folder")


def write_export(
    folder: Path, *, state: dict[str, Tensor], config: dict, card: str, files: Callable[[Path], None] | None = None
) -> None:
    """Write config.json (with the format mark), model.safetensors (contiguous copies of ``state``), README.md and
    what ``files`` writes into a folder it is given (the tokenizer's) into ``folder`` (created; empty but for the
    leftovers of an interrupted export, which are removed). ValueError for a config that is not JSON.

    Everything is written into a hidden ``.flowlm-export-partial-*`` folder inside ``folder`` and moved up when
    complete, config.json last: an interrupted export leaves no file that makes ``folder`` an export or non-empty.
    Every file gets the mode a new file gets here (safetensors writes 0600)."""
    from safetensors.torch import save_file

    try:
        text = json.dumps({MARK: VERSION, **config}, indent=2, sort_keys=False, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ValueError(f"the checkpoint's config is not JSON ({err}): it cannot be exported as is") from err
    check_target(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for leftover in folder.glob(f"{PARTIAL}*"):
        if leftover.is_dir():
            shutil.rmtree(leftover)
        else:
            leftover.unlink()
    staging = folder / f"{PARTIAL}-{os.getpid()}"
    staging.mkdir()
    try:
        (staging / CARD).write_text(card)
        save_file({name: t.detach().cpu().contiguous() for name, t in state.items()}, str(staging / WEIGHTS))
        (staging / CONFIG).write_text(text + "\n")
        if files is not None:
            files(staging)
        mode = stat.S_IMODE((staging / CARD).stat().st_mode)
        for path in sorted(staging.iterdir(), key=lambda p: p.name == CONFIG):  # config.json last
            if path.is_file():
                path.chmod(mode)
            os.replace(path, folder / path.name)
        staging.rmdir()
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def read_export(folder: Path) -> tuple[dict, dict[str, Tensor]]:
    """(config, weights) of an export folder; ValueError for another format version or missing weights."""
    from safetensors.torch import load_file

    config = json.loads((folder / CONFIG).read_text())
    if config.get(MARK) != VERSION:
        raise ValueError(f"{folder} is a flowlm export of version {config.get(MARK)}, this suite reads {VERSION}")
    if not (folder / WEIGHTS).is_file():
        raise ValueError(f"{folder} is a flowlm export without its {WEIGHTS}")
    try:
        return config, load_file(str(folder / WEIGHTS))
    except Exception as err:  # noqa: BLE001 - safetensors reports a cut file in several ways
        raise ValueError(
            f"{folder} is a corrupt flowlm export: its {WEIGHTS} is unreadable ({type(err).__name__}: {err}); a "
            "truncated copy: copy or export it again"
        ) from err
