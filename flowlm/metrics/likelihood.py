"""Log-likelihoods of a continuation given pinned context: the MDM's ELBO (Monte Carlo, and exact by enumerating
masks for a few tokens) and an AR model's exact chain rule; what an lm-evaluation-harness model scores with
(runners/lm_harness.py, docs/evaluation.md).

A row is ``tokens`` (B, L) with ``pinned`` positions (the context, kept verbatim), ``scored`` positions (the
continuation) and the rest, which an MDM sees as [MASK] at every draw (the text after the continuation, marginalised).
With n scored positions and M ⊆ scored the masked set, the MDM's continuous-time ELBO (methods.md §2, α_t = 1 − t) is

    ELBO = E_{t ~ U(0, 1]} E_{M ~ Bernoulli(t)^n} [ (1/t) Σ_{i∈M} log p_θ(x_i | x with M and the rest masked) ]
         = Σ_{k=1}^{n} (1/k) E_{|M| = k} [ Σ_{i∈M} log p_θ(x_i | …) ]       (∫₀¹ t^{k−1}(1−t)^{n−k} dt = 1/(k·C(n,k)))

≤ log p_θ(continuation | context), so −ELBO bounds the negative log-likelihood from above: a perplexity or
bits-per-byte read off it is an upper bound on the model's own. Two estimators of it:

- ``count`` (LLaDA's, the default for a time-agnostic MDM): k_j = ⌊(j + u_j)·n/S⌋ + 1 (stratified, uniform on
  1…n), a uniform k-subset masked, weight n/k_j; bounded weights, unbiased, and exact (zero variance) for one scored
  token.
- ``time`` (MDLM's; a time-conditioned MDM's only choice): t_j = ε + (1 − ε)(j + 1 − u_j)/S for j < S (stratified,
  MDLM's antithetic sampling), each scored position masked when v < t_j, weight (1 − ε)/t_j: the ELBO over
  t ∈ [ε, 1] with the training's floor ε = 10⁻³ (Dream's harness floors t alike). Without the floor the weight 1/t
  has unbounded variance (the estimate's sd was 0.53 / 3.3 / 5.6 nats for 2 / 4 / 6 tokens against count's
  0.063 / 0.92 / 0.97, 30 seeds × 128 terms on a trained tiny MDM, issue 48); the floor leaves out
  ∫₀^ε of the integrand, ≈ ε·|Σ log p| (0.01 nats for 10 nats), against that bias.

``auto`` picks count for a time-agnostic MDM and time for a time-conditioned one; wherever 2ⁿ − 1 ≤ S the ELBO is
enumerated exactly instead (``mdm_elbo_estimate``: no more network rows than the S terms, zero variance). The network
reads the time t_j (``time``) or k_j/n (``count``); a time-conditioned MDM is refused by ``count`` (its ELBO
integrates over t) and by the enumeration.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from flowlm.samplers.autoregressive import CausalDenoiser
from flowlm.samplers.base import MaskedDenoiser

ESTIMATORS = ("auto", "count", "time")
# The rows a likelihood is scored on: the item alone (context + continuation: LLaDA's and Dream's harnesses), or
# rows of the model's length with the text after the continuation [MASK] (the layout of models trained on full-length
# rows: the suite's DiT MDMs, MDLM). ``auto``: the item for the LLaMA family (LLaDA, Dream, SMDM on it).
ROW_LAYOUTS = ("auto", "item", "max_length")
TIME_EPS = 1e-3  # the ``time`` estimator's floor on t: the training's (flowlm/processes/masking.py MaskingProcess)
# The most scored positions ``mdm_elbo_exact`` enumerates (2^n − 1 network rows).
MAX_ENUMERATED = 16


def check_estimator(estimator: str, model: MaskedDenoiser) -> str:
    """The estimator ``estimator`` names for ``model``: ``auto`` is count for a time-agnostic MDM, time for a
    time-conditioned one; ``count`` only for a time-agnostic MDM."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    if estimator == "auto":
        return "time" if model.time_conditioned else "count"
    if estimator == "count" and model.time_conditioned:
        raise ValueError(
            "estimator=count feeds the network k/n, not a time of the ELBO's integral: a time-conditioned MDM needs "
            "estimator=time"
        )
    return estimator


