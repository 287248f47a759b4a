"""The papers' released evaluation protocols as defaults (issue 14).

GSM8K execute scoring follows the released TinyGSM scorer of FMLM+ (code extraction, ``simple_math_problem()``
only, absolute 1e-3, 5 s); gen-PPL follows the released FMLM+/MDLM token convention. Each identity is checked
against an independent computation, and the earlier behaviour (the response run as generated, ``run_raw``: the
removed ``extract_code=raw``, an oracle here; ``convention=bos_prefix``, an option) is shown to differ where it
should, so the tests fail if the default silently reverts.
"""

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fixtures.text import encode_rows, save_tiny_evaluator, tiny_evaluator, tiny_tokenizer
from omegaconf import OmegaConf

import flowlm.metrics.gsm8k as gsm8k
from flowlm.metrics.gsm8k import answers_match, defines_name, execute_responses, extract_program, prepare_program
from flowlm.metrics.text import GenerativePerplexity
from flowlm.metrics.text_metrics import GenPPLMetric, GSM8KAccuracy

CONF = Path(__file__).resolve().parents[2] / "conf" / "eval"
FENCE = "`" * 3
BODY = "def simple_math_problem() -> int:\n    boxes = 3\n    result = boxes * 4\n    return result\n"
CLEAN = BODY.strip()

# Untidy but correct generations (answer 12): what the released extraction recovers and raw execution does not.
UNTIDY = {
    "leading prose": "Let's solve it step by step with Python.\n" + BODY,
    "python fence": f"{FENCE}python\n{BODY}{FENCE}\n",
    "bare fence": f"{FENCE}\n{BODY}{FENCE}",
    "truncated trailing line": BODY + "\nprint(simple_math_problem(",
    "prose + fence + trailing prose": f"Here is the code:\n{FENCE}python\n{BODY}{FENCE}\nIt returns 12, so the ans",
    "fence + truncated line": f"{FENCE}python\n{BODY}print(result",
    "prose + fence + truncated + end marker": f"Answer:\n{FENCE}Python\n{BODY}x = (<|endoftext|>{FENCE}",
    "end marker mid-line": BODY.rstrip() + f"</s>{FENCE}\nprint(",
    # the cut at 'def ' comes first: a marker or a fenced block before the function does not hide it
    "end marker before the def": "</s>" + BODY,
    "fenced text before the def": f"Expected output:\n{FENCE}\n12\n{FENCE}\nThe code:\n{BODY}",
}


def run_raw(texts: list[str], *, timeout_s: float = 2.0) -> list:
    """The oracle of the removed ``extract_code=raw`` (with ``entry_fallback=True``): each response run as generated,
    no extraction, no ``math`` in scope, the entry point's fallback left to the sandbox."""
    return gsm8k.run_programs(texts, workers=2, timeout_s=timeout_s, memory_mb=512, entry="simple_math_problem")


@pytest.mark.parametrize("name", list(UNTIDY))
def test_released_extraction_recovers_the_function(name):
    assert extract_program(UNTIDY[name]) == CLEAN


def test_released_extraction_details():
    # the cut at 'def ' comes first, so a fence only counts when two more follow the function: its inside is
    # then what is run (here prose: no answer), exactly as the released scorer does
    two_fences = f"{BODY}{FENCE}\nThen check:\n{FENCE}python\nprint(1)\n{FENCE}"
    assert extract_program(two_fences) == "Then check:"
    # trailing lines go one at a time until the rest compiles; at most 49 of them
    assert extract_program(BODY + "\n".join(["x = ("] * 49)) == CLEAN
    assert extract_program(BODY + "\n".join(["x = ("] * 50)).startswith(CLEAN + "\nx = (")
    # helper functions defined before the entry stay; text with no 'def ' is stripped and kept whole
    helper = "def helper(x):\n    return 2 * x\n\n" + BODY
    assert extract_program("Code:\n" + helper) == helper.strip()
    assert extract_program("  no code (  ") == "no code ("
    # 'math' is available without an import, as in the released namespace (its import before the def is cut)
    assert prepare_program("import math\ndef simple_math_problem():\n    return math.ceil(2.5)\n").startswith(
        "import math\ndef simple_math_problem"
    )


