"""MDM samplers draw their float64 categorical at the committing positions only, in the same law as the
whole-tensor draw of the earlier stream (``draws="full"``, removed: tests/samplers/oracles.py), and rank in float32.

Exact laws by enumeration on a 2-position, 3-token toy whose logits at a position depend on the other position's
token: a sampler that draws at the wrong rows, ranks by the draw, or skips the temperature lands outside the
tolerance; at temperature 0 both paths give identical tokens.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from flowlm.ops import draws
from flowlm.samplers import (
    AncestralSampler,
    ConfidenceSampler,
    EBSampler,
    MaskedDenoiser,
    SemiARConfidenceSampler,
    ThresholdSampler,
)
from tests.samplers.oracles import FullDrawAncestral, FullDrawConfidence, FullDrawSemiAR

V, MASK, N = 3, 3, 60_000
BASE = torch.tensor([[1.2, 0.1, -0.5], [0.0, 0.4, 0.9]])  # logits of positions 0, 1 when the other is masked
COUPLING = torch.tensor([[0.0, 1.5, -1.0], [1.0, -0.8, 0.2], [-1.2, 0.3, 1.1]])  # row: the other's token


def toy(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """logits[l] = BASE[l] + COUPLING[x_other] where the other position is decoded (x: (B, 2) ids)."""
    other = x.flip(-1)
    shift = torch.where((other == MASK)[..., None], 0.0, COUPLING[other.clamp(max=V - 1)])
    return BASE + shift


def logits_given(l: int, other_token: int | None) -> torch.Tensor:  # noqa: E741
    return BASE[l] + (0.0 if other_token is None else COUPLING[other_token])


def probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.double() / temperature, -1)


def confidence_law(temperature: float) -> dict[tuple[int, int], float]:
    """nfe = 2: the step commits the position with the larger max p (given nothing), drawn at T; then the other
    given it."""
    first = max((0, 1), key=lambda l: torch.softmax(BASE[l].double(), -1).max().item())  # noqa: E741
    law = {}
    for a, b in itertools.product(range(V), repeat=2):
        tok = (a, b)
        p1 = probs(logits_given(first, None), temperature)[tok[first]]
        p2 = probs(logits_given(1 - first, tok[first]), temperature)[tok[1 - first]]
        law[tok] = float(p1 * p2)
    return law


def semi_ar_law(temperature: float, score: str) -> dict[tuple[int, int], float]:
    """One block of both positions, nfe = 2: the first step commits one position, the one whose candidate scores
    higher ("max_prob": max p given nothing, as the confidence sampler; "sampled": both candidates drawn at T, ranked
    by their untempered p), then the other given it."""
    if score == "max_prob":
        return confidence_law(temperature)
    marginal = [probs(logits_given(l, None), temperature) for l in (0, 1)]  # noqa: E741
    untempered = [probs(logits_given(l, None), 1.0) for l in (0, 1)]  # noqa: E741
    law = dict.fromkeys(itertools.product(range(V), repeat=2), 0.0)
    for a, b in itertools.product(range(V), repeat=2):  # the two candidates
        first, kept = (0, a) if untempered[0][a] > untempered[1][b] else (1, b)
        p_pair = float(marginal[0][a] * marginal[1][b])
        for c in range(V):  # the other position, drawn given the committed token
            tok = (kept, c) if first == 0 else (c, kept)
            law[tok] += p_pair * float(probs(logits_given(1 - first, kept), temperature)[c])
    return law


def ancestral_law(temperature: float) -> dict[tuple[int, int], float]:
    """nfe = 2 (t: 1 → ½ → 0): each position unmasks at the first step with probability ½ (drawn given nothing
    decoded), the rest at the second, given the first step's tokens."""
    law = dict.fromkeys(itertools.product(range(V), repeat=2), 0.0)
    for first in itertools.product((True, False), repeat=2):  # which positions unmask at step 1
        for tok in law:
            p = 0.25
            for l in (0, 1):  # noqa: E741
                other = 1 - l
                given = None if first[l] or not first[other] else tok[other]
                p *= probs(logits_given(l, given), temperature)[tok[l]].item()
            law[tok] += p
    return law


def independent_law(temperature: float) -> dict[tuple[int, int], float]:
    """nfe = 1: both positions commit at the one step, each drawn given nothing."""
    p = [probs(logits_given(l, None), temperature) for l in (0, 1)]  # noqa: E741
    return {(a, b): float(p[0][a] * p[1][b]) for a, b in itertools.product(range(V), repeat=2)}