def row_layout(rows: str, net: object) -> str:
    """The layout ``rows`` names for a network: ``auto`` is ``item`` for a LLaMA-family backbone, ``max_length``
    otherwise."""
    if rows not in ROW_LAYOUTS:
        raise ValueError(f"rows must be one of {ROW_LAYOUTS}, got {rows!r}")
    if rows != "auto":
        return rows
    from flowlm.backbones.llama import BidirectionalLM  # the backbones import transformers: only when asked

    return "item" if isinstance(net, BidirectionalLM) else "max_length"


def elbo_draws(
    scored: Tensor, samples: int, generator: torch.Generator, estimator: str = "count", eps: float = TIME_EPS
) -> tuple[Tensor, Tensor, Tensor]:
    """One row's draws for ``samples`` ELBO terms: masked positions (S, L) bool (a subset of ``scored`` (L,)), the
    time each network call reads (S,) and each term's weight (S,), float64; on ``scored``'s device, drawn on the
    generator's (see the module docstring)."""
    if samples < 1:
        raise ValueError(f"samples must be ≥ 1, got {samples}")
    device = generator.device
    scored = scored.to(device)
    strata = torch.arange(samples, device=device, dtype=torch.float64)
    u = torch.rand(samples, generator=generator, device=device, dtype=torch.float64)
    v = torch.rand((samples, scored.shape[0]), generator=generator, device=device, dtype=torch.float64)
    if estimator == "time":
        if not 0.0 <= eps < 1.0:
            raise ValueError(f"eps must lie in [0, 1), got {eps}")
        times = eps + (1.0 - eps) * (strata + 1.0 - u) / samples  # (ε, 1]: 1 − u > 0
        masked = (v < times[:, None]) & scored
        weights = (1.0 - eps) / times  # ∫_ε^1 f dt = (1 − ε)·E_{t ~ U(ε, 1]} f(t)
    elif estimator == "count":
        n = int(scored.sum())
        if n == 0:
            zeros = torch.zeros(samples, device=device, dtype=torch.float64)
            return torch.zeros((samples, scored.shape[0]), dtype=torch.bool, device=device), zeros + 1, zeros
        k = ((strata + u) * n / samples).floor().clamp_(0, n - 1) + 1  # uniform on 1…n
        v = v.masked_fill(~scored, 2.0)  # unscored positions rank last
        rank = v.argsort(-1).argsort(-1)
        masked = rank < k[:, None]
        times, weights = k / n, n / k
    else:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    return masked, times, weights


def _visible(tokens: Tensor, pinned: Tensor, scored: Tensor, masked: Tensor, mask_id: int) -> Tensor:
    """The network input: pinned and unmasked scored positions show their token, everything else [MASK]."""
    keep = pinned | (scored & ~masked)
    return torch.where(keep, tokens, mask_id)


def _masked_log_probs(model: MaskedDenoiser, x: Tensor, times: Tensor, targets: Tensor, masked: Tensor) -> Tensor:
    """Σ over ``masked`` positions of log p_θ(target | x) per row, float64 (B,)."""
    logits = model.fn(x, times.to(torch.float32))
    log_p = torch.log_softmax(logits.float(), dim=-1)
    picked = log_p.gather(-1, torch.where(masked, targets, 0)[..., None]).squeeze(-1).double()
    return torch.where(masked, picked, 0.0).sum(-1)


