"""Adaptive-NFE MDM decoders (flowlm/samplers/mdm_adaptive.py): the threshold sampler (Fast-dLLM) and the EB-sampler,
the margin and entropy ranks, the budget as a cap, blocks, batch invariance."""

from __future__ import annotations

import math

import pytest
import torch

from flowlm.samplers import EBSampler, MaskedDenoiser, ThresholdSampler
from flowlm.samplers.mdm_adaptive import CallStats, position_scores
from tests.samplers.oracles import FullDrawConfidence

V, L = 7, 12


def neighbour_model(seed: int = 0, scale: float = 2.0) -> MaskedDenoiser:
    """logits[b, i] = scale·(A[x[b, i−1]] + B[x[b, i+1]]): positions interact, rows do not (exact per row)."""
    g = torch.Generator().manual_seed(seed)
    a, b = (torch.randn(V + 1, V, generator=g, dtype=torch.float64) for _ in range(2))

    def fn(x, t):
        left = torch.nn.functional.pad(x, (1, 0), value=V)[:, :-1]
        right = torch.nn.functional.pad(x, (0, 1), value=V)[:, 1:]
        return (scale * (a[left] + b[right])).float()

    return MaskedDenoiser(fn=fn, mask_id=V)


def prompts(batch: int, seed: int = 1, clues: int = 3):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, V, (batch, L), generator=g)
    mask = torch.zeros(batch, L, dtype=torch.bool)
    mask[:, :clues] = True
    return prompt, mask


@pytest.mark.parametrize("nfe", [9, 3], ids=["one_per_call", "three_per_call"])
def test_a_threshold_above_every_confidence_is_the_confidence_samplers_schedule(nfe):
    """τ > 1 commits ⌈#masked / calls left⌉ per call, the fixed-step confidence sampler's schedule: one per call at
    NFE = the 9 free positions, three per call at NFE 3; the same tokens."""
    model, (prompt, mask) = neighbour_model(), prompts(4)
    want = FullDrawConfidence()(model, prompt=prompt, prompt_mask=mask, nfe=nfe)
    got = ThresholdSampler(threshold=1.01)(model, prompt=prompt, prompt_mask=mask, nfe=nfe)
    assert torch.equal(got.tokens, want.tokens) and got.nfe == want.nfe == nfe
    assert torch.equal(got.row_nfe, torch.full((4,), nfe))


def test_a_threshold_at_or_below_zero_commits_a_whole_block_per_call():
    model, (prompt, mask) = neighbour_model(), prompts(2)
    assert ThresholdSampler(threshold=0.0)(model, prompt=prompt, prompt_mask=mask, nfe=9).nfe == 1
    out = ThresholdSampler(threshold=-1.0, block_length=3)(model, prompt=prompt, prompt_mask=mask, nfe=9)
    assert out.nfe == 3 and (out.tokens != V).all()  # 9 free positions, blocks of 3


def test_blocks_commit_in_order():
    """After the first call of τ ≤ 0 with blocks of 4, exactly the first block (positions 3–6) is filled."""
    model, (prompt, mask) = neighbour_model(), prompts(2)
    out = ThresholdSampler(threshold=0.0, block_length=4)(model, prompt=prompt, prompt_mask=mask, nfe=3)
    assert out.nfe == 3  # 9 free positions: blocks of 4, 4, 1
    one = ThresholdSampler(threshold=0.0, block_length=4)
    first = one(model, prompt=prompt, prompt_mask=mask, nfe=3).tokens
    partial = _after_calls(one, model, prompt, mask, calls=1, nfe=3)
    assert (partial[:, 3:7] != V).all() and (partial[:, 7:] == V).all()
    assert torch.equal(partial[:, 3:7], first[:, 3:7])


def _after_calls(sampler, model, prompt, mask, *, calls: int, nfe: int):
    """The state after ``calls`` network calls: the model raises once it is called once more."""
    seen = []

    def fn(x, t):
        if len(seen) == calls:
            raise StopIteration(x.clone())
        seen.append(1)
        return model.fn(x, t)

    with pytest.raises(StopIteration) as stop:
        sampler(MaskedDenoiser(fn=fn, mask_id=V), prompt=prompt, prompt_mask=mask, nfe=nfe)
    return stop.value.args[0]


def test_gamma_zero_commits_one_position_per_call():
    model, (prompt, mask) = neighbour_model(), prompts(4)
    free = int((~mask).sum(-1).max())
    want = FullDrawConfidence()(model, prompt=prompt, prompt_mask=mask, nfe=free)
    got = EBSampler(gamma=0.0, score="max_prob")(model, prompt=prompt, prompt_mask=mask, nfe=free)
    assert torch.equal(got.tokens, want.tokens) and got.nfe == free
    assert EBSampler(gamma=0.0)(model, prompt=prompt, prompt_mask=mask, nfe=free).nfe == free


