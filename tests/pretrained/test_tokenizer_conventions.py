"""The tokenizer conventions of the LLaMA-family MDMs on the data side (docs/pretrained.md, "Tokenizer conventions"):
SMDM ([MASK] = the extra id |V|, PAD = EOS), LLaDA and Dream ([MASK] inside the vocabulary, PAD = EOS), on tiny
tokenizers built with `tokenizers` that put the special tokens at the released ones' relative places; the refusals of
data whose PAD or mask token contradicts the backbone's [MASK], before any compute."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fixtures.make_fixtures import HERE

from datamodules.gsm8k import GSM8KDataModule
from datamodules.sources import load_tokenizer
from lightning_modules.mdm import MDMModule
from lightning_modules.vocabulary import check_data_tokens
from tests.datamodules.test_pad_token import gsm_dm  # the fixture GSM8K problems as a datamodule (L = 256)

GSM8K = HERE / "gsm8k_sample.jsonl"
WORDS = "the a of to and is in it that was he for on are as with his they at be this how many what".split()
TARGET = "flowlm.backbones.llama.BidirectionalLM"


def _save(tmp_path_factory, name: str, vocab: dict[str, int], specials: list[str], **roles) -> Path:
    """A WordLevel tokenizer over ``vocab`` (``specials`` added as special tokens, ids as given), saved to a folder."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab, unk_token=roles.pop("unk_token")))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens([AddedToken(s, special=True) for s in specials])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, **roles)
    assert [tok.convert_tokens_to_ids(s) for s in specials] == [vocab[s] for s in specials]  # ids kept
    path = tmp_path_factory.mktemp(name)
    tok.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def llada_tok(tmp_path_factory) -> Path:
    """LLaDA's layout (126 080 <|startoftext|> BOS, 126 081 <|endoftext|> EOS = PAD, 126 336 <|mdm_mask|>, 126 348
    <|eot_id|>, after the text tokens): no PAD and no mask token named in its config (LLaDA's generate hard-codes
    the mask id); 36 ids."""
    vocab = {"<|unk|>": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    n = len(vocab)
    extra = {"<|startoftext|>": n, "<|endoftext|>": n + 1, "<|r0|>": n + 2, "<|r1|>": n + 3, "<|mdm_mask|>": n + 4}
    extra |= {"<|r2|>": n + 5, "<|eot_id|>": n + 6}
    vocab |= extra
    return _save(
        tmp_path_factory,
        "llada_tok",
        vocab,
        list(extra),
        unk_token="<|unk|>",
        bos_token="<|startoftext|>",
        eos_token="<|endoftext|>",
    )


@pytest.fixture(scope="module")
def dream_tok(tmp_path_factory) -> Path:
    """Dream's layout (Qwen2.5: 151 643 <|endoftext|> EOS = PAD, then <|im_start|>, <|im_end|>; Dream's
    <|beginoftext|> 151 665 BOS and <|mask|> 151 666, the tokenizer's mask token); 34 ids."""
    vocab = {"<|unk|>": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    n = len(vocab)
    extra = {"<|endoftext|>": n, "<|im_start|>": n + 1, "<|im_end|>": n + 2, "<|beginoftext|>": n + 3}
    extra |= {"<|mask|>": n + 4}
    vocab |= extra
    return _save(
        tmp_path_factory,
        "dream_tok",
        vocab,
        list(extra),
        unk_token="<|unk|>",
        bos_token="<|beginoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        mask_token="<|mask|>",
    )


@pytest.fixture(scope="module")
def smdm_tok(tmp_path_factory) -> Path:
    """Llama-2 / TinyLlama's layout (<unk> 0, <s> 1, </s> 2, no PAD, no mask token): SMDM's."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    return _save(
        tmp_path_factory,
        "smdm_tok",
        vocab,
        ["<unk>", "<s>", "</s>"],
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
    )


def _saved_size(path: Path) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(str(path)))


@pytest.mark.parametrize(
    ("name", "eos", "mask"),
    [("llada_tok", "<|endoftext|>", "<|mdm_mask|>"), ("dream_tok", "<|endoftext|>", "<|mask|>")],
)
def test_eos_pads_with_eos_keeps_the_vocabulary_and_the_mask_inside(request, name, eos, mask):
    path = request.getfixturevalue(name)
    tok = load_tokenizer(path, "eos")
    assert len(tok) == _saved_size(path)  # no new id: the data vocabulary is the tokenizer's
    assert tok.pad_token_id == tok.eos_token_id == tok.convert_tokens_to_ids(eos)
    assert tok.mask_token_id == tok.convert_tokens_to_ids(mask) < len(tok)  # [MASK] inside the vocabulary
    assert tok.mask_token_id > tok.eos_token_id  # at its released relative place (after EOS)
    added = load_tokenizer(path, "add")  # a distinct [PAD] at the end; the mask token stays where it was
    assert len(added) == len(tok) + 1 and added.pad_token_id == len(tok) and added.mask_token_id == tok.mask_token_id


def test_smdm_tokenizer_has_no_mask_token(smdm_tok):
    tok = load_tokenizer(smdm_tok, "eos")
    assert tok.mask_token_id is None and tok.pad_token_id == tok.eos_token_id == 2 and len(tok) == _saved_size(smdm_tok)


@pytest.mark.parametrize(("name", "mask"), [("llada_tok", "<|mdm_mask|>"), ("dream_tok", "<|mask|>")])
def test_padding_with_the_mask_token_is_refused(request, name, mask):
    with pytest.raises(ValueError, match="mask token"):
        load_tokenizer(request.getfixturevalue(name), mask)


@pytest.mark.parametrize("name", ["llada_tok", "dream_tok", "smdm_tok"])
def test_gsm8k_rows_pad_with_eos_and_never_hold_the_mask(request, tmp_path, name):
    path = request.getfixturevalue(name)
    dm = gsm_dm(tmp_path, path)
    size = _saved_size(path)
    own_mask = dm.tokenizer.mask_token_id
    assert dm.vocab_size == size and dm.pad_id == dm.eos_id
    assert dm.mask_id == (size if name == "smdm_tok" else own_mask)  # the model's [MASK]: extra id or the tokenizer's
    dm.prepare_data()
    dm.setup()
    row = dm.train_set[0]
    tokens = row["tokens"]
    assert tokens[0] == dm.bos_id and (tokens < size).all() and not (tokens == dm.mask_id).any()
    end = int((tokens == dm.eos_id).nonzero()[0])  # the response's EOS, then EOS padding to L
    assert end > 8 and (tokens[end:] == dm.eos_id).all() and tokens[end:].numel() > 1
    assert row["prompt_mask"][:end].any() and not row["prompt_mask"][end:].any()


def _llama(**layout) -> dict:
    return {"_target_": TARGET, "hidden_size": 16, "n_layers": 1, "n_heads": 2, "intermediate_size": 32, **layout}


def _module(dm: GSM8KDataModule, **layout) -> MDMModule:
    torch.manual_seed(0)
    return MDMModule(data_vocab_size=dm.vocab_size, seq_len=dm.seq_len, backbone=_llama(**layout), optim={})


def test_matched_backbones_are_accepted(tmp_path, llada_tok, dream_tok, smdm_tok):
    for path in (llada_tok, dream_tok):  # [MASK] inside: embedding and head rows = the vocabulary, mask_id = its own
        dm = gsm_dm(tmp_path, path)
        v = dm.vocab_size
        module = _module(dm, embed_rows=v, head_rows=v, mask_id=dm.tokenizer.mask_token_id)
        check_data_tokens(dm, module)
        assert module.mask_id == dm.mask_id
    dm = gsm_dm(tmp_path, smdm_tok)  # SMDM: [MASK] = |V|, the extra embedding row
    module = _module(dm, embed_rows=dm.vocab_size + 1, head_rows=dm.vocab_size, mask_id=dm.vocab_size)
    check_data_tokens(dm, module)
    assert module.mask_id == dm.mask_id


def test_a_mask_token_other_than_the_backbones_is_refused(tmp_path, llada_tok):
    dm = gsm_dm(tmp_path, llada_tok)
    v, eot = dm.vocab_size, dm.tokenizer.convert_tokens_to_ids("<|eot_id|>")
    own = dm.tokenizer.mask_token_id
    with pytest.raises(ValueError, match=rf"mask token '<\|mdm_mask\|>' at id {own}.*\[MASK\] = id {eot}"):
        check_data_tokens(dm, _module(dm, embed_rows=v, head_rows=v, mask_id=eot))
    with pytest.raises(ValueError, match="mask token"):  # SMDM's layout on LLaDA's tokenizer: [MASK] = |V|
        check_data_tokens(dm, _module(dm, embed_rows=v + 1, head_rows=v, mask_id=v))


def test_pad_equal_to_the_backbones_mask_is_refused(tmp_path, smdm_tok):
    dm = gsm_dm(tmp_path, smdm_tok)  # PAD = EOS = 2
    v = dm.vocab_size
    with pytest.raises(ValueError, match="PAD id 2 is the \\[MASK\\] id"):
        check_data_tokens(dm, _module(dm, embed_rows=v, head_rows=v, mask_id=2))


def test_a_backbone_mask_on_an_ordinary_token_is_refused(tmp_path, smdm_tok):
    dm = gsm_dm(tmp_path, smdm_tok)  # no mask token: a [MASK] inside the vocabulary would be the word "the"
    v = dm.vocab_size
    with pytest.raises(ValueError, match="ordinary token 'the'"):
        check_data_tokens(dm, _module(dm, embed_rows=v, head_rows=v, mask_id=3))
    check_data_tokens(dm, _module(dm, embed_rows=v, head_rows=v, mask_id=0))  # a special token (<unk>): accepted


def test_a_data_id_beyond_the_head_is_refused(tmp_path, dream_tok):
    dm = gsm_dm(tmp_path, dream_tok, pad_token="add")  # |V| + 1 ids against a head of |V|
    v = dm.vocab_size
    with pytest.raises(ValueError, match=f"vocabulary of {v} tokens but backbone .* predicts {v - 1}"):
        _module(dm, embed_rows=v - 1, head_rows=v - 1, mask_id=dm.tokenizer.mask_token_id)


def test_the_entry_points_run_the_check_before_compute(monkeypatch, tmp_path, smdm_tok):
    """flowlm-train calls check_data_tokens right after building the module (nothing written yet)."""
    from conftest import FAST, compose_config, isolate_runs

    import lightning_modules.vocabulary
    import runners.train

    isolate_runs(monkeypatch, tmp_path)
    seen = []

    def refuse(datamodule, module):
        seen.append((datamodule, module))
        raise ValueError("checked")

    # train() imports it when it runs (the entry module stays light: tests/runners/test_first_hour.py)
    monkeypatch.setattr(lightning_modules.vocabulary, "check_data_tokens", refuse)
    llama = ["backbone=llama/tiny", "backbone.embed_rows=10", "backbone.head_rows=9", "backbone.mask_id=9"]
    with pytest.raises(ValueError, match="checked"):
        runners.train.train(compose_config(overrides=["experiment=sudoku_mdm_easy", "scale=cpu", *FAST, *llama]))
    assert len(seen) == 1 and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("name", ["llada_tok", "dream_tok"])
def test_a_head_padded_beyond_the_tokenizer_serves_mask_inside_data(request, tmp_path, name):
    """LLaDA / Dream: more head (and embedding) rows than tokenizer ids, [MASK] among the data ids: accepted; the
    logits are cut to the data's ids, [MASK]'s −∞, and the ELBO on GSM8K rows padded with EOS is finite."""
    dm = gsm_dm(tmp_path, request.getfixturevalue(name))
    v, rows = dm.vocab_size, dm.vocab_size + 8
    module = _module(dm, embed_rows=rows, head_rows=rows, mask_id=dm.mask_id)
    check_data_tokens(dm, module)
    dm.prepare_data()
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    logits = module.denoiser().fn(batch["tokens"], torch.ones(batch["tokens"].shape[0]))
    assert logits.shape[-1] == v and (logits[..., dm.mask_id] == -torch.inf).all()
    assert torch.isfinite(logits[..., : dm.mask_id]).all()
    loss = module.loss(
        batch, module.draws_at(batch, torch.full((batch["tokens"].shape[0],), 0.5), torch.Generator().manual_seed(0))
    )
    assert torch.isfinite(loss.loss)


@pytest.mark.parametrize("mask_offset", [4, 0])
def test_a_padded_head_without_mask_among_the_data_is_refused(tmp_path, smdm_tok, mask_offset):
    """SMDM's layout ([MASK] beyond the data's ids: the head's size, or the first id past the data) with a head
    larger than the data: refused."""
    dm = gsm_dm(tmp_path, smdm_tok)
    v = dm.vocab_size
    with pytest.raises(ValueError, match=f"vocabulary of {v} tokens but backbone .* predicts {v + 4}"):
        _module(dm, embed_rows=v + 5, head_rows=v + 4, mask_id=v + mask_offset)
