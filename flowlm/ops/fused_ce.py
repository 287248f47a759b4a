"""The student's soft-capped cross-entropy straight from the output head's input, one block of rows at a time, its
gradient computed in the same pass (methods.md §3–4): the training counterpart of the samplers' chunked head pass
(``head_expectation``, flowlm/ops/summary.py), never holding a (B, L, |V|) logit, log δ or gradient tensor.

With l = features · Wᵀ + b (the head Linear(d, |V|)), g(l) = c·tanh(l/c) the soft cap (c = ``SOFT_CAP``) and
log δ = g − lse_v g, the per-token loss against a target distribution q (one-hot at y, or a soft row's q) is

    per_token = −Σ_v q_v log δ_v = m · lse_v g(l_v) − Σ_v q_v g(l_v),      m = Σ_v q_v (1 for a distribution)

and the loss the caller optimises is a weighted sum, loss = Σ_tokens w · per_token (w = the loss mask over the
scored count for a masked mean). Its gradient is

    ∂loss/∂l_v = w · (m · softmax(g)_v − q_v) · g'(l_v),   g'(l) = 1 − tanh²(l/c)
    ∂/∂features = G W,   ∂/∂W = Gᵀ features,   ∂/∂b = Σ_rows G.

Because w is known before the loss is computed, G needs nothing the forward pass does not already hold: each block
of rows takes its logits over the whole vocabulary once (one head product), its lse, per_token and G, and the two
gradient products, then frees them. The backward only scales the stored gradients by the upstream scalar. So a step
costs the head's three products (forward, ∂features, ∂W) as the dense path does, where recomputing the logits in a
separate backward would cost a fourth; memory holds one block's (rows × |V|) float32 buffers (``block_rows``) plus
∂features (B·L × d) and ∂W (|V| × d), which the backward writes anyway. Without grad mode (validation) only the
loss is computed. The cap bounds g − c to (−2c, 0] (summary.py's docstring), so lse = c + log Σ_v exp(g_v − c)
needs no running maximum.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from flowlm.ops.summary import has_autocast, vocab_sizes

MIN_BLOCK = 16  # rows; fewer make the head's matrix product inefficient


def block_rows(vocab: int, device: torch.device | str) -> int:
    """Rows per block so that one (rows × |V|) float32 buffer takes about ``vocab_sizes(device).ce_block_bytes`` (at
    least ``MIN_BLOCK``): 32 MiB on the CPU, bounded by memory on a GPU, where a block costs some 30 kernel launches
    whatever its rows (docs/gpu.md)."""
    return max(MIN_BLOCK, vocab_sizes(device).ce_block_bytes // (4 * max(vocab, 1)))


def _sigma(z: Tensor, cap: float) -> Tensor:
    """σ(−2l/c) of a block's logits l (overwritten when they are already in float32), in at least float32 (float64
    stays float64): g(l) = c·tanh(l/c) = c − 2c·σ, g' = 1 − tanh² = 4σ(1 − σ); a sigmoid and an exp cost less than
    a tanh (summary.py's docstring)."""
    wide = torch.promote_types(z.dtype, torch.float32)
    z = z.mul_(-2 / cap) if z.dtype == wide else z.to(wide).mul_(-2 / cap)
    return z.sigmoid_()


def _soft_index(rows: Tensor, length: int) -> Tensor:
    """Flat (B·L) row indices of the tokens of batch rows ``rows`` (n,) → (n·L,), in that order."""
    return (rows[:, None] * length + torch.arange(length, device=rows.device)).reshape(-1)


def _groups(b: int, length: int, rows: Tensor | None, device) -> tuple[Tensor, Tensor | None]:
    """The flat row indices of the one-hot tokens and of the soft tokens (in ``rows`` order, as their values), found
    without a device read: the soft rows' count is a shape, so a stable sort puts the one-hot batch rows first."""
    if rows is None:
        return torch.arange(b * length, device=device), None
    is_soft = torch.zeros(b, dtype=torch.int8, device=device).index_fill_(0, rows, 1)
    hard_rows = torch.argsort(is_soft, stable=True)[: b - rows.shape[0]]
    return _soft_index(hard_rows, length), _soft_index(rows, length)


@functools.cache
def _function(device_type: str) -> type[torch.autograd.Function]:
    """The autograd Function for one autocast device type: ``custom_fwd`` records the caller's autocast, so each
    block's logits are rounded as the model's head would round them; the gradients are made in the forward."""
    # a device type without autocast (the meta device of tests/gpu_readiness): nothing to record
    records_autocast = torch.amp.custom_fwd(device_type=device_type) if has_autocast(device_type) else (lambda f: f)

    class FusedCappedCE(torch.autograd.Function):
        @staticmethod
        @records_autocast
        def forward(ctx, features, weight, bias, tokens, weights, rows, values, cap, block, wanted):
            b, length, d = features.shape
            flat = features.reshape(-1, d)
            tok = tokens.reshape(-1)
            w_all = weights.reshape(-1)
            vocab = weight.shape[0]
            acc = torch.promote_types(features.dtype, torch.float32)  # float32 (float64 in gradcheck)
            want_f, want_w, want_b = wanted
            per_token = torch.empty(flat.shape[0], dtype=acc, device=flat.device)
            grad_flat = torch.zeros(flat.shape, dtype=acc, device=flat.device) if want_f else None
            grad_w = torch.zeros(weight.shape, dtype=acc, device=flat.device) if want_w else None
            grad_b = torch.zeros(vocab, dtype=acc, device=flat.device) if want_b else None
            hard, soft = _groups(b, length, rows, flat.device)
            soft_q = None if soft is None else values.reshape(soft.shape[0], vocab)
            for index, q_all in ((hard, None), (soft, soft_q)):
                if index is None:
                    continue
                for start in range(0, index.shape[0], block):
                    idx = index[start : start + block]
                    f = flat[idx]
                    z = F.linear(f, weight, bias)  # the whole vocabulary, in the caller's autocast
                    sg = _sigma(z, cap)
                    del z
                    e = sg.mul(-2 * cap).exp_()  # exp(g − c) = exp(−2c·σ)
                    total = e.sum(-1)
                    lse = total.log() + cap  # lse_v g(l_v)
                    if q_all is None:  # one-hot at y: lse − g(l_y)
                        y = tok[idx][:, None]
                        loss = lse - (cap - 2 * cap * sg.gather(1, y).squeeze(1))
                    else:  # m·lse − Σ q·g = m·lse − c·m + 2c·Σ q·σ (m = Σ q = 1 up to rounding)
                        q = q_all[start : start + block].to(acc)
                        m = q.sum(-1)
                        loss = (lse - cap) * m + 2 * cap * (q * sg).sum(-1)  # not vecdot: autocast runs it in bf16
                    per_token[idx] = loss
                    if not (want_f or want_w or want_b):
                        continue
                    w = 4 * w_all[idx].to(acc)  # the 4 of g' = 4σ(1 − σ), taken in here
                    scale = w if q_all is None else w * m
                    gz = e.mul_((scale / total)[:, None])  # 4·w·m·softmax(g)
                    if q_all is None:
                        gz.scatter_add_(1, y, -w[:, None])  # − 4·w·onehot(y)
                    else:
                        gz.addcmul_(w[:, None].expand_as(q), q, value=-1)  # − 4·w·q
                    gz.mul_(sg.addcmul_(sg, sg, value=-1))  # · σ(1 − σ): with the 4 above, · g'(l)
                    del sg
                    if want_f:  # autocast: the product in its dtype, accumulated in float32
                        grad_flat[idx] = (gz @ weight).to(acc)
                    if want_w:
                        grad_w += (gz.T @ f).to(acc)
                    if want_b:
                        grad_b += gz.sum(0)
            ctx.save_for_backward(
                None if grad_flat is None else grad_flat.reshape(b, length, d).to(features.dtype),
                None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype),
            )
            per_token = per_token.reshape(b, length)
            ctx.mark_non_differentiable(per_token)
            return (per_token * weights.to(acc)).sum(), per_token

        @staticmethod
        def backward(ctx, grad_loss, _grad_per_token):
            grad_features, grad_w, grad_b = ctx.saved_tensors
            scaled = [None if g is None else g * grad_loss.to(g.dtype) for g in (grad_features, grad_w, grad_b)]
            return *scaled, None, None, None, None, None, None, None

    return FusedCappedCE


