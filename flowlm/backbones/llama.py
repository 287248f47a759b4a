"""Bidirectional LLaMA-style MDM backbone (SMDM, LLaDA, Dream) on transformers' Llama / Qwen2 decoders.

The decoder is transformers' own ``LlamaModel`` / ``Qwen2Model`` built with ``is_causal=False`` (transformers 5.x
then builds a bidirectional mask; docs/pretrained.md "LLaMA-family MDMs"), plus an untied output head whose row
count may differ from the embedding's (SMDM: the [MASK] row exists in the embedding only). Call contract as the
DiT's (``forward(x, s, t=None) → logits``): token ids or vectors over the embedding rows in, logits out; the times are
accepted and ignored, since these MDMs are time-agnostic.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from contextlib import nullcontext

import torch
from torch import Tensor, nn
from transformers import LlamaConfig, LlamaModel, Qwen2Config, Qwen2Model
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from flowlm.backbones.adapters import linear_head_parts
from flowlm.backbones.dit import PinnedCondition, modulation
from flowlm.samplers.base import MaskedDenoiser, data_head, plain_linear

# arch → (config class, decoder class, rotary class). Qwen2 has q/k/v biases (Dream); Llama has none (SMDM, LLaDA).
ARCHS: dict[str, tuple[type, type, type]] = {
    "llama": (LlamaConfig, LlamaModel, LlamaRotaryEmbedding),
    "qwen2": (Qwen2Config, Qwen2Model, Qwen2RotaryEmbedding),
}


class BidirectionalLM(nn.Module):
    """transformers' Llama/Qwen2 decoder run bidirectionally + an untied head: ``forward(x, s, t) → logits``.

    embed_rows: rows of the token embedding (every input id, [MASK] included); head_rows: logits per position
    (SMDM: embed_rows − 1, no [MASK] logit; LLaDA/Dream: equal, [MASK] inside the vocabulary).
    shift_logits: Dream's convention, the prediction for position i is the raw output at i − 1 (position 0 keeps
    its own): ``logits = cat(raw[:, :1], raw[:, :-1])``.
    """

    mdm_head = True  # logits = output_head(head_features(input_embeddings(x), t)): MaskedModel.head_pass reads it

    def __init__(
        self,
        *,
        arch: str = "llama",
        embed_rows: int,
        head_rows: int,
        hidden_size: int,
        n_layers: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        intermediate_size: int,
        rope_theta: float = 10_000.0,
        rms_norm_eps: float = 1e-5,
        max_positions: int = 4096,
        mask_id: int,
        shift_logits: bool = False,
        attn_implementation: str = "sdpa",
        device: str | torch.device | None = None,
    ) -> None:
        super().__init__()
        if arch not in ARCHS:
            raise ValueError(f"unknown arch {arch!r}; known: {sorted(ARCHS)}")
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if hidden_size % n_heads or n_heads % n_kv_heads:
            raise ValueError(
                f"need hidden_size % n_heads == 0 and n_heads % n_kv_heads == 0; got {hidden_size}, {n_heads}, "
                f"{n_kv_heads}"
            )
        if not 0 <= mask_id < embed_rows or not 1 <= head_rows <= embed_rows:
            raise ValueError(
                f"need 0 ≤ mask_id < embed_rows and 1 ≤ head_rows ≤ embed_rows; got mask_id={mask_id}, "
                f"embed_rows={embed_rows}, head_rows={head_rows}"
            )
        config_cls, model_cls, self._rotary_cls = ARCHS[arch]
        self.spec = {
            "arch": arch,
            "embed_rows": embed_rows,
            "head_rows": head_rows,
            "hidden_size": hidden_size,
            "n_layers": n_layers,
            "n_heads": n_heads,
            "n_kv_heads": n_kv_heads,
            "intermediate_size": intermediate_size,
            "rope_theta": float(rope_theta),
            "rms_norm_eps": float(rms_norm_eps),
            "max_positions": max_positions,
            "mask_id": mask_id,
            "shift_logits": shift_logits,
        }
        self.config = config_cls(
            vocab_size=embed_rows,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            hidden_act="silu",
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv_heads,
            max_position_embeddings=max_positions,
            rms_norm_eps=rms_norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
            tie_word_embeddings=False,
            pad_token_id=None,  # no padding_idx row in the embedding
            use_cache=False,
            is_causal=False,  # bidirectional attention: create_causal_mask → create_bidirectional_mask
            attn_implementation=attn_implementation,
        )
        self.mask_id = mask_id
        self.vocab_size = embed_rows  # what continuous inputs (B, L, embed_rows) are read against
        self.head_rows = head_rows
        self.shift_logits = shift_logits
        self.d_model = hidden_size
        with torch.device(device) if device is not None else nullcontext():
            self.model = model_cls(self.config)
            self.lm_head = nn.Linear(hidden_size, head_rows, bias=False)

    @classmethod
    def from_state(cls, spec: dict, state: dict[str, Tensor], dtype: torch.dtype | None = None) -> BidirectionalLM:
        """A model of ``spec`` holding ``state`` (this class's names: ``model.*``, ``lm_head.weight``), built on the
        meta device and filled strictly without a random initialisation (8 B parameters load without a copy). A
        ``state`` of meta tensors (a rank whose weights rank 0 broadcasts under FSDP2) leaves the whole model on the
        meta device, RoPE buffers included, in the stored dtypes (``lightning_modules.sharding.shard`` fills it)."""
        model = cls(**spec, device="meta")
        if dtype is not None:
            state = {key: value.to(dtype) for key, value in state.items()}
        model.load_state_dict(state, strict=True, assign=True)
        if not any(value.is_meta for value in state.values()):
            model.materialize_rotary()
        return model.eval()

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder layers (FSDP2 shards each, adapters wrap each)."""
        return self.model.layers

    def materialize_rotary(self, device: str | torch.device = "cpu") -> None:
        """Rebuild the RoPE inverse-frequency buffers (non-persistent, so a meta-device build loaded with
        ``load_state_dict(assign=True)`` leaves them on the meta device)."""
        with torch.device(device):
            self.model.rotary_emb = self._rotary_cls(config=self.config)

    def covers_data(self, data_vocab_size: int) -> bool:
        """Whether this head serves data of ``data_vocab_size`` ids: equal sizes, or (LLaDA, Dream: [MASK] inside the
        data vocabulary) a head padded beyond the tokenizer, whose extra rows no data id reaches (the logits are cut
        to the data's ids). A larger data vocabulary, or a larger head without [MASK] among the data ids (SMDM's
        layout, a random backbone, a foreign tokenizer), is not."""
        return self.head_rows == data_vocab_size or self.mask_id < data_vocab_size < self.head_rows

    def cut_head(self, rows: int) -> None:
        """Keep the head's first ``rows`` rows (a copy; ``head_rows`` and the spec follow): a head padded beyond the
        tokenizer (LLaDA, Dream) cut to the data ids, for a network whose output size is the data vocabulary (the
        FMLM+ flow's |V|). Rows no data id reaches are all it may drop: more rows than the head has, or a cut that
        would drop [MASK] while keeping a head row past it, is refused."""
        if rows == self.head_rows:
            return
        if not self.covers_data(rows):
            raise ValueError(
                f"cannot cut a head of {self.head_rows} rows ([MASK] = id {self.mask_id}) to {rows}: only rows past "
                "the data vocabulary of a head with [MASK] among the data ids may be dropped"
            )
        old = self.lm_head.weight
        self.lm_head = nn.Linear(old.shape[1], rows, bias=False, device=old.device, dtype=old.dtype)
        if old.device.type != "meta":
            with torch.no_grad():
                self.lm_head.weight.copy_(old[:rows])
        self.head_rows = rows
        self.spec = {**self.spec, "head_rows": rows}

    def input_embeddings(self, x: Tensor) -> Tensor:
        """Token ids → E[x]; vectors over the embedding rows (B, L, embed_rows) → x·E."""
        weight = self.model.embed_tokens.weight
        if not x.is_floating_point():
            return self.model.embed_tokens(x)
        if x.shape[-1] != self.vocab_size:
            raise ValueError(f"continuous input has last dim {x.shape[-1]}, expected embed_rows={self.vocab_size}")
        return x.to(weight.dtype) @ weight

    def forward(
        self, x: Tensor, s: Tensor | None = None, t: Tensor | None = None, *, attention_mask: Tensor | None = None
    ) -> Tensor:
        """Logits (B, L, head_rows) for ids or vectors x; ``s``/``t`` are ignored (a time-agnostic MDM);
        ``attention_mask`` (B, L), 1 = attend, keeps padded keys out (LLaDA's released snapshot attends to all)."""
        return self.forward_embeddings(self.input_embeddings(x), attention_mask=attention_mask)

    def forward_embeddings(self, h: Tensor, *, attention_mask: Tensor | None = None) -> Tensor:
        """Logits for inputs given as embeddings h (B, L, d), with the source's shift convention applied."""
        return self.lm_head(self.head_features(h, attention_mask=attention_mask))

    @property
    def output_head(self) -> nn.Module:
        """The output head Linear(d, head_rows): the logits are it applied to ``head_features``."""
        return self.lm_head

    def head_features(self, h: Tensor, s: Tensor | None = None, *, attention_mask: Tensor | None = None) -> Tensor:
        """``forward_embeddings`` up to the head's input (B, L, d), shifted as the logits are (the head is per
        position, so shifting its input shifts its output): the logits are ``lm_head`` of it. ``s`` is ignored (a
        time-agnostic MDM; the DiT's call shape)."""
        if h.shape[1] > self.spec["max_positions"]:
            raise ValueError(f"sequence length {h.shape[1]} exceeds max_positions={self.spec['max_positions']}")
        out = self.model(inputs_embeds=h, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return shift_logits(out) if self.shift_logits else out

    def new_block_cache(self, length: int) -> BlockCache:
        """An empty block KV cache over ``length`` positions (flowlm/samplers/block_cache.py)."""
        if length > self.spec["max_positions"]:
            raise ValueError(f"sequence length {length} exceeds max_positions={self.spec['max_positions']}")
        return BlockCache(len(self.layers), length)

    def forward_window(
        self, x: Tensor, s: Tensor | None, cache: BlockCache, start: int, fresh: Tensor | None = None, *, features=False
    ) -> Tensor:
        """Logits (B, n, head_rows) of positions start … start + n − 1 (ids x (B, n)) through transformers' own
        layers at those position ids, attending bidirectionally to every position's keys and values: the window's
        from this pass where ``fresh`` (B, n) holds (all: None), the cache's elsewhere; stores the fresh ones. With
        start 0 and the whole sequence it is ``forward`` and fills the cache. ``s`` is ignored (time-agnostic).
        ``features``: the head's input (B, n, d) instead (``lm_head`` of it is the logits).

        Shifted logits (Dream): position p reads the output at p − 1, so a window from start > 0 also runs position
        start − 1 (its id as the cache holds it), a query only: its keys are not written."""
        b, n = x.shape
        if start < 0 or start + n > cache.max_len:
            raise ValueError(f"window {start} … {start + n - 1} outside the cache's {cache.max_len} positions")
        widen = self.shift_logits and start > 0
        if widen:
            if cache.ids is None:
                raise ValueError("a block KV cache is filled by a full pass (start 0, every position) first")
            x = torch.cat([cache.ids[:, start - 1 : start], x], dim=1)
            edge = torch.zeros(b, 1, dtype=torch.bool, device=x.device)
            fresh = torch.cat([edge, torch.ones_like(x[:, 1:], dtype=torch.bool) if fresh is None else fresh], dim=1)
            start -= 1
        cache.window(x, start, fresh)
        positions = torch.arange(start, start + x.shape[1], device=x.device)[None]
        out = self.model(
            inputs_embeds=self.input_embeddings(x), position_ids=positions, cache=cache, use_cache=True
        ).last_hidden_state
        if widen:  # outputs at start − 1 … start + n − 2 are the predictions for start … start + n − 1
            out = out[:, :-1]
        elif self.shift_logits:
            out = shift_logits(out)
        return out if features else self.lm_head(out)

    def token_logits(self, x: Tensor) -> Tensor:
        """Logits over the head's tokens with the [MASK] logit (when the head has one) at −∞: a sampler never
        proposes [MASK] (MDLM's SUBS zero-masking; LLaDA/Dream keep [MASK] inside their vocabulary)."""
        return self.without_mask_logit(self(x))

    def without_mask_logit(self, logits: Tensor) -> Tensor:
        """``logits`` with the [MASK] logit (when the head has one) at −∞."""
        if self.mask_id < self.head_rows:
            logits = logits.index_fill(-1, torch.tensor([self.mask_id], device=logits.device), -torch.inf)
        return logits

    def denoiser(self) -> MaskedDenoiser:
        """This model as the MDM samplers see it (time-agnostic), with windowed passes over a block KV cache and, where
        its head is a plain Linear, the head in vocabulary chunks (``head_fn``). With shifted logits position 0 has no
        prediction (Dream's generation asserts it is unmasked: BOS or prompt), so a [MASK] there is refused before the
        call."""

        def check(x: Tensor) -> None:
            # one host read per call, negligible beside a pretrained model's forward
            if self.shift_logits and bool((x[:, 0] == self.mask_id).any()):
                raise ValueError("a shifted-logits model (Dream) predicts nothing at position 0: keep it unmasked")

        def fn(x: Tensor, t: Tensor) -> Tensor:
            check(x)
            return self.token_logits(x)

        def head(x: Tensor, t: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
            check(x)  # fn's logits are features·Wᵀ + b: the head in vocabulary chunks at the rows a sampler reads
            return (
                self.head_features(self.input_embeddings(x)),
                *data_head(self.lm_head, self.head_rows, self.mask_id),
            )

        def windowed(length: int, head: bool = False):
            cache = self.new_block_cache(length)
            linear = data_head(self.lm_head, self.head_rows, self.mask_id) if head else None

            def read(x: Tensor, t: Tensor, start: int, fresh: Tensor | None = None):
                if start == 0:
                    check(x)
                if linear is not None:  # the head's input: the sampler runs the head at the rows it reads
                    return (self.forward_window(x, t, cache, start, fresh, features=True), *linear)
                return self.without_mask_logit(self.forward_window(x, t, cache, start, fresh))

            return read

        return MaskedDenoiser(
            fn=fn,
            mask_id=self.mask_id,
            time_conditioned=False,
            windowed=windowed,
            head_fn=head if plain_linear(self.lm_head) else None,
        )


class BlockCacheLayer(CacheLayerMixin):
    """One decoder layer's keys and values (B, H_kv, length, head_dim) at every position, rotated at their own
    positions: a pass over the window ``start`` … (set by ``BlockCache.window``) writes its keys where ``fresh``
    holds and returns every position's (bidirectional attention, no mask)."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self.length, self.start, self.fresh = length, 0, None

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:  # noqa: D102
        self.keys, self.values = key_states.clone(), value_states.clone()
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:  # noqa: D102
        if not self.is_initialized:  # the filling pass (every position: BlockCache.window checked it)
            self.lazy_initialization(key_states, value_states)
            return self.keys, self.values
        window = slice(self.start, self.start + key_states.shape[-2])
        for stored, new in ((self.keys, key_states), (self.values, value_states)):
            if self.fresh is not None:
                new = torch.where(self.fresh[:, None, :, None], new, stored[:, :, window])
            stored[:, :, window] = new
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:  # noqa: D102
        return self.length, 0  # every query sees every position's key

    def get_seq_length(self) -> int:  # noqa: D102
        return self.length if self.is_initialized else 0

    def get_max_length(self) -> int:  # noqa: D102
        return self.length


class BlockCache(Cache):
    """transformers' ``Cache`` over ``BlockCacheLayer`` s: the LLaMA family's block KV cache for semi-autoregressive
    decoding (flowlm/samplers/block_cache.py), with the ids each position was last run with (B, length), which a
    shifted-logits window reads at its left edge."""

    def __init__(self, n_layers: int, length: int) -> None:
        super().__init__(layers=[BlockCacheLayer(length) for _ in range(n_layers)])
        self.max_len = length
        self.ids: Tensor | None = None

    def window(self, x: Tensor, start: int, fresh: Tensor | None) -> None:
        """The next pass runs ids x (B, n) at positions start … start + n − 1, writing keys where ``fresh``."""
        n = x.shape[1]
        if self.ids is None:
            if start != 0 or n != self.max_len:
                raise ValueError("a block KV cache is filled by a full pass (start 0, every position) first")
            self.ids = x.clone()
        elif fresh is None:
            self.ids[:, start : start + n] = x
        else:
            self.ids[:, start : start + n] = torch.where(fresh, x, self.ids[:, start : start + n])
        for layer in self.layers:
            layer.start, layer.fresh = start, fresh


def shift_logits(raw: Tensor) -> Tensor:
    """Dream's shift: out[:, i] = raw[:, i − 1] for i ≥ 1, out[:, 0] = raw[:, 0] (position 0 is never scored)."""
    return torch.cat([raw[:, :1], raw[:, :-1]], dim=1)


# ---------------------------------------------------------------------------------------------------- adapter
# Linears of every decoder layer LoRA may target (names under model.layers.{i}.); "lm_head" is the untied head.
LAYER_LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
# Parts an adapter can train: its time adaLN, the LoRA factors, the token embedding, the whole base (FMLM+'s default).
ADAPTER_PARTS = ("time_adaln", "lora", "embeddings", "base")


class LlamaAdaLNAdapter(nn.Module):
    """A frozen ``BidirectionalLM`` + zero-initialised time adaLN per decoder layer + PEFT LoRA (methods.md §4, §6).

    Per layer l, from c = SiLU(emb_s(s) [+ emb_t(t)]) (per sequence or per token): (shift₁, scale₁, gate₁, shift₂,
    scale₂, gate₂) = W_l c, applied around transformers' own layer through forward hooks (no copy of its code):

        h ← h + (1 + gate₁) ⊙ Attn(RMSNorm₁(h) ⊙ (1 + scale₁) + shift₁)
        h ← h + (1 + gate₂) ⊙ MLP(RMSNorm₂(h) ⊙ (1 + scale₂) + shift₂)

    W_l = 0 and LoRA B = 0 at init, so the adapted network computes the MDM's logits exactly (MLFM: one bridge time
    per sequence, ``two_times=False``; MDM-initialised FMLM+: per-token (s, t), ``two_times=True``, continuous input
    x·E through the MDM's embedding). LoRA wraps the layers' q/k/v/o and MLP projections and, with ``lora_head``,
    the untied head (additive LoRA on it: the head stays the MDM's at init).
    """

    def __init__(
        self,
        base: BidirectionalLM,
        *,
        cond_dim: int = 512,
        two_times: bool = False,
        lora_rank: int = 8,
        lora_alpha: float = 16.0,
        lora_dropout: float = 0.0,
        lora_targets: tuple[str, ...] | list[str] = LAYER_LINEARS,
        lora_head: bool = True,
        train: tuple[str, ...] | list[str] = ("time_adaln", "lora"),
    ) -> None:
        super().__init__()
        from peft import LoraConfig, inject_adapter_in_model

        from flowlm.backbones.dit import TimeEmbedding

        unknown = sorted(set(train) - set(ADAPTER_PARTS)) + sorted(set(lora_targets) - set(LAYER_LINEARS))
        if unknown or lora_rank < 0:
            raise ValueError(
                f"unknown trainable parts / LoRA targets {unknown} (known: {list(ADAPTER_PARTS)}, "
                f"{list(LAYER_LINEARS)}) or lora_rank {lora_rank} < 0"
            )
        self.base = base
        self.two_times = two_times
        d = base.d_model
        self.emb_s = TimeEmbedding(cond_dim)
        self.emb_t = TimeEmbedding(cond_dim) if two_times else None
        self.layer_mods = nn.ModuleList(nn.Linear(cond_dim, 6 * d) for _ in base.layers)
        for mod in self.layer_mods:  # zero modulation: the adapter starts as the MDM
            nn.init.zeros_(mod.weight)
            nn.init.zeros_(mod.bias)
        names = [f"model.layers.{i}.{target}" for i in range(len(base.layers)) for target in lora_targets]
        names += ["lm_head"] if lora_head else []
        self.lora_names = names if lora_rank > 0 else []
        if self.lora_names:
            config = LoraConfig(r=lora_rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout, target_modules=names)
            inject_adapter_in_model(config, base)  # in place; LoRA B = 0, so still the MDM
        self._mods: list[tuple[Tensor, ...]] | None = None  # this call's per-layer chunks, read by the hooks
        # partials of a bound method, not closures: a deep copy of the adapter rebinds them to the copy (a closure
        # would keep reading the original's modulation)
        for i, layer in enumerate(base.layers):
            layer.input_layernorm.register_forward_hook(functools.partial(self._hook, i, "norm", 0))
            layer.self_attn.register_forward_hook(functools.partial(self._hook, i, "gate", 2))
            layer.post_attention_layernorm.register_forward_hook(functools.partial(self._hook, i, "norm", 3))
            layer.mlp.register_forward_hook(functools.partial(self._hook, i, "gate", 5))
        self.set_trainable(train)

    def _hook(self, layer: int, kind: str, slot: int, module: nn.Module, args: tuple, output):
        """The forward hook that modulates a norm's output (shift/scale) or a branch's output ((1 + gate))."""
        if self._mods is None:  # the base called on its own: unchanged
            return output
        chunks = self._mods[layer]
        if kind == "norm":
            return output * (1 + chunks[slot + 1]) + chunks[slot]
        if isinstance(output, tuple):  # attention returns (output, weights)
            return (output[0] * (1 + chunks[slot]), *output[1:])
        return output * (1 + chunks[slot])

    def recompute_context(self) -> contextlib.AbstractContextManager:
        """A context that restores this call's modulation (read now) while activation checkpointing recomputes a
        decoder layer in backward, after ``forward_embeddings`` has cleared it (lightning_modules/sharding.py)."""
        return self._with_mods(self._mods)

    @contextlib.contextmanager
    def _with_mods(self, mods: list[tuple[Tensor, ...]] | None) -> Iterator[None]:
        saved, self._mods = self._mods, mods
        try:
            yield
        finally:
            self._mods = saved

    def set_trainable(self, parts: tuple[str, ...] | list[str]) -> None:
        """requires_grad only on the configured parts; the MDM stays frozen."""
        self.requires_grad_(False)
        if "time_adaln" in parts:
            for module in (self.emb_s, self.emb_t, self.layer_mods):
                if module is not None:
                    module.requires_grad_(True)
        for name, param in self.base.named_parameters():
            lora = ".lora_" in name
            if ("lora" in parts and lora) or ("embeddings" in parts and "embed_tokens" in name):
                param.requires_grad_(True)
            if "base" in parts and not lora:  # the MDM itself fine-tuned (FMLM+, as the released DiT init)
                param.requires_grad_(True)

    @property
    def embeddings(self) -> Tensor:
        """The MDM's input embedding matrix (embed_rows, d)."""
        return self.base.model.embed_tokens.weight

    def condition(self, s: Tensor, t: Tensor | None = None) -> Tensor:
        """c = SiLU(emb_s(s) [+ emb_t(t)]): (B, 1, cond) for per-sequence times (B,), (B, L, cond) per token."""
        if (t is not None) != self.two_times:
            raise ValueError(
                f"adapter built with two_times={self.two_times}, called {'with' if t is not None else 'without'} t"
            )
        s = s[:, None] if s.dim() == 1 else s
        c = self.emb_s(s)
        if t is not None:
            c = c + self.emb_t(t[:, None] if t.dim() == 1 else t)
        return torch.nn.functional.silu(c)

    def forward_embeddings(self, h: Tensor, s: Tensor, t: Tensor | None = None) -> Tensor:
        """Logits for embeddings h (B, L, d) at times s [, t] (per sequence (B,) or per token (B, L))."""
        return self.base.lm_head(self.head_features(h, s, t))

    def head_features(self, h: Tensor, s: Tensor, t: Tensor | None = None) -> Tensor:
        """``forward_embeddings`` up to the head's input (B, L, d): the logits are ``base.lm_head`` of it."""
        c = self.condition(s, t)  # in the adapter's dtype; the chunks in the (frozen) base's
        self._mods = [mod(c).to(h.dtype).chunk(6, dim=-1) for mod in self.layer_mods]
        try:
            return self.base.head_features(h)
        finally:
            self._mods = None

    def forward(self, x: Tensor, s: Tensor, t: Tensor | None = None) -> Tensor:
        """Logits for ids or vectors x (vectors: x·E through the MDM's embedding) at times s [, t]."""
        return self.forward_embeddings(self.base.input_embeddings(x), s, t)

    def base_state_names(self) -> dict[str, str]:
        """This adapter's base parameter names → the plain backbone's (PEFT inserts ``.base_layer``)."""
        return {name: name.replace(".base_layer", "") for name in self.base.state_dict() if ".lora_" not in name}


class LlamaMLFMAdapter(LlamaAdaLNAdapter):
    """``LlamaAdaLNAdapter`` with MLFM's call contract (flowlm/backbones/adapters.py ``MLFMAdapter``): one bridge
    time per sequence on input embeddings, ``forward(z (B, L, d), time (B,), base_time (B,)) → logits``
    (``base_time`` is ignored: the LLaMA-family MDMs are time-agnostic)."""

    def __init__(self, base: BidirectionalLM, **options) -> None:
        super().__init__(base, two_times=False, **options)

    def forward(self, z: Tensor, time: Tensor, base_time: Tensor | None = None) -> Tensor:  # type: ignore[override]
        """Logits for embeddings z (B, L, d) at time feature ``time`` (B,)."""
        return self.forward_embeddings(z, time)

    def head_parts(
        self, z: Tensor, time: Tensor, base_time: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor | None, tuple[Tensor, Tensor] | None]:
        """``forward``'s logits as (features, W, b, low-rank part), as ``MLFMAdapter.head_parts`` (eval mode)."""
        if self.training:
            raise RuntimeError("head_parts is for evaluation (LoRA dropout is active in training mode)")
        features = self.head_features(z, time)
        return (features, *linear_head_parts(self.base.lm_head, features))


class LlamaFlowNet(LlamaAdaLNAdapter):
    """The FMLM+ network on a LLaMA-family MDM (methods.md §4): ``LlamaAdaLNAdapter(two_times=True)`` with the DiT's
    call contract, ``forward(x, s, t, *, pinned=None) → logits``, ``forward_embeddings``, ``head_features``,
    ``input_embeddings``, ``token_embeddings``, ``output_head``, ``d_model``, ``emb_t`` (what FMLMPlusModule reads).

    Vocabulary: the flow states are over the data vocabulary, |V| = the head's rows (``data_vocab_size`` first cuts
    a head padded beyond the tokenizer, LLaDA's and Dream's, to the data ids: ``BidirectionalLM.cut_head``). A
    continuous input x (…, |V|) is read as h = x·E with E = the embedding's first |V| rows (``token_embeddings``),
    in float32 as the released DiT's ``input_fp32``. SMDM: [MASK] is the extra last embedding row, never read by a
    flow state (kept, unused, so the tensors keep the MDM's shapes); LLaDA/Dream: [MASK] is one of the |V| rows and
    columns, its logit removed by FMLMPlusModule (−∞ before the soft cap, as the MDM module's SUBS). Logits are the
    base's raw ones.

    Times: s, t per sequence (B,) or per token (B, L); with ``pinned`` (B, L) the times are per sequence and the
    pinned tokens sit at s = t = 1 (the DiT's ``PinnedCondition``: the adaLN Linears run on B + 1 rows). Shifted logits
    (Dream): hidden position j predicts token j + 1, so it is conditioned on that token's times (c_j ← c_{j+1}; the
    last position, which predicts nothing, keeps its own).

    What trains (``train``): the whole network by default, base + time adaLN, as the released FMLM+ initialisation
    fine-tunes the whole DiT; ``train=[time_adaln, lora]`` with ``lora_rank`` > 0 is the option for large bases
    (PEFT LoRA on the decoder's projections, the base frozen). LoRA on the head is refused: the chunked head passes
    (greedy summary, fused loss) read the head as one plain Linear.
    """

    def __init__(
        self,
        base: BidirectionalLM,
        *,
        data_vocab_size: int | None = None,
        cond_dim: int = 512,
        train: tuple[str, ...] | list[str] = ("base", "time_adaln"),
        lora_rank: int = 0,
        lora_alpha: float = 16.0,
        lora_dropout: float = 0.0,
        lora_targets: tuple[str, ...] | list[str] = LAYER_LINEARS,
        lora_head: bool = False,
    ) -> None:
        if lora_head:
            raise ValueError(
                "lora_head=true is not supported for FMLM+: the chunked head passes (greedy summary, fused loss) need "
                "the head as one plain Linear; train it with train=[..., base] instead"
            )
        if "lora" in train and lora_rank == 0:
            raise ValueError("adapter.train includes lora but lora_rank=0: set adapter.lora_rank > 0")
        if data_vocab_size is not None:
            base.cut_head(data_vocab_size)  # a padded head (LLaDA, Dream) keeps the data rows: |V| = the data's
        super().__init__(
            base,
            cond_dim=cond_dim,
            two_times=True,
            lora_rank=lora_rank,
            lora_alpha=lora_alpha,
            lora_dropout=lora_dropout,
            lora_targets=lora_targets,
            lora_head=False,
            train=train,
        )
        self.d_model = base.d_model
        self.vocab_size = base.head_rows  # the flow's |V|: what continuous inputs (B, L, |V|) are read against

    @property
    def spec(self) -> dict:
        """The base's spec (what a checkpoint records of the backbone)."""
        return self.base.spec

    @property
    def mask_id(self) -> int:
        """The base's [MASK] id."""
        return self.base.mask_id

    @property
    def shift_logits(self) -> bool:
        """Whether the base predicts position i at i − 1 (Dream)."""
        return self.base.shift_logits

    @property
    def token_embeddings(self) -> Tensor:
        """E (|V|, d): the embedding's data rows, which a continuous input x (…, |V|) is read against, h = x·E."""
        return self.base.model.embed_tokens.weight[: self.vocab_size]

    @property
    def output_head(self) -> nn.Module:
        """The output Linear(d, |V|): ``forward``'s logits are it applied to ``head_features``."""
        return self.base.lm_head

    def input_embeddings(self, x: Tensor) -> Tensor:
        """Token ids → E[x]; vectors over the data vocabulary (B, L, |V|) → x·E_data, computed in float32 (the
        released DiT's ``input_fp32``) and returned in the embedding's dtype."""
        if not x.is_floating_point():
            return self.base.input_embeddings(x)
        if x.shape[-1] != self.vocab_size:
            raise ValueError(f"continuous input has last dim {x.shape[-1]}, expected |V| = head_rows={self.vocab_size}")
        weight = self.token_embeddings
        with torch.autocast(device_type=x.device.type, enabled=False):
            return (x.float() @ weight.float()).to(weight.dtype)

    def flow_condition(self, s: Tensor, t: Tensor, pinned: Tensor | None, batch: int, length: int):
        """c = SiLU(emb_s(s) + emb_t(t)): (B, 1, cond) per sequence, (B, L, cond) per token, or with ``pinned`` a
        ``PinnedCondition`` (free rows at the per-sequence times, one row at s = t = 1); shifted for Dream."""
        if pinned is None:
            c = self.condition(s, t)
        else:
            if pinned.shape != (batch, length) or s.dim() > 1 or t.dim() > 1:
                raise ValueError("with `pinned` (B, L), the times are per sequence: (B,)")
            one = torch.ones(1, device=pinned.device)
            rows = 2 * torch.arange(batch, device=pinned.device)[:, None] + pinned.long()
            c = PinnedCondition(self.condition(s, t), self.condition(one, one), rows)
        if self.base.shift_logits:  # hidden j predicts token j + 1: it reads that token's times
            if isinstance(c, PinnedCondition):
                c = c._replace(rows=shift_left(c.rows))
            elif c.shape[1] > 1:
                c = shift_left(c)
        return c

    def head_features(  # type: ignore[override]
        self, h: Tensor, s: Tensor, t: Tensor, *, pinned: Tensor | None = None
    ) -> Tensor:
        """The output head's input (B, L, d) for embeddings h at times (s, t) [pinned]: the logits are
        ``output_head`` of it."""
        c = self.flow_condition(s, t, pinned, h.shape[0], h.shape[1])
        mods = [modulation(mod, c).to(h.dtype).chunk(6, dim=-1) for mod in self.layer_mods]
        with self._with_mods(mods):
            return self.base.head_features(h)

    def forward_embeddings(  # type: ignore[override]
        self, h: Tensor, s: Tensor, t: Tensor, *, pinned: Tensor | None = None
    ) -> Tensor:
        """Logits (B, L, |V|) for embeddings h (B, L, d) at times (s, t) [pinned]."""
        return self.base.lm_head(self.head_features(h, s, t, pinned=pinned))

    def forward(  # type: ignore[override]
        self, x: Tensor, s: Tensor, t: Tensor, *, pinned: Tensor | None = None
    ) -> Tensor:
        """Logits (B, L, |V|) for ids or vectors x (B, L, |V|) at times (s, t) [pinned]."""
        return self.forward_embeddings(self.input_embeddings(x), s, t, pinned=pinned)


def shift_left(c: Tensor) -> Tensor:
    """c'[:, j] = c[:, j + 1] for j < L − 1, c'[:, L − 1] = c[:, L − 1]: each position takes the next one's value."""
    return torch.cat([c[:, 1:], c[:, -1:]], dim=1)
