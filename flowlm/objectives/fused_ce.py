"""The student's soft-capped cross-entropy straight from the output head's input, in vocabulary chunks (methods.md
§3–4): the training counterpart of the samplers' chunked head pass (``head_expectation``,
flowlm/samplers/summary.py), never holding a (B, L, |V|) logit, log δ or gradient tensor.

With l = features · Wᵀ + b (the head Linear(d, |V|)), g(l) = c·tanh(l/c) the soft cap (c = ``SOFT_CAP``) and
log δ = g − lse_v g, the per-token loss against a target distribution q (one-hot at y, or a soft row's q) is

    per_token = −Σ_v q_v log δ_v = m · lse_v g(l_v) − Σ_v q_v g(l_v),      m = Σ_v q_v (1 for a distribution)

and its gradient, for an upstream gradient w per token,

    ∂/∂l_v = w · (m · softmax(g)_v − q_v) · g'(l_v),   g'(l) = 1 − tanh²(l/c)
    ∂/∂features = Σ_chunks G_c W_c,   ∂/∂W_c = G_cᵀ features,   ∂/∂b_c = Σ_rows G_c.

The cap bounds g − c to (−2c, 0] (summary.py's docstring), so lse = c + log Σ_v exp(g_v − c) needs no running
maximum. The forward makes one pass over the chunks (Σ exp(g − c), the soft rows' Σ q·g and Σ q, the gathered
g(l_y)); it saves the features, the head's parameters, lse per row and the targets; the backward recomputes each
chunk's logits. Memory: a few (B·L) × chunk float32 buffers instead of several (B·L) × |V| ones.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from flowlm.samplers.summary import chunk_width


def _chunks(vocab: int, width: int):
    """(start, stop) of each vocabulary chunk of ``width`` columns."""
    for start in range(0, vocab, width):
        yield start, min(start + width, vocab)


def _sigma(z: Tensor, cap: float) -> Tensor:
    """σ(−2l/c) of a chunk's logits l, in at least float32 (float64 stays float64): g(l) = c·tanh(l/c) = c − 2c·σ,
    g' = 1 − tanh² = 4σ(1 − σ); a sigmoid and an exp cost less than a tanh (summary.py's docstring)."""
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    return z.mul(-2 / cap).sigmoid_()


def _soft_index(rows: Tensor, length: int) -> Tensor:
    """Flat (B·L) row indices of the soft rows' tokens: rows (n,) batch indices → (n·L,)."""
    return (rows[:, None] * length + torch.arange(length, device=rows.device)).reshape(-1)


