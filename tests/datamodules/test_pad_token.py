"""``data.pad_token``: add a distinct [PAD] (default), pad with EOS (SMDM's SFT convention) or an existing token."""

from pathlib import Path

import pytest
import torch
from conftest import gsm8k_datamodule
from fixtures.make_fixtures import TOKENIZER_DIR

from datamodules.gsm8k import GSM8KDataModule
from datamodules.sources import PAD_TOKEN, load_tokenizer


@pytest.fixture(scope="module")
def llama_tok(tmp_path_factory) -> Path:
    """A tiny Llama-2-style tokenizer (<unk> 0, <s> 1, </s> 2, no PAD), as TinyLlama's: what SMDM reads."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "the a of to and is in it that was he for on are as with his they at be this".split()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    path = tmp_path_factory.mktemp("llama_tok")
    tok.save_pretrained(str(path))
    return path


def base_size(path: Path) -> int:
    """Ids of a tokenizer as saved (nothing added)."""
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(str(path)))


def test_add_is_the_default_and_grows_the_vocabulary_by_one(llama_tok):
    tok = load_tokenizer(llama_tok)
    assert tok.pad_token == PAD_TOKEN and len(tok) == base_size(llama_tok) + 1 == tok.pad_token_id + 1
    assert len(load_tokenizer(llama_tok, "add")) == len(tok)


def test_eos_pads_with_eos_and_keeps_the_vocabulary(llama_tok):
    tok = load_tokenizer(llama_tok, "eos")
    assert len(tok) == base_size(llama_tok)  # SMDM: 32 000 ids, not 32 001
    assert tok.pad_token_id == tok.eos_token_id == 2  # Llama-2's </s>


def test_an_existing_token_pads_with_that_token(llama_tok):
    tok = load_tokenizer(llama_tok, "<unk>")
    assert tok.pad_token_id == 0 and len(tok) == base_size(llama_tok)


@pytest.mark.parametrize("bad", ["<pad>", "", 3])
def test_a_token_outside_the_vocabulary_is_refused(llama_tok, bad):
    with pytest.raises(ValueError, match="pad_token"):
        load_tokenizer(llama_tok, bad)


def gsm_dm(tmp_path: Path, tokenizer: Path, pad_token: str = "eos") -> GSM8KDataModule:
    """The fixture GSM8K problems, L = 256 (every example fits)."""
    return gsm8k_datamodule(tmp_path, tokenizer=str(tokenizer), num_proc=1, pad_token=pad_token)


def test_gsm8k_rows_pad_with_eos_and_mask_stays_at_vocab_size(tmp_path):
    """The shipped tiny tokenizer (<|endoftext|> = BOS = EOS): eos gives |V| ids, rows `[BOS] p | r [EOS] EOS…`."""
    added, eos = gsm_dm(tmp_path, TOKENIZER_DIR, "add"), gsm_dm(tmp_path, TOKENIZER_DIR, "eos")
    size = base_size(TOKENIZER_DIR)
    assert added.vocab_size == size + 1 and added.pad_id == size and added.mask_id == size + 1
    assert eos.vocab_size == size and eos.pad_id == eos.eos_id and eos.mask_id == size  # [MASK] = the backbone's
    for dm in (added, eos):
        dm.prepare_data()
        dm.setup()
    a, e = added.train_set[0]["tokens"], eos.train_set[0]["tokens"]
    pad = a == added.pad_id
    assert pad.any() and torch.equal(e[~pad], a[~pad])  # same text ids, the padding differs
    assert (e[pad] == eos.eos_id).all()
    assert added.built and eos.built  # two caches (the PAD id is in the cache key), not one reused
