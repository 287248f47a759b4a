"""Text metrics (methods.md §7): generative perplexity under an evaluator causal LM, and unigram entropy.

Gen-PPL: decode a sample, re-tokenise it with the evaluator's tokenizer, truncate to the sample length L (in
evaluator tokens), score it, and report ``exp(Σ NLL / Σ tokens)`` over the scored tokens of all samples (a
token-weighted mean, not a mean of per-sample perplexities). Which tokens are scored is the ``convention``:

- ``released`` (default; the released FMLM+ code, ``metrics.py`` ``Metrics.record_generative_perplexity``, which
  is MDLM's): the text is tokenised as the evaluator's tokenizer does by default (GPT-2 adds no BOS); its first
  token is context only; every later token is scored except EOS tokens, of which only the first one of the row
  is scored (when it is not the first token). A sample ``[BOS=EOS] story [EOS]`` thus scores its story only.
- ``bos_prefix``: the evaluator's BOS is prepended (unless the text starts with it), so every token of the text,
  EOS included, is scored: ``p(x_1 | BOS) Π p(x_i | x_<i)``; the BOS takes one position of the context.

The evaluator (GPT-2 Large in the configs) is loaded once per (name, device, dtype) and reused; every batch is
scored, the last partial one too.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "GEN_PPL_CONVENTIONS",
    "EvaluatorUnavailableError",
    "GenerativePerplexity",
    "TextScores",
    "check_convention",
    "check_evaluator",
    "clear_evaluator_cache",
    "load_evaluator",
    "mean_entropy",
    "unigram_entropy",
]


GEN_PPL_CONVENTIONS = ("released", "bos_prefix")


def check_convention(convention: str) -> None:
    """Raise ValueError unless ``convention`` names a known gen-PPL convention."""
    if convention not in GEN_PPL_CONVENTIONS:
        raise ValueError(f"gen-PPL convention must be one of {list(GEN_PPL_CONVENTIONS)}, got {convention!r}")


class EvaluatorUnavailableError(OSError):
    """The evaluator LM (or its tokenizer) cannot be loaded, typically because the machine is offline."""


# (name or path, device, dtype) → (model, tokenizer): loading GPT-2 Large per batch or per metric would dominate
# evaluation time (methods.md §9), so every scorer in the process shares one copy.
_EVALUATORS: dict[tuple[str, str, torch.dtype], tuple] = {}


def _unavailable(name: str, err: Exception) -> EvaluatorUnavailableError:
    return EvaluatorUnavailableError(
        f"cannot load the gen-PPL evaluator {name!r}: {err}\n"
        "Without hub access, provide a local copy: either pass a directory as the evaluator (e.g. "
        "eval.metric.evaluator=/path/to/gpt2-large, holding the model and tokenizer from save_pretrained), or "
        f"download it once where the network is reachable (`hf download {name}`) into the Hugging Face cache "
        "(HF_HOME / HF_HUB_CACHE) and run with HF_HUB_OFFLINE=1 so the cached copy is used."
    )


def load_evaluator(name: str, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> tuple:
    """The (model, tokenizer) of a causal LM by hub name or local path, loaded once per (name, device, dtype)."""
    device = torch.device(device)
    key = (str(name), str(device), dtype)
    if key not in _EVALUATORS:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(name)
            model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
        except OSError as err:
            raise _unavailable(name, err) from err
        model.to(device).eval().requires_grad_(False)
        _EVALUATORS[key] = (model, tokenizer)
    return _EVALUATORS[key]


def check_evaluator(name: str) -> None:
    """Fail fast (before any sampling) if the evaluator's config cannot be found locally or on the hub."""
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(name)
    except OSError as err:
        raise _unavailable(name, err) from err


def clear_evaluator_cache() -> None:
    """Forget every loaded evaluator (frees its memory once no scorer holds it)."""
    _EVALUATORS.clear()


@dataclass(frozen=True)
class TextScores:
    """Per-sample total NLL in nats (N,) float64 and number of scored evaluator tokens (N,) int64."""

    nll: Tensor
    tokens: Tensor

    def perplexity(self) -> float:
        """Gen-PPL = exp(Σ_i NLL_i / Σ_i n_i) over all samples (NaN when no token was scored)."""
        total = int(self.tokens.sum())
        return math.exp(float(self.nll.sum()) / total) if total else math.nan

    def per_sample_perplexity(self) -> Tensor:
        """exp(NLL_i / n_i) per sample: for inspection only; its mean is *not* the reported gen-PPL."""
        return torch.exp(self.nll / self.tokens.clamp_min(1))


