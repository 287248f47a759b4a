"""MT-Bench (Zheng et al. 2023, arXiv 2306.05685): its question records, the chat prompts the model answers, the
single-answer grading prompts a judge model reads, the rating read back from the judge and the scores aggregated.

Pure Python: runners/mt_bench.py generates the answers with a checkpoint and talks to the judge over HTTP. The chat
layouts (``chat_renderer``: the tokenizer's template or Vicuna's) are also the lm-eval model's
(runners/lm_harness.py, ``--apply_chat_template``).

- A question is FastChat's ``question.jsonl`` record: ``question_id``, ``category``, ``turns`` (two user turns),
  optionally ``reference`` (reference answers per turn, for math / reasoning / coding); the Hugging Face copy
  ``HuggingFaceH4/mt_bench_prompts`` names them ``prompt_id`` and ``prompt``, which are read as well.
- Single-answer grading (FastChat's ``single`` mode): turn 1 is graded from the question and the first answer; turn 2
  from the whole conversation, the judge told to rate the second answer. The judge ends with ``[[r]]``, r ∈ [1, 10];
  a reply without one is scored −1 and counted, as FastChat does, and left out of every mean.
- Scores: the mean per turn, over both turns (FastChat's ``show_result``), and per category over both turns.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

TURNS = 2  # MT-Bench questions have two user turns
UNPARSEABLE = -1.0  # FastChat's score of a judgment without a rating
RATING_RANGE = (1.0, 10.0)
TEMPLATES = ("auto", "tokenizer", "vicuna")  # the chat layouts of ``template_kind``
# "[[7]]" (the requested form), else "[7]" (FastChat's fallback for judges that drop one bracket); first match wins.
_RATING = (re.compile(r"\[\[\s*(\d+(?:\.\d+)?)\s*\]\]"), re.compile(r"\[\s*(\d+(?:\.\d+)?)\s*\]"))
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
    return Question(qid, category, tuple(turns), tuple(r for r in reference if r.strip()))


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
    if turn not in (1, 2):
        raise ValueError(f"turn must be 1 or 2, got {turn}")
    if len(answers) < turn:
        raise ValueError(f"question {question.question_id!r}: turn {turn} needs {turn} answers, got {len(answers)}")
    ref = question.reference[:turn] if len(question.reference) >= turn else ()
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


def parse_rating(judgment: str) -> float:
    """The rating r in the judge's ``[[r]]`` (else ``[r]``), r ∈ [1, 10]; −1 (UNPARSEABLE) when there is none or it
    lies outside [1, 10]."""
    for pattern in _RATING:
        match = pattern.search(judgment)
        if match:
            rating = float(match.group(1))
            low, high = RATING_RANGE
            return rating if low <= rating <= high else UNPARSEABLE
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
