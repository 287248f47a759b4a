"""Reading flowlm checkpoints and converting between method families (MDM → FMLM+ initialisation).

A checkpoint is a file (one process, DDP) or, from a sharded run (trainer=fsdp2 / fsdp), a folder of per-rank
shards (torch.distributed.checkpoint) plus Lightning's ``meta.pt``; readers here take either and give the same dict.
``read_checkpoint`` is the one place a source is resolved: a hub name or path (flowlm/pretrained/hub.py), then a
flowlm checkpoint, a ``flowlm-export`` folder, or a foreign pretrained MDM whose layout a registered reader detects
(flowlm/pretrained/formats.py: MDLM's HF folder and Lightning .ckpt), converted to the same dict (an MDM module's).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import torch
from torch import Tensor, nn

from flowlm.backbones.dit import RELEASED_OPTIONS, legacy_backbone_options
from flowlm.pretrained.export import is_export, read_export
from flowlm.pretrained.formats import PretrainedMDM, detect_format, insert_pad_row, known_formats
from flowlm.pretrained.hub import resolve_source
from lightning_modules.sharding import is_dtensor

# Lightning's record of everything but weights and optimizer states in a sharded checkpoint folder.
SHARDED_META = "meta.pt"
# Inside a sharded checkpoint's weights the EMA callback keeps the live (non-averaged) weights under this key (the
# top-level key of the same name in a file checkpoint; Lightning's WeightAveraging layout).
LIVE_KEY = "current_model_state"
# The module a foreign pretrained MDM is read as (its hyper-parameters are built from the source).
FOREIGN_MDM_CLASS = "lightning_modules.mdm.MDMModule"


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """A folder written by a sharded strategy (it holds ``meta.pt``)."""
    return Path(path).is_dir() and (Path(path) / SHARDED_META).is_file()


def read_checkpoint(path: str | os.PathLike, *, data_vocab_size: int | None = None) -> dict:
    """The whole checkpoint dict (memory-mapped), with clear errors for missing or foreign files.

    ``path`` may be a hub name (``owner/name[@revision]``, resolved through the HF cache). A sharded folder is
    consolidated on this process (full tensors, in memory; no process group needed): its ``state_dict`` holds the
    EMA weights and ``current_model_state`` the live ones, as in a file checkpoint; optimizer states are left out
    (see ``consolidate_checkpoint``). An export folder and a foreign pretrained MDM give the same layout, the
    latter as an MDM module's (``foreign_checkpoint``; ``data_vocab_size``: the run's, see there).
    """
    path = resolve_source(path)
    if path.is_dir():
        if is_export(path):
            return export_checkpoint(path)
        if not (path / SHARDED_META).is_file():
            fmt = detect_format(path)
            if fmt is None:
                raise ValueError(
                    f"{path} is a folder but not a sharded checkpoint (no {SHARDED_META}: an interrupted save, or not "
                    f"a checkpoint), nor an export, nor any of the pretrained layouts read here "
                    f"({'; '.join(known_formats())})"
                )
            return foreign_checkpoint(fmt.read(path, None), data_vocab_size)
        ckpt = consolidate_checkpoint(path)
    elif not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    else:
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        except Exception as err:  # noqa: BLE001 - any unpickling failure means the same thing here
            raise ValueError(f"{path} is not a readable PyTorch checkpoint ({type(err).__name__}: {err})") from err
        fmt = detect_format(path, ckpt) if isinstance(ckpt, dict) and "flowlm" not in ckpt else None
        if fmt is not None:
            return foreign_checkpoint(fmt.read(path, ckpt), data_vocab_size)
    if not isinstance(ckpt, dict) or "flowlm" not in ckpt:
        raise ValueError(
            f"{path} is not a flowlm checkpoint (no 'flowlm' record): it was not written by flowlm-train, and it is "
            f"none of the pretrained layouts read here ({'; '.join(known_formats())})"
        )
    return ckpt


def foreign_checkpoint(model: PretrainedMDM, data_vocab_size: int | None = None) -> dict:
    """A foreign pretrained MDM as the checkpoint of an MDM module (time-agnostic, its backbone options), weights
    under ``net.*`` (the EMA ones in ``state_dict``, the live ones, if any, in ``current_model_state``).

    When the run's ``data_vocab_size`` is the source's + 1, the run's data add a [PAD] the source lacks (the
    suite's GPT-2 data: 50 257 + [PAD]; MDLM: 50 257 + [MASK]): a PAD row is inserted before [MASK]
    (``insert_pad_row``: every other logit unchanged). Any other difference is left for ``check_family`` to refuse.
    """
    if data_vocab_size is not None and data_vocab_size == model.data_vocab_size + 1:
        model = insert_pad_row(model)
    ckpt = {
        "flowlm": {
            "family": "mdm",
            "class_path": FOREIGN_MDM_CLASS,
            "data_vocab_size": model.data_vocab_size,
            "seq_len": model.seq_len,
            "config": None,
            "source": model.provenance,
        },
        "hyper_parameters": {
            "data_vocab_size": model.data_vocab_size,
            "seq_len": model.seq_len,
            "backbone": dict(model.backbone),
            "optim": {},
            "time_conditioning": False,
        },
        "state_dict": {"net." + name: t for name, t in model.state.items()},
        "global_step": 0,
    }
    if model.live is not None:
        ckpt[LIVE_KEY] = {"net." + name: t for name, t in model.live.items()}
    return ckpt


def export_checkpoint(path: Path) -> dict:
    """A ``flowlm-export`` folder as the checkpoint dict it was written from (weights, record, hyper-parameters)."""
    config, state = read_export(path)
    record = {**config["flowlm"], "source": {"format": "flowlm-export", "path": str(path)}}
    return {
        "flowlm": record,
        "hyper_parameters": config["hyper_parameters"],
        "state_dict": state,
        "global_step": config.get("global_step"),
    }


def read_checkpoint_meta(path: str | os.PathLike, *, data_vocab_size: int | None = None) -> dict:
    """The ``flowlm`` record of a checkpoint (family, class, vocabulary, config); a sharded folder's weights are not
    read."""
    local = resolve_source(path)
    if local.is_dir() and (local / SHARDED_META).is_file():
        return _read_sharded_meta(local)["flowlm"]
    return read_checkpoint(local, data_vocab_size=data_vocab_size)["flowlm"]


def verify_checkpoint(path: str | os.PathLike) -> None:
    """Raise ValueError unless ``path`` is a complete flowlm checkpoint, without reading its tensors: a file's
    archive index, or a folder's ``meta.pt``, shard index and every shard file at its full length."""
    path = Path(path)
    if not path.is_dir():
        read_checkpoint(path)  # memory-mapped: reads the archive's index, not the tensors
        return
    _read_sharded_meta(path)
    metadata = read_shard_index(path)
    sizes: dict[str, int] = {}
    for info in getattr(metadata, "storage_data", {}).values():
        name = info.relative_path
        sizes[name] = max(sizes.get(name, 0), info.offset + info.length)
    for name, size in sorted(sizes.items()):
        shard = path / name
        if not shard.is_file():
            raise ValueError(f"{path} is an incomplete sharded checkpoint: shard {name} is missing")
        if shard.stat().st_size < size:
            raise ValueError(
                f"{path} is an incomplete sharded checkpoint: shard {name} has {shard.stat().st_size} bytes, "
                f"its index expects {size}"
            )


