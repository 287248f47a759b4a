"""The block KV cache of semi-autoregressive MDM decoding (flowlm/samplers/block_cache.py, Fast-dLLM's prefix and
dual cache) on the DiT: windowed passes read what a full pass would where their keys are fresh, a refresh at every
step decodes token for token as no cache (semi_ar, threshold, eb), the approximation runs within the same NFE, and
a row decodes alike alone and inside a batch of 8. The LLaMA family: test_block_cache_llama.py."""

from __future__ import annotations

import pytest
import torch

from flowlm.samplers import EBSampler, SemiARConfidenceSampler, ThresholdSampler
from flowlm.samplers.block_cache import BlockCachedReader
from lightning_modules.mdm import MDMModule

V, L = 7, 24
BACKBONE = {"d_model": 32, "n_layers": 2, "n_heads": 4, "cond_dim": 16, "dropout": 0.0}


def random_mdm(seed: int = 0, std: float = 0.4, **kwargs) -> MDMModule:
    torch.manual_seed(seed)
    module = MDMModule(data_vocab_size=V, seq_len=L, backbone=BACKBONE, optim={}, **kwargs)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, std)  # every adaLN and the head away from their zero initialisation
    return module.eval()


def prompts(b: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, V, (b, L), generator=gen)
    mask = torch.zeros(b, L, dtype=torch.bool)
    mask[:, :5] = True
    mask[1, :9] = True  # rows with different prompts: the blocks' windows cover every row's block
    mask[2, 12] = True  # a given inside the answer (Sudoku-like)
    return tokens, mask


def batch_prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """8 rows of 10 prompt positions and 14 to fill (so semi_ar plans alike for a row alone): row r a prefix of
    2 + r and 8 − r givens at 23, 21, …, so every row's blocks cover other columns."""
    tokens = torch.randint(0, V, (8, L), generator=torch.Generator().manual_seed(4))
    mask = torch.zeros(8, L, dtype=torch.bool)
    for r in range(8):
        mask[r, : 2 + r] = True
        mask[r, [23 - 2 * k for k in range(8 - r)]] = True
    return tokens, mask


DECODERS = {  # name → (sampler with a cache, budget)
    "semi_ar": (lambda **c: SemiARConfidenceSampler(block_length=4, **c), 10),
    "threshold": (lambda **c: ThresholdSampler(threshold=0.6, block_length=4, **c), 12),
    "eb": (lambda **c: EBSampler(gamma=0.4, block_length=4, **c), 12),
}


def decode(model, decoder: str, tokens, mask, **cache):
    """The decoder's output at T = 0 (no generator: argmax) under ``cache`` options."""
    make, nfe = DECODERS[decoder]
    with torch.no_grad():
        return make(**cache)(model, prompt=tokens, prompt_mask=mask, nfe=nfe, generator=None)


def assert_refresh_every_step_is_no_cache(model, decoder: str, cache: str, tokens, mask) -> None:
    """refresh=1: the same tokens, NFE (and per-row NFE) and confidences as cache=none."""
    want, got = decode(model, decoder, tokens, mask), decode(model, decoder, tokens, mask, cache=cache, refresh=1)
    assert torch.equal(got.tokens, want.tokens) and got.nfe == want.nfe
    assert (got.row_nfe is None and want.row_nfe is None) or torch.equal(got.row_nfe, want.row_nfe)
    torch.testing.assert_close(got.confidence, want.confidence, atol=1e-5, rtol=1e-5)


def assert_rows_decode_alike_alone(model, decoder: str, cache: str) -> None:
    """The approximate cache (refresh at block boundaries only): each of 8 rows decodes as it does alone (and the
    approximation shows: the batch's tokens are not all those of cache=none)."""
    tokens, mask = batch_prompts()
    batch = decode(model, decoder, tokens, mask, cache=cache)
    assert (batch.tokens != model.mask_id).all()
    assert not torch.equal(batch.tokens, decode(model, decoder, tokens, mask).tokens)
    for r in range(8):
        alone = decode(model, decoder, tokens[r : r + 1], mask[r : r + 1], cache=cache)
        assert torch.equal(alone.tokens[0], batch.tokens[r]), r
        if batch.row_nfe is not None:
            assert int(alone.row_nfe[0]) == int(batch.row_nfe[r]), r


