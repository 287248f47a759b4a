"""Reading flowlm checkpoints and converting between method families (MDM → FMLM+ initialisation).

A checkpoint is a file (one process, DDP) or, from a sharded run (trainer=fsdp2 / fsdp), a folder of per-rank
shards (torch.distributed.checkpoint) plus Lightning's ``meta.pt``; readers here take either and give the same dict.
``read_checkpoint`` is the one place a source is resolved: a hub name or path (flowlm/pretrained/hub.py), then a
flowlm checkpoint, a ``flowlm-export`` folder, or a foreign pretrained MDM whose layout a registered reader detects
(flowlm/pretrained/formats.py: MDLM's HF folder and Lightning .ckpt), converted to the same dict (an MDM module's).

Every torch file is unpickled with ``weights_only=True`` (``load_torch_file``): tensors, plain containers and the
types in ``allowed_globals``; a file that needs anything else is refused unless the user trusts it by name
(``trust_pickle=True``, or its path in ``FLOWLM_TRUST_PICKLE``; docs/reliability.md, Checkpoints are data).
"""

from __future__ import annotations

import collections
import importlib
import json
import os
import pickle
import typing
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

from flowlm.backbones.dit import RELEASED_OPTIONS, legacy_backbone_options
from flowlm.options import as_bool
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
# Checkpoint files (or folders: every file under them) the user trusts to be unpickled in full, os.pathsep-separated.
TRUST_ENV = "FLOWLM_TRUST_PICKLE"


class UntrustedCheckpointError(ValueError):
    """A checkpoint file that only a full unpickling (which can run code from the file) could read."""


def allowed_globals() -> list:
    """What a checkpoint may hold besides tensors and plain containers (torch's own allow-list): OmegaConf containers
    with their metadata and the types it names (a DictConfig ``hyper_parameters``, which Lightning saves as is with
    its type; MDLM's ``.ckpt``). ``collections.defaultdict`` (OmegaConf's resolver cache) is read as a dict, the one
    kind the weights-only unpickler fills, and made a defaultdict again by ``load_torch_file``."""
    from omegaconf import DictConfig, ListConfig
    from omegaconf.base import ContainerMetadata, Metadata
    from omegaconf.nodes import AnyNode

    omegaconf = [DictConfig, ListConfig, ContainerMetadata, Metadata, AnyNode, typing.Any, dict, list, int]
    return [*omegaconf, (_dict_of_items, "collections.defaultdict")]


def _dict_of_items(default_factory=None, *args) -> dict:
    return dict(*args)


def is_trusted(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a file, or lies under a folder, that ``FLOWLM_TRUST_PICKLE`` names."""
    path = Path(path).resolve()
    for entry in filter(None, os.environ.get(TRUST_ENV, "").split(os.pathsep)):
        trusted = Path(entry).expanduser().resolve()
        if path == trusted or path.is_relative_to(trusted):
            return True
    return False


def trusts(path: str | os.PathLike, trust_pickle: object) -> bool:
    """Whether ``path`` is unpickled in full: ``trust_pickle`` as a real boolean (``as_bool``: the string "no" is
    truthy, and ``trust_pickle=no`` unpickled a crafted file; an unclear value is refused) or the path named in
    ``FLOWLM_TRUST_PICKLE``."""
    return as_bool("trust_pickle", trust_pickle) or is_trusted(path)


def load_torch_file(path: str | os.PathLike, *, trust_pickle: bool = False, mmap: bool = True):
    """``torch.load`` of a checkpoint file on the CPU with ``weights_only=True`` and ``allowed_globals``; a file
    that needs more (a pickled object whose loading could run code) is an ``UntrustedCheckpointError`` naming the
    file and its refused globals, raised before anything of it runs. ``trust_pickle`` (or ``path`` in
    ``FLOWLM_TRUST_PICKLE``) unpickles it in full (``weights_only=False``). Other failures propagate as torch's."""
    path = Path(path)
    if trusts(path, trust_pickle):
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    with torch.serialization.safe_globals(allowed_globals()):
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except pickle.UnpicklingError:
            try:
                refused = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))
            except Exception:  # noqa: BLE001 - not a torch zip archive: an unreadable file, not an untrusted one
                refused = []
            if not refused:
                raise
            raise UntrustedCheckpointError(
                f"{path} holds pickled objects beyond tensors and the allowed types ({', '.join(refused)}): "
                "unpickling it could run code from the file, so it is not loaded. If you trust where it came from, "
                f"load it with trust_pickle=True (flowlm-export --trust-pickle) or name it in {TRUST_ENV}="
                f"{path.resolve()} (a file, or a folder for every file under it; {os.pathsep}-separated)"
            ) from None
    _restore_resolver_caches(payload)
    return payload


