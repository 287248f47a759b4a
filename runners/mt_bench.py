"""`flowlm-mt-bench`: MT-Bench for any checkpoint (docs/evaluation.md#mt-bench; the prompts, ratings and scores are
flowlm/metrics/mt_bench.py's).

    flowlm-mt-bench ckpt_path=PATH judge.model=NAME [judge.base_url=http://HOST:PORT/v1] [step=generate|judge|all]

- ``generate``: the checkpoint answers each question's two turns through the lm-evaluation-harness model
  (runners/lm_harness.py ``FlowLM``: any sampler of its family at an NFE budget, semi-AR blocks by ``semi_ar`` /
  ``block``), the second turn's prompt holding the first turn and the model's first answer, in the tokenizer's chat
  template or Vicuna's; written as FastChat's ``model_answer`` JSONL (``question_id``, ``answer_id``, ``model_id``,
  ``choices: [{index, turns}]``, ``tstamp``), each choice with the NFE its turns spent (``nfe``).
- ``judge``: single-answer grading by a judge model at an OpenAI-compatible ``/chat/completions`` endpoint
  (``JudgeClient``: transient failures retried with exponential backoff), judgments written as FastChat's
  ``model_judgment`` JSONL, scores per turn and per category printed and logged to MLflow.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict

from flowlm.metrics.mt_bench import (
    TEMPLATES,
    TURNS,
    Question,
    aggregate,
    chat_renderer,  # noqa: F401 - the prompt layouts, re-exported here (FlowLM renders with it)
    check_questions,
    conversation,
    judge_messages,
    parse_question,
    parse_rating,
)
from flowlm.project import CONF_DIR
from flowlm.tasks.files import json_records, project_path
from runners.common import resolve_paths
from runners.console import console_script

log = logging.getLogger(__name__)

STEPS = ("generate", "judge", "all")
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
        f"  - FastChat's question file: download {QUESTION_URL} (on a machine with access) and set "
        "questions=/path/to/question.jsonl;\n"
        "  - a Hugging Face dataset: questions=lighteval/mt-bench (FastChat's fields) or "
        "questions=HuggingFaceH4/mt_bench_prompts, online, or offline (HF_DATASETS_OFFLINE=1) once loaded into the "
        "HF cache (the same HF_HOME);\n"
        "  - `huggingface-cli download lighteval/mt-bench --repo-type dataset --local-dir DIR` and set questions=DIR."
    )


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


def generate_answers(cfg: DictConfig, questions: Sequence[Question], model_id: str) -> list[dict]:
    """FastChat ``model_answer`` records: turn 1 of every question, then turn 2 given turn 1 and its answer."""
    from lm_eval.api.instance import Instance

    model = flowlm_model(cfg)
    until = {"until": list(cfg.generate.stop or [])}
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
    settings = model.summary()
    return [answer_record(q, model_id, a, s, settings) for q, a, s in zip(questions, answers, spent, strict=True)]


def answer_record(question: Question, model_id: str, turns: list[str], nfe: list[int], settings: dict) -> dict:
    """One FastChat ``model_answer`` line; ``answer_id`` a digest of its content (the same answers, the same id)."""
    digest = hashlib.sha256(json.dumps([model_id, question.question_id, turns]).encode()).hexdigest()[:22]
    return {
        "question_id": question.question_id,
        "answer_id": digest,
        "model_id": model_id,
        "choices": [{"index": 0, "turns": turns, "nfe": nfe}],
        "tstamp": time.time(),
        "flowlm": {k: settings[k] for k in ("checkpoint", "family", "sampler", "nfe_budget", "gen_length")},
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
@dataclass(frozen=True)
class JudgeClient:
    """A judge model behind an OpenAI-compatible API (OpenAI, vLLM, SGLang, llama.cpp's server, ...)."""

    base_url: str
    model: str
    api_key: str | None = None
    temperature: float = 0.0
    max_tokens: int = 2048
    retries: int = 5
    backoff_s: float = 2.0
    timeout_s: float = 300.0

    @classmethod
    def from_config(cls, judge: DictConfig) -> JudgeClient:
        """The client of conf/mt_bench.yaml's ``judge`` section, its settings checked; the key read from the
        environment variable ``api_key_env``."""
        if not re.fullmatch(r"https?://[^/\s]+(/\S*)?", str(judge.base_url or "")):
            raise ValueError(
                f"judge.base_url must be an http(s) URL such as http://127.0.0.1:8000/v1, got {judge.base_url!r}"
            )
        if not isinstance(judge.model, str) or not judge.model:
            raise ValueError("judging needs judge.model=NAME (the judge's model name at judge.base_url)")
        for key, low in (("retries", 0), ("max_tokens", 1), ("parallel", 1)):
            if isinstance(judge[key], bool) or not isinstance(judge[key], int) or judge[key] < low:
                raise ValueError(f"judge.{key} must be an integer ≥ {low}, got {judge[key]!r}")
        for key in ("backoff_s", "timeout_s", "temperature"):
            if isinstance(judge[key], bool) or not isinstance(judge[key], int | float) or judge[key] < 0:
                raise ValueError(f"judge.{key} must be a number ≥ 0, got {judge[key]!r}")
        key = os.environ.get(judge.api_key_env) if judge.api_key_env else None
        if key is None:
            log.warning("mt_bench: $%s is not set: the judge is called without an API key", judge.api_key_env)
        return cls(
            str(judge.base_url).rstrip("/"),
            judge.model,
            key or None,
            float(judge.temperature),
            judge.max_tokens,
            judge.retries,
            float(judge.backoff_s),
            float(judge.timeout_s),
        )

    def complete(self, messages: list[dict]) -> str:
        """The judge's reply to ``messages`` (temperature and max_tokens as configured)."""
        body = {"model": self.model, "messages": messages, "temperature": self.temperature}
        payload = self._request("chat/completions", body | {"max_tokens": self.max_tokens})
        try:
            return str(payload["choices"][0]["message"]["content"])
        except (KeyError, IndexError, TypeError):
            raise JudgeError(
                f"{self.base_url}/chat/completions answered no chat completion: {payload!r:.300}"
            ) from None

    def check(self) -> None:
        """Before any compute: the endpoint answers ``/models`` and, where it lists them, serves ``model``."""
        listed = [m.get("id") for m in (self._request("models") or {}).get("data") or [] if isinstance(m, dict)]
        if listed and self.model not in listed:
            raise JudgeError(f"{self.base_url} does not serve judge.model={self.model!r}; it serves {listed}")

    def _request(self, route: str, body: dict | None = None) -> Any:
        """``route`` under the base URL (POST ``body`` as JSON, else GET), transient failures retried after
        backoff_s · 2^k seconds (or the server's Retry-After), at most MAX_WAIT_S each."""
        url = f"{self.base_url}/{route}"
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        for attempt in range(self.retries + 1):
            request = urllib.request.Request(url, data=data, headers=headers, method="GET" if data is None else "POST")
            wait = None
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as err:
                detail = err.read()[:300].decode(errors="replace")
                if err.code not in TRANSIENT_STATUS:
                    raise JudgeError(f"{url} answered HTTP {err.code}: {detail}") from None
                reason, wait = f"HTTP {err.code}", _retry_after(err.headers.get("Retry-After"))
            except (urllib.error.URLError, ConnectionError, TimeoutError, http.client.IncompleteRead) as err:
                reason = f"{type(err).__name__}: {getattr(err, 'reason', err)}"
            except json.JSONDecodeError as err:
                raise JudgeError(f"{url} answered something that is not JSON ({err})") from None
            if attempt == self.retries:
                raise JudgeError(f"{url} failed {attempt + 1} times; the last: {reason}")
            delay = min(MAX_WAIT_S, wait if wait is not None else self.backoff_s * 2**attempt)
            log.warning("mt_bench: judge %s: %s; retry %d/%d in %.1f s", url, reason, attempt + 1, self.retries, delay)
            time.sleep(delay)
        raise AssertionError("unreachable")


def _retry_after(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:  # an HTTP date: the backoff decides
        return None


def judge_answers(
    client: JudgeClient, questions: Sequence[Question], answers: dict[str, dict], model_id: str, parallel: int
) -> list[dict]:
    """FastChat ``model_judgment`` records (single-answer grading), one per question and turn, in question order."""
    jobs = [(q, answers[str(q.question_id)]["choices"][0]["turns"], turn) for q in questions for turn in (1, 2)]

    def grade(job: tuple[Question, list[str], int]) -> dict:
        question, turns, turn = job
        prompt_name, messages = judge_messages(question, turns, turn)
        judgment = client.complete(messages)
        return {
            "question_id": question.question_id,
            "model": model_id,
            "judge": [client.model, prompt_name],
            "user_prompt": messages[-1]["content"],
            "judgment": judgment,
            "score": parse_rating(judgment),
            "turn": turn,
            "category": question.category,
            "tstamp": time.time(),
        }

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        futures = [pool.submit(grade, job) for job in jobs]
        try:
            return [f.result() for f in futures]
        except BaseException:  # a judge that refuses or keeps failing: send nothing more
            for f in futures:
                f.cancel()
            raise


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
    model_id = str(model_id)
    safe = re.sub(r"[^\w.-]", "_", model_id)
    judge = re.sub(r"[^\w.-]", "_", str(cfg.judge.model or "judge"))
    out = Path(cfg.out_dir)
    return model_id, out / "model_answer" / f"{safe}.jsonl", out / "model_judgment" / safe / f"{judge}_single.jsonl"


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
    judge = check_config(cfg)
    questions = load_questions(str(cfg.questions), str(cfg.split))
    if judge is not None:
        judge.check()
    model_id, answer_path, judgment_path = outputs(cfg)
    written = [
        p for p, used in ((answer_path, cfg.step != "judge"), (judgment_path, judge is not None)) if used and p.exists()
    ]
    if written and not cfg.overwrite:
        raise FileExistsError(f"{', '.join(map(str, written))} exist: give overwrite=true to replace them")
    if cfg.step == "judge":
        read_answers(answer_path, questions)  # every question answered, before the run is tracked
    with open_dict(cfg):
        cfg.model_id = model_id
        if cfg.get("logger") and cfg.logger.get("run_name") == f"{cfg.name}/{cfg.run_name}":
            cfg.logger.run_name = f"{cfg.name}/{model_id}/{cfg.run_name}"
    with tracked_run(cfg) as logger:
        result = _run_steps(cfg, questions, model_id, answer_path, judgment_path, judge)
        if logger is not None:
            _log(logger, cfg, result, [answer_path] + ([judgment_path] if judge else []))
    return result | {"mlflow_run_id": getattr(logger, "run_id", None)}


def _run_steps(cfg, questions, model_id, answer_path, judgment_path, judge) -> dict:
    if cfg.step != "judge":
        records = generate_answers(cfg, questions, model_id)
        write_jsonl(answer_path, records)
        print(f"answers written to {answer_path}", flush=True)
    answers = read_answers(answer_path, questions)
    spent = [n for q in questions for n in answers[str(q.question_id)]["choices"][0].get("nfe") or []]
    result: dict[str, Any] = {"model_id": model_id, "answers": str(answer_path)}
    if spent:
        from runners.lm_harness import nfe_summary

        result["nfe"] = nfe_summary(spent)
    if judge is not None:
        judgments = judge_answers(judge, questions, answers, model_id, cfg.judge.parallel)
        write_jsonl(judgment_path, judgments)
        result |= {"judgments": str(judgment_path), "scores": aggregate(judgments)}
        print(f"\nMT-Bench, {model_id}, judged by {judge.model}\n{summary_table(result['scores'])}", flush=True)
        print(f"judgments written to {judgment_path}", flush=True)
    return result


def _log(logger, cfg: DictConfig, result: dict, files: list[Path]) -> None:
    """Params (the generation and judge settings, the key's variable name only), metrics ``mt_bench/...``, tags and
    the answer / judgment files as artifacts."""
    client, run_id = logger.experiment, logger.run_id
    keep = ("ckpt_path", "model_id", "questions", "step", "generate")
    params = {k: OmegaConf.to_container(cfg[k], resolve=True) if k == "generate" else cfg[k] for k in keep}
    params["judge"] = {k: cfg.judge[k] for k in ("base_url", "model", "api_key_env", "temperature", "max_tokens")}
    logger.log_hyperparams(params)
    metrics = {**result.get("nfe", {}), **result.get("scores", {})}
    metrics = {METRIC_PREFIX + re.sub(r"[^\w./ -]", "_", k): v for k, v in metrics.items() if v == v}  # no NaN
    if metrics:
        logger.log_metrics(metrics)
    client.set_tag(run_id, "flowlm.model_id", result["model_id"])
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
