"""MT-Bench (runners/mt_bench.py, flowlm/metrics/mt_bench.py): answers in FastChat's format from tiny checkpoints
written as flowlm-train writes them, and single-answer grading against a judge served over real HTTP on 127.0.0.1
(a transient 503 retried, a reply without a rating counted), the scores aggregated and logged to MLflow."""

from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from mlflow import MlflowClient

from datamodules.sources import load_tokenizer
from flowlm.metrics.mt_bench import (
    UNPARSEABLE,
    Question,
    QuestionError,
    aggregate,
    judge_messages,
    parse_question,
    parse_rating,
)
from lightning_modules.mdm import MDMModule
from lightning_modules.mlfm import MLFMModule
from runners import mt_bench
from runners.lm_harness import FlowLM
from tests.conftest import compose_config
from tests.runners.test_lm_harness import TOKENIZER, write_checkpoint

QUESTIONS = [
    {  # a short reference in a category FastChat grades without one: not shown (FastChat's rule)
        "question_id": 81,
        "category": "writing",
        "turns": ["Write a haiku about rain.", "Now make it rhyme."],
        "reference": ["Any haiku.", ""],
    },
    {
        "question_id": 111,
        "category": "math",
        "turns": ["What is 2 + 3?", "And 2 × 3?"],
        "reference": ["5", "6"],
    },
    {"question_id": 121, "category": "coding", "turns": ["Reverse a list in Python.", "UNRATED: in C?"]},
]
# FastChat's data folder in its formats, with the suite's stand-in text (never FastChat's prompts or questions): the
# four single-answer prompts (a pairwise one, which single grading never reads, beside them) and "GPT-4" references
STAND_IN_PROMPTS = [
    {"name": "pair-v2", "type": "pairwise", "system_prompt": "Pick one.", "prompt_template": "{question}",
     "description": "stand-in", "category": "general", "output_format": "[[A]]"},
    {"name": "single-v1", "type": "single", "system_prompt": "You grade one answer.",
     "prompt_template": "<Q>{question}</Q>\n<A>{answer}</A>\nEnd with [[rating]].",
     "description": "stand-in", "category": "general", "output_format": "[[rating]]"},
    {"name": "single-math-v1", "type": "single", "system_prompt": "You grade one answer against a reference.",
     "prompt_template": "<Q>{question}</Q>\n<Reference Answer>{ref_answer_1}</Reference Answer>\n<A>{answer}</A>",
     "description": "stand-in", "category": "math", "output_format": "[[rating]]"},
    {"name": "single-v1-multi-turn", "type": "single",
     "system_prompt": "Grade only the answer to the second user question.",
     "prompt_template": "<Q1>{question_1}</Q1><A1>{answer_1}</A1><Q2>{question_2}</Q2><A2>{answer_2}</A2>",
     "description": "stand-in", "category": "general", "output_format": "[[rating]]"},
    {"name": "single-math-v1-multi-turn", "type": "single",
     "system_prompt": "Grade only the answer to the second user question, against the reference.",
     "prompt_template": "<Reference Answer>{ref_answer_1} / {ref_answer_2}</Reference Answer>"
                        "<Q1>{question_1}</Q1><A1>{answer_1}</A1><Q2>{question_2}</Q2><A2>{answer_2}</A2>",
     "description": "stand-in", "category": "math", "output_format": "[[rating]]"},
]  # fmt: skip
STAND_IN_REFERENCES = {111: ["Five (GPT-4).", "Six (GPT-4)."], 121: ["xs[::-1] (GPT-4)", "a loop (GPT-4)"]}
JUDGE = "judge-x"
# small budgets on the tiny checkpoints (rows of 64 positions)
SMALL = ["generate.gen_length=16", "generate.nfe=4", "generate.batch_size=2", "logger=none"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mt_bench")
    mdm = write_checkpoint(root / "mdm.ckpt", MDMModule)
    return {"mdm": mdm, "mlfm": write_checkpoint(root / "mlfm.ckpt", MLFMModule, init_from=str(mdm))}


def write_jsonl_lines(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_fastchat_data(root: Path, questions: list[dict] = QUESTIONS) -> Path:
    """A FastChat ``llm_judge/data`` folder at ``root``: judge_prompts.jsonl, mt_bench/question.jsonl and
    mt_bench/reference_answer/gpt-4.jsonl (model_answer records), the stand-in text above."""
    write_jsonl_lines(root / "judge_prompts.jsonl", STAND_IN_PROMPTS)
    write_jsonl_lines(root / "mt_bench" / "question.jsonl", questions)
    references = [
        {"question_id": qid, "answer_id": f"ref{qid}", "model_id": "gpt-4", "tstamp": 0.0,
         "choices": [{"index": 0, "turns": turns}]}
        for qid, turns in STAND_IN_REFERENCES.items()
    ]  # fmt: skip
    write_jsonl_lines(root / "mt_bench" / "reference_answer" / "gpt-4.jsonl", references)
    return root


@pytest.fixture
def questions(tmp_path) -> Path:
    """FastChat's question file in the FastChat data folder ``config`` gives (the default questions=null reads it)."""
    return write_fastchat_data(tmp_path / "fastchat") / "mt_bench" / "question.jsonl"


def config(tmp_path: Path, *overrides: str):
    """conf/mt_bench.yaml with outputs under ``tmp_path`` and FastChat's data folder there (stand-in files)."""
    data = tmp_path / "fastchat"
    if not data.exists():
        write_fastchat_data(data)
    return compose_config("mt_bench", [f"out_dir={tmp_path / 'out'}", f"fastchat_data={data}", *overrides])


class JudgeServer:
    """An OpenAI-compatible judge on 127.0.0.1: ``/v1/models`` lists JUDGE; ``/v1/chat/completions`` answers the
    first ``failures`` requests with ``status``, then rates turn 1 [[7]] and turn 2 [[4]], and a conversation that
    holds "UNRATED" without a rating; after ``rated_until`` ratings (None: never) it answers ``status`` to all.
    Every request is kept (path, headers, body, and what ``watch()`` returned as it arrived). ``model``: the judge it
    serves; ``reply(user prompt, second turn)``: its judgments instead."""

    def __init__(
        self, failures: int = 1, status: int = 503, rated_until: int | None = None, watch=None, model: str = JUDGE,
        reply=None,
    ) -> None:  # fmt: skip
        self.failures, self.status, self.requests, self.model, self.reply = failures, status, [], model, reply
        self.rated_until, self.rated, self.watch = rated_until, 0, watch
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _reply(self, status: int, payload: dict | str) -> None:
                body = (payload if isinstance(payload, str) else json.dumps(payload)).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._reply(200, {"object": "list", "data": [{"id": server.model, "object": "model"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    seen = server.watch() if server.watch else None
                    server.requests.append(
                        {"path": self.path, "headers": dict(self.headers), "body": body, "seen": seen}
                    )
                    fail = server.failures > 0
                    server.failures -= fail
                    dead = server.rated_until is not None and server.rated >= server.rated_until
                    server.rated += not (fail or dead)
                    fail = fail or dead
                if fail:
                    self._reply(server.status, "busy")
                    return
                text = body["messages"][-1]["content"]
                second = "second user question" in body["messages"][0]["content"]
                judgment = "No verdict." if "UNRATED" in text else f"Fine. Rating: [[{4 if second else 7}]]"
                judgment = server.reply(text, second) if server.reply else judgment
                self._reply(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": judgment}}]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> JudgeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def completions(self) -> list[dict]:
        return [r for r in self.requests if r["path"] == "/v1/chat/completions"]


def judged(server: JudgeServer, *overrides: str) -> list[str]:
    return [f"judge.base_url={server.url}", f"judge.model={JUDGE}", "judge.backoff_s=0.01", *overrides]


def write_answers(tmp_path: Path, model_id: str = "m") -> Path:
    path = tmp_path / "out" / "model_answer" / f"{model_id}.jsonl"
    path.parent.mkdir(parents=True)
    rows = [
        {"question_id": q["question_id"], "answer_id": "a", "model_id": model_id, "tstamp": 0.0,
         "choices": [{"index": 0, "turns": [f"first {q['question_id']}", f"second {q['question_id']}"]}]}
        for q in QUESTIONS
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------------------------ generation
@pytest.mark.parametrize("sampler", [[], ["generate.sampler=semi_ar", "+generate.sampler_options.block_length=8"]])
def test_answers_are_fastchat_records_of_two_turns_with_their_nfe(
    checkpoints, questions, tmp_path, monkeypatch, sampler
):
    """Three questions, two turns each: FastChat's model_answer fields, the NFE of each turn within the budget, the
    second turn's prompt (Vicuna's: the tiny tokenizer has no chat template) holding the first turn and the model's
    first answer, and each question answered with the sampler at FastChat's temperature for its category (writing
    0.7, math and coding 0: argmax)."""
    calls = []  # (the sampler's temperature, the contexts) of each generation call
    generate = FlowLM.generate_until

    def spy(self, requests, disable_tqdm=False):
        calls.append((self.sampler.temperature, [r.args[0] for r in requests]))
        return generate(self, requests, disable_tqdm)

    monkeypatch.setattr(FlowLM, "generate_until", spy)
    cfg = config(
        tmp_path, f"ckpt_path={checkpoints['mdm']}", f"questions={questions}", "step=generate", *SMALL, *sampler
    )
    result = mt_bench.run(cfg)
    rows = [json.loads(line) for line in Path(result["answers"]).read_text().splitlines()]
    assert Path(result["answers"]) == tmp_path / "out" / "model_answer" / "tiny_mdm.jsonl"  # the run's name
    assert [r["question_id"] for r in rows] == [81, 111, 121]
    for row in rows:
        assert set(row) >= {"question_id", "answer_id", "model_id", "choices", "tstamp"}
        assert row["model_id"] == "tiny_mdm"
        (choice,) = row["choices"]
        assert choice["index"] == 0 and len(choice["turns"]) == 2 and all(isinstance(t, str) for t in choice["turns"])
        assert all(1 <= n <= 4 for n in choice["nfe"]) and len(choice["nfe"]) == 2
    assert result["nfe"]["max_nfe"] <= 4
    assert [(t, len(c)) for t, c in calls] == [(0.7, 1), (0.7, 1), (0.0, 2), (0.0, 2)]  # writing; math and coding
    assert "haiku" in calls[0][1][0] and "2 + 3" in calls[2][1][0] and "Reverse a list" in calls[2][1][1]
    assert [r["flowlm"]["temperature"] for r in rows] == [0.7, 0.0, 0.0]
    (_, first), (_, second) = calls[:2]
    assert first[0].startswith("A chat between") and first[0].endswith("USER: Write a haiku about rain. ASSISTANT:")
    answer = rows[0]["choices"][0]["turns"][0]
    assert second[0] == f"{first[0]} {answer}<|endoftext|>USER: Now make it rhyme. ASSISTANT:"  # EOS closes a turn


def test_the_mlfm_paper_setting_runs_on_an_mlfm_checkpoint(checkpoints, questions, tmp_path):
    """mt_bench=mlfm_paper: the MLFM sampler with CCFG (w = 2) and OTP, 128 guided steps + the final call = NFE 257
    per answer, spent in full; the answer window half the row."""
    cfg = config(
        tmp_path, "mt_bench=mlfm_paper", f"ckpt_path={checkpoints['mlfm']}", f"questions={questions}", "step=generate",
        "logger=none",
    )  # fmt: skip
    assert cfg.generate.sampler == "mlfm" and cfg.generate.sampler_options.guidance == 2.0
    result = mt_bench.run(cfg)
    rows = [json.loads(line) for line in Path(result["answers"]).read_text().splitlines()]
    assert [r["choices"][0]["nfe"] for r in rows] == [[257, 257]] * 3
    assert rows[0]["flowlm"]["sampler"] == "mlfm" and rows[0]["flowlm"]["family"] == "mlfm"
    assert rows[0]["flowlm"]["gen_length"] == 32  # gen_length null: half the row of 64


def test_a_tokenizer_chat_template_renders_the_conversation_without_a_second_bos():
    tok = load_tokenizer(TOKENIZER)
    tok.bos_token = tok.bos_token or tok.eos_token
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    messages = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
    ]
    assert (
        mt_bench.chat_renderer(tok, "auto", None, drop_bos=True)(messages) == "<user>q1<assistant>a1<user>q2<assistant>"
    )
    assert mt_bench.chat_renderer(tok, "auto", None, drop_bos=False)(messages).startswith(tok.bos_token + "<user>")
    vicuna = mt_bench.chat_renderer(tok, "vicuna", "SYS", drop_bos=True)(messages)
    assert vicuna == f"SYS USER: q1 ASSISTANT: a1{tok.eos_token}USER: q2 ASSISTANT:"


# ------------------------------------------------------------------------------------------------ grading
def test_judging_retries_a_503_and_aggregates_per_turn_and_category(tmp_path, questions, monkeypatch):
    monkeypatch.setenv("MT_JUDGE_KEY", "sekret")
    write_answers(tmp_path)
    with JudgeServer(failures=1) as server:
        cfg = config(
            tmp_path, "step=judge", "model_id=m", f"questions={questions}", "logger=none",
            *judged(server, "judge.api_key_env=MT_JUDGE_KEY"),
        )  # fmt: skip
        result = mt_bench.run(cfg)
    posts = server.completions()
    assert len(posts) == 7  # 3 questions × 2 turns, and the one that met the 503 once more
    assert all(p["headers"]["Authorization"] == "Bearer sekret" and p["body"]["model"] == JUDGE for p in posts)
    scores = result["scores"]
    assert scores["turn_1"] == 7 and scores["turn_2"] == 4
    assert scores["score"] == pytest.approx((3 * 7 + 2 * 4) / 5)
    assert scores["category/writing"] == 5.5 and scores["category/math"] == 5.5 and scores["category/coding"] == 7
    assert scores["judged"] == 5 and scores["unparseable"] == 1
    rows = [json.loads(line) for line in Path(result["judgments"]).read_text().splitlines()]
    assert [(r["question_id"], r["turn"], r["score"]) for r in rows] == [
        (81, 1, 7.0), (81, 2, 4.0), (111, 1, 7.0), (111, 2, 4.0), (121, 1, 7.0), (121, 2, UNPARSEABLE)
    ]  # fmt: skip
    assert all(r["model"] == "m" and r["judge"][0] == JUDGE for r in rows)
    math_turn_2 = next(p for p in posts if "And 2 × 3?" in p["body"]["messages"][-1]["content"])
    # FastChat's GPT-4 references of both turns, not the question file's short ones
    assert (
        "<Reference Answer>Five (GPT-4). / Six (GPT-4).</Reference Answer>"
        in math_turn_2["body"]["messages"][-1]["content"]
    )
    writing = [p["body"]["messages"][-1]["content"] for p in posts if "haiku" in p["body"]["messages"][-1]["content"]]
    assert writing and not any("Reference" in text or "Any haiku." in text for text in writing)


def test_generate_and_judge_in_one_command_log_to_mlflow(checkpoints, questions, tmp_path, runs_env):
    with JudgeServer(failures=0) as server:
        cfg = config(
            tmp_path, f"ckpt_path={checkpoints['mdm']}", f"questions={questions}", *SMALL[:-1], *judged(server)
        )
        result = mt_bench.run(cfg)
    client = MlflowClient(f"sqlite:///{runs_env / 'runs' / 'mlflow.db'}")
    run = client.get_run(result["mlflow_run_id"])
    metrics = run.data.metrics
    assert metrics["mt_bench/turn_1"] == 7 and metrics["mt_bench/unparseable"] == 1
    assert metrics["mt_bench/mean_nfe"] == result["nfe"]["mean_nfe"] and 1 <= metrics["mt_bench/max_nfe"] <= 4
    assert run.data.params["judge/model"] == JUDGE and run.data.params["generate/nfe"] == "4"
    assert run.data.tags["flowlm.model_id"] == "tiny_mdm" and run.info.status == "FINISHED"
    assert (
        run.data.tags["flowlm.mt_bench.judge_prompts"] == "fastchat"
        and run.data.tags["flowlm.mt_bench.comparable"] == "true"
    )
    protocol = "FastChat's judge prompts and GPT-4 references; answers at FastChat's per-category temperatures"
    assert run.data.tags["flowlm.mt_bench.protocol"] == protocol
    files = {a.path for a in client.list_artifacts(run.info.run_id, "mt_bench")}
    assert files == {"mt_bench/tiny_mdm.jsonl", f"mt_bench/{JUDGE}_single.jsonl"}


# (reply, FastChat's rating): its regexes, first match, read as a Python literal, no range check
RATINGS = [
    ("Good. Rating: [[7]]", 7),
    ("Rating: [[8.5]] and later [[2]]", 8.5),
    ("Rating: [6]", 6),  # one bracket dropped: FastChat's fallback
    ("Rating: [[7.]]", 7.0),
    ("[[ 9 ]]", UNPARSEABLE),  # no space inside the brackets
    ("[[ 9 ]] but [3] too", 3),  # ... so the fallback's first match
    ("The answer is wrong.", UNPARSEABLE),
    ("Rating: [[11]]", 11),
    ("Rating: [[0]]", 0),
    ("[[1.5.3]]", UNPARSEABLE),
]


@pytest.mark.parametrize(("reply", "rating"), RATINGS)
def test_the_rating_is_fastchats_parse(reply, rating):
    assert parse_rating(reply) == rating and type(parse_rating(reply)) is type(rating)


def test_a_rating_with_a_leading_zero_is_unrated():
    """ "[[07]]" is no Python literal: FastChat's judging stops with a SyntaxError; here it is unrated (−1)."""
    assert parse_rating("Rating: [[07]]") == UNPARSEABLE


def test_unrated_judgments_are_counted_and_left_out_of_the_means():
    rows = [
        {"score": 8.0, "turn": 1, "category": "a"},
        {"score": UNPARSEABLE, "turn": 2, "category": "a"},
        {"score": UNPARSEABLE, "turn": 2, "category": "b"},
    ]
    scores = aggregate(rows)
    assert scores["score"] == 8 and scores["turn_1"] == 8 and math.isnan(scores["turn_2"])
    assert scores["category/a"] == 8 and "category/b" not in scores
    assert scores["unparseable"] == 2 and scores["judged"] == 1


def test_the_judge_prompts_hold_the_question_the_answers_and_the_rating_form():
    q = Question(1, "math", ("Q one?", "Q two?"), ("R one", "R two"))
    name, (system, user) = judge_messages(q, ["A one", "A two"], 1)
    assert name == "flowlm-single-ref" and '"[[rating]]"' in user["content"]
    assert all(s in user["content"] for s in ("Q one?", "A one", "R one")) and "Q two?" not in user["content"]
    name, (system, user) = judge_messages(Question(1, "writing", ("Q one?", "Q two?")), ["A one", "A two"], 2)
    assert name == "flowlm-single-multi-turn" and "second user question" in system["content"]
    assert user["content"].index("Q one?") < user["content"].index("A one") < user["content"].index("A two")


# ------------------------------------------------------------------------------------------------ bad input
def test_a_missing_question_file_says_how_to_provide_it_before_the_checkpoint_is_read(tmp_path):
    cfg = config(tmp_path, "ckpt_path=/nonexistent/last.ckpt", "questions=/nonexistent/question.jsonl", "logger=none",
                 "judge.model=x")  # fmt: skip
    with pytest.raises(mt_bench.QuestionsUnavailable, match="question.jsonl") as err:
        mt_bench.run(cfg)
    assert "questions=lighteval/mt-bench" in str(err.value) and "huggingface-cli download" in str(err.value)


def test_an_uncached_dataset_offline_fails_at_once_with_the_ways(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(mt_bench.QuestionsUnavailable, match="FastChat's question file"):
        mt_bench.load_questions("lighteval/mt-bench")


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({"category": "a", "turns": ["x", "y"]}, "question_id"),
        ({"question_id": 1, "category": "a", "turns": ["x"]}, "2 user turns"),
        ({"question_id": 1, "category": "a", "turns": ["x", " "]}, "non-empty"),
        ({"question_id": 1, "turns": ["x", "y"]}, "category"),
    ],
)
def test_a_question_that_is_not_mt_bench_is_refused(record, match):
    with pytest.raises(QuestionError, match=match):
        parse_question(record, "q.jsonl: line 1")


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        (["step=judge_all"], ValueError, "step must be one of"),
        (["judge.model=null"], ValueError, "judge.model=NAME"),
        (["judge.model=x", "judge.base_url=localhost:8000"], ValueError, "http"),
        (["judge.model=x", "judge.retries=-1"], ValueError, "judge.retries"),
        (["judge.model=x", "generate.template=chatml"], ValueError, "generate.template"),
        (["judge.model=x", "judge.base_url=http://127.0.0.1:9/v1", "judge.retries=0"], mt_bench.JudgeError, "failed 1"),
    ],
)
def test_bad_settings_are_refused_before_the_checkpoint_is_read(tmp_path, questions, overrides, error, match):
    cfg = config(tmp_path, "ckpt_path=/nonexistent/last.ckpt", f"questions={questions}", "logger=none", *overrides)
    with pytest.raises(error, match=match):
        mt_bench.run(cfg)


def test_a_refusing_judge_is_not_retried_and_a_failing_one_gives_up(tmp_path, questions):
    write_answers(tmp_path)
    common = ["step=judge", "model_id=m", f"questions={questions}", "logger=none"]
    with JudgeServer(failures=99, status=401) as server:
        with pytest.raises(mt_bench.JudgeError, match="HTTP 401"):
            mt_bench.run(config(tmp_path, *common, *judged(server, "judge.parallel=1")))
    bodies = [json.dumps(p["body"]) for p in server.completions()]
    assert len(bodies) == len(set(bodies)) < 6  # none sent twice, the rest not sent (one may have started)
    with JudgeServer(failures=99, status=429) as server:
        with pytest.raises(mt_bench.JudgeError, match="failed 3 times; the last: HTTP 429"):
            mt_bench.run(config(tmp_path, *common, *judged(server, "judge.parallel=1", "judge.retries=2")))
    bodies = [json.dumps(p["body"]) for p in server.completions()]
    assert bodies.count(bodies[0]) == 3 and len(bodies) < 6 * 3  # 1 + 2 retries, then no more sent


def test_written_answers_are_not_replaced_without_overwrite(checkpoints, questions, tmp_path):
    write_answers(tmp_path, "tiny_mdm")
    cfg = config(tmp_path, f"ckpt_path={checkpoints['mdm']}", f"questions={questions}", "step=generate", *SMALL)
    with pytest.raises(FileExistsError, match="overwrite=true"):
        mt_bench.run(cfg)


def test_a_judge_model_the_endpoint_does_not_serve_is_refused_before_judging(tmp_path, questions):
    write_answers(tmp_path)
    with JudgeServer(failures=0) as server:
        cfg = config(tmp_path, "step=judge", "model_id=m", f"questions={questions}", "logger=none", *judged(server))
        cfg.judge.model = "gpt-5"
        with pytest.raises(mt_bench.JudgeError, match=f"does not serve judge.model='gpt-5'; it serves \\['{JUDGE}'\\]"):
            mt_bench.run(cfg)
    assert server.completions() == []


def test_the_suite_prompts_keep_references_by_position():
    """Question 133's shape (no turn-1 reference, a turn-2 one): turn 1 shows none, turn 2 its own; dropping the
    empty entry moved turn 2's reference to turn 1."""
    record = {"question_id": 133, "category": "extraction", "turns": ["T one?", "T two?"], "reference": ["", "R two"]}
    question = parse_question(record, "q.jsonl: line 1")
    assert question.reference == ("", "R two")
    name, (_, user) = judge_messages(question, ["A one", "A two"], 1)
    assert name == "flowlm-single" and "R two" not in user["content"]
    name, (_, user) = judge_messages(question, ["A one", "A two"], 2)
    assert name == "flowlm-single-ref-multi-turn" and "R two" in user["content"]
