"""Reading pretrained checkpoints: where a source is (local path or Hugging Face cache), what tensors it holds
(one safetensors file, a sharded folder with its index, or a torch ``.pth``), and a key/shape check that names what
does not match, all before any tensor is read."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import Tensor

from flowlm.pretrained import hub

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


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


def load_tensors(files: Mapping[str, Path], keys: Iterable[str] | None = None) -> dict[str, Tensor]:
    """The tensors (all, or ``keys``) on the CPU, in their stored dtype."""
    wanted = set(files) if keys is None else set(keys)
    out: dict[str, Tensor] = {}
    for path in sorted({files[key] for key in wanted}):
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                out.update({key: f.get_tensor(key) for key in f.keys() if key in wanted})
        else:
            out.update({key: value for key, value in _torch_state(path).items() if key in wanted})
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
