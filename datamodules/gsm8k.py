"""GSM8K-style question → answer data as prompt-conditioned token batches (methods.md §7).

Two recipes, chosen by config: TinyGSM (``TinyGSM/TinyGSM``: ``question`` → Python ``code``; FMLM+) or GSM8K
natural language (``openai/gsm8k`` ``main``: ``question`` → ``answer`` ending in ``#### N``; MLFM/SMDM), or local
JSONL with the same fields. Evaluation (the val loader) is the GSM8K test split (1 319 problems) by default.

One row: ``[BOS] prompt | response [EOS] PAD … PAD`` with ``prompt = prompt_template.format(question=...)`` and
``response = response_template.format(response=...)``, tokenised separately so the prompt boundary is exact.
Batches: ``tokens`` (B, L) long; ``prompt_mask`` (B, L) bool, True exactly on ``[BOS] prompt`` (pinned clean);
``gold`` (B,) float64, the ``#### N`` number of the example's ``gold_field`` (NaN when unknown, e.g. TinyGSM
training rows); ``index`` (B,) long, the example's position in its source split; ``loss_mask`` only when
``loss_on_pad=False``. PAD (distinct from [MASK] = ``vocab_size``) fills the response region after EOS and is
trained as a target by default, so the model learns where an answer ends.

Length filter: a training example whose prompt + response exceeds L is dropped; an evaluation problem is kept
(its reference response truncated) unless its prompt leaves fewer than ``min_response_tokens`` positions, so the
test set keeps its size. Counts are logged and kept in ``cache_meta["splits"][split]["dropped"]``.

Metric interface (``flowlm/metrics/text_metrics.py``: ``GSM8KAccuracy``): ``tokenizer``, ``pad_id``,
``response_mask(target_tokens)`` (B, L) bool, ``gold_answers(target_tokens_or_indices)`` → list of float | None.
"""

from __future__ import annotations

import logging
import math
import os
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from datamodules.base import check_ints, check_optional_ints
from datamodules.sources import builder_for, load_documents, local_files, source_identity
from datamodules.token_arrays import PaddedRows, load_array, token_dtype
from datamodules.token_cache import TokenCacheDataModule
from flowlm.metrics.gsm8k import parse_gold

log = logging.getLogger(__name__)

_CALCULATOR = re.compile(r"<<[^>]*>>")  # GSM8K's calculator annotations, e.g. "<<48/2=24>>"


def gold_number(answer: Any) -> float:
    """The ``#### N`` number of a GSM8K answer (commas, signs, decimals), NaN when absent or unparsable."""
    if answer is None:
        return math.nan
    try:
        return parse_gold(answer)
    except ValueError:
        return math.nan


