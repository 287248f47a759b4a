"""Text task metrics as torchmetrics Metrics (rank-synced): generative perplexity + entropy, GSM8K accuracy.

Both plug into ``SamplingEvaluation`` like the Sudoku metric: built by ``metric(datamodule=...)``, fed
``update(pred_tokens, target_tokens)``, ``compute()`` returns a dict whose first key is the headline metric,
``render(tokens)`` shows a sample, and ``artifact_rows()`` gives per-sample records the callback logs as JSONL.
Decoded texts and per-sample rows are kept per rank (strings cannot be all-reduced); the numbers that make up
the headline metrics are tensor states, reduced over ranks.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat

from flowlm.metrics.gsm8k import (
    SANDBOXES,
    ExecResult,
    Isolation,
    SandboxUnavailableError,
    answers_match,
    execute_responses,
    extract_answer,
    isolation,
)
from flowlm.metrics.text import GenerativePerplexity, check_convention, check_evaluator, unigram_entropy
from flowlm.removed import check_removed
from flowlm.tasks.files import project_path


def _decode(tokenizer, ids: Tensor, keep: Tensor, skip_special_tokens: bool = False) -> str:
    """Text of the kept positions of one (L,) row."""
    return tokenizer.decode(ids[keep].tolist(), skip_special_tokens=skip_special_tokens)


def _content(tokens: Tensor, pad_id: int, mask_id: int) -> Tensor:
    """Positions holding text: not PAD, and not a [MASK] a sampler left (its id is outside the tokenizer's)."""
    return (tokens != pad_id) & (tokens != mask_id)


class GenPPLMetric(Metric):
    """Generative perplexity (lower is better) of unconditional text samples, with mean unigram entropy.

    Each generated row loses its PAD and any leftover [MASK] tokens, is decoded with ``datamodule.tokenizer`` and
    scored by ``GenerativePerplexity`` (re-tokenised with the evaluator's tokenizer, truncated to ``max_length``
    evaluator tokens; ``convention="released"`` scores every token after the first but EOS beyond the row's first,
    as the released FMLM+/MDLM code, ``"bos_prefix"`` prepends BOS and scores every token, EOS included; the
    convention is in the run's params, ``eval/metric/convention``, and in every JSONL row).
    ``gen_ppl`` = exp(Σ NLL / Σ tokens) over all samples of all ranks;
    ``entropy`` = mean over samples of the unigram entropy (nats) of the *model's* token ids without pad (low
    entropy flags degenerate repetition: report it beside gen-PPL); ``num_samples`` counts scored samples.

    Datamodule interface: ``tokenizer`` (a Hugging Face tokenizer with ``decode``), ``pad_id`` and ``mask_id``
    (ints; [MASK] may lie outside the tokenizer) and, optionally, ``seq_len`` (the default ``max_length``; without
    it, the evaluator's context − 1). The evaluator loads on the device of the first generated batch, once per
    process (cached); its config is checked at construction so a missing evaluator fails before any sampling.
    """

    full_state_update = False
    higher_is_better = False

    def __init__(
        self,
        *,
        datamodule,
        evaluator: str = "gpt2-large",
        max_length: int | None = None,
        batch_size: int = 8,
        dtype: str | torch.dtype = "float32",
        convention: str = "released",
        skip_special_tokens: bool = False,
    ) -> None:
        super().__init__()
        check_convention(convention)  # a typo fails here, before the evaluator is looked up or anything sampled
        local = project_path(evaluator)  # a local folder: from the working directory, else the project root
        evaluator = str(local) if local.exists() else evaluator
        check_evaluator(evaluator)  # fail before sampling, not after it
        self.tokenizer = datamodule.tokenizer
        self.pad_id, self.mask_id = int(datamodule.pad_id), int(datamodule.mask_id)
        self.evaluator = evaluator
        self.max_length = max_length if max_length is not None else getattr(datamodule, "seq_len", None)
        self.batch_size = batch_size
        self.eval_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.convention = convention
        self.skip_special_tokens = skip_special_tokens
        self._scorer: GenerativePerplexity | None = None
        self._rows: list[dict] = []
        self.add_state("nll", default=[], dist_reduce_fx="cat")
        self.add_state("tokens", default=[], dist_reduce_fx="cat")
        self.add_state("entropy", default=[], dist_reduce_fx="cat")

    def scorer(self, device: torch.device) -> GenerativePerplexity:
        """The gen-PPL scorer on ``device`` (the evaluator itself is shared through the module cache)."""
        if self._scorer is None or self._scorer.device != device:
            self._scorer = GenerativePerplexity(
                self.evaluator,
                max_length=self.max_length,
                batch_size=self.batch_size,
                device=device,
                dtype=self.eval_dtype,
                convention=self.convention,
            )
        return self._scorer

    def texts(self, tokens: Tensor) -> list[str]:
        """Decoded rows of a (B, L) batch, PAD and [MASK] removed."""
        keep = _content(tokens, self.pad_id, self.mask_id)
        return [_decode(self.tokenizer, row, k, self.skip_special_tokens) for row, k in zip(tokens, keep, strict=True)]

    def update(self, pred_tokens: Tensor, target_tokens: Tensor) -> None:  # noqa: D102
        texts = self.texts(pred_tokens)
        scores = self.scorer(pred_tokens.device).score(texts)
        keep = _content(pred_tokens, self.pad_id, self.mask_id)
        entropy = [unigram_entropy(row[k]) for row, k in zip(pred_tokens, keep, strict=True)]
        entropy = torch.tensor(entropy, dtype=torch.float64)
        self.nll.append(scores.nll.to(self.device))
        self.tokens.append(scores.tokens.to(self.device))
        self.entropy.append(entropy.to(self.device))
        for text, nll, n, h in zip(texts, scores.nll.tolist(), scores.tokens.tolist(), entropy.tolist(), strict=True):
            self._rows.append(
                {
                    "text": text,
                    "nll": nll,
                    "eval_tokens": n,
                    "ppl": math.exp(nll / max(n, 1)),
                    "entropy": h,
                    "convention": self.convention,
                }
            )

    def compute(self) -> dict[str, Tensor]:  # noqa: D102
        if isinstance(self.nll, list) and not self.nll:  # nothing scored (after a sync it is a tensor)
            return {
                "gen_ppl": torch.tensor(math.nan),
                "entropy": torch.tensor(math.nan),
                "num_samples": torch.tensor(0.0),
                "empty_pct": torch.tensor(math.nan),
            }
        nll, tokens, entropy = dim_zero_cat(self.nll), dim_zero_cat(self.tokens), dim_zero_cat(self.entropy)
        # gen-PPL = exp(Σ_i NLL_i / Σ_i n_i), accumulated in float64. Empty samples (all PAD) add no token: they
        # are counted in empty_pct, and a set with no token at all has no perplexity (NaN, not exp(0) = 1).
        total = tokens.sum()
        ppl = torch.exp(nll.sum() / total.double()) if total > 0 else torch.tensor(math.nan, dtype=torch.float64)
        return {
            "gen_ppl": ppl,
            "entropy": entropy.mean(),
            "num_samples": torch.tensor(float(entropy.numel())),
            "empty_pct": 100 * (tokens == 0).float().mean(),
        }

    def reset(self) -> None:  # noqa: D102
        super().reset()
        self._rows = []

    def render(self, tokens: Tensor) -> str:
        """One sample as text (PAD and [MASK] removed)."""
        return self.texts(tokens[None])[0]

    def artifact_rows(self) -> list[dict]:
        """This rank's samples: text, total NLL, evaluator tokens, per-sample PPL (not the headline) and entropy."""
        return list(self._rows)


class GSM8KAccuracy(Metric):
    """GSM8K accuracy (%, higher is better): share of problems whose generated answer equals the gold number.

    ``scorer="extract"`` reads the final number of a natural-language answer (``#### N``, else the last number;
    MLFM/SMDM protocol); ``scorer="execute"`` runs the response as a TinyGSM-style Python function in the
    sandbox (FMLM+ protocol). A response ends at its first EOS.

    Execute options, defaults = the released TinyGSM scorer of FMLM+ (``utils_gsm8k.score_sample``), which cuts
    the program out of the response (from the first ``def ``, inside a Markdown fence, trailing lines dropped until
    it compiles; ``flowlm.metrics.gsm8k.extract_program``; ``extract_code``, removed, is accepted at "released"
    only); ``entry_fallback=False`` calls ``simple_math_problem()`` only (``True``: else the last
    argument-free function, or a global ``result``/``answer``); ``timeout_s=5.0``; ``sandbox="os"`` runs each
    program behind an operating-system boundary (its own network, pid, IPC and mount namespaces, a read-only file
    system with an empty scratch folder, uid 65534 when started by root; ``flowlm.metrics.gsm8k``), and refuses
    at construction, before anything is sampled, where none can be set up; ``sandbox="python_only"`` (explicit)
    runs with the Python-level guard and resource limits alone, which generated code can escape. The isolation
    used is named in every per-problem row (``sandbox``). Matching: |pred − gold| ≤
    max(``rel_tol`` · max(|pred|, |gold|), ``abs_tol``), by default absolute 1e-3 for ``execute`` (released)
    and 1e-6 absolute or relative for ``extract``. Also reported:
    ``num_problems``, and counts of ``no_gold`` (gold unknown: counted as wrong), ``no_answer`` (no number
    found), ``errors`` (exception, syntax error, non-numeric return), ``timeouts`` and ``forbidden`` (sandbox
    whitelist violations).

    Datamodule interface:
      - ``tokenizer``: a Hugging Face tokenizer (``decode``); ``pad_id``, ``mask_id``: ints, stripped before
        decoding (special tokens such as EOS are skipped too);
      - ``response_mask(tokens: Tensor) -> Tensor``: (B, L) bool, True on the positions the model generates
        (the answer, not the question prompt), computed from the target tokens of a batch;
      - ``gold_answers(target_tokens: Tensor) -> list[float | None]`` (optional): the gold number of each row; without
        it the gold is the ``#### N`` (else last) number of the decoded target response, so a datamodule whose
        target responses hold the GSM8K answer text needs nothing more.
    """

    full_state_update = False
    higher_is_better = True

    def __init__(
        self,
        *,
        datamodule,
        scorer: str = "extract",
        extract_code: str = "released",
        entry_fallback: bool = False,
        timeout_s: float = 5.0,
        memory_mb: int = 512,
        workers: int = 4,
        abs_tol: float | None = None,
        rel_tol: float | None = None,
        sandbox: str = "os",
    ) -> None:
        super().__init__()
        if scorer not in _SCORERS:
            raise ValueError(f"GSM8K scorer must be one of {sorted(_SCORERS)}, got {scorer!r}")
        # removed: running the response as generated is a test oracle (tests/metrics/test_metric_protocols.py)
        replacement = "the program is cut out of the response as the released TinyGSM scorer does"
        check_removed("GSM8KAccuracy", "extract_code", extract_code, "released", replacement)
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if sandbox not in SANDBOXES:
            raise ValueError(f"GSM8K sandbox must be one of {list(SANDBOXES)}, got {sandbox!r}")
        self.isolation = _isolation(sandbox) if scorer == "execute" else None
        default_abs, default_rel = _TOLERANCES[scorer]
        self.tolerance = {
            "abs_tol": default_abs if abs_tol is None else float(abs_tol),
            "rel_tol": default_rel if rel_tol is None else float(rel_tol),
        }
        if min(self.tolerance.values()) < 0:
            raise ValueError(f"tolerances must be ≥ 0, got {self.tolerance}")
        self.datamodule = datamodule
        self.tokenizer = datamodule.tokenizer
        self.pad_id, self.mask_id = int(datamodule.pad_id), int(datamodule.mask_id)
        self.scorer = scorer
        self.sandbox = {
            "entry_fallback": bool(entry_fallback),
            "timeout_s": timeout_s,
            "memory_mb": memory_mb,
            "workers": workers,
            "sandbox": sandbox,
        }
        self._rows: list[dict] = []
        for name in ("total", *_COUNTS):
            self.add_state(name, default=torch.tensor(0), dist_reduce_fx="sum")

    def gold(self, target_tokens: Tensor, response: Tensor) -> list[float | None]:
        """Gold numbers from the datamodule, else parsed from the decoded target responses."""
        if hasattr(self.datamodule, "gold_answers"):
            return [None if g is None else float(g) for g in self.datamodule.gold_answers(target_tokens)]
        return [extract_answer(text) for text in self._decode_rows(target_tokens, response)]

    def _decode_rows(self, tokens: Tensor, keep: Tensor) -> list[str]:
        """Text of the kept positions of each row, up to the first EOS among them (what follows is not answer)."""
        keep = keep & _content(tokens, self.pad_id, self.mask_id)
        eos = self.tokenizer.eos_token_id
        if eos is not None:
            keep = keep & ((keep & (tokens == eos)).cumsum(1) == 0)
        return [_decode(self.tokenizer, row, k, True) for row, k in zip(tokens, keep, strict=True)]

    def update(self, pred_tokens: Tensor, target_tokens: Tensor) -> None:  # noqa: D102
        response = self.datamodule.response_mask(target_tokens).to(pred_tokens.device).bool()
        texts = self._decode_rows(pred_tokens, response)
        prompts = self._decode_rows(target_tokens, ~response)
        golds = self.gold(target_tokens, response)
        programs, results = _SCORERS[self.scorer](texts, **self.sandbox)
        counts = dict.fromkeys(_COUNTS, 0)
        for prompt, text, program, gold, result in zip(prompts, texts, programs, golds, results, strict=True):
            ok = answers_match(result.value, gold, **self.tolerance)
            counts["correct"] += ok
            counts["no_gold"] += gold is None
            counts["no_answer"] += result.status == "ok" and result.value is None
            counts["errors"] += result.status == "error"
            counts["timeouts"] += result.status == "timeout"
            counts["forbidden"] += result.status == "forbidden"
            row = {"prompt": prompt, "response": text, "pred": result.value, "gold": gold, "correct": ok}
            if program is not None:  # what the sandbox ran, after extraction, and how (execute scorer)
                row |= {"program": program, "sandbox": self.isolation.name}
            self._rows.append({**row, "status": result.status, "message": result.message})
        self.total += len(texts)
        for name, count in counts.items():
            setattr(self, name, getattr(self, name) + count)

    def compute(self) -> dict[str, Tensor]:  # noqa: D102
        counts = {k: getattr(self, k).float() for k in _COUNTS if k != "correct"}
        return {
            "accuracy": 100 * self.correct / self.total.clamp_min(1).float(),
            "num_problems": self.total.float(),
            **counts,
        }

    def reset(self) -> None:  # noqa: D102
        super().reset()
        self._rows = []

    def render(self, tokens: Tensor) -> str:
        """One sample (question and generated answer) as text, PAD and [MASK] removed."""
        return _decode(self.tokenizer, tokens, _content(tokens, self.pad_id, self.mask_id))

    def artifact_rows(self) -> list[dict]:
        """This rank's problems: prompt, response, (execute) extracted program, pred and gold, correctness, status."""
        return list(self._rows)


def _warn_once_per_job(message: str) -> None:
    """A warning from rank 0 only (every rank builds the metric; one line per job is enough)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        warnings.warn(message, stacklevel=3)


def _isolation(sandbox: str) -> Isolation:
    """The sandbox's isolation, refused with the config key to change; a warning when it is Python-level only."""
    try:
        found = isolation(sandbox)
    except SandboxUnavailableError as err:
        raise SandboxUnavailableError(
            f"GSM8K scorer=execute: {err} (in a run config: eval.metric.sandbox=python_only)"
        ) from None
    if sandbox == "python_only":
        _warn_once_per_job(
            "GSM8K scorer=execute with eval.metric.sandbox=python_only: generated programs run behind the Python-level "
            "guard only, which they can escape (files, network and processes of this user are reachable)"
        )
    return found


def _extract(texts: list[str], **_sandbox) -> tuple[list[None], list[ExecResult]]:
    """Natural-language answers: no program; the extracted number (status ok, value None when there is none)."""
    return [None] * len(texts), [ExecResult("ok", extract_answer(text)) for text in texts]


def _execute(texts: list[str], **sandbox) -> tuple[list[str], list[ExecResult]]:
    """Generated programs: the extracted code and its sandboxed return value."""
    return execute_responses(texts, **sandbox)


_SCORERS = {"extract": _extract, "execute": _execute}
# Default (abs_tol, rel_tol) per scorer: the released TinyGSM scorer's absolute 1e-3 for executed programs; for
# extracted numbers the suite's float-noise tolerance (12 vs 12.0, 0.1 + 0.2 vs 0.3).
_TOLERANCES = {"execute": (1e-3, 0.0), "extract": (1e-6, 1e-6)}
# Per-problem outcome counts kept as summed states (besides ``total``); all but ``correct`` are reported as is.
_COUNTS = ("correct", "no_gold", "no_answer", "errors", "timeouts", "forbidden")
