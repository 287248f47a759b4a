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

Sources and tokenizer: ``datamodules/sources.py``; the cache folder (one per configuration, ``meta.json`` last):
``datamodules/token_cache.py``; its arrays and the datasets over them: ``datamodules/token_arrays.py``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from datamodules.base import check_optional_ints
from datamodules.sources import builder_for, load_documents, local_files, source_identity
from datamodules.token_arrays import PaddedRows, WrappedStream, token_dtype, write_stream
from datamodules.token_cache import TokenCacheDataModule

log = logging.getLogger(__name__)

PACKINGS = ("truncate_pad", "wrap")


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
        pad_token: str = "add",
        num_proc: int | None = None,
        batch_size: int = 256,
        val_batch_size: int | None = None,
        num_workers: int = 0,
        pin_memory: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(**self._base_arguments(locals()))
        self.save_hyperparameters(logger=False)  # the runner logs the data config itself (as Sudoku does)
        if packing not in PACKINGS:
            raise ValueError(f"packing must be one of {PACKINGS}, got {packing!r}")
        if txt_docs not in ("line", "paragraph"):
            raise ValueError(f"txt_docs must be 'line' or 'paragraph', got {txt_docs!r}")
        if (name is None) == (files is None):
            raise ValueError(f"give exactly one of data.name and data.files (got name={name!r}, files={files!r})")
        if (val_split is None) == (val_last_n is None):
            raise ValueError("give exactly one of val_split (the source's own split) and val_last_n (last N docs)")
        check_optional_ints(
            ("val_last_n", val_last_n), ("max_train_docs", max_train_docs), ("max_val_docs", max_val_docs)
        )
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
                rows = self._write_rows(folder, split, encoded, dtype)
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
        return self._describe(
            task="text", source=self.name if self.files is None else str(self.files), packing=self.packing
        )