def _restore_resolver_caches(obj, depth: int = 0) -> None:
    """Give every OmegaConf container in ``obj`` (dicts and lists walked) its resolver cache back as a defaultdict."""
    from omegaconf import Container

    if isinstance(obj, Container):
        meta = obj._metadata
        meta.resolver_cache = collections.defaultdict(dict, meta.resolver_cache)
    elif depth < 8 and isinstance(obj, dict | list | tuple):
        for value in obj.values() if isinstance(obj, dict) else obj:
            _restore_resolver_caches(value, depth + 1)


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """A folder written by a sharded strategy (it holds ``meta.pt``)."""
    return Path(path).is_dir() and (Path(path) / SHARDED_META).is_file()


def read_checkpoint(path: str | os.PathLike, *, data_vocab_size: int | None = None, trust_pickle: bool = False) -> dict:
    """The whole checkpoint dict (memory-mapped), with clear errors for missing, foreign or corrupt files.

    ``path`` may be a hub name (``owner/name[@revision]``, resolved through the HF cache). A sharded folder is
    consolidated on this process (full tensors, in memory; no process group needed): its ``state_dict`` holds the
    EMA weights and ``current_model_state`` the live ones, as in a file checkpoint; optimizer states are left out
    (see ``consolidate_checkpoint``). An export folder and a foreign pretrained MDM give the same layout, the
    latter as an MDM module's (``foreign_checkpoint``; ``data_vocab_size``: the run's, see there). Torch files are
    read by ``load_torch_file`` (``trust_pickle``: see there).
    """
    path = resolve_source(path)
    if path.is_dir():
        config = path / "config.json"  # an export's or a pretrained folder's description
        if config.is_file():
            try:
                json.loads(config.read_text())
            except (UnicodeDecodeError, ValueError) as err:
                raise ValueError(
                    f"{path} is corrupt: its config.json is not valid JSON ({err}); a truncated copy or an interrupted "
                    "write: copy or export it again"
                ) from err
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
        ckpt = consolidate_checkpoint(path, trust_pickle=trust_pickle)
    elif not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    else:
        try:
            ckpt = load_torch_file(path, trust_pickle=trust_pickle)
        except UntrustedCheckpointError:
            raise
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


def checkpoint_of(module, **extra) -> dict:
    """What Lightning saves for ``module`` without a trainer's states (its state dict, hyper-parameters and version,
    ``extra``'s keys, then the module's ``on_save_checkpoint``: the flowlm record): a checkpoint in the format
    ``flowlm-train`` writes, for ``torch.save`` (benchmarks and tests build theirs this way)."""
    import lightning

    ckpt = {
        "state_dict": module.state_dict(),
        "hyper_parameters": dict(module.hparams),
        "pytorch-lightning_version": lightning.__version__,
        **extra,
    }
    module.on_save_checkpoint(ckpt)
    return ckpt


def read_checkpoint_meta(
    path: str | os.PathLike, *, data_vocab_size: int | None = None, trust_pickle: bool = False
) -> dict:
    """The ``flowlm`` record of a checkpoint (family, class, vocabulary, config); a sharded folder's weights are not
    read."""
    local = resolve_source(path)
    if local.is_dir() and (local / SHARDED_META).is_file():
        return _read_sharded_meta(local, trust_pickle=trust_pickle)["flowlm"]
    return read_checkpoint(local, data_vocab_size=data_vocab_size, trust_pickle=trust_pickle)["flowlm"]


def verify_checkpoint(path: str | os.PathLike, *, trust_pickle: bool = False) -> None:
    """Raise ValueError unless ``path`` is a complete flowlm checkpoint, without reading its tensors: a file's
    archive index, or a folder's ``meta.pt``, shard index and every shard file at its full length."""
    path = Path(path)
    if not path.is_dir():
        read_checkpoint(path, trust_pickle=trust_pickle)  # memory-mapped: reads the archive's index, not the tensors
        return
    _read_sharded_meta(path, trust_pickle=trust_pickle)
    metadata = read_shard_index(path, trust_pickle=trust_pickle)
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


