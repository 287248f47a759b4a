"""Diffusion transformer (DiT) shared by every method, conditioned per token on one or two times (methods.md §1).

Reads top to bottom: time embedding → rotary → KV cache → block → final layer → DiT.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

SIZES: dict[str, dict[str, int]] = {
    "tiny": {"d_model": 128, "n_layers": 4, "n_heads": 4, "cond_dim": 128},
    "mini": {"d_model": 512, "n_layers": 8, "n_heads": 8, "cond_dim": 128},
    "small": {"d_model": 768, "n_layers": 12, "n_heads": 12, "cond_dim": 128},
}

# Choices of the released FMLM+ DiT (MananAg007/posterior-refinement, models/dit.py) that change training dynamics,
# the defaults of every DiT here (docs/protocol.md): token embedding kaiming-uniform (a = √5), std 1/√(3d); the time
# sinusoid of the raw t ∈ [0, 1]; no dropout on attention probabilities (dropout only on the residual branches);
# attention logits soft-capped at 50 (flash-attn's softcap); the continuous input x·E and the time conditioning in
# float32 under autocast.
RELEASED_OPTIONS: dict[str, object] = dict(
    embed_init="kaiming_uniform",
    time_scale=1.0,
    attn_dropout=0.0,
    attn_softcap=50.0,
    input_fp32=True,
    time_fp32=True,
)
# What this suite did before these options existed (N(0, 1) embedding, 1000·t, attention dropout = the residual
# dropout, no soft-cap, x·E in the autocast dtype): checkpoints written then are read with these values
# (``legacy_backbone_options``), and any of them can still be chosen for a new run.
LEGACY_OPTIONS: dict[str, object] = dict(
    embed_init="normal",
    time_scale=1000.0,
    attn_dropout=None,  # = the residual dropout
    attn_softcap=0.0,
    input_fp32=False,
    time_fp32=False,
)
EMBED_INITS = ("kaiming_uniform", "normal")
# An adapter's extra adaLN modulation: one tensor for every block, then one for the final layer (DiTBlock.forward).
ExtraMods = list[Tensor] | None


def legacy_backbone_options(backbone: dict) -> dict:
    """A saved backbone config with the options it was written without filled in as they were then
    (``LEGACY_OPTIONS``), so a checkpoint from before the released defaults computes what it was trained to."""
    filled = {key: value for key, value in LEGACY_OPTIONS.items() if key not in backbone}
    if "attn_dropout" in filled:
        filled["attn_dropout"] = float(backbone.get("dropout", 0.0))
    return {**backbone, **filled}


class TimeEmbedding(nn.Module):
    """Sinusoidal(freq_dim) features of ``scale`` · t, t ∈ [0, 1] → Linear → SiLU → Linear.

    scale = 1 (the released FMLM+ DiT) feeds the raw time: arguments t·ω ≤ 1 rad for every frequency ω ≤ 1;
    scale = 1000 (DiT/MDLM habit for integer diffusion steps) spreads them over many periods."""

    def __init__(self, cond_dim: int, freq_dim: int = 256, max_period: float = 10_000.0, scale: float = 1.0) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.scale = float(scale)
        half = freq_dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32) / half)
        self.register_buffer("freqs", freqs, persistent=False)
        self.mlp = nn.Sequential(nn.Linear(freq_dim, cond_dim), nn.SiLU(), nn.Linear(cond_dim, cond_dim))

    def forward(self, t: Tensor, *, fp32: bool = False) -> Tensor:
        """The embedding of times ``t``; ``fp32``: computed in float32 whatever the weights' dtype (FSDP2 gathers
        them in bf16 under its mixed-precision policy) and outside autocast (the caller disables it)."""
        args = (self.scale * t.float())[..., None] * self.freqs
        features = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        if not fp32:
            return self.mlp(features.to(self.mlp[0].weight.dtype))
        first, last = self.mlp[0], self.mlp[2]
        hidden = F.silu(F.linear(features, first.weight.float(), first.bias.float()))
        return F.linear(hidden, last.weight.float(), last.bias.float())


class Rotary(nn.Module):
    """Rotary position embedding applied to queries and keys (half-split convention)."""

    def __init__(self, head_dim: int, base: float = 10_000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, q: Tensor, k: Tensor, offset: int = 0) -> tuple[Tensor, Tensor]:
        """Rotate q, k (…, n, head_dim) as the positions offset … offset + n − 1 (offset > 0: cached decoding)."""
        seq_len = q.shape[-2]
        pos = torch.arange(offset, offset + seq_len, device=q.device, dtype=torch.float32)
        angles = torch.outer(pos, self.inv_freq)  # (L, head_dim/2)
        cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """adaLN: x · (1 + scale) + shift, all per token."""
    return x * (1 + scale) + shift


class PinnedCondition(NamedTuple):
    """The conditioning of tokens that sit either at their sequence's times or pinned at s = t = 1 (prompt,
    context and committed tokens of the flow models): every adaLN Linear runs on B + 1 rows instead of B·L and each
    token looks its row up. Per-token conditioning otherwise costs each block cond_dim · 6·d multiply-adds per
    token, 50 % of a `tiny` block's, 8 % of a `small` one's."""

    free: Tensor  # (B, 1, cond_dim)
    pinned: Tensor  # (1, 1, cond_dim)
    rows: Tensor  # (B, L) long: 2·b + [token pinned], a row of the (2B, ·) table [free_b; pinned] per token


def modulation(linear: nn.Module, c: Tensor | PinnedCondition) -> Tensor:
    """An adaLN Linear applied to the conditioning: per token/sequence, or looked up from the two rows of each
    sequence (an embedding lookup: on a CPU 4–5× faster than a broadcast ``where`` over (B, L, 6·d))."""
    if isinstance(c, PinnedCondition):
        free = linear(c.free)  # (B, 1, k)
        table = torch.cat([free, linear(c.pinned).expand_as(free)], dim=1)  # (B, 2, k)
        return F.embedding(c.rows, table.reshape(-1, table.shape[-1]))
    return linear(c)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    dropout_p: float,
    is_causal: bool,
    attn_mask: Tensor | None = None,
    softcap: float = 0.0,
) -> Tensor:
    """softmax(q·kᵀ/√d) v, or with ``softcap`` > 0 softmax(cap · tanh(q·kᵀ/(√d · cap))) v (``capped_attention``).

    Without a cap: PyTorch SDPA. On CPU with autograd on it is pinned to the math kernel (its backward is the faster
    one there), without autograd SDPA's own choice, the CPU flash kernel (docs/performance.md#design, the figures).
    On GPU SDPA picks the flash / memory-efficient kernels itself."""
    if softcap > 0:
        return capped_attention(q, k, v, cap=softcap, dropout_p=dropout_p, is_causal=is_causal, attn_mask=attn_mask)
    if q.device.type == "cpu" and torch.is_grad_enabled():
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal
            )
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal)


def capped_attention(
    q: Tensor, k: Tensor, v: Tensor, *, cap: float, dropout_p: float, is_causal: bool, attn_mask: Tensor | None
) -> Tensor:
    """Attention with soft-capped logits, cap · tanh(score / cap), as the released FMLM+ DiT (flash-attn's
    ``softcap``, 50). SDPA has no cap, so it is written out: scores in the inputs' dtype, cap and softmax in float32.
    On CUDA, without dropout or a mask, FlexAttention computes the same fused (``flex_capped_attention``)."""
    if q.is_cuda and dropout_p == 0 and attn_mask is None:
        return flex_capped_attention(q, k, v, cap=cap, is_causal=is_causal)
    return written_capped_attention(q, k, v, cap=cap, dropout_p=dropout_p, is_causal=is_causal, attn_mask=attn_mask)


def written_capped_attention(
    q: Tensor, k: Tensor, v: Tensor, *, cap: float, dropout_p: float, is_causal: bool, attn_mask: Tensor | None
) -> Tensor:
    """``capped_attention`` written out: a (…, L, L) score matrix in the inputs' dtype, cap and softmax in fp32."""
    scores = (q @ k.transpose(-2, -1)).float() * q.shape[-1] ** -0.5
    scores = cap * torch.tanh(scores / cap)
    if is_causal:
        attn_mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, -math.inf)
    probs = F.dropout(scores.softmax(-1), dropout_p) if dropout_p > 0 else scores.softmax(-1)
    return probs.to(v.dtype) @ v


