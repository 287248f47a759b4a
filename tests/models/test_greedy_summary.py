"""The greedy summary (flowlm/ops/summary.py): per position the argmax and log p there, without a (B, L, |V|)
log δ. Against the dense path it replaces: the same argmax (ties: the first index, as ``torch.argmax``) and the same
log p to float rounding, at every chunk width, under float32 and bf16 autocast; the same tokens, commits, NFE and
confidences from every flow sampler; no (B, L, |V|) tensor made."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import flowlm.ops.summary as summary_module
import flowlm.samplers.block_flow as block_flow_module
import flowlm.samplers.posterior_refinement as posterior_refinement_module
from flowlm.objectives.flow import SOFT_CAP, log_delta
from flowlm.ops.summary import (
    BLOCK,
    capped_head_summary,
    chunked_max_log_prob,
    head_expectation,
    row_max,
    row_max_runner,
)
from flowlm.samplers import BlockFlowSampler, PosteriorRefinementSampler
from flowlm.samplers.mdm_confidence import fused_max_log_prob, max_log_prob
from lightning_modules.fmlm_plus import FMLMPlusModule
from tests.models.oracles import dense_view
from tests.objectives.test_state_spaces import SAMPLERS, flow_module

D = 8


def head(vocab: int, seed: int, *, scale: float = 10.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Features (3, 4, d) and a head (|V|, d), bias, whose logits spread over ±3·scale (the cap matters there)."""
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(3, 4, D, generator=gen)
    weight = torch.randn(vocab, D, generator=gen) * scale / D**0.5
    return features, weight, torch.randn(vocab, generator=gen)


def dense(features, weight, bias):
    """Today's path: the whole head, log δ = log_softmax(cap·tanh(l/cap)), its max and argmax."""
    return log_delta(F.linear(features, weight, bias)).max(-1)


def plant_ties(weight: torch.Tensor, bias: torch.Tensor, columns: list[int]) -> None:
    """Make ``columns`` the same, largest logit of every row (zero weight rows, a large bias)."""
    weight[columns] = 0.0
    bias[columns] = 200.0


@pytest.mark.parametrize("vocab", [40, 5003])
@pytest.mark.parametrize("autocast", [False, True])
def test_capped_summary_equals_dense(vocab, autocast):
    """Every chunk width (1, odd, a block, the default, the whole vocabulary) gives torch.argmax's index of log δ and
    its value to float rounding; a tie planted across a chunk boundary and inside a block resolves to the first."""
    features, weight, bias = head(vocab, seed=vocab)
    widths = [1, 7, BLOCK, 3 * BLOCK, None, vocab] if vocab < 100 else [7, BLOCK, 1000, None, vocab]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        log_max, argmax = dense(features, weight, bias)
        for width in widths:
            got_max, got_arg = capped_head_summary(features, weight, bias, cap=SOFT_CAP, chunk=width)
            assert torch.equal(got_arg, argmax), width
            assert torch.allclose(got_max, log_max, atol=2e-5, rtol=1e-5), (width, (got_max - log_max).abs().max())
        boundary = 1000 if vocab > 1000 else 7  # a chunk boundary of the widths above
        inside = [BLOCK + 5, BLOCK + 3, 2 * BLOCK + 1] if vocab > 1000 else [13, 9, 33]  # within and across blocks
        for columns in ([boundary, boundary - 1], inside):
            tied_w, tied_b = weight.clone(), bias.clone()
            plant_ties(tied_w, tied_b, columns)
            _, want = dense(features, tied_w, tied_b)
            assert bool((want == min(columns)).all())
            for width in widths:
                _, got = capped_head_summary(features, tied_w, tied_b, cap=SOFT_CAP, chunk=width)
                assert torch.equal(got, want), (columns, width)


