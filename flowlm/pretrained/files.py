"""Reading pretrained checkpoints: where a source is (local path or Hugging Face cache), what tensors it holds
(one safetensors file, a sharded folder with its index, or a torch ``.pth``), and a key/shape check that names what
does not match, all before any tensor is read.

Under FSDP2 only rank 0 needs to read the weights: the runner builds the model inside
``tensors_from_rank_zero(True)`` on the other ranks, where the LLaMA-family loaders get tensors on the meta device
(the stored shapes and dtypes, read from the headers) instead of the data, and ``lightning_modules.sharding.shard``
broadcasts rank 0's weights into the sharded model."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar
from pathlib import Path

import torch
from torch import Tensor

from flowlm.pretrained import hub

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

_DEFERRED: ContextVar[bool] = ContextVar("flowlm_tensors_from_rank_zero", default=False)
# safetensors' dtype names (the header's "dtype" field) → torch dtypes
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


@contextlib.contextmanager
def tensors_from_rank_zero(active: bool = True) -> Iterator[None]:
    """Inside (when ``active``), ``load_tensors(..., deferrable=True)`` reads no data: it returns meta-device
    tensors of the stored shapes and dtypes, for a rank whose weights rank 0 will broadcast once the model is
    sharded. Configs, names and shapes are still checked from the files' headers."""
    token = _DEFERRED.set(bool(active))
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def reads_deferred() -> bool:
    """True inside ``tensors_from_rank_zero(True)``."""
    return _DEFERRED.get()


def resolve_source(source: str | Path, *, filename: str | None = None, allow_patterns: list[str] | None = None) -> Path:
    """A local file/folder, or a hub name (``owner/name``) resolved through the Hugging Face cache by
    ``flowlm.pretrained.hub.resolve_source`` (the one resolver of the suite): the snapshot folder, or with
    ``filename`` that file of it. Offline, a source that is neither fails at once with the ways to provide it."""
    path = Path(source).expanduser()
    if path.exists():
        return path / filename if filename and path.is_dir() else path
    folder = hub.resolve_source(str(source), allow_patterns=[filename] if filename else allow_patterns)
    if filename is None:
        return folder
    if not (folder / filename).exists():
        raise FileNotFoundError(f"pretrained source {source!r} has no file {filename!r} (snapshot {folder})")
    return folder / filename


def checkpoint_files(path: Path) -> dict[str, Path]:
    """Each tensor name → the file holding it: a ``.safetensors`` file, a folder with ``model.safetensors`` or a
    sharded ``model.safetensors.index.json`` (every shard it names must exist), or a ``.pth``/``.pt`` file."""
    if path.is_dir():
        if (path / INDEX).exists():
            weight_map = json.loads((path / INDEX).read_text())["weight_map"]
            missing = sorted({shard for shard in weight_map.values() if not (path / shard).exists()})
            if missing:
                raise FileNotFoundError(f"{path / INDEX} names shards that are not there: {missing}")
            return {key: path / shard for key, shard in weight_map.items()}
        if (path / SINGLE).exists():
            path = path / SINGLE
        else:
            raise FileNotFoundError(f"{path} holds neither {INDEX} nor {SINGLE}")
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return dict.fromkeys(f.keys(), path)
    if path.suffix in (".pth", ".pt", ".bin"):
        return dict.fromkeys(_torch_state(path), path)
    raise ValueError(f"{path}: unknown checkpoint format (expected .safetensors, a sharded folder, or .pth)")


def tensor_shapes(files: Mapping[str, Path]) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape from the files' headers (safetensors) or a memory-mapped load (.pth), no data read."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(set(files.values())):
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                held = set(f.keys())
                for key in (k for k, p in files.items() if p == path):
                    if key not in held:
                        raise ValueError(f"the index puts {key!r} in {path.name}, which does not hold it")
                    shapes[key] = tuple(f.get_slice(key).get_shape())
        else:
            shapes.update({key: tuple(value.shape) for key, value in _torch_state(path).items()})
    return shapes


def load_tensors(
    files: Mapping[str, Path], keys: Iterable[str] | None = None, *, deferrable: bool = False
) -> dict[str, Tensor]:
    """The tensors (all, or ``keys``) on the CPU, in their stored dtype. With ``deferrable`` inside
    ``tensors_from_rank_zero(True)``: meta-device tensors of the stored shapes and dtypes, no data read (a caller
    passes ``deferrable`` only when everything it does with them works on the meta device)."""
    wanted = set(files) if keys is None else set(keys)
    meta = deferrable and reads_deferred()
    out: dict[str, Tensor] = {}
    for path in sorted({files[key] for key in wanted}):
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                for key in (k for k in f.keys() if k in wanted):
                    if meta:
                        info = f.get_slice(key)
                        dtype = SAFETENSORS_DTYPES[info.get_dtype()]
                        out[key] = torch.empty(info.get_shape(), dtype=dtype, device="meta")
                    else:
                        out[key] = f.get_tensor(key)
        else:
            for key, value in _torch_state(path).items():  # memory-mapped: a meta copy touches no data
                if key in wanted:
                    out[key] = torch.empty_like(value, device="meta") if meta else value
    return out


def check_state(
    found: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]], *, source: str, config: str
) -> None:
    """Refuse a checkpoint whose tensor names or shapes differ from what ``config`` needs, naming the keys."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong = sorted(key for key in set(found) & set(expected) if tuple(found[key]) != tuple(expected[key]))
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} keys, e.g. {missing[:4]}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} keys, e.g. {unexpected[:4]}")
        if wrong:
            parts.append(
                "wrong shapes: "
                + ", ".join(f"{k} {tuple(found[k])} (expected {tuple(expected[k])})" for k in wrong[:4])
            )
        raise ValueError(f"{source} does not match the config {config}: " + "; ".join(parts))


def _torch_state(path: Path) -> dict[str, Tensor]:
    """A torch checkpoint's tensors: a flat state dict, or the ``model`` / ``state_dict`` entry of a training
    checkpoint (lit-gpt/fabric ``.pth``: ``{"model", "optimizer", "hparams", ...}``)."""
    payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    for entry in ("model", "state_dict"):
        if isinstance(payload, dict) and isinstance(payload.get(entry), dict):
            payload = payload[entry]
            break
    if not isinstance(payload, dict) or not all(isinstance(v, Tensor) for v in payload.values()):
        raise ValueError(f"{path}: expected a state dict of tensors (or one under 'model' / 'state_dict')")
    return payload


def read_json(path: Path) -> dict:
    """A JSON file, or a clear error naming it."""
    if not path.exists():
        raise FileNotFoundError(f"{path} not found (the pretrained folder needs its config.json)")
    return json.loads(path.read_text())