class GSM8KEncoder:
    """Examples → cached rows (a picklable batched ``map`` function with indices); drops rows that do not fit.

    Returns ``ids`` (``[BOS] prompt response [EOS]``, ≤ L), ``prompt_len``, ``gold`` and ``index``. Training
    rows must fit whole; evaluation rows need ``min_response`` free positions and their response is truncated.
    """

    def __init__(
        self,
        tokenizer,
        *,
        question_field: str,
        response_field: str,
        gold_field: str | None,
        prompt_template: str,
        response_template: str,
        strip_calculator: bool,
        seq_len: int,
        bos_id: int | None,
        eos_id: int | None,
        evaluation: bool,
        min_response: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.question_field, self.response_field, self.gold_field = question_field, response_field, gold_field
        self.prompt_template, self.response_template = prompt_template, response_template
        self.strip_calculator, self.seq_len = strip_calculator, seq_len
        self.bos_id, self.eos_id = bos_id, eos_id
        self.evaluation, self.min_response = evaluation, min_response

    def __call__(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        n = len(indices)
        questions = batch[self.question_field]
        responses = batch.get(self.response_field, [None] * n)  # the test split of another recipe has none
        golds = batch.get(self.gold_field, [None] * n) if self.gold_field else [None] * n
        prompts = [self.prompt_template.format(question=q) for q in questions]
        texts = ["" if r is None else self.response_template.format(response=self._clean(r)) for r in responses]
        encode = lambda xs: self.tokenizer(xs, add_special_tokens=False, verbose=False)["input_ids"]  # noqa: E731
        head = [] if self.bos_id is None else [self.bos_id]
        tail = [] if self.eos_id is None else [self.eos_id]
        out = {"ids": [], "prompt_len": [], "gold": [], "index": []}
        for i, p, r, response, gold in zip(indices, encode(prompts), encode(texts), responses, golds, strict=True):
            prompt = head + p
            answer = [] if response is None else r + tail  # no reference: the response region is all PAD
            if self.evaluation:
                if len(prompt) + self.min_response > self.seq_len:
                    continue
                answer = answer[: self.seq_len - len(prompt)]
            elif len(prompt) + len(answer) > self.seq_len:
                continue
            out["ids"].append(prompt + answer)
            out["prompt_len"].append(len(prompt))
            out["gold"].append(gold_number(gold))
            out["index"].append(i)
        return out

    def _clean(self, response: str) -> str:
        return _CALCULATOR.sub("", response) if self.strip_calculator else response


class GSM8KDataModule(TokenCacheDataModule):
    """GSM8K / TinyGSM training rows and GSM8K test problems (see the module docstring); batch sizes are global.

    Sources: ``train_name`` (+ ``train_config``, ``train_split``) or ``train_files`` (JSONL/JSON/parquet with the
    same fields; a path is taken as the split ``train_split``), likewise ``eval_*`` for the problems scored.
    """

    cache_prefix = "gsm8k"

    def __init__(
        self,
        *,
        train_name: str | None = "openai/gsm8k",
        train_config: str | None = "main",
        train_split: str = "train",
        train_files: Any = None,
        eval_name: str | None = "openai/gsm8k",
        eval_config: str | None = "main",
        eval_split: str = "test",
        eval_files: Any = None,
        revision: str | None = None,
        question_field: str = "question",
        response_field: str = "answer",
        gold_field: str | None = "answer",
        prompt_template: str = "Question: {question}\nAnswer:",
        response_template: str = " {response}",
        strip_calculator: bool = False,
        min_response_tokens: int = 32,
        max_train_examples: int | None = None,
        max_eval_examples: int | None = None,
        tokenizer: str = "gpt2",
        seq_len: int = 256,
        add_bos_eos: bool = True,
        loss_on_pad: bool = True,
        cache_dir: str | os.PathLike = "data_cache/gsm8k",
        hf_cache_dir: str | os.PathLike | None = None,
        pad_token: str = "add",
        num_proc: int | None = None,
        batch_size: int = 64,
        val_batch_size: int | None = None,
        num_workers: int = 0,
        pin_memory: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(**self._base_arguments(locals()))
        self.save_hyperparameters(logger=False)  # the runner logs the data config itself (as Sudoku does)
        # Files override the default hub name, so `data.train_files=x.jsonl` alone switches to a local source.
        for role, name, files in (("train", train_name, train_files), ("eval", eval_name, eval_files)):
            if name is None and files is None:
                raise ValueError(f"give {role}_name (HF dataset) or {role}_files (local JSONL/JSON/parquet)")
        if "{question}" not in prompt_template:
            raise ValueError(f"prompt_template must contain '{{question}}', got {prompt_template!r}")
        if "{response}" not in response_template:
            raise ValueError(f"response_template must contain '{{response}}', got {response_template!r}")
        check_ints(("min_response_tokens", min_response_tokens, 1))
        check_optional_ints(("max_train_examples", max_train_examples), ("max_eval_examples", max_eval_examples))
        if add_bos_eos:
            self._need_bos_eos("add_bos_eos")
        self.sources = {
            "train": {
                "name": None if train_files is not None else train_name,
                "config_name": train_config,
                "split": train_split,
                "files": None if train_files is None else {train_split: train_files},
            },
            "val": {
                "name": None if eval_files is not None else eval_name,
                "config_name": eval_config,
                "split": eval_split,
                "files": None if eval_files is None else {eval_split: eval_files},
            },
        }
        for source in self.sources.values():  # now, not at the first load (after the run folder is made)
            if source["files"] is not None:
                builder_for(local_files(source["files"])[source["split"]])
        self.revision = revision
        self.question_field, self.response_field, self.gold_field = question_field, response_field, gold_field
        self.prompt_template, self.response_template = prompt_template, response_template
        self.strip_calculator, self.min_response_tokens = strip_calculator, min_response_tokens
        self.limits = {"train": max_train_examples, "val": max_eval_examples}
        self._lookup: dict[bytes, int] | None = None
        self._val_arrays: dict[str, np.ndarray] | None = None

    # --- what metrics and samplers read ------------------------------------------------------------------------

    @property
    def answer_format(self) -> str:
        """'code' (TinyGSM functions, scored by sandboxed execution) or 'nl' (scored by number extraction)."""
        return "code" if self.response_field == "code" else "nl"

    @property
    def prompt_len(self) -> int:
        """The longest evaluation prompt (0 before setup): the fewest positions a sampler has to generate into."""
        if self.val_set is None or len(self.val_set) == 0:
            return 0
        return int(self._val()["prompt_len"].max())

    def _val(self) -> dict[str, np.ndarray]:
        if self.val_set is None:
            raise RuntimeError("call setup() first")
        if self._val_arrays is None:
            files = self.val_set.arrays.files
            self._val_arrays = {k: load_array(p, mmap=False) for k, p in files.items()}  # small: 1 319 problems
        return self._val_arrays

    def _rows_of(self, target_tokens: Tensor) -> list[int]:
        """Validation row of each target row (B, L), found by its exact tokens."""
        arrays = self._val()
        if self._lookup is None:
            tokens = arrays["tokens"].astype(np.int64)
            self._lookup = {}
            for row, key in enumerate(tokens):
                self._lookup.setdefault(key.tobytes(), row)
        rows = []
        for key in target_tokens.detach().cpu().long().numpy():
            row = self._lookup.get(key.tobytes())
            if row is None:
                raise KeyError("a target row is not a validation example of this datamodule (tokens not found)")
            rows.append(row)
        return rows

    def response_mask(self, target_tokens: Tensor) -> Tensor:
        """(B, L) bool: True on the positions the model generates (after the prompt), for validation targets."""
        prompt = torch.as_tensor(self._val()["prompt_len"][self._rows_of(target_tokens)], dtype=torch.long)
        return torch.arange(target_tokens.shape[1])[None] >= prompt[:, None]

    def gold_answers(self, targets: Tensor) -> list[float | None]:
        """Gold number of each validation target row (B, L tokens) or source index (B,); None when unknown."""
        arrays = self._val()
        if targets.dim() == 1:
            where = {int(i): row for row, i in enumerate(arrays["index"])}
            rows = [where[int(i)] for i in targets.detach().cpu()]
        else:
            rows = self._rows_of(targets)
        return [None if math.isnan(g) else float(g) for g in arrays["gold"][rows]]

    # --- cache ---------------------------------------------------------------------------------------------------

    def _cache_label(self) -> str:
        train = self.sources["train"]
        if train["files"] is not None:
            source = Path(next(iter(local_files(train["files"]).values()))[0]).stem.replace("*", "all")
        else:
            source = str(train["name"]).rstrip("/").split("/")[-1]
        return f"gsm8k_{source}_{self.answer_format}"

    def _identity(self) -> dict[str, Any]:
        sources = {
            split: {
                "source": source_identity(
                    name=s["name"],
                    config_name=s["config_name"],
                    revision=self.revision,
                    files=s["files"],
                    txt_docs="line",
                ),
                "split": s["split"],
                "limit": self.limits[split],
            }
            for split, s in self.sources.items()
        }
        return {
            "task": "gsm8k",
            "sources": sources,
            "fields": [self.question_field, self.response_field, self.gold_field],
            "templates": [self.prompt_template, self.response_template],
            "strip_calculator": self.strip_calculator,
            "min_response_tokens": self.min_response_tokens,
            "seq_len": self.seq_len,
            "add_bos_eos": self.add_bos_eos,
        }

    def examples(self, split: str):
        """The raw ``train`` or ``val`` examples (``datasets.Dataset``) before tokenisation and filtering."""
        s = self.sources[split]
        data = load_documents(
            name=s["name"],
            config_name=s["config_name"],
            split=s["split"],
            files=s["files"],
            revision=self.revision,
            hf_cache_dir=self.hf_cache_dir,
            local_cache_dir=self.cache_dir / "hf",
            fields=(self.question_field,) if split == "val" else (self.question_field, self.response_field),
        )
        if self.question_field not in data.column_names:
            raise KeyError(f"{split} data has no field {self.question_field!r}; it has {data.column_names}")
        if split == "train" and self.response_field not in data.column_names:
            raise KeyError(f"train data has no field {self.response_field!r}; it has {data.column_names}")
        limit = self.limits[split]
        return data if limit is None else data.select(range(min(limit, len(data))))

    def encoder(self, *, evaluation: bool) -> GSM8KEncoder:
        """The batched ``map`` function for the train (``evaluation=False``) or evaluation split."""
        return GSM8KEncoder(
            self.tokenizer,
            question_field=self.question_field,
            response_field=self.response_field,
            gold_field=self.gold_field,
            prompt_template=self.prompt_template,
            response_template=self.response_template,
            strip_calculator=self.strip_calculator,
            seq_len=self.seq_len,
            bos_id=self.bos_id if self.add_bos_eos else None,
            eos_id=self.eos_id if self.add_bos_eos else None,
            evaluation=evaluation,
            min_response=self.min_response_tokens,
        )

    def _build(self, folder: Path, work: Path) -> dict[str, Any]:
        dtype = token_dtype(self.vocab_size)
        meta: dict[str, Any] = {"dtype": dtype.name, "splits": {}}
        examples = {split: self.examples(split) for split in ("train", "val")}  # every file read before tokenising
        for split, data in examples.items():
            fn = self.encoder(evaluation=split == "val")
            encoded = self._map(data, fn, work=work, name=split, with_indices=True)
            self._write_rows(folder, split, encoded, dtype)
            np.save(folder / f"{split}_prompt_len.npy", encoded.data.column("prompt_len").to_numpy().astype(np.int32))
            np.save(folder / f"{split}_gold.npy", encoded.data.column("gold").to_numpy().astype(np.float64))
            np.save(folder / f"{split}_index.npy", encoded.data.column("index").to_numpy().astype(np.int64))
            dropped = len(data) - len(encoded)
            meta["splits"][split] = {"examples": len(data), "rows": len(encoded), "dropped": dropped}
            if dropped:
                rule = f"prompt + {self.min_response_tokens} response tokens" if split == "val" else "prompt + response"
                message = f"{split}: dropped {dropped} of {len(data)} examples whose {rule} exceed L = {self.seq_len}"
                if split == "val":  # the reported accuracy is then over fewer problems
                    warnings.warn(message, stacklevel=2)
                log.info(message)
        return meta

    def _datasets(self, folder: Path, meta: dict[str, Any]) -> tuple[Dataset, Dataset]:
        self._lookup, self._val_arrays = None, None
        sets = [
            PaddedRows(
                {k: folder / f"{split}_{k}.npy" for k in ("tokens", "prompt_len", "gold", "index")},
                pad_id=self.pad_id,
                loss_mask=not self.loss_on_pad,
            )
            for split in ("train", "val")
        ]
        return sets[0], sets[1]

    @property
    def dropped(self) -> dict[str, int]:
        """Examples removed by the length filter, per split (after setup)."""
        if self.cache_meta is None:
            raise RuntimeError("call setup() first")
        return {split: info["dropped"] for split, info in self.cache_meta["splits"].items()}

    def describe(self) -> dict[str, Any]:
        """Flat parameters for logging."""
        return self._describe(
            task="gsm8k",
            answer_format=self.answer_format,
            train_source=self.sources["train"]["name"] or str(self.sources["train"]["files"]),
            eval_source=self.sources["val"]["name"] or str(self.sources["val"]["files"]),
        )