@pytest.mark.parametrize("cap", [None, SOFT_CAP, 2.0])
@pytest.mark.parametrize("autocast", [False, True])
def test_head_expectation_equals_dense(cap, autocast):
    """The one-pass head fold: log max p, argmax and Σ p·E of p = softmax(g(l)) (g the soft cap or the identity)
    equal the dense computation at every chunk width, under float32 and bf16 autocast (the head rounded as the
    model's logits; Σ p·E in float32 as the dense lift); without the cap the online rescaling is exercised by logits
    spread over ±30 whose running max grows from chunk to chunk."""
    features, weight, bias = head(2003, seed=7)
    table = torch.randn(2003, 5, generator=torch.Generator().manual_seed(8))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = F.linear(features, weight, bias).float()
        g = logits if cap is None else cap * torch.tanh(logits / cap)
        p = g.softmax(-1)
        with torch.autocast("cpu", enabled=False):
            want_mean = p @ table
        want_max, want_arg = p.amax(-1), logits.argmax(-1)  # the cap is monotone: the logits' argmax (it saturates)
        for width in (7, BLOCK, 500, None):
            got_max, got_arg, got_mean = head_expectation(features, weight, bias, cap=cap, table=table, chunk=width)
            assert torch.equal(got_arg, want_arg), width
            assert torch.allclose(got_max, want_max.log(), atol=2e-5, rtol=1e-5), (width, cap)
            assert torch.allclose(got_mean, want_mean, atol=1e-5, rtol=1e-4), (
                width,
                (got_mean - want_mean).abs().max(),
            )
        assert head_expectation(features, weight, bias, cap=cap)[2] is None  # no table: the summary alone
        # Σ p·E in the caller's autocast (MLFM, as its dense q·E): bf16 products, accumulated in float32
        got_mean = head_expectation(features, weight, bias, cap=cap, table=table, mean_autocast=True, chunk=500)[2]
        assert got_mean.dtype == torch.float32
        assert torch.allclose(got_mean, want_mean, atol=2e-2 if autocast else 1e-5, rtol=1e-2 if autocast else 1e-4)
    with pytest.raises(ValueError, match="table has"):
        head_expectation(features, weight, bias, table=table[:10])


def test_row_max_is_torch_max():
    """Block maxima then the first index inside the first maximal block: torch.max's values and indices, with ties
    inside a block, across blocks, and widths that are not a multiple of the block."""
    gen = torch.Generator().manual_seed(0)
    for width in (BLOCK, 4 * BLOCK, 4 * BLOCK + 3):
        z = torch.randint(-3, 4, (50, width), generator=gen).float()  # many ties of the max
        top, index = row_max(z)
        want = z.max(-1)
        assert torch.equal(top, want.values) and torch.equal(index, want.indices), width


def test_row_max_runner_is_the_max_with_its_own_entry_left_out():
    """The runner-up from the blocks' maxima: the amax of z with the max's own entry set to −∞ — the max again when
    it is tied (inside its block or in another), a block's second entry, another block's max, −∞ entries — at widths
    that are and are not a multiple of the block."""
    gen = torch.Generator().manual_seed(0)
    for width in (BLOCK, 4 * BLOCK, 4 * BLOCK + 3):
        for span in (3, 1000):  # many ties of the max, or almost none
            z = torch.randint(-span, span + 1, (200, width), generator=gen).float()
            z[:5, : width // 2] = -torch.inf  # −∞ entries (a [MASK] column at −∞ lies among them)
            z[5, :] = 0.0  # one value everywhere: the runner-up is the max
            z[6, :] = -1.0
            z[6, 1] = 5.0  # the max alone, its block's second entry the runner-up …
            z[6, min(BLOCK + 2, width - 1)] = 4.0  # … or another block's max (one block: the same one)
            top, index, runner = row_max_runner(z)
            want = z.max(-1)
            left_out = z.scatter(1, want.indices[:, None], -torch.inf).amax(-1)
            assert torch.equal(top, want.values) and torch.equal(index, want.indices), width
            assert torch.equal(runner, left_out), (width, span)
            assert runner[5] == 0.0 and runner[6] == 4.0


@pytest.mark.parametrize("autocast", [False, True])
def test_chunked_max_log_prob_equals_dense(autocast):
    """The confidence sampler's ranking read in chunks: the dense argmax and max logit − logsumexp to float
    rounding, its input left unchanged, ties resolved to the first index."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 3001, generator=gen) * 4
    logits[0, 0, [700, 1900]] = 40.0  # a tie across chunks
    logits = logits.bfloat16() if autocast else logits
    before = logits.clone()
    want_max, want_arg = fused_max_log_prob.eager(logits)
    for width in (64, 1000, None):
        got_max, got_arg = chunked_max_log_prob(logits, chunk=width)
        assert torch.equal(got_arg, want_arg) and got_arg[0, 0] == 700
        assert torch.allclose(got_max, want_max, atol=2e-5, rtol=1e-5)
    assert torch.equal(logits, before)
    assert torch.equal(max_log_prob(logits)[1], want_arg)
    # some rows only (the samplers' masked or block rows), and a slice: each row's values bit for bit, with chunks
    # of 512 columns for all 15 rows (the default width follows the whole tensor) in blocks of 4 rows
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(summary_module, "CHUNK_BYTES", 4 * 15 * 512)
        mp.setattr(summary_module, "ROW_BLOCK_BYTES", 4 * 4 * 512)
        rows = torch.tensor([14, 0, 7, 3, 9, 11])
        whole = chunked_max_log_prob(logits)
        for got, want in zip(chunked_max_log_prob(logits, rows=rows), whole, strict=True):
            assert torch.equal(got, want.reshape(-1)[rows])
        assert torch.equal(whole[1], want_arg)
        torch.testing.assert_close(whole[0], want_max, atol=2e-5, rtol=1e-5)
    sliced = chunked_max_log_prob(logits[:, 1:4], chunk=1000)
    for got, want in zip(sliced, chunked_max_log_prob(logits, chunk=1000), strict=True):
        torch.testing.assert_close(got, want[:, 1:4], rtol=0, atol=0)


def test_model_summary_is_its_log_delta():
    """FMLM+'s summary equals its forward's log δ read off (both state spaces, pinned form); the head's input is
    what the head reads (final.linear of it is forward's logits, bit for bit)."""
    module = flow_module()
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 10, 40, generator=gen)
    s, t = torch.rand(3, generator=gen), torch.rand(3, generator=gen)
    pinned = torch.rand(3, 10, generator=gen) < 0.3
    h = module.net.input_embeddings(x)
    with torch.no_grad():
        logits = module.net.forward_embeddings(h, s, t, pinned=pinned)
        assert torch.equal(module.net.final.linear(module.net.head_features(h, s, t, pinned=pinned)), logits)
        want = module(x, s, t, pinned).max(-1)
        for got in (module.view.summary(x, s, t, pinned), module.view.summary(h, s, t, pinned, embedded=True)):
            assert torch.equal(got[1], want.indices)
            assert torch.allclose(got[0], want.values, atol=2e-5, rtol=1e-5)


class LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, tuple | list) else (out,):
            if isinstance(value, torch.Tensor):
                self.most = max(self.most, value.numel())
        return out


