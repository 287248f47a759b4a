"""The registry of foreign checkpoint layouts the suite reads (docs/pretrained.md), and what a reader returns.

A reader (``SourceFormat``) recognises its layout from the files (a folder) or the unpickled payload (a file) and
converts it into a ``PretrainedMDM``: the weights under the suite's DiT names, the ``build_dit`` options that make
the suite's DiT compute the source's function, and the vocabulary layout ([MASK] = the last row). Readers are
picked by what they detect, never by a name the user types: ``detect_format`` asks each in turn.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import Tensor

# Rows of these DiT tensors index the vocabulary ([MASK] last).
VOCAB_ROW_TENSORS = ("embed.weight", "final.linear.weight", "final.linear.bias")
# The logit a PAD row inserted by ``insert_pad_row`` outputs: exp(−100) ≈ 4e−44 is below float32's resolution
# next to any real logit ≥ −80, so log-softmax over the other tokens is unchanged bit for bit; a finite value that
# training can lift (PAD targets of padded data move the zero weight row at once).
PAD_LOGIT = -100.0


@dataclass
class PretrainedMDM:
    """A masked diffusion model read from a foreign layout, in the suite's DiT names and options."""

    state: dict[str, Tensor]  # DiT names (embed.weight, blocks.0.qkv.weight, …): the weights to use (EMA if any)
    backbone: dict  # build_dit keyword arguments (sizes and options) that compute the source's function
    data_vocab_size: int  # tokens before [MASK]; [MASK] = data_vocab_size, the last row
    seq_len: int  # the context the source was trained with
    live: dict[str, Tensor] | None = None  # the non-averaged weights, when the source holds both
    provenance: dict = field(default_factory=dict)  # format, path, what the conversion did


class SourceFormat(ABC):
    """One foreign checkpoint layout: detect it, convert it."""

    name: str = ""

    @abstractmethod
    def matches(self, path: Path, payload: object | None) -> bool:
        """Whether ``path`` (a folder or file) is in this layout; ``payload`` is the unpickled file, if any."""

    @abstractmethod
    def read(self, path: Path, payload: object | None) -> PretrainedMDM:
        """The source as a ``PretrainedMDM``; ValueError naming the offending keys/shapes for a damaged one."""


FORMATS: list[SourceFormat] = []  # filled when flowlm.pretrained is imported (its __init__ imports each reader)


def register_format(fmt: SourceFormat) -> SourceFormat:
    """Add a reader to the registry (each format module registers its readers at import)."""
    if all(type(known) is not type(fmt) for known in FORMATS):
        FORMATS.append(fmt)
    return fmt


def detect_format(path: Path, payload: object | None = None) -> SourceFormat | None:
    """The registered reader that recognises ``path``/``payload``, or None."""
    return next((fmt for fmt in FORMATS if fmt.matches(path, payload)), None)


def known_formats() -> list[str]:
    """Names of the registered layouts (for error messages)."""
    return [fmt.name for fmt in FORMATS]


def insert_pad_row(model: PretrainedMDM) -> PretrainedMDM:
    """The same model over one more data token, a [PAD] at id ``data_vocab_size`` before [MASK] (the suite's text
    data add [PAD] to a tokenizer without one, GPT-2's included: datamodules/sources.py). Its embedding row and
    head row are zero and its head bias ``PAD_LOGIT``: every other logit is unchanged, [MASK] moves up by one."""

    def widen(tensors: dict[str, Tensor] | None) -> dict[str, Tensor] | None:
        if tensors is None:
            return None
        out = dict(tensors)
        n = model.data_vocab_size
        for name in VOCAB_ROW_TENSORS:
            t = tensors[name]
            row = torch.full_like(t[:1], PAD_LOGIT) if name == "final.linear.bias" else torch.zeros_like(t[:1])
            out[name] = torch.cat([t[:n], row, t[n:]])
        return out

    notes = {**model.provenance, "pad_row": f"[PAD] inserted at id {model.data_vocab_size} (logit {PAD_LOGIT})"}
    return replace(
        model,
        state=widen(model.state),
        live=widen(model.live),
        data_vocab_size=model.data_vocab_size + 1,
        provenance=notes,
    )
