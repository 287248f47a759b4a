"""The MT-Bench judge's reliability and its key (runners/mt_bench.py ``JudgeClient``, ``judge_answers``), against
judges served over real HTTP on loopback: judgments appended as they come and resumed, one request retrying while
the judge fails, no key in a repr, an error or a log line, none sent across a redirect to another host, no plain
HTTP to another machine without ``judge.allow_insecure_http``, no key variable by default for a non-OpenAI URL."""

from __future__ import annotations

import fcntl
import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from runners import mt_bench
from tests.conftest import compose_config
from tests.runners.test_mt_bench import JUDGE, QUESTIONS, JudgeServer, config, judged, write_answers

KEY = "sk-test-0123456789-do-not-show"
JUDGE_ONLY = ["step=judge", "model_id=m", "logger=none"]
JOBS = [(q["question_id"], turn) for q in QUESTIONS for turn in (1, 2)]  # question order, 6 judgments


@pytest.fixture
def questions(tmp_path) -> Path:
    path = tmp_path / "question.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return path


def judgment_file(tmp_path: Path) -> Path:
    return tmp_path / "out" / "model_judgment" / "m" / f"{JUDGE}_single.jsonl"


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def judged_jobs(posts: list[dict]) -> list[tuple[int, int]]:
    """(question_id, turn) of each completion request, read from the prompt it sent."""
    out = []
    for post in posts:
        system, user = (m["content"] for m in post["body"]["messages"])
        turn = 2 if "second user question" in system else 1
        out.append(next((q["question_id"], turn) for q in QUESTIONS if q["turns"][turn - 1] in user))
    return out


# ------------------------------------------------------------------------------------------------ judgments survive
@pytest.mark.parametrize("parallel", [1, 4])
def test_a_judge_that_dies_after_3_of_6_leaves_3_on_disk_and_a_rerun_pays_for_the_other_3(
    tmp_path, questions, parallel
):
    """Each judgment is on disk (flushed) as soon as it completes; a rerun sends only the missing ones."""
    write_answers(tmp_path)
    path = judgment_file(tmp_path)
    on_disk = lambda: len(path.read_text().splitlines()) if path.exists() else 0  # noqa: E731
    common = [*JUDGE_ONLY, f"questions={questions}", f"judge.parallel={parallel}", "judge.retries=1"]
    with JudgeServer(failures=0, status=500, rated_until=3, watch=on_disk) as server:
        with pytest.raises(mt_bench.JudgeError, match="HTTP 500"):
            mt_bench.run(config(tmp_path, *common, *judged(server)))
    assert server.rated == 3 and len(rows(path)) == 3  # every judgment paid for is kept, none other
    if parallel == 1:  # one at a time: each request finds every earlier judgment already in the file
        assert [p["seen"] for p in server.completions()[:3]] == [0, 1, 2]
    first = {(r["question_id"], r["turn"]) for r in rows(path)}

    with JudgeServer(failures=0) as server:
        result = mt_bench.run(config(tmp_path, *common, *judged(server)))
    sent = judged_jobs(server.completions())
    assert len(sent) == 3 and set(sent) == set(JOBS) - first  # only the missing three are paid for
    assert [(r["question_id"], r["turn"]) for r in rows(path)] == JOBS  # rewritten whole, in question order
    assert result["scores"]["judged"] == 5 and result["scores"]["unparseable"] == 1
    assert result["scores"]["turn_1"] == 7 and result["scores"]["turn_2"] == 4


def test_a_failing_judge_is_retried_by_one_request_while_the_others_wait(tmp_path, questions):
    """A judge that answers 500 to everything: the jobs in flight fail once each, then one request retries; every
    parallel job retrying on its own sent (1 + retries) × parallel requests and more."""
    write_answers(tmp_path)
    parallel, retries = 4, 2
    common = [*JUDGE_ONLY, f"questions={questions}", f"judge.parallel={parallel}", f"judge.retries={retries}"]
    with JudgeServer(failures=99, status=500) as server:
        with pytest.raises(mt_bench.JudgeError, match=f"failed {retries + 1} times; the last: HTTP 500"):
            mt_bench.run(config(tmp_path, *common, *judged(server)))
    assert 1 + retries <= len(server.completions()) <= parallel + retries
    assert rows(judgment_file(tmp_path)) == []


def test_the_waiting_requests_go_again_once_the_judge_recovers(tmp_path, questions):
    write_answers(tmp_path)
    common = [*JUDGE_ONLY, f"questions={questions}", "judge.parallel=4", "judge.retries=5"]
    with JudgeServer(failures=4, status=503) as server:
        result = mt_bench.run(config(tmp_path, *common, *judged(server)))
    assert len(server.completions()) == 6 + 4 and sorted(judged_jobs(server.completions()[4:])) == sorted(JOBS)
    assert [(r["question_id"], r["turn"]) for r in rows(judgment_file(tmp_path))] == JOBS
    assert result["scores"]["judged"] == 5


