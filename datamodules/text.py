"""Text corpora as token batches (methods.md §7): HF datasets or local files, tokenised once into a numpy cache.

Batches are ``{"tokens": (B, L) long, "prompt_mask": (B, L) bool}`` (all False: unconditional text), plus
``"loss_mask"`` (B, L) bool when ``loss_on_pad=False``. The data vocabulary is the tokenizer's, with a distinct
``[PAD]`` added when it has none (GPT-2 has none: 50 257 + 1); models put [MASK] at ``vocab_size``, so PAD ≠ MASK.

Packing modes:
- ``truncate_pad`` (TinyStories, MDLM's recipe): each document becomes ``[BOS] ids[:L-2] [EOS]`` right-padded
  with PAD to L. PAD positions are ordinary *targets*, never context: ``prompt_mask`` stays False on them, so a
  masked model learns to emit PAD after EOS (MDLM trains them as tokens). With ``loss_on_pad=False`` batches also
  carry ``loss_mask = (tokens != PAD) & ~prompt_mask`` for methods that read it.
- ``wrap`` (OpenWebText, MDLM's recipe): every document is followed by EOS, all are concatenated, cut into
  L−2-token pieces and each piece is framed ``[BOS] piece [EOS]``. The token stream is cached once, independent of
  L; the last partial piece is padded with PAD (default) or dropped (``drop_remainder``, as MDLM does).

The cache is one folder per configuration under ``cache_dir`` (``.npy`` arrays opened as memory maps, and a
``meta.json`` written last); a second setup with the same configuration reads it without tokenising. Tokenisation
runs through ``datasets.Dataset.map(batched=True, num_proc=...)`` with its cache files in a work folder beside it
(removed once the arrays are written; an interrupted build resumes from them).
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import math
import os
import shutil
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from datamodules.base import GlobalBatchDataModule
from flowlm.tasks.files import DataFileError, json_records, text_lines

log = logging.getLogger(__name__)

PROJECT_DIR = Path(__file__).resolve().parent.parent  # = runners.common.PROJECT_DIR, without importing the runners
PAD_TOKEN = "[PAD]"
PACKINGS = ("truncate_pad", "wrap")
CACHE_VERSION = 1  # bump when the cached arrays' layout or content rules change
_WRITE_BATCH = 10_000  # documents per Arrow batch when writing the arrays


class DataUnavailableError(FileNotFoundError):
    """A dataset or tokenizer is neither on this machine nor downloadable (e.g. offline); says how to provide it."""


# ------------------------------------------------------------------------------------------------------------
# Paths, tokenizer and sources.


def project_path(path: str | os.PathLike) -> Path:
    """An absolute path: as given if absolute or present relative to the working directory, else under the project
    root (so the shipped fixture configs work from any working directory)."""
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists() or glob.glob(str(p)):
        return p.resolve()
    return PROJECT_DIR / p


def load_tokenizer(name_or_path: str | os.PathLike):
    """A HF tokenizer by hub name (``gpt2``), folder or ``tokenizer.json`` file, with a distinct PAD token.

    PAD is added as ``[PAD]`` (a new id at the end) when the tokenizer has none or shares it with BOS/EOS, so that
    padding is never mistaken for text and never equals the models' [MASK] id (= the data vocabulary size).
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    spec = str(name_or_path)
    local = project_path(spec)
    try:
        if local.is_file():
            tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(local))
        else:
            tokenizer = AutoTokenizer.from_pretrained(str(local) if local.is_dir() else spec)
    except (OSError, ValueError) as e:
        raise DataUnavailableError(
            f"tokenizer {spec!r} could not be loaded ({type(e).__name__}: {e}). Offline, give a local copy: on a "
            f"machine with access run `AutoTokenizer.from_pretrained({spec!r}).save_pretrained(DIR)` (or "
            f"`huggingface-cli download {spec}`, which fills the HF cache that HF_HUB_OFFLINE=1 then reads) and set "
            "data.tokenizer=DIR"
        ) from e
    special = {tokenizer.bos_token_id, tokenizer.eos_token_id} - {None}
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id in special:
        tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})
    return tokenizer