def stats_of(log_p: torch.Tensor, score: str = "max_prob") -> CallStats:
    """A decoder's ``CallStats`` of every position of (1, L, |V|) log-probabilities, read as its calls read them."""
    sampler = EBSampler(score=score)  # reads the entropy for its rule, the margin for score="margin"
    return sampler.stats(log_p, torch.arange(log_p.shape[1]))


def test_margin_and_entropy_ranks_on_a_hand_example():
    """Three positions over three tokens; each rank orders them differently:
    Z = (.60, .39, .01): max .60, margin .21, H .720;  Y = (.49, .255, .255): max .49, margin .235, H 1.046;
    X = (.47, .47, .06): max .47, margin 0, H .879."""
    p = torch.tensor([[0.60, 0.39, 0.01], [0.49, 0.255, 0.255], [0.47, 0.47, 0.06]], dtype=torch.float64)
    log_p = p.log()[None]
    h = [-sum(v * math.log(v) for v in row) for row in p.tolist()]
    got = stats_of(log_p, "margin")
    assert got.entropy[0].tolist() == pytest.approx(h, abs=1e-6)
    assert h == pytest.approx([0.7198, 1.0465, 0.8785], abs=1e-4)
    assert got.confidence[0].tolist() == pytest.approx([0.60, 0.49, 0.47], abs=1e-6)
    order = {s: position_scores(got, s)[0].argsort(descending=True).tolist() for s in ("max_prob", "margin", "entropy")}
    assert order == {"max_prob": [0, 1, 2], "margin": [1, 0, 2], "entropy": [0, 2, 1]}
    assert position_scores(got, "margin")[0].tolist() == pytest.approx([0.21, 0.235, 0.0], abs=1e-6)


def test_the_factor_threshold_and_entropy_rules_count_by_hand():
    """NVlabs' factor rule, f = 1, thresholds 1 − f/(n + 1) = −, .667, .75, .8 for n = 1 … 4: over .99 ≥ .95 ≥ .70 only
    the last fails, so all three commit (its "commit the last one too"); with a fourth at .50 the prefix stops at 2;
    the first position always holds.
    Fast-dLLM's threshold keeps c ≥ τ: τ = .95 commits .99 and .95. EB γ = .25 over entropies .1, .2, .5 (best
    first): Σ − max = 0, .1, .3 → 2."""
    confidence = torch.tensor([[0.99, 0.95, 0.70, 0.50]], dtype=torch.float64)
    token = torch.zeros(1, 4, dtype=torch.long)
    stats = CallStats(confidence, token, entropy=torch.tensor([[0.1, 0.2, 0.5, 0.9]]))
    ordered = torch.tensor([[0, 1, 2, 3]])
    three = torch.tensor([[True, True, True, False]])
    four = torch.ones(1, 4, dtype=torch.bool)
    assert ThresholdSampler(factor=1.0).select(stats, ordered, three).tolist() == [3]
    assert ThresholdSampler(factor=1.0).select(stats, ordered, four).tolist() == [2]
    assert ThresholdSampler(factor=1.0).select(stats, ordered, torch.tensor([[False, False, True, True]])) == 2
    assert ThresholdSampler(threshold=0.95).select(stats, ordered, four).tolist() == [2]
    # the first always holds (NVlabs' −1): over .30 ≥ .20 only the last fails, so both commit
    low = CallStats(torch.tensor([[0.3, 0.2]], dtype=torch.float64), token[:, :2])
    assert ThresholdSampler(factor=1.0).select(low, ordered[:, :2], four[:, :2]).tolist() == [2]
    assert EBSampler(gamma=0.25).select(stats, ordered, three).tolist() == [2]
    assert EBSampler(gamma=0.05).select(stats, ordered, three).tolist() == [1]


@pytest.mark.parametrize(
    "sampler",
    [
        ThresholdSampler(threshold=0.9),
        ThresholdSampler(threshold=0.5, block_length=4),
        ThresholdSampler(factor=1.0),
        ThresholdSampler(threshold=0.9, score="margin", temperature=1.0),
        EBSampler(gamma=0.5),
        EBSampler(gamma=2.0, score="margin", block_length=3),
    ],
    ids=["tau", "tau_blocks", "factor", "margin_drawn", "eb", "eb_margin_blocks"],
)
@pytest.mark.parametrize("nfe", [1, 2, 5, 9, 20])
def test_the_budget_is_a_cap_and_nothing_stays_masked(sampler, nfe):
    model, (prompt, mask) = neighbour_model(scale=0.5), prompts(5)
    out = sampler(model, prompt=prompt, prompt_mask=mask, nfe=nfe, generator=torch.Generator().manual_seed(3))
    assert out.nfe <= nfe and int(out.row_nfe.max()) == out.nfe and (out.tokens != V).all()
    assert torch.equal(out.tokens[mask], prompt[mask])
    assert out.mean_nfe() == pytest.approx(out.row_nfe.float().mean().item())


