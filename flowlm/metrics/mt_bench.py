"""MT-Bench (Zheng et al. 2023, arXiv 2306.05685): its question records, the chat prompts the model answers, the
single-answer grading prompts a judge model reads, the rating read back from the judge and the scores aggregated.

Pure Python: runners/mt_bench.py generates the answers with a checkpoint and talks to the judge over HTTP. The chat
layouts (``chat_renderer``: the tokenizer's template or Vicuna's) are also the lm-eval model's
(runners/lm_harness.py, ``--apply_chat_template``).

- A question is FastChat's ``question.jsonl`` record: ``question_id``, ``category``, ``turns`` (two user turns),
  optionally ``reference`` (short answers per turn, kept by position); the Hugging Face copy
  ``HuggingFaceH4/mt_bench_prompts`` names them ``prompt_id`` and ``prompt``, which are read as well.
- Grading as FastChat grades (``FastChatGrading``, the default): the judge prompts, questions and GPT-4 references
  of FastChat's data folder (``fastchat/llm_judge/data`` of its repository, ``load_fastchat_data``), the prompt chosen
  by FastChat's names (``single-v1``, ``single-math-v1`` and their ``-multi-turn`` variants for turn 2), the GPT-4
  reference shown for the categories FastChat gives one (math, reasoning, coding) and no other; answers generated at
  FastChat's per-category temperatures (``answer_temperature``). The suite's own wording (``SuiteGrading``, a named
  option) shows the question file's short ``reference`` instead: its scores are not comparable to FastChat's.
- Single-answer grading (FastChat's ``single`` mode): turn 1 is graded from the question and the first answer; turn 2
  from the whole conversation, the judge told to rate the second answer. The rating is FastChat's parse
  (``parse_rating``); a reply without one is scored −1 and counted, as FastChat does, and left out of every mean.
- Scores: the mean per turn, over both turns (FastChat's ``show_result``), and per category over both turns.
"""

from __future__ import annotations

import ast
import math
import re
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowlm.tasks.files import json_records

TURNS = 2  # MT-Bench questions have two user turns
UNPARSEABLE = -1  # FastChat's score of a judgment without a rating (an int, as FastChat writes it)
TEMPLATES = ("auto", "tokenizer", "vicuna")  # the chat layouts of ``template_kind``
# FastChat's rating parse (fastchat/llm_judge/common.py): "[[r]]", else "[r]" (a judge that drops one bracket); the
# first match anywhere in the reply, no space inside the brackets, r digits with at most one point; no range check.
_RATING = (re.compile(r"\[\[(\d+\.?\d*)\]\]"), re.compile(r"\[(\d+\.?\d*)\]"))
VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)


class QuestionError(ValueError):
    """A question record is not an MT-Bench question; the message names the record and the field."""


@dataclass(frozen=True)
class Question:
    """One MT-Bench question: its id, category, user turns and reference answers (empty: none)."""

    question_id: int | str
    category: str
    turns: tuple[str, ...]
    reference: tuple[str, ...] = field(default=())


def parse_question(record: Mapping[str, Any], where: str) -> Question:
    """A ``Question`` from a FastChat (``question_id``, ``turns``) or Hugging Face (``prompt_id``, ``prompt``) record;
    ``where`` names the record in errors."""
    qid = record.get("question_id", record.get("prompt_id"))
    turns = record.get("turns", record.get("prompt"))
    if qid is None or isinstance(qid, bool) or not isinstance(qid, int | str):
        raise QuestionError(f"{where}: needs a question_id (an integer or a string), got {qid!r}")
    if not isinstance(turns, list | tuple) or len(turns) != TURNS:
        raise QuestionError(f"{where}: turns must be a list of {TURNS} user turns, got {turns!r}")
    if not all(isinstance(t, str) and t.strip() for t in turns):
        raise QuestionError(f"{where}: every turn must be a non-empty string, got {turns!r}")
    category = record.get("category")
    if not isinstance(category, str) or not category:
        raise QuestionError(f"{where}: needs a category (a non-empty string), got {category!r}")
    reference = record.get("reference") or ()
    if isinstance(reference, str) or not all(isinstance(r, str) for r in reference):
        raise QuestionError(f"{where}: reference must be a list of strings, got {reference!r}")
    # by position: question 133's first entry is empty and its second is turn 2's (dropping it shifted turn 2's to 1)
    return Question(qid, category, tuple(turns), tuple(reference))


