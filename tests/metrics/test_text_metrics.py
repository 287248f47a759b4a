"""Text metrics: gen-PPL against a direct transformers computation, entropy, GSM8K extraction and sandbox."""

import json
import math
import time
from types import SimpleNamespace
from unittest.mock import MagicMock

import numpy as np
import pytest
import torch
from fixtures.text import encode_rows, save_tiny_evaluator, tiny_evaluator, tiny_tokenizer

from flowlm.metrics.gsm8k import answers_match, extract_answer, parse_gold, run_program
from flowlm.metrics.text import (
    EvaluatorUnavailableError,
    GenerativePerplexity,
    load_evaluator,
    mean_entropy,
    unigram_entropy,
)
from flowlm.metrics.text_metrics import GenPPLMetric, GSM8KAccuracy

TEXTS = [
    "Once upon a time there was a little cat.",
    "The dog ran to the park.",
    "She bought 12 pencils and paid $18 in total, and then she went home to play in the garden with Tom.",
    "Birds sang.",
    "Every morning the girl walked to school.",
]


@pytest.fixture(scope="module")
def evaluator_dir(tmp_path_factory):
    """A tiny evaluator + tokenizer saved to disk, loaded by path like a local copy of gpt2-large."""
    return save_tiny_evaluator(tmp_path_factory.mktemp("evaluator"), seed=0)


def direct_nll(texts: list[str], max_length: int) -> tuple[list[float], list[int]]:
    """Per-text total NLL and token count, one unpadded sequence at a time, with transformers' own loss."""
    tokenizer, model = tiny_tokenizer(), tiny_evaluator(len(tiny_tokenizer()), seed=0)
    nll, counts = [], []
    for text in texts:
        ids = torch.tensor(
            [[tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False).input_ids[:max_length]]]
        )
        with torch.no_grad():
            loss = model(ids, labels=ids).loss  # mean NLL of tokens 1..n given their prefixes
        nll.append(float(loss) * (ids.shape[1] - 1))
        counts.append(ids.shape[1] - 1)
    return nll, counts


def test_gen_ppl_matches_transformers_and_scores_the_last_partial_batch(evaluator_dir):
    scorer = GenerativePerplexity(str(evaluator_dir), max_length=16, batch_size=2, convention="bos_prefix")
    calls = []
    hook = scorer.model.register_forward_hook(lambda module, args, out: calls.append(1))
    try:
        scores = scorer.score(TEXTS)
    finally:
        hook.remove()
    assert len(calls) == 3  # 5 texts in batches of 2: the partial third batch is scored
    nll, counts = direct_nll(TEXTS, max_length=16)
    assert scores.tokens.tolist() == counts and max(counts) == 16  # the long text is truncated to 16 tokens
    torch.testing.assert_close(scores.nll, torch.tensor(nll, dtype=torch.float64), rtol=1e-5, atol=1e-5)
    assert scores.perplexity() == pytest.approx(math.exp(sum(nll) / sum(counts)), rel=1e-5)
    # a text that already starts with BOS is not given a second one
    assert scorer.encode(["<|endoftext|>Birds sang."]) == scorer.encode(["Birds sang."])


def test_evaluator_is_loaded_once_and_missing_one_explains_offline_use(evaluator_dir):
    first = GenerativePerplexity(str(evaluator_dir), batch_size=4, convention="bos_prefix")
    second = GenerativePerplexity(str(evaluator_dir), batch_size=8)
    assert first.model is second.model and load_evaluator(str(evaluator_dir))[0] is first.model
    assert first.max_length == 63 and second.max_length == 64  # context 64, minus the BOS position if prefixed
    with pytest.warns(UserWarning, match="context of 64 tokens with the BOS prefix"):
        assert GenerativePerplexity(str(evaluator_dir), max_length=64, convention="bos_prefix").max_length == 63
    with pytest.raises(EvaluatorUnavailableError, match="HF_HUB_OFFLINE") as err:
        GenerativePerplexity("flowlm-test/no-such-evaluator")
    assert "local copy" in str(err.value)