@pytest.mark.parametrize("sampler", [ThresholdSampler(threshold=0.7, block_length=4), EBSampler(gamma=0.3)])
def test_a_row_decodes_alike_alone_and_inside_a_batch_of_eight(sampler):
    model, (prompt, mask) = neighbour_model(), prompts(8, seed=5)
    batch = sampler(model, prompt=prompt, prompt_mask=mask, nfe=9)
    for i in range(8):
        alone = sampler(model, prompt=prompt[i : i + 1], prompt_mask=mask[i : i + 1], nfe=9)
        assert torch.equal(alone.tokens[0], batch.tokens[i]) and int(alone.row_nfe[0]) == int(batch.row_nfe[i])


def test_bad_settings_are_refused_before_any_call():
    for make, match in [
        (lambda: ThresholdSampler(score="sampled"), "score must be one of"),
        (lambda: ThresholdSampler(factor=0.0), "factor must be > 0"),
        (lambda: ThresholdSampler(block_length=0), "block_length must be ≥ 1"),
        (lambda: EBSampler(gamma=-0.1), "gamma must be ≥ 0"),
        (lambda: ThresholdSampler(cache="dual"), "needs semi-AR blocks"),
        (lambda: EBSampler(cache="prefix"), "needs semi-AR blocks"),
        (lambda: ThresholdSampler(block_length=4, cache="both"), "cache must be one of"),
        (lambda: EBSampler(block_length=4, cache="dual", refresh=0), "refresh must be"),
    ]:
        with pytest.raises(ValueError, match=match):
            make()
    model, (prompt, mask) = neighbour_model(), prompts(2)
    with pytest.raises(ValueError, match="windowed passes"):  # a network without them: refused before any call
        ThresholdSampler(block_length=4, cache="dual")(model, prompt=prompt, prompt_mask=mask, nfe=4)


def test_a_minus_infinite_logit_leaves_every_rank_finite():
    """LLaMA-family MDMs put the [MASK] logit at −inf: 0·(−inf) must not make the entropy rank NaN (it ordered every
    position by index)."""
    logits = torch.tensor([[[2.0, 0.0, -torch.inf], [0.0, 0.0, -torch.inf]]])
    for score in ("max_prob", "margin", "entropy"):
        got = position_scores(stats_of(logits, score), score)
        assert torch.isfinite(got).all() and got[0, 0] > got[0, 1], score


def commits_per_call(sampler, prompt, mask, nfe: int) -> list[list[int]]:
    """Per call, each row's commits (its [MASK] count before the call minus after it)."""
    model = neighbour_model(scale=0.5)
    seen = []

    def fn(x, t):
        seen.append((x == V).sum(-1).tolist())
        return model.fn(x, t)

    out = sampler(MaskedDenoiser(fn=fn, mask_id=V), prompt=prompt, prompt_mask=mask, nfe=nfe)
    seen.append((out.tokens == V).sum(-1).tolist())
    return [[a - b for a, b in zip(seen[i], seen[i + 1], strict=True)] for i in range(len(seen) - 1)]


def test_a_binding_budget_splits_its_calls_over_the_blocks_left():
    """41 positions in blocks of 7 (six blocks, the last of 6), budget 8, a rule that commits one per call (τ above
    every confidence): each call commits the current block's share of the calls left, split over the blocks still
    holding [MASK]: 7, 7, 7, 7 (one call per block while 8 ≥ 6, 7 ≥ 5, …), then 4 + 3 (two calls for five), then
    3 + 3 (the last call commits the rest). The whole-row floor gave 6, 1, 6, 1, 7, 7, 7, 6 (issue 48)."""
    prompt = torch.zeros(2, 41, dtype=torch.long)
    mask = torch.zeros_like(prompt, dtype=torch.bool)
    got = commits_per_call(ThresholdSampler(threshold=1.01, block_length=7), prompt, mask, nfe=8)
    assert [row[0] for row in got] == [7, 7, 7, 7, 4, 3, 3, 3]
    out = ThresholdSampler(threshold=1.01, block_length=7)(
        neighbour_model(scale=0.5), prompt=prompt, prompt_mask=mask, nfe=8
    )
    assert out.forced.tolist() == [41 - 8, 41 - 8]  # every commit beyond one per call was the budget's
    # without blocks the floor is ⌈#masked / calls left⌉ (the confidence sampler's schedule): 6, 5, 5, 5, 5, 5, 5, 5
    assert [row[0] for row in commits_per_call(ThresholdSampler(threshold=1.01), prompt, mask, nfe=8)] == [
        6,
        5,
        5,
        5,
        5,
        5,
        5,
        5,
    ]


def test_a_rule_that_needs_no_help_is_never_forced():
    """τ ≤ 0 commits every eligible position by its own rule: nothing is forced, whatever the budget."""
    prompt, mask = prompts(3)
    out = ThresholdSampler(threshold=0.0)(neighbour_model(), prompt=prompt, prompt_mask=mask, nfe=2)
    assert out.nfe == 1 and out.forced.tolist() == [0, 0, 0]
