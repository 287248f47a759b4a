"""Text and GSM8K datamodules on the shipped fixtures, with a tiny BPE tokenizer trained here (offline)."""

import json
import math
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import compose_config
from fixtures.make_fixtures import HERE, TOKENIZER_DIR, build_tokenizer
from hydra.utils import instantiate

from datamodules.gsm8k import GSM8KDataModule
from datamodules.sources import DataUnavailableError, load_tokenizer
from datamodules.text import TextDataModule

STORIES = HERE / "tinystories_sample.jsonl"
GSM8K = HERE / "gsm8k_sample.jsonl"
TINYGSM = HERE / "tinygsm_sample.jsonl"
GOLD = [16, 37500, -7, 4.5, 12, 10, 2880, 1050, -6.5, 22, 2.4, 5750]  # the `#### N` of gsm8k_sample.jsonl
TEMPLATE = "Question: {question}\nAnswer:"


def jsonl(path: Path) -> list[dict]:
    """The records of a JSONL file."""
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    """The tiny tokenizer trained here from the fixtures (GPT-2-like: <|endoftext|> = BOS = EOS, no PAD)."""
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer().save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def base_size(tok_dir) -> int:
    """Ids of the tiny tokenizer before the datamodule adds [PAD]."""
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(tok_dir))


@pytest.fixture(scope="module")
def tok(tok_dir):
    """The tokenizer as the datamodules load it (with [PAD] added)."""
    return load_tokenizer(tok_dir)