def test_released_protocol_scores_untidy_programs_and_raw_does_not():
    texts = list(UNTIDY.values())
    programs, results = execute_responses(texts, workers=2)
    assert programs == [CLEAN] * len(texts)
    assert [(r.status, r.value) for r in results] == [("ok", 12.0)] * len(texts)
    raw = run_raw(texts)
    assert [r.status for r in raw] == ["error"] * len(texts)
    assert not any(answers_match(r.value, 12.0) for r in raw)


def test_released_protocol_runs_math_without_import_and_calls_only_simple_math_problem():
    uses_math = f"Sure.\n{FENCE}python\nimport math\n\ndef simple_math_problem():\n    return math.ceil(7 / 2)\n{FENCE}"
    helper_and_two_defs = (
        "def helper():\n    return 100\n\ndef simple_math_problem():\n    return 1\n\n"
        "def simple_math_problem():\n    return helper() + 4\n\ndef other():\n    return 7\n"
    )
    other_name = "def solve():\n    return 12\n"
    _, results = execute_responses([uses_math, helper_and_two_defs, other_name], workers=2)
    assert [(r.status, r.value) for r in results[:2]] == [("ok", 4.0), ("ok", 104.0)]  # the last binding wins
    assert results[2].status == "error" and "simple_math_problem" in results[2].message
    _, fallback = execute_responses([other_name], entry_fallback=True)
    assert fallback[0].value == 12.0
    assert defines_name("if True:\n    def simple_math_problem():\n        return 1\n", "simple_math_problem")
    assert defines_name("simple_math_problem = lambda: 3\n", "simple_math_problem")
    assert not defines_name("def f():\n    def simple_math_problem():\n        return 1\n", "simple_math_problem")
    assert defines_name("def f(:\n", "simple_math_problem") is None


def test_released_tolerance_is_absolute_1e3_inclusive_and_exact_in_decimal():
    match = dict(rel_tol=0.0, abs_tol=1e-3)
    assert answers_match(12.0005, 12.0, **match) and answers_match(11.999, 12.0, **match)
    assert not answers_match(12.0011, 12.0, **match)
    # absolute, not relative: a relative 1e-3 would accept 1000.5 for 1000
    assert not answers_match(1000.5, 1000.0, **match)
    # the bound holds as the numbers are written (the float difference of 100.001 − 100 is 0.0010000000000047748)
    assert answers_match(100.001, 100.0, **match) and answers_match(-3.001, -3.0, **match)
    assert not answers_match(math.inf, math.inf, **match) and not answers_match(1.0, math.nan, **match)