def wide_module(vocab: int = 3000) -> FMLMPlusModule:
    """An untrained FMLM+ at a moderately large vocabulary (|V| = 3 000 ≫ d = 16), random output layer."""
    torch.manual_seed(5)
    backbone = {"d_model": 16, "n_layers": 2, "n_heads": 2, "cond_dim": 16}
    module = FMLMPlusModule(data_vocab_size=vocab, seq_len=10, backbone=backbone, optim={"lr": 1e-3}).eval()
    with torch.no_grad():
        for p in module.parameters():
            if not p.any():
                p.normal_(0, 0.5)
    return module


# Greedy samplers: no (B, L, |V|) tensor on the chunked path (the flow-map sub-steps' δ·E from the head's chunks).
GREEDY = ("pr", "pr_n2", "a_priori", "flow_map", "flm_euler", "block")
CASES = [*SAMPLERS, ("a_priori_t1", PosteriorRefinementSampler(rounds=3, confidence="a_priori", temperature=1.0), 3)]


@pytest.mark.parametrize("wide", [False, True], ids=["V40", "V3000_bf16"])
@pytest.mark.parametrize(("name", "sampler", "nfe"), CASES, ids=[c[0] for c in CASES])
def test_samplers_same_both_ways(name, sampler, nfe, wide, monkeypatch):
    """Every flow sampler gives the same tokens, NFE and confidences (to float rounding) reading the chunked
    summary as reading the full log δ (the oracle ``dense_view``); PR's commits follow (its tokens are committed round
    by round). At |V| = 3 000 under bf16 autocast (many tied bf16 logits) too. The greedy PR / a-priori call never
    makes a (B, L, |V|) tensor (at chunks of 512 columns; by default a chunk holds up to 4 MiB of logits), nor do the
    flow-map, FLM Euler, block and two-step PR samplers, whose sub-steps take δ·E from the head's chunks; the dense
    path does."""
    module, vocab = (wide_module(), 3000) if wide else (flow_module(), 40)
    b, length = 3, module.hparams.seq_len
    prompt = torch.randint(0, vocab, (b, length), generator=torch.Generator().manual_seed(4))
    prompt_mask = torch.zeros(b, length, dtype=torch.bool)
    prompt_mask[:, :3] = True
    monkeypatch.setattr(summary_module, "CHUNK_BYTES", 4 * b * length * 512)  # chunks of 512 < |V| columns
    outs, largest = [], []
    for summary in ("chunked", "dense"):
        watch = LargestTensor()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=wide), watch:
            gen = torch.Generator().manual_seed(5)
            view = module.denoiser() if summary == "chunked" else dense_view(module.denoiser())
            outs.append(sampler(view, prompt=prompt, prompt_mask=prompt_mask, nfe=nfe, generator=gen))
        largest.append(watch.most)
    assert torch.equal(outs[0].tokens, outs[1].tokens)
    assert outs[0].nfe == outs[1].nfe == nfe
    assert torch.allclose(outs[0].confidence, outs[1].confidence, atol=2e-5, rtol=1e-4)
    if name in GREEDY and wide:
        assert largest[0] < b * length * vocab <= largest[1], largest