_FLEX: dict[str, object] = {}


def flex_capped_attention(q: Tensor, k: Tensor, v: Tensor, *, cap: float, is_causal: bool) -> Tensor:
    """``capped_attention`` through FlexAttention with a tanh ``score_mod``, compiled once per process (the fused
    kernel on a GPU; FlexAttention has no backward on CPU). Compiled with automatic dynamic shapes: a second sequence
    length (lm-eval's rows batched by length, a new sampling shape) recompiles once for symbolic lengths instead of
    once per length (``dynamic=False`` hit the recompile limit after 8 lengths and fell back to the unfused path).
    The causal block mask is built once per (query, key) length and device (``causal_block_mask``), not in every
    block of every forward. Not measured on a GPU yet: benchmarks/gpu_check.py compares it with
    ``written_capped_attention`` (values and time)."""
    from torch.nn.attention.flex_attention import flex_attention

    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_attention)
    block_mask = causal_block_mask(q.shape[-2], k.shape[-2], q.device) if is_causal else None
    return _FLEX["fn"](q, k, v, score_mod=tanh_cap(float(cap)), block_mask=block_mask)


@functools.lru_cache(maxsize=8)
def tanh_cap(cap: float):
    """FlexAttention's ``score_mod`` for cap · tanh(score / cap), one function per cap (a new function object per
    call would be a new guard for the compiled kernel)."""

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return cap * torch.tanh(score / cap)

    return score_mod