def ids(tok, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens."""
    return tok(text, add_special_tokens=False)["input_ids"]


def text_dm(tmp_path: Path, tok_dir: Path, **kwargs) -> TextDataModule:
    """The fixture stories, last 40 as validation, L = 32."""
    args = {
        "files": str(STORIES),
        "val_split": None,
        "val_last_n": 40,
        "tokenizer": str(tok_dir),
        "seq_len": 32,
        "cache_dir": tmp_path / "cache",
        "batch_size": 16,
        **kwargs,
    }
    return TextDataModule(**args)


def gsm_dm(tmp_path: Path, tok_dir: Path, **kwargs) -> GSM8KDataModule:
    """The fixture GSM8K problems as training and evaluation data, L = 256 (every example fits)."""
    args = {
        "train_files": str(GSM8K),
        "eval_files": str(GSM8K),
        "tokenizer": str(tok_dir),
        "seq_len": 256,
        "min_response_tokens": 8,
        "cache_dir": tmp_path / "cache",
        "batch_size": 4,
        "prompt_template": TEMPLATE,
        **kwargs,
    }
    return GSM8KDataModule(**args)


def all_rows(dataset) -> dict[str, torch.Tensor]:
    """Every item of a dataset, stacked."""
    items = [dataset[i] for i in range(len(dataset))]
    return {k: torch.stack([item[k] for item in items]) for k in items[0]}


# ------------------------------------------------------------------------------------------------------------
# Text: vocabulary, packing, validation split.


def test_pad_is_added_and_distinct_from_bos_eos_and_mask(tmp_path, tok_dir, base_size):
    dm = text_dm(tmp_path, tok_dir)
    assert dm.pad_id == base_size and dm.vocab_size == base_size + 1  # like GPT-2's 50 257 + [PAD]
    assert dm.mask_id == dm.vocab_size != dm.pad_id
    assert dm.bos_id == dm.eos_id == 0 and dm.pad_id not in (dm.bos_id, dm.eos_id)
    assert dm.tokenizer.convert_ids_to_tokens(dm.pad_id) == "[PAD]"


def test_truncate_pad_rows_are_bos_story_eos_then_pad(tmp_path, tok_dir, tok):
    dm = text_dm(tmp_path, tok_dir)
    dm.prepare_data()
    dm.setup()
    rows = all_rows(dm.train_set)
    stories = [r["text"] for r in jsonl(STORIES)][:-40]
    assert rows["tokens"].shape == (260, 32) and rows["tokens"].dtype == torch.long
    assert not rows["prompt_mask"].any()  # PAD is a target, never context
    assert "loss_mask" not in rows  # loss_on_pad (MDLM): PAD is an ordinary token
    truncated = 0
    for row, story in zip(rows["tokens"].tolist(), stories, strict=True):
        body = ids(tok, story)
        truncated += len(body) > 30
        expected = [dm.bos_id, *body[:30], dm.eos_id]
        assert row == expected + [dm.pad_id] * (32 - len(expected))
    assert 0 < truncated < 260  # both kinds occur in the fixture
    assert dm.cache_meta["splits"]["train"]["truncated"] == truncated


def test_loss_mask_excludes_pad_when_asked(tmp_path, tok_dir):
    dm = text_dm(tmp_path, tok_dir, loss_on_pad=False)
    dm.setup()
    batch = next(iter(dm.val_dataloader()))
    assert torch.equal(batch["loss_mask"], batch["tokens"] != dm.pad_id)
    assert (batch["tokens"] == dm.pad_id).any() and not batch["prompt_mask"].any()


def test_wrap_chunks_are_framed_and_lose_no_document(tmp_path, tok_dir, tok):
    dm = text_dm(tmp_path, tok_dir, packing="wrap", seq_len=24)
    dm.setup()
    stories = [r["text"] for r in jsonl(STORIES)]
    for dataset, docs in ((dm.train_set, stories[:-40]), (dm.val_set, stories[-40:])):
        rows = all_rows(dataset)["tokens"]
        assert rows.shape[1] == 24 and (rows[:, 0] == dm.bos_id).all()
        assert (rows[:-1, -1] == dm.eos_id).all() and (rows[:-1] != dm.pad_id).all()
        last = rows[-1][rows[-1] != dm.pad_id]  # the last piece is PAD-filled after its EOS
        assert last[-1] == dm.eos_id and (rows[-1][len(last) :] == dm.pad_id).all()
        stream = [t for row in rows[:-1] for t in row[1:-1].tolist()] + last[1:-1].tolist()
        assert stream == [t for doc in docs for t in [*ids(tok, doc), dm.eos_id]]


def test_wrap_cache_is_shared_across_lengths_and_drop_remainder_drops_the_tail(tmp_path, tok_dir):
    keep = text_dm(tmp_path, tok_dir, packing="wrap", seq_len=24)
    drop = text_dm(tmp_path, tok_dir, packing="wrap", seq_len=40, drop_remainder=True)
    assert keep.cache_path == drop.cache_path  # the token stream does not depend on L
    keep.setup()
    drop.setup()
    tokens = keep.cache_meta["splits"]["train"]["tokens"]
    assert len(keep.train_set) == math.ceil(tokens / 22) and len(drop.train_set) == tokens // 38
    assert (all_rows(drop.train_set)["tokens"] != drop.pad_id).all()


def test_validation_is_the_last_n_documents(tmp_path, tok_dir, tok):
    dm = text_dm(tmp_path, tok_dir, val_last_n=25)
    dm.setup()
    stories = [r["text"] for r in jsonl(STORIES)]
    assert (len(dm.train_set), len(dm.val_set)) == (275, 25)
    firsts = [row[1 : 1 + 5].tolist() for row in all_rows(dm.val_set)["tokens"]]
    assert firsts == [ids(tok, s)[:5] for s in stories[-25:]]


def test_txt_files_with_own_validation_split(tmp_path, tok_dir):
    train, val = tmp_path / "train.txt", tmp_path / "val.txt"
    train.write_text("one story here.\n\nanother story,\nover two lines.\n\n\nthird story.\n")
    val.write_text("a validation story.\nand one more\n\n")
    by_para = text_dm(tmp_path, tok_dir, files={"train": str(train), "validation": str(val)}, val_split="validation",
                      val_last_n=None, txt_docs="paragraph", batch_size=2)  # fmt: skip
    by_para.setup()
    assert by_para.decode(all_rows(by_para.train_set)["tokens"]) == [
        "one story here.",
        "another story,\nover two lines.",
        "third story.",
    ]
    by_line = text_dm(tmp_path, tok_dir, files={"train": str(train), "validation": str(val)}, val_split="validation",
                      val_last_n=None, batch_size=2)  # fmt: skip
    by_line.setup()
    assert len(by_line.train_set) == 4 and len(by_line.val_set) == 2  # empty lines are no documents
    assert by_line.cache_meta["splits"]["train"]["empty_dropped"] == 3


def test_second_setup_reads_the_cache_without_tokenising(tmp_path, tok_dir, monkeypatch):
    first = text_dm(tmp_path, tok_dir)
    first.prepare_data()
    first.setup()
    assert first.built
    meta = first.cache_path / "meta.json"
    stamp = meta.stat().st_mtime_ns
    monkeypatch.setattr(TextDataModule, "_build", lambda *a: pytest.fail("re-tokenised despite the cache"))
    again = text_dm(tmp_path, tok_dir)
    again.prepare_data()
    again.setup()
    assert not again.built and meta.stat().st_mtime_ns == stamp
    assert torch.equal(all_rows(again.val_set)["tokens"], all_rows(first.val_set)["tokens"])
    assert text_dm(tmp_path, tok_dir, seq_len=48).cache_path != first.cache_path  # another L, another cache
    assert not list(first.cache_dir.glob("*.work")) and not list(first.cache_dir.glob("*.tmp*"))


def test_parallel_tokenisation_matches_serial(tmp_path, tok_dir):
    # num_proc workers get pickled encoders (tokenizer only) and shard the indices: same rows, same order.
    serial, parallel = (text_dm(tmp_path / str(n), tok_dir, packing="wrap", num_proc=n) for n in (None, 2))
    gsm_serial, gsm_parallel = (gsm_dm(tmp_path / str(n), tok_dir, num_proc=n) for n in (None, 2))
    for one, two in ((serial, parallel), (gsm_serial, gsm_parallel)):
        one.setup()
        two.setup()
        for split in ("train_set", "val_set"):
            a, b = all_rows(getattr(one, split)), all_rows(getattr(two, split))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_unknown_hf_dataset_offline_says_how_to_provide_a_local_copy(tmp_path, tok_dir, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    dm = text_dm(tmp_path, tok_dir, files=None, name="no-such-user/no-such-dataset")
    start = time.perf_counter()
    with pytest.raises(DataUnavailableError) as err:
        dm.prepare_data()
    assert time.perf_counter() - start < 30
    message = str(err.value)
    for hint in ("no-such-user/no-such-dataset", "data.files=", "huggingface-cli download", "save_to_disk"):
        assert hint in message
    with pytest.raises(DataUnavailableError, match="save_pretrained"):
        load_tokenizer("no-such-user/no-such-tokenizer")


def test_loaders_give_global_batches_and_keep_the_last_val_batch(tmp_path, tok_dir):
    dm = text_dm(tmp_path, tok_dir, batch_size=16, val_batch_size=16)
    dm.setup()
    train = list(dm.train_dataloader())
    assert len(train) == 260 // 16  # drop_last in training
    for batch in train[:2]:
        assert batch["tokens"].shape == (16, 32) and batch["tokens"].dtype == torch.long
        assert batch["prompt_mask"].shape == (16, 32) and batch["prompt_mask"].dtype == torch.bool
    assert [b["tokens"].shape[0] for b in dm.val_dataloader()] == [16, 16, 8]
    dm.trainer = SimpleNamespace(world_size=2, accumulate_grad_batches=2)
    assert (dm.per_device_batch_size, dm.per_device_val_batch_size) == (4, 8)


# ------------------------------------------------------------------------------------------------------------
# GSM8K / TinyGSM.


def test_gsm8k_prompt_mask_covers_exactly_the_prompt(tmp_path, tok_dir, tok):
    dm = gsm_dm(tmp_path, tok_dir)
    dm.setup()
    rows = all_rows(dm.train_set)
    for i, record in enumerate(jsonl(GSM8K)):
        prompt = [dm.bos_id, *ids(tok, TEMPLATE.format(question=record["question"]))]
        response = [*ids(tok, " " + record["answer"]), dm.eos_id]
        tokens, mask = rows["tokens"][i].tolist(), rows["prompt_mask"][i]
        assert tokens == prompt + response + [dm.pad_id] * (256 - len(prompt) - len(response))
        assert mask[: len(prompt)].all() and not mask[len(prompt) :].any()
    assert dm.prompt_len == max(int(m.sum()) for m in all_rows(dm.val_set)["prompt_mask"])


def test_gsm8k_calculator_annotations_can_be_stripped(tmp_path, tok_dir):
    dm = gsm_dm(tmp_path, tok_dir, strip_calculator=True)
    dm.setup()
    first = dm.decode(dm.train_set[0]["tokens"][None])[0]
    assert first.endswith("she has 12 - 5 = 7 apples.\nAfter buying more she has 7 + 9 = 16 apples.\n#### 16")
    assert dm.train_set[0]["gold"].item() == 16


def test_gsm8k_length_filter_counts_dropped_examples(tmp_path, tok_dir, tok):
    records = jsonl(GSM8K)
    prompts = [1 + len(ids(tok, TEMPLATE.format(question=r["question"]))) for r in records]  # [BOS] prompt
    sizes = [p + len(ids(tok, " " + r["answer"])) + 1 for p, r in zip(prompts, records, strict=True)]  # + [EOS]
    seq_len = sorted(sizes)[6]  # about half fit
    dm = gsm_dm(tmp_path, tok_dir, seq_len=seq_len)
    dm.setup()
    assert dm.dropped["train"] == sum(s > seq_len for s in sizes) > 0
    assert len(dm.train_set) == sum(s <= seq_len for s in sizes)
    assert dm.dropped["val"] == 0 and len(dm.val_set) == 12  # the test set keeps its size, responses truncated
    with pytest.warns(UserWarning, match="dropped"):
        strict = gsm_dm(tmp_path, tok_dir, seq_len=seq_len, min_response_tokens=seq_len - 60)
        strict.setup()
    assert strict.dropped["val"] == sum(p + seq_len - 60 > seq_len for p in prompts) > 0


def test_gsm8k_gold_answers_by_batch_tokens_and_index(tmp_path, tok_dir):
    dm = gsm_dm(tmp_path, tok_dir, val_batch_size=5)
    dm.setup()
    batches = list(dm.val_dataloader())
    assert [b["tokens"].shape[0] for b in batches] == [5, 5, 2]
    gold = torch.cat([b["gold"] for b in batches])
    assert gold.dtype == torch.float64 and gold.tolist() == GOLD
    assert torch.cat([b["index"] for b in batches]).tolist() == list(range(12))
    batch = batches[1]
    assert dm.gold_answers(batch["tokens"]) == GOLD[5:10] == dm.gold_answers(batch["index"])
    assert torch.equal(dm.response_mask(batch["tokens"]), ~batch["prompt_mask"])
    with pytest.raises(KeyError):
        dm.response_mask(torch.zeros(1, 256, dtype=torch.long))


def test_gsm8k_batches_score_with_the_accuracy_metric(tmp_path, tok_dir):
    from flowlm.metrics.text_metrics import GSM8KAccuracy

    dm = gsm_dm(tmp_path, tok_dir, val_batch_size=12)
    dm.setup()
    batch = next(iter(dm.val_dataloader()))
    metric = GSM8KAccuracy(datamodule=dm, scorer="extract")
    wrong = batch["tokens"].clone()
    wrong[:6] = torch.where(batch["prompt_mask"][:6], wrong[:6], dm.pad_id)  # no answer generated
    metric.update(wrong, batch["tokens"])
    assert metric.compute()["accuracy"] == pytest.approx(50.0)  # the reference answers are right, blanks wrong


def test_tinygsm_trains_on_code_and_evaluates_on_gsm8k_gold(tmp_path, tok_dir, tok):
    dm = gsm_dm(
        tmp_path,
        tok_dir,
        train_files=str(TINYGSM),
        response_field="code",
        prompt_template="{question}\n",
        response_template="{response}",
    )
    dm.setup()
    assert dm.answer_format == "code"
    train = all_rows(dm.train_set)
    first = jsonl(TINYGSM)[0]
    p = int(train["prompt_mask"][0].sum())
    response = train["tokens"][0, p:]
    assert response[: len(ids(tok, first["code"]))].tolist() == ids(tok, first["code"])
    assert dm.decode(response[None])[0].startswith("def simple_math_problem():")
    assert torch.isnan(train["gold"]).all()  # TinyGSM rows carry no `#### N`
    val = all_rows(dm.val_set)
    assert val["gold"].tolist() == GOLD
    assert (val["tokens"][~val["prompt_mask"]] == dm.pad_id).all()  # no reference code: the response is all PAD


def test_tiny_data_configs_run_offline_and_shipped_tokenizer_is_current(runs_env, tok_dir, base_size):
    shipped, fresh = (d / "tokenizer.json" for d in (TOKENIZER_DIR, tok_dir))
    assert shipped.read_text() == fresh.read_text(), "stale data/cpu/tiny_tokenizer: run make_fixtures.py"
    for name, seq_len in (("tiny_tinystories", 128), ("tiny_owt", 64), ("tiny_gsm8k", 256), ("tiny_tinygsm", 256)):
        cfg = compose_config("train", [f"data={name}"])
        dm = instantiate(cfg.data)
        dm.prepare_data()
        dm.setup()
        assert Path(dm.cache_path).is_relative_to(runs_env / "data")
        batch = next(iter(dm.train_dataloader()))
        assert batch["tokens"].shape == (cfg.data.batch_size, seq_len) and dm.vocab_size == base_size + 1
        assert batch["tokens"].max() < dm.vocab_size
        assert sum(b["tokens"].shape[0] for b in dm.val_dataloader()) == len(dm.val_set) > 0


@pytest.mark.parametrize(
    ("name", "overrides", "expected"),
    [
        ("tinystories", [], {"name": "roneneldan/TinyStories", "seq_len": 128, "packing": "truncate_pad"}),
        ("owt", [], {"name": "Skylion007/openwebtext", "seq_len": 1024, "packing": "wrap", "val_last_n": 100000}),
        ("tinystories_local", [f"data.files.train={STORIES}", f"data.files.validation={STORIES}"], {"name": None}),
        ("owt_local", [f"data.files={STORIES}"], {"packing": "wrap", "name": None}),
        ("gsm8k", [], {"train_name": "openai/gsm8k", "eval_split": "test", "response_field": "answer"}),
        ("tinygsm", [], {"train_name": "TinyGSM/TinyGSM", "response_field": "code"}),
        ("gsm8k_local", [f"data.train_files={GSM8K}", f"data.eval_files={GSM8K}"], {"response_field": "answer"}),
        ("tinygsm_local", [f"data.train_files={TINYGSM}", f"data.eval_files={GSM8K}"], {"response_field": "code"}),
    ],
)
def test_paper_data_configs_compose_and_build(runs_env, base_size, tok_dir, name, overrides, expected):
    # The GPT-2 tokenizer is not available offline: the shipped tiny one stands in to build the datamodule.
    cfg = compose_config("train", [f"data={name}", f"data.tokenizer={TOKENIZER_DIR}", *overrides])
    for key, value in expected.items():
        assert cfg.data[key] == value
    dm = instantiate(cfg.data)
    assert dm.seq_len == cfg.data.seq_len and dm.pad_id == base_size
    assert str(dm.cache_path).startswith(str(runs_env / "data"))