def consolidate_checkpoint(path: str | os.PathLike, *, optimizer: bool = False) -> dict:
    """A sharded checkpoint folder as one checkpoint dict of full tensors, the layout of a file checkpoint.

    Works for ModelParallelStrategy (FSDP2) folders, whose weights are under ``state_dict``, and FSDPStrategy ones
    (``model``). The EMA's live weights (``state_dict.current_model_state``) move to the top-level
    ``current_model_state``. Optimizer states (FQN-keyed, as the sharded strategies save them) are read only with
    ``optimizer=True``, as ``optimizer_states``. Everything is held in CPU memory on this process.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    path = Path(path)
    ckpt = _read_sharded_meta(path)
    tops = {key.split(".", 1)[0] for key in read_shard_index(path).state_dict_metadata}
    weights_key = "state_dict" if "state_dict" in tops else "model"
    if weights_key not in tops:
        raise ValueError(f"{path} holds no weights (its shards hold {sorted(tops)})")
    state: dict = {}
    try:
        _load_state_dict(
            state,
            storage_reader=FileSystemReader(path),
            planner=_EmptyStateDictLoadPlanner(keys=None if optimizer else {weights_key}),
            no_dist=True,
        )
    except Exception as err:  # noqa: BLE001 - a damaged shard fails in many ways; all mean the same here
        raise ValueError(f"{path} is not a readable sharded checkpoint ({type(err).__name__}: {err})") from err
    weights = state.pop(weights_key)
    live = weights.pop(LIVE_KEY, None)
    ckpt["state_dict"] = weights
    if live is not None:
        ckpt[LIVE_KEY] = live
    if optimizer:
        count = sum(1 for key in state if key.startswith("optimizer_"))
        ckpt["optimizer_states"] = [state.pop(f"optimizer_{i}") for i in range(count)]
    return ckpt


def load_module(
    path: str | os.PathLike, *, map_location: str | torch.device = "cpu", data_vocab_size: int | None = None
):
    """The LightningModule a checkpoint (file, sharded folder, export folder or foreign pretrained MDM, by path or
    hub name) holds, built from its hyper-parameters, with the checkpoint's ``state_dict`` (the EMA weights when an
    EMA ran), on ``map_location``. A backbone saved before an option of the DiT existed is built as it was then
    (``legacy_backbone_options``). ``data_vocab_size``: the run's, for a foreign source (``foreign_checkpoint``)."""
    path = resolve_source(path)
    ckpt = read_checkpoint(path, data_vocab_size=data_vocab_size)  # a file: memory-mapped, read once by Lightning
    cls = import_class(ckpt["flowlm"]["class_path"])
    if path.is_file() and "source" not in ckpt["flowlm"]:
        return cls.load_from_checkpoint(path, map_location=map_location, **_backbone_kwargs(ckpt))
    from lightning.pytorch.core.saving import _load_state  # what load_from_checkpoint runs once the dict is read

    return _load_state(cls, ckpt, strict=True, **_backbone_kwargs(ckpt)).to(map_location)


