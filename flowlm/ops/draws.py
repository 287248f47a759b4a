"""Categorical draws in float64: the inverse CDF in two levels (one uniform per row, no (n, |V|) copy) and Gumbel-max
(the suite's earlier random stream); and the random source of an MDM sampler call, one generator for the batch or one
per row (``Generators``). The samplers' contract is flowlm/samplers/base.py, their option checks
flowlm/samplers/common.py."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from flowlm.ops.summary import chunked_head_draw, vocab_sizes

Generators = torch.Generator | Sequence[torch.Generator] | None
"""An MDM sampler's random source: one generator for the whole batch (None: torch's default one), or a list or tuple
of one generator per row. Per row, every step of a sampler's loop draws from each row's own generator a block of fixed
size, one uniform per position for each draw the step makes (``draw_uniforms``: a coin, a categorical u, |V| Gumbel
uniforms), whether or not the row uses them (drawn and discarded): the count never depends on the other rows, so a row
decodes alike alone (generator s) and inside any batch (generators [..., s, ...]). A batch may run steps past a
finished row; those draws come after its last token and change nothing."""


def per_row(generator: Generators) -> bool:
    """Whether ``generator`` holds one generator per row (a list or tuple)."""
    return isinstance(generator, list | tuple)


def check_generators(generator: Generators, batch: int, device: torch.device) -> None:
    """A clear error, before any compute, unless ``generator`` is None, one ``torch.Generator``, or exactly ``batch``
    of them (one per row), each on ``device``'s type (torch.rand draws on the generator's device only)."""
    gens = list(generator) if per_row(generator) else [] if generator is None else [generator]
    if any(not isinstance(g, torch.Generator) for g in gens):
        kinds = sorted({type(g).__name__ for g in gens})
        raise TypeError(f"generator must be a torch.Generator, None or a list of one per row, got {kinds}")
    if per_row(generator) and len(gens) != batch:
        raise ValueError(f"per-row generators: got {len(gens)} for a batch of {batch} rows (one per row)")
    wrong = sorted({g.device.type for g in gens} - {torch.device(device).type})
    if wrong:
        raise ValueError(f"generator on {wrong} for tensors on {torch.device(device).type}: create it on that device")


def draw_uniforms(generator: Generators, shape: tuple[int, ...], device: torch.device) -> Tensor:
    """U(0, 1) in float64 of ``shape`` = (B, …). One generator: torch.rand's stream over the whole tensor. One per row:
    row b's block (shape[1:]) from generator b, whatever the other rows draw."""
    if not per_row(generator):
        return torch.rand(shape, generator=generator, device=device, dtype=torch.float64)
    rows = [torch.rand(shape[1:], generator=g, device=device, dtype=torch.float64) for g in generator]
    return torch.stack(rows) if rows else torch.empty(shape, device=device, dtype=torch.float64)


def row_uniforms(
    generator: Generators, shape: tuple[int, ...], device: torch.device, temperature: float
) -> Tensor | None:
    """The uniforms a draw at ``temperature`` takes from per-row generators (``draw_uniforms``; one per position of
    ``shape``, drawn whether or not the position is drawn at, so a row's stream never depends on the other rows); None
    at T = 0 (argmax) and for one generator, whose draws the kernels make themselves (``draw_rows``, ``pick_tokens``:
    the stream the suite always had)."""
    return draw_uniforms(generator, shape, device) if per_row(generator) and temperature > 0 else None


def sample_categorical(log_probs: Tensor, temperature: float, generator: torch.Generator | None) -> Tensor:
    """A draw from softmax(log_probs / T) per row by inverting its CDF in float64: one U(0, 1) per row against the
    cumulative sum, where Gumbel-max needs |V| uniforms and two logarithms each. Exact in law to float64
    resolution; a zero-probability token is never drawn. T = 0: the argmax. The CDF is inverted in two levels
    (``draw_rows``)."""
    if temperature == 0:
        return log_probs.argmax(dim=-1)
    lead, vocab = log_probs.shape[:-1], log_probs.shape[-1]
    return draw_rows(log_probs.reshape(-1, vocab), temperature, generator)[0].reshape(lead)


CDF_CHUNK = 256  # columns per chunk of the two-level CDF (the second level's cumsum runs over this many)