def tokenizer_digest(tokenizer) -> str:
    """A short hash of everything that decides token ids (vocabulary, merges, normaliser, added tokens, PAD)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    extra = json.dumps([len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id])
    return hashlib.sha256((text + extra).encode()).hexdigest()[:16]


def builder_for(patterns: Sequence[str]) -> str:
    """The `datasets` packaged builder for local files, from their extension (compression suffixes ignored)."""
    kinds = set()
    for pattern in patterns:
        name = pattern.lower()
        for suffix in (".gz", ".bz2", ".xz", ".zst", ".zip"):
            name = name.removesuffix(suffix)
        kind = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}.get(Path(name).suffix)
        if kind is None:
            raise ValueError(f"data.files: {pattern} is not .txt, .json, .jsonl or .parquet")
        kinds.add(kind)
    if len(kinds) != 1:
        raise ValueError(f"data.files mixes formats {sorted(kinds)} in one split")
    return kinds.pop()


def local_files(files: str | Sequence[str] | Mapping[str, Any]) -> dict[str, list[str]]:
    """``files`` as ``{split: [absolute paths or globs]}``; a plain path or list is the ``train`` split."""
    if isinstance(files, str | os.PathLike):
        files = {"train": [files]}
    elif not isinstance(files, Mapping):
        files = {"train": list(files)}
    out = {}
    for split, value in files.items():
        patterns = [value] if isinstance(value, str | os.PathLike) else list(value)
        resolved = [str(project_path(p)) for p in patterns]
        for pattern in resolved:
            found = glob.glob(pattern)
            if not found:
                raise FileNotFoundError(
                    f"data files for split {split!r}: nothing matches {pattern} (a relative path is looked up in "
                    "the working directory, then in the project root)"
                )
            for file in found:
                if not os.access(file, os.R_OK):
                    raise PermissionError(f"data files for split {split!r}: {file} is not readable by this user")
                if os.path.isfile(file) and os.path.getsize(file) == 0:
                    raise DataFileError(f"data files for split {split!r}: {file} is empty (0 bytes)")
        out[str(split)] = resolved
    return out


def check_local_file(path: str, builder: str, fields: Sequence[str]) -> int:
    """Read one local data file through before it is loaded and tokenised: UTF-8 text, every JSON line an object
    holding ``fields`` as strings (a parquet file: its schema), at least one document. Returns the number of
    documents (records or non-blank lines); a DataFileError names the file, the line and the problem.

    One read pass (compressed files through fsspec), far cheaper than the tokenisation it precedes; `datasets`
    would report these problems without the file or line, or (a non-UTF-8 string) only while tokenising.
    """
    import fsspec

    if builder == "parquet":
        import pyarrow.parquet as pq

        try:
            meta = pq.read_metadata(path)  # the footer only
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a damaged file
            raise DataFileError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from e
        missing = [f for f in fields if f not in meta.schema.names]
        if missing:
            raise DataFileError(f"{path}: no column(s) {missing}; it has {meta.schema.names} (data.*_field)")
        count = meta.num_rows
    else:
        with fsspec.open(path, "rb", compression="infer") as f:
            if builder == "text":
                count = sum(1 for _, line in text_lines(f, path) if line.strip())
            else:
                count = 0
                for where, record in _json_file_records(f, path):
                    for field in fields:
                        if not isinstance(record.get(field), str):
                            got = "missing" if field not in record else f"of type {type(record[field]).__name__}"
                            raise DataFileError(
                                f"{path}: {where}: field {field!r} is {got}, not a string (it has "
                                f"{sorted(record)[:8]}; the field is set by data.*_field)"
                            )
                    count += 1
    if count == 0:
        raise DataFileError(f"{path}: no documents (the file holds only blank lines or no records)")
    return count


def _json_file_records(f, path: str) -> Iterator[tuple[str, dict]]:
    """('line <n>', object) of a JSON Lines file, or ('record <n>', object) of a file holding one JSON array."""
    head = f.read(4096)
    f.seek(0)
    if not head.lstrip().startswith(b"["):
        yield from ((f"line {num}", record) for num, record in json_records(f, path))
        return
    try:
        records = json.loads(f.read().decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataFileError(f"{path}: not one JSON array of records ({e})") from e
    for i, record in enumerate(records, start=1):
        if not isinstance(record, dict):
            raise DataFileError(f"{path}: record {i}: expected a JSON object, got {type(record).__name__}")
        yield f"record {i}", record


def files_identity(files: dict[str, list[str]]) -> dict[str, list]:
    """Every matched file with its size and mtime, so an edited file gets a new cache."""
    ident = {}
    for split, patterns in files.items():
        found = sorted({f for p in patterns for f in glob.glob(p)})
        ident[split] = [(f, os.path.getsize(f), os.stat(f).st_mtime_ns) for f in found]
    return ident


def source_identity(
    *, name: str | None, config_name: str | None, revision: str | None, files: Any, txt_docs: str
) -> dict[str, Any]:
    """What decides the raw documents of a source (without loading it)."""
    if files is not None:
        return {"files": files_identity(local_files(files)), "txt_docs": txt_docs}
    path = project_path(name)
    if path.is_dir():
        files = (f for f in path.rglob("*") if f.is_file())
        stamps = sorted((str(f.relative_to(path)), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
        return {"dir": str(path), "stamps": stamps}
    return {"name": name, "config_name": config_name, "revision": revision}


def load_documents(
    *,
    name: str | None,
    config_name: str | None,
    split: str,
    files: Any = None,
    revision: str | None = None,
    txt_docs: str = "line",
    hf_cache_dir: str | os.PathLike | None = None,
    local_cache_dir: str | os.PathLike | None = None,
    fields: Sequence[str] = (),
):
    """One split of a source as a ``datasets.Dataset``: local files, a ``save_to_disk`` folder, a folder of data
    files (``huggingface-cli download --local-dir``), or a hub name (offline: from the HF cache, else a clear error).
    Local files are read through first (``check_local_file``: every record holds ``fields`` as strings).
    """
    import datasets

    if (name is None) == (files is None):
        raise ValueError(f"give exactly one of data.name and data.files (got name={name!r}, files={files!r})")
    if files is not None:
        table = local_files(files)
        if split not in table:
            raise ValueError(
                f"data.files has no split {split!r} (it has {sorted(table)}); give files as "
                "{train: ..., validation: ...} or take validation from the last documents (val_last_n)"
            )
        builder = builder_for(table[split])
        for file in sorted({f for pattern in table[split] for f in glob.glob(pattern)}):
            check_local_file(file, builder, fields if builder != "text" else ())
        extra = {"sample_by": txt_docs} if builder == "text" else {}
        cache = None if local_cache_dir is None else str(local_cache_dir)
        return datasets.load_dataset(builder, data_files={split: table[split]}, split=split, cache_dir=cache, **extra)
    path = project_path(name)
    if path.is_dir():
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            saved = datasets.load_from_disk(str(path))
            if isinstance(saved, datasets.DatasetDict):
                if split not in saved:
                    raise ValueError(f"{path} has splits {sorted(saved)}, not {split!r}")
                return saved[split]
            if split != "train":
                raise ValueError(f"{path} holds one unsplit dataset; use it as train and set val_last_n")
            return saved
        return datasets.load_dataset(str(path), config_name, split=split, cache_dir=hf_cache_dir)
    try:
        return datasets.load_dataset(name, config_name, split=split, revision=revision, cache_dir=hf_cache_dir)
    except Exception as e:  # offline, unknown name, missing split: all need the same advice
        args = ", ".join(repr(a) for a in (name, config_name) if a is not None)
        raise DataUnavailableError(
            f"could not load the HF dataset {name!r} (config {config_name!r}, split {split!r}): "
            f"{type(e).__name__}: {e}\n"
            "Without network access (HF_DATASETS_OFFLINE=1), provide a local copy, one of:\n"
            "  - local files: data.files=/path/to/*.jsonl (json/jsonl/parquet with the text field, or .txt), or "
            "data.files={train: ..., validation: ...};\n"
            f"  - on a machine with access: `huggingface-cli download {name} --repo-type dataset --local-dir DIR` "
            "and set data.name=DIR;\n"
            f"  - or `datasets.load_dataset({args}).save_to_disk(DIR)` and set data.name=DIR;\n"
            "  - or load it once online with the same HF cache (HF_HOME / hf_cache_dir): offline mode then reuses it."
        ) from e


# ------------------------------------------------------------------------------------------------------------
# Cached arrays served as batches.


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (GPT-2 + PAD does), else int32: half the disk for OpenWebText."""
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.int32)


