"""The semi-AR sampler plans each row alone (issue 37): row r has n_r = ⌈free_r / block_length⌉ blocks of
K_r = budget // n_r steps and spends n_r × K_r calls (``row_nfe``). Where every row has as many positions to fill
(Sudoku, fixed-length generation) it decodes bit for bit as the batch-planned sampler it replaced
(tests/samplers/oracles.py ``BatchPlannedSemiAR``); ragged rows alone and in a batch: test_batch_invariance.py."""

from __future__ import annotations

import pytest
import torch

from flowlm.samplers import MaskedDenoiser, SemiARConfidenceSampler
from tests.backbones.test_block_cache import L, V, counting_windows, random_mdm
from tests.samplers.oracles import BatchPlannedSemiAR
from tests.samplers.test_batch_invariance import Refusing, ragged_prompts
from tests.samplers.test_committed_draws import random_network


def equal_prompts(b: int, length: int, n_free: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``b`` rows of ``length`` whose ``n_free`` positions to fill lie at random (givens anywhere, as in Sudoku)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (b, length), generator=gen)
    chosen = torch.rand(b, length, generator=gen).argsort(-1)[:, :n_free]
    mask = torch.ones(b, length, dtype=torch.bool).scatter(1, chosen, False)
    return tokens, mask


def both(model, options: dict, tokens, mask, nfe: int, per_row: bool):
    """The sampler and the batch-planned oracle under ``options``, each with fresh generators of the same seeds."""
    outs = []
    for kind in (SemiARConfidenceSampler, BatchPlannedSemiAR):
        gen = [torch.Generator().manual_seed(3 + i) for i in range(len(tokens))] if per_row else None
        gen = gen or torch.Generator().manual_seed(3)
        with torch.no_grad():
            outs.append(kind(**options)(model, prompt=tokens, prompt_mask=mask, nfe=nfe, generator=gen))
    return outs


SHAPES = [(5, 26, 20, 10), (3, 17, 17, 12), (6, 30, 9, 12), (1, 12, 5, 4)]  # (rows, length, to fill, budget)
OPTIONS = [
    {"block_length": 4},
    {"block_length": 3, "temperature": 1.0},
    {"block_length": 5, "temperature": 0.7, "score": "max_prob"},
    {"block_length": 7, "temperature": 1.0, "score": "max_prob"},
    {"block_length": 4, "temperature": 1.0, "cfg_scale": 1.5},
]


@pytest.mark.parametrize("per_row", [False, True], ids=["one_generator", "row_generators"])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_equal_rows_decode_bit_for_bit_as_the_batch_planned_sampler(shape, options, per_row):
    b, length, n_free, nfe = shape
    model = MaskedDenoiser(fn=random_network(V, length, torch.Generator().manual_seed(length)), mask_id=V)
    tokens, mask = equal_prompts(b, length, n_free, seed=b)
    new, old = both(model, options, tokens, mask, nfe, per_row)
    assert torch.equal(new.tokens, old.tokens) and torch.equal(new.confidence, old.confidence)
    assert new.nfe == old.nfe and torch.equal(new.row_nfe, torch.full((b,), old.nfe))
    assert not (new.tokens == V).any()