def draw_rows(
    logits: Tensor,
    temperature: float,
    generator: Generators,
    *,
    rows: Tensor | None = None,
    uniforms: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """A draw from softmax(logits[r] / T) for each row r of ``rows`` (all rows of the (N, |V|) ``logits`` when None),
    T > 0, by a two-level inverse CDF in float64, and log softmax(logits[r]) at the drawn token (untempered, float64:
    the confidence samplers report). No (n, |V|) copy is made: the rows are read in column tiles (float64, of
    ``vocab_sizes(device).tile_bytes``: about an L2 cache on the CPU; the tiles never change the values).

    With w_v = exp(l_v / T − m_c) inside chunk c of ``CDF_CHUNK`` columns (m_c the chunk's max of l / T), the chunk
    masses are M_c = exp(m_c − m) Σ_{v∈c} w_v (m = max_c m_c), all in float64. One u ~ U(0, 1) per row (the stream
    of a one-level inverse CDF): the chunk is the first c with Σ_{c'≤c} M_{c'} > u·Σ M, the residual fraction
    f = (u·Σ M − Σ_{c'<c} M_{c'}) / M_c ∈ [0, 1) is uniform given c, and the token is the first v of the chunk with
    Σ_{v'≤v} w_{v'} > f·Σ_c w: P(v) = M_c/Σ M · w_v/Σ_c w = softmax(l / T)_v, and the token the one-level inversion
    with the same u picks, up to float64 rounding. A chunk or token of mass 0 is never picked (clamped to the last of
    positive mass). log p(v) = l_v/T − m − log Σ M at T = 1 (the same normaliser); at T ≠ 1 an untempered Σ exp is
    accumulated in the same pass.

    ``uniforms``: the u of every row of ``logits`` (N elements, e.g. (B, L) per position), read at ``rows``, in place
    of the n drawn from ``generator`` (per-row generators: ``row_uniforms``; they draw nothing here).
    """
    n_all, vocab = logits.shape
    device = logits.device
    n = n_all if rows is None else rows.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.long, device=device), torch.zeros(0, dtype=torch.float64, device=device)
    chunk = min(CDF_CHUNK, vocab)
    k = -(-vocab // chunk)
    width = max(chunk, vocab_sizes(device).tile_bytes // (8 * n) // chunk * chunk)  # whole chunks a tile
    tops = torch.empty(n, k, dtype=torch.float64, device=device)
    mass = torch.empty(n, k, dtype=torch.float64, device=device)
    tempered = temperature != 1
    if tempered:
        raw_tops, raw_mass = torch.empty_like(tops), torch.empty_like(mass)
    buffer = torch.empty(n * min(width, vocab), dtype=torch.float64, device=device)  # one tile buffer, reused
    picked = None if rows is None else torch.empty(n * min(width, vocab), dtype=logits.dtype, device=device)
    for start in range(0, vocab, width):
        w = min(width, vocab - start)
        part = logits[:, start : start + w]
        if rows is not None:
            part = torch.index_select(part, 0, rows, out=picked[: n * w].view(n, w))
        part = buffer[: n * w].view(n, w).copy_(part)
        first, whole = start // chunk, w // chunk
        pieces = [(part[:, : whole * chunk].unflatten(-1, (whole, chunk)), first, first + whole)] if whole else []
        if whole * chunk < part.shape[1]:  # the vocabulary's last, narrower chunk
            pieces.append((part[:, whole * chunk :].unsqueeze(1), first + whole, first + whole + 1))
        for z, a, b in pieces:
            if tempered:
                top = z.amax(-1)
                raw_tops[:, a:b], raw_mass[:, a:b] = top, (z - finite(top)[..., None]).exp_().sum(-1)
                z.div_(temperature)
            top = z.amax(-1)
            tops[:, a:b], mass[:, a:b] = top, z.sub_(finite(top)[..., None]).exp_().sum(-1)
    top = tops.amax(-1, keepdim=True)
    mass.mul_((tops - top).exp_())  # M_c
    cdf = mass.cumsum(-1)
    if uniforms is None:
        if per_row(generator):
            raise TypeError("draw_rows: per-row generators draw through ``uniforms`` (row_uniforms), not here")
        u = torch.rand((n, 1), generator=generator, device=device, dtype=torch.float64)
    else:
        u = (uniforms.reshape(-1) if rows is None else uniforms.reshape(-1)[rows])[:, None]
    target = u * cdf[:, -1:]
    c = torch.minimum(torch.searchsorted(cdf, target, right=True), cdf.argmax(-1, keepdim=True))
    below = torch.where(c > 0, cdf.gather(1, (c - 1).clamp_min(0)), 0.0)
    frac = ((target - below) / mass.gather(1, c)).clamp_(0.0, 1.0)
    cols = c * chunk + torch.arange(chunk, device=device)
    row = torch.arange(n, device=device) if rows is None else rows
    z = logits[row[:, None], cols.clamp_max(vocab - 1)].to(torch.float64)
    if tempered:
        z = z.div_(temperature)
    weight = torch.where(cols < vocab, z.sub(tops.gather(1, c)).exp_(), 0.0).cumsum_(-1)  # Σ_{v'≤v} w_{v'}
    inner = torch.searchsorted(weight, frac * weight[:, -1:], right=True)
    inner = torch.minimum(inner, weight.argmax(-1, keepdim=True))
    index = (c * chunk + inner).squeeze(-1)
    if not tempered:
        log_p = z.gather(1, inner).squeeze(-1) - (top + cdf[:, -1:].log()).squeeze(-1)
    else:
        raw_top = raw_tops.amax(-1, keepdim=True)
        log_norm = raw_mass.mul_((raw_tops - raw_top).exp_()).sum(-1).log_() + raw_top.squeeze(-1)
        log_p = logits[row, index].to(torch.float64) - log_norm
    return index, log_p


def draw_at(
    source: Tensor,
    rows: Tensor,
    temperature: float,
    generator: Generators,
    *,
    uniforms: Tensor | None = None,
    linear: Sequence[Tensor | None] | None = None,
) -> tuple[Tensor, Tensor]:
    """``draw_rows`` at the flat rows ``rows`` of ``source``: (N, |V|) logits, or with ``linear`` = (W, b) the (N, d)
    inputs of an output head Linear(d, |V|), run at those rows only in vocabulary chunks with the draw in the same
    pass (an MDM sampler reading its network's head, ``MaskedDenoiser.head_fn``; ``chunked_head_draw``: the same u,
    the same token unless u falls within float32 rounding of a group's boundary). ``uniforms``: per-row generators'
    u of every row of ``source`` (``row_uniforms``), read at ``rows`` either way."""
    if linear is None:
        return draw_rows(source, temperature, generator, rows=rows, uniforms=uniforms)
    own = None if uniforms is None else uniforms.reshape(-1)[rows]
    _, token, log_p = chunked_head_draw(source[rows], *linear, temperature, generator, uniforms=own)
    return token, log_p


def finite(top: Tensor) -> Tensor:
    """A chunk's max as the shift of its exp: 0 where the whole chunk is −inf (mass exp(−inf) = 0, not −inf + inf)."""
    return torch.where(top == -torch.inf, 0.0, top)


def gumbel_argmax(log_probs: Tensor, generator: Generators, *, uniforms: Tensor | None = None) -> Tensor:
    """A categorical draw by Gumbel-max in float64 (float32 Gumbel noise biases low-probability tokens).

    ``uniforms``: the float64 U(0, 1) draws to use (log_probs' shape), when the caller drew them itself, e.g. in full
    to keep its random stream while it needs the draw at a few positions only, or from per-row generators
    (``row_uniforms``)."""
    if uniforms is None:  # drawn here, so transformed in place
        gumbel = torch.rand(log_probs.shape, generator=generator, device=log_probs.device, dtype=torch.float64)
        gumbel = gumbel.clamp_min_(1e-300)
    else:
        gumbel = uniforms.clamp_min(1e-300)
    # −log(−log u), in place: one (…, V) float64 buffer instead of four (the draw's cost at a text vocabulary).
    gumbel = gumbel.log_().neg_().log_().neg_()
    return gumbel.add_(log_probs).argmax(dim=-1)


def pick_tokens(
    log_probs: Tensor, temperature: float, generator: Generators, *, uniforms: Tensor | None = None
) -> Tensor:
    """argmax at temperature 0, else a float64 Gumbel draw from softmax(log_probs / temperature) (``uniforms``: see
    ``gumbel_argmax``)."""
    if temperature == 0:
        return log_probs.argmax(dim=-1)
    log_probs = log_probs.double()  # a no-op for float64 scores; x / 1 == x exactly, so temperature 1 skips a copy
    return gumbel_argmax(log_probs if temperature == 1 else log_probs / temperature, generator, uniforms=uniforms)
