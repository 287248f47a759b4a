"""Where a text datamodule's documents and tokenizer come from: HF datasets (hub name, ``save_to_disk`` folder,
folder of data files) or local files (read through before loading), and a HF tokenizer with a distinct PAD.

The data vocabulary is the tokenizer's, with a distinct ``[PAD]`` added when it has none (GPT-2 has none:
50 257 + 1); models put [MASK] at ``vocab_size``, so PAD ≠ MASK. ``pad_token`` chooses otherwise for a pretrained
backbone whose vocabulary is the tokenizer's exactly: ``eos`` pads with EOS (SMDM's GSM8K SFT, the released
convention: 32 000 ids, [MASK] = 32 000), a token string pads with that existing token.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flowlm.tasks.files import DamagedFileError, DataFileError, json_records, project_path, text_lines

PAD_TOKEN = "[PAD]"
PAD_ADD, PAD_EOS = "add", "eos"  # data.pad_token: add a distinct [PAD] (default) | pad with EOS | an existing token


class DataUnavailableError(FileNotFoundError):
    """A dataset or tokenizer is neither on this machine nor downloadable (e.g. offline); says how to provide it."""


def load_tokenizer(name_or_path: str | os.PathLike, pad_token: str = PAD_ADD):
    """A HF tokenizer by hub name (``gpt2``), folder or ``tokenizer.json`` file, with its PAD set by ``pad_token``.

    ``add`` (default): PAD is added as ``[PAD]`` (a new id at the end) when the tokenizer has none or shares it with
    BOS/EOS, so that padding is never mistaken for text and never equals the models' [MASK] id (= the data
    vocabulary size). ``eos``: PAD = EOS, no new id (SMDM's SFT convention, and LLaDA's / Dream's: their
    ``pad_token_id`` is their EOS; docs/pretrained.md, "Tokenizer conventions"). Any other string: PAD = that token,
    which must already be in the vocabulary (no new id). PAD is never the tokenizer's own mask token (LLaDA's
    ``<|mdm_mask|>``, Dream's ``<|mask|>``), which is the model's [MASK].
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if not isinstance(pad_token, str) or not pad_token:
        raise ValueError(f"pad_token must be 'add', 'eos' or a token of the vocabulary, got {pad_token!r}")
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
    _register_mask_token(tokenizer)
    if pad_token == PAD_ADD:
        special = {tokenizer.bos_token_id, tokenizer.eos_token_id} - {None}
        if tokenizer.pad_token_id is None or tokenizer.pad_token_id in special:
            tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})
        return tokenizer
    if pad_token == PAD_EOS:
        if tokenizer.eos_token is None:
            raise ValueError(f"data.pad_token=eos: tokenizer {spec!r} has no EOS token")
        pad_token = tokenizer.eos_token
    if pad_token not in tokenizer.get_vocab():
        raise ValueError(
            f"data.pad_token={pad_token!r} is not a token of tokenizer {spec!r}; give 'add' (a new [PAD] id), 'eos' "
            "or an existing token"
        )
    if pad_token == tokenizer.mask_token:
        raise ValueError(
            f"data.pad_token={pad_token!r} is tokenizer {spec!r}'s mask token, the model's [MASK]: padding would read "
            "as noise to denoise; pad with 'eos' or another token"
        )
    size = len(tokenizer)
    tokenizer.pad_token = pad_token  # an existing token: no new id
    if len(tokenizer) != size:  # transformers added it after all: the vocabulary would no longer match the model
        raise ValueError(f"data.pad_token={pad_token!r} grew tokenizer {spec!r} from {size} to {len(tokenizer)} ids")
    return tokenizer


# The masked-diffusion LMs' own mask tokens, inside their vocabularies: LLaDA (126 336), Dream (151 666).
MASK_TOKENS = ("<|mdm_mask|>", "<|mask|>")