def consolidate_checkpoint(path: str | os.PathLike, *, optimizer: bool = False, trust_pickle: bool = False) -> dict:
    """A sharded checkpoint folder as one checkpoint dict of full tensors, the layout of a file checkpoint.

    Works for ModelParallelStrategy (FSDP2) folders, whose weights are under ``state_dict``, and FSDPStrategy ones
    (``model``; FSDP1, no longer trained with, its folders still read). The EMA's live weights
    (``state_dict.current_model_state``) move to the top-level ``current_model_state``. Optimizer states (FQN-keyed,
    as the sharded strategies save them) are read only with ``optimizer=True``, as ``optimizer_states``. Everything
    is held in CPU memory on this process.
    """
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    path = Path(path)
    ckpt = _read_sharded_meta(path, trust_pickle=trust_pickle)
    tops = {key.split(".", 1)[0] for key in read_shard_index(path, trust_pickle=trust_pickle).state_dict_metadata}
    weights_key = "state_dict" if "state_dict" in tops else "model"
    if weights_key not in tops:
        raise ValueError(f"{path} holds no weights (its shards hold {sorted(tops)})")
    state: dict = {}
    try:
        _load_state_dict(
            state,
            storage_reader=shard_reader(path, trust_pickle=trust_pickle),
            planner=(_EmptyStateDictLoadPlanner if trusts(path, trust_pickle) else _SafeBytesPlanner)(
                keys=None if optimizer else {weights_key}
            ),
            no_dist=True,
        )
    except UntrustedCheckpointError:
        raise
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - a damaged shard fails in many ways
        # torch wraps a reader's error into a CheckpointException (a BaseException) naming it in its text
        if "UntrustedCheckpointError" in str(err):
            raise UntrustedCheckpointError(
                f"{path} holds a shard entry of pickled objects beyond tensors and the allowed types: not loaded; "
                f"if you trust where it came from, load it with trust_pickle=True or name it in {TRUST_ENV}"
            ) from None
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


def _safe_bytes_planner():
    """torch's ``_EmptyStateDictLoadPlanner`` whose non-tensor entries (pickled bytes in the shards: Lightning's
    loop and callback states) are unpickled with ``weights_only=True`` and ``allowed_globals``: torch's own
    ``load_bytes`` unpickles them in full, so a crafted shard would run code."""
    import io

    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.planner import ReadItem

    class SafeBytesPlanner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            with torch.serialization.safe_globals(allowed_globals()):
                try:
                    loaded = torch.load(value, weights_only=True)
                except pickle.UnpicklingError as err:
                    raise UntrustedCheckpointError(
                        f"a shard entry ({read_item.dest_index.fqn}) holds pickled objects beyond tensors and the "
                        f"allowed types ({err}): not loaded; trust the folder by name to read it (trust_pickle=True, "
                        f"or {TRUST_ENV})"
                    ) from None
            _restore_resolver_caches(loaded)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element  # where torch's planner takes it

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafeBytesPlanner


def _SafeBytesPlanner(**kwargs):  # noqa: N802 - used as the planner's class
    return _safe_bytes_planner()(**kwargs)


def load_module(
    path: str | os.PathLike,
    *,
    map_location: str | torch.device = "cpu",
    data_vocab_size: int | None = None,
    trust_pickle: bool = False,
):
    """The LightningModule a checkpoint (file, sharded folder, export folder or foreign pretrained MDM, by path or
    hub name) holds, built from its hyper-parameters, with the checkpoint's ``state_dict`` (the EMA weights when an
    EMA ran), on ``map_location``. A backbone saved before an option of the DiT existed is built as it was then
    (``legacy_backbone_options``). ``data_vocab_size``: the run's, for a foreign source (``foreign_checkpoint``);
    ``trust_pickle``: see ``load_torch_file``."""
    path = resolve_source(path)
    # a file: memory-mapped, read again by Lightning under the same rule
    ckpt = read_checkpoint(path, data_vocab_size=data_vocab_size, trust_pickle=trust_pickle)
    cls = import_class(ckpt["flowlm"]["class_path"])
    if path.is_file() and "source" not in ckpt["flowlm"]:
        trusted = trusts(path, trust_pickle)
        with torch.serialization.safe_globals(allowed_globals()):
            return cls.load_from_checkpoint(
                path, map_location=map_location, weights_only=not trusted, **_backbone_kwargs(ckpt)
            )
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
    """Refuse, before any compute, a source checkpoint whose DiT would not serve a network built from ``backbone``:
    first another size (``d_model``, ``n_layers``, ``cond_dim``, ``mlp_ratio``, which the weights' shapes follow:
    nothing else matters then, and the advice is the checkpoint's size), then another function with the same shapes:
    another attention soft-cap or head count, or, when the source read its time (``time_conditioned``), another
    time-feature scale. (A ``mini`` MDM into a ``tiny`` run was advised ``backbone.n_heads=8``, then failed on
    shapes.) A ``size`` preset (flowlm/backbones/dit.py ``SIZES``) is spelled out on either side."""
    from flowlm.backbones.dit import SIZES

    def spelled_out(cfg: dict) -> dict:
        return {**SIZES.get(cfg["size"], {}), **cfg} if isinstance(cfg.get("size"), str) else dict(cfg)

    source = spelled_out(checkpoint_backbone(ckpt))
    target = {**RELEASED_OPTIONS, **spelled_out(backbone)}  # a new DiT's defaults
    shape = ("d_model", "n_layers", "cond_dim", "mlp_ratio")
    dits = "_target_" not in source and "_target_" not in target  # a LLaMA-family size: copy_into names it
    sizes = [key for key in shape if dits and key in source and key in target and source[key] != target[key]]
    if sizes:
        there = ", ".join(f"{key}={source[key]!r}" for key in sizes)
        here = ", ".join(f"{key}={target[key]!r}" for key in sizes)
        preset = next((name for name, dims in SIZES.items() if all(source.get(k) == v for k, v in dims.items())), "")
        options = " ".join(f"backbone.{key}={source[key]}" for key in (*shape, "n_heads") if key in source)
        raise ValueError(
            f"{role} {path} has another backbone size, a DiT of {there} (here {here}): its weights do not fit this "
            f"network. Build this run at the checkpoint's size ({f'backbone={preset}' if preset else options}), "
            "or give a checkpoint of this run's size"
        )
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