def check_questions(questions: Sequence[Question], source: str) -> None:
    """Refuse an empty question set or a repeated question_id (answers and judgments are matched by it)."""
    if not questions:
        raise QuestionError(f"{source} holds no questions")
    seen: set[str] = set()
    for q in questions:
        if str(q.question_id) in seen:
            raise QuestionError(f"{source}: question_id {q.question_id!r} appears twice")
        seen.add(str(q.question_id))


# ------------------------------------------------------------------------------------------------ the model's prompt
def conversation(turns: Sequence[str], answers: Sequence[str]) -> list[dict[str, str]]:
    """Chat messages for the next answer: user turn k, then the model's answer k, for k < len(answers), then the
    next user turn (the second turn's prompt holds the first turn and the model's first answer)."""
    if len(answers) >= len(turns):
        raise ValueError(f"{len(answers)} answers leave no turn to answer of {len(turns)}")
    messages = []
    for k, answer in enumerate(answers):
        messages += [{"role": "user", "content": turns[k]}, {"role": "assistant", "content": answer}]
    return messages + [{"role": "user", "content": turns[len(answers)]}]


def vicuna_prompt(
    messages: Sequence[Mapping[str, str]], system: str = VICUNA_SYSTEM, eos: str = "</s>", open_end: bool = False
) -> str:
    """The Vicuna v1.1 chat layout (FastChat's MT-Bench default, SMDM's and MLFM's prompt):
    ``SYSTEM USER: q₁ ASSISTANT: a₁<eos>USER: q₂ ASSISTANT:``, open for the assistant's next answer. A ``system``
    message replaces ``system``; ``open_end``: a final assistant message is left open (no EOS), to be continued."""
    system = next((m["content"] for m in messages if m["role"] == "system"), system)
    turns = [m for m in messages if m["role"] != "system"]
    text = f"{system} " if system else ""
    for k, message in enumerate(turns):
        if message["role"] == "user":
            text += f"USER: {message['content']} ASSISTANT:"
        else:
            text += f" {message['content']}" + ("" if open_end and k == len(turns) - 1 else eos)
    return text


def template_kind(tokenizer, template: str) -> str:
    """The chat layout ``template`` (auto | tokenizer | vicuna) selects: the tokenizer's own template ("tokenizer";
    auto: where it has one) or Vicuna's ("vicuna"); template=tokenizer without one is a ValueError."""
    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {TEMPLATES}, got {template!r}")
    has_own = bool(getattr(tokenizer, "chat_template", None))
    if template == "tokenizer" and not has_own:
        raise ValueError("template=tokenizer, but the tokenizer has no chat template: use template=vicuna (or auto)")
    return "tokenizer" if template != "vicuna" and has_own else "vicuna"


