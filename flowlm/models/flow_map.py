"""FMLM+ (and FLM, FMLM) as samplers and the loss read the two-time network: the flow map's denoiser
log δ_{s,t}(x), its head summaries and the flow's state space (methods.md §3–4)."""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from flowlm.objectives.flow import SOFT_CAP, log_delta, log_delta_
from flowlm.ops.compiled import tails_enabled
from flowlm.ops.summary import head_expectation
from flowlm.processes.gaussian_flow import EmbeddingSpace, GaussianFlowProcess, OneHotSpace, choose_space
from flowlm.samplers.base import FlowDenoiser

FUSED_LOSSES = ("auto", True, False)  # FlowMapModel.fused_head: auto = by shape, where the head allows it


def is_shard(weight: Tensor) -> bool:
    """Whether ``weight`` is an FSDP2 shard (a DTensor), not the full matrix, as parameters are outside the network's
    forward under FSDP2. Any other tensor is whole: a plain one, or a fake one (benchmarks/memory_estimates.py), so
    the estimate takes the path the run takes."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(weight, DTensor) or isinstance(weight.data, DTensor)


class FlowMapModel:
    """``net(x, s, t, pinned)`` → logits over the data vocabulary at per-token times (s, t), read as
    log δ_{s,t}(x) = log_softmax(g(logits)), g the soft cap at 30. A [MASK] inside the data vocabulary (LLaDA, Dream)
    gets logit −∞ before the cap, on every path (the full log δ, the chunked summaries, the fused loss)."""

    def __init__(self, net: nn.Module, *, data_vocab_size: int, mask_id: int, state_space: str = "auto") -> None:
        self.net = net
        self.data_vocab_size = data_vocab_size
        self.mask_id = mask_id
        self.state_space = state_space
        self.process = GaussianFlowProcess(vocab_size=data_vocab_size)
        self._space_cache: tuple | None = None  # (key of the embedding's storage and version, its state space)

    def __call__(
        self, x: Tensor, s: Tensor, t: Tensor, pinned: Tensor | None = None, *, embedded: bool = False
    ) -> Tensor:
        """log δ_{s,t}(x): (B, L, |V|) log-probabilities at per-token times (s, t); or, with ``pinned`` (B, L), at
        per-sequence times (s, t) with the pinned tokens at s = t = 1. ``embedded``: x is already h = x·E (B, L, d),
        a state of the embedding space."""
        logits = self.net.forward_embeddings(x, s, t, pinned=pinned) if embedded else self.net(x, s, t, pinned=pinned)
        if self.mask_id < self.data_vocab_size:  # [MASK] inside the vocabulary: logit −∞, capped to −cap
            logits = logits.index_fill(-1, torch.tensor([self.mask_id], device=logits.device), -torch.inf)
        if torch.is_grad_enabled() or tails_enabled():
            return log_delta(logits)
        return log_delta_(logits)  # in place without autograd

    def never_mask(self, fn, *args: Tensor) -> Tensor:
        """``fn``'s log δ with a [MASK] inside the vocabulary at exactly −∞, what samplers draw from. ``__call__``
        leaves it at the soft cap's floor, −cap − lse_v g(l_v), which every training path shares (a −∞ would turn
        into 0 · ∞ = NaN in a soft target's CE); the other columns are not renormalised (the mass moved is below
        float32 resolution for any max capped logit above −13)."""
        log_probs = fn(*args)
        return log_probs.index_fill(-1, torch.tensor([self.mask_id], device=log_probs.device), -torch.inf)

    def states(self, kind: str | None = None) -> OneHotSpace | EmbeddingSpace:
        """The flow state space (``state_space``, or ``kind``; ``auto``: by shape, methods.md §4), kept while the
        embedding's values are unchanged."""
        weight = self.net.token_embeddings.detach()
        key = (kind or self.state_space, weight.data_ptr(), weight._version, weight.device, weight.dtype)
        if self._space_cache is None or self._space_cache[0] != key:
            with torch.no_grad():
                self._space_cache = (key, choose_space(key[0], weight.float()))
        return self._space_cache[1]

    def training_process(self) -> GaussianFlowProcess:
        """The process of a training step's states: over the vocabulary, or, when the state space is the embedding
        space, h = x·E with the noise z·R built from this step's E (differentiable). A sharded embedding (FSDP) is
        not a full matrix outside the network's forward: ``auto`` then keeps the one-hot states."""
        if self.state_space == "onehot":
            return self.process
        weight = self.net.token_embeddings
        full = not is_shard(weight) and tuple(weight.shape) == (self.data_vocab_size, self.net.d_model)
        if not full:
            if self.state_space == "embedding":
                raise ValueError("state_space=embedding needs the full embedding matrix: not with a sharded (FSDP) DiT")
            return self.process
        space = choose_space(self.state_space, weight)
        return GaussianFlowProcess(vocab_size=self.data_vocab_size, space=space) if space.embedded else self.process

    # -------------------------------------------------------------------------------------------- the head
    def head_input(
        self, x: Tensor, s: Tensor, t: Tensor, pinned: Tensor | None = None, *, embedded: bool = False
    ) -> Tensor:
        """The network up to its output head's input (B, L, d): log δ = log_softmax(g(head(·)))."""
        h = x if embedded else self.net.input_embeddings(x)
        return self.net.head_features(h, s, t, pinned=pinned)

    def plain_head(self) -> nn.Linear:
        """The output head, refused unless a plain Linear (an adapter's weight is not the whole head)."""
        head = self.net.output_head
        if type(head) is not nn.Linear:
            raise TypeError(f"the chunked head pass needs a plain Linear output head, got {type(head).__name__}")
        return head

    def head_bias(self, head: nn.Linear) -> Tensor | None:
        """The head's bias, with a [MASK] inside the data vocabulary at −∞ (computed per call, never a parameter:
        an optimiser or EMA step on −∞ would give NaN)."""
        if self.mask_id >= self.data_vocab_size:
            return head.bias
        bias = head.weight.new_zeros(head.out_features) if head.bias is None else head.bias
        return bias.index_fill(0, torch.tensor([self.mask_id], device=bias.device), -torch.inf)

    def summary(
        self,
        x: Tensor,
        s: Tensor,
        t: Tensor,
        pinned: Tensor | None = None,
        *,
        embedded: bool = False,
        rows: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """(max_v log δ_{s,t}(x), argmax_v) per position (B, L), from the head in vocabulary chunks
        (flowlm/ops/summary.py); with ``rows`` (n,), flat indices into the B·L positions, the head runs at those
        positions only (the blocks at every position, as attention needs) and the values come as (n,). The argmax is
        that of the logits (the cap is monotone), the first index on a tie."""
        log_max, argmax, _ = self._head_pass(x, s, t, pinned, embedded=embedded, mean=False, rows=rows)
        return log_max, argmax

    def lifted(
        self, x: Tensor, s: Tensor, t: Tensor, pinned: Tensor | None = None, *, embedded: bool = False
    ) -> Tensor:
        """δ_{s,t}(x)·E (B, L, d), the denoiser's mean in the embedding space (what a flow-map sub-step adds), from
        the head's vocabulary chunks: ``states("embedding").lift(self(...).exp())`` without a (B, L, |V|) tensor."""
        return self._head_pass(x, s, t, pinned, embedded=embedded, mean=True)[2]

    def _head_pass(
        self,
        x: Tensor,
        s: Tensor,
        t: Tensor,
        pinned: Tensor | None,
        *,
        embedded: bool,
        mean: bool,
        rows: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        head = self.plain_head()
        features = self.head_input(x, s, t, pinned, embedded=embedded)
        if rows is not None:  # the head at these positions only
            features = features.reshape(-1, features.shape[-1]).index_select(0, rows)
        table = self.net.token_embeddings if mean else None
        return head_expectation(features, head.weight, self.head_bias(head), cap=SOFT_CAP, table=table)

    def fused_head(self, fused_loss: str | bool, *, compiled: bool = False) -> tuple[Tensor, Tensor | None] | None:
        """(W, b) of the output head when the student loss runs fused from the head's input (flowlm/ops/fused_ce.py),
        else None. ``fused_loss`` true: required (a head that is not a plain, unsharded Linear is refused); false:
        never; auto: where the vocabulary is larger than the width (text; Sudoku keeps the dense loss), the head is
        a plain, unsharded Linear and the dense log-softmax is not asked to be ``compiled``."""
        if fused_loss is False:
            return None
        linear = self.net.output_head
        plain = type(linear) is nn.Linear and not is_shard(linear.weight)
        if fused_loss == "auto":
            wide = linear.out_features > linear.in_features
            return (linear.weight, self.head_bias(linear)) if plain and wide and not compiled else None
        linear = self.plain_head()
        if is_shard(linear.weight):  # a DTensor shard outside the network's forward
            raise ValueError("method.fused_loss needs the full head weight: not with a sharded (FSDP) DiT")
        return linear.weight, self.head_bias(linear)

    def denoiser(self, space: str | None = None) -> FlowDenoiser:
        """This model as flow samplers see it, reading states of its state space (or of ``space``); greedy drafts
        read its ``summary`` and flow-map sub-steps its ``lifted`` mean, from the head's chunks."""
        states = self.states(space)
        fn = functools.partial(self, embedded=True) if states.embedded else self
        if self.mask_id < self.data_vocab_size:  # a [MASK] inside the vocabulary: never drawn (see never_mask)
            fn = functools.partial(self.never_mask, fn)
        summary_fn = functools.partial(self.summary, embedded=True) if states.embedded else self.summary
        # δ·E from the head's chunks; the one-hot space's δ is its own state (no product)
        lift_fn = functools.partial(self.lifted, embedded=True) if states.embedded else None
        return FlowDenoiser(
            fn=fn, vocab_size=self.data_vocab_size, pinned_fn=fn, space=states, summary_fn=summary_fn, lift_fn=lift_fn
        )
