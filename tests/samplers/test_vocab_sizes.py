"""The sizes of a pass over the vocabulary per device (flowlm/ops/summary.py ``vocab_sizes``, issue 51): the CPU keeps
its cache-sized chunks, row blocks and draw tiles; any other device (CUDA, the meta device of tests/gpu_readiness)
takes memory-bounded chunks with the rows in one block, and the values are the dense oracle's under those cuts too
(CPU tensors cut as on a GPU, the budget narrowed so that these small shapes take several chunks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flowlm.ops.draws as draws_module
import flowlm.ops.summary as summary_module
from flowlm.ops.draws import draw_rows
from flowlm.ops.summary import (
    BLOCK,
    DEVICE_PASS_BYTES,
    GROUP,
    chunk_width,
    chunked_head_draw,
    chunked_head_summary,
    chunked_summary,
    head_expectation,
    keeps_draw,
    row_block,
    vocab_sizes,
)

N, VOCAB, D = 40, 1000, 16


def test_the_cpu_keeps_its_cache_sized_passes_and_a_gpu_takes_a_handful_of_chunks():
    """CPU: today's sizes (4 MiB chunks of at least 256 columns, 1 MiB row blocks halved for the entropy, 1 MiB
    float64 draw tiles, 32 MiB blocks of the fused loss: tests/objectives/test_fused_ce.py). CUDA and meta at
    8 × 1 024 rows and |V| = 50 258: chunks of ≥ 4 096 columns (≤ 13 a pass) within the memory budget, every row in
    one block, draw tiles of ≥ 4 096 columns; one chunk at 1 × 256."""
    assert chunk_width(8192, 50258, "cpu") == 256 and chunk_width(256, 50258, "cpu") == 4096
    assert row_block(8192, 256, "cpu") == 1024 and row_block(8192, 256, "cpu", entropy=True) == 512
    assert vocab_sizes(torch.device("cpu")) == (4 << 20, 1 << 20, 1 << 20, 32 << 20)  # + fused_ce's 32 MiB blocks
    for device in ("cuda", torch.device("cuda", 1), "meta"):
        width = chunk_width(8192, 50258, device)
        assert width >= 4096 and width % BLOCK == 0 and 8192 * width * 4 <= DEVICE_PASS_BYTES, (device, width)
        assert chunk_width(256, 50258, device) == 50258
        assert row_block(8192, width, device) == row_block(8192, width, device, entropy=True) == 8192
        assert vocab_sizes(device).tile_bytes // (8 * 8192) >= 4096


@pytest.fixture
def device_sizes(monkeypatch):
    """CPU tensors cut as on a GPU (``vocab_sizes("cuda")``), the budget at 256 columns for ``N`` rows: |V| = 1 000
    in four chunks (three of 256, one of 232), the rows in one block, draw_rows' float64 tiles of one 256-column
    chunk each."""
    real = summary_module.vocab_sizes

    def as_on_a_gpu(device):
        return real("cuda")

    monkeypatch.setattr(summary_module, "vocab_sizes", as_on_a_gpu)
    monkeypatch.setattr(draws_module, "vocab_sizes", as_on_a_gpu)
    monkeypatch.setattr(summary_module, "DEVICE_PASS_BYTES", 4 * N * 256)
    assert summary_module.chunk_width(N, VOCAB, "cpu") == 256 and summary_module.row_block(N, 256, "cpu") == N


def logits_with_ties() -> torch.Tensor:
    """(N, |V|) logits: a tie of the max across two chunks (columns 100 and 700), a sure row, a −∞ column."""
    logits = torch.randn(N, VOCAB, generator=torch.Generator().manual_seed(4)) * 3
    logits[0, [100, 700]] = 30.0
    logits[1, 5] = 40.0
    logits[:, 999] = -torch.inf
    return logits


def dense(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log max p, argmax, margin, H) from a float64 log_softmax."""
    log_p = torch.log_softmax(logits.double(), -1)
    top2 = log_p.topk(2, dim=-1).values.exp()
    entropy = -(log_p.exp() * log_p.nan_to_num(neginf=0.0)).sum(-1)
    return top2[:, 0].log(), log_p.argmax(-1), top2[:, 0] - top2[:, 1], entropy