def _register_mask_token(tokenizer) -> None:
    """Make a known MDM mask token of the vocabulary (``MASK_TOKENS``) the tokenizer's ``mask_token`` when its config
    names none (no new id): the data then know the model's [MASK] (``TokenCacheDataModule.mask_id``)."""
    if tokenizer.mask_token is not None:
        return
    vocab = tokenizer.get_vocab()
    for name in MASK_TOKENS:
        if name in vocab:
            size = len(tokenizer)
            tokenizer.mask_token = name
            if len(tokenizer) != size:
                raise ValueError(f"setting the mask token {name!r} grew the tokenizer from {size} to {len(tokenizer)}")
            return


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


@contextmanager
def arrow_files_of(folder: Path, remedy: str, *, scan: bool = True) -> Iterator[None]:
    """Within the block, an Arrow file that cannot be read (cut short, overwritten: pyarrow's ``ArrowInvalid``, or
    an ``OSError`` such as "Expected to be able to read N bytes", neither naming the file) raises DamagedFileError
    naming it (the first unreadable ``*.arrow`` under ``folder``, when ``scan``; else ``folder``) and ``remedy``."""
    import pyarrow as pa

    try:
        yield
    except (pa.ArrowException, OSError) as e:
        if not _raised_by_pyarrow(e):  # a missing file, the network, permissions: their own errors
            raise
        bad = _first_unreadable_arrow(folder) if scan else None
        where = str(bad) if bad else f"an Arrow file under {folder}"
        raise DamagedFileError(f"{where} is damaged or cut short ({type(e).__name__}: {e}); {remedy}") from e


def _raised_by_pyarrow(err: BaseException) -> bool:
    """Whether ``err`` was raised inside pyarrow (its innermost frame is pyarrow's), as reading an Arrow file raises."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and "pyarrow" in Path(tb.tb_frame.f_code.co_filename).parts


def _first_unreadable_arrow(folder: Path) -> Path | None:
    import pyarrow as pa

    for path in sorted(folder.rglob("*.arrow")):
        try:
            with pa.memory_map(str(path)) as source:  # zero-copy: only the messages' headers are read
                pa.ipc.open_stream(source).read_all()
        except (pa.ArrowException, OSError):
            return path
    return None


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
        where = Path(cache or datasets.config.HF_DATASETS_CACHE)
        copies = f"{where} (the Arrow copies of data.files)" if cache else f"its dataset's folder under {where}"
        with arrow_files_of(where, f"delete {copies}: the next run reads the files again"):
            return datasets.load_dataset(
                builder, data_files={split: table[split]}, split=split, cache_dir=cache, **extra
            )
    path = project_path(name)
    if path.is_dir():
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            with arrow_files_of(path, "save the dataset there again (save_to_disk), or point data.name elsewhere"):
                saved = datasets.load_from_disk(str(path))
            if isinstance(saved, datasets.DatasetDict):
                if split not in saved:
                    raise ValueError(f"{path} has splits {sorted(saved)}, not {split!r}")
                return saved[split]
            if split != "train":
                raise ValueError(f"{path} holds one unsplit dataset; use it as train and set val_last_n")
            return saved
        hf_cache = Path(hf_cache_dir or datasets.config.HF_DATASETS_CACHE)
        with arrow_files_of(hf_cache, f"delete this folder's dataset under {hf_cache}: the next run converts it again"):
            return datasets.load_dataset(str(path), config_name, split=split, cache_dir=hf_cache_dir)
    hf_cache = Path(hf_cache_dir or datasets.config.HF_DATASETS_CACHE)
    remedy = f"delete the dataset's folder under {hf_cache} (or load it once with download_mode='force_redownload')"
    try:
        with arrow_files_of(hf_cache, remedy, scan=False):  # the whole HF cache is not searched for the file
            return datasets.load_dataset(name, config_name, split=split, revision=revision, cache_dir=hf_cache_dir)
    except DamagedFileError:
        raise
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
