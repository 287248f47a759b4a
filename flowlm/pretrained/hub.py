"""A pretrained source given by local path or Hugging Face hub name (``owner/name[@revision]``), resolved through
the Hugging Face cache (docs/pretrained.md, Sources).

A path that exists is used as is (a relative one from the working directory, else from the project root: the
shipped fixtures of the CPU scales resolve from any working directory). Otherwise a hub name is looked up in the
cache (``HF_HUB_CACHE``, else ``HF_HOME``/hub, else ~/.cache/huggingface/hub) and, unless offline
(``HF_HUB_OFFLINE=1``), downloaded into it. A source that is neither fails at once, before any compute, with the ways
to provide it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from flowlm.tasks.files import project_path

# owner/name[@revision]: hub repository ids are letters, digits, '-', '_', '.'; names ending like a checkpoint file
# are taken for missing local paths, never for repositories.
HUB_NAME = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?:@(?P<revision>[\w./-]+))?$")
FILE_SUFFIXES = (".ckpt", ".pt", ".pth", ".safetensors", ".bin", ".json")
TRUE = ("1", "true", "yes", "on")


class SourceUnavailableError(FileNotFoundError):
    """A pretrained source that is neither a local path nor in the Hugging Face cache (and cannot be downloaded)."""


def is_offline() -> bool:
    """Whether the hub must not be contacted (``HF_HUB_OFFLINE``, read now, not at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in TRUE


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache this process reads (the same environment variables as huggingface_hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def parse_hub_name(spec: str) -> tuple[str, str | None] | None:
    """(repo id, revision) when ``spec`` reads as a hub name, else None."""
    match = HUB_NAME.match(spec)
    if match is None or spec.lower().endswith(FILE_SUFFIXES) or spec.startswith((".", "~")):
        return None
    return match["repo"], match["revision"]


def resolve_source(spec: str | os.PathLike, *, allow_patterns: Sequence[str] | None = None) -> Path:
    """A local path for a pretrained source: the path itself when it exists, else the cached (or, online, freshly
    downloaded) snapshot folder of a hub name. FileNotFoundError for a missing path; ``SourceUnavailableError``
    (a FileNotFoundError) for a hub name that cannot be had, naming the ways to provide it."""
    path = project_path(spec)
    if path.exists():
        return path
    hub = parse_hub_name(str(spec))
    if hub is None:
        raise FileNotFoundError(f"checkpoint not found: {spec} (neither a local path nor a hub name owner/name)")
    repo, revision = hub
    from huggingface_hub import snapshot_download

    offline = is_offline()
    try:
        folder = snapshot_download(
            repo,
            revision=revision,
            cache_dir=hub_cache_dir(),
            local_files_only=offline,
            allow_patterns=list(allow_patterns) if allow_patterns else None,
        )
    except Exception as err:  # noqa: BLE001 - offline misses, network errors, unknown repos: one remedy
        cache = hub_cache_dir()
        why = f"is not in the Hugging Face cache {cache} (HF_HUB_OFFLINE=1)" if offline else "could not be fetched"
        rev = f" --revision {revision}" if revision else ""
        raise SourceUnavailableError(
            f"pretrained source {spec!r} is not a local path and hub repo {repo!r} {why} "
            f"({type(err).__name__}: {err}). Provide it one of these ways:\n"
            f"  - on a machine with access: `huggingface-cli download {repo}{rev}` (or `hf download {repo}`), then "
            f"copy the cache folder {cache}/models--{repo.replace('/', '--')} here, or point HF_HUB_CACHE (or "
            "HF_HOME) at a cache that has it;\n"
            f"  - or download it to a folder (`huggingface-cli download {repo}{rev} --local-dir DIR`) and give the "
            "local path DIR instead of the hub name;\n"
            "  - or, with network access, unset HF_HUB_OFFLINE."
        ) from err
    return Path(folder)