@functools.lru_cache(maxsize=32)
def causal_block_mask(q_len: int, k_len: int, device: torch.device):
    """FlexAttention's causal block mask for ``q_len`` queries over ``k_len`` keys on ``device``, built once per
    shape (each build launches hundreds of kernels)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, q_len, k_len, device=device)


class KVCache:
    """Keys and values of every layer of a causal DiT for positions 0 … length − 1, for incremental decoding.

    Each layer's K and V are preallocated to ``max_len`` positions, (B, heads, max_len, head_dim), on its first
    write, with the dtype and device of the keys it is given (so a cache filled under autocast holds bf16).
    Keys are stored already rotated: rotary depends on the absolute position only, which never changes.
    """

    def __init__(self, n_layers: int, max_len: int) -> None:
        self.max_len = max_len
        self.length = 0
        self.keys: list[Tensor | None] = [None] * n_layers
        self.values: list[Tensor | None] = [None] * n_layers

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Store ``k, v`` (B, H, n, hd) at positions length … length + n − 1 of ``layer``; return the keys and
        values of positions 0 … length + n − 1 and the mask of the n new queries over them (None when n = 1)."""
        start, n = self.length, k.shape[-2]
        stop = start + n
        if self.keys[layer] is None:
            shape = (*k.shape[:2], self.max_len, k.shape[-1])
            self.keys[layer], self.values[layer] = k.new_empty(shape), v.new_empty(shape)
        keys, values = self.keys[layer], self.values[layer]
        keys[:, :, start:stop] = k
        values[:, :, start:stop] = v
        # New query j sits at absolute position start + j and sees keys 0 … start + j (bottom-right causal mask;
        # SDPA's is_causal aligns top-left when there are more keys than queries, so it cannot be used here).
        mask = None if n == 1 else torch.ones(n, stop, dtype=torch.bool, device=k.device).tril(diagonal=start)
        return keys[:, :, :stop], values[:, :, :stop], mask


class BlockKVCache:
    """Keys and values of every layer of a bidirectional DiT for all ``length`` positions, for a semi-autoregressive
    decoder's windowed passes (flowlm/samplers/block_cache.py): a pass over positions ``start`` … ``start`` + n − 1
    (``length`` below names that start, as ``KVCache.length`` does) stores their keys and values where ``fresh``
    (B, n) holds (every one: None) and attends to the stored ones of every position; a pass from 0 over the whole
    sequence fills it."""

    def __init__(self, n_layers: int, length: int) -> None:
        self.max_len = length
        self.length = 0  # the window's first position (the rotary offset of its keys)
        self.fresh: Tensor | None = None
        self.keys: list[Tensor | None] = [None] * n_layers
        self.values: list[Tensor | None] = [None] * n_layers

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, None]:
        """Store ``k, v`` (B, H, n, hd) at positions length … length + n − 1 of ``layer``; return every position's
        keys and values (no mask: bidirectional attention)."""
        start, n = self.length, k.shape[-2]
        if self.keys[layer] is None:
            if start != 0 or n != self.max_len:
                raise ValueError("a block KV cache is filled by a full pass (start 0, every position) first")
            self.keys[layer], self.values[layer] = k.clone(), v.clone()
        else:
            for stored, new in ((self.keys[layer], k), (self.values[layer], v)):
                if self.fresh is not None:  # the window's other positions keep (and attend to) the stored ones
                    new = torch.where(self.fresh[:, None, :, None], new, stored[:, :, start : start + n])
                stored[:, :, start : start + n] = new
        return self.keys[layer], self.values[layer], None


