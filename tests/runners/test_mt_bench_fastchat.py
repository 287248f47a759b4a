"""MT-Bench graded as FastChat grades (runners/mt_bench.py, flowlm/metrics/mt_bench.py), checked with FastChat's own
code (fschat 0.2.36, installed without its dependencies) on the suite's files: FastChat's loaders and ``check_data``
read the answers, its ``play_a_match_single`` builds the very prompts the suite sent (its prompt per category and
turn, GPT-4's references) and parses the judge's replies to the same scores, ``resolve_single_judgment_dict`` finds
every judgment and ``show_result`` prints the suite's numbers. The FastChat data folder is written by the tests in
FastChat's formats with the suite's stand-in text (tests/runners/test_mt_bench.py)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import re
import sys
import types
from argparse import Namespace
from pathlib import Path

import pytest
from mlflow import MlflowClient

from flowlm.metrics.mt_bench import (
    FastChatGrading,
    JudgePrompt,
    Question,
    QuestionError,
    answer_temperature,
    judge_messages,
    load_fastchat_data,
    parse_rating,
)
from runners import mt_bench
from tests.runners.test_mt_bench import (
    QUESTIONS,
    RATINGS,
    JudgeServer,
    config,
    write_answers,
    write_fastchat_data,
    write_jsonl_lines,
)

FASTCHAT_JUDGE = "gpt-4"  # the judge FastChat's resolve_single_judgment_dict looks judgments up by


@pytest.fixture
def questions(tmp_path) -> Path:
    """FastChat's question file in the data folder ``config`` gives."""
    return write_fastchat_data(tmp_path / "fastchat") / "mt_bench" / "question.jsonl"


@pytest.fixture(scope="module")
def fastchat() -> types.SimpleNamespace:
    """FastChat's llm_judge modules. Its common.py imports the OpenAI and Anthropic clients, which only its API calls
    use: where they are not installed, empty modules stand in while it is imported (a call into one would fail)."""
    if importlib.util.find_spec("fastchat") is None:
        pytest.fail("fschat is not installed: pip install --no-deps fschat==0.2.36 (`make test` installs it)")
    added = [n for n in ("openai", "anthropic") if n not in sys.modules and importlib.util.find_spec(n) is None]
    sys.modules.update({name: types.ModuleType(name) for name in added})
    try:
        names = ("common", "gen_judgment", "show_result")
        return types.SimpleNamespace(**{n: importlib.import_module(f"fastchat.llm_judge.{n}") for n in names})
    finally:
        for name in added:
            sys.modules.pop(name, None)


def reply(prompt: str, second: bool) -> str:
    """The stand-in judge's replies: some only FastChat's parse reads as the suite now does."""
    if "UNRATED" in prompt:
        return "No verdict."
    if "haiku" in prompt and not second:
        return "Rating: [[8.5]]"
    if "2 + 3" in prompt and not second:
        return "[[ 9 ]] on reflection [6]"  # no space allowed inside [[...]]: the fallback's [6]
    return f"Rating: [[{4 if second else 7}]]"