@pytest.mark.parametrize(
    "cache",
    [{"cache": "prefix"}, {"cache": "dual"}, {"cache": "dual", "refresh": 2}, {"cache": "prefix", "refresh": 3}],
)
@pytest.mark.parametrize(("b", "n_free", "nfe"), [(4, 14, 10), (3, 19, 12)])
def test_equal_rows_decode_bit_for_bit_with_the_block_cache(cache, b, n_free, nfe):
    model = random_mdm(std=0.3).denoiser()
    tokens, mask = equal_prompts(b, L, n_free, seed=n_free)
    new, old = both(model, {"block_length": 4, "temperature": 1.0, **cache}, tokens, mask, nfe, per_row=True)
    assert torch.equal(new.tokens, old.tokens) and new.nfe == old.nfe
    # the confidences to float32 rounding: the cache's window passes batch the rows otherwise than the oracle's, and
    # a product of another shape may round otherwise (bit for bit on an AVX-512 CPU; ≤ 2e-7 relative on an AVX2 one)
    torch.testing.assert_close(new.confidence, old.confidence, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(("options", "nfe"), [({}, 8), ({"cache": "dual", "refresh": 2}, 12), ({"cfg_scale": 1.0}, 24)])
def test_ragged_rows_spend_their_own_blocks_times_steps(options, nfe):
    """Rows with 21 … 14 positions to fill, blocks of 4: n_r = 6, 5, 5, 5, 5, 4, 4, 4 and K_r = steps // n_r; the
    batch runs its most demanding row's calls, every row ends filled, the prompt kept."""
    tokens, mask = ragged_prompts()
    sampler = SemiARConfidenceSampler(block_length=4, temperature=1.0, **options)
    with torch.no_grad():
        out = sampler(random_mdm().denoiser(), prompt=tokens, prompt_mask=mask, nfe=nfe, generator=None)
    cost = 2 if options.get("cfg_scale") else 1
    n_blocks = torch.tensor([6, 5, 5, 5, 5, 4, 4, 4])
    assert torch.equal(out.row_nfe, n_blocks * (nfe // cost // n_blocks) * cost), out.row_nfe
    assert out.nfe == int(out.row_nfe.max()) and out.mean_nfe() < out.nfe
    assert not (out.tokens == V).any() and torch.equal(out.tokens[mask], tokens[mask])


def test_a_rows_inputs_stop_changing_once_its_schedule_is_spent():
    """The row with 14 positions (4 blocks × 2 steps at a budget of 8) sees its last change at its 8th call's
    commit, then the same input while the batch runs on; the 21-position row (6 blocks × 1) changes at every call."""
    tokens, mask = ragged_prompts()
    seen = []
    net = random_mdm().denoiser()
    model = MaskedDenoiser(fn=lambda x, t: seen.append(x.clone()) or net.fn(x, t), mask_id=net.mask_id)
    with torch.no_grad():
        out = SemiARConfidenceSampler(block_length=4)(model, prompt=tokens, prompt_mask=mask, nfe=8)
    assert out.nfe == len(seen) == 8
    changes = [(a != b).any(-1) for a, b in zip(seen, [*seen[1:], out.tokens], strict=True)]
    assert all(step[7] for step in changes) and all(step[0] for step in changes[:6])
    assert not any(step[0] for step in changes[6:])


def test_the_budget_is_checked_per_row_before_any_call():
    """The longest response (21 positions: 6 blocks of 4) needs 6 NFE; the cap is its own (16 per position), not
    the shortest row's."""
    tokens, mask = ragged_prompts()
    with pytest.raises(ValueError, match="6 blocks of 4 need at least 6 NFE, got 5"):
        SemiARConfidenceSampler(block_length=4)(Refusing(), prompt=tokens, prompt_mask=mask, nfe=5)
    with pytest.raises(ValueError, match=r"6 blocks of 4: NFE budget 11 buys 5 step\(s\)"):
        SemiARConfidenceSampler(block_length=4, cfg_scale=1.0)(Refusing(), prompt=tokens, prompt_mask=mask, nfe=11)
    with pytest.raises(ValueError, match="above the cap of 336"):
        SemiARConfidenceSampler(block_length=4).schedule(337, tokens, mask)
    row_plan, plans = SemiARConfidenceSampler(block_length=4).schedule(300, tokens, mask)  # above 16 × 14: accepted
    assert plans[0] == (14, 4, 75) and plans[-1] == (21, 6, 50) and row_plan.tolist() == list(range(7, -1, -1))


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_a_finished_rows_window_goes_idle_in_the_block_cache(cache):
    """Row 0 fills positions 0 … 19 (5 blocks × 1 step at a budget of 8), row 1 positions 16 … 23 (2 blocks × 4):
    after its 5 calls row 0 has no block (its window empty), so the last 3 calls run row 1's block 20 … 23 only."""
    tokens = torch.randint(0, V, (2, L), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, L, dtype=torch.bool)
    mask[0, :20] = mask[1, 16:] = False
    counted, calls = counting_windows(random_mdm().denoiser())
    with torch.no_grad():
        out = SemiARConfidenceSampler(block_length=4, cache=cache)(counted, prompt=tokens, prompt_mask=mask, nfe=8)
    assert out.row_nfe.tolist() == [5, 8] and len(calls) == 8
    assert calls[5:] == [(20, 4)] * 3, calls


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_each_call_commits_llada_s_split_of_its_block(temperature):
    """LLaDA's ``get_num_transfer_tokens``: a block of m masked positions with K steps commits ⌈m' / (K − k)⌉ at
    step k (m' still masked): rows with 10 and 6 positions to fill, blocks of 4, budget 6 → (3 blocks, K = 2) and
    (2 blocks, K = 3)."""
    length = 12
    network = random_network(V, length, torch.Generator().manual_seed(1))
    masked_per_call = []

    def fn(x, t):
        masked_per_call.append((x == V).sum(-1).tolist())
        return network(x, t)

    tokens = torch.randint(0, V, (2, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, length, dtype=torch.bool)
    mask[0, :10] = False
    mask[1, 3:9] = False
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        out = SemiARConfidenceSampler(block_length=4, temperature=temperature)(
            MaskedDenoiser(fn=fn, mask_id=V), prompt=tokens, prompt_mask=mask, nfe=6, generator=gen
        )
    masked = [*masked_per_call, (out.tokens == V).sum(-1).tolist()]
    commits = [[before[r] - after[r] for before, after in zip(masked[:-1], masked[1:], strict=True)] for r in range(2)]
    assert commits == [[2, 2, 2, 2, 1, 1], [2, 1, 1, 1, 1, 0]]  # row 1: ⌈4/3⌉, ⌈2/2⌉, 1; ⌈2/3⌉, ⌈1/2⌉, 0
    assert out.row_nfe.tolist() == [6, 6]