def assert_windows_read_the_full_pass_where_keys_are_fresh(net, s: torch.Tensor, mask_id: int) -> None:
    """On two rows of ids: a window reads the full pass's logits where its keys are fresh (prefix, dual and edge
    windows, per-row fresh masks); stale keys outside the window, or inside it where not fresh, change them."""
    x = torch.randint(0, mask_id + 1, (2, L), generator=torch.Generator().manual_seed(2))

    def filled(rows: slice = slice(None)):
        cache = net.new_block_cache(L)
        torch.testing.assert_close(net.forward_window(x[rows], s[rows], cache, 0), full[rows], atol=1e-5, rtol=1e-5)
        return cache

    with torch.no_grad():
        full = net(x, s)
        cache = filled()
        for lo, hi in ((8, 16), (8, L), (0, 4), (1, 5)):  # dual, prefix and edge windows: the full pass's logits
            got = net.forward_window(x[:, lo:hi], s, cache, lo)
            torch.testing.assert_close(got, full[:, lo:hi], atol=1e-5, rtol=1e-5)
        fresh = torch.tensor([[True] * 4 + [False] * 4, [False] * 2 + [True] * 6])  # rows' own windows
        got = net.forward_window(x[:, 8:16], s, cache, 8, fresh)
        torch.testing.assert_close(got, full[:, 8:16], atol=1e-5, rtol=1e-5)
        y = x.clone()
        y[:, 16:] = mask_id  # positions outside the window changed since the refresh: the window reads their old keys
        stale = net.forward_window(y[:, 8:16], s, filled(), 8)
        assert not torch.allclose(stale, net(y, s)[:, 8:16], atol=1e-3)
        # inside the window but not fresh (row 0 at 12 … 15): the cached keys, as row 0's own window alone reads them
        y = x.clone()
        y[:, 12:16] = mask_id
        part = torch.tensor([[True] * 4 + [False] * 4, [True] * 8])
        got = net.forward_window(y[:, 8:16], s, filled(), 8, part)[0, :4]
        alone = net.forward_window(y[:1, 8:12], s[:1], filled(slice(0, 1)), 8)[0]
        torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(net.forward_window(y[:, 8:16], s, filled(), 8)[0, :4], got, atol=1e-3)
        with pytest.raises(ValueError, match="full pass"):  # a cache is filled by a full pass first
            net.forward_window(x[:, 8:16], s, net.new_block_cache(L), 8)
        with pytest.raises(ValueError, match="outside"):
            net.forward_window(x, s, filled(), 4)


def test_windowed_passes_read_the_full_pass_where_their_keys_are_fresh():
    assert_windows_read_the_full_pass_where_keys_are_fresh(random_mdm().net, torch.zeros(2), V)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("decoder", ["threshold", "eb"])
def test_a_refresh_at_every_step_decodes_as_no_cache_in_the_adaptive_decoders(cache, decoder):
    assert_refresh_every_step_is_no_cache(random_mdm().denoiser(), decoder, cache, *prompts())


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("decoder", ["semi_ar", "threshold"])
def test_a_row_decodes_alike_alone_and_inside_a_batch_of_eight(cache, decoder):
    assert_rows_decode_alike_alone(random_mdm(std=0.3).denoiser(), decoder, cache)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("score", ["sampled", "max_prob"])
def test_a_refresh_at_every_step_decodes_as_no_cache(cache, score):
    model = random_mdm().denoiser()
    tokens, mask = prompts()
    outs = {}
    for name, kwargs in (("none", {}), (cache, {"cache": cache, "refresh": 1})):
        sampler = SemiARConfidenceSampler(block_length=4, score=score, **kwargs)
        with torch.no_grad():
            outs[name] = sampler(model, prompt=tokens, prompt_mask=mask, nfe=10, generator=torch.Generator())
    assert torch.equal(outs[cache].tokens, outs["none"].tokens)
    assert outs[cache].nfe == outs["none"].nfe
    torch.testing.assert_close(outs[cache].confidence, outs["none"].confidence, atol=1e-5, rtol=1e-5)


