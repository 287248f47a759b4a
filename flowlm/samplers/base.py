"""What every sampler returns, the model views samplers see, and the option checks (methods.md §2, §5); the draws
are flowlm/ops/draws.py."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from flowlm.ops.summary import dense_summary
from flowlm.processes.gaussian_flow import EmbeddingSpace, OneHotSpace


@dataclass
class SampleOutput:
    """Tokens (B, L), per-token confidence (B, L) of the committed token, and the NFE really spent; ``row_nfe`` (B,):
    the calls each row needed, where an adaptive sampler finishes rows at different calls (None: every row ``nfe``)."""

    tokens: Tensor
    confidence: Tensor
    nfe: int
    row_nfe: Tensor | None = None

    def mean_nfe(self) -> float:
        """The NFE per row, averaged over the batch: where adaptive samplers meet fixed-step ones on one axis."""
        return float(self.nfe) if self.row_nfe is None else float(self.row_nfe.float().mean())


@dataclass(frozen=True)
class MaskedDenoiser:
    """An MDM as samplers see it: ``fn(x_t ids (B, L), t (B,)) → logits over the data vocabulary (B, L, V)``.

    ``time_conditioned`` says whether fn depends on t; a time-agnostic network gives the same output for the
    same input, which is what makes the ancestral sampler's no-change cache exact.
    """

    fn: Callable[[Tensor, Tensor], Tensor]
    mask_id: int
    time_conditioned: bool = False


@dataclass(frozen=True)
class FlowDenoiser:
    """A two-time flow model as samplers see it: ``fn(x (B, L, V) float, s (B, L), t (B, L)) → log δ_{s,t}(x)``.

    Times are per token; positions at s = t = 1 are clean one-hot vectors (prompt, context, committed tokens).
    ``pinned_fn(x, s, t, pinned)``, when the model has it, computes the same with the times of the unpinned tokens
    given once (scalars or per sequence) and the pinned ones at s = t = 1, cheaper; samplers call ``at``.

    ``space``: how states are represented (``flowlm.processes.gaussian_flow``): x over the vocabulary (the one-hot
    space, the default) or projected by the input embedding, h = x·E (the embedding space, for text vocabularies);
    fn and pinned_fn read states of that space. Samplers build every state through it (``noise``, ``data``,
    ``lift``), so they run unchanged in either.

    ``summary_fn(x, s, t, pinned)``, when the model has it, returns in the pinned form only (max_v log δ, argmax_v)
    per position, without a (B, L, |V|) log δ (``flowlm.ops.summary``); greedy drafts call ``summary_at``.
    ``lift_fn(x, s, t, pinned)``, likewise, returns the denoiser's mean as a state, δ·E (B, L, d), in the embedding
    space only; flow-map sub-steps call ``lifted_at``.
    """

    fn: Callable[[Tensor, Tensor, Tensor], Tensor]
    vocab_size: int
    pinned_fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor] | None = None
    space: OneHotSpace | EmbeddingSpace | None = None
    summary_fn: Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]] | None = None
    lift_fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor] | None = None

    @property
    def states(self) -> OneHotSpace | EmbeddingSpace:
        """The state space the model reads (the one-hot space unless ``space`` says otherwise)."""
        return self.space if self.space is not None else OneHotSpace(self.vocab_size)

    def at(self, x: Tensor, s: float | Tensor, t: float | Tensor, pinned: Tensor) -> Tensor:
        """log δ_{s,t}(x) with the unpinned tokens at (s, t) (scalars or (B,)) and the pinned ones at s = t = 1."""
        s, t = _sequence_times(x, s, t)
        if self.pinned_fn is not None:
            return self.pinned_fn(x, s, t, pinned)
        return self.fn(x, torch.where(pinned, 1.0, s[:, None]), torch.where(pinned, 1.0, t[:, None]))

    def summary_at(self, x: Tensor, s: float | Tensor, t: float | Tensor, pinned: Tensor) -> tuple[Tensor, Tensor]:
        """(max_v log δ_{s,t}(x), argmax_v) per position (B, L), as ``at`` times: all a greedy draft reads. The one
        place the path is chosen: the model's ``summary_fn`` (no (B, L, |V|) log δ), else read off ``at``."""
        if self.summary_fn is None:
            return dense_summary(self.at(x, s, t, pinned))
        return self.summary_fn(x, *_sequence_times(x, s, t), pinned)

    def lifted_at(self, x: Tensor, s: float | Tensor, t: float | Tensor, pinned: Tensor) -> Tensor:
        """δ_{s,t}(x) as a state of the model's space (``states.lift``), as ``at`` times: what a flow-map sub-step
        adds. The one place the path is chosen: the model's ``lift_fn`` (no (B, L, |V|) log δ), else lifted off
        ``at``."""
        if self.lift_fn is None:
            return self.states.lift(self.at(x, s, t, pinned).exp())
        return self.lift_fn(x, *_sequence_times(x, s, t), pinned)


