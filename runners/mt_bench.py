"""`flowlm-mt-bench`: MT-Bench for any checkpoint (docs/evaluation.md#mt-bench; the prompts, ratings and scores are
flowlm/metrics/mt_bench.py's).

    flowlm-mt-bench fastchat_data=FastChat/fastchat/llm_judge/data ckpt_path=PATH judge.model=NAME
        [judge.base_url=http://HOST:PORT/v1] [step=generate|judge|all]

By default graded as FastChat grades (``load_grading``): its judge prompts, questions and GPT-4 references read from
its data folder (``fastchat_data``; none: one line saying how to get it, before any compute), answers at its
per-category temperatures through the sampler, ``model_id`` the answer file's name. ``judge_prompts=suite`` takes the
suite's own prompts, its scores labelled not comparable (printed, MLflow tags ``flowlm.mt_bench.*``).

- ``generate``: the checkpoint answers each question's two turns through the lm-evaluation-harness model
  (runners/lm_harness.py ``FlowLM``: any sampler of its family at an NFE budget, semi-AR blocks by ``semi_ar`` /
  ``block``), the second turn's prompt holding the first turn and the model's first answer, in the tokenizer's chat
  template or Vicuna's; written as FastChat's ``model_answer`` JSONL (``question_id``, ``answer_id``, ``model_id``,
  ``choices: [{index, turns}]``, ``tstamp``), each choice with the NFE its turns spent (``nfe``).
- ``judge``: single-answer grading by a judge model at an OpenAI-compatible ``/chat/completions`` endpoint
  (``JudgeClient``: transient failures retried with exponential backoff, one request at a time while the judge fails;
  the key never in a repr, a log line or an error, never sent across a redirect to another host, nor over plain HTTP
  to another machine without ``judge.allow_insecure_http``), judgments appended to FastChat's ``model_judgment``
  JSONL as they come (``JudgmentFile``: a relaunch judges only the missing ones), scores per turn and per category
  printed and logged to MLflow.
"""

from __future__ import annotations

import fcntl
import hashlib
import http.client
import ipaddress
import json
import logging
import os
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict

from flowlm.metrics.mt_bench import (
    JUDGE_PROMPTS,
    TEMPLATES,
    TURNS,
    FastChatDataError,  # noqa: F401 - raised by grading (no FastChat data folder), re-exported for callers
    Grading,
    Question,
    SuiteGrading,
    aggregate,
    answer_temperature,
    chat_renderer,  # noqa: F401 - the prompt layouts, re-exported here (FlowLM renders with it)
    check_questions,
    conversation,
    load_fastchat_data,
    map_question_ids,
    parse_question,
    parse_rating,
)
from flowlm.project import CONF_DIR
from flowlm.tasks.files import json_records, project_path
from runners.common import check_switches, resolve_paths
from runners.console import console_script
from runners.outputs import check_writable

log = logging.getLogger(__name__)

STEPS = ("generate", "judge", "all")
TEMPERATURES = ("fastchat", "sampler")  # generate.temperature: FastChat's per category | the sampler config's
TRANSIENT_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})
MAX_WAIT_S = 60.0
QUESTION_URL = "https://raw.githubusercontent.com/lm-sys/FastChat/main/fastchat/llm_judge/data/mt_bench/question.jsonl"
METRIC_PREFIX = "mt_bench/"


class QuestionsUnavailable(FileNotFoundError):
    """The question file or dataset is not on this machine (or not reachable); the message says how to provide it."""


class JudgeError(RuntimeError):
    """The judge endpoint refused a request, answered something that is not a chat completion, or kept failing."""


# ------------------------------------------------------------------------------------------------ questions
def load_questions(source: str, split: str = "train") -> list[Question]:
    """MT-Bench questions from a JSONL file (FastChat's ``question.jsonl``) or a Hugging Face dataset (name or a
    downloaded folder); offline, a source that is not here fails at once with the ways to provide it."""
    path = project_path(source)
    if path.is_file():
        with path.open("rb") as f:
            questions = [parse_question(r, f"{path}: line {n}") for n, r in json_records(f, path)]
    elif source.endswith((".json", ".jsonl")) or Path(source).is_absolute() or source.startswith("."):
        raise QuestionsUnavailable(_ways_to_provide(source, "no such file"))
    else:
        import datasets

        try:
            records = datasets.load_dataset(str(path) if path.is_dir() else source, split=split)
        except Exception as err:  # offline, unknown name, missing split: all need the same advice
            raise QuestionsUnavailable(_ways_to_provide(source, f"{type(err).__name__}: {err}")) from err
        questions = [parse_question(r, f"{source} [{split}] record {i}") for i, r in enumerate(records)]
    check_questions(questions, source)
    return questions


def _ways_to_provide(source: str, reason: str) -> str:
    return (
        f"MT-Bench questions {source!r} are not available ({reason}). Provide them one of these ways:\n"
        "  - FastChat's data folder (questions=null, the default: its mt_bench/question.jsonl): git clone "
        "https://github.com/lm-sys/FastChat and set fastchat_data=<clone>/fastchat/llm_judge/data;\n"
        f"  - FastChat's question file: download {QUESTION_URL} (on a machine with access) and set "
        "questions=/path/to/question.jsonl;\n"
        "  - a Hugging Face dataset: questions=lighteval/mt-bench (FastChat's fields) or "
        "questions=HuggingFaceH4/mt_bench_prompts, online, or offline (HF_DATASETS_OFFLINE=1) once loaded into the "
        "HF cache (the same HF_HOME);\n"
        "  - `huggingface-cli download lighteval/mt-bench --repo-type dataset --local-dir DIR` and set questions=DIR."
    )