def empirical(sampler, seed: int, nfe: int = 2) -> dict[tuple[int, int], float]:
    prompt = torch.zeros(N, 2, dtype=torch.long)
    out = sampler(
        MaskedDenoiser(fn=toy, mask_id=MASK),
        prompt=prompt,
        prompt_mask=torch.zeros(N, 2, dtype=torch.bool),
        nfe=nfe,
        generator=torch.Generator().manual_seed(seed),
    )
    assert out.nfe == nfe and bool((out.tokens < V).all())
    codes = (out.tokens[:, 0] * V + out.tokens[:, 1]).bincount(minlength=V * V).double() / N
    return {(a, b): codes[a * V + b].item() for a, b in itertools.product(range(V), repeat=2)}


def total_variation(p: dict, q: dict) -> float:
    return 0.5 * sum(abs(p[k] - q[k]) for k in p)


# n = 60 000 draws over 9 cells: the expected total variation from the exact law is ≈ ½ Σ √(2 p(1−p)/(π n)) ≈ 0.005;
# 0.015 is three times that, and every mutation tried moves the law by more than 0.05.
TOLERANCE = 0.015


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("score", ["max_prob", "sampled"])
@pytest.mark.parametrize("kind", [ConfidenceSampler, FullDrawConfidence], ids=["sampler", "oracle"])
def test_confidence_sampler_law(kind, score, temperature):
    """Both rankings; "sampled" draws at every masked position first (the law of one semi-AR block of both)."""
    sampler = kind(temperature=temperature, score=score)
    tv = total_variation(empirical(sampler, seed=1), semi_ar_law(temperature, score))
    assert tv <= TOLERANCE, tv


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("kind", [AncestralSampler, FullDrawAncestral], ids=["sampler", "oracle"])
def test_ancestral_sampler_law(kind, temperature):
    sampler = kind(temperature=temperature, cache=False)
    tv = total_variation(empirical(sampler, seed=2), ancestral_law(temperature))
    assert tv <= TOLERANCE, tv


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("score", ["sampled", "max_prob"])
@pytest.mark.parametrize("kind", [SemiARConfidenceSampler, FullDrawSemiAR], ids=["sampler", "oracle"])
def test_semi_ar_sampler_law(kind, score, temperature):
    sampler = kind(block_length=2, temperature=temperature, score=score)
    tv = total_variation(empirical(sampler, seed=3), semi_ar_law(temperature, score))
    assert tv <= TOLERANCE, tv


@pytest.mark.parametrize(
    "sampler",
    [
        ConfidenceSampler(temperature=0.7),
        SemiARConfidenceSampler(block_length=2, temperature=0.7, score="max_prob"),
        SemiARConfidenceSampler(block_length=2, temperature=0.7),
    ],
    ids=["confidence", "semi_ar-max_prob", "semi_ar-sampled"],
)
def test_every_committing_position_is_drawn(sampler):
    """nfe = 1 commits both positions in one step: each must be drawn (not left at its argmax), so the law is the
    product of the marginals at T."""
    tv = total_variation(empirical(sampler, seed=4, nfe=1), independent_law(0.7))
    assert tv <= TOLERANCE, tv


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize(
    ("sampler", "ranking"),
    [
        (lambda t: ThresholdSampler(threshold=1.01, temperature=t), "sampled"),
        (lambda t: ThresholdSampler(threshold=1.01, confidence="max_prob", temperature=t), "max_prob"),
        (lambda t: EBSampler(gamma=0.0, score="max_prob", temperature=t), "max_prob"),
    ],
    ids=["threshold", "threshold_max_prob", "eb"],
)
def test_adaptive_sampler_law(sampler, ranking, temperature):
    """τ above every confidence, or γ = 0, commits one position per call (flowlm/samplers/mdm_adaptive.py): the
    threshold sampler ranks by the drawn token's p (Fast-dLLM; drawn at every position first: the "sampled" law of
    one semi-AR block), with ``confidence="max_prob"`` and the EB-sampler by max p, drawn at the committing position
    only (the confidence sampler's law) at nfe = 2; at nfe = 1 both positions commit, each drawn."""
    tv = total_variation(empirical(sampler(temperature), seed=5), semi_ar_law(temperature, ranking))
    assert tv <= TOLERANCE, tv
    tv = total_variation(empirical(sampler(temperature), seed=6, nfe=1), independent_law(temperature))
    assert tv <= TOLERANCE, tv


