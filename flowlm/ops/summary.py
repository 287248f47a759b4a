"""The greedy summary of a model's output: per position the argmax and the log-probability there, computed
without materialising a (B, L, |V|) log δ or log-softmax (methods.md §3, §5).

A greedy draft (PR and the a-priori loop at temperature 0, the last jump of the flow-map, FLM Euler and block
samplers) needs nothing else from log δ = log_softmax(c·tanh(l/c)). The soft cap is monotone, so
argmax log δ = argmax l, and

    log max_v δ = cap(l_max) − logsumexp_v cap(l_v),   cap(l) − c = c·(tanh(l/c) − 1) = −2c·σ(−2l/c) ∈ (−2c, 0],

so Σ_v exp(cap(l_v) − c) needs no running maximum (every term lies in (e^{−2c}, 1], e^{−60} ≫ float32's least
normal) and costs one sigmoid and one exp per logit, where tanh alone costs 2.7× both on this project's CPU
(measured). ``capped_head_summary`` runs the output head in vocabulary chunks (memory B·L·chunk; each chunk's
passes on data in cache) and folds each chunk into a running max / argmax / sum.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

# The sizes of a pass over the vocabulary depend on the device (``vocab_sizes``). On the CPU they are cache-sized:
# bytes of one chunk's float32 logits (rows × chunk), where the chunk's passes stay in cache. Measured on one CPU
# thread at |V| = 50 258: the capped summary at 512 rows, d 128, chunks of 256 / 512 / 1 024 / 2 048 columns
# 192 / 146 / 129 / 131 ms, at 256 rows, d 512, of 2 048 / 4 096 / 8 192 columns 146 / 138 / 138 ms; the
# confidence ranking at 512 rows, chunks of 1 024 / 2 048 / 4 096 columns 84 / 64 / 69 ms.
CHUNK_BYTES = 4 << 20
ROW_BLOCK_BYTES = 1 << 20  # chunked_max_log_prob: float32 bytes of one block of rows × one chunk
CDF_TILE_BYTES = 1 << 20  # draw_rows: float64 working tile of the first level (rows × columns × 8), about an L2 cache
CE_BLOCK_BYTES = 32 << 20  # the training loss (flowlm/ops/fused_ce.py): one block's float32 (rows × |V|) buffer
# On any other device (CUDA; the meta device that stands in for it in tests/gpu_readiness) a chunk is bounded by
# memory, not by a cache: each chunk or tile costs a dozen kernel launches whatever its size, so cache-sized chunks
# launched 20–46 DiT `small` forwards' worth of kernels per NFE at 8 × 1 024 rows (docs/gpu.md). A chunk's float32
# logits (and draw_rows' float64 tile) take up to this much, and the rows go through in one block: at |V| = 50 258 a
# pass is one chunk up to 1 335 rows, 7 at 8 × 1 024. The pass's buffers (the product, its float32 copy, e^s for the
# entropy) hold a few such chunks: about 1 GiB at most. The fused cross-entropy of training takes blocks of rows of
# the same size (1 335 rows at |V| = 50 258: 13 blocks at a 16 × 1 024 micro batch, where the CPU's 32 MiB made 99),
# its buffers (σ, e^g, a soft block's q·σ, the gradient's bf16 casts) about 0.8 GiB.
DEVICE_PASS_BYTES = 256 << 20
MIN_CHUNK = 256  # narrower chunks make the head's matrix product inefficient
BLOCK = 64  # row_max's block: chunks are multiples of it
GROUP = BLOCK  # columns of a draw's first level (chunked_head_draw): its second level makes this many logits again


class VocabSizes(NamedTuple):
    """How a pass over the vocabulary is cut on one device type (``vocab_sizes``)."""

    chunk_bytes: int  # float32 bytes of one chunk's logits, rows × columns (``chunk_width``)
    row_block_bytes: int | None  # float32 bytes of one block of rows × one chunk (``row_block``); None: one block
    tile_bytes: int  # float64 bytes of draw_rows' first-level tile, rows × columns
    ce_block_bytes: int  # float32 bytes of one block of the fused cross-entropy, rows × |V| (fused_ce.block_rows)


def vocab_sizes(device: torch.device | str) -> VocabSizes:
    """The sizes of a vocabulary pass on ``device``: cache-sized on the CPU, bounded by memory on any other device."""
    if torch.device(device).type == "cpu":  # read at each call: the tests narrow the CPU's chunks
        return VocabSizes(CHUNK_BYTES, ROW_BLOCK_BYTES, CDF_TILE_BYTES, CE_BLOCK_BYTES)
    return VocabSizes(DEVICE_PASS_BYTES, None, DEVICE_PASS_BYTES, DEVICE_PASS_BYTES)


def dense_summary(log_probs: Tensor) -> tuple[Tensor, Tensor]:
    """(max_v log p, argmax_v) per position from materialised log-probabilities (…, |V|): the first maximal index,
    as ``torch.argmax``."""
    return log_probs.max(-1)


def row_max(z: Tensor) -> tuple[Tensor, Tensor]:
    """(max, first index of the max) along the last dim of a contiguous 2-D tensor, as ``torch.max(z, -1)``, through
    ``amax`` over blocks of ``BLOCK`` columns, then the first block holding the max and the first index inside it
    (ATen's CPU max-with-index costs ≈ 20× an ``amax``, measured)."""
    n, width = z.shape
    if width % BLOCK or not z.is_contiguous():
        return z.max(-1)
    blocks = z.view(n, width // BLOCK, BLOCK)
    top, block = blocks.amax(-1).max(-1)  # the first block that holds the row's max
    inner = blocks.gather(1, block[:, None, None].expand(n, 1, BLOCK)).squeeze(1).argmax(-1)  # first index in it
    return top, block * BLOCK + inner


def row_max_runner(z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``row_max`` and the runner-up: the largest entry of each row with its max's own entry left out (the max
    again where it is tied), from the same blocks' maxima — the other blocks' and the max's block without that
    entry — with no second pass over z. Equal to leaving the entry out of z and taking ``amax``."""
    n, width = z.shape
    if width % BLOCK or not z.is_contiguous():
        top, arg = row_max(z)
        runner = z.scatter(1, arg[:, None], -torch.inf).amax(-1)
        return top, arg, runner
    blocks = z.view(n, width // BLOCK, BLOCK)
    maxima = blocks.amax(-1)  # (n, blocks)
    top, block = maxima.max(-1)
    own = blocks.gather(1, block[:, None, None].expand(n, 1, BLOCK)).squeeze(1)  # the max's block (n, BLOCK)
    inner = own.argmax(-1)
    others = maxima.scatter(1, block[:, None], -torch.inf).amax(-1)
    within = own.scatter(1, inner[:, None], -torch.inf).amax(-1)
    return top, block * BLOCK + inner, torch.maximum(others, within)


def chunk_width(rows: int, vocab: int, device: torch.device | str) -> int:
    """Vocabulary chunk so that rows × chunk float32 logits take about ``vocab_sizes(device).chunk_bytes`` (at least
    ``MIN_CHUNK``, a multiple of ``BLOCK``)."""
    width = max(MIN_CHUNK, vocab_sizes(device).chunk_bytes // (4 * max(rows, 1))) // BLOCK * BLOCK
    return min(vocab, width)


def row_block(rows: int, width: int, device: torch.device | str, *, entropy: bool = False) -> int:
    """Rows per block of a chunk's fold (``fold_chunks``) at chunk ``width``: about ``row_block_bytes`` of float32 a
    block, half that with the ``entropy`` (its two float32 buffers, s and e^s, in the cache one took: measured
    faster); every row at once where the device has no row blocks."""
    budget = vocab_sizes(device).row_block_bytes
    if budget is None:
        return max(1, rows)
    block = max(1, budget // (4 * width))
    return max(1, block // 2) if entropy else block


def capped_head_summary(
    features: Tensor, weight: Tensor, bias: Tensor | None, *, cap: float, chunk: int | None = None
) -> tuple[Tensor, Tensor]:
    """(log max_v δ, argmax_v) per position, δ = softmax(cap · tanh(l / cap)), l = features · Wᵀ + b, without the
    (…, |V|) logits: the head Linear(d, |V|) (``weight`` (|V|, d), ``bias``) in vocabulary chunks of ``chunk``
    columns (default ``chunk_width``), run in the caller's autocast as the head would be (so l is rounded as the
    model's logits are), read in float32. The argmax is the first index of the largest logit (``torch.argmax``'s
    rule; a later chunk takes over only when strictly larger)."""
    if cap <= 0:
        raise ValueError(f"the summary needs a soft cap > 0, got {cap}")
    log_max, index, _ = head_expectation(features, weight, bias, cap=cap, chunk=chunk)
    return log_max, index


def head_expectation(
    features: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    *,
    cap: float | None = None,
    table: Tensor | None = None,
    low_rank: tuple[Tensor, Tensor] | None = None,
    mean_autocast: bool = False,
    chunk: int | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(log max_v p, argmax_v, Σ_v p_v·table_v) per position, p = softmax(g(l)), l = features · Wᵀ + b, g the soft
    cap c·tanh(l/c) (``cap``) or the identity (``cap=None``), in one pass over the head's vocabulary chunks: the
    denoiser's mean δ·E that a flow-map sub-step needs (``table`` = E, (|V|, d_e)), and MLFM's endpoint estimate
    x̂₁ = p·E, without a (…, |V|) tensor. The last is None without ``table``. ``low_rank`` = (u (…, r), B (|V|, r))
    adds u·Bᵀ to the logits, chunk by chunk: a LoRA on the head, u = scaling · A(features).

    Each chunk's weights w_v = exp(g(l_v) − m) fold into Σ w and Σ w·table_v: with the cap, m = c and every w lies in
    (e^{−2c}, 1] (no running maximum); without it, m is the running max logit and both sums are rescaled by
    exp(m_old − m_new) when it grows (the online softmax). The head runs in the caller's autocast (l is rounded as
    the model's logits are); w·table runs in float32 with autocast off, as the dense lift ``EmbeddingSpace.lift``, or
    with ``mean_autocast`` in the caller's autocast (MLFM's dense q·E; each chunk's product then accumulated in
    float32).
    Cost: the head's product plus one (B·L) × |V| × d_e product, which δ·E needs by its definition."""
    if cap is not None and cap <= 0:
        raise ValueError(f"the soft cap must be > 0 (or None), got {cap}")
    if features.shape[-1] != weight.shape[1]:
        raise ValueError(f"features have width {features.shape[-1]}, the head expects {weight.shape[1]}")
    if table is not None and table.shape[0] != weight.shape[0]:
        raise ValueError(f"table has {table.shape[0]} rows, the head {weight.shape[0]}")
    lr_shape = None if low_rank is None else (low_rank[1].shape[0], low_rank[0].shape[-1])
    if lr_shape is not None and lr_shape != (weight.shape[0], low_rank[1].shape[1]):
        raise ValueError(f"low-rank head part {tuple(low_rank[0].shape)} × {tuple(low_rank[1].shape)} does not fit")
    width = chunk if chunk is not None else chunk_width(features[..., 0].numel(), weight.shape[0], features.device)
    if width < 1:
        raise ValueError(f"chunk must be ≥ 1, got {width}")
    lead, vocab = features.shape[:-1], weight.shape[0]
    rows = features.reshape(-1, features.shape[-1])
    u = None if low_rank is None else low_rank[0].reshape(rows.shape[0], -1)
    best = torch.full((rows.shape[0],), -torch.inf, device=rows.device)  # running max logit, float32
    index = torch.zeros(rows.shape[0], dtype=torch.long, device=rows.device)
    total = torch.zeros(rows.shape[0], device=rows.device)  # Σ_v w_v over the chunks so far
    mean = None if table is None else torch.zeros(rows.shape[0], table.shape[1], device=rows.device)  # Σ w·table
    for start in range(0, vocab, width):
        stop = min(start + width, vocab)
        z = F.linear(rows, weight[start:stop], None if bias is None else bias[start:stop])
        if u is not None:
            z = z + F.linear(u, low_rank[1][start:stop])  # as the LoRA layer adds it: in the autocast dtype
        z = z.float()
        top, arg = row_max(z)
        index = torch.where(top > best, arg + start, index)  # strict: an earlier chunk keeps a tie (first index)
        new = torch.maximum(best, top)
        if cap is not None:
            w = z.mul_(-2 / cap).sigmoid_().mul_(-2 * cap).exp_()  # exp(cap(l) − cap) = exp(−2c·σ(−2l/c))
        else:
            w = z.sub_(new[:, None]).exp_()  # exp(l − m_new)
            rescale = (best - new).exp_()  # exp(m_old − m_new): 0 at the first chunk (m_old = −∞)
            total.mul_(rescale)
            if mean is not None:
                mean.mul_(rescale[:, None])
        total += w.sum(-1)
        if mean is not None:
            if mean_autocast:  # as the dense `probs @ E.float()`: bf16 under autocast, float32 without
                mean = mean + (w @ table[start:stop].float()).float()
            else:
                with torch.autocast(device_type=rows.device.type, enabled=False):
                    mean = torch.addmm(mean, w.to(table.dtype), table[start:stop])  # counted by FlopCounterMode
        best = new
    if cap is not None:
        log_max = torch.sigmoid(best * (-2 / cap)) * (-2 * cap) - total.log()  # cap(l_max) − cap − log Σ w
    else:
        log_max = -total.log()  # log max p = −log Σ exp(l − l_max)
    if mean is not None:
        mean = (mean / total[:, None]).reshape(*lead, table.shape[1])
    return log_max.reshape(lead), index.reshape(lead), mean


def chunked_max_log_prob(
    logits: Tensor, *, chunk: int | None = None, rows: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """(log max_v softmax(logits), argmax_v) per position in float32 (max logit − logsumexp), read in vocabulary
    chunks with a running max, argmax and rescaled Σ exp (no (…, |V|) float32 copy); the argmax as ``torch.argmax``.
    ``rows``: only these rows of logits viewed as (N, |V|), gathered chunk by chunk (results (n,), no (n, |V|)
    copy, each row's values those of the call over all rows). ``chunked_summary`` without its extra statistics."""
    summary = chunked_summary(logits, chunk=chunk, rows=rows)
    return summary.log_max, summary.argmax


class PositionSummary(NamedTuple):
    """What an MDM decoder reads of p = softmax(logits) per position (float32): log max_v p, the argmax (the first
    maximal index), and, when asked for, the top-two margin p₍₁₎ − p₍₂₎ and the entropy H(p) in nats (else None)."""

    log_max: Tensor
    argmax: Tensor
    margin: Tensor | None = None
    entropy: Tensor | None = None


@torch.no_grad()  # a summary for decoding, never differentiated (its buffers are written in place)
def chunked_summary(
    logits: Tensor,
    *,
    chunk: int | None = None,
    rows: Tensor | None = None,
    margin: bool = False,
    entropy: bool = False,
) -> PositionSummary:
    """``PositionSummary`` of softmax(logits) per position, read in vocabulary chunks: no (…, |V|) float32 or float64
    tensor is made. ``rows``: only these rows of logits viewed as (N, |V|), gathered chunk by chunk (results (n,);
    each row's values those of the call over all rows, bit for bit).

    Each chunk c is folded alone, with its own max m_c (s_v = l_v − m_c): Z_c = Σ_{v∈c} e^{s_v} and
    S_c = Σ_{v∈c} e^{s_v}·s_v; at the end, with m = max_c m_c and a_c = e^{m_c − m},

        Z = Σ_c a_c Z_c,   S = Σ_c a_c (S_c + (m_c − m) Z_c),
        log max p = −log Z,   H = log Z − S / Z,   p₍₁₎ − p₍₂₎ = (1 − e^{l₍₂₎ − l₍₁₎}) / Z,

    l₍₂₎ the larger of the chunks' runner-up logits and their second-largest max (a tie of the max gives margin 0).
    A −∞ logit (a LLaMA-family [MASK]) adds 0 to every sum. Precision: float32 throughout, against a float64
    log_softmax within 2e-5 (relative) for log max p and 1e-5 (absolute, nats / probability) for H and the margin at
    |V| = 50 258 (tests/samplers/test_adaptive_summary.py).

    On the CPU the rows go through in blocks of about ``ROW_BLOCK_BYTES`` of float32 per chunk, so that a chunk's
    passes (max, subtract into float32, exp, sum) stay in cache; on a GPU in one block (``row_block``); every
    operation is row-wise, so the values do not depend on the blocks. At (4, 128, 50 258) bf16 on one CPU thread
    (the running fold before the per-chunk tables, 2026-12-06, a loaded 2-core machine): 38 ms with one block, 32 ms
    in blocks of 128 rows; a float64 log_softmax 204 ms."""
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    n = flat.shape[0] if rows is None else rows.numel()
    # The default chunk is the whole tensor's, also for ``rows``: the same chunk boundaries, so each row's result is
    # the one the call over all rows gives, bit for bit (a sampler restricted to some rows ranks them as before).
    width = min(vocab, chunk if chunk is not None else chunk_width(flat.shape[0], vocab, logits.device))
    block = row_block(n, width, logits.device, entropy=entropy)
    picked = None if rows is None else torch.empty(min(block, n) * width, dtype=logits.dtype, device=logits.device)

    def fill(first: int, last: int, start: int, z: Tensor) -> Tensor:
        w = z.shape[1]
        if rows is None:
            return z.copy_(flat[first:last, start : start + w])
        return z.copy_(
            torch.index_select(flat[:, start : start + w], 0, rows[first:last], out=picked[: z.numel()].view(z.shape))
        )

    out = fold_chunks(fill, n, vocab, width, block, device=logits.device, margin=margin, entropy=entropy)
    if rows is not None:
        return out
    return PositionSummary(*(None if t is None else t.reshape(lead) for t in out))


@torch.no_grad()
def chunked_head_summary(
    features: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    *,
    chunk: int | None = None,
    margin: bool = False,
    entropy: bool = False,
) -> PositionSummary:
    """``chunked_summary`` of the logits l = features · Wᵀ + b (features (n, d), the head Linear(d, |V|)'s ``weight``
    (|V|, d) and ``bias``) without them: the head runs chunk by chunk in the caller's autocast (l rounded as the
    model's logits are), each chunk folded while it is in cache. What an MDM decoder reads at its eligible positions
    only: the head's product over those rows, not the whole sequence's."""
    return head_fold(features, weight, bias, chunk=chunk, margin=margin, entropy=entropy)[0]


@torch.no_grad()
def chunked_head_draw(
    features: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    temperature: float,
    generator: torch.Generator | None,
    *,
    uniforms: Tensor | None = None,
    chunk: int | None = None,
    margin: bool = False,
    entropy: bool = False,
) -> tuple[PositionSummary, Tensor, Tensor]:
    """(summary, token, log p) per row: a draw from softmax(l / T), T > 0, and log softmax(l) at the drawn token
    (untempered, float64), l = features · Wᵀ + b, read in the same single pass over the head's vocabulary chunks as
    ``chunked_head_summary`` (whose margin and entropy it also returns where asked for; no argmax: None): the draw of
    ``draw_kept`` at every row of ``chunked_head_keep`` (``draw_rows``' two-level inverse CDF with the same u, one
    per row: torch.rand's (n, 1) from ``generator``, or ``uniforms`` (n,) from per-row generators)."""
    if temperature <= 0:
        raise ValueError(f"chunked_head_draw draws at T > 0, got {temperature}")
    summary, kept = chunked_head_keep(features, weight, bias, temperature, chunk=chunk, margin=margin, entropy=entropy)
    token, log_p = draw_kept(kept, None, generator, uniforms=uniforms)
    return summary, token, log_p


# The group masses a fold keeps for a later draw (``chunked_head_keep``): rows × ⌈|V| / GROUP⌉ float32, 1/64 of the
# logits' (25.8 MB, 24.6 MiB, at 8 × 1 024 rows, |V| = 50 258). A sampler keeps them only within this budget, on
# any device (``keeps_draw``: 85 000 rows at that vocabulary); above it the draw makes its rows' head product again.
KEPT_BYTES = 256 << 20


def keeps_draw(rows: int, vocab: int) -> bool:
    """Whether a fold over ``rows`` rows keeps its group masses for a later draw (within ``KEPT_BYTES``)."""
    return rows * -(-vocab // GROUP) * 4 <= KEPT_BYTES


class KeptDraw(NamedTuple):
    """What a draw at T from some of a head fold's rows needs after the fold (``chunked_head_keep``, ``draw_kept``):
    per row the float32 masses Σ_{v∈g} e^{(l_v − m_c)/T} of each ``GROUP`` of columns, m_c − m per chunk, and the
    untempered m + log Z (float64); the fold's chunk width, T, and the head's inputs as it ran them."""

    groups: Tensor  # (n, groups) float32
    gaps: Tensor  # (n, chunks) float32: m_c − m
    log_norm: Tensor  # (n,) float64
    width: int
    temperature: float
    features: Tensor  # (n, d), in the autocast dtype where autocast is on
    weight: Tensor
    bias: Tensor | None


@torch.no_grad()
def chunked_head_keep(
    features: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    temperature: float,
    *,
    chunk: int | None = None,
    margin: bool = False,
    entropy: bool = False,
) -> tuple[PositionSummary, KeptDraw]:
    """``chunked_head_summary`` (no argmax: None) and, from the same single pass over the head's chunks, what a later
    draw at T > 0 at any of its rows needs (``KeptDraw``, ``draw_kept``): a sampler that ranks its rows first and
    draws at the committing ones after makes their head product once, not twice. The extra cost in the pass: a sum
    per ``GROUP`` of e^{s} at T = 1, an exp of s / T at T ≠ 1."""
    if temperature <= 0:
        raise ValueError(f"a kept draw is made at T > 0, got {temperature}")
    summary, groups, gaps, log_norm, width, (features, weight, bias) = head_fold(
        features, weight, bias, chunk=chunk, margin=margin, entropy=entropy, draw=temperature
    )
    return summary, KeptDraw(groups, gaps, log_norm, width, temperature, features, weight, bias)


@torch.no_grad()
def draw_kept(
    kept: KeptDraw, rows: Tensor | None, generator: torch.Generator | None, *, uniforms: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """(token, log p) at the rows ``rows`` (None: every row) of a ``chunked_head_keep`` fold: a draw from
    softmax(l / T) and the untempered log softmax(l) at the drawn token (float64), one u per drawn row (torch.rand's
    (n, 1) from ``generator``, or ``uniforms`` (n,)), as ``chunked_head_draw`` (whose draw this is) over those rows.

    The draw is ``flowlm.ops.draws.draw_rows``'s two-level inverse CDF with the same u, its first level over the kept
    group masses: M_g = e^{(m_c − m)/T}·mass_g in float64, the group the first with Σ_{g'≤g} M_{g'} > u·Σ M; inside it
    the token the first whose cumulative float64 weight exceeds the residual fraction, the group's logits made again
    from its GROUP rows of the head (``torch.baddbmm``: on this CPU the chunk's product's values bit for bit,
    tested). So the token is draw_rows' with the same u on the same logits unless u·Σ M falls within float32 rounding
    (≈ 1e-7 relative) of a group's boundary, and the law is softmax(l / T) to that rounding (tokens with
    e^{(l_v − m_c)/T} below float32's range, p < e^{−87} relative to their chunk's most likely token, are never
    drawn); log p = l_v − (m + log Z), Z the fold's float32 Σ e^{l − m}."""

    def at(t: Tensor) -> Tensor:
        return t if rows is None else t[rows]

    features, weight, bias, temperature = at(kept.features), kept.weight, kept.bias, kept.temperature
    n, vocab = features.shape[0], weight.shape[0]
    owner = torch.arange(kept.groups.shape[1], device=features.device) * GROUP // kept.width  # each group's chunk
    masses = at(kept.groups).double().mul_((at(kept.gaps).double() / temperature).exp_()[:, owner])
    cdf = masses.cumsum_(-1)
    u = torch.rand((n, 1), generator=generator, device=cdf.device, dtype=torch.float64) if uniforms is None else None
    target = (u if uniforms is None else uniforms.reshape(n, 1).to(torch.float64)) * cdf[:, -1:]
    g = torch.minimum(torch.searchsorted(cdf, target, right=True), cdf.argmax(-1, keepdim=True))  # positive mass
    below = torch.where(g > 0, cdf.gather(1, (g - 1).clamp_min(0)), 0.0)
    frac = ((target - below) / (cdf.gather(1, g) - below)).clamp_(0.0, 1.0)
    cols = g * GROUP + torch.arange(min(GROUP, vocab), device=g.device)  # (n, GROUP): no more than the vocabulary
    valid = cols < vocab
    cols = cols.clamp_max(vocab - 1)
    with torch.autocast(features.device.type, enabled=False):  # inputs already in the autocast dtype
        shift = bias[cols] if bias is not None else features.new_zeros(cols.shape)
        logits = torch.baddbmm(shift[..., None], weight[cols], features[:, :, None]).squeeze(-1).double()
    z = torch.where(valid, logits / temperature, -torch.inf)
    weights = (z - z.amax(-1, keepdim=True)).exp_().cumsum_(-1)  # Σ_{v'≤v} w_{v'}
    inner = torch.minimum(
        torch.searchsorted(weights, frac * weights[:, -1:], right=True), weights.argmax(-1, keepdim=True)
    )
    token = (g * GROUP + inner).squeeze(-1)
    return token, logits.gather(1, inner).squeeze(-1) - at(kept.log_norm)


def head_fold(
    features: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    *,
    chunk: int | None,
    margin: bool,
    entropy: bool,
    draw: float | None = None,
):
    """``fold_chunks`` over the head's product chunk by chunk (``chunked_head_summary``, ``chunked_head_draw``):
    the fold's result, then the inputs as the head ran them."""
    if features.shape[-1] != weight.shape[1]:
        raise ValueError(f"features have width {features.shape[-1]}, the head expects {weight.shape[1]}")
    n, vocab = features.shape[0], weight.shape[0]
    width = min(vocab, chunk if chunk is not None else chunk_width(n, vocab, features.device))
    if draw is not None:  # whole groups in a chunk
        width = min(vocab, max(GROUP, width // GROUP * GROUP))
    block = row_block(n, width, features.device, entropy=entropy)
    features, weight, bias = autocast_inputs(features, weight, bias)
    # A −∞ bias (a [MASK] inside the vocabulary) as the most negative finite logit: the same p (e^{−huge} = 0) and
    # statistics, and every logit finite, so the entropy's e^s·s needs no guard against 0·(−∞)
    bias = None if bias is None else bias.clamp_min(torch.finfo(bias.dtype).min)

    # One product per chunk over all n rows (the head's matrix product is the dearer the fewer its rows: 2× at a
    # quarter of 384, measured), into one buffer reused (a fresh one per chunk costs page faults); the fold then
    # reads it in row blocks. torch.addmm is F.linear's own kernel on 2-D inputs (the same values).
    product = torch.empty(n * width, dtype=features.dtype, device=features.device)

    def fill(first: int, last: int, start: int, z: Tensor) -> Tensor:
        w = z.shape[1]
        out = product[: n * w].view(n, w)
        if first == 0:
            stop = start + w
            with torch.autocast(features.device.type, enabled=False):  # inputs already in the autocast dtype
                if bias is None:
                    torch.mm(features, weight[start:stop].t(), out=out)
                else:
                    torch.addmm(bias[start:stop], features, weight[start:stop].t(), out=out)
        if out.dtype == torch.float32:
            return out[first:last]  # the fold's float32 rows, as they are
        return z.copy_(out[first:last])

    folded = fold_chunks(
        fill,
        n,
        vocab,
        width,
        block,
        device=features.device,
        margin=margin,
        entropy=entropy,
        finite=True,
        draw=draw,
    )
    return (*folded, width, (features, weight, bias)) if draw is not None else (folded, (features, weight, bias))


def has_autocast(device_type: str) -> bool:
    """Whether torch has autocast for ``device_type`` (the meta device of tests/gpu_readiness has none: asking
    whether it is on raises)."""
    try:
        torch.is_autocast_enabled(device_type)
    except RuntimeError:
        return False
    return True


def autocast_inputs(*tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    """``tensors`` cast once to the autocast dtype where autocast is on for their device and they are floating
    point, as each autocast op would cast them (a chunked head then casts its weight once a call, not once a row
    block and chunk: the casts cost more than the head's product, measured at |V| = 50 258)."""
    first = next(t for t in tensors if t is not None)
    kind = first.device.type
    if not has_autocast(kind) or not torch.is_autocast_enabled(kind):
        return tensors
    dtype = torch.get_autocast_dtype(kind)
    return tuple(None if t is None or not t.is_floating_point() else t.to(dtype) for t in tensors)


def fold_chunks(
    fill,
    n: int,
    vocab: int,
    width: int,
    block: int,
    *,
    device: torch.device,
    margin: bool,
    entropy: bool,
    finite: bool = False,
    draw: float | None = None,
):
    """``PositionSummary`` of n rows of logits over ``vocab`` columns that ``fill(first, last, start, z)`` writes,
    rows [first, last) × columns [start, start + z.shape[1]), into the float32 buffer z:
    rows in blocks of ``block``, columns in chunks of ``width``, each chunk's max, argmax, Z_c, S_c (and runner-up)
    kept in a (chunks, n) table and combined at the end (``chunked_summary``). ``finite``: every logit is finite
    (no guard for a −∞ one). ``draw`` = T: also each ``GROUP`` of columns' mass (chunks whole groups) for a draw at
    T, returned as (summary without argmax, the masses (n, groups) float32, m_c − m (n, chunks) float32,
    m + log Z float64) (``chunked_head_keep``)."""
    chunks = -(-vocab // width)
    tops = torch.empty(chunks, n, device=device)  # m_c
    args = torch.empty(chunks, n, dtype=torch.long, device=device)
    sums = torch.empty(chunks, n, device=device)  # Z_c = Σ_{v∈c} e^{l_v − m_c}
    spreads = torch.empty(chunks, n, device=device) if entropy else None  # S_c = Σ_{v∈c} e^{s_v}·s_v
    runners = torch.empty(chunks, n, device=device) if margin else None  # the chunk's runner-up logit
    groups = None if draw is None else torch.empty(n, -(-vocab // GROUP), device=device)  # Σ_{v∈g} e^{(l_v − m_c)/T}
    tempered = None if draw in (None, 1.0) else torch.empty(min(block, n) * width, device=device)
    # One float32 buffer for every chunk: a fresh (n, chunk) allocation per chunk costs about 3× its copy on a CPU
    # (page faults; 0.34 vs 0.11 ms at 256 × 2048 bf16 → float32, measured).
    buffer = torch.empty(min(block, n) * width, device=device)
    weights = torch.empty(min(block, n) * width, device=device) if entropy else None
    for c, start in enumerate(range(0, vocab, width)):
        w = min(width, vocab - start)
        for first in range(0, n, block):
            last = min(n, first + block)
            k = last - first
            z = fill(first, last, start, buffer[: k * w].view(k, w))  # contiguous float32, changed in place
            if runners is not None:  # the chunk's runner-up (its max's own entry left out) from the same blocks
                top, arg, runners[c, first:last] = row_max_runner(z)
            elif groups is None:
                top, arg = row_max(z)
            else:  # a draw reads no argmax: the max alone (row_max's block argmax costs as much as the amax)
                top, arg = z.amax(-1), None
            tops[c, first:last] = top
            if arg is not None:
                args[c, first:last] = arg + start
            s = z.sub_((top if finite else torch.where(top == -torch.inf, 0.0, top))[:, None])  # s = l − m_c
            if tempered is not None:  # e^{s/T} for the draw's group masses, before s is used up
                group_masses(torch.mul(s, 1 / draw, out=tempered[: k * w].view(k, w)).exp_(), groups[first:last], start)
            if spreads is not None:
                e = torch.exp(s, out=weights[: k * w].view(k, w))
                torch.sum(e, -1, out=sums[c, first:last])
                if not finite:
                    s.clamp_min_(torch.finfo(s.dtype).min)  # e^s·s = 0 at a −∞ logit, not 0·(−∞)
                torch.sum(s.mul_(e), -1, out=spreads[c, first:last])  # in place: 3× a vecdot's speed
            else:
                e = s.exp_()
                torch.sum(e, -1, out=sums[c, first:last])
            if groups is not None and tempered is None:  # T = 1: the masses are e^{s}'s
                group_masses(e, groups[first:last], start)
    # combined along each row's own contiguous (chunks,) table: row-wise reductions, so a row's values do not depend
    # on the other rows (``chunked_summary``'s rows read alone, bit for bit)
    tops, args, sums = (t.t().contiguous() for t in (tops, args, sums))
    spreads = None if spreads is None else spreads.t().contiguous()
    best = tops.amax(-1)  # m
    index = None
    if groups is None:
        first_best = (tops == best[:, None]).byte().argmax(-1)  # the first chunk holding the max: torch.argmax's rule
        index = args.gather(1, first_best[:, None]).squeeze(1)
    gap = (tops - best[:, None]).clamp_min_(torch.finfo(tops.dtype).min)  # m_c − m (finite, so that 0·gap = 0)
    scale = gap.exp()  # a_c
    total = (scale * sums).sum(-1)  # Z
    log_z = total.log()
    second = None
    if runners is not None:  # the larger of the runners-up and the second-largest chunk max
        second = runners.amax(0)
        if chunks > 1:
            second = torch.maximum(second, tops.topk(2, dim=-1).values[:, 1])
    spread = None if spreads is None else (scale * (spreads + gap * sums)).sum(-1)  # S
    summary = PositionSummary(
        -log_z,  # log max p = −log Σ exp(l − l_max)
        index,
        None if second is None else (1 - (second - best).exp()) / total,
        None if spread is None else log_z - spread / total,
    )
    if groups is None:
        return summary
    # the group masses, m_c − m, and m + log Z, the untempered log-normaliser (``draw_kept``)
    return summary, groups, gap, best.double() + total.double().log()


def group_masses(e: Tensor, out: Tensor, start: int) -> None:
    """Σ of ``e`` (k, w) over each ``GROUP`` of its columns (the last one maybe narrower) into the columns of ``out``
    (k, groups) from group start // GROUP on."""
    k, w = e.shape
    first, whole = start // GROUP, w // GROUP
    if whole:
        torch.sum(e[:, : whole * GROUP].unflatten(-1, (whole, GROUP)), -1, out=out[:, first : first + whole])
    if whole * GROUP < w:
        torch.sum(e[:, whole * GROUP :], -1, out=out[:, first + whole])