def load_grading(cfg: DictConfig) -> tuple[Grading, list[Question]]:
    """How answers are put to the judge (``judge_prompts``: FastChat's prompts and GPT-4 references from its data
    folder ``fastchat_data``, or the suite's) and the questions (``questions``; null: FastChat's question file), a
    question FastChat knows by its turns given FastChat's id; refused before any compute where FastChat's data is
    needed and not there, or a reference question has no GPT-4 reference."""
    fastchat = None
    if cfg.judge_prompts == "fastchat" or cfg.fastchat_data or cfg.questions is None:
        fastchat = load_fastchat_data(cfg.fastchat_data)
    if cfg.questions is None:
        questions = fastchat[1]
    else:
        questions = load_questions(str(cfg.questions), str(cfg.split))
        if fastchat is not None:  # e.g. HuggingFaceH4/mt_bench_prompts' hash ids: FastChat's check_data refuses them
            questions, notes = map_question_ids(questions, fastchat[1])
            if notes:
                log.warning(
                    "mt_bench: %d question ids are not FastChat's and were mapped to the ids of FastChat's questions "
                    "with the same turns (its answers, judgments and references are keyed by them): %s",
                    len(notes),
                    ", ".join(notes[:5]) + (", ..." if len(notes) > 5 else ""),
                )
            check_questions(questions, str(cfg.questions))
    chosen = fastchat[0] if cfg.judge_prompts == "fastchat" else SuiteGrading()
    chosen.check(questions)
    return chosen, questions


def answered_at(questions: Sequence[Question], answers: dict[str, dict]) -> str:
    """How the answers were sampled, from their records' ``flowlm.temperature``: "fastchat" (each at FastChat's
    temperature for its category), "other", or "unrecorded" (answers another tool wrote)."""
    recorded = [(answers[str(q.question_id)].get("flowlm") or {}).get("temperature", ...) for q in questions]
    if any(t is ... for t in recorded):
        return "unrecorded"
    fastchat = all(t == answer_temperature(q.category) for q, t in zip(questions, recorded, strict=True))
    return "fastchat" if fastchat else "other"


def protocol_label(grading: Grading, temperature: str) -> str:
    """One line saying how the scores were made (``temperature``: ``answered_at``'s) and whether they stand beside
    FastChat's (published) ones."""
    judged = (
        "FastChat's judge prompts and GPT-4 references"
        if grading.comparable
        else "judge_prompts=suite, the suite's own judge prompts: NOT comparable to FastChat's (published) MT-Bench "
        "scores"
    )
    answered = {
        "fastchat": "answers at FastChat's per-category temperatures",
        "other": "answers not at FastChat's per-category temperatures (generate.temperature=sampler)",
        "unrecorded": "the answers' temperatures not recorded",
    }[temperature]
    return f"{judged}; {answered}"


# ------------------------------------------------------------------------------------------------ answers
# generate.* keys that are FlowLM's model arguments of the same name
PASSED_TO_FLOWLM = ("sampler", "nfe", "max_length", "tokenizer", "template", "system", "dtype", "trust_pickle")
PASSED_TO_FLOWLM += ("batch_size", "device")