def rows(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_fastchats_own_code_reads_the_suites_files_and_makes_the_same_prompts_and_scores(
    tmp_path, questions, fastchat, monkeypatch, capsys
):
    write_answers(tmp_path, "org_m")  # model_id org/m: FastChat names the model by its file, org_m.jsonl
    with JudgeServer(failures=0, model=FASTCHAT_JUDGE, reply=reply) as server:
        judge = [f"judge.base_url={server.url}", f"judge.model={FASTCHAT_JUDGE}", "judge.parallel=2"]
        result = mt_bench.run(config(tmp_path, "step=judge", "model_id=org/m", "logger=none", *judge))
    sent = [p["body"] for p in server.completions()]
    ours = {(r["question_id"], r["turn"]): r for r in rows(result["judgments"])}
    assert result["model_id"] == "org_m" and {r["model"] for r in ours.values()} == {"org_m"}

    common, gen_judgment, data = fastchat.common, fastchat.gen_judgment, tmp_path / "fastchat"
    answer_dir = str(tmp_path / "out" / "model_answer")
    models = common.get_model_list(answer_dir)
    fc_questions = common.load_questions(str(questions), None, None)
    answers = common.load_model_answers(answer_dir)
    references = common.load_model_answers(str(data / "mt_bench" / "reference_answer"))
    judges = gen_judgment.make_judge_single(
        FASTCHAT_JUDGE, common.load_judge_prompts(str(data / "judge_prompts.jsonl"))
    )
    assert models == ["org_m"]
    common.check_data(fc_questions, answers, references, models, judges)  # the suite's answer file passes

    def completion(model, conv, temperature, max_tokens, api_dict=None):  # FastChat's call to the judge
        messages = conv.to_openai_api_messages()
        assert any(body["messages"] == messages for body in sent), messages  # the suite sent this very prompt
        return reply(messages[-1]["content"], "second user question" in messages[0]["content"])

    monkeypatch.setattr(common, "chat_completion_openai", completion)
    ref_questions = [q for q in fc_questions if q["category"] in common.NEED_REF_CATS]
    plain = [q for q in fc_questions if q["category"] not in common.NEED_REF_CATS]
    matches = [
        *gen_judgment.make_match_single(plain, models, answers, judges["default"]),
        *gen_judgment.make_match_single(ref_questions, models, answers, judges["math"], ref_answers=references),
        *gen_judgment.make_match_single(plain, models, answers, judges["default-mt"], multi_turn=True),
        *gen_judgment.make_match_single(
            ref_questions, models, answers, judges["math-mt"], ref_answers=references, multi_turn=True
        ),
    ]
    theirs = {(r["question_id"], r["turn"]): r for r in (common.play_a_match_single(m, None) for m in matches)}
    assert theirs.keys() == ours.keys() and len(theirs) == len(sent) == 6
    for key, fc in theirs.items():
        mine = ours[key]
        assert (mine["user_prompt"], tuple(mine["judge"]), mine["model"]) == (
            fc["user_prompt"],
            fc["judge"],
            fc["model"],
        )
        assert mine["score"] == fc["score"] and type(mine["score"]) is type(fc["score"]), key
    assert ours[(81, 1)]["score"] == 8.5 and ours[(111, 1)]["score"] == 6 and ours[(121, 2)]["score"] == -1
    assert all(body["temperature"] == 0 and body["max_tokens"] == 2048 for body in sent)  # FastChat's judge call

    judgments = common.load_single_model_judgments(result["judgments"])
    for q in fc_questions:
        for turn in (1, 2):
            found = common.resolve_single_judgment_dict(q, judgments, judgments, multi_turn=turn == 2)
            assert found[(q["question_id"], "org_m")]["score"] == ours[(q["question_id"], turn)]["score"]

    capsys.readouterr()
    args = Namespace(bench_name="mt_bench", input_file=result["judgments"], model_list=None, judge_model="gpt-4")
    fastchat.show_result.display_result_single(args)
    printed = [float(v) for v in re.findall(r"^org_m\s+(?:\d\s+)?([\d.]+)\s*$", capsys.readouterr().out, re.M)]
    scores = result["scores"]
    assert printed == pytest.approx([scores["turn_1"], scores["turn_2"], scores["score"]], abs=1e-5)
    assert scores["turn_1"] == pytest.approx((8.5 + 6 + 7) / 3)


def test_the_rating_parse_is_fastchats_on_every_reply(fastchat, monkeypatch):
    """Each reply of test_mt_bench.RATINGS through FastChat's own judging code: the same rating, of the same type."""
    common = fastchat.common
    prompts = {"system_prompt": "S", "prompt_template": "{question}|{answer}", "output_format": "[[rating]]"}
    judge = common.Judge(FASTCHAT_JUDGE, {**prompts, "name": "single-v1", "type": "single"})
    question, answer = {"turns": ["q"]}, {"choices": [{"turns": ["a"]}]}
    for text, _ in RATINGS:
        monkeypatch.setattr(common, "chat_completion_openai", lambda *a, text=text, **k: text)
        rating, _, _ = common.run_judge_single(question, answer, judge, None)
        assert parse_rating(text) == rating and type(parse_rating(text)) is type(rating), text


def test_the_suite_prompts_are_labelled_not_comparable(tmp_path, questions, fastchat, runs_env, capsys):
    """judge_prompts=suite: the printed results and the MLflow tags say the scores are not comparable; FastChat's
    result code cannot even find judgments under the suite's prompt names."""
    write_answers(tmp_path)
    with JudgeServer(failures=0, model=FASTCHAT_JUDGE) as server:
        judge = [f"judge.base_url={server.url}", f"judge.model={FASTCHAT_JUDGE}"]
        cfg = config(tmp_path, "step=judge", "model_id=m", "judge_prompts=suite", "fastchat_data=null", *judge)
        cfg.questions = str(questions)
        result = mt_bench.run(cfg)
    assert "judge_prompts=suite, the suite's own judge prompts: NOT comparable" in capsys.readouterr().out
    run = MlflowClient(f"sqlite:///{runs_env / 'runs' / 'mlflow.db'}").get_run(result["mlflow_run_id"])
    tags = run.data.tags
    assert tags["flowlm.mt_bench.judge_prompts"] == "suite" and tags["flowlm.mt_bench.comparable"] == "false"
    assert "NOT comparable" in tags["flowlm.mt_bench.protocol"]
    judgments = fastchat.common.load_single_model_judgments(result["judgments"])
    with pytest.raises(KeyError):
        fastchat.common.resolve_single_judgment_dict(QUESTIONS[0], judgments, judgments)


# ------------------------------------------------------------------------------------------------ refused or mapped
def test_without_fastchats_data_folder_one_line_says_how_to_get_it_before_the_checkpoint_is_read(tmp_path):
    cfg = config(tmp_path, "ckpt_path=/nonexistent/last.ckpt", "fastchat_data=null", "logger=none", "judge.model=x")
    with pytest.raises(mt_bench.FastChatDataError) as err:
        mt_bench.run(cfg)
    message = str(err.value)
    assert "\n" not in message and "fastchat_data is not set" in message
    assert (
        "git clone https://github.com/lm-sys/FastChat" in message
        and "fastchat_data=<clone>/fastchat/llm_judge/data" in message
    )
    (tmp_path / "fastchat" / "mt_bench" / "reference_answer" / "gpt-4.jsonl").unlink()
    with pytest.raises(
        mt_bench.FastChatDataError,
        match=r"lacks the GPT-4 reference answers \(mt_bench/reference_answer/gpt-4\.jsonl\)",
    ):
        mt_bench.run(config(tmp_path, "ckpt_path=/nonexistent/last.ckpt", "logger=none", "judge.model=x"))


def test_hash_ids_are_mapped_to_fastchats_by_their_turns_and_unknown_ones_refused(tmp_path, questions, caplog):
    """HuggingFaceH4/mt_bench_prompts' records (prompt_id hashes, prompt): FastChat's check_data finds no GPT-4
    reference under a hash id; a question with FastChat's turns takes FastChat's id, another of a reference category
    is refused."""
    hashed = [
        {"prompt_id": f"h{q['question_id']:x}", "prompt": q["turns"], "category": q["category"]} for q in QUESTIONS
    ]
    path = write_jsonl_lines(tmp_path / "h4.jsonl", hashed)
    with caplog.at_level(logging.WARNING, logger="runners.mt_bench"):
        grading, mapped = mt_bench.load_grading(config(tmp_path, f"questions={path}"))
    assert [q.question_id for q in mapped] == [81, 111, 121] and grading.name == "fastchat"
    assert "3 question ids are not FastChat's" in caplog.text and "'h6f' → 111" in caplog.text
    write_jsonl_lines(path, [*hashed, {"prompt_id": "hnew", "prompt": ["New sum?", "And?"], "category": "math"}])
    with pytest.raises(QuestionError, match="question 'hnew' \\(math\\) has no GPT-4 reference answer"):
        mt_bench.load_grading(config(tmp_path, f"questions={path}"))


def test_the_answer_file_name_is_the_model_id(tmp_path):
    model_id, answers, judgments = mt_bench.outputs(config(tmp_path, "model_id=org/m"))
    assert model_id == "org_m" and answers.name == "org_m.jsonl" and judgments.parent.name == "org_m"


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["generate.temperature=hot"], "generate.temperature must be one of"),
        (["+generate.sampler_options.temperature=0.5"], "drop one"),
        (["generate.sampler=flm_euler"], "conf/sampler/flm_euler.yaml has no temperature"),
        (["judge_prompts=gpt"], "judge_prompts must be one of"),
    ],
)
def test_temperature_and_prompt_settings_that_cannot_work_are_refused_before_the_checkpoint_is_read(
    tmp_path, overrides, match
):
    cfg = config(tmp_path, "ckpt_path=/nonexistent/last.ckpt", "logger=none", "judge.model=x", *overrides)
    with pytest.raises(ValueError, match=match):
        mt_bench.run(cfg)