class DiTBlock(nn.Module):
    """Pre-norm transformer block with per-token adaLN shift/scale/gate on attention and MLP."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        cond_dim: int,
        mlp_ratio: int,
        dropout: float,
        attn_dropout: float = 0.0,
        softcap: float = 0.0,
    ) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.norm1 = nn.LayerNorm(d_model, bias=False)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.attn_out = nn.Linear(d_model, d_model, bias=False)
        self.norm2 = nn.LayerNorm(d_model, bias=False)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, mlp_ratio * d_model),
            nn.GELU(approximate="tanh"),
            nn.Linear(mlp_ratio * d_model, d_model),
        )
        self.dropout = dropout  # on the attention and MLP residual branches
        self.attn_dropout = attn_dropout  # on the attention probabilities
        self.softcap = softcap
        self.rotary = Rotary(d_model // n_heads)
        # Zero-initialised modulation: every block starts as the identity map on the residual stream.
        self.adaLN_modulation = nn.Linear(cond_dim, 6 * d_model)
        nn.init.zeros_(self.adaLN_modulation.weight)
        nn.init.zeros_(self.adaLN_modulation.bias)

    def forward(
        self,
        x: Tensor,
        c: Tensor | PinnedCondition,
        causal: bool = False,
        extra: Tensor | None = None,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> Tensor:
        """``extra`` (…, 6·d): an adapter's own adaLN on top of this block's (MLFM, methods.md §6): its shift/scale
        act after the block's modulation and its gate in the (1 + gate) form, so extra = 0 leaves the block as is.
        ``cache``: x holds only the new positions cache.length …; they attend causally to the cached ones too and
        their keys/values are stored as layer ``layer`` (the caller advances cache.length)."""
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = modulation(self.adaLN_modulation, c).chunk(6, dim=-1)
        if extra is not None:
            x_shift_a, x_scale_a, x_gate_a, x_shift_m, x_scale_m, x_gate_m = extra.chunk(6, dim=-1)
            gate_a, gate_m = gate_a * (1 + x_gate_a), gate_m * (1 + x_gate_m)
        b, length, d = x.shape
        h = modulate(self.norm1(x), shift_a, scale_a)
        if extra is not None:
            h = modulate(h, x_shift_a, x_scale_a)
        q, k, v = self.qkv(h).view(b, length, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        drop = self.dropout if self.training else 0.0
        attn_drop = self.attn_dropout if self.training else 0.0
        if cache is None:
            q, k = self.rotary(q, k)
            attn = attention(q, k, v, dropout_p=attn_drop, is_causal=causal, softcap=self.softcap)
        else:
            q, k = self.rotary(q, k, offset=cache.length)
            k, v, mask = cache.update(layer, k, v)
            attn = attention(q, k, v, dropout_p=attn_drop, is_causal=False, attn_mask=mask, softcap=self.softcap)
        attn = attn.transpose(1, 2).reshape(b, length, d)
        x = x + gate_a * F.dropout(self.attn_out(attn), drop, self.training)
        h = modulate(self.norm2(x), shift_m, scale_m)
        if extra is not None:
            h = modulate(h, x_shift_m, x_scale_m)
        return x + gate_m * F.dropout(self.mlp(h), drop, self.training)


class FinalLayer(nn.Module):
    """LayerNorm + adaLN shift/scale, then Linear(d, |V|) zero-initialised (uniform output at init)."""

    def __init__(self, d_model: int, cond_dim: int, vocab_size: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model, bias=False)
        self.adaLN_modulation = nn.Linear(cond_dim, 2 * d_model)
        self.linear = nn.Linear(d_model, vocab_size)
        for layer in (self.adaLN_modulation, self.linear):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: Tensor, c: Tensor | PinnedCondition, extra: Tensor | None = None) -> Tensor:
        """``extra`` (…, 2·d): an adapter's shift/scale applied after this layer's own (zero = unchanged)."""
        shift, scale = modulation(self.adaLN_modulation, c).chunk(2, dim=-1)
        return self.linear(self.features(x, c, extra))

    def features(self, x: Tensor, c: Tensor | PinnedCondition, extra: Tensor | None = None) -> Tensor:
        """The head's input (…, d): ``forward`` less its Linear."""
        shift, scale = modulation(self.adaLN_modulation, c).chunk(2, dim=-1)
        h = modulate(self.norm(x), shift, scale)
        return h if extra is None else modulate(h, *extra.chunk(2, dim=-1))