class GSMData(SimpleNamespace):
    """A GSM8K-like datamodule: the first ``prompt_len`` tokens are the question, the rest the response."""

    def response_mask(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(tokens.shape, dtype=torch.bool)
        mask[:, self.prompt_len :] = True
        return mask


def gsm_datamodule(prompt_len: int = 8) -> GSMData:
    tokenizer = tiny_tokenizer(extra_special=("[PAD]",))
    pad_id = tokenizer.convert_tokens_to_ids("[PAD]")
    return GSMData(tokenizer=tokenizer, pad_id=pad_id, mask_id=len(tokenizer), prompt_len=prompt_len)


def test_gsm8k_accuracy_defaults_are_the_released_protocol(monkeypatch):
    dm = gsm_datamodule()
    texts = [UNTIDY["leading prose"], UNTIDY["python fence"], "def simple_math_problem():\n    return 12.0005\n"]
    dm.gold_answers = lambda target: [12.0] * len(texts)
    width = max(len(dm.tokenizer(t).input_ids) for t in texts)
    batch = torch.cat([encode_rows(dm, ["Q"] * len(texts), 8), encode_rows(dm, texts, width)], 1)
    seen = {}
    real = gsm8k.run_programs

    def spy(codes, **kwargs):
        seen.update(kwargs)
        return real(codes, **kwargs)

    monkeypatch.setattr(gsm8k, "run_programs", spy)
    metric = GSM8KAccuracy(datamodule=dm, scorer="execute", workers=2)
    metric.update(batch, batch)
    assert metric.compute()["accuracy"].item() == 100.0
    assert seen["timeout_s"] == 5.0 and seen["entry"] == "simple_math_problem" and seen["sandbox"] == "os"
    rows = metric.artifact_rows()
    assert [r["program"] for r in rows[:2]] == [CLEAN, CLEAN] and rows[0]["response"] == texts[0]
    assert {r["sandbox"] for r in rows} == {metric.isolation.name} != {"python_only"}  # the isolation used
    # the earlier behaviour (the raw response, ``run_raw``'s, by the oracle's identity extraction): the same
    # generations score 0 (untidy) and 12.0005 is not 12
    monkeypatch.setattr(gsm8k, "extract_program", lambda text: text)
    monkeypatch.setattr(gsm8k, "_with_math", lambda code: code)
    old = GSM8KAccuracy(datamodule=dm, scorer="execute", entry_fallback=True, timeout_s=2.0, abs_tol=1e-6)
    old.update(batch, batch)
    assert old.compute()["accuracy"].item() == 0.0 and seen["timeout_s"] == 2.0
    assert [r["status"] for r in old.artifact_rows()] == ["error", "error", "ok"]


def test_configs_default_to_the_released_protocols():
    gsm = OmegaConf.load(CONF / "gsm8k_base.yaml").metric
    assert "extract_code" not in gsm  # removed: the released extraction is the only one
    assert (gsm.entry_fallback, gsm.timeout_s, gsm.abs_tol, gsm.rel_tol, gsm.sandbox) == (
        False,
        5.0,
        None,
        None,
        "os",
    )
    metric = GSM8KAccuracy(datamodule=gsm_datamodule(), scorer="execute")
    assert metric.tolerance == {"abs_tol": 1e-3, "rel_tol": 0.0} and metric.sandbox["timeout_s"] == 5.0
    assert GSM8KAccuracy(datamodule=gsm_datamodule()).tolerance == {"abs_tol": 1e-6, "rel_tol": 1e-6}
    assert OmegaConf.load(CONF / "text_base.yaml").metric.convention == "released"


def test_unknown_protocol_names_fail_before_any_compute():
    for removed in ("raw", "tidy"):  # extract_code, removed: only what saved configs hold ("released") is accepted
        with pytest.raises(ValueError, match=rf"extract_code='{removed}' was removed; the program is cut out"):
            GSM8KAccuracy(datamodule=gsm_datamodule(), scorer="execute", extract_code=removed)
    assert GSM8KAccuracy(datamodule=gsm_datamodule(), scorer="execute", extract_code="released").scorer == "execute"
    with pytest.raises(ValueError, match="timeout_s"):
        GSM8KAccuracy(datamodule=gsm_datamodule(), scorer="execute", timeout_s=0)
    # the convention is checked before the evaluator is looked up: a ValueError, not EvaluatorUnavailableError
    with pytest.raises(ValueError, match=r"\['released', 'bos_prefix'\].*'mdlm'"):
        GenerativePerplexity("flowlm-test/no-such-evaluator", convention="mdlm")
    with pytest.raises(ValueError, match="bos_prefix"):
        GenPPLMetric(datamodule=SimpleNamespace(), evaluator="flowlm-test/no-such-evaluator", convention="bos")


# ---- gen-PPL conventions -------------------------------------------------------------------------------------

EOT = "<|endoftext|>"
TEXTS = [
    f"{EOT}Once upon a time there was a little cat.{EOT}",  # BOS … EOS, as TinyStories rows decode
    f"The dog ran to the park.{EOT} Birds sang.{EOT}{EOT}",  # EOS inside and repeated
    "She bought 12 pencils and paid $18 in total, and then she went home to play in the garden with Tom.",
    "Birds sang.",
    f"Every morning{EOT}",
]


@pytest.fixture(scope="module")
def evaluator_dir(tmp_path_factory):
    return save_tiny_evaluator(tmp_path_factory.mktemp("evaluator"), seed=0)


def direct(texts: list[str], max_length: int, convention: str) -> tuple[list[float], list[int]]:
    """Per-text total NLL and count, one unpadded sequence at a time, with transformers' own loss on labels."""
    tokenizer, model = tiny_tokenizer(), tiny_evaluator(len(tiny_tokenizer()), seed=0)
    eos = tokenizer.eos_token_id
    nll, counts = [], []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if convention == "bos_prefix":
            ids = ids[:max_length]
            ids = ids if ids[:1] == [eos] else [eos, *ids]  # the tiny tokenizer's BOS is its EOS, like GPT-2
            labels = list(ids)  # every token after the BOS
        else:
            ids = ids[:max_length]
            first = ids.index(eos) if eos in ids else None
            labels = [t if (t != eos or j == first) else -100 for j, t in enumerate(ids)]
        n = sum(label != -100 for label in labels[1:])
        with torch.no_grad():
            loss = model(torch.tensor([ids]), labels=torch.tensor([labels])).loss  # mean over scored targets
        nll.append(float(loss) * n if n else 0.0)
        counts.append(n)
    return nll, counts


@pytest.mark.parametrize("convention", ["released", "bos_prefix"])
def test_gen_ppl_conventions_match_a_direct_transformers_computation(evaluator_dir, convention):
    scorer = GenerativePerplexity(str(evaluator_dir), max_length=20, batch_size=2, convention=convention)
    scores = scorer.score(TEXTS)
    nll, counts = direct(TEXTS, max_length=20, convention=convention)
    assert scores.tokens.tolist() == counts
    torch.testing.assert_close(scores.nll, torch.tensor(nll, dtype=torch.float64), rtol=1e-5, atol=1e-5)
    assert scores.perplexity() == pytest.approx(math.exp(sum(nll) / sum(counts)), rel=1e-5)


def test_released_convention_token_counts(evaluator_dir):
    released = GenerativePerplexity(str(evaluator_dir), convention="released")
    bos = GenerativePerplexity(str(evaluator_dir), convention="bos_prefix")
    tok = released.tokenizer
    n = [len(tok(t, add_special_tokens=False).input_ids) for t in ("Once upon a time there was a little cat.", "x")]
    counts = released.score([TEXTS[0], "x", f"x{EOT}", f"x{EOT}{EOT}", f"{EOT}{EOT}", ""]).tokens.tolist()
    # BOS story EOS: the story only (its first EOS is the BOS, context); 'x': nothing has a prefix; 'x EOS': the
    # first EOS counts; later EOS do not; an empty story scores nothing
    assert counts == [n[0], 0, 1, 1, 0, 0]
    assert bos.score([TEXTS[0], "x", f"x{EOT}{EOT}"]).tokens.tolist() == [n[0] + 1, 1, 3]
    # released on BOS + text equals bos_prefix on the text when it has no EOS: same targets, same contexts
    text = "Every morning the girl walked to school."
    torch.testing.assert_close(released.score([EOT + text]).nll, bos.score([text]).nll, rtol=1e-6, atol=1e-6)
    # context: the released convention uses all of it, the BOS prefix takes one position
    assert (released.max_length, bos.max_length) == (64, 63)
    with pytest.warns(UserWarning, match="context of 64"):
        assert GenerativePerplexity(str(evaluator_dir), max_length=65).max_length == 64


def test_gen_ppl_metric_defaults_to_released_and_records_the_convention(evaluator_dir):
    tokenizer = tiny_tokenizer(extra_special=("[PAD]",))
    pad_id = tokenizer.convert_tokens_to_ids("[PAD]")
    dm = SimpleNamespace(tokenizer=tokenizer, pad_id=pad_id, mask_id=len(tokenizer), seq_len=20)
    rows = [tokenizer(t, add_special_tokens=False).input_ids[:20] for t in TEXTS]
    tokens = torch.tensor([r + [pad_id] * (20 - len(r)) for r in rows])
    values = {}
    for convention in ("released", "bos_prefix"):
        kwargs = {} if convention == "released" else {"convention": convention}
        metric = GenPPLMetric(datamodule=dm, evaluator=str(evaluator_dir), batch_size=2, **kwargs)
        metric.update(tokens, tokens)
        values[convention] = metric.compute()["gen_ppl"].item()
        assert {r["convention"] for r in metric.artifact_rows()} == {convention}
        texts = [r["text"] for r in metric.artifact_rows()]
        nll, counts = direct(texts, max_length=20, convention=convention)
        assert values[convention] == pytest.approx(math.exp(sum(nll) / sum(counts)), rel=1e-5)
    assert values["released"] != pytest.approx(values["bos_prefix"], rel=1e-3)