class _Memmaps:
    """Named ``.npy`` files opened read-only as memory maps on first use in each process (worker-safe)."""

    def __init__(self, files: Mapping[str, Path]) -> None:
        self.files = dict(files)
        self._arrays: dict[str, np.ndarray] | None = None

    def __getitem__(self, key: str) -> np.ndarray:
        if self._arrays is None:
            self._arrays = {k: np.load(p, mmap_mode="r") for k, p in self.files.items()}
        return self._arrays[key]

    def __getstate__(self) -> dict:
        # Pickling a memmap copies its data; workers reopen the files instead.
        return {"files": self.files, "_arrays": None}


class PaddedRows(Dataset):
    """Rows of a (N, L) token array; optional per-row ``prompt_len``, ``gold`` and ``index`` arrays."""

    def __init__(self, files: Mapping[str, Path], *, pad_id: int, loss_mask: bool) -> None:
        self.arrays = _Memmaps(files)
        self.pad_id, self.loss_mask = pad_id, loss_mask
        self.length, self.seq_len = np.load(files["tokens"], mmap_mode="r").shape

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        tokens = torch.from_numpy(self.arrays["tokens"][i].astype(np.int64))
        prompt = int(self.arrays["prompt_len"][i]) if "prompt_len" in self.arrays.files else 0
        item = {"tokens": tokens, "prompt_mask": torch.arange(self.seq_len) < prompt}
        if self.loss_mask:
            item["loss_mask"] = (tokens != self.pad_id) & ~item["prompt_mask"]
        if "gold" in self.arrays.files:
            item["gold"] = torch.tensor(float(self.arrays["gold"][i]), dtype=torch.float64)
            item["index"] = torch.tensor(int(self.arrays["index"][i]), dtype=torch.long)
        return item