class DiT(nn.Module):
    """Bidirectional transformer over token ids or continuous vectors, conditioned per token on (s[, t]).

    Inputs:
      x: LongTensor (B, L) of ids (embedding lookup), or FloatTensor (B, L, |V|) projected by the same
         embedding matrix (h = x·E), as flow models feed one-hot/noisy vectors.
      s: time(s) of shape (B,) (one per sequence, broadcast) or (B, L) (per token).
      t: second time, same shapes; required iff the model was built with ``two_times=True``.
    Output: logits (B, L, |V|).

    Options (defaults: the released FMLM+ DiT, ``RELEASED_OPTIONS``; earlier choices: ``LEGACY_OPTIONS``):
      embed_init: "kaiming_uniform" (a = √5: U(±1/√d)) or "normal" (N(0, 1)); with a continuous input h = x·E the
        per-dimension input scale is ‖x‖ · std, ≈ √|V| · std for Gaussian noise.
      time_scale: the sinusoid reads time_scale · t.
      attn_dropout: dropout on the attention probabilities (``dropout`` acts on the residual branches).
      attn_softcap: cap · tanh(score / cap) on the attention logits (0: none).
      input_fp32: x·E in float32 under autocast (the released code); else in the autocast dtype.
      time_fp32: the time conditioning c = SiLU(emb_s(s) [+ emb_t(t)]) in float32 under autocast (the released code
        runs its backbone under a float32 autocast and only the blocks and the output layer in bf16); else in the
        autocast dtype, where nearby times (a small u − s in the semigroup) come out about twice as blurred.
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        d_model: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        cond_dim: int = 128,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
        two_times: bool = False,
        causal: bool = False,
        embed_init: str = "kaiming_uniform",
        time_scale: float = 1.0,
        attn_dropout: float = 0.0,
        attn_softcap: float = 50.0,
        input_fp32: bool = True,
        time_fp32: bool = True,
    ) -> None:
        super().__init__()
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be ≥ 2, got {vocab_size}")
        if embed_init not in EMBED_INITS:
            raise ValueError(f"embed_init must be one of {EMBED_INITS}, got {embed_init!r}")
        if attn_softcap < 0 or time_scale <= 0 or not 0 <= attn_dropout < 1:
            raise ValueError(
                f"need attn_softcap ≥ 0, time_scale > 0, 0 ≤ attn_dropout < 1; got {attn_softcap}, {time_scale}, "
                f"{attn_dropout}"
            )
        self.vocab_size, self.d_model = vocab_size, d_model
        self.two_times, self.causal = two_times, causal
        self.input_fp32, self.time_fp32 = input_fp32, time_fp32
        self.embed = nn.Embedding(vocab_size, d_model)  # N(0, 1), torch's default
        if embed_init == "kaiming_uniform":
            nn.init.kaiming_uniform_(self.embed.weight, a=math.sqrt(5))  # U(±1/√d): fan_in = d for a (|V|, d) matrix
        self.emb_s = TimeEmbedding(cond_dim, scale=time_scale)
        self.emb_t = TimeEmbedding(cond_dim, scale=time_scale) if two_times else None
        self.blocks = nn.ModuleList(
            DiTBlock(d_model, n_heads, cond_dim, mlp_ratio, dropout, attn_dropout, attn_softcap)
            for _ in range(n_layers)
        )
        self.final = FinalLayer(d_model, cond_dim, vocab_size)

    def condition(
        self, s: Tensor, t: Tensor | None, batch: int, length: int, pinned: Tensor | None = None
    ) -> Tensor | PinnedCondition:
        """c = SiLU(emb_s(s) + emb_t(t)), shape (B, L, cond_dim), or (B, 1, cond_dim) for per-sequence times; with
        ``pinned`` (B, L), s and t are the other tokens' times (per sequence) and pinned tokens sit at s = t = 1."""
        if (t is not None) != self.two_times:
            raise ValueError(
                "this DiT was built with two_times="
                f"{self.two_times} but was called {'with' if t is not None else 'without'} a second time t"
            )
        if pinned is not None:
            if pinned.shape != (batch, length) or any(time.dim() > 1 for time in (s, t) if time is not None):
                raise ValueError("with `pinned` (B, L), the times are per sequence: (B,) or scalars")
            one = torch.ones(1, 1, device=pinned.device)
            rows = 2 * torch.arange(batch, device=pinned.device)[:, None] + pinned.long()
            free = self.condition(s, t, batch, length)
            return PinnedCondition(free, self.condition(one, None if t is None else one, 1, 1), rows)
        s = _per_token(s, batch, length)
        if t is not None:
            t = _per_token(t, batch, length)
            if t.shape != s.shape:  # one per token, the other per sequence
                s, t = s.expand(batch, length), t.expand(batch, length)
        with torch.autocast(device_type=s.device.type, enabled=False) if self.time_fp32 else contextlib.nullcontext():
            c = self.emb_s(s, fp32=self.time_fp32)
            if t is not None:
                c = c + self.emb_t(t, fp32=self.time_fp32)
            return F.silu(c)

    @property
    def token_embeddings(self) -> Tensor:
        """E (|V|, d): the rows a continuous input x (…, |V|) is read against, h = x·E (the whole embedding)."""
        return self.embed.weight

    @property
    def output_head(self) -> nn.Module:
        """The output Linear(d, |V|): ``forward``'s logits are it applied to ``head_features``."""
        return self.final.linear

    def input_embeddings(self, x: Tensor) -> Tensor:
        """Token ids → E[x]; vectors over the vocabulary → x·E."""
        if x.dtype in (torch.long, torch.int, torch.int32, torch.int16, torch.uint8):
            return self.embed(x)
        if x.shape[-1] != self.vocab_size:
            raise ValueError(f"continuous input has last dim {x.shape[-1]}, expected |V|={self.vocab_size}")
        if self.input_fp32:  # the released code: a (B·L) × |V| × d product whose inputs are noise, kept in float32
            with torch.autocast(device_type=x.device.type, enabled=False):
                return x.float() @ self.embed.weight.float()
        return x.to(self.embed.weight.dtype) @ self.embed.weight

    def forward(self, x: Tensor, s: Tensor, t: Tensor | None = None, *, pinned: Tensor | None = None) -> Tensor:
        """Logits (B, L, |V|) for ids or vectors x at per-token times (s[, t]); or, with ``pinned`` (B, L), at the
        per-sequence times (s[, t]) with the pinned tokens at s = t = 1 (the same logits, cheaper)."""
        return self.forward_embeddings(self.input_embeddings(x), s, t, pinned=pinned)

    def forward_embeddings(
        self, h: Tensor, s: Tensor, t: Tensor | None = None, *, extra: ExtraMods = None, pinned: Tensor | None = None
    ) -> Tensor:
        """Logits for inputs given directly as embeddings h (B, L, d) (MLFM feeds these); ``extra`` holds an
        adapter's modulation for every block and then the final layer (see DiTBlock.forward)."""
        return self.final.linear(self.head_features(h, s, t, extra=extra, pinned=pinned))

    def head_features(
        self, h: Tensor, s: Tensor, t: Tensor | None = None, *, extra: ExtraMods = None, pinned: Tensor | None = None
    ) -> Tensor:
        """``forward_embeddings`` up to the output head's input (B, L, d): the logits are ``final.linear`` of it,
        for callers that apply the head in vocabulary chunks (flowlm/ops/summary.py)."""
        b, length, _ = h.shape
        c = self.condition(s, t, b, length, pinned)
        if extra is not None and len(extra) != len(self.blocks) + 1:
            raise ValueError(f"extra modulation for {len(extra)} layers, expected {len(self.blocks) + 1}")
        for i, block in enumerate(self.blocks):
            h = block(h, c, causal=self.causal, extra=None if extra is None else extra[i])
        return self.final.features(h, c, None if extra is None else extra[-1])

    def new_cache(self, max_len: int) -> KVCache:
        """An empty KV cache for incremental decoding of up to ``max_len`` positions (causal DiTs only)."""
        if not self.causal:
            raise ValueError("a KV cache needs a causal DiT: bidirectional attention changes earlier keys")
        return KVCache(len(self.blocks), max_len)

    def new_block_cache(self, length: int) -> BlockKVCache:
        """An empty block KV cache over ``length`` positions (bidirectional DiTs only)."""
        if self.causal:
            raise ValueError("a block KV cache is for bidirectional DiTs: a causal one decodes with new_cache")
        return BlockKVCache(len(self.blocks), length)

    def forward_window(
        self, x: Tensor, s: Tensor, cache: BlockKVCache, start: int, fresh: Tensor | None = None, *, features=False
    ) -> Tensor:
        """Logits (B, n, |V|) of positions start … start + n − 1 (ids x (B, n)) attending to every position's keys
        and values: the window's from this pass where ``fresh`` (B, n) holds (all: None), the others' as ``cache``
        holds them; stores the fresh ones. With start 0 and the whole sequence it is ``forward`` (per-sequence times
        s (B,)) and fills the cache. ``features``: the head's input (B, n, d) instead (``head_features``)."""
        h = self.input_embeddings(x)
        b, n, _ = h.shape
        if start < 0 or start + n > cache.max_len:
            raise ValueError(f"window {start} … {start + n - 1} outside the cache's {cache.max_len} positions")
        cache.length, cache.fresh = start, fresh
        c = self.condition(s, None, b, n)
        for i, block in enumerate(self.blocks):
            h = block(h, c, cache=cache, layer=i)
        return self.final.features(h, c) if features else self.final(h, c)

    def forward_cached(self, x: Tensor, s: Tensor, cache: KVCache, t: Tensor | None = None) -> Tensor:
        """Logits (B, n, |V|) for the n new positions cache.length … cache.length + n − 1 only, given as ids or
        vectors x (B, n[, |V|]), attending to the cached positions; stores their keys/values and advances the
        cache. Equals ``forward`` on the whole prefix at those positions (up to float rounding). Times are per
        sequence (B,) or per new position (B, n): per-sequence times give the same (B, 1, ·) conditioning as the
        full forward."""
        if not self.causal:
            raise ValueError("forward_cached needs a causal DiT")
        h = self.input_embeddings(x)
        b, n, _ = h.shape
        if cache.length + n > cache.max_len:
            raise ValueError(f"KV cache holds {cache.max_len} positions; {cache.length} + {n} new ones do not fit")
        c = self.condition(s, t, b, n)
        for i, block in enumerate(self.blocks):
            h = block(h, c, causal=True, cache=cache, layer=i)
        cache.length += n
        return self.final(h, c)


def _per_token(time: Tensor, batch: int, length: int) -> Tensor:
    """(B, L) per-token times, or (B, 1) when one time serves the whole sequence.

    Keeping a per-sequence time at length 1 lets the time MLP and every adaLN Linear run once per sequence
    and broadcast over tokens (docs/performance.md#design: what expanding it to every token costs).
    """
    if time.dim() == 0:
        return time.expand(batch, 1)
    if time.dim() == 1:
        return time[:, None]
    if time.shape != (batch, length):
        raise ValueError(f"time has shape {tuple(time.shape)}, expected ({batch},) or ({batch}, {length})")
    return time


def build_dit(*, size: str | None = None, vocab_size: int, **overrides: object) -> DiT:
    """A DiT of a named size (tiny/mini/small), any field overridable."""
    if size is not None and size not in SIZES:
        raise ValueError(f"unknown backbone size {size!r}; known: {sorted(SIZES)}")
    kwargs = {**(SIZES[size] if size else {}), **overrides}
    return DiT(vocab_size=vocab_size, **kwargs)  # type: ignore[arg-type]