def chat_renderer(tokenizer, template: str, system: str | None, drop_bos: bool) -> Callable[..., str]:
    """(messages, add_generation_prompt=True) → the model's prompt, in the layout ``template_kind`` selects; Vicuna's
    system prompt ``system`` (None: FastChat's). A BOS the tokenizer's template writes is dropped when the row adds
    its own (``drop_bos``). add_generation_prompt=False continues a final assistant message (lm-eval's prefill); a
    template that refuses a system message renders without it, as lm-eval's HF model does."""
    if template_kind(tokenizer, template) == "vicuna":
        eos, system = tokenizer.eos_token or "</s>", VICUNA_SYSTEM if system is None else system
        return lambda messages, add_generation_prompt=True: vicuna_prompt(
            messages, system, eos, open_end=not add_generation_prompt
        )
    from jinja2.exceptions import TemplateError

    bos = tokenizer.bos_token if drop_bos else None

    def render(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        options = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
        options["continue_final_message"] = not add_generation_prompt
        try:
            text = tokenizer.apply_chat_template(list(messages), **options)
        except TemplateError:
            warnings.warn("the chat template refused the messages: rendered without the system message", stacklevel=2)
            text = tokenizer.apply_chat_template([m for m in messages if m["role"] != "system"], **options)
        return text[len(bos) :] if bos and text.startswith(bos) else text

    return render


# ------------------------------------------------------------------------------------------------ the judge's prompt
_CRITERIA = (
    "Weigh how helpful, relevant, accurate, deep, creative and detailed it is. Start with a short explanation and be "
    "as objective as you can. After the explanation, give a rating from 1 to 10 written strictly in the form "
    '"[[rating]]", for example "Rating: [[5]]".'
)
_WITH_REFERENCE = " Compare it with the reference answer, and name and correct any mistake it makes."
JUDGE_SYSTEM = "You are a helpful assistant."


def judge_messages(question: Question, answers: Sequence[str], turn: int) -> tuple[str, list[dict[str, str]]]:
    """(prompt name, messages) asking the judge to grade answer ``turn`` (1 or 2) to ``question``: turn 1 from the
    question and the answer; turn 2 from the conversation, the judge told to grade the second answer only. A
    reference answer for the turn, where the question has one, is shown beside the answer."""
    _check_turn(question, answers, turn)
    # the turn's own entry decides (an empty one: none for that turn); turn 2 shows the entries of both turns
    shown = len(question.reference) >= turn and bool(question.reference[turn - 1].strip())
    ref = question.reference[:turn] if shown else ()
    extra = _WITH_REFERENCE if ref else ""
    if turn == 1:
        reference = f"[The Start of Reference Answer]\n{ref[0]}\n[The End of Reference Answer]\n\n" if ref else ""
        user = (
            "[Instruction]\nAct as an impartial judge of the response an AI assistant gave to the user question "
            f"below. {_CRITERIA}{extra}\n\n[Question]\n{question.turns[0]}\n\n{reference}"
            f"[The Start of Assistant's Answer]\n{answers[0]}\n[The End of Assistant's Answer]"
        )
        system = JUDGE_SYSTEM
    else:
        system = (
            "Act as an impartial judge of the answers an AI assistant gave in the conversation below. Grade only its "
            f"answer to the second user question. {_CRITERIA}{extra}"
        )
        user = ""
        if ref:
            user = _dialogue("Reference Answer", question.turns, ref, "Reference answer") + "\n\n\n"
        user += _dialogue("Assistant A's Conversation with User", question.turns, answers[:2], "Assistant A")
    name = f"flowlm-single{'-ref' if ref else ''}{'-multi-turn' if turn == 2 else ''}"
    return name, [{"role": "system", "content": system}, {"role": "user", "content": user}]


def _dialogue(title: str, turns: Sequence[str], answers: Sequence[str], speaker: str) -> str:
    body = "".join(f"### User:\n{q}\n\n### {speaker}:\n{a}\n\n" for q, a in zip(turns, answers, strict=True))
    return f"<|The Start of {title}|>\n\n{body}<|The End of {title}|>"


# ------------------------------------------------------------------------------------------------ FastChat's grading
JUDGE_PROMPTS = ("fastchat", "suite")  # FastChat's prompts and references (the default) | the suite's wording
# FastChat's categories graded against a GPT-4 reference answer (its NEED_REF_CATS); every other category without one
NEEDS_REFERENCE = frozenset({"math", "reasoning", "coding", "arena-hard-200"})
# FastChat's answer temperatures by category (gen_model_answer.py, common.py's temperature_config); others: 0.7
ANSWER_TEMPERATURES = {
    "writing": 0.7, "roleplay": 0.7, "extraction": 0.0, "math": 0.0, "coding": 0.0, "reasoning": 0.0,
    "stem": 0.1, "humanities": 0.1, "arena-hard-200": 0.0,
}  # fmt: skip
OTHER_TEMPERATURE = 0.7
# FastChat's data folder (fastchat/llm_judge/data of its repository): what each file holds → its path in the folder
FASTCHAT_FILES = {
    "judge prompts": "judge_prompts.jsonl",
    "questions": "mt_bench/question.jsonl",
    "GPT-4 reference answers": "mt_bench/reference_answer/gpt-4.jsonl",
}
FASTCHAT_HOWTO = (
    "git clone https://github.com/lm-sys/FastChat and set fastchat_data=<clone>/fastchat/llm_judge/data (the fschat "
    "pip package does not ship these files)"
)
# the fields each single-answer prompt is formatted with (FastChat's names), without and with a reference
_TURN_FIELDS = {1: ("question", "answer"), 2: ("question_1", "question_2", "answer_1", "answer_2")}
_REFERENCE_FIELDS = {1: ("ref_answer_1",), 2: ("ref_answer_1", "ref_answer_2")}


class FastChatDataError(FileNotFoundError):
    """FastChat's data folder is not given, lacks a file, or holds a file that is not FastChat's; the message says
    which and how to get it."""


def answer_temperature(category: str) -> float:
    """The temperature FastChat answers a question of ``category`` at (0: greedy)."""
    return ANSWER_TEMPERATURES.get(category, OTHER_TEMPERATURE)


def fastchat_prompt_name(category: str, turn: int) -> str:
    """FastChat's single-answer judge prompt for ``category`` and ``turn``: ``single-math-v1`` for the reference
    categories, ``single-v1`` for the others, ``-multi-turn`` added for turn 2."""
    return ("single-math-v1" if category in NEEDS_REFERENCE else "single-v1") + ("-multi-turn" if turn == 2 else "")


@dataclass(frozen=True)
class JudgePrompt:
    """One of FastChat's judge prompts: its name, system prompt and user-prompt template (``str.format`` fields)."""

    name: str
    system: str
    template: str


class Grading(ABC):
    """How an answer turn is put to the judge (its prompts and references); ``comparable``: the scores stand beside
    FastChat's (published MT-Bench scores)."""

    name: str
    comparable: bool

    @abstractmethod
    def messages(self, question: Question, answers: Sequence[str], turn: int) -> tuple[str, list[dict[str, str]]]:
        """(prompt name, chat messages) asking the judge to grade answer ``turn`` (1 or 2) of ``answers``."""

    def check(self, questions: Sequence[Question]) -> None:  # noqa: B027 - every question is gradable by default
        """Refuse, before any compute, questions this judge cannot grade."""


class FastChatGrading(Grading):
    """FastChat's single-answer grading: its prompt per category and turn (``fastchat_prompt_name``), formatted with
    the question(s) and answer(s), and GPT-4's reference answer(s) by position for the reference categories only;
    the messages are FastChat's OpenAI ones (its system prompt, where not empty, then the user prompt)."""

    name, comparable = "fastchat", True

    def __init__(self, prompts: Mapping[str, JudgePrompt], references: Mapping[str, tuple[str, ...]]) -> None:
        self.prompts, self.references = dict(prompts), dict(references)

    def messages(self, question: Question, answers: Sequence[str], turn: int) -> tuple[str, list[dict[str, str]]]:
        """(FastChat's prompt name, messages) for answer ``turn`` of ``answers`` to ``question``."""
        _check_turn(question, answers, turn)
        name = fastchat_prompt_name(question.category, turn)
        prompt = self.prompts[name]
        values = (question.turns[0], answers[0]) if turn == 1 else (*question.turns[:2], *answers[:2])
        fields = dict(zip(_TURN_FIELDS[turn], values, strict=True))
        if question.category in NEEDS_REFERENCE:
            fields |= dict(zip(_REFERENCE_FIELDS[turn], self._reference(question)[:turn], strict=True))
        system = [{"role": "system", "content": prompt.system}] if prompt.system else []
        return name, [*system, {"role": "user", "content": prompt.template.format(**fields)}]

    def check(self, questions: Sequence[Question]) -> None:
        """Every question of a reference category has GPT-4's reference for both turns (FastChat's check_data)."""
        for question in questions:
            if question.category in NEEDS_REFERENCE:
                self._reference(question)

    def _reference(self, question: Question) -> tuple[str, ...]:
        reference = self.references.get(str(question.question_id), ())
        if len(reference) < TURNS:
            raise QuestionError(
                f"question {question.question_id!r} ({question.category}) has no GPT-4 reference answer for its "
                f"{TURNS} turns in FastChat's {FASTCHAT_FILES['GPT-4 reference answers']}: FastChat grades "
                f"{', '.join(sorted(NEEDS_REFERENCE))} questions against it; use FastChat's question ids "
                "(its mt_bench/question.jsonl)"
            )
        return reference


class SuiteGrading(Grading):
    """The suite's own wording of single-answer grading (``judge_messages``, prompts named ``flowlm-single…``), the
    question file's short ``reference`` shown: a named option whose scores are not comparable to FastChat's."""

    name, comparable = "suite", False

    def messages(self, question: Question, answers: Sequence[str], turn: int) -> tuple[str, list[dict[str, str]]]:
        """(the suite's prompt name, messages) for answer ``turn`` of ``answers`` to ``question``."""
        return judge_messages(question, answers, turn)


def fastchat_files(root: str | Path | None) -> dict[str, Path]:
    """The paths of FastChat's judge prompts, questions and GPT-4 references in its data folder ``root``;
    FastChatDataError naming what is missing and how to get it."""
    if root is None or not str(root).strip():
        raise FastChatDataError(
            "MT-Bench is graded as FastChat grades, from FastChat's data folder, and fastchat_data is not set: "
            f"{FASTCHAT_HOWTO}; or judge_prompts=suite with questions=FILE_OR_DATASET (scores not comparable)"
        )
    files = {what: Path(root) / name for what, name in FASTCHAT_FILES.items()}
    missing = [f"{what} ({FASTCHAT_FILES[what]})" for what, path in files.items() if not path.is_file()]
    if missing:
        raise FastChatDataError(
            f"fastchat_data={root} is not FastChat's data folder: it lacks the {', '.join(missing)}; {FASTCHAT_HOWTO}"
        )
    return files


def load_fastchat_data(root: str | Path | None) -> tuple[FastChatGrading, list[Question]]:
    """FastChat's grading (its four single-answer prompts, GPT-4's reference answers by question id) and its
    questions, read from its data folder ``root``; every record checked."""
    files = fastchat_files(root)
    prompts: dict[str, JudgePrompt] = {}
    path = files["judge prompts"]
    with path.open("rb") as f:
        for num, record in json_records(f, path):
            if isinstance(record.get("name"), str) and record["name"].startswith("single"):
                prompts[record["name"]] = _judge_prompt(record, f"{path}: line {num}")
    names = [fastchat_prompt_name(c, t) for c in ("math", "writing") for t in (1, 2)]
    missing = [n for n in names if n not in prompts]
    if missing:
        raise FastChatDataError(f"{path} lacks FastChat's judge prompts {missing}: {FASTCHAT_HOWTO}")
    for name in names:  # each formats with the fields it is given (a wrong file fails here, not mid-judging)
        turn = 2 if name.endswith("multi-turn") else 1
        fields = _TURN_FIELDS[turn] + (_REFERENCE_FIELDS[turn] if name.startswith("single-math") else ())
        try:
            prompts[name].template.format(**dict.fromkeys(fields, ""))
        except (KeyError, IndexError, ValueError) as err:
            raise FastChatDataError(f"{path}: prompt {name!r} does not format with {fields}: {err!r}") from None
    path = files["GPT-4 reference answers"]
    with path.open("rb") as f:
        references = {
            str(r.get("question_id")): _reference_turns(r, f"{path}: line {n}") for n, r in json_records(f, path)
        }
    path = files["questions"]
    with path.open("rb") as f:
        questions = [parse_question(r, f"{path}: line {n}") for n, r in json_records(f, path)]
    check_questions(questions, str(path))
    return FastChatGrading({n: prompts[n] for n in names}, references), questions


def _judge_prompt(record: Mapping[str, Any], where: str) -> JudgePrompt:
    if record.get("type") != "single" or record.get("output_format") != "[[rating]]":
        raise FastChatDataError(f"{where}: {record['name']!r} is not a single-answer prompt rated as [[rating]]")
    system, template = record.get("system_prompt"), record.get("prompt_template")
    if not isinstance(system, str) or not isinstance(template, str):
        raise FastChatDataError(f"{where}: {record['name']!r} needs a system_prompt and a prompt_template (strings)")
    return JudgePrompt(record["name"], system, template)


def _reference_turns(record: Mapping[str, Any], where: str) -> tuple[str, ...]:
    turns = ((record.get("choices") or [{}])[0] or {}).get("turns")
    if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
        raise FastChatDataError(f"{where}: a reference answer needs choices[0].turns (strings), got {turns!r}")
    return tuple(turns)  # by position: turn k's reference is entry k, empty or not


def map_question_ids(questions: Sequence[Question], known: Sequence[Question]) -> tuple[list[Question], list[str]]:
    """``questions`` with each one whose id is not among ``known``'s (FastChat's) but whose turns are a known
    question's replaced by that question (its id and category: FastChat keys answers, judgments and references by
    them), and a note per replacement ("'hash' → 81")."""
    ids = {str(q.question_id) for q in known}
    by_turns = {tuple(t.strip() for t in q.turns): q for q in known}
    mapped, notes = [], []
    for question in questions:
        match = by_turns.get(tuple(t.strip() for t in question.turns))
        if str(question.question_id) not in ids and match is not None:
            notes.append(f"{question.question_id!r} → {match.question_id!r}")
            question = match
        mapped.append(question)
    return mapped, notes


def _check_turn(question: Question, answers: Sequence[str], turn: int) -> None:
    if turn not in (1, 2):
        raise ValueError(f"turn must be 1 or 2, got {turn}")
    if len(answers) < turn:
        raise ValueError(f"question {question.question_id!r}: turn {turn} needs {turn} answers, got {len(answers)}")


def parse_rating(judgment: str) -> float:
    """The judge's rating as FastChat reads it: the number in the first ``[[r]]``, else in the first ``[r]``, read as
    a Python literal ("7" → 7, "7." → 7.0, "0" and "11" kept); −1 (UNPARSEABLE) when there is none."""
    for pattern in _RATING:
        match = pattern.search(judgment)
        if match:
            try:
                return ast.literal_eval(match.group(1))
            except SyntaxError:  # "07": not a Python literal; FastChat's judging stops there, here it is unrated
                return UNPARSEABLE
    return UNPARSEABLE


def aggregate(judgments: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """From judgments with ``score``, ``turn`` and ``category``: ``score`` (mean over both turns), ``turn_1``,
    ``turn_2``, ``category/<c>`` (both turns), ``judged`` (judgments with a rating) and ``unparseable`` (−1); means over
    rated judgments only, NaN where there are none."""
    rated: dict[str, list[float]] = {"score": [], "turn_1": [], "turn_2": []}
    unparseable = 0
    for j in judgments:
        if j["score"] == UNPARSEABLE:
            unparseable += 1
            continue
        for key in ("score", f"turn_{j['turn']}", f"category/{j['category']}"):
            rated.setdefault(key, []).append(float(j["score"]))
    means = {k: (sum(v) / len(v) if v else math.nan) for k, v in rated.items()}
    return {**means, "judged": float(len(rated["score"])), "unparseable": float(unparseable)}
