"""The samplers' contract: what every sampler returns, the model views samplers see, and the Sampler base with its
budget check (methods.md §2, §5); the option checks are ``common.py``, the draws flowlm/ops/draws.py."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from flowlm.ops.summary import dense_summary
from flowlm.processes.gaussian_flow import EmbeddingSpace, OneHotSpace
from flowlm.samplers.common import BUDGET_PER_POSITION, check_budget, sequence_times  # noqa: F401 (tests import it)
from flowlm.samplers.interrupt import with_interruptible_view


@dataclass
class SampleOutput:
    """Tokens (B, L), per-token confidence (B, L) of the committed token, and the NFE really spent; ``row_nfe`` (B,):
    the calls each row needed, where an adaptive sampler finishes rows at different calls (None: every row ``nfe``);
    ``forced`` (B,): the commits an adaptive sampler's NFE budget forced beyond its rule's count (None elsewhere)."""

    tokens: Tensor
    confidence: Tensor
    nfe: int
    row_nfe: Tensor | None = None
    forced: Tensor | None = None  # (B,): an adaptive sampler's commits that its budget forced beyond its rule

    def mean_nfe(self) -> float:
        """The NFE per row, averaged over the batch: where adaptive samplers meet fixed-step ones on one axis."""
        return float(self.nfe) if self.row_nfe is None else float(self.row_nfe.float().mean())


@dataclass(frozen=True)
class MaskedDenoiser:
    """An MDM as samplers see it: ``fn(x_t ids (B, L), t (B,)) → logits over the data vocabulary (B, L, V)``.
    ``time_conditioned``: whether fn depends on t (a time-agnostic one makes the ancestral no-change cache exact).
    ``windowed(L)``, where the network can: a reader ``(x window, t, start, fresh) → its logits`` over a new block KV
    cache (flowlm/samplers/block_cache.py); ``windowed(L, head=True)`` where ``head_fn`` is given too: the reader
    returns ``(features, W, b)`` as ``head_fn`` does. ``head_fn(x, t)``, where the network can: ``(features
    (B, L, d), W (V, d), b (V,) or None)``, the network up to its output head's input and the head over the data
    vocabulary, fn's logits being features·Wᵀ + b, for decoders that read the head in vocabulary chunks at some
    positions only
    (``flowlm.ops.summary.chunked_head_summary``). ``rows_alone``: whether fn and head_fn compute each row from that
    row's x and t alone (no batch-wide state), so that a sampler may call them on the rows that need a call
    (``flowlm.samplers.common.call_rows``); False for a view holding the batch's prompt mask (CFG's guided view).
    """

    fn: Callable[[Tensor, Tensor], Tensor]
    mask_id: int
    time_conditioned: bool = False
    windowed: Callable[..., Callable[..., Tensor | tuple]] | None = None
    head_fn: Callable[[Tensor, Tensor], tuple[Tensor, Tensor, Tensor | None]] | None = None
    rows_alone: bool = True


def plain_linear(head: object) -> bool:
    """Whether ``head`` is a plain, unsharded Linear (not an adapter's, not an FSDP shard): a head the MDM samplers
    may run in vocabulary chunks (``MaskedDenoiser.head_fn``)."""
    return type(head) is torch.nn.Linear and type(head.weight.data) is torch.Tensor


def data_head(head: torch.nn.Linear, rows: int, mask_id: int) -> tuple[Tensor, Tensor | None]:
    """(W, b) of ``head``'s first ``rows`` outputs as ``MaskedDenoiser.head_fn`` gives them: a [MASK] among them
    (LLaDA, Dream) at −∞ through the bias, as its logits are set (SUBS: a sampler never proposes [MASK])."""
    weight, bias = head.weight[:rows], None if head.bias is None else head.bias[:rows]
    if mask_id < rows:
        bias = weight.new_zeros(rows) if bias is None else bias
        bias = bias.index_fill(0, torch.tensor([mask_id], device=bias.device), -torch.inf)
    return weight, bias


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

    ``summary_fn(x, s, t, pinned, rows=None)``, when the model has it, returns in the pinned form only
    (max_v log δ, argmax_v) per position, without a (B, L, |V|) log δ (``flowlm.ops.summary``), or at the flat
    positions ``rows`` only; greedy drafts call ``summary_at``.
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
        s, t = sequence_times(x, s, t)
        if self.pinned_fn is not None:
            return self.pinned_fn(x, s, t, pinned)
        return self.fn(x, torch.where(pinned, 1.0, s[:, None]), torch.where(pinned, 1.0, t[:, None]))

    def summary_at(
        self, x: Tensor, s: float | Tensor, t: float | Tensor, pinned: Tensor, rows: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """(max_v log δ_{s,t}(x), argmax_v) per position (B, L), as ``at`` times: all a greedy draft reads; with
        ``rows`` (n,), flat indices into the B·L positions, at those positions only (n,): the head runs there alone.
        The one place the path is chosen: the model's ``summary_fn`` (no (B, L, |V|) log δ), else read off ``at``."""
        if self.summary_fn is None:
            log_max, argmax = dense_summary(self.at(x, s, t, pinned))
            return (log_max, argmax) if rows is None else (log_max.view(-1)[rows], argmax.view(-1)[rows])
        if rows is None:
            return self.summary_fn(x, *sequence_times(x, s, t), pinned)
        return self.summary_fn(x, *sequence_times(x, s, t), pinned, rows=rows)

    def lifted_at(self, x: Tensor, s: float | Tensor, t: float | Tensor, pinned: Tensor) -> Tensor:
        """δ_{s,t}(x) as a state of the model's space (``states.lift``), as ``at`` times: what a flow-map sub-step adds.
        The one place the path is chosen: the model's ``lift_fn`` (no (B, L, |V|) log δ), else lifted off ``at``."""
        if self.lift_fn is None:
            return self.states.lift(self.at(x, s, t, pinned).exp())
        return self.lift_fn(x, *sequence_times(x, s, t), pinned)


CONFIDENCE_KINDS = ("a-priori", "a-posteriori")


class Sampler(ABC):
    """A sampler for one model family; it spends at most ``nfe`` network calls and reports what it spent.

    A concrete sampler declares ``family`` (the models it samples) and ``confidence_kind``, how its per-token
    confidence is scored: "a-priori" before the rest of the sequence exists (MDM confidence, FMLM+ δ_{0,0}) or
    "a-posteriori" on a finished draft (PR, flow-map endpoints); a class attribute, or a property when a setting
    decides it. A concrete subclass (no abstract method open) without a valid one is refused where it is defined.
    Every ``__call__`` gets its model view ``interruptible`` (flowlm/samplers/interrupt.py): a stop request is
    honoured before the next network call, not after the batch.
    """

    family: str = ""

    @property
    @abstractmethod
    def confidence_kind(self) -> str:
        """One of ``CONFIDENCE_KINDS``: how this sampler's reported confidence is scored."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "__call__" in cls.__dict__ and not getattr(cls.__call__, "__isabstractmethod__", False):
            cls.__call__ = with_interruptible_view(cls.__call__)
        names = (name for name in dir(cls) if name != "confidence_kind")
        if any(getattr(getattr(cls, name, None), "__isabstractmethod__", False) for name in names):
            return  # an abstract method (``__call__``, a skeleton's hook) still open: a base for other samplers
        kind = cls.confidence_kind
        if isinstance(kind, property) and getattr(kind, "__isabstractmethod__", False):
            raise TypeError(
                f"{cls.__name__} must declare confidence_kind, one of {CONFIDENCE_KINDS} (a class attribute, "
                "or a property when a setting decides it)"
            )
        if not isinstance(kind, property) and kind not in CONFIDENCE_KINDS:
            raise TypeError(f"{cls.__name__}.confidence_kind must be one of {CONFIDENCE_KINDS}, got {kind!r}")

    @abstractmethod
    def __call__(
        self, model, *, prompt: Tensor, prompt_mask: Tensor, nfe: int, generator: torch.Generator
    ) -> SampleOutput:
        """Sample completions of ``prompt`` (ids at ``prompt_mask`` positions are kept verbatim)."""

    def check_budget(self, nfe: int, *, free_positions: int | None = None) -> None:
        """Raise a clear error, before any compute, if this sampler cannot honour an NFE budget (for sequences
        with ``free_positions`` non-prompt tokens, when the sampler's cost depends on it): ``common.check_budget``."""
        check_budget(type(self).__name__, nfe, free_positions)