# the most-open row (8 to generate): 8 → 8 − ⌈8/4⌉ = 6 → 6 − ⌈6/3⌉ = 4 → 4 − ⌈4/2⌉ = 2 positions; a block sampler
# its block's 3 at most (8 positions: blocks of 3, 3, 2), each × 3 rows
HEAD_ROWS = [
    ("pr", PosteriorRefinementSampler(rounds=4, threshold=1.0), [24, 18, 12, 6]),
    ("a_priori", PosteriorRefinementSampler(rounds=4, threshold=1.0, confidence="a_priori"), [24, 18, 12, 6]),
    ("pr_top_k", PosteriorRefinementSampler(rounds=4, threshold=1.0, commit="top_k", top_k=3), [24, 15, 6, 3]),
    ("block", BlockFlowSampler(block_size=3, steps_per_block=1), [9, 9, 9]),
]


@pytest.mark.parametrize(("name", "sampler", "want"), HEAD_ROWS, ids=[c[0] for c in HEAD_ROWS])
def test_greedy_flow_samplers_run_the_head_at_the_positions_they_read_only(name, sampler, want, monkeypatch):
    """Greedy PR and the a-priori loop run the flow head at the uncommitted slots of a round only: every row's
    uncommitted positions among its first ``most_open`` (a count read once, then bounded on the host by the commit
    rule's k), so a round of B rows costs B × that bound head rows, not B × L; the block sampler at its block's
    slots. Tokens and confidences those of the same sampler reading the head at every position (its summary read
    whole, no slots: the oracle below), and of the dense path (``test_samplers_same_both_ways``)."""
    import flowlm.models.flow_map as flow_map_module

    module, rows = wide_module(), []
    real = flow_map_module.head_expectation

    def counted(features, *args, **kwargs):
        rows.append(features.reshape(-1, features.shape[-1]).shape[0])
        return real(features, *args, **kwargs)

    monkeypatch.setattr(flow_map_module, "head_expectation", counted)
    b, length = 3, module.hparams.seq_len
    prompt = torch.randint(0, 3000, (b, length), generator=torch.Generator().manual_seed(4))
    prompt_mask = torch.arange(length).expand(b, length) < torch.tensor([[2], [3], [5]])  # 8, 7, 5 to generate
    seeded = lambda: torch.Generator().manual_seed(5)  # noqa: E731  the same noise for both runs
    with torch.no_grad():
        out = sampler(module.denoiser(), prompt=prompt, prompt_mask=prompt_mask, nfe=4, generator=seeded())
    assert rows == want, rows
    assert out.nfe == len(want) and torch.equal(out.tokens[prompt_mask], prompt[prompt_mask])

    def every_position(read, flag, width):  # the oracle: the summary at all B·L positions, no slots
        log_max, argmax = read(rows=torch.arange(flag.numel()))
        return log_max.view(flag.shape), argmax.view(flag.shape)

    for owner in (posterior_refinement_module, block_flow_module):
        monkeypatch.setattr(owner, "summary_at_slots", every_position)
    with torch.no_grad():
        whole = sampler(module.denoiser(), prompt=prompt, prompt_mask=prompt_mask, nfe=4, generator=seeded())
    assert rows[len(want) :] == [b * length] * len(want)
    assert torch.equal(out.tokens, whole.tokens) and len(set(out.tokens[~prompt_mask].tolist())) > 3
    assert torch.allclose(out.confidence, whole.confidence, atol=2e-5, rtol=1e-4)