def test_a_line_cut_by_a_kill_is_judged_again_and_judgments_of_other_answers_are_refused(tmp_path, questions):
    write_answers(tmp_path)
    path = judgment_file(tmp_path)
    common = [*JUDGE_ONLY, f"questions={questions}"]
    with JudgeServer(failures=0) as server:
        mt_bench.run(config(tmp_path, *common, *judged(server)))
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:2]) + lines[2][:40])  # killed in the middle of the third line
    with JudgeServer(failures=0) as server:
        mt_bench.run(config(tmp_path, *common, *judged(server)))
    assert len(server.completions()) == 4 and [(r["question_id"], r["turn"]) for r in rows(path)] == JOBS

    answers = tmp_path / "out" / "model_answer" / "m.jsonl"
    answers.write_text(answers.read_text().replace("first 81", "another first answer"))  # regenerated answers
    with JudgeServer(failures=0) as server:
        with pytest.raises(ValueError, match=r"other answers .* \(question 81, turn 1.*overwrite=true"):
            mt_bench.run(config(tmp_path, *common, *judged(server)))
        assert server.completions() == []  # refused before any judgment is paid for
        mt_bench.run(config(tmp_path, *common, "overwrite=true", *judged(server)))
    assert len(server.completions()) == 6 and "another first answer" in rows(path)[0]["user_prompt"]


def test_a_second_process_judging_into_the_same_file_is_refused(tmp_path, questions):
    write_answers(tmp_path)
    path = judgment_file(tmp_path)
    path.parent.mkdir(parents=True)
    with path.open("a") as held, JudgeServer(failures=0) as server:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(mt_bench.JudgeError, match="another process is judging into"):
            mt_bench.run(config(tmp_path, *JUDGE_ONLY, f"questions={questions}", *judged(server)))
    assert server.completions() == []