class WrappedStream(Dataset):
    """Chunk i of a flat token stream: ``[BOS] stream[i(L-2) : (i+1)(L-2)] [EOS]``, the last one PAD-filled."""

    def __init__(
        self, path: Path, *, seq_len: int, bos_id: int, eos_id: int, pad_id: int, drop_remainder: bool, loss_mask: bool
    ) -> None:
        if seq_len < 3:
            raise ValueError(f"wrap packing needs seq_len >= 3 (BOS, a token, EOS), got {seq_len}")
        self.arrays = _Memmaps({"stream": path})
        self.seq_len, self.piece = seq_len, seq_len - 2
        self.bos_id, self.eos_id, self.pad_id, self.loss_mask = bos_id, eos_id, pad_id, loss_mask
        total = np.load(path, mmap_mode="r").shape[0]
        self.length = total // self.piece if drop_remainder else math.ceil(total / self.piece)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        if not 0 <= i < self.length:
            raise IndexError(i)
        piece = self.arrays["stream"][i * self.piece : (i + 1) * self.piece].astype(np.int64)
        tokens = torch.full((self.seq_len,), self.pad_id, dtype=torch.long)
        tokens[0] = self.bos_id
        tokens[1 : 1 + len(piece)] = torch.from_numpy(piece)
        tokens[1 + len(piece)] = self.eos_id
        item = {"tokens": tokens, "prompt_mask": torch.zeros(self.seq_len, dtype=torch.bool)}
        if self.loss_mask:
            item["loss_mask"] = tokens != self.pad_id
        return item


def arrow_lists(dataset, column: str, batch_size: int = _WRITE_BATCH):
    """Yield (values, lengths) numpy arrays of a list column, batch by batch (never the whole column at once)."""
    import pyarrow.compute as pc

    for table in dataset.with_format("arrow").iter(batch_size=batch_size):
        col = table.column(column).combine_chunks()
        yield col.flatten().to_numpy(zero_copy_only=False), pc.list_value_length(col).to_numpy(zero_copy_only=False)


def write_padded(path: Path, dataset, *, seq_len: int, pad_id: int, dtype: np.dtype, desc: str) -> int:
    """Write the ``ids`` lists of ``dataset`` (each ≤ L) as a (N, L) PAD-filled ``.npy``; returns N."""
    from tqdm.auto import tqdm

    out = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=(len(dataset), seq_len))
    row = 0
    with tqdm(total=len(dataset), desc=desc, unit="doc", disable=None) as bar:
        for values, lengths in arrow_lists(dataset, "ids"):
            if lengths.size and lengths.max() > seq_len:
                raise ValueError(f"a row of {lengths.max()} tokens does not fit seq_len {seq_len}")
            block = np.full((len(lengths), seq_len), pad_id, dtype=dtype)
            block[np.arange(seq_len) < lengths[:, None]] = values  # row-major fill = each row's ids, left-aligned
            out[row : row + len(lengths)] = block
            row += len(lengths)
            bar.update(len(lengths))
    out.flush()
    del out
    return row


def write_stream(path: Path, dataset, *, total: int, dtype: np.dtype, desc: str) -> None:
    """Write the ``ids`` lists of ``dataset`` back to back as one flat ``.npy`` of ``total`` tokens."""
    from tqdm.auto import tqdm

    out = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=(total,))
    at = 0
    with tqdm(total=total, desc=desc, unit="tok", unit_scale=True, disable=None) as bar:
        for values, _ in arrow_lists(dataset, "ids"):
            out[at : at + len(values)] = values
            at += len(values)
            bar.update(len(values))
    if at != total:
        raise RuntimeError(f"wrote {at} tokens, expected {total}")
    out.flush()
    del out


