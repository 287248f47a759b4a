"""The token cache's arrays (methods.md §7): writers of the ``.npy`` files, and datasets serving them as batches.

Items are ``{"tokens": (L,) long, "prompt_mask": (L,) bool}``, plus ``"loss_mask"`` (L,) bool when asked for
(``loss_on_pad=False``: the positions that are neither PAD nor prompt). Arrays are opened as memory maps, once per
process (data-loader workers reopen them rather than copy them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from flowlm.tasks.files import DamagedFileError

_WRITE_BATCH = 10_000  # documents per Arrow batch when writing the arrays


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (GPT-2 + PAD does), else int32: half the disk for OpenWebText."""
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.int32)


def cache_remedy(folder: Path) -> str:
    """What to do with a damaged token cache folder."""
    return f"delete the cache folder (rm -r {folder}): the next run tokenises the data again"


def load_array(path: Path, *, mmap: bool = True) -> np.ndarray:
    """A cached ``.npy`` array (a read-only memory map unless ``mmap`` is False); a missing, cut or overwritten file
    raises DamagedFileError naming it (numpy says "mmap length is greater than file size", without the file)."""
    try:
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise DamagedFileError(
            f"token cache file {path} is damaged ({type(e).__name__}: {e}); {cache_remedy(Path(path).parent)}"
        ) from e


class _Memmaps:
    """Named ``.npy`` files opened read-only as memory maps on first use in each process (worker-safe); ``open``
    opens them all now and checks that they hold the same number of rows."""

    def __init__(self, files: Mapping[str, Path]) -> None:
        self.files = dict(files)
        self._arrays: dict[str, np.ndarray] | None = None

    def __getitem__(self, key: str) -> np.ndarray:
        if self._arrays is None:
            self._arrays = {k: load_array(p) for k, p in self.files.items()}
        return self._arrays[key]

    def open(self) -> dict[str, np.ndarray]:
        """Every array, opened (a damaged file fails here, before training); their first dimensions must agree."""
        arrays = {k: self[k] for k in self.files}
        rows = {k: a.shape[0] for k, a in arrays.items()}
        if len(set(rows.values())) > 1:
            folder = Path(next(iter(self.files.values()))).parent
            raise DamagedFileError(
                f"token cache {folder}: its arrays disagree in length {rows}; {cache_remedy(folder)}"
            )
        return arrays

    def __getstate__(self) -> dict:
        # Pickling a memmap copies its data; workers reopen the files instead.
        return {"files": self.files, "_arrays": None}


class PaddedRows(Dataset):
    """Rows of a (N, L) token array; optional per-row ``prompt_len``, ``gold`` and ``index`` arrays."""

    def __init__(self, files: Mapping[str, Path], *, pad_id: int, loss_mask: bool) -> None:
        self.arrays = _Memmaps(files)
        self.pad_id, self.loss_mask = pad_id, loss_mask
        self.length, self.seq_len = self.arrays.open()["tokens"].shape

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
        total = self.arrays.open()["stream"].shape[0]
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