def flowlm_model(cfg: DictConfig):
    """The checkpoint as runners/lm_harness.py's ``FlowLM`` with the ``generate`` settings (checked before the
    weights are read); ``gen_length`` null: half the row."""
    from lightning_modules.checkpoints import read_checkpoint_meta
    from runners.lm_harness import FlowLM

    gen = cfg.generate
    gen_length = gen.gen_length
    if gen_length is None:  # half the row answers, the other half holds the prompt (cut from the left)
        row = gen.max_length or read_checkpoint_meta(cfg.ckpt_path, trust_pickle=gen.trust_pickle).get("seq_len")
        gen_length = max(1, int(row) // 2) if isinstance(row, int) else None
    settings = OmegaConf.to_container(gen.sampler_options, resolve=True) if gen.sampler_options else {}
    options = {f"sampler.{k}": v for k, v in settings.items()}
    passed = {key: gen[key] for key in PASSED_TO_FLOWLM}
    return FlowLM(checkpoint=cfg.ckpt_path, gen_length=gen_length, seed=cfg.seed, **passed, **options)


def check_temperature_setting(cfg: DictConfig) -> None:
    """Refuse, before any compute, generate.temperature settings that cannot work: an unknown one, FastChat's
    per-category temperatures together with a temperature in sampler_options, or a sampler without a temperature."""
    from runners.lm_harness import sampler_config

    gen = cfg.generate
    if gen.temperature not in TEMPERATURES:
        raise ValueError(f"generate.temperature must be one of {TEMPERATURES}, got {gen.temperature!r}")
    if gen.temperature != "fastchat":
        return
    if "temperature" in (gen.sampler_options or {}):
        raise ValueError(
            f"generate.sampler_options.temperature={gen.sampler_options.temperature} and generate.temperature=fastchat "
            "(FastChat's per-category temperatures) both set it: drop one (generate.temperature=sampler keeps the "
            "sampler's, which is not FastChat's protocol)"
        )
    if gen.sampler is not None and "temperature" not in sampler_config(str(gen.sampler)):  # the defaults all have one
        raise ValueError(
            f"generate.temperature=fastchat sets FastChat's per-category temperatures through the sampler, but "
            f"conf/sampler/{gen.sampler}.yaml has no temperature: give a sampler with one, or generate.temperature="
            "sampler (not FastChat's protocol)"
        )


def temperature_groups(questions: Sequence[Question], rule: str) -> list[tuple[float | None, list[int]]]:
    """(temperature, question indices) in order of first appearance: FastChat's per category (``rule`` fastchat), or
    one group at the sampler's own (None)."""
    if rule != "fastchat":
        return [(None, list(range(len(questions))))]
    groups: dict[float, list[int]] = {}
    for i, question in enumerate(questions):
        groups.setdefault(answer_temperature(question.category), []).append(i)
    return list(groups.items())


def set_temperature(model, temperature: float) -> None:
    """The FlowLM model's sampler rebuilt at ``temperature`` (its other settings kept; 0: argmax, FastChat's greedy)."""
    from runners.common import build

    settings = {**model.sampler_settings, "temperature": float(temperature)}
    model.sampler, model.sampler_settings = build(OmegaConf.create(settings)), settings


def generate_answers(cfg: DictConfig, questions: Sequence[Question], model_id: str) -> list[dict]:
    """FastChat ``model_answer`` records: turn 1 of every question, then turn 2 given turn 1 and its answer; each
    question at FastChat's temperature for its category (``generate.temperature=fastchat``) or the sampler's."""
    model = flowlm_model(cfg)
    until = {"until": list(cfg.generate.stop or [])}
    records: list[dict | None] = [None] * len(questions)
    for temperature, indices in temperature_groups(questions, cfg.generate.temperature):
        if temperature is not None:
            set_temperature(model, temperature)
        group = [questions[i] for i in indices]
        answers, spent = _answer_turns(model, group, until)
        settings = model.summary()
        for i, a, n in zip(indices, answers, spent, strict=True):
            records[i] = answer_record(questions[i], model_id, a, n, settings)
        log.info(
            "mt_bench: %d questions answered at temperature %s",
            len(group),
            settings["sampler_settings"].get("temperature"),
        )
    return records


def _answer_turns(model, questions: Sequence[Question], until: dict) -> tuple[list[list[str]], list[list[int]]]:
    from lm_eval.api.instance import Instance

    answers: list[list[str]] = [[] for _ in questions]
    spent: list[list[int]] = [[] for _ in questions]
    for turn in range(1, TURNS + 1):
        contexts = [
            model.apply_chat_template(conversation(q.turns, a)) for q, a in zip(questions, answers, strict=True)
        ]
        requests = [Instance("generate_until", {}, (c, until), i) for i, c in enumerate(contexts)]
        texts = model.generate_until(requests)
        for a, s, text, nfe in zip(answers, spent, texts, model.nfe_spent[-len(texts) :], strict=True):
            a.append(text.strip())
            s.append(nfe)
        log.info("mt_bench: turn %d answered for %d questions", turn, len(questions))
    return answers, spent


def answer_record(question: Question, model_id: str, turns: list[str], nfe: list[int], settings: dict) -> dict:
    """One FastChat ``model_answer`` line; ``answer_id`` a digest of its content (the same answers, the same id)."""
    digest = hashlib.sha256(json.dumps([model_id, question.question_id, turns]).encode()).hexdigest()[:22]
    kept = {k: settings[k] for k in ("checkpoint", "family", "sampler", "nfe_budget", "gen_length")}
    return {
        "question_id": question.question_id,
        "answer_id": digest,
        "model_id": model_id,
        "choices": [{"index": 0, "turns": turns, "nfe": nfe}],
        "tstamp": time.time(),
        "flowlm": kept | {"temperature": settings["sampler_settings"].get("temperature")},
    }


def read_answers(path: Path, questions: Sequence[Question]) -> dict[str, dict]:
    """The answer records of ``path`` by question_id; every question must have one with two turns."""
    if not path.is_file():
        raise FileNotFoundError(f"no answer file {path}: run step=generate first (or give model_id / out_dir)")
    with path.open("rb") as f:
        records = {str(r.get("question_id")): r for _, r in json_records(f, path)}
    for q in questions:
        record = records.get(str(q.question_id))
        turns = ((record or {}).get("choices") or [{}])[0].get("turns")
        if not isinstance(turns, list) or len(turns) != TURNS:
            raise ValueError(f"{path}: question {q.question_id!r} has no answer with {TURNS} turns")
    return records


# ------------------------------------------------------------------------------------------------ the judge
OPENAI_HOST = "api.openai.com"
OPENAI_KEY_ENV = "OPENAI_API_KEY"  # the key variable only OpenAI's own endpoint gets without being named


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (a URL's host name) is this machine: ``localhost`` or a loopback address."""
    if not host:
        return False
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), parts.port or {"http": 80, "https": 443}.get(scheme)


class JudgeStopped(JudgeError):
    """A request not sent because the judging stopped (another request failed for good)."""


class _Transient(Exception):
    """A failure worth retrying (the reason, and the wait the server asked for)."""

    def __init__(self, reason: str, wait: float | None) -> None:
        super().__init__(reason)
        self.reason, self.wait = reason, wait


class _SameOriginRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only for a GET and only to the same scheme, host and port. urllib re-sends every header,
    ``Authorization`` included, to wherever ``Location`` points, and turns a redirected POST into a GET without its
    body: the judge's key reached another host and the completions were re-sent as GETs."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: D102 - urllib's hook
        method = req.get_method()
        if method != "GET" or _origin(newurl) != _origin(req.full_url):
            fp.close()
            why = "a POST is not re-sent" if method != "GET" else "another scheme, host or port"
            raise JudgeError(
                f"{req.full_url} redirected ({code}) to {newurl}: not followed ({why}; the key was not sent there). "
                "Set judge.base_url to the endpoint's own URL"
            )
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_OPENER = urllib.request.build_opener(_SameOriginRedirects)


class _Pace:
    """The retry state all requests of one client share. After a transient failure one request (the prober) waits
    the backoff and retries while the others wait for its answer; a success lets them all go again, and a failure
    beyond ``retries`` in a row, or any other error, stops every request not yet sent. Each job retrying on its own
    multiplied the requests to a failing judge by the jobs in flight (18 requests for 6 judgments)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._failures = 0  # transient failures in a row, over all requests
        self._prober: int | None = None  # the thread that retries next
        self._retry_at = 0.0
        self.stopped: BaseException | None = None  # the error that stopped the judging

    def enter(self) -> None:
        """Wait until this thread may send: at once while the judge answers, after the backoff for the prober,
        after the prober's answer for the others; JudgeStopped once stopped."""
        me = threading.get_ident()
        with self._cond:
            while True:
                if self.stopped is not None:
                    raise JudgeStopped(f"not sent: the judging stopped ({self.stopped})")
                if self._prober is None:
                    return
                if self._prober == me:
                    left = self._retry_at - time.monotonic()
                    if left <= 0:
                        return
                    self._cond.wait(left)
                else:
                    self._cond.wait()

    def succeeded(self) -> None:
        """The judge answered: every waiting request may go."""
        with self._cond:
            self._failures, self._prober = 0, None
            self._cond.notify_all()

    def failed(self, failure: _Transient, url: str, retries: int, backoff_s: float) -> None:
        """A transient failure: this thread retries after the backoff (unless another already does: then it waits
        for that one's answer), or, past ``retries`` failures in a row, the judging stops (JudgeError)."""
        me = threading.get_ident()
        with self._cond:
            if self._prober not in (None, me):  # sent before the judge began failing: the prober's answer decides
                return
            self._failures += 1
            if self._failures > retries:
                error = JudgeError(f"{url} failed {self._failures} times; the last: {failure.reason}")
                self.stop(error)
                raise error
            failures, wait = self._failures, failure.wait
            delay = min(MAX_WAIT_S, wait if wait is not None else backoff_s * 2 ** (failures - 1))
            self._prober, self._retry_at = me, time.monotonic() + delay
        log.warning("mt_bench: judge %s: %s; retry %d/%d in %.1f s", url, failure.reason, failures, retries, delay)

    def stop(self, error: BaseException) -> None:
        """Stop every request not yet sent (the first error is kept)."""
        with self._cond:
            if self.stopped is None:
                self.stopped = error
            self._cond.notify_all()


@dataclass(frozen=True)
class JudgeClient:
    """A judge model behind an OpenAI-compatible API (OpenAI, vLLM, SGLang, llama.cpp's server, ...); its key is
    never shown (repr, logs, errors)."""

    base_url: str
    model: str
    api_key: str | None = field(default=None, repr=False)
    temperature: float = 0.0
    max_tokens: int = 2048
    retries: int = 5
    backoff_s: float = 2.0
    timeout_s: float = 300.0
    _pace: _Pace = field(default_factory=_Pace, init=False, repr=False, compare=False)

    @classmethod
    def from_config(cls, judge: DictConfig) -> JudgeClient:
        """The client of conf/mt_bench.yaml's ``judge`` section, its settings checked (no plain HTTP to another
        machine without ``allow_insecure_http``); the key read from the variable ``api_key_env``."""
        url = str(judge.base_url or "")
        if not re.fullmatch(r"https?://[^/\s]+(/\S*)?", url):
            raise ValueError(f"judge.base_url must be an http(s) URL such as http://127.0.0.1:8000/v1, got {url!r}")
        parts = urllib.parse.urlsplit(url)
        if parts.username is not None or parts.password is not None:  # would be logged with the URL
            raise ValueError(
                "judge.base_url must not hold a user or password (user:pass@host): put the key in an environment "
                "variable and name it with judge.api_key_env"
            )
        insecure = judge.get("allow_insecure_http", False)
        if not isinstance(insecure, bool):
            raise ValueError(f"judge.allow_insecure_http must be true or false, got {insecure!r}")
        if parts.scheme == "http" and not is_loopback(parts.hostname) and not insecure:
            raise ValueError(
                f"judge.base_url={url} is plain HTTP to another machine: the prompts, judgments and any key would "
                "cross the network unencrypted. Use https://, or set judge.allow_insecure_http=true on a network "
                "you trust"
            )
        if not isinstance(judge.model, str) or not judge.model:
            raise ValueError("judging needs judge.model=NAME (the judge's model name at judge.base_url)")
        for key, low in (("retries", 0), ("max_tokens", 1), ("parallel", 1)):
            if isinstance(judge[key], bool) or not isinstance(judge[key], int) or judge[key] < low:
                raise ValueError(f"judge.{key} must be an integer ≥ {low}, got {judge[key]!r}")
        for key in ("backoff_s", "timeout_s", "temperature"):
            if isinstance(judge[key], bool) or not isinstance(judge[key], int | float) or judge[key] < 0:
                raise ValueError(f"judge.{key} must be a number ≥ 0, got {judge[key]!r}")
        return cls(
            url.rstrip("/"),
            judge.model,
            api_key=judge_key(judge.get("api_key_env"), url),
            temperature=float(judge.temperature),
            max_tokens=judge.max_tokens,
            retries=judge.retries,
            backoff_s=float(judge.backoff_s),
            timeout_s=float(judge.timeout_s),
        )

    def complete(self, messages: list[dict]) -> str:
        """The judge's reply to ``messages`` (temperature and max_tokens as configured)."""
        body = {"model": self.model, "messages": messages, "temperature": self.temperature}
        payload = self._request("chat/completions", body | {"max_tokens": self.max_tokens})
        try:
            return str(payload["choices"][0]["message"]["content"])
        except (KeyError, IndexError, TypeError):
            shown = self._redact(f"{payload!r:.300}")
            raise JudgeError(f"{self.base_url}/chat/completions answered no chat completion: {shown}") from None

    def check(self) -> None:
        """Before any compute: the endpoint answers ``/models`` and, where it lists them, serves ``model``."""
        listed = [m.get("id") for m in (self._request("models") or {}).get("data") or [] if isinstance(m, dict)]
        if listed and self.model not in listed:
            raise JudgeError(f"{self.base_url} does not serve judge.model={self.model!r}; it serves {listed}")

    def stop(self, error: BaseException) -> None:
        """Send nothing more: every request not yet sent raises JudgeStopped."""
        self._pace.stop(error)

    @property
    def stopped(self) -> BaseException | None:
        """The error that stopped the requests (None: not stopped)."""
        return self._pace.stopped

    def _request(self, route: str, body: dict | None = None) -> Any:
        """``route`` under the base URL (POST ``body`` as JSON, else GET); transient failures retried after
        backoff_s · 2^k seconds (or the server's Retry-After, at most MAX_WAIT_S), one request at a time while the
        judge fails (``_Pace``)."""
        url = f"{self.base_url}/{route}"
        data = None if body is None else json.dumps(body).encode()
        while True:
            self._pace.enter()
            try:
                payload = self._send(url, data)
            except _Transient as failure:
                self._pace.failed(failure, url, self.retries, self.backoff_s)
                continue
            except BaseException as err:
                self._pace.stop(err)
                raise
            self._pace.succeeded()
            return payload

    def _send(self, url: str, data: bytes | None) -> Any:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(url, data=data, headers=headers, method="GET" if data is None else "POST")
        try:
            with _OPENER.open(request, timeout=self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as err:
            detail = self._redact(err.read()[:300].decode(errors="replace"))
            if err.code in TRANSIENT_STATUS:
                raise _Transient(f"HTTP {err.code}", _retry_after(err.headers.get("Retry-After"))) from None
            hint = " (no key was sent: name its variable with judge.api_key_env)" if err.code in (401, 403) else ""
            raise JudgeError(f"{url} answered HTTP {err.code}: {detail}{'' if self.api_key else hint}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, http.client.IncompleteRead) as err:
            raise _Transient(f"{type(err).__name__}: {getattr(err, 'reason', err)}", None) from None
        try:
            return json.loads(raw)
        except json.JSONDecodeError as err:
            raise JudgeError(f"{url} answered something that is not JSON ({err})") from None

    def _redact(self, text: str) -> str:
        """``text`` without the key (a server may echo it in an error)."""
        return text.replace(self.api_key, "[judge key]") if self.api_key else text


def judge_key(api_key_env: str | None, base_url: str) -> str | None:
    """The judge's key: the value of the variable ``api_key_env``; unnamed, $OPENAI_API_KEY for OpenAI's endpoint
    only (another endpoint gets no key unless its variable is named). A named variable that is unset is an error."""
    name = api_key_env
    if name is None:
        if urllib.parse.urlsplit(base_url).hostname != OPENAI_HOST:
            state = f"${OPENAI_KEY_ENV} is set but not sent" if os.environ.get(OPENAI_KEY_ENV) else "no key sent"
            log.warning(
                "mt_bench: judge %s is not OpenAI's: %s; set judge.api_key_env=VARIABLE to send a key", base_url, state
            )
            return None
        name = OPENAI_KEY_ENV
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_]\w*", name):
        raise ValueError(f"judge.api_key_env must name an environment variable (or be null), got {name!r}")
    key = os.environ.get(name)
    if not key:
        raise ValueError(
            f"judge.api_key_env={name}, but ${name} is not set: export {name}=<key>, or judge.api_key_env=null to "
            "call a judge that needs no key"
        )
    return key


def _retry_after(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:  # an HTTP date: the backoff decides
        return None


# ------------------------------------------------------------------------------------------------ the judgments
JudgmentKey = tuple[str, int, str, tuple[str, ...]]  # (question_id, turn, model, judge: [judge model, prompt name])


@dataclass(frozen=True)
class JudgmentJob:
    """One judgment to make: its key (the judge prompt's name in it), the question and turn, and the messages the
    judge reads."""

    key: JudgmentKey
    question: Question
    turn: int
    messages: list[dict]


def judgment_jobs(
    client: JudgeClient, grading: Grading, questions: Sequence[Question], answers: dict[str, dict], model_id: str
) -> list[JudgmentJob]:
    """The judgments of ``answers`` (one per question and turn, in question order) and the prompts ``grading``
    sends."""
    jobs = []
    for question in questions:
        turns = answers[str(question.question_id)]["choices"][0]["turns"]
        for turn in range(1, TURNS + 1):
            prompt_name, messages = grading.messages(question, turns, turn)
            key = (str(question.question_id), turn, model_id, (client.model, prompt_name))
            jobs.append(JudgmentJob(key, question, turn, messages))
    return jobs


def judgment_key(record: dict) -> JudgmentKey:
    """The key of a FastChat ``model_judgment`` record: what it judged (question, turn, model) and how (judge)."""
    judge = record["judge"]
    if not isinstance(judge, list) or not all(isinstance(j, str) for j in judge):
        raise TypeError(f"judge must be a list of names, got {judge!r}")
    return str(record["question_id"]), int(record["turn"]), str(record["model"]), tuple(judge)


class JudgmentFile:
    """A judgment file kept open for appending, under an exclusive lock: each judgment is written as one line and
    flushed to disk as it comes, so a judge that dies, a kill or an interrupted run loses none already paid for, and
    a relaunch (``read``) judges only the missing ones. At the end the file is rewritten in question order."""

    def __init__(self, path: Path, fresh: bool) -> None:
        self.path, self.fresh = path, fresh
        self._lock = threading.Lock()
        self._file = None

    def __enter__(self) -> JudgmentFile:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a+b")
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise JudgeError(f"another process is judging into {self.path}: wait for it to end") from None
        if self.fresh:  # overwrite=true: the old judgments go once judging starts
            self._file.truncate(0)
        return self

    def __exit__(self, *exc) -> None:
        self._file.close()  # and the lock with it

    def read(self, jobs: Sequence[JudgmentJob]) -> dict[JudgmentKey, dict]:
        """The judgments already written, by key; a line cut by a kill is removed (it is judged again)."""
        self._file.seek(0)
        raw = self._file.read()
        records, end = parse_judgments(raw, self.path)
        if end < len(raw):
            log.warning("mt_bench: %s: its last line was cut (a killed run); it is judged again", self.path)
            self._file.truncate(end)
        elif raw and not raw.endswith(b"\n"):
            self._file.write(b"\n")
        check_judgments(records, jobs, self.path)
        return records

    def append(self, record: dict) -> None:
        """``record`` as one line at the end, flushed to disk before this returns."""
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        with self._lock:
            self._file.write(line)
            self._file.flush()
            os.fsync(self._file.fileno())

    def rewrite(self, records: Sequence[dict]) -> None:
        """The file replaced, at once, by ``records`` (every judgment is in it: none is lost)."""
        with self._lock:
            write_jsonl(self.path, records)


def parse_judgments(raw: bytes, path: Path) -> tuple[dict[JudgmentKey, dict], int]:
    """(the judgment records of a judgment file's bytes by key, the length of its whole lines): a last line without
    its newline that is not JSON was cut by a kill and is left out; any other line that is not a judgment is an
    error naming it."""
    records: dict[JudgmentKey, dict] = {}
    end, lines = len(raw), raw.split(b"\n")
    for num, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise TypeError(f"a JSON {type(record).__name__}")
            missing = [k for k in ("user_prompt", "score") if k not in record]
            if missing:
                raise KeyError(f"no {', '.join(missing)}")
            records[judgment_key(record)] = record
        except (ValueError, TypeError, KeyError) as err:
            if num == len(lines) and isinstance(err, json.JSONDecodeError):  # cut: no newline after it
                end = len(raw) - len(line)
                break
            raise ValueError(
                f"{path}: line {num} is not a judgment ({type(err).__name__}: {err}): repair or delete it, or give "
                "overwrite=true to judge every answer anew"
            ) from None
    return records, end


def check_judgments(records: dict[JudgmentKey, dict], jobs: Sequence[JudgmentJob], path: Path) -> None:
    """Refuse a judgment file that holds judgments of other answers, questions or judge prompts (resuming would mix
    them into the scores)."""
    prompts = {job.key: job.messages[-1]["content"] for job in jobs}
    for key, record in records.items():
        if prompts.get(key) != record["user_prompt"]:
            question_id, turn, model, judge = key
            raise ValueError(
                f"{path} holds a judgment of other answers or another judge setup (question {question_id}, turn "
                f"{turn}, model {model}, judge {list(judge)}): give overwrite=true to judge every answer anew, or "
                "another out_dir"
            )


def judge_answers(
    client: JudgeClient,
    grading: Grading,
    questions: Sequence[Question],
    answers: dict[str, dict],
    model_id: str,
    parallel: int,
    path: Path,
    overwrite: bool = False,
) -> list[dict]:
    """FastChat ``model_judgment`` records (single-answer grading), one per question and turn, in question order;
    each appended to ``path`` as it comes, those already there kept and not sent again (``overwrite``: all anew)."""
    jobs = judgment_jobs(client, grading, questions, answers, model_id)

    def grade(job: JudgmentJob) -> None:
        judgment = client.complete(job.messages)
        record = {
            "question_id": job.question.question_id,
            "model": model_id,
            "judge": list(job.key[3]),
            "user_prompt": job.messages[-1]["content"],
            "judgment": judgment,
            "score": parse_rating(judgment),
            "turn": job.turn,
            "category": job.question.category,
            "tstamp": time.time(),
        }
        file.append(record)
        done[job.key] = record

    with JudgmentFile(path, fresh=overwrite) as file:
        done = file.read(jobs)
        todo = [job for job in jobs if job.key not in done]
        if done:
            log.info("mt_bench: %d of %d judgments already in %s: judging %d", len(done), len(jobs), path, len(todo))
        with ThreadPoolExecutor(max_workers=parallel) as pool:
            futures = [pool.submit(grade, job) for job in todo]
            try:
                for future in as_completed(futures):
                    future.result()
            except BaseException as err:  # a judge that refuses or keeps failing: send nothing more
                client.stop(err)
                for f in futures:
                    f.cancel()
                raise (client.stopped if isinstance(err, JudgeStopped) else err) from None
        records = [done[job.key] for job in jobs]
        file.rewrite(records)
    return records


# ------------------------------------------------------------------------------------------------ the run
def outputs(cfg: DictConfig) -> tuple[str, Path, Path]:
    """(model_id, answer file, judgment file): ``<out_dir>/model_answer/<model_id>.jsonl`` and
    ``<out_dir>/model_judgment/<model_id>/<judge>_single.jsonl`` (FastChat's layout; one judgment file per model)."""
    model_id = cfg.model_id
    if not model_id:
        if not cfg.ckpt_path:
            raise ValueError("give ckpt_path=PATH (to generate) or model_id=NAME (to judge written answers)")
        from lightning_modules.checkpoints import read_checkpoint_meta

        meta = read_checkpoint_meta(cfg.ckpt_path, trust_pickle=cfg.generate.trust_pickle)
        model_id = (meta.get("config") or {}).get("name") or Path(str(cfg.ckpt_path)).stem
    # FastChat names a model by its answer file's name (load_model_answers): the records carry that name
    safe = re.sub(r"[^\w.-]", "_", str(model_id))
    if safe != str(model_id):
        log.warning(
            "mt_bench: model_id %r is written as %r, its answer file's name (FastChat's model name)", model_id, safe
        )
    judge = re.sub(r"[^\w.-]", "_", str(cfg.judge.model or "judge"))
    out = Path(cfg.out_dir)
    return safe, out / "model_answer" / f"{safe}.jsonl", out / "model_judgment" / safe / f"{judge}_single.jsonl"


def write_jsonl(path: Path, records: Sequence[dict]) -> None:
    """``records`` as JSON Lines at ``path``, written whole to a temporary file first (no half-written file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    tmp.replace(path)


def check_config(cfg: DictConfig) -> JudgeClient | None:
    """Refuse, before anything is built, an unknown step or template, or judge settings that cannot work."""
    if cfg.step not in STEPS:
        raise ValueError(f"step must be one of {STEPS}, got {cfg.step!r}")
    if cfg.generate.template not in TEMPLATES:
        raise ValueError(f"generate.template must be one of {TEMPLATES}, got {cfg.generate.template!r}")
    if cfg.judge_prompts not in JUDGE_PROMPTS:
        raise ValueError(f"judge_prompts must be one of {JUDGE_PROMPTS}, got {cfg.judge_prompts!r}")
    if cfg.step != "judge":
        check_temperature_setting(cfg)
    if cfg.step != "judge" and not cfg.ckpt_path:
        raise ValueError(f"step={cfg.step} generates answers: give ckpt_path=PATH")
    return None if cfg.step == "generate" else JudgeClient.from_config(cfg.judge)


def summary_table(scores: dict[str, float]) -> str:
    """The scores as a Markdown table (turns, both, categories, counts)."""
    return "| score | value |\n|---|---|\n" + "".join(f"| {k} | {v:.3f} |\n" for k, v in scores.items())


def run(cfg: DictConfig) -> dict:
    """Generate and/or judge (``cfg.step``): every input checked (questions, judge endpoint, output files) before
    the checkpoint is read; the answers' NFE and the scores logged to MLflow."""
    from runners.mlflow_run import tracked_run

    resolve_paths(cfg)
    check_switches(cfg, ("generate.trust_pickle", "overwrite"))  # "no" is a truthy string
    judge = check_config(cfg)
    grading, questions = load_grading(cfg)
    if judge is not None:
        judge.check()
    model_id, answer_path, judgment_path = outputs(cfg)
    # the folders this step writes (the judgment file is appended to in place), before any answer or judgment is made
    if cfg.step != "judge":
        check_writable("out_dir", answer_path.parent)
    if judge is not None:
        check_writable("out_dir", judgment_path.parent, files=[judgment_path])
    # step=judge resumes the judgment file; the other steps make new answers, which its judgments are not of
    written = [
        p for p, used in ((answer_path, cfg.step != "judge"), (judgment_path, cfg.step == "all")) if used and p.exists()
    ]
    if written and not cfg.overwrite:
        resume = " (or step=judge to judge the answers written, keeping the judgments made)" * (cfg.step == "all")
        raise FileExistsError(f"{', '.join(map(str, written))} exist: give overwrite=true to replace them{resume}")
    if cfg.step == "judge":
        answers = read_answers(answer_path, questions)  # every question answered, before the run is tracked
        if judgment_path.exists() and cfg.overwrite is not True:  # judgments of these answers, or refused now
            records, _ = parse_judgments(judgment_path.read_bytes(), judgment_path)
            check_judgments(records, judgment_jobs(judge, grading, questions, answers, model_id), judgment_path)
    with open_dict(cfg):
        cfg.model_id = model_id
        if cfg.get("logger") and cfg.logger.get("run_name") == f"{cfg.name}/{cfg.run_name}":
            cfg.logger.run_name = f"{cfg.name}/{model_id}/{cfg.run_name}"
    with tracked_run(cfg) as logger:
        result = _run_steps(cfg, grading, questions, model_id, answer_path, judgment_path, judge)
        if logger is not None:
            _log(logger, cfg, result, [answer_path] + ([judgment_path] if judge else []))
    return result | {"mlflow_run_id": getattr(logger, "run_id", None)}


def _run_steps(cfg, grading, questions, model_id, answer_path, judgment_path, judge) -> dict:
    if cfg.step != "judge":
        records = generate_answers(cfg, questions, model_id)
        write_jsonl(answer_path, records)
        print(f"answers written to {answer_path}", flush=True)
    answers = read_answers(answer_path, questions)
    spent = [n for q in questions for n in answers[str(q.question_id)]["choices"][0].get("nfe") or []]
    result: dict[str, Any] = {"model_id": model_id, "answers": str(answer_path), "judge_prompts": grading.name}
    label = protocol_label(grading, answered_at(questions, answers))
    result |= {"comparable": grading.comparable, "protocol": label}
    if spent:
        from runners.lm_harness import nfe_summary

        result["nfe"] = nfe_summary(spent)
    if judge is not None:
        overwrite = cfg.overwrite is True
        judgments = judge_answers(
            judge, grading, questions, answers, model_id, cfg.judge.parallel, judgment_path, overwrite
        )
        result |= {"judgments": str(judgment_path), "scores": aggregate(judgments)}
        print(
            f"\nMT-Bench, {model_id}, judged by {judge.model}: {result['protocol']}\n{summary_table(result['scores'])}",
            flush=True,
        )
        print(f"judgments written to {judgment_path}", flush=True)
    return result


def _log(logger, cfg: DictConfig, result: dict, files: list[Path]) -> None:
    """Params (the generation and judge settings, the key's variable name only), metrics ``mt_bench/...``, tags and
    the answer / judgment files as artifacts."""
    client, run_id = logger.experiment, logger.run_id
    keep = ("ckpt_path", "model_id", "questions", "fastchat_data", "judge_prompts", "step", "generate")
    params = {k: OmegaConf.to_container(cfg[k], resolve=True) if k == "generate" else cfg[k] for k in keep}
    params["judge"] = {k: cfg.judge[k] for k in ("base_url", "model", "api_key_env", "temperature", "max_tokens")}
    logger.log_hyperparams(params)
    metrics = {**result.get("nfe", {}), **result.get("scores", {})}
    metrics = {METRIC_PREFIX + re.sub(r"[^\w./ -]", "_", k): v for k, v in metrics.items() if v == v}  # no NaN
    if metrics:
        logger.log_metrics(metrics)
    client.set_tag(run_id, "flowlm.model_id", result["model_id"])
    # whether the scores stand beside FastChat's (published) ones, and the line saying how they were made
    client.set_tag(run_id, "flowlm.mt_bench.judge_prompts", result["judge_prompts"])
    client.set_tag(run_id, "flowlm.mt_bench.comparable", str(result["comparable"]).lower())
    client.set_tag(run_id, "flowlm.mt_bench.protocol", result["protocol"])
    if cfg.ckpt_path:
        client.set_tag(run_id, "flowlm.checkpoint", str(cfg.ckpt_path))
    for path in files:
        client.log_artifact(run_id, str(path), "mt_bench")


@console_script
@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="mt_bench")
def main(cfg: DictConfig) -> None:
    """Console entry point."""
    run(cfg)


if __name__ == "__main__":
    main()