# ------------------------------------------------------------------------------------------------------------
# Shared datamodule machinery: tokenizer, cache folder, loaders, global → per-device batch sizes.


class TokenCacheDataModule(GlobalBatchDataModule, ABC):
    """Base of the text and GSM8K datamodules: a tokenizer with PAD, one cache folder per configuration, loaders.

    Subclasses give ``_identity()`` (what decides the cached arrays), ``_build(folder, work)`` (write the arrays
    and return their metadata) and ``_datasets(folder, meta)`` (train and val datasets over the arrays).
    """

    cache_prefix = "tokens"

    def __init__(
        self,
        *,
        tokenizer: str,
        seq_len: int,
        cache_dir: str | os.PathLike,
        batch_size: int,
        val_batch_size: int | None,
        loss_on_pad: bool,
        add_bos_eos: bool,
        num_proc: int | None,
        num_workers: int,
        pin_memory: bool,
        seed: int,
        hf_cache_dir: str | os.PathLike | None,
    ) -> None:
        super().__init__()
        for name, value, low in (
            ("seq_len", seq_len, 2),
            ("batch_size", batch_size, 1),
            ("num_workers", num_workers, 0),
            ("seed", seed, 0),
        ):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if val_batch_size is not None and (not isinstance(val_batch_size, int) or val_batch_size < 1):
            raise ValueError(f"val_batch_size must be None or an int >= 1, got {val_batch_size!r}")
        if num_proc is not None and (not isinstance(num_proc, int) or num_proc < 1):
            raise ValueError(f"num_proc must be None or an int >= 1, got {num_proc!r}")
        self.tokenizer_name = str(tokenizer)
        self.tokenizer = load_tokenizer(tokenizer)  # now, not in setup: the runner reads vocab_size first
        self._seq_len = seq_len
        self.cache_dir = Path(cache_dir)
        self.batch_size, self.val_batch_size = batch_size, val_batch_size
        self.loss_on_pad, self.add_bos_eos = loss_on_pad, add_bos_eos
        self.num_proc, self.num_workers, self.pin_memory, self.seed = num_proc, num_workers, pin_memory, seed
        self.hf_cache_dir = None if hf_cache_dir is None else str(hf_cache_dir)
        bos, eos = self.tokenizer.bos_token_id, self.tokenizer.eos_token_id
        # GPT-2 has one <|endoftext|> for both; a tokenizer with only one of them uses it for both roles.
        self.bos_id: int | None = bos if bos is not None else eos
        self.eos_id: int | None = eos if eos is not None else bos
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.cache_meta: dict[str, Any] | None = None
        self.built = False  # True when this instance tokenised (False after a cache hit)

    def _need_bos_eos(self, why: str) -> None:
        if self.bos_id is None:
            raise ValueError(f"tokenizer {self.tokenizer_name!r} has no BOS/EOS token, which {why} needs")

    # --- what models, samplers and metrics read ----------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Data vocabulary the model sees: the tokenizer's ids including PAD (models add [MASK] at this id)."""
        return len(self.tokenizer)

    @property
    def pad_id(self) -> int:
        """The PAD id (never a text token, never [MASK])."""
        return int(self.tokenizer.pad_token_id)

    @property
    def mask_id(self) -> int:
        """The id MDM-family models give [MASK] (= vocab_size); not a tokenizer id."""
        return self.vocab_size

    @property
    def seq_len(self) -> int:
        """Tokens per sequence (L)."""
        return self._seq_len

    def decode(self, tokens: Tensor, *, skip_special_tokens: bool = True) -> list[str]:
        """Text of each row of (B, L) ids; PAD, BOS/EOS (when skipping specials) and ids ≥ vocab_size are dropped."""
        texts = []
        for row in tokens.detach().cpu().long().tolist():
            ids = [t for t in row if 0 <= t < self.vocab_size and t != self.pad_id]
            texts.append(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
        return texts

    # --- cache ---------------------------------------------------------------------------------------------------

    @abstractmethod
    def _identity(self) -> dict[str, Any]:
        """Everything that determines the cached tokens (its hash names the cache folder)."""

    @abstractmethod
    def _build(self, folder: Path, work: Path) -> dict[str, Any]:
        """Tokenise the sources into ``folder`` (scratch space in ``work``); returns the cache's meta record."""

    @abstractmethod
    def _datasets(self, folder: Path, meta: dict[str, Any]) -> tuple[Dataset, Dataset]:
        """The train and validation datasets over a built cache."""

    def _cache_label(self) -> str:
        return self.cache_prefix

    @property
    def cache_path(self) -> Path:
        """The folder holding this configuration's tokenised arrays (``meta.json`` marks it complete)."""
        ident = {"version": CACHE_VERSION, "tokenizer": tokenizer_digest(self.tokenizer), **self._identity()}
        digest = hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:12]
        label = "".join(c if c.isalnum() or c in "-_." else "-" for c in self._cache_label())
        return self.cache_dir / f"{label}_{digest}"

    def prepare_data(self) -> None:
        """Tokenise and write the arrays unless this configuration's cache folder is complete."""
        final = self.cache_path
        if (final / "meta.json").is_file():
            log.info("Token cache hit: %s", final)
            return
        start = time.perf_counter()
        work = final.with_name(final.name + ".work")  # map() caches: stable, so an interrupted build resumes
        tmp = final.with_name(f"{final.name}.tmp{os.getpid()}")
        work.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            meta = self._build(tmp, work)
            meta["seconds"] = round(time.perf_counter() - start, 2)
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
            try:
                os.rename(tmp, final)  # atomic; a concurrent builder that finished first wins
            except OSError:
                if not (final / "meta.json").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
        self.built = True
        log.info("Tokenised into %s in %.1f s", final, time.perf_counter() - start)

    def setup(self, stage: str | None = None) -> None:
        """Open the cached arrays (building them if prepare_data was skipped)."""
        if self.train_set is not None:
            return
        folder = self.cache_path
        if not (folder / "meta.json").is_file():
            self.prepare_data()
        self.cache_meta = json.loads((folder / "meta.json").read_text())
        self.train_set, self.val_set = self._datasets(folder, self.cache_meta)
        if not self.loss_on_pad:
            log.info("loss_on_pad=False: batches carry `loss_mask`; only methods that read it leave PAD untrained")
        self.check_train_size()

    def _map(self, dataset, fn: Callable, *, work: Path, name: str, with_indices: bool = False):
        """``dataset.map(fn, batched=True)`` with its cache file in ``work`` and a fingerprint from our identity."""
        key = hashlib.sha256(f"{self.cache_path.name}/{name}".encode()).hexdigest()[:16]
        return dataset.map(
            fn,
            batched=True,
            with_indices=with_indices,
            num_proc=self.num_proc,
            remove_columns=dataset.column_names,
            cache_file_name=str(work / f"{name}.arrow"),
            new_fingerprint=key,  # fn holds a tokenizer, whose hash is not stable across processes
            desc=f"Tokenising {name}",
        )