def checkpoint_backbone(ckpt: dict) -> dict:
    """The backbone config a checkpoint was trained with, options it predates filled in as they were then (a DiT;
    a ``_target_`` one, the LLaMA family, is recorded whole)."""
    backbone = dict(ckpt.get("hyper_parameters", {}).get("backbone") or {})
    return backbone if "_target_" in backbone else legacy_backbone_options(backbone)


def _backbone_kwargs(ckpt: dict) -> dict:
    return {"backbone": checkpoint_backbone(ckpt)} if "backbone" in ckpt.get("hyper_parameters", {}) else {}


def check_backbone_options(
    ckpt: dict, backbone: dict, path: str | os.PathLike, *, role: str, time_conditioned: bool
) -> None:
    """Refuse, before any compute, a source checkpoint whose DiT would compute another function with its weights
    in a network built from ``backbone``: another attention soft-cap or head count (same shapes), or, when the
    source read its time (``time_conditioned``), another time-feature scale."""
    source, target = checkpoint_backbone(ckpt), {**RELEASED_OPTIONS, **backbone}  # a new DiT's defaults
    keys = ("attn_softcap", "n_heads") + (("time_scale",) if time_conditioned else ())
    diff = [
        f"{key}={source[key]!r} there, {target[key]!r} here"
        for key in keys
        if key in source and key in target and source[key] != target[key]
    ]
    if diff:
        raise ValueError(
            f"{role} {path} was trained with another backbone ({'; '.join(diff)}): set backbone.<option> to the "
            "checkpoint's value"
        )


def _read_sharded_meta(path: Path) -> dict:
    meta_file = path / SHARDED_META
    if not meta_file.is_file():
        raise ValueError(
            f"{path} is a folder but not a sharded checkpoint (no {SHARDED_META}: an interrupted save, or not a "
            "checkpoint)"
        )
    try:
        meta = torch.load(meta_file, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 - any unpickling failure means the same thing here
        raise ValueError(f"{meta_file} is not readable ({type(err).__name__}: {err})") from err
    if not isinstance(meta, dict) or "flowlm" not in meta:
        raise ValueError(f"{path} is not a flowlm checkpoint (no 'flowlm' record): it was not written by flowlm-train")
    return meta


def read_shard_index(path: Path):
    """The torch.distributed.checkpoint index (.metadata) of a sharded folder; ValueError when unreadable."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(path).read_metadata()
    except Exception as err:  # noqa: BLE001 - a missing or truncated index fails in many ways
        raise ValueError(
            f"{path} is an incomplete sharded checkpoint: its shard index (.metadata) is unreadable "
            f"({type(err).__name__}: {err})"
        ) from err


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


def copy_backbone(
    net: nn.Module, state: dict[str, Tensor], *, prefix: str = "net.", partial_modules: bool = False
) -> dict[str, list[str]]:
    """Copy a checkpoint's DiT into ``net`` by name and shape; returns what was copied, sliced and left fresh.

    From an MDM the [MASK] rows (one extra vocabulary row) are dropped; modules the source lacks (an MDM has no
    second time embedding ``emb_t``) keep their fresh initialisation. Another backbone is a ValueError naming
    the tensors: a parameter present in both with another shape, a source tensor with no counterpart here (a
    deeper source: more ``blocks``), or a fresh parameter of a module the source has (a deeper ``net``), unless
    ``partial_modules`` (adapters that add parameters inside copied modules check their own).
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
            if is_dtensor(param):  # a sharded net (trainer=fsdp2): every rank keeps its own slice, no communication
                from torch.distributed.tensor import distribute_tensor

                source = source.to(device=param.device, dtype=param.dtype)
                source = distribute_tensor(source, param.device_mesh, param.placements, src_data_rank=None)
            param.copy_(source)
            report["copied"].append(name)
    source_names = [key[len(prefix) :] for key in state if key.startswith(prefix)]
    unused = [name for name in source_names if name not in own]
    if unused:
        mismatched.append(f"{len(unused)} source tensor(s) with no counterpart here ({', '.join(unused[:3])}, ...)")
    source_modules = {name.partition(".")[0] for name in source_names}  # a fresh `blocks.3` of a 3-block source
    missing = [name for name in report["fresh"] if name.partition(".")[0] in source_modules]
    if missing and not partial_modules:
        mismatched.append(f"{len(missing)} tensor(s) here that the source lacks ({', '.join(missing[:3])}, ...)")
    if mismatched:
        raise ValueError("the source checkpoint has another backbone size: " + "; ".join(mismatched[:6]))
    return report