def test_unigram_entropy_is_exact():
    assert unigram_entropy([1, 1, 2, 2]) == pytest.approx(math.log(2), abs=1e-12)
    assert unigram_entropy(torch.tensor([7, 7, 7])) == 0.0
    assert unigram_entropy([1, 2, 3, 4]) == pytest.approx(math.log(4), abs=1e-12)
    assert unigram_entropy([]) == 0.0
    # p = (1/2, 1/4, 1/4): H = ½ ln 2 + ½ ln 4 = 1.5 ln 2
    assert unigram_entropy([3, 3, 1, 2]) == pytest.approx(1.5 * math.log(2), abs=1e-12)
    assert mean_entropy([[1, 1, 2, 2], [5, 5]]) == pytest.approx(math.log(2) / 2, abs=1e-12)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("She pays 1,000 + 234 dollars.\n#### 1,234", 1234.0),
        ("The temperature drops to -5 degrees.", -5.0),
        ("#### 3.50", 3.5),
        ("So the book costs $12", 12.0),
        ("#### $12.", 12.0),
        ("#### 72 apples in total.", 72.0),
        ("#### -$5", -5.0),
        ("3 + 4 = 7, then 7 * 2 = 14. The answer is 14.", 14.0),
        ("#### 16\nand 99 more words", 16.0),
        ("5-3 is what remains", 3.0),  # a hyphen between numbers is not a sign
        ("5 - 3 is what remains", 3.0),  # nor a spaced one
        ("5\u22123 and 5 \u2013 3", 3.0),  # nor a Unicode minus or en dash there
        ("The temperature drops to \u22125 degrees.", -5.0),  # U+2212 MINUS SIGN
        ("#### \u20135", -5.0),  # U+2013 EN DASH, as typesetting writes a minus
        ("#### \u2212$5", -5.0),
        ("#### 5e3", 5000.0),
        ("The answer is 5E3.", 5000.0),
        ("#### 1.5e-3", 0.0015),
        ("#### 2.5e\u22122", 0.025),
        ("#### \u22121e+2", -100.0),
        ("#### 3eggs", 3.0),  # an 'e' without digits is not an exponent
        ("costs 1,250.5 dollars", 1250.5),
        ("no number here", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_gold_parsing_and_tolerant_match():
    assert parse_gold("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72") == 72.0
    assert parse_gold(18) == 18.0
    with pytest.raises(ValueError, match="####"):
        parse_gold("no final answer")
    assert answers_match(0.1 + 0.2, 0.3) and answers_match(12, 12.0)
    assert not answers_match(12.5, 12.0) and not answers_match(None, 12.0) and not answers_match(math.nan, 1.0)


PROGRAM = '''def simple_math_problem() -> int:
    """Tom has 3 bags of 4 apples and eats 2. How many are left?"""
    import math
    bags = 3
    apples = bags * 4
    result = apples - 2
    print("left:", result)
    return result
'''


def test_sandbox_runs_correct_code_and_fails_cleanly_on_errors():
    assert run_program(PROGRAM).value == 10.0
    fractions = "from fractions import Fraction\ndef f():\n    return Fraction(7, 2) * 2\n"
    assert run_program(fractions).status == "ok" and run_program(fractions).value == 7.0
    crash = run_program("def simple_math_problem():\n    return 1 / 0\n")
    assert crash.status == "error" and "ZeroDivisionError" in crash.message
    assert run_program("def simple_math_problem(:\n").status == "error"
    assert run_program("def simple_math_problem():\n    return [1]\n").status == "error"


def test_sandbox_times_out_infinite_loops():
    start = time.perf_counter()
    result = run_program("def simple_math_problem():\n    while True:\n        pass\n", timeout_s=1.0)
    assert result.status == "timeout" and result.value is None
    assert time.perf_counter() - start < 3.0


@pytest.mark.parametrize(
    "code",
    [
        "import os\ndef f():\n    return os.getpid()\n",
        "import socket\ndef f():\n    return 1\n",
        "def f():\n    return len(open('/etc/passwd').read())\n",
        "def f():\n    return __import__('os').getpid()\n",
        "def f():\n    return ().__class__.__base__.__subclasses__()\n",
        "def f():\n    return eval('1 + 1')\n",
        "from . import secrets\n",
    ],
)
def test_sandbox_refuses_forbidden_access(code):
    result = run_program(code)
    assert result.status == "forbidden" and result.value is None


def test_sandbox_modules_carry_no_submodules_and_memory_bombs_fail():
    # fractions imports sys; the sandbox's copy of the module must not lead there
    leak = run_program("import fractions\ndef f():\n    return fractions.sys.modules['os'].getpid()\n")
    assert leak.status == "error" and "sys" in leak.message
    for bomb in (
        "def f():\n    return len([0] * 10**10)\n",
        "def f():\n    s = []\n    while True:\n        s.append('x' * 10**6)\n",
    ):
        result = run_program(bomb, timeout_s=2.0, memory_mb=256)
        assert result.status == "error" and "MemoryError" in result.message


def text_datamodule(length: int = 24) -> SimpleNamespace:
    """What the text metrics need from a datamodule: a GPT-2-like tokenizer + [PAD], pad/mask ids, seq_len.

    As in datamodules/token_cache.py, [MASK] is the id just past the tokenizer's vocabulary.
    """
    tokenizer = tiny_tokenizer(extra_special=("[PAD]",))
    pad_id = tokenizer.convert_tokens_to_ids("[PAD]")
    return SimpleNamespace(tokenizer=tokenizer, pad_id=pad_id, mask_id=len(tokenizer), seq_len=length)


def test_gen_ppl_metric_decodes_strips_pad_and_matches_the_scorer(evaluator_dir):
    dm = text_datamodule(24)
    tokens = encode_rows(dm, TEXTS, 24)
    tokens[3, -1] = dm.mask_id  # a [MASK] a sampler left behind is not text
    metric = GenPPLMetric(datamodule=dm, evaluator=str(evaluator_dir), batch_size=2)
    metric.update(tokens[:3], tokens[:3])
    metric.update(tokens[3:], tokens[3:])
    out = metric.compute()
    assert list(out) == ["gen_ppl", "entropy", "num_samples", "empty_pct"]
    assert out["empty_pct"].item() == 0
    content = [r[(r != dm.pad_id) & (r != dm.mask_id)] for r in tokens]
    texts = [dm.tokenizer.decode(r.tolist()) for r in content]
    assert [row["text"] for row in metric.artifact_rows()] == texts and metric.render(tokens[3]) == TEXTS[3]
    expected = GenerativePerplexity(str(evaluator_dir), max_length=24).score(texts).perplexity()
    assert out["gen_ppl"].item() == pytest.approx(expected, rel=1e-6)
    assert out["entropy"].item() == pytest.approx(mean_entropy(content), rel=1e-9)
    assert out["num_samples"].item() == 5
    metric.reset()
    assert metric.artifact_rows() == []


def test_empty_samples_are_counted_and_never_score_a_perplexity_of_one(evaluator_dir):
    dm = text_datamodule(24)
    all_pad = torch.full((3, 24), dm.pad_id)
    metric = GenPPLMetric(datamodule=dm, evaluator=str(evaluator_dir), batch_size=2)
    metric.update(all_pad, all_pad)
    out = metric.compute()
    assert math.isnan(out["gen_ppl"].item()) and out["empty_pct"].item() == 100  # not exp(0) = 1
    metric.update(encode_rows(dm, TEXTS[:1], 24), all_pad[:1])
    out = metric.compute()
    assert out["empty_pct"].item() == 75 and out["gen_ppl"].item() > 1


class GSMData(SimpleNamespace):
    """A GSM8K-like datamodule: the first ``prompt_len`` tokens are the question, the rest the response."""

    def response_mask(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(tokens.shape, dtype=torch.bool)
        mask[:, self.prompt_len :] = True
        return mask


def gsm_batch(dm, questions: list[str], answers: list[str], prompt_len: int = 16, length: int = 40) -> torch.Tensor:
    q = encode_rows(dm, questions, prompt_len)
    a = encode_rows(dm, answers, length - prompt_len)
    return torch.cat([q, a], dim=1)


def test_gsm8k_accuracy_extracts_answers_and_reads_gold_from_targets():
    base = text_datamodule()
    dm = GSMData(tokenizer=base.tokenizer, pad_id=base.pad_id, mask_id=base.mask_id, prompt_len=16)
    questions = ["Tom had 3 apples.", "She bought 12 pencils.", "The dog ran."]
    target = gsm_batch(dm, questions, ["#### 1", "#### 18", "#### 4"])
    # the first answer ends at EOS: the number after it is not part of the answer
    pred = gsm_batch(dm, questions, ["so he had 1 apple left<|endoftext|> 7", "paid $12 in total", "the dog ran"])
    metric = GSM8KAccuracy(datamodule=dm, scorer="extract")
    metric.update(pred, target)
    out = metric.compute()
    assert list(out)[0] == "accuracy" and out["accuracy"].item() == pytest.approx(100 / 3)
    assert out["num_problems"].item() == 3 and out["no_answer"].item() == 1
    rows = metric.artifact_rows()
    assert [r["gold"] for r in rows] == [1.0, 18.0, 4.0] and [r["correct"] for r in rows] == [True, False, False]
    assert rows[0]["prompt"] == questions[0] and rows[0]["response"] == "so he had 1 apple left"


def test_gsm8k_accuracy_executes_programs_against_datamodule_gold():
    base = text_datamodule()
    dm = GSMData(tokenizer=base.tokenizer, pad_id=base.pad_id, mask_id=base.mask_id, prompt_len=8)
    dm.gold_answers = lambda target: [10.0, None]  # an unknown gold counts as wrong, and is counted
    programs = [PROGRAM, "def simple_math_problem() -> int:\n    return 1 / 0\n"]
    q = encode_rows(dm, ["Tom", "Lily"], 8)
    a = encode_rows(dm, programs, max(len(dm.tokenizer(p).input_ids) for p in programs))
    metric = GSM8KAccuracy(datamodule=dm, scorer="execute", timeout_s=2.0)
    metric.update(torch.cat([q, a], 1), torch.cat([q, a], 1))
    out = metric.compute()
    assert out["accuracy"].item() == 50.0 and out["errors"].item() == 1 and out["timeouts"].item() == 0
    assert out["no_gold"].item() == 1
    assert [r["status"] for r in metric.artifact_rows()] == ["ok", "error"]
    with pytest.raises(ValueError, match="scorer"):
        GSM8KAccuracy(datamodule=dm, scorer="regex")


def test_sampling_evaluation_logs_metric_rows_as_jsonl():
    from lightning.pytorch.loggers import MLFlowLogger

    from callbacks.sampling_eval import CalibrationBuffer, SamplingEvaluation
    from flowlm.samplers import ConfidenceSampler

    base = text_datamodule()
    dm = GSMData(tokenizer=base.tokenizer, pad_id=base.pad_id, mask_id=base.mask_id, prompt_len=16)
    metric = GSM8KAccuracy(datamodule=dm)
    batch = gsm_batch(dm, ["Tom had 3 apples."], ["#### 3"])
    metric.update(batch, batch)
    callback = SamplingEvaluation(samplers={"confidence": ConfidenceSampler()}, nfe=[4], metric=GSM8KAccuracy)
    callback._states = {
        ("confidence", 4): {
            "metric": metric,
            "samples": [batch[0]],
            "calibration": CalibrationBuffer(0),
            "spent": np.array([4.0]),
        }
    }
    logger = MagicMock(spec=MLFlowLogger)
    logger.run_id = "run"
    callback._log_artifacts(SimpleNamespace(loggers=[logger], global_step=7))
    logged = {call.args[2]: call.args[1] for call in logger.experiment.log_text.call_args_list}
    assert set(logged) == {
        "eval/step0000007/table.md",
        "eval/step0000007/samples.md",
        "eval/step0000007/confidence_nfe4.jsonl",
    }
    logger.experiment.log_dict.assert_called_once_with(
        "run", {"confidence/nfe4": {"4": 1}}, "eval/step0000007/nfe_histogram.json"
    )
    rows = [json.loads(line) for line in logged["eval/step0000007/confidence_nfe4.jsonl"].splitlines()]
    assert rows == [
        {
            "prompt": "Tom had 3 apples.",
            "response": "#### 3",
            "pred": 3.0,
            "gold": 3.0,
            "correct": True,
            "status": "ok",
            "message": "",
        }
    ]