def test_fastchats_temperatures_by_category():
    assert [answer_temperature(c) for c in ("writing", "roleplay", "extraction", "math", "coding", "reasoning")] == [
        0.7, 0.7, 0.0, 0.0, 0.0, 0.0
    ]  # fmt: skip
    assert [answer_temperature(c) for c in ("stem", "humanities", "unlisted")] == [0.1, 0.1, 0.7]


def test_a_folder_with_other_prompts_is_refused(tmp_path):
    data = write_fastchat_data(tmp_path / "fastchat")
    prompts = [json.loads(line) for line in (data / "judge_prompts.jsonl").read_text().splitlines()]
    write_jsonl_lines(data / "judge_prompts.jsonl", [p for p in prompts if p["name"] != "single-math-v1-multi-turn"])
    with pytest.raises(
        mt_bench.FastChatDataError, match=r"lacks FastChat's judge prompts \['single-math-v1-multi-turn'\]"
    ):
        mt_bench.load_grading(config(tmp_path))


def test_an_empty_system_prompt_is_left_out_as_fastchat_leaves_it_out(fastchat, monkeypatch):
    """FastChat sends no system message when a prompt's system_prompt is empty; the suite sends the same messages."""
    common, sent = fastchat.common, []
    prompt = {"name": "single-v1", "type": "single", "system_prompt": "", "prompt_template": "{question}|{answer}"}
    judge = common.Judge(FASTCHAT_JUDGE, {**prompt, "output_format": "[[rating]]"})
    monkeypatch.setattr(
        common, "chat_completion_openai", lambda model, conv, **k: sent.append(conv.to_openai_api_messages()) or ""
    )
    common.run_judge_single({"turns": ["q"]}, {"choices": [{"turns": ["a"]}]}, judge, None)
    prompts = {n: JudgePrompt(n, "", prompt["prompt_template"]) for n in ("single-v1",)}
    question = Question(1, "writing", ("q", "q2"))
    assert FastChatGrading(prompts, {}).messages(question, ["a", "a2"], 1) == ("single-v1", sent[0])