def test_semi_ar_law_tells_the_scores_apart():
    """The two scores' laws differ by more than the tolerance (so the test above can see a swapped score)."""
    assert total_variation(semi_ar_law(1.0, "sampled"), semi_ar_law(1.0, "max_prob")) > 3 * TOLERANCE
    assert math.isclose(sum(semi_ar_law(0.7, "sampled").values()), 1.0)


def random_network(v: int, length: int, gen: torch.Generator):
    """A random MDM stand-in over ``v`` tokens ([MASK] = v): logits from a per-(token, position) table plus a term
    that depends on the whole input, so a commit changes the other positions' logits."""
    table = torch.randn(v + 1, length, v, generator=gen) * 3

    def net(x, t):
        return table[x, torch.arange(length)] + x.float().mean(-1, keepdim=True)[..., None] / 10

    return net


def test_semi_ar_greedy_paths_agree_on_ragged_blocks():
    """At T = 0 (the default) the block-rows float32 path commits the same tokens with the same confidences, in the
    same NFE (blocks × K), as the whole-tensor float64 oracle, for both scores, on a random network over a 50-token
    vocabulary whose rows have prompts of different lengths (so a block covers different columns per row); the
    confidence sampler's masked rows too."""
    gen = torch.Generator().manual_seed(13)
    v, length = 50, 26
    net = random_network(v, length, gen)

    prompt = torch.randint(0, v, (16, length), generator=gen)
    mask = torch.arange(length) < torch.randint(2, 9, (16, 1), generator=gen)  # prompts of 2..8 tokens
    model = MaskedDenoiser(fn=net, mask_id=v)
    for score in ("sampled", "max_prob"):
        a, b = (
            kind(block_length=5, score=score)(
                model, prompt=prompt, prompt_mask=mask, nfe=10, generator=torch.Generator().manual_seed(4)
            )
            for kind in (SemiARConfidenceSampler, FullDrawSemiAR)
        )
        assert torch.equal(a.tokens, b.tokens), score
        assert torch.allclose(a.confidence, b.confidence, rtol=1e-5)
        assert a.nfe == b.nfe == 5 * 2  # ⌈24 / 5⌉ = 5 blocks × 10 // 5 steps
        assert bool((a.tokens < v).all()) and torch.equal(a.tokens[mask], prompt[mask])
    a, b = (  # the confidence sampler's masked slots on the same ragged rows
        kind()(model, prompt=prompt, prompt_mask=mask, nfe=5, generator=torch.Generator())
        for kind in (ConfidenceSampler, FullDrawConfidence)
    )
    assert torch.equal(a.tokens, b.tokens) and torch.allclose(a.confidence, b.confidence, rtol=1e-5)