@functools.cache
def _function(device_type: str) -> type[torch.autograd.Function]:
    """The autograd Function for one autocast device type: ``custom_fwd`` records the caller's autocast, and
    ``custom_bwd`` runs the backward under it, so each chunk's logits are recomputed rounded as in the forward."""

    class FusedCappedCE(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type=device_type)
        def forward(ctx, features, weight, bias, tokens, rows, values, cap, width):
            b, length, d = features.shape
            flat = features.reshape(-1, d)
            tok = tokens.reshape(-1)
            n_rows, vocab = flat.shape[0], weight.shape[0]
            acc = torch.promote_types(features.dtype, torch.float32)  # float32 (float64 in gradcheck)
            total = torch.zeros(n_rows, dtype=acc, device=flat.device)  # Σ_v exp(g_v − c)
            picked = torch.zeros(n_rows, dtype=acc, device=flat.device)  # g(l_y)
            soft = None if rows is None else _soft_index(rows, length)
            soft_q = None if rows is None else values.reshape(soft.shape[0], vocab)
            dot = None if rows is None else torch.zeros(soft.shape[0], dtype=acc, device=flat.device)  # Σ q·g
            for start, stop in _chunks(vocab, width):
                z = F.linear(flat, weight[start:stop], None if bias is None else bias[start:stop])  # caller's autocast
                sg = _sigma(z, cap)
                total += sg.mul(-2 * cap).exp_().sum(-1)  # exp(g − c) = exp(−2c·σ)
                inside = (tok >= start) & (tok < stop)
                col = (tok - start).clamp(0, stop - start - 1)
                picked = torch.where(inside, cap - 2 * cap * sg.gather(1, col[:, None]).squeeze(1), picked)
                if soft is not None:
                    dot += (soft_q[:, start:stop].to(acc) * sg[soft].mul_(-2 * cap).add_(cap)).sum(-1)  # Σ q·g
            lse = total.log() + cap  # lse_v g(l_v)
            per_token = lse - picked
            if soft is not None:  # m·lse − Σ q·g on the soft rows (m = Σ q = 1 up to rounding)
                per_token = per_token.index_copy(0, soft, lse[soft] * soft_q.to(acc).sum(-1) - dot)
            ctx.save_for_backward(features, weight, bias, lse, tokens, rows, values)
            ctx.cap, ctx.width = cap, width
            return per_token.reshape(b, length)

        @staticmethod
        @torch.amp.custom_bwd(device_type=device_type)
        def backward(ctx, grad):
            features, weight, bias, lse, tokens, rows, values = ctx.saved_tensors
            cap, width = ctx.cap, ctx.width
            b, length, d = features.shape
            flat = features.reshape(-1, d)
            tok = tokens.reshape(-1)
            vocab = weight.shape[0]
            w = grad.reshape(-1).to(lse.dtype)  # upstream gradient per token
            scale = w
            hard = torch.ones_like(w)  # 1 on one-hot rows, 0 on soft rows: where the one-hot −w is subtracted
            soft = soft_q = None
            if rows is not None:
                soft = _soft_index(rows, length)
                soft_q = values.reshape(soft.shape[0], vocab)
                hard = hard.index_fill(0, soft, 0.0)
                scale = w.index_copy(0, soft, w[soft] * soft_q.to(w.dtype).sum(-1))  # w·m
            grad_flat = torch.zeros(flat.shape, dtype=lse.dtype, device=flat.device)
            grad_w = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
            grad_b = torch.empty_like(bias) if bias is not None and ctx.needs_input_grad[2] else None
            for start, stop in _chunks(vocab, width):
                z = F.linear(flat, weight[start:stop], None if bias is None else bias[start:stop])  # as the forward
                sg = _sigma(z, cap)
                gc = sg.mul(-2 * cap).add_(cap - lse[:, None]).exp_().mul_(scale[:, None])  # w·m·softmax(g)
                inside = (tok >= start) & (tok < stop)
                col = (tok - start).clamp(0, stop - start - 1)
                gc.scatter_add_(1, col[:, None], -(w * hard * inside)[:, None])  # − w·onehot(y) on one-hot rows
                if soft is not None:
                    gc.index_add_(0, soft, -(w[soft, None] * soft_q[:, start:stop].to(gc.dtype)))  # − w·q
                gc.mul_(sg).mul_(sg.neg_().add_(1)).mul_(4)  # · g'(l) = 4σ(1 − σ)
                grad_flat += (gc @ weight[start:stop]).to(grad_flat.dtype)  # autocast: in its dtype, summed in fp32
                if grad_w is not None:
                    grad_w[start:stop] = gc.T @ flat
                if grad_b is not None:
                    grad_b[start:stop] = gc.sum(0)
            grad_features = grad_flat.reshape(b, length, d).to(features.dtype)
            return grad_features, grad_w, grad_b, None, None, None, None, None

    return FusedCappedCE


def fused_capped_ce(
    features: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    tokens: Tensor,
    soft: tuple[Tensor, Tensor] | None = None,
    *,
    cap: float,
    chunk: int | None = None,
) -> Tensor:
    """per_token (B, L) = −Σ_v q_v log δ_v, log δ = log_softmax(cap·tanh(l/cap)), l = features·Wᵀ + b, without a
    (B, L, |V|) tensor (the module docstring). ``features`` (B, L, d): the head's input; ``weight`` (|V|, d),
    ``bias`` (|V|,): the head Linear; the target q is onehot(``tokens``) except on ``soft`` = (rows (n,) batch
    indices, values (n, L, |V|) target distributions). The head runs in vocabulary chunks of ``chunk`` columns
    (default ``chunk_width``) in the caller's autocast, as the model's head would; the sums run in float32. The
    caller masks and averages per_token; its backward takes a per-token upstream gradient."""
    if cap <= 0:
        raise ValueError(f"the fused loss needs a soft cap > 0, got {cap}")
    if features.dim() != 3 or features.shape[-1] != weight.shape[1]:
        raise ValueError(f"features {tuple(features.shape)} do not fit the head {tuple(weight.shape)}")
    if tokens.shape != features.shape[:2]:
        raise ValueError(f"tokens {tuple(tokens.shape)} do not match features {tuple(features.shape[:2])}")
    rows = values = None
    if soft is not None:
        rows, values = soft
        if values.shape != (rows.shape[0], features.shape[1], weight.shape[0]):
            raise ValueError(f"soft targets {tuple(values.shape)} do not match rows {tuple(rows.shape)}")
        values = values.detach()
    width = chunk if chunk is not None else chunk_width(tokens.numel(), weight.shape[0])
    if width < 1:
        raise ValueError(f"chunk must be ≥ 1, got {width}")
    function = _function(features.device.type)
    return function.apply(features, weight, bias, tokens, rows, values, float(cap), int(width))
