"""Adapting a pretrained MDM's DiT into an MLFM denoiser on embeddings (methods.md §6).

The MDM's embeddings, blocks and head are frozen. Trainable on top:
  - a fresh time embedding and, per block and for the final layer, a zero-initialised adaLN modulation applied after
    the block's own (shift/scale on the normalised input, gate in the (1 + gate) form);
  - LoRA (PEFT) on the attention and MLP Linears of every block and an additive LoRA on the output head, B = 0.
With every zero-initialised part at zero the adapted network computes exactly the MDM's logits (tested).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from peft import LoraConfig, inject_adapter_in_model
from torch import Tensor, nn

from flowlm.backbones.dit import DiT, TimeEmbedding

# Module names inside each DiT block that LoRA may target; "head" is the output Linear.
BLOCK_LINEARS = ("qkv", "attn_out", "mlp.0", "mlp.2")
TRAINABLE_PARTS = ("time_adaln", "lora", "base_adaln", "embeddings")


class MLFMAdapter(nn.Module):
    """A frozen DiT + time adaLN + LoRA: ``forward(z (B, L, d), time (B,), base_time (B,)) → logits``."""

    def __init__(
        self,
        base: DiT,
        *,
        lora_targets: Sequence[str] = BLOCK_LINEARS,
        lora_head: bool = True,
        lora_rank: int = 8,
        lora_alpha: float = 16.0,
        lora_dropout: float = 0.0,
        train: Sequence[str] = ("time_adaln", "lora"),
    ) -> None:
        super().__init__()
        unknown = sorted(set(train) - set(TRAINABLE_PARTS))
        if unknown:
            raise ValueError(f"unknown trainable parts {unknown}; known: {list(TRAINABLE_PARTS)}")
        if lora_rank < 0:
            raise ValueError(f"lora_rank must be ≥ 0, got {lora_rank}")
        self.base = base
        cond_dim = base.emb_s.mlp[-1].out_features
        d = base.d_model
        self.time_embed = TimeEmbedding(cond_dim)
        self.block_mods = nn.ModuleList(nn.Linear(cond_dim, 6 * d) for _ in base.blocks)
        self.final_mod = nn.Linear(cond_dim, 2 * d)
        for layer in (*self.block_mods, self.final_mod):  # zero modulation: the adapter starts as the MDM
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)
        self.lora_names = lora_module_names(base, lora_targets, lora_head) if lora_rank > 0 else []
        if self.lora_names:
            config = LoraConfig(
                r=lora_rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout, target_modules=self.lora_names
            )
            inject_adapter_in_model(config, base)  # in place; LoRA B = 0, so still the MDM
        self.set_trainable(train)

    def set_trainable(self, parts: Sequence[str]) -> None:
        """requires_grad only on the configured parts; everything else of the MDM stays frozen."""
        self.requires_grad_(False)
        if "time_adaln" in parts:
            for module in (self.time_embed, self.block_mods, self.final_mod):
                module.requires_grad_(True)
        for name, param in self.base.named_parameters():
            if "lora" in parts and ".lora_" in name:
                param.requires_grad_(True)
            if "base_adaln" in parts and "adaLN_modulation" in name:
                param.requires_grad_(True)
            if "embeddings" in parts and name.startswith("embed."):
                param.requires_grad_(True)

    @property
    def embeddings(self) -> Tensor:
        """The MDM's embedding matrix E (|V| + 1, d), [MASK] last."""
        return self.base.embed.weight

    def forward(self, z: Tensor, time: Tensor, base_time: Tensor) -> Tensor:
        """Logits over the MDM's vocabulary for embeddings z at time feature ``time`` (B,); ``base_time`` is what
        the MDM's own conditioning reads (0 for a time-agnostic MDM)."""
        return self.base.forward_embeddings(z, base_time, extra=self._modulation(time))

    def _modulation(self, time: Tensor) -> list[Tensor]:
        """The adapter's adaLN modulation of every block and of the final layer at time feature ``time`` (B,)."""
        c = torch.nn.functional.silu(self.time_embed(time[:, None]))  # (B, 1, cond): one time per sequence
        return [mod(c) for mod in self.block_mods] + [self.final_mod(c)]

    def head_parts(
        self, z: Tensor, time: Tensor, base_time: Tensor
    ) -> tuple[Tensor, Tensor, Tensor | None, tuple[Tensor, Tensor] | None]:
        """``forward``'s logits as (features, W, b, low-rank part) with logits = features·Wᵀ + b + u·Bᵀ (the head's
        LoRA: u = scaling · A(features), B (|V|, r); None without one), for callers that apply the head in
        vocabulary chunks (``flowlm.ops.summary.head_expectation``). Eval mode only: LoRA dropout would make
        the chunks disagree."""
        if self.training:
            raise RuntimeError("head_parts is for evaluation (LoRA dropout is active in training mode)")
        features = self.base.head_features(z, base_time, extra=self._modulation(time))
        return (features, *linear_head_parts(self.base.final.linear, features))

    def base_state_names(self) -> dict[str, str]:
        """This adapter's base parameter names → the plain DiT's names (PEFT inserts ``.base_layer``)."""
        return {name: name.replace(".base_layer", "") for name in self.base.state_dict() if ".lora_" not in name}


def linear_head_parts(head: nn.Module, features: Tensor) -> tuple[Tensor, Tensor | None, tuple[Tensor, Tensor] | None]:
    """An output head (a Linear, or a PEFT LoRA Linear around one) as (W, b, low-rank part): head(features) =
    features·Wᵀ + b + u·Bᵀ with u = scaling · A(features) (None without an active adapter), so that a caller can
    apply it in vocabulary chunks. One plain LoRA adapter only (no DoRA, no LoRA bias); dropout must be off (eval)."""
    if type(head) is nn.Linear:
        return head.weight, head.bias, None
    base_layer = head.get_base_layer()
    adapters = [name for name in head.active_adapters if name in head.lora_A]
    if head.merged or head.disable_adapters or not adapters:  # the base layer alone computes the head
        return base_layer.weight, base_layer.bias, None
    if len(adapters) > 1 or adapters[0] in head.lora_variant or head.lora_B[adapters[0]].bias is not None:
        raise TypeError("the chunked head supports one plain LoRA adapter (no DoRA, no LoRA bias)")
    name = adapters[0]
    u = head.lora_A[name](features.to(head.lora_A[name].weight.dtype)) * head.scaling[name]
    return base_layer.weight, base_layer.bias, (u, head.lora_B[name].weight)


def lora_module_names(base: DiT, targets: Sequence[str], head: bool) -> list[str]:
    """Full names of the Linears LoRA wraps: each block's ``targets`` (suffixes such as ``qkv``, ``mlp.0``) and the
    output head; a target that matches no Linear is an error (before any compute)."""
    unknown = sorted(set(targets) - set(BLOCK_LINEARS))
    if unknown:
        raise ValueError(f"LoRA targets {unknown} match no module of the DiT blocks; known: {list(BLOCK_LINEARS)}")
    linears = {name for name, module in base.named_modules() if isinstance(module, nn.Linear)}
    names = [f"blocks.{i}.{target}" for i in range(len(base.blocks)) for target in targets]
    if head:
        names.append("final.linear")
    missing = [name for name in names if name not in linears]
    if missing:
        raise ValueError(f"LoRA targets match no Linear: {missing[:4]}")
    if not names:
        raise ValueError("LoRA has no targets: give lora_targets or lora_head=true, or set lora_rank=0")
    return names
