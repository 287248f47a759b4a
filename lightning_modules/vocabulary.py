"""The data's special tokens against a LLaMA-family MDM's [MASK] (docs/pretrained.md, "Tokenizer conventions").

SMDM's tokenizer (TinyLlama) has no mask token: its [MASK] is the extra id |V| = 32 000 (the embedding row the head
does not predict). LLaDA (``<|mdm_mask|>`` 126 336, EOS = PAD 126 081) and Dream (``<|mask|>`` 151 666, EOS = PAD
151 643) keep [MASK] inside the vocabulary, as a special token of their tokenizers, and a checkpoint's head may have
more rows than its tokenizer has ids (Dream: Qwen2.5's padded 152 064). ``TargetKind.build``
(lightning_modules/base.py) refuses a data vocabulary the head does not cover (``BidirectionalLM.covers_data``: no
data id reaches a row the head lacks, a padded head only with [MASK] among the data ids); what it cannot see, the
tokenizer, is checked here (``check_data_tokens``), by the entry points, before any compute.
"""

from __future__ import annotations

from typing import Any


def check_data_tokens(datamodule: Any, module: Any) -> None:
    """Refuse, with the ids named, data whose special tokens contradict a LLaMA-family backbone's [MASK]: PAD = [MASK]
    (padding would read as noise to denoise), a tokenizer mask token that is not the backbone's ``mask_id``, or a
    backbone [MASK] that is an ordinary (non-special) token of a tokenizer without a mask token (text would read as
    [MASK]); a data id ≥ the head's rows is refused earlier, by ``TargetKind.build``. A DiT (its [MASK] is always
    the extra id |V|), a module without [MASK] (AR, FMLM+) and data without a tokenizer (Sudoku) have nothing to
    check."""
    from flowlm.backbones.llama import BidirectionalLM
    from lightning_modules.base import TargetKind

    tokenizer = getattr(datamodule, "tokenizer", None)
    mask = getattr(module, "mask_id", None)
    if tokenizer is None or mask is None or not isinstance(getattr(module, "backbone_kind", None), TargetKind):
        return
    vocab, pad, own = datamodule.vocab_size, datamodule.pad_id, datamodule.mask_token_id
    head = next(m for m in module.modules() if isinstance(m, BidirectionalLM)).head_rows  # MDM's net, MLFM's base
    where = f"backbone {module.backbone_cfg.get('_target_')} ([MASK] = id {mask}, {head} head rows)"
    if pad == mask:
        raise ValueError(
            f"the data's PAD id {pad} is the [MASK] id of {where}: padding would read as noise to denoise; pad with "
            "data.pad_token=eos (LLaDA, Dream, SMDM's SFT) or another token"
        )
    if own is not None and own != mask:
        raise ValueError(
            f"tokenizer {datamodule.tokenizer_name!r} has its mask token {tokenizer.mask_token!r} at id {own}, but "
            f"{where}: use the backbone's own tokenizer"
        )
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    if own is None and mask < vocab and mask not in special:
        raise ValueError(
            f"{where}: id {mask} is the ordinary token {tokenizer.convert_ids_to_tokens(mask)!r} of tokenizer "
            f"{datamodule.tokenizer_name!r}, which has no mask token: text would read as [MASK]; use the backbone's "
            "own tokenizer"
        )
