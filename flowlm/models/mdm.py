"""The MDM as samplers and its loss read it: logits over the data vocabulary, [MASK] removed (SUBS, methods.md §2)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from flowlm.backbones.dit import DiT
from flowlm.samplers.base import MaskedDenoiser, data_head, plain_linear


def drop_mask_logit(logits: Tensor, data_vocab_size: int, mask_id: int) -> Tensor:
    """Logits over the data vocabulary (B, L, V), [MASK] removed (SUBS, methods.md §2): a DiT's extra last column
    dropped (a slice), a [MASK] inside the vocabulary (LLaDA/Dream) set to −∞."""
    logits = logits[..., :data_vocab_size]
    if mask_id < data_vocab_size:
        logits = logits.index_fill(-1, torch.tensor([mask_id], device=logits.device), -torch.inf)
    return logits


@dataclass(eq=False)
class MaskedModel:
    """A network over data ids + [MASK] (``mask_id``); time-agnostic (MDLM/SMDM: t is fed as 0) unless
    ``time_conditioning``."""

    net: nn.Module
    data_vocab_size: int
    mask_id: int
    time_conditioning: bool = False

    def __call__(self, x: Tensor, t: Tensor) -> Tensor:
        """The network's logits (B, L, V+1; a LLaMA-family head: B, L, V) at times t (B,)."""
        return self.net(x, t if self.time_conditioning else torch.zeros_like(t))

    def data_logits(self, logits: Tensor) -> Tensor:
        """Logits over the data vocabulary (B, L, V), [MASK] removed."""
        return drop_mask_logit(logits, self.data_vocab_size, self.mask_id)

    def windowed(self, length: int, head: bool = False) -> Callable[..., Tensor | tuple]:
        """A reader over a new block KV cache of ``length`` positions (flowlm/samplers/block_cache.py): ``(x window
        (B, n), t, start, fresh) → data logits (B, n, V)`` of positions start … start + n − 1, the window's keys
        written where ``fresh`` (B, n) holds (None: all); a window from 0 over the whole sequence is a full pass.
        ``head`` (where ``chunked_head``): ``(features (B, n, d), W, b)`` as ``head_pass`` gives them instead."""
        cache = self.net.new_block_cache(length)
        linear = data_head(self.net.output_head, self.data_vocab_size, self.mask_id) if head else None

        def read(x: Tensor, t: Tensor, start: int, fresh: Tensor | None = None) -> Tensor | tuple:
            time = t if self.time_conditioning else torch.zeros_like(t)
            if linear is not None:  # the head's input: the sampler runs the head at the rows it reads
                return (self.net.forward_window(x, time, cache, start, fresh, features=True), *linear)
            return self.data_logits(self.net.forward_window(x, time, cache, start, fresh))

        return read

    def head_pass(self, x: Tensor, t: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """(features (B, L, d), W (V, d), b (V,) or None): the network up to its output head's input at times t, and
        the head's rows of the data vocabulary ([MASK] dropped; a [MASK] inside the vocabulary at −∞ by the bias, as
        ``drop_mask_logit``): ``data_logits(self(x, t))`` = features·Wᵀ + b."""
        time = t if self.time_conditioning else torch.zeros_like(t)
        features = self.net.head_features(self.net.input_embeddings(x), time)
        return (features, *data_head(self.net.output_head, self.data_vocab_size, self.mask_id))

    def chunked_head(self) -> bool:
        """Whether samplers may read the head in vocabulary chunks (``head_pass``): a bidirectional DiT or LLaMA-family
        network (SMDM, LLaDA, Dream; tied or untied) whose head is a plain, unsharded Linear (not an adapter's, not an
        FSDP shard)."""
        # the LLaMA family by its marker (importing its class here would import transformers for every DiT user)
        llama = getattr(type(self.net), "mdm_head", False)
        bidirectional = (isinstance(self.net, DiT) and not self.net.causal) or llama
        return bidirectional and plain_linear(getattr(self.net, "output_head", None))

    def denoiser(self) -> MaskedDenoiser:
        """This model as MDM samplers see it (with windowed passes, and the chunked head where ``chunked_head``)."""
        windows = hasattr(self.net, "forward_window") and not getattr(self.net, "causal", False)
        return MaskedDenoiser(
            fn=lambda x, t: self.data_logits(self(x, t)),
            mask_id=self.mask_id,
            time_conditioned=self.time_conditioning,
            windowed=self.windowed if windows else None,
            head_fn=self.head_pass if self.chunked_head() else None,
        )
