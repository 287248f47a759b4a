"""The draw made in the head's vocabulary chunks (flowlm/ops/summary.py ``chunked_head_draw``, issue 50): with the
same u it draws ``draw_rows``' tokens on the head's logits (the logits path's stream unchanged), its log p is the
float64 log-softmax's to float32 rounding, and its law is softmax(l / T) (a chi-square test at T = 1 and 0.7 on a
vocabulary of 150 tokens in three chunks, three groups and a narrower last one). The same draw at some rows of a
fold that kept its group masses (``chunked_head_keep``, ``draw_kept``) is the second head pass's it replaces."""

from __future__ import annotations

import pytest
import torch

import flowlm.ops.summary as summary_module
from flowlm.ops.draws import draw_rows
from flowlm.ops.summary import GROUP, chunked_head_draw, chunked_head_keep, draw_kept

# log p from float32 logits of a chunked product and a float32 fold of |V| exponentials against the float64
# log-softmax of the whole product's logits: ≈ 2e-6 apart on an AVX2 CPU (< 1e-6 on an AVX-512 one, whose kernels
# round the chunks as the whole product), far below any change of law
LOG_P_TOL = 1e-5


def head(vocab: int, d: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weight, bias = torch.randn(vocab, d, generator=g), torch.randn(vocab, generator=g)
    return weight, bias.index_fill(0, torch.tensor([3]), -torch.inf)  # a [MASK] inside the vocabulary


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_head_draw_is_draw_rows_on_the_heads_logits(temperature, autocast):
    """Tokens of draw_rows on F.linear's logits with the same generator (one u per row) and with per-row uniforms,
    log p to float32 rounding (LOG_P_TOL), chunk widths that do and do not fill the vocabulary, margin and entropy
    those of the summary."""
    weight, bias = head(1000, d=16)
    features = torch.randn(200, 16, generator=torch.Generator().manual_seed(1)) * 0.8
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = torch.nn.functional.linear(features, weight, bias).float()
        for chunk in (None, 128, 320):
            _, token, log_p = chunked_head_draw(
                features, weight, bias, temperature, torch.Generator().manual_seed(5), chunk=chunk
            )
            want, want_log_p = draw_rows(logits, temperature, torch.Generator().manual_seed(5))
            assert torch.equal(token, want), chunk
            torch.testing.assert_close(log_p, want_log_p, rtol=0, atol=LOG_P_TOL)
            u = torch.rand(200, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
            summary, token, _ = chunked_head_draw(
                features, weight, bias, temperature, None, uniforms=u, chunk=chunk, margin=True, entropy=True
            )
            assert torch.equal(token, draw_rows(logits, temperature, None, uniforms=u)[0])
            plain = summary_module.chunked_head_summary(features, weight, bias, chunk=chunk, margin=True, entropy=True)
            assert summary.argmax is None
            for got, expected in zip(summary[2:], plain[2:], strict=True):
                torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_head_draw_follows_the_softmax(temperature, monkeypatch):
    """40 000 draws of one row's distribution over 150 tokens (chunks of 64 columns: groups 64, 64, 22): the
    chi-square statistic against softmax(l / T), cells of expected count < 5 pooled, below df + 6·√(2 df) (the
    statistic's mean df, its sd √(2 df))."""
    monkeypatch.setattr(summary_module, "CHUNK_BYTES", 4 * 64 * 40_000)  # chunks of 64 columns for 40 000 rows
    weight, bias = head(150)
    features = torch.randn(1, 8, generator=torch.Generator().manual_seed(2)).expand(40_000, 8) * 0.5
    logits = torch.nn.functional.linear(features[:1], weight, bias)[0].double()
    _, token, log_p = chunked_head_draw(features, weight, bias, temperature, torch.Generator().manual_seed(3))
    p = torch.softmax(logits / temperature, -1)
    torch.testing.assert_close(log_p, torch.log_softmax(logits, -1)[token], rtol=0, atol=LOG_P_TOL)  # untempered
    expected, counts = p * token.numel(), torch.bincount(token, minlength=150).double()
    assert counts[3] == 0  # the −∞ token is never drawn
    small = expected < 5
    assert small.any() and counts[~small].sum() > 0.9 * token.numel()  # a pooled cell, most draws in the rest
    observed = torch.cat([counts[~small], counts[small].sum()[None]])
    wanted = torch.cat([expected[~small], expected[small].sum()[None]])
    chi2, df = float(((observed - wanted) ** 2 / wanted).sum()), observed.numel() - 1
    assert chi2 < df + 6 * (2 * df) ** 0.5, (chi2, df)


PRODUCTS = (
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.mm.out,
    torch.ops.aten.addmm.out,
    torch.ops.aten.baddbmm.default,
)


class LargestProduct(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the element count of every matrix product's output made inside it."""

    def __init__(self):
        super().__init__()
        self.sizes = [0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in PRODUCTS:
            self.sizes.append(out.numel())
        return out


def test_draw_at_runs_the_head_in_chunks(monkeypatch):
    """draw_at with the head's (W, b) (the samplers' draw at committing or unmasking rows): the draw_rows tokens of
    those rows' logits, the head's product made chunk by chunk (no (n, |V|) product), nothing drawn for no rows."""
    from flowlm.ops.draws import draw_at

    monkeypatch.setattr(summary_module, "CHUNK_BYTES", 4 * 64 * 10)  # chunks of 64 columns for 10 rows
    monkeypatch.setattr(summary_module, "MIN_CHUNK", 64)
    weight, bias = head(1000, d=16)
    features = torch.randn(30, 16, generator=torch.Generator().manual_seed(1))
    rows = torch.tensor([3, 17, 0, 29, 8, 11, 5, 22, 13, 1])
    spy = LargestProduct()
    with torch.no_grad(), spy:
        token, log_p = draw_at(features, rows, 1.0, torch.Generator().manual_seed(6), linear=(weight, bias))
    assert 0 < max(spy.sizes) <= 10 * 64
    logits = torch.nn.functional.linear(features, weight, bias)
    want, want_log_p = draw_rows(logits, 1.0, torch.Generator().manual_seed(6), rows=rows)
    assert torch.equal(token, want)
    torch.testing.assert_close(log_p, want_log_p, rtol=0, atol=LOG_P_TOL)
    gen = torch.Generator().manual_seed(6)
    token, log_p = draw_at(features, rows[:0], 1.0, gen, linear=(weight, bias))
    assert token.shape == (0,) and token.dtype == torch.long and log_p.dtype == torch.float64
    assert torch.equal(gen.get_state(), torch.Generator().manual_seed(6).get_state())


def test_a_small_vocabulary_makes_no_more_logits_again_than_it_has():
    """At |V| = 6 (Sudoku) the drawn group's logits made again are the 6 columns, not a group of 64 (its gather of
    the head's rows cost more than the draw itself): draw_rows' tokens, each product at most n × |V|."""
    weight, bias = head(6)
    features = torch.randn(50, 8, generator=torch.Generator().manual_seed(3))
    spy = LargestProduct()
    with torch.no_grad(), spy:
        _, token, _ = chunked_head_draw(features, weight, bias, 1.0, torch.Generator().manual_seed(2))
    assert 0 < max(spy.sizes) <= 50 * 6
    logits = torch.nn.functional.linear(features, weight, bias)
    assert torch.equal(token, draw_rows(logits, 1.0, torch.Generator().manual_seed(2))[0])


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_a_kept_fold_draws_at_some_rows_as_a_second_head_pass(temperature, autocast):
    """chunked_head_keep over 200 rows, then draw_kept at 37 of them in any order (a sampler's committing rows after
    its rank): the summary's log max p, margin and entropy those of chunked_head_summary (no argmax); the tokens those
    of chunked_head_draw over those rows' features (the second head pass it replaces) and of draw_rows on their
    logits with the same u (one generator; per-row uniforms), log p to LOG_P_TOL; the draw makes only the drawn groups'
    logits again (each product ≤ rows × GROUP); at no rows nothing is drawn and the generator is untouched."""
    weight, bias = head(1000, d=16)
    features = torch.randn(200, 16, generator=torch.Generator().manual_seed(1)) * 0.8
    rows = torch.randperm(200, generator=torch.Generator().manual_seed(2))[:37]
    u = torch.rand(200, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = torch.nn.functional.linear(features, weight, bias).float()
        for chunk in (None, 128, 320):
            summary, kept = chunked_head_keep(
                features, weight, bias, temperature, chunk=chunk, margin=True, entropy=True
            )
            plain = summary_module.chunked_head_summary(features, weight, bias, chunk=chunk, margin=True, entropy=True)
            assert summary.argmax is None and kept.groups.shape == (200, -(-1000 // GROUP))
            for got, expected in zip(summary[::2] + summary[3:], plain[::2] + plain[3:], strict=True):
                torch.testing.assert_close(got, expected)
            spy = LargestProduct()
            with spy:
                token, log_p = draw_kept(kept, rows, torch.Generator().manual_seed(5))
            assert 0 < max(spy.sizes) <= rows.numel() * GROUP
            _, again, again_log_p = chunked_head_draw(
                features[rows], weight, bias, temperature, torch.Generator().manual_seed(5), chunk=chunk
            )
            want, want_log_p = draw_rows(logits, temperature, torch.Generator().manual_seed(5), rows=rows)
            assert torch.equal(token, again) and torch.equal(token, want), chunk
            torch.testing.assert_close(log_p, want_log_p, rtol=0, atol=LOG_P_TOL)
            torch.testing.assert_close(log_p, again_log_p, rtol=0, atol=LOG_P_TOL)
            token, _ = draw_kept(kept, rows, None, uniforms=u[rows])
            assert torch.equal(token, draw_rows(logits, temperature, None, rows=rows, uniforms=u)[0]), chunk
        gen = torch.Generator().manual_seed(6)
        token, log_p = draw_kept(kept, rows[:0], gen)
    assert token.shape == (0,) and token.dtype == torch.long and log_p.dtype == torch.float64
    assert torch.equal(gen.get_state(), torch.Generator().manual_seed(6).get_state())