# ------------------------------------------------------------------------------------------------ the key
class Loopback:
    """An HTTP server on ``host`` (loopback) whose ``reply(method, path, headers)`` gives (status, headers, body);
    every request is kept as (method, path, headers)."""

    def __init__(self, reply: Callable[[str, str, dict], tuple[int, dict, bytes]], host: str = "127.0.0.1") -> None:
        self.requests: list[tuple[str, str, dict]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _any(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                server.requests.append((self.command, self.path, dict(self.headers)))
                status, headers, body = reply(self.command, self.path, dict(self.headers))
                self.send_response(status)
                for name, value in {"Content-Length": str(len(body)), **headers}.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _any

        self.httpd = ThreadingHTTPServer((host, 0), Handler)
        self.port = self.httpd.server_port
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> Loopback:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


MODELS = json.dumps({"data": [{"id": JUDGE}]}).encode()


def client(url: str, **settings) -> mt_bench.JudgeClient:
    return mt_bench.JudgeClient(url, JUDGE, api_key=KEY, backoff_s=0.01, **settings)


def test_no_key_crosses_a_redirect_to_another_host(caplog):
    """127.0.0.1 redirects every request to localhost (another origin): neither the GET of /models nor the POST of
    the completions follows it, so the second server is never reached and never sees the key."""
    with Loopback(lambda *_: (200, {}, MODELS)) as other:
        target = f"http://localhost:{other.port}"
        with Loopback(lambda method, path, headers: (302, {"Location": target + path}, b"")) as first:
            judge = client(f"http://127.0.0.1:{first.port}/v1", retries=0)
            with pytest.raises(mt_bench.JudgeError, match=r"redirected \(302\) to http://localhost.*not followed"):
                judge.check()
            judge = client(f"http://127.0.0.1:{first.port}/v1", retries=0)
            with pytest.raises(mt_bench.JudgeError, match="a POST is not re-sent"):
                judge.complete([{"role": "user", "content": "rate this"}])
    assert other.requests == []
    assert [(m, p) for m, p, _ in first.requests] == [("GET", "/v1/models"), ("POST", "/v1/chat/completions")]
    assert KEY not in caplog.text


def test_a_post_is_not_resent_as_a_get_and_a_same_host_get_redirect_keeps_working():
    def reply(method, path, headers):
        if path == "/v1/models":
            return 301, {"Location": "/v1/models/"}, b""
        if path == "/v1/models/":
            return 200, {}, MODELS
        return 302, {"Location": "/v1/elsewhere"}, b""

    with Loopback(reply) as server:
        judge = client(f"http://127.0.0.1:{server.port}/v1", retries=0)
        judge.check()  # followed: the same scheme, host and port
        with pytest.raises(mt_bench.JudgeError, match="a POST is not re-sent"):
            judge.complete([{"role": "user", "content": "rate this"}])
    assert [(m, p) for m, p, _ in server.requests] == [
        ("GET", "/v1/models"), ("GET", "/v1/models/"), ("POST", "/v1/chat/completions")
    ]  # fmt: skip
    assert server.requests[1][2]["Authorization"] == f"Bearer {KEY}"


def test_the_key_is_in_no_repr_error_or_log_line(caplog):
    """A server that echoes the key it got (as some APIs do in a 401): the error shows a placeholder instead; the
    retries' warnings and the client's repr never hold it."""

    def reply(method, path, headers):
        status = 503 if len(server.requests) == 1 else 401
        return status, {}, f"bad key: {headers.get('Authorization')}".encode()

    with caplog.at_level(logging.WARNING), Loopback(reply) as server:
        judge = client(f"http://127.0.0.1:{server.port}/v1", retries=2)
        assert KEY not in repr(judge) and KEY not in str(judge) and judge.api_key == KEY
        with pytest.raises(mt_bench.JudgeError) as err:
            judge.complete([{"role": "user", "content": "rate this"}])
    assert "HTTP 401: bad key: Bearer [judge key]" in str(err.value) and KEY not in str(err.value)
    assert "retry 1/2" in caplog.text and KEY not in caplog.text
    assert len(server.requests) == 2 and all(h["Authorization"] == f"Bearer {KEY}" for _, _, h in server.requests)


@pytest.mark.parametrize(
    ("url", "insecure", "match"),
    [
        ("http://10.1.2.3:8000/v1", False, "plain HTTP to another machine.*judge.allow_insecure_http=true"),
        ("http://judge.example:8000/v1", False, "plain HTTP to another machine"),
        ("http://judge.example:8000/v1", "yes", "allow_insecure_http must be true or false"),
        ("https://user:secret@judge.example/v1", False, "must not hold a user or password"),
        ("http://judge.example:8000/v1", True, None),
        ("http://localhost:8000/v1", False, None),
        ("http://127.0.0.5:8000/v1", False, None),
        ("http://[::1]:8000/v1", False, None),
        ("https://judge.example/v1", False, None),
    ],
)
def test_plain_http_to_another_machine_needs_allow_insecure_http(tmp_path, monkeypatch, url, insecure, match):
    """Refused from the settings alone, before any connection (the opener fails the test if it is reached)."""
    monkeypatch.setattr(mt_bench._OPENER, "open", lambda *a, **k: pytest.fail("a request was sent"))
    cfg = compose_config("mt_bench", [f"judge.model={JUDGE}"])
    cfg.judge.base_url, cfg.judge.allow_insecure_http = url, insecure  # (Hydra's grammar has no "[::1]")
    if match is None:
        assert mt_bench.JudgeClient.from_config(cfg.judge).base_url == url.rstrip("/")
        return
    with pytest.raises(ValueError, match=match):
        mt_bench.JudgeClient.from_config(cfg.judge)


def test_an_insecure_url_is_refused_by_the_command_before_anything_is_read(tmp_path, questions, monkeypatch):
    monkeypatch.setattr(mt_bench._OPENER, "open", lambda *a, **k: pytest.fail("a request was sent"))
    cfg = config(tmp_path, "ckpt_path=/nonexistent/last.ckpt", f"questions={questions}", "logger=none",
                 f"judge.model={JUDGE}", "judge.base_url=http://judge.example:8000/v1")  # fmt: skip
    with pytest.raises(ValueError, match="judge.allow_insecure_http=true"):
        mt_bench.run(cfg)


def test_a_user_openai_key_is_not_sent_to_another_endpoint_by_default(monkeypatch, caplog):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    with caplog.at_level(logging.WARNING), JudgeServer(failures=0) as server:
        cfg = compose_config("mt_bench", judged(server))
        judge = mt_bench.JudgeClient.from_config(cfg.judge)
        judge.check()
        judge.complete([{"role": "user", "content": "rate this"}])
    assert judge.api_key is None and all("Authorization" not in r["headers"] for r in server.requests)
    assert "is not OpenAI's: $OPENAI_API_KEY is set but not sent; set judge.api_key_env=VARIABLE" in caplog.text
    openai = compose_config("mt_bench", ["judge.base_url=https://api.openai.com/v1", "judge.model=gpt-4o"])
    assert mt_bench.JudgeClient.from_config(openai.judge).api_key == KEY  # OpenAI's own endpoint: its variable
    named = compose_config("mt_bench", [*judged(server), "judge.api_key_env=OPENAI_API_KEY"])
    assert mt_bench.JudgeClient.from_config(named.judge).api_key == KEY  # named: sent wherever base_url points


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["judge.api_key_env=FLOWLM_TEST_UNSET_KEY"], r"judge.api_key_env=FLOWLM_TEST_UNSET_KEY, but \$FLOWLM_TEST"),
        (["judge.base_url=https://api.openai.com/v1"], r"judge.api_key_env=OPENAI_API_KEY, but \$OPENAI_API_KEY"),
        (["judge.api_key_env='bad name'"], "must name an environment variable"),
    ],
)
def test_a_key_variable_that_is_not_set_is_refused(monkeypatch, overrides, match):
    monkeypatch.delenv("FLOWLM_TEST_UNSET_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    cfg = compose_config("mt_bench", [f"judge.model={JUDGE}", *overrides])
    with pytest.raises(ValueError, match=match):
        mt_bench.JudgeClient.from_config(cfg.judge)