@torch.no_grad()
def mdm_elbo_samples(
    model: MaskedDenoiser,
    tokens: Tensor,
    pinned: Tensor,
    scored: Tensor,
    *,
    samples: int,
    generators: Sequence[torch.Generator],
    estimator: str = "auto",
    batch_size: int | None = None,
    eps: float = TIME_EPS,
) -> Tensor:
    """``samples`` terms of each row's ELBO (B, S) float64, drawn stratified over the times: their mean is unbiased,
    each term alone is not (it is its stratum's), so their i.i.d. standard error std/√S is an upper bound on the
    mean's; row b draws from ``generators[b]`` alone, so its terms do not depend on the other rows (the same
    generator seed for the choices of one question: common random draws, their differences' variance reduced).
    ``batch_size``: network rows per call (all B·S at once when None)."""
    estimator = check_estimator(estimator, model)
    if len(generators) != tokens.shape[0]:
        raise ValueError(f"one generator per row: {len(generators)} for {tokens.shape[0]} rows")
    draws = [elbo_draws(scored[b], samples, generators[b], estimator, eps) for b in range(tokens.shape[0])]
    device = tokens.device
    masked = torch.stack([d[0] for d in draws]).to(device)  # (B, S, L)
    times = torch.stack([d[1] for d in draws]).to(device).flatten()
    weights = torch.stack([d[2] for d in draws]).to(device).flatten()
    rows = tokens[:, None].expand(-1, samples, -1)
    x = _visible(rows, pinned[:, None], scored[:, None], masked, model.mask_id).flatten(0, 1)
    targets, masked = rows.flatten(0, 1), masked.flatten(0, 1)
    step = batch_size or x.shape[0]
    terms = torch.cat(
        [
            _masked_log_probs(model, x[i : i + step], times[i : i + step], targets[i : i + step], masked[i : i + step])
            for i in range(0, x.shape[0], step)
        ]
    )
    return (terms * weights).view(tokens.shape[0], samples)


@torch.no_grad()
def mdm_elbo_exact(model: MaskedDenoiser, tokens: Tensor, pinned: Tensor, scored: Tensor) -> Tensor:
    """Each row's ELBO (B,) float64, exactly: Σ over the 2^n − 1 non-empty masked sets M of the scored positions of
    Σ_{i∈M} log p_θ(x_i | …) / (|M|·C(n, |M|)); one network call per row, n ≤ ``MAX_ENUMERATED``. Time-agnostic
    MDMs only (a time-conditioned one's ELBO integrates over the time it reads)."""
    if model.time_conditioned:
        raise ValueError("the enumerated ELBO is that of a time-agnostic MDM; this one reads its time")
    out = torch.zeros(tokens.shape[0], dtype=torch.float64, device=tokens.device)
    for b in range(tokens.shape[0]):
        where = scored[b].nonzero().squeeze(-1)
        n = where.numel()
        if n == 0:
            continue
        if n > MAX_ENUMERATED:
            raise ValueError(f"{n} scored positions: the enumeration stops at {MAX_ENUMERATED} (2^n network rows)")
        # the subsets and their weights are built on the host (reading k off the device cost 2^n − 1 syncs a row)
        bits = (torch.arange(1, 2**n)[:, None] >> torch.arange(n)) & 1
        k = bits.sum(-1).double()
        combs = torch.tensor([math.comb(n, j) for j in range(n + 1)], dtype=torch.float64)
        weights = (1.0 / (k * combs[bits.sum(-1)])).to(tokens.device, non_blocking=True)
        k, bits = k.to(tokens.device, non_blocking=True), bits.to(tokens.device, non_blocking=True)
        masked = torch.zeros((bits.shape[0], tokens.shape[1]), dtype=torch.bool, device=tokens.device)
        masked[:, where] = bits.bool()
        rows = tokens[b].expand(bits.shape[0], -1)
        x = _visible(rows, pinned[b], scored[b], masked, model.mask_id)
        times = k / n  # read by no network here
        out[b] = (_masked_log_probs(model, x, times, rows, masked) * weights).sum()
    return out


def enumerable(n: int, samples: int) -> bool:
    """Whether n scored positions are enumerated exactly within ``samples`` network rows (2ⁿ − 1 ≤ S)."""
    return 0 < n <= MAX_ENUMERATED and 2**n - 1 <= samples