def _sequence_times(x: Tensor, s: float | Tensor, t: float | Tensor) -> tuple[Tensor, Tensor]:
    """Times (scalars or (B,)) as (B,) tensors of x's dtype, without a host copy."""
    b = x.shape[0]
    s, t = (time.to(x.dtype).expand(b) if isinstance(time, Tensor) else x.new_full((b,), time) for time in (s, t))
    return s, t


CONFIDENCE_KINDS = ("a-priori", "a-posteriori")
# The largest NFE budget a sampler takes, per position it generates (``Sampler.check_budget``, given the positions).
# The MDM confidence and semi-AR samplers commit at least one token per step: above one NFE per position (two with
# guidance) they give the same samples (semi-AR: with idle calls). The MDM ancestral, flow and MLFM samplers refine on
# a grid with no natural end, where a budget far beyond the sequence only lengthens the loop (10⁸ NFE on a 36-cell
# board ran 18 minutes): a cap, not a bound, for every family. 16 allows grids 11× finer than the configs' largest
# budget per position (128 NFE on 89 positions: the MDM and MLFM budgets of conditional 9×9 Sudoku at scale=paper).
BUDGET_PER_POSITION = 16  # × the positions a caller passes: the whole row (prompt included), a loose cap


class Sampler(ABC):
    """A sampler for one model family; it spends at most ``nfe`` network calls and reports what it spent.

    A concrete sampler declares ``family`` (the models it samples) and ``confidence_kind``, how its per-token
    confidence is scored: "a-priori" before the rest of the sequence exists (MDM confidence, FMLM+ δ_{0,0}) or
    "a-posteriori" on a finished draft (PR, flow-map endpoints); a class attribute, or a property when a setting
    decides it. A concrete subclass without a valid declaration is refused where it is defined.
    """

    family: str = ""

    @property
    @abstractmethod
    def confidence_kind(self) -> str:
        """One of ``CONFIDENCE_KINDS``: how this sampler's reported confidence is scored."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if getattr(cls.__call__, "__isabstractmethod__", False):  # still abstract: a base for other samplers
            return
        kind = cls.confidence_kind
        if isinstance(kind, property):
            if getattr(kind, "__isabstractmethod__", False):
                raise TypeError(
                    f"{cls.__name__} must declare confidence_kind, one of {CONFIDENCE_KINDS} (a class attribute, "
                    "or a property when a setting decides it)"
                )
        elif kind not in CONFIDENCE_KINDS:
            raise TypeError(f"{cls.__name__}.confidence_kind must be one of {CONFIDENCE_KINDS}, got {kind!r}")

    @abstractmethod
    def __call__(
        self, model, *, prompt: Tensor, prompt_mask: Tensor, nfe: int, generator: torch.Generator
    ) -> SampleOutput:
        """Sample completions of ``prompt`` (ids at ``prompt_mask`` positions are kept verbatim)."""

    def check_budget(self, nfe: int, *, free_positions: int | None = None) -> None:
        """Raise a clear error, before any compute, if this sampler cannot honour an NFE budget (for sequences
        with ``free_positions`` non-prompt tokens, when the sampler's cost depends on it), or, with
        ``free_positions``, if the budget is above ``BUDGET_PER_POSITION`` NFE per position."""
        if not isinstance(nfe, int) or nfe < 1:
            raise ValueError(f"{type(self).__name__}: NFE budget must be an integer ≥ 1, got {nfe!r}")
        cap = BUDGET_PER_POSITION * max(free_positions or 0, 1)
        if free_positions is not None and nfe > cap:
            raise ValueError(
                f"{type(self).__name__}: NFE budget {nfe} is above the cap of {cap} for {free_positions} positions "
                f"to generate ({BUDGET_PER_POSITION} NFE per position, docs/reliability.md); lower it (eval.nfe)"
            )


def check_temperature(temperature: float) -> float:
    """A sampling temperature: 0 means argmax, > 0 scales the logits."""
    if temperature < 0:
        raise ValueError(f"temperature must be ≥ 0, got {temperature}")
    return temperature


SCORES = ("max_prob", "sampled")


def check_score(score: str) -> str:
    """How a commit loop ranks positions at temperature > 0: by the max probability ("max_prob") or by the
    probability of the token drawn ("sampled"); at temperature 0 they coincide."""
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    return score


DRAWS = ("committed", "full")


def check_draws(draws: str) -> str:
    """Where a sampler draws its float64 categorical: "committed", only at the positions that commit or unmask in
    a step (the same law: which positions commit does not depend on the draw), by inverse CDF
    (``sample_categorical``), or "full", every position by Gumbel-max, the suite's earlier random stream (a
    (B, L, |V|) float64 pass per step, the cost that dominates at a text vocabulary)."""
    if draws not in DRAWS:
        raise ValueError(f"draws must be one of {DRAWS}, got {draws!r}")
    return draws


def masked_start(prompt: Tensor, prompt_mask: Tensor, mask_id: int) -> tuple[Tensor, Tensor]:
    """The all-[MASK] state with the prompt in place, and its confidence (1 on the prompt, 0 elsewhere)."""
    return torch.where(prompt_mask, prompt, mask_id), prompt_mask.float()