def one_level_draw(logits: torch.Tensor, temperature: float, u: torch.Tensor) -> torch.Tensor:
    """The one-level inverse CDF (the earlier ``sample_categorical``): first v with CDF(v) > u, in float64."""
    cdf = torch.softmax(logits.double() / temperature, -1).cumsum(-1)
    return torch.searchsorted(cdf, u * cdf[..., -1:], right=True).squeeze(-1).clamp_max(logits.shape[-1] - 1)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_two_level_draw_law_and_log_prob(monkeypatch, temperature):
    """``draw_rows`` with chunks of 4 columns over 11 tokens (a whole chunk, 4–7, and the last token at probability
    0; a narrower last chunk; rows drawn through ``rows``, one chunk per tile at this many rows): the frequencies of
    each selected row's law lie within 4.5 standard errors of softmax(logits / T), a zero-probability token is never
    drawn, and the log-probability returned is the untempered log-softmax at the token."""
    monkeypatch.setattr(draws, "CDF_CHUNK", 4)
    logits = torch.tensor(
        [
            [0.3, -1.0, 2.0, 0.0, *[float("-inf")] * 4, 1.1, -0.4, float("-inf")],
            [-2.0, 0.5, 0.1, 1.5, 0.2, -0.3, 0.9, 0.0, -1.5, 2.2, 0.4],
        ]
    )
    n = 100_000
    rows = torch.arange(2 * n) % 2
    drawn, log_p = draws.draw_rows(logits, temperature, torch.Generator().manual_seed(8), rows=rows)
    for r in (0, 1):
        freq = drawn[rows == r].bincount(minlength=11).double() / n
        p = torch.softmax(logits[r].double() / temperature, -1)
        se = (p * (1 - p) / n).sqrt()
        assert bool(((freq - p).abs() <= 4.5 * se + 1e-12).all()), (r, freq, p)
    assert not bool(torch.isinf(logits[rows, drawn]).any())
    want = torch.log_softmax(logits.double(), -1)[rows, drawn]
    torch.testing.assert_close(log_p, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_two_level_draw_picks_the_one_level_token(temperature):
    """With the same uniform per row the two-level inversion picks the token the one-level one picks (the random
    stream of the earlier ``sample_categorical`` kept), over a vocabulary of 50 258 in bf16, in one tile and in
    several."""
    logits = (2 * torch.randn(40, 50_258, generator=torch.Generator().manual_seed(9))).bfloat16()
    u = torch.rand((40, 1), generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    want = one_level_draw(logits, temperature, u)
    drawn, _ = draws.draw_rows(logits, temperature, torch.Generator().manual_seed(10))
    assert torch.equal(drawn, want)
    assert torch.equal(draws.sample_categorical(logits, temperature, torch.Generator().manual_seed(10)), want)


def test_greedy_paths_agree_and_draws_are_checked():
    """At T = 0 the float32 ranking and the float64 oracle's commit the same tokens with the same confidence, on a
    random network over a 50-token vocabulary and 4 steps; ``draws`` other than "committed" is refused, naming it."""
    gen = torch.Generator().manual_seed(3)
    v, length = 50, 24
    net = random_network(v, length, gen)

    prompt = torch.randint(0, v, (32, length), generator=gen)
    mask = torch.zeros(32, length, dtype=torch.bool)
    mask[:, :5] = True
    model = MaskedDenoiser(fn=net, mask_id=v)
    for sampler, oracle in ((ConfidenceSampler, FullDrawConfidence), (AncestralSampler, FullDrawAncestral)):
        a, b = (
            kind(temperature=0.0)(
                model, prompt=prompt, prompt_mask=mask, nfe=4, generator=torch.Generator().manual_seed(4)
            )
            for kind in (sampler, oracle)
        )
        assert torch.equal(a.tokens, b.tokens), sampler.__name__
        assert torch.allclose(a.confidence, b.confidence, rtol=1e-5)
    # At T = 1 on a network whose softmax is one-hot to float64 precision, the draw is the argmax wherever it is
    # made: every committing position must have been drawn (none left at [MASK] or at a stale id).
    sharp = MaskedDenoiser(fn=lambda x, t: net(x, t) * 1e4, mask_id=v)
    greedy = ConfidenceSampler(temperature=0.0)(
        sharp, prompt=prompt, prompt_mask=mask, nfe=4, generator=torch.Generator().manual_seed(5)
    )
    drawn = ConfidenceSampler(temperature=1.0)(
        sharp, prompt=prompt, prompt_mask=mask, nfe=4, generator=torch.Generator().manual_seed(5)
    )
    assert torch.equal(drawn.tokens, greedy.tokens)
    for kind in (ConfidenceSampler, AncestralSampler, lambda **k: SemiARConfidenceSampler(block_length=2, **k)):
        assert kind(draws="committed").temperature >= 0  # what saved configs hold: accepted
        with pytest.raises(ValueError, match=r"draws='full' was removed; the categorical is drawn where a step"):
            kind(draws="full")
    assert math.isclose(sum(confidence_law(1.0).values()), 1.0) and math.isclose(sum(ancestral_law(1.0).values()), 1.0)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_inverse_cdf_draw_frequencies(temperature):
    """``sample_categorical``: over 200 000 rows the frequencies of a 5-token law (one token at probability 0) lie
    within 4.5 standard errors of softmax(logits / T); the zero-probability token is never drawn; T = 0: argmax."""
    from flowlm.ops.draws import sample_categorical

    logits = torch.tensor([0.3, -1.0, float("-inf"), 2.0, 0.0])
    n = 200_000
    drawn = sample_categorical(logits.expand(n, -1), temperature, torch.Generator().manual_seed(7))
    freq = drawn.bincount(minlength=5).double() / n
    p = torch.softmax(logits.double() / temperature, -1)
    se = (p * (1 - p) / n).sqrt()
    assert bool(((freq - p).abs() <= 4.5 * se + 1e-12).all()), (freq, p)
    assert freq[2] == 0
    assert torch.equal(sample_categorical(logits.expand(3, -1), 0.0, None), torch.full((3,), 3))