def assert_dense(got, logits: torch.Tensor, *, argmax: bool = True) -> None:
    """``got`` (a PositionSummary) within chunked_summary's stated tolerances of the float64 statistics."""
    log_max, index, margin, entropy = dense(logits)
    if argmax:
        assert torch.equal(got.argmax, index) and int(got.argmax[0]) == 100  # the first index of a tie
    torch.testing.assert_close(got.log_max.double(), log_max, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(got.margin.double(), margin, rtol=0, atol=1e-5)
    torch.testing.assert_close(got.entropy.double(), entropy, rtol=0, atol=1e-5)


def test_the_summary_cut_as_on_a_gpu_is_the_dense_statistics(device_sizes):
    """chunked_summary over four chunks and one row block: log max p, argmax (first index across chunks), margin
    (0 at the tie) and entropy those of a float64 log_softmax, rows read alone bit for bit as in the whole call."""
    logits = logits_with_ties()
    got = chunked_summary(logits, margin=True, entropy=True)
    assert_dense(got, logits)
    assert float(got.margin[0]) == 0.0
    rows = torch.tensor([17, 0, 3])
    for part, whole in zip(chunked_summary(logits, rows=rows, margin=True, entropy=True), got, strict=True):
        assert torch.equal(part, whole[rows])


def test_the_head_cut_as_on_a_gpu_is_the_dense_statistics_and_draws_as_draw_rows(device_sizes):
    """The DiT's head in four chunks (one product per chunk over all rows, one row block): the summary that of its
    logits; the draw in the same pass draw_rows' tokens (the same u, GROUP-aligned chunks) and log p."""
    gen = torch.Generator().manual_seed(6)
    features, weight = torch.randn(N, D, generator=gen), torch.randn(VOCAB, D, generator=gen)
    bias = torch.randn(VOCAB, generator=gen)
    weight[[100, 700]], bias[[100, 700]] = 0.0, 30.0  # a tie of every row's max across two chunks
    bias[3] = -torch.inf  # a [MASK] inside the vocabulary
    logits = F.linear(features, weight, bias)
    got = chunked_head_summary(features, weight, bias, margin=True, entropy=True)
    assert_dense(got, logits)
    for temperature in (1.0, 0.7):
        summary, token, log_p = chunked_head_draw(
            features, weight, bias, temperature, torch.Generator().manual_seed(5), entropy=True
        )
        want, want_log_p = draw_rows(logits, temperature, torch.Generator().manual_seed(5))
        assert torch.equal(token, want), temperature
        torch.testing.assert_close(log_p, want_log_p, rtol=0, atol=1e-6)
        torch.testing.assert_close(summary.entropy, got.entropy)


def test_draw_rows_tiles_do_not_change_its_draw(device_sizes, monkeypatch):
    """draw_rows in four float64 tiles at 40 rows (as on a GPU, narrowed) and in the CPU's one tile: the same tokens
    and log p, bit for bit (each 256-column chunk's mass is made inside one tile either way)."""
    logits = logits_with_ties()
    for temperature in (1.0, 0.7):
        for rows in (None, torch.tensor([2, 9, 0, 31])):  # 40 rows: four tiles; 4 rows: one (whole chunks)
            cut = draw_rows(logits, temperature, torch.Generator().manual_seed(1), rows=rows)
            monkeypatch.setattr(draws_module, "vocab_sizes", vocab_sizes)  # the CPU's own tile
            whole = draw_rows(logits, temperature, torch.Generator().manual_seed(1), rows=rows)
            monkeypatch.setattr(draws_module, "vocab_sizes", summary_module.vocab_sizes)
            for a, b in zip(cut, whole, strict=True):
                assert torch.equal(a, b), temperature


@pytest.mark.parametrize("cap", [None, 30.0])
def test_head_expectation_cut_as_on_a_gpu_is_dense(device_sizes, cap):
    """PR's and MLFM's one-pass head fold over four chunks: log max p, argmax and Σ p·E those of the dense
    softmax (the running rescale without the cap, the fixed shift with it)."""
    gen = torch.Generator().manual_seed(9)
    features, weight = torch.randn(N, D, generator=gen), torch.randn(VOCAB, D, generator=gen) * 2
    bias, table = torch.randn(VOCAB, generator=gen), torch.randn(VOCAB, 5, generator=gen)
    logits = F.linear(features, weight, bias)
    p = (logits if cap is None else cap * torch.tanh(logits / cap)).softmax(-1)
    log_max, index, mean = head_expectation(features, weight, bias, cap=cap, table=table)
    assert torch.equal(index, logits.argmax(-1))
    torch.testing.assert_close(log_max, p.amax(-1).log(), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(mean, p @ table, atol=1e-5, rtol=1e-4)


def test_the_kept_group_masses_are_bounded():
    """A fold that keeps its rows' group masses for a later draw (``chunked_head_keep``) holds rows × ⌈|V| / 64⌉
    float32: 25.8 MB at 8 × 1 024 rows and |V| = 50 258, kept on any device; the samplers keep them only within
    ``KEPT_BYTES`` (256 MiB: up to 85 380 rows at that vocabulary), else draw from a second head pass."""
    assert 8192 * -(-50258 // GROUP) * 4 == 25_755_648 and summary_module.KEPT_BYTES == 256 << 20
    assert keeps_draw(8192, 50258) and keeps_draw(85_380, 50258) and not keeps_draw(85_381, 50258)