class GenerativePerplexity:
    """Scores texts under an evaluator causal LM: per-sample NLL and token counts, and gen-PPL.

    Each text is re-tokenised with the evaluator's tokenizer and truncated to ``max_length`` tokens (the sample
    length L; ``None`` = as many as the context allows). ``convention`` says which tokens are scored (module
    docstring): ``released`` (first token context only, EOS after the row's first one not scored; L ≤ context,
    1024 for GPT-2) or ``bos_prefix`` (BOS prepended, every token scored; L ≤ context − 1, 1023 for GPT-2). A
    larger ``max_length`` is clipped to what fits, with a warning.
    Batches are right-padded with an attention mask (padding is never scored); per-token NLL comes from a float32
    log-softmax (logits upcast from bf16/fp16 evaluators) and is summed per sample in float64, so totals over
    10⁵+ tokens keep their precision.
    """

    def __init__(
        self,
        evaluator: str = "gpt2-large",
        *,
        max_length: int | None = None,
        batch_size: int = 8,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        convention: str = "released",
    ) -> None:
        check_convention(convention)
        if batch_size < 1:
            raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length must be ≥ 1, got {max_length}")
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.model, self.tokenizer = load_evaluator(evaluator, device=device, dtype=dtype)
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.convention = convention
        add_bos = convention == "bos_prefix"
        self.bos_id = self._bos_id() if add_bos else None
        self.eos_id = self.tokenizer.eos_token_id
        context = getattr(self.model.config, "n_positions", None) or self.model.config.max_position_embeddings
        room = context - int(add_bos)  # the BOS prefix takes one position of the context
        if max_length is not None and max_length > room:
            warnings.warn(
                f"gen-PPL max_length={max_length} exceeds the evaluator's context of {context} tokens"
                f"{' with the BOS prefix' if add_bos else ''}: samples are truncated to {room} evaluator tokens",
                stacklevel=2,
            )
        self.max_length = min(max_length or room, room)

    def _bos_id(self) -> int:
        for token_id in (self.tokenizer.bos_token_id, self.tokenizer.eos_token_id, self.model.config.bos_token_id):
            if token_id is not None:
                return int(token_id)
        raise ValueError("the evaluator defines no BOS/EOS token to prefix samples with; use convention='released'")

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Evaluator token ids of each text, truncated to ``max_length`` (BOS-prefixed under ``bos_prefix``)."""
        if self.convention == "released":
            # the tokenizer's own special tokens, as the released code calls it (GPT-2 adds none)
            return self.tokenizer(list(texts), truncation=True, max_length=self.max_length)["input_ids"]
        ids = self.tokenizer(list(texts), add_special_tokens=False, truncation=True, max_length=self.max_length)[
            "input_ids"
        ]
        return [row if row[:1] == [self.bos_id] else [self.bos_id, *row] for row in ids]

    def scored_mask(self, ids: Tensor, mask: Tensor) -> Tensor:
        """(B, n − 1) bool: which targets ``ids[:, 1:]`` count, given the (B, n) attention mask of real tokens."""
        scored = mask[:, 1:].bool()
        if self.convention == "released" and self.eos_id is not None:
            # EOS tokens are left out, except the first EOS of each row (wherever it is; if it is the first
            # token it is context only, so then no EOS of the row counts)
            eos = ids == self.eos_id
            first_eos = eos & (eos.cumsum(1) == 1)
            scored = scored & (~eos | first_eos)[:, 1:]
        return scored

    @torch.inference_mode()
    def score(self, texts: Sequence[str]) -> TextScores:
        """Per-sample total NLL (nats) and scored-token counts, in input order, every batch included."""
        encoded = self.encode(texts)
        nll = torch.zeros(len(encoded), dtype=torch.float64)
        counts = torch.zeros(len(encoded), dtype=torch.long)
        for start in range(0, len(encoded), self.batch_size):  # the last, partial batch is scored too
            rows = encoded[start : start + self.batch_size]
            width = max(len(r) for r in rows)
            if width < 2:  # nothing has a prefix to be predicted from (texts of at most one token)
                continue
            ids = torch.zeros(len(rows), width, dtype=torch.long)  # pad id is irrelevant: masked everywhere
            mask = torch.zeros(len(rows), width, dtype=torch.long)
            for i, row in enumerate(rows):
                ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
                mask[i, : len(row)] = 1
            ids, mask = ids.to(self.device), mask.to(self.device)
            logits = self.model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            # NLL_i = Σ_{j≥1, scored} −log p(x_j | x_<j)
            token_nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
            scored = self.scored_mask(ids, mask)
            nll[start : start + len(rows)] = (token_nll.double() * scored).sum(1).cpu()
            counts[start : start + len(rows)] = scored.sum(1).cpu()
        return TextScores(nll=nll, tokens=counts)

    def __call__(self, texts: Sequence[str]) -> float:
        """Gen-PPL of a list of texts: exp(Σ NLL / Σ tokens) (lower is better)."""
        return self.score(texts).perplexity()


def unigram_entropy(token_ids: Sequence[int] | Tensor) -> float:
    """Entropy in nats of one sample's empirical unigram distribution, H = −Σ_v p_v ln p_v (0 for empty)."""
    ids = token_ids.tolist() if isinstance(token_ids, Tensor) else list(token_ids)
    if not ids:
        return 0.0
    counts = torch.tensor(list(Counter(ids).values()), dtype=torch.float64)
    p = counts / counts.sum()
    return float(-(p * p.log()).sum())


def mean_entropy(samples: Iterable[Sequence[int] | Tensor]) -> float:
    """Mean over samples of their unigram entropies (nats); NaN for no samples."""
    values = [unigram_entropy(s) for s in samples]
    return sum(values) / len(values) if values else math.nan
