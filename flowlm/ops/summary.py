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

# Bytes of one chunk's float32 logits (rows × chunk), where the chunk's passes stay in cache. Measured on one CPU
# thread at |V| = 50 258: the capped summary at 512 rows, d 128, chunks of 256 / 512 / 1 024 / 2 048 columns
# 192 / 146 / 129 / 131 ms, at 256 rows, d 512, of 2 048 / 4 096 / 8 192 columns 146 / 138 / 138 ms; the
# confidence ranking at 512 rows, chunks of 1 024 / 2 048 / 4 096 columns 84 / 64 / 69 ms.
CHUNK_BYTES = 4 << 20
MIN_CHUNK = 256  # narrower chunks make the head's matrix product inefficient
BLOCK = 64  # row_max's block: chunks are multiples of it
ROW_BLOCK_BYTES = 1 << 20  # chunked_max_log_prob: float32 bytes of one block of rows × one chunk


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


def chunk_width(rows: int, vocab: int) -> int:
    """Vocabulary chunk so that rows × chunk float32 logits take about ``CHUNK_BYTES`` (at least ``MIN_CHUNK``, a
    multiple of ``BLOCK``)."""
    width = max(MIN_CHUNK, CHUNK_BYTES // (4 * max(rows, 1))) // BLOCK * BLOCK
    return min(vocab, width)


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
    width = chunk if chunk is not None else chunk_width(features[..., 0].numel(), weight.shape[0])
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
    """``PositionSummary`` of softmax(logits) per position, read in vocabulary chunks with running statistics: no
    (…, |V|) float32 or float64 tensor is made. ``rows``: only these rows of logits viewed as (N, |V|), gathered
    chunk by chunk (results (n,); each row's values those of the call over all rows, bit for bit).

    With m the running max logit, s_v = l_v − m, Z = Σ_v e^{s_v} and S = Σ_v e^{s_v}·s_v over the chunks so far
    (when m grows by Δ: Z ← e^{−Δ}Z, S ← e^{−Δ}(S − Δ·Z)):

        log max p = −log Z,   H = log Z − S / Z,   p₍₁₎ − p₍₂₎ = (1 − e^{l₍₂₎ − l₍₁₎}) / Z,

    l₍₂₎ the running second-largest logit (a tie of the max gives margin 0). A −∞ logit (a LLaMA-family [MASK])
    adds 0 to every sum. Precision: float32 throughout, against a float64 log_softmax within 2e-5 (relative) for
    log max p and 1e-5 (absolute, nats / probability) for H and the margin at |V| = 50 258
    (tests/samplers/test_adaptive_summary.py).

    The rows go through in blocks of about ``ROW_BLOCK_BYTES`` of float32 per chunk, so that a chunk's passes (max,
    subtract into float32, exp, sum) stay in cache; every operation is row-wise, so the values do not depend on the
    blocks. At (4, 128, 50 258) bf16 on one CPU thread: 38 ms with one block, 32 ms in blocks of 128 rows; the
    argmax from the chunk maxima at the end instead of a running one, 30.6 vs 30.4 ms (so it stays running), the
    entropy adding 17 ms (side by side, 2026-12-06, a loaded 2-core machine); a float64 log_softmax of the same
    logits takes 204 ms."""
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    n = flat.shape[0] if rows is None else rows.numel()
    # The default chunk is the whole tensor's, also for ``rows``: the same chunk boundaries, so each row's result is
    # the one the call over all rows gives, bit for bit (a sampler restricted to some rows ranks them as before).
    width = min(vocab, chunk if chunk is not None else chunk_width(flat.shape[0], vocab))
    block = max(1, ROW_BLOCK_BYTES // (4 * width))
    picked = None if rows is None else torch.empty(min(block, n) * width, dtype=logits.dtype, device=logits.device)

    def fill(first: int, last: int, start: int, z: Tensor) -> None:
        w = z.shape[1]
        if rows is None:
            z.copy_(flat[first:last, start : start + w])
        else:
            z.copy_(
                torch.index_select(
                    flat[:, start : start + w], 0, rows[first:last], out=picked[: z.numel()].view(z.shape)
                )
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
    if features.shape[-1] != weight.shape[1]:
        raise ValueError(f"features have width {features.shape[-1]}, the head expects {weight.shape[1]}")
    n, vocab = features.shape[0], weight.shape[0]
    width = min(vocab, chunk if chunk is not None else chunk_width(n, vocab))
    block = max(1, ROW_BLOCK_BYTES // (4 * width))

    def fill(first: int, last: int, start: int, z: Tensor) -> None:
        stop = start + z.shape[1]
        z.copy_(F.linear(features[first:last], weight[start:stop], None if bias is None else bias[start:stop]))

    return fold_chunks(fill, n, vocab, width, block, device=features.device, margin=margin, entropy=entropy)


def fold_chunks(
    fill, n: int, vocab: int, width: int, block: int, *, device: torch.device, margin: bool, entropy: bool
) -> PositionSummary:
    """``PositionSummary`` of n rows of logits over ``vocab`` columns that ``fill(first, last, start, z)`` writes,
    rows [first, last) × columns [start, start + z.shape[1]), into the float32 buffer z: rows in blocks of
    ``block``, columns in chunks of ``width``, each chunk folded into the running statistics (``chunked_summary``)."""
    best = torch.full((n,), -torch.inf, device=device)
    index = torch.zeros(n, dtype=torch.long, device=device)
    total = torch.zeros(n, device=device)  # Z = Σ exp(l − best) so far
    second = torch.full((n,), -torch.inf, device=device) if margin else None  # the runner-up logit so far
    spread = torch.zeros(n, device=device) if entropy else None  # S = Σ exp(l − best)·(l − best) so far
    # One float32 buffer for every chunk: a fresh (n, chunk) allocation per chunk costs about 3× its copy on a CPU
    # (page faults; 0.34 vs 0.11 ms at 256 × 2048 bf16 → float32, measured).
    buffer = torch.empty(min(block, n) * width, device=device)
    weights = torch.empty(min(block, n) * width, device=device) if entropy else None
    for first in range(0, n, block):
        last = min(n, first + block)
        k = last - first
        top_so_far, arg_so_far, sum_so_far = best[first:last], index[first:last], total[first:last]  # views
        for start in range(0, vocab, width):
            w = min(width, vocab - start)
            z = buffer[: k * w].view(k, w)  # contiguous float32, changed in place
            fill(first, last, start, z)
            top, arg = row_max(z)
            if second is not None:  # the chunk's runner-up: its max's own entry left out, then put back
                runner = z.scatter_(1, arg[:, None], -torch.inf).amax(-1)
                z.scatter_(1, arg[:, None], top[:, None])
                lo = second[first:last]  # the runner-up so far: the larger of it, this chunk's, the smaller max
                lo.copy_(torch.maximum(torch.minimum(top_so_far, top), torch.maximum(lo, runner)))
            arg_so_far.copy_(torch.where(top > top_so_far, arg + start, arg_so_far))  # strict: the first index
            new = torch.maximum(top_so_far, top)
            shrink = (top_so_far - new).exp_()  # e^{−Δ}
            s = z.sub_(new[:, None])  # s = l − m_new
            if spread is not None:  # S ← e^{−Δ}(S − Δ·Z) + Σ e^{s}·s (0·(−∞) read as 0)
                acc = spread[first:last]
                acc.sub_(sum_so_far * (new - top_so_far).nan_to_num_(0.0)).mul_(shrink)
                e = torch.exp(s, out=weights[: k * w].view(k, w))
                sum_so_far.mul_(shrink).add_(e.sum(-1))
                acc.add_(s.clamp_min_(torch.finfo(s.dtype).min).mul_(e).sum(-1))  # in place: 3× a vecdot's speed
            else:
                sum_so_far.mul_(shrink).add_(s.exp_().sum(-1))
            top_so_far.copy_(new)
    log_z = total.log()
    return PositionSummary(
        -log_z,  # log max p = −log Σ exp(l − l_max)
        index,
        None if second is None else (1 - (second - best).exp()) / total,
        None if spread is None else log_z - spread / total,
    )