def counting_windows(model):
    """``model`` (a MaskedDenoiser) whose windowed reads are recorded as (start, width), and the list they go to."""
    calls = []

    def windowed(length):
        read = model.windowed(length)
        return lambda x, t, start, fresh: calls.append((start, x.shape[1])) or read(x, t, start, fresh)

    return type(model)(fn=model.fn, mask_id=model.mask_id, windowed=windowed), calls


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_the_approximate_cache_spends_the_same_nfe_and_fills_every_position(cache):
    model = random_mdm(seed=3).denoiser()
    tokens, mask = prompts()
    counted, calls = counting_windows(model)
    sampler = SemiARConfidenceSampler(block_length=4, cache=cache, temperature=1.0)
    with torch.no_grad():
        out = sampler(counted, prompt=tokens, prompt_mask=mask, nfe=10, generator=torch.Generator().manual_seed(0))
    free = L - 5
    assert out.nfe == len(calls) == 10  # 5 blocks of 4 (19 free in row 0): 10 // 5 = 2 steps each (row 1: 4 × 2)
    assert (out.tokens != model.mask_id).all() and torch.equal(out.tokens[mask], tokens[mask])
    full = [c for c in calls if c == (0, L)]
    assert len(full) == -(-free // 4)  # one full pass per block
    if cache == "dual":
        # the block's window: its positions over the rows (row 1's prompt is 4 longer), never the suffix
        assert all(width <= 4 + 4 for start, width in calls if (start, width) != (0, L))
    else:
        assert all(start + width == L for start, width in calls)  # the block and everything after it


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_a_rows_logits_through_the_reader_are_those_it_reads_alone(cache):
    """Two rows whose blocks sit at different columns (4 … 7 and 10 … 13): a full pass, then the tokens change
    over 4 … 13 and a windowed call runs both blocks' columns; each row's logits at every position (its window's
    this call's, the rest its full pass's) are those of the row through a reader of its own."""
    model = random_mdm(std=0.3).denoiser()
    x = torch.randint(0, V, (2, L), generator=torch.Generator().manual_seed(6))
    lo, hi = torch.tensor([4, 10]), torch.tensor([8, 14])

    def run(rows: slice) -> torch.Tensor:
        reader = BlockCachedReader(model, cache, None, L)
        reader.block(lo[rows], hi[rows])
        y = x[rows].clone()
        t = torch.zeros(y.shape[0])
        reader(y, t)
        y[:, 4:14] = (y[:, 4:14] + 1) % V
        return reader(y, t).clone()

    with torch.no_grad():
        batch = run(slice(None))
        for r in range(2):
            torch.testing.assert_close(batch[r], run(slice(r, r + 1))[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_the_adaptive_decoders_refresh_where_a_row_enters_a_block_and_at_the_budgets_last_call(cache):
    """One row, 19 positions to fill in blocks of 4 (4, 4, 4, 4, 3), τ above every confidence and NFE 10: each call
    commits ⌈#masked / calls left⌉ = 2, so calls 1, 3, 5, 7, 9 enter a block (full passes), 2, 4, 6, 8 run the
    block's window, and call 10, the budget's last, which commits beyond the block, is a full pass."""
    model = random_mdm().denoiser()
    tokens, mask = (t[:1] for t in prompts())
    counted, calls = counting_windows(model)
    with torch.no_grad():
        out = ThresholdSampler(threshold=1.01, block_length=4, cache=cache)(
            counted, prompt=tokens, prompt_mask=mask, nfe=10
        )
    assert out.nfe == len(calls) == 10 and (out.tokens != model.mask_id).all()
    windows = [(5 + 4 * k, 4 if cache == "dual" else L - 5 - 4 * k) for k in range(4)]
    assert calls == [c for k in range(4) for c in ((0, L), windows[k])] + [(0, L), (0, L)]


def test_cache_refusals():
    with pytest.raises(ValueError, match="cache must be one of"):
        SemiARConfidenceSampler(block_length=4, cache="both")
    with pytest.raises(ValueError, match="refresh must be"):
        SemiARConfidenceSampler(block_length=4, cache="dual", refresh=0)
    with pytest.raises(ValueError, match="cfg_scale"):
        SemiARConfidenceSampler(block_length=4, cache="dual", cfg_scale=1.0)
    model = random_mdm().denoiser()
    plain = type(model)(fn=model.fn, mask_id=model.mask_id)  # a network without windowed passes
    tokens, mask = prompts()
    with pytest.raises(ValueError, match="windowed passes"):
        SemiARConfidenceSampler(block_length=4, cache="prefix")(
            plain, prompt=tokens, prompt_mask=mask, nfe=8, generator=None
        )