def fused_capped_ce(
    features: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    tokens: Tensor,
    weights: Tensor,
    soft: tuple[Tensor, Tensor] | None = None,
    *,
    cap: float,
    block: int | None = None,
) -> tuple[Tensor, Tensor]:
    """(loss, per_token): per_token (B, L) = −Σ_v q_v log δ_v, log δ = log_softmax(cap·tanh(l/cap)),
    l = features·Wᵀ + b, and loss = Σ ``weights`` · per_token, differentiable in ``features``, ``weight`` and
    ``bias`` (per_token is not: it is for logging), without a (B, L, |V|) tensor (the module docstring).
    ``features`` (B, L, d): the head's input; ``weight`` (|V|, d), ``bias`` (|V|,): the head Linear; ``weights``
    (B, L): each token's weight in the loss (0 leaves it out); the target q is onehot(``tokens``) except on
    ``soft`` = (rows (n,) batch indices, values (n, L, |V|) target distributions). The head runs over ``block``
    rows at a time (default ``block_rows``) in the caller's autocast, as the model's head would; the sums run in
    float32."""
    if cap <= 0:
        raise ValueError(f"the fused loss needs a soft cap > 0, got {cap}")
    if features.dim() != 3 or features.shape[-1] != weight.shape[1]:
        raise ValueError(f"features {tuple(features.shape)} do not fit the head {tuple(weight.shape)}")
    if tokens.shape != features.shape[:2] or weights.shape != features.shape[:2]:
        raise ValueError(
            f"tokens {tuple(tokens.shape)} and weights {tuple(weights.shape)} do not match features "
            f"{tuple(features.shape[:2])}"
        )
    rows = values = None
    if soft is not None:
        rows, values = soft
        if values.shape != (rows.shape[0], features.shape[1], weight.shape[0]):
            raise ValueError(f"soft targets {tuple(values.shape)} do not match rows {tuple(rows.shape)}")
        values = values.detach()
    size = block if block is not None else block_rows(weight.shape[0], features.device)
    if size < 1:
        raise ValueError(f"block must be ≥ 1 row, got {size}")
    grad = torch.is_grad_enabled()  # without it (validation) the forward makes no gradients
    wanted = tuple(grad and x is not None and x.requires_grad for x in (features, weight, bias))
    function = _function(features.device.type)
    return function.apply(features, weight, bias, tokens, weights.detach(), rows, values, float(cap), int(size), wanted)