def _read_sharded_meta(path: Path, *, trust_pickle: bool = False) -> dict:
    meta_file = path / SHARDED_META
    if not meta_file.is_file():
        raise ValueError(
            f"{path} is a folder but not a sharded checkpoint (no {SHARDED_META}: an interrupted save, or not a "
            "checkpoint)"
        )
    try:
        meta = load_torch_file(meta_file, trust_pickle=trust_pickle, mmap=False)
    except UntrustedCheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - any unpickling failure means the same thing here
        raise ValueError(f"{meta_file} is not readable ({type(err).__name__}: {err})") from err
    if not isinstance(meta, dict) or "flowlm" not in meta:
        raise ValueError(f"{path} is not a flowlm checkpoint (no 'flowlm' record): it was not written by flowlm-train")
    return meta


def read_shard_index(path: Path, *, trust_pickle: bool = False):
    """The torch.distributed.checkpoint index (.metadata) of a sharded folder, unpickled as ``shard_reader`` does;
    ValueError when unreadable, ``UntrustedCheckpointError`` when it holds more than an index."""
    try:
        return shard_reader(path, trust_pickle=trust_pickle).read_metadata()
    except UntrustedCheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - a missing or truncated index fails in many ways
        raise ValueError(
            f"{path} is an incomplete sharded checkpoint: its shard index (.metadata) is unreadable "
            f"({type(err).__name__}: {err})"
        ) from err


# What a torch.distributed.checkpoint index (.metadata) pickles: torch unpickles it in full, this suite only these.
SHARD_INDEX_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},  # and every dtype
    "pathlib": {"PosixPath", "PurePosixPath"},
}


class _ShardIndexUnpickler(pickle.Unpickler):
    """Unpickles ``SHARD_INDEX_GLOBALS`` and torch dtypes; any other global is an ``UntrustedCheckpointError``."""

    def __init__(self, file, *, path: Path, folder: Path) -> None:
        super().__init__(file)
        self.path, self.folder = path, folder

    def find_class(self, module: str, name: str):  # noqa: D102
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if dtype or name in SHARD_INDEX_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise UntrustedCheckpointError(
            f"{self.path} holds pickled objects beyond a shard index ({module}.{name}): unpickling it could run code "
            f"from the file, so it is not loaded. If you trust where it came from, load it with trust_pickle=True "
            f"or name it in {TRUST_ENV}={self.folder.resolve()}"
        )


def shard_reader(path: str | os.PathLike, *, trust_pickle: bool = False):
    """A ``FileSystemReader`` of a sharded folder whose index is unpickled with ``SHARD_INDEX_GLOBALS`` only (torch's
    own unpickles anything). ``trust_pickle`` (or the folder in ``FLOWLM_TRUST_PICKLE``): torch's reader."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    if trusts(path, trust_pickle):
        return FileSystemReader(path)

    class IndexReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            index = Path(self._get_metadata_path(kwargs.get("rank")))
            with open(index, "rb") as f:
                metadata = _ShardIndexUnpickler(f, path=index, folder=Path(path)).load()
            if getattr(metadata, "storage_meta", None) is None:  # as torch's reader
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return IndexReader(path)


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


def load_teacher(path: str, device: torch.device, data_vocab_size: int, time: str) -> nn.Module:
    """A frozen MDM teacher (eval mode, no gradients) from a file, a sharded or export folder, or a foreign
    pretrained MDM (path or hub name); a time-conditioned one fed ``time`` "zero" is warned about."""
    teacher = load_module(path, map_location=device, data_vocab_size=data_vocab_size)
    teacher.eval().requires_grad_(False)
    if getattr(teacher, "time_conditioning", False) and time == "zero":
        warnings.warn(
            f"the MDM teacher {path} is time-conditioned and is fed time 0 (nothing masked) on rows with [MASK]s: the "
            "released code's choice, made for a time-agnostic teacher; method.mdm_teacher_time=rate feeds it each "
            "row's masking rate",
            UserWarning,
            stacklevel=3,
        )
    return teacher