@torch.no_grad()
def mdm_elbo_estimate(
    model: MaskedDenoiser,
    tokens: Tensor,
    pinned: Tensor,
    scored: Tensor,
    *,
    samples: int,
    generators: Sequence[torch.Generator],
    estimator: str = "auto",
    batch_size: int | None = None,
    eps: float = TIME_EPS,
) -> tuple[Tensor, Tensor]:
    """Each row's ELBO (B,) float64 and its standard error (B,): exact (error 0) where a time-agnostic MDM's n scored
    positions are ``enumerable`` within ``samples`` rows, else the mean of ``mdm_elbo_samples`` with its i.i.d.
    standard error (an upper bound, the terms being stratified)."""
    estimator = check_estimator(estimator, model)
    counts = scored.sum(-1).tolist()
    exact = [not model.time_conditioned and enumerable(n, samples) for n in counts]
    mean = torch.zeros(tokens.shape[0], dtype=torch.float64, device=tokens.device)
    stderr = torch.zeros_like(mean)
    rows = [b for b, e in enumerate(exact) if e]
    if rows:
        pick = torch.tensor(rows, device=tokens.device)
        mean[pick] = mdm_elbo_exact(model, tokens[pick], pinned[pick], scored[pick])
    rows = [b for b, e in enumerate(exact) if not e]
    if rows:
        pick = torch.tensor(rows, device=tokens.device)
        terms = mdm_elbo_samples(
            model,
            tokens[pick],
            pinned[pick],
            scored[pick],
            samples=samples,
            generators=[generators[b] for b in rows],
            estimator=estimator,
            batch_size=batch_size,
            eps=eps,
        )
        mean[pick] = terms.mean(1)
        if samples > 1:
            stderr[pick] = terms.std(1) / math.sqrt(samples)
    return mean, stderr


@torch.no_grad()
def mdm_greedy(model: MaskedDenoiser, tokens: Tensor, pinned: Tensor, scored: Tensor) -> Tensor:
    """Whether each row's scored tokens are all the argmax of one call with every scored position masked (B,) bool:
    the continuation a one-step greedy decoding gives."""
    x = _visible(tokens, pinned, scored, scored, model.mask_id)
    logits = model.fn(x, torch.ones(tokens.shape[0], device=tokens.device))
    return ((logits.argmax(-1) == tokens) | ~scored).all(-1)


GREEDY_CHECKS = ("one_call", "iterative")


@torch.no_grad()
def mdm_greedy_iterative(model: MaskedDenoiser, tokens: Tensor, pinned: Tensor, scored: Tensor) -> Tensor:
    """LLaDA's greedy check (its harness's ``suffix_greedy_prediction``) per row (B,) bool: from the continuation all
    masked, n calls each committing the one most confident scored position (max p) at its argmax, the confidence
    sampler at T = 0 with one commit a call; true where that decodes the continuation. Positions neither pinned nor
    scored (a [MASK] tail) stay [MASK]."""
    from flowlm.samplers.mdm_confidence import ConfidenceSampler  # the samplers import the models: only when asked

    most = int(scored.sum(-1).max()) if scored.numel() else 0
    if most == 0:
        return torch.ones(tokens.shape[0], dtype=torch.bool, device=tokens.device)
    shown = torch.where(pinned, tokens, model.mask_id)  # a tail shows [MASK] and is never committed
    # ⌈masked / calls left⌉ with `most` calls: one commit a call for every row (its masked never exceed calls left)
    out = ConfidenceSampler(temperature=0.0)(model, prompt=shown, prompt_mask=~scored, nfe=most)
    return ((out.tokens == tokens) | ~scored).all(-1)


@torch.no_grad()
def causal_log_likelihood(model: CausalDenoiser, tokens: Tensor, scored: Tensor) -> tuple[Tensor, Tensor]:
    """An AR model's exact Σ_{i scored} log p(x_i | x_<i) per row (B,) float64, and whether every scored token is
    the argmax of its prediction (B,) bool (greedy decoding reproduces the continuation)."""
    log_p = torch.log_softmax(model.fn(tokens).float(), dim=-1)
    picked = log_p.gather(-1, tokens[..., None]).squeeze(-1).double()
    greedy = ((log_p.argmax(-1) == tokens) | ~scored).all(-1)
    return torch.where(scored, picked, 0.0).sum(-1), greedy