# ------------------------------------------------------------------------------------------------------------
# The text datamodule.


class TextEncoder:
    """Documents → cached ids (a picklable ``map`` function: ``num_proc`` workers get the tokenizer, not the
    datamodule). Returns ``ids`` and the untruncated ``length``; empty documents are dropped.

    ``wrap``: ``ids + [EOS]`` (the BOS/EOS frame is added per chunk). ``truncate_pad``: ``[BOS] ids[:L-2] [EOS]``
    (the frame survives truncation, as in MDLM), or ``ids[:L]`` without BOS/EOS.
    """

    def __init__(
        self,
        tokenizer,
        *,
        field: str,
        packing: str,
        seq_len: int,
        bos_id: int | None,
        eos_id: int | None,
        strip: bool = False,
    ) -> None:
        self.tokenizer, self.field, self.packing, self.seq_len = tokenizer, field, packing, seq_len
        self.bos_id, self.eos_id, self.strip = bos_id, eos_id, strip

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        texts = [t.strip() if self.strip else t for t in batch[self.field] if t and not t.isspace()]
        ids = self.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
        if self.packing == "wrap":
            ids = [[*x, self.eos_id] for x in ids]
            return {"ids": ids, "length": [len(x) for x in ids]}
        if self.bos_id is not None:
            lengths = [len(x) + 2 for x in ids]
            ids = [[self.bos_id, *x[: self.seq_len - 2], self.eos_id] for x in ids]
        else:
            lengths = [len(x) for x in ids]
            ids = [x[: self.seq_len] for x in ids]
        return {"ids": ids, "length": lengths}