def test_the_label_reads_the_answers_temperatures_from_their_records():
    """step=judge labels answers another run wrote by the temperatures recorded in them, not by today's settings."""
    questions = [
        Question(q["question_id"], q["category"], tuple(q["turns"])) for q in QUESTIONS
    ]  # writing, math, coding

    def answers(*temperatures):
        return {
            str(q.question_id): {"flowlm": {"temperature": t}} for q, t in zip(questions, temperatures, strict=True)
        }

    assert mt_bench.answered_at(questions, answers(0.7, 0.0, 0.0)) == "fastchat"
    assert mt_bench.answered_at(questions, answers(0.1, 0.1, 0.1)) == "other"  # mt_bench=mlfm_paper's
    assert mt_bench.answered_at(questions, {str(q.question_id): {} for q in questions}) == "unrecorded"


@pytest.mark.skipif(
    not os.environ.get("MT_BENCH_FASTCHAT_DATA"),
    reason="FastChat's data folder is not in the repository: MT_BENCH_FASTCHAT_DATA=<clone>/fastchat/llm_judge/data",
)
def test_on_fastchats_real_data_every_judge_prompt_is_fastchats(fastchat, monkeypatch):
    """On a FastChat clone's data folder: the 160 judge prompts (80 questions × 2 turns) the suite sends for stand-in
    answers are the ones FastChat's play_a_match_single sends, prompt names included; the suite's own option shows a
    reference on a different set of them."""
    common, gen_judgment, root = fastchat.common, fastchat.gen_judgment, Path(os.environ["MT_BENCH_FASTCHAT_DATA"])
    grading, questions = load_fastchat_data(root)
    grading.check(questions)
    answers = {
        q.question_id: {"choices": [{"turns": [f"one {q.question_id}", f"two {q.question_id}"]}]} for q in questions
    }
    fc_questions = common.load_questions(str(root / "mt_bench" / "question.jsonl"), None, None)
    references = common.load_model_answers(str(root / "mt_bench" / "reference_answer"))
    judges = gen_judgment.make_judge_single("gpt-4", common.load_judge_prompts(str(root / "judge_prompts.jsonl")))
    sent = []
    monkeypatch.setattr(
        common, "chat_completion_openai", lambda m, conv, **k: sent.append(conv.to_openai_api_messages()) or ""
    )
    same = references_differ = 0
    for question, record in zip(questions, fc_questions, strict=True):
        needs = question.category in common.NEED_REF_CATS
        for turn, judge in (
            (1, judges["math" if needs else "default"]),
            (2, judges["math-mt" if needs else "default-mt"]),
        ):
            match = common.MatchSingle(
                record,
                "m",
                answers[question.question_id],
                judge,
                references["gpt-4"][question.question_id] if needs else None,
                turn == 2,
            )
            result = common.play_a_match_single(match, None)
            name, messages = grading.messages(question, answers[question.question_id]["choices"][0]["turns"], turn)
            same += (name, messages) == (result["judge"][1], sent[-1])
            references_differ += ("-ref" in judge_messages(question, ["a", "b"], turn)[0]) != needs
    assert same == 2 * len(questions) == 160
    print(f"\n{same}/160 judge prompts are FastChat's; the suite's show a reference differently on {references_differ}")
