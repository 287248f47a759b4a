"""MLFM as its sampler and loss read the adapted MDM: logits over the data vocabulary for bridge states z at bridge
times t, and the posterior's summaries (methods.md §6)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from flowlm.models.mdm import drop_mask_logit
from flowlm.ops.summary import head_expectation
from flowlm.processes.bridge import BridgeProcess
from flowlm.samplers.mlfm import BridgeDenoiser


@dataclass(eq=False)
class BridgeModel:
    """The adapter ``net(z, condition(t), base_time)`` over the frozen MDM; the MDM's own conditioning reads 0 (the
    suite's MDMs are time-agnostic by default)."""

    net: nn.Module
    process: BridgeProcess
    data_vocab_size: int
    mask_id: int

    def __call__(self, z: Tensor, t: Tensor) -> Tensor:
        """Logits over data ids + [MASK] for embeddings z (B, L, d) at bridge times t (B,)."""
        return self.net(z, self.process.condition(t), torch.zeros_like(t))

    def data_logits(self, z: Tensor, t: Tensor) -> Tensor:
        """Logits over the data vocabulary (B, L, |V|), [MASK] removed."""
        return drop_mask_logit(self(z, t), self.data_vocab_size, self.mask_id)

    def denoiser(self) -> BridgeDenoiser:
        """This model as the MLFM sampler sees it: data logits and the embedding table with its [MASK] row; also
        ``posterior``, where the adapter exposes its head (``head_parts``) and the network is in eval mode."""
        emb = self.net.embeddings
        chunked = not self.net.training and getattr(self.net, "head_parts", None) is not None
        return BridgeDenoiser(
            fn=self.data_logits,
            table=emb,
            mask_id=self.mask_id,
            data_vocab_size=self.data_vocab_size,
            process=self.process,
            posterior_fn=self.posterior if chunked else None,
        )

    def posterior(self, z: Tensor, t: Tensor, *, mean: bool = True) -> tuple[Tensor, Tensor, Tensor | None]:
        """(log max_v p, argmax_v, x̂₁ = p·E or None) over the data vocabulary, p = softmax of the data logits, from
        the head's vocabulary chunks (flowlm/ops/summary.py): no (B, L, |V|) tensor."""
        features, weight, bias, low_rank = self.net.head_parts(z, self.process.condition(t), torch.zeros_like(t))
        v = self.data_vocab_size  # the head's rows [0, |V|): a DiT's [MASK] row |V| dropped
        bias = None if bias is None else bias[:v]
        if self.mask_id < v:  # a [MASK] inside the vocabulary (LLaDA, Dream): its logit −∞ through the bias
            bias = weight.new_zeros(v) if bias is None else bias
            bias = bias.index_fill(0, torch.tensor([self.mask_id], device=bias.device), -torch.inf)
        if low_rank is not None:
            low_rank = (low_rank[0], low_rank[1][:v])
        table = self.net.embeddings[:v] if mean else None
        # x̂₁ in the caller's autocast, as the sampler's q·E from the whole posterior
        return head_expectation(features, weight[:v], bias, table=table, low_rank=low_rank, mean_autocast=True)