class TextDataModule(TokenCacheDataModule):
    """TinyStories / OpenWebText / local text as L-token sequences (see the module docstring for the packing).

    Source: ``name`` (HF hub name, ``save_to_disk`` folder or folder of data files) with ``config_name``, or
    ``files`` (a path/glob/list = the train split, or ``{train: ..., validation: ...}``; ``.txt`` holds one document
    per line, or per blank-line-separated paragraph with ``txt_docs=paragraph``; json/jsonl/parquet need
    ``text_field``). Validation: the source's ``val_split``, or the last ``val_last_n`` documents of the train split
    (then excluded from training). Batch sizes are global.
    """

    cache_prefix = "text"

    def __init__(
        self,
        *,
        name: str | None = None,
        config_name: str | None = None,
        revision: str | None = None,
        files: Any = None,
        txt_docs: str = "line",
        text_field: str = "text",
        train_split: str = "train",
        val_split: str | None = "validation",
        val_last_n: int | None = None,
        max_train_docs: int | None = None,
        max_val_docs: int | None = None,
        tokenizer: str = "gpt2",
        seq_len: int = 128,
        packing: str = "truncate_pad",
        add_bos_eos: bool = True,
        drop_remainder: bool = False,
        loss_on_pad: bool = True,
        cache_dir: str | os.PathLike = "data_cache/text",
        hf_cache_dir: str | os.PathLike | None = None,
        num_proc: int | None = None,
        batch_size: int = 256,
        val_batch_size: int | None = None,
        num_workers: int = 0,
        pin_memory: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(
            tokenizer=tokenizer,
            seq_len=seq_len,
            cache_dir=cache_dir,
            batch_size=batch_size,
            val_batch_size=val_batch_size,
            loss_on_pad=loss_on_pad,
            add_bos_eos=add_bos_eos,
            num_proc=num_proc,
            num_workers=num_workers,
            pin_memory=pin_memory,
            seed=seed,
            hf_cache_dir=hf_cache_dir,
        )
        self.save_hyperparameters(logger=False)  # the runner logs the data config itself (as Sudoku does)
        if packing not in PACKINGS:
            raise ValueError(f"packing must be one of {PACKINGS}, got {packing!r}")
        if txt_docs not in ("line", "paragraph"):
            raise ValueError(f"txt_docs must be 'line' or 'paragraph', got {txt_docs!r}")
        if (name is None) == (files is None):
            raise ValueError(f"give exactly one of data.name and data.files (got name={name!r}, files={files!r})")
        if (val_split is None) == (val_last_n is None):
            raise ValueError("give exactly one of val_split (the source's own split) and val_last_n (last N docs)")
        for key, value in (
            ("val_last_n", val_last_n),
            ("max_train_docs", max_train_docs),
            ("max_val_docs", max_val_docs),
        ):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{key} must be None or an int >= 1, got {value!r}")
        if packing == "wrap" or add_bos_eos:
            why = "wrap packing" if packing == "wrap" else "add_bos_eos"
            self._need_bos_eos(why)
            if seq_len < 3:
                raise ValueError(f"{why} needs seq_len >= 3 (BOS, a token, EOS), got {seq_len}")
        if files is not None:  # now, not at the first load (after the run folder is made): cheap checks
            for patterns in local_files(files).values():
                builder_for(patterns)
        self.name, self.config_name, self.revision, self.files = name, config_name, revision, files
        self.txt_docs, self.text_field = txt_docs, text_field
        self.train_split, self.val_split, self.val_last_n = train_split, val_split, val_last_n
        self.max_train_docs, self.max_val_docs = max_train_docs, max_val_docs
        self.packing, self.drop_remainder = packing, drop_remainder

    @property
    def prompt_len(self) -> int:
        """No prompt: text is generated unconditionally."""
        return 0

    def _cache_label(self) -> str:
        if self.files is not None:
            first = next(iter(local_files(self.files).values()))[0]
            source = Path(first).stem.replace("*", "all")
        else:
            source = str(self.name).rstrip("/").split("/")[-1]
        return f"text_{source}_{self.packing}"

    def _identity(self) -> dict[str, Any]:
        source = source_identity(
            name=self.name,
            config_name=self.config_name,
            revision=self.revision,
            files=self.files,
            txt_docs=self.txt_docs,
        )
        ident = {
            "task": "text",
            "source": source,
            "text_field": self.text_field,
            "splits": [self.train_split, self.val_split, self.val_last_n, self.max_train_docs, self.max_val_docs],
            "packing": self.packing,
        }
        if self.packing == "truncate_pad":  # the wrap stream does not depend on L: one cache serves every L
            ident |= {"seq_len": self.seq_len, "add_bos_eos": self.add_bos_eos}
        return ident

    def _load(self, split: str):
        docs = load_documents(
            name=self.name,
            config_name=self.config_name,
            split=split,
            files=self.files,
            revision=self.revision,
            txt_docs=self.txt_docs,
            hf_cache_dir=self.hf_cache_dir,
            local_cache_dir=self.cache_dir / "hf",
            fields=(self.text_field,),
        )
        if self.text_field not in docs.column_names:
            raise KeyError(f"split {split!r} has no field {self.text_field!r}; it has {docs.column_names} (text_field)")
        return docs

    def documents(self) -> dict[str, Any]:
        """The raw train and val documents (``datasets.Dataset``) this configuration tokenises."""
        train = self._load(self.train_split)
        if self.val_last_n is not None:
            n = len(train)
            if self.val_last_n >= n:
                raise ValueError(f"val_last_n = {self.val_last_n} leaves no training document of {n}")
            val = train.select(range(n - self.val_last_n, n))
            train = train.select(range(n - self.val_last_n))
        else:
            val = self._load(self.val_split)
        if self.max_train_docs is not None:
            train = train.select(range(min(self.max_train_docs, len(train))))
        if self.max_val_docs is not None:
            val = val.select(range(min(self.max_val_docs, len(val))))
        return {"train": train, "val": val}

    def encoder(self) -> TextEncoder:
        """The batched ``map`` function that turns documents into cached ids."""
        return TextEncoder(
            self.tokenizer,
            field=self.text_field,
            packing=self.packing,
            seq_len=self.seq_len,
            bos_id=self.bos_id if self.add_bos_eos or self.packing == "wrap" else None,
            eos_id=self.eos_id if self.add_bos_eos or self.packing == "wrap" else None,
            strip=self._plain_text(),
        )

    def _plain_text(self) -> bool:
        # In .txt files documents are delimited by line breaks: whitespace around them is layout, not content.
        return self.files is not None and all(builder_for(p) == "text" for p in local_files(self.files).values())

    def _build(self, folder: Path, work: Path) -> dict[str, Any]:
        import pyarrow.compute as pc

        dtype = token_dtype(self.vocab_size)
        meta: dict[str, Any] = {"packing": self.packing, "dtype": dtype.name, "splits": {}}
        encoder = self.encoder()
        for split, docs in self.documents().items():
            encoded = self._map(docs, encoder, work=work, name=split)
            lengths = encoded.data.column("length")
            info = {"documents": len(docs), "empty_dropped": len(docs) - len(encoded)}
            if self.packing == "wrap":
                total = int(pc.sum(lengths).as_py() or 0)
                write_stream(folder / f"{split}_stream.npy", encoded, total=total, dtype=dtype, desc=f"Writing {split}")
                info["tokens"] = total
            else:
                rows = write_padded(
                    folder / f"{split}_tokens.npy",
                    encoded,
                    seq_len=self.seq_len,
                    pad_id=self.pad_id,
                    dtype=dtype,
                    desc=f"Writing {split}",
                )
                truncated = int(pc.sum(pc.greater(lengths, self.seq_len)).as_py() or 0)
                info |= {"rows": rows, "truncated": truncated}
                if rows:
                    log.info("%s: %d of %d documents truncated to %d tokens", split, truncated, rows, self.seq_len)
            meta["splits"][split] = info
        return meta

    def _datasets(self, folder: Path, meta: dict[str, Any]) -> tuple[Dataset, Dataset]:
        loss_mask = not self.loss_on_pad
        if self.packing == "wrap":
            sets = [
                WrappedStream(
                    folder / f"{split}_stream.npy",
                    seq_len=self.seq_len,
                    bos_id=self.bos_id,
                    eos_id=self.eos_id,
                    pad_id=self.pad_id,
                    drop_remainder=self.drop_remainder,
                    loss_mask=loss_mask,
                )
                for split in ("train", "val")
            ]
        else:
            sets = [
                PaddedRows({"tokens": folder / f"{split}_tokens.npy"}, pad_id=self.pad_id, loss_mask=loss_mask)
                for split in ("train", "val")
            ]
        return sets[0], sets[1]

    def describe(self) -> dict[str, Any]:
        """Flat parameters for logging."""
        return {
            "task": "text",
            "source": self.name if self.files is None else str(self.files),
            "packing": self.packing,
            "tokenizer": self.tokenizer_name,
            "vocab_size": self.vocab_size,
            "pad_id": self.pad_id,
            "seq_len": self.seq_len,
            "loss_on_pad": self.loss_on_pad,
            "batch_size": self.batch_size,
            "num_train": None if self.train_set is None else len(self.train_set),
            "num_val": None if self.val_set is None else len(self.val_set),
            "cache": str(self.cache_path),
        }
