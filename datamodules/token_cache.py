"""The base of the tokenised datamodules (text, GSM8K): a tokenizer with PAD, one cache folder per configuration,
global batch sizes (methods.md §7).

The cache is one folder per configuration under ``cache_dir`` (``.npy`` arrays opened as memory maps, and a
``meta.json`` written last); a second setup with the same configuration reads it without tokenising. Tokenisation
runs through ``datasets.Dataset.map(batched=True, num_proc=...)`` with its cache files in a work folder beside it
(removed once the arrays are written; an interrupted build resumes from them).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import inspect
import json
import logging
import os
import shutil
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import Tensor
from torch.utils.data import Dataset

from datamodules.base import GlobalBatchDataModule, check_ints, check_optional_ints
from datamodules.sources import arrow_files_of, load_tokenizer, tokenizer_digest
from datamodules.token_arrays import cache_remedy, write_padded
from flowlm.tasks.files import DamagedFileError

log = logging.getLogger(__name__)


CACHE_VERSION = 1  # bump when the cached arrays' layout or content rules change


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
        pad_token: str = "add",
    ) -> None:
        super().__init__()
        check_ints(
            ("seq_len", seq_len, 2), ("batch_size", batch_size, 1), ("num_workers", num_workers, 0), ("seed", seed, 0)
        )
        check_optional_ints(("val_batch_size", val_batch_size), ("num_proc", num_proc))
        self.tokenizer_name = str(tokenizer)
        self.pad_token = pad_token
        self.tokenizer = load_tokenizer(tokenizer, pad_token)  # now, not in setup: the runner reads vocab_size first
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

    @staticmethod
    def _base_arguments(values: dict[str, Any]) -> dict[str, Any]:
        """This base's constructor arguments, picked by name from a subclass constructor's ``locals()``: the
        subclass states them (its defaults, its type hints) and forwards them all with
        ``super().__init__(**self._base_arguments(locals()))``."""
        names = list(inspect.signature(TokenCacheDataModule.__init__).parameters)[1:]  # after self
        return {name: values[name] for name in names}

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
        """The PAD id: never [MASK]; a distinct id with ``pad_token=add`` (default), EOS with ``pad_token=eos``."""
        return int(self.tokenizer.pad_token_id)

    @property
    def mask_token_id(self) -> int | None:
        """The tokenizer's own mask token (LLaDA's ``<|mdm_mask|>``, Dream's ``<|mask|>``: inside the vocabulary), or
        None (GPT-2, Llama-2/TinyLlama: the model's [MASK] is then an extra id)."""
        return self.tokenizer.mask_token_id

    @property
    def mask_id(self) -> int:
        """The id MDM-family models give [MASK] on these data: the tokenizer's own mask token when it has one (the
        model's ``mask_id`` for LLaDA / Dream), else vocab_size (an extra id, not a tokenizer id: the DiT's, SMDM's).
        A DiT always puts its [MASK] at vocab_size; the tokenizer's mask token is then an unused data id."""
        return self.vocab_size if self.mask_token_id is None else int(self.mask_token_id)

    @property
    def seq_len(self) -> int:
        """Tokens per sequence (L)."""
        return self._seq_len

    def _describe(self, **head: Any) -> dict[str, Any]:
        """Flat parameters for logging: a subclass's own ``head`` entries, then the tokenizer, shapes and loaders."""
        return {
            **head,
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
        self.cache_meta = self._read_meta(folder / "meta.json")
        self.train_set, self.val_set = self._datasets(folder, self.cache_meta)  # opens (checks) every array
        if not self.loss_on_pad:
            log.info("loss_on_pad=False: batches carry `loss_mask`; only methods that read it leave PAD untrained")
        self.check_train_size(stage)

    @staticmethod
    def _read_meta(path: Path) -> dict[str, Any]:
        """The cache's ``meta.json``; one that is not a JSON object with its ``splits`` raises DamagedFileError."""
        try:
            meta = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DamagedFileError(
                f"token cache file {path} is damaged ({type(e).__name__}: {e}); {cache_remedy(path.parent)}"
            ) from e
        if not isinstance(meta, dict) or not isinstance(meta.get("splits"), dict):
            raise DamagedFileError(f"token cache file {path} has no 'splits' record; {cache_remedy(path.parent)}")
        return meta

    def _write_rows(self, folder: Path, split: str, encoded, dtype) -> int:
        """The encoded ``split``'s ids as PAD-filled rows of L tokens in ``{split}_tokens.npy``; returns the rows."""
        return write_padded(
            folder / f"{split}_tokens.npy",
            encoded,
            seq_len=self.seq_len,
            pad_id=self.pad_id,
            dtype=dtype,
            desc=f"Writing {split}",
        )

    def _map(self, dataset, fn: Callable, *, work: Path, name: str, with_indices: bool = False):
        """``dataset.map(fn, batched=True)`` with its cache file in ``work`` and a fingerprint from our identity."""
        key = hashlib.sha256(f"{self.cache_path.name}/{name}".encode()).hexdigest()[:16]
        resumed = any(work.glob(f"{glob.escape(name)}*.arrow"))  # an interrupted build's output, read back by map()
        remedy = f"delete {work} (an interrupted tokenisation's files): the next run tokenises from the start"
        with arrow_files_of(work, remedy) if resumed else contextlib.nullcontext():
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
