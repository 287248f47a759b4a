"""The adaptive MDM decoders read p through the chunked summary (flowlm/ops/summary.py ``chunked_summary``, issue 50):
against the dense float64 log_softmax they replaced (tests/samplers/oracles.py ``DenseStats``), the same tokens, NFE
and per-row NFE, and confidences to float32 rounding, for every rank and rule, with and without semi-AR blocks and
the block KV cache, at T = 0 and T = 1, on a model whose vocabulary spans several chunks, on a tiny DiT and on a
tiny LLaMA-family MDM; the summary itself equals the dense statistics within the stated tolerance."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flowlm.ops.summary as summary_module
from flowlm.backbones.llama import BidirectionalLM
from flowlm.models.mdm import MaskedModel
from flowlm.ops.summary import chunked_summary
from flowlm.samplers import EBSampler, MaskedDenoiser, ThresholdSampler
from lightning_modules.mdm import MDMModule
from tests.backbones.test_block_cache import BACKBONE, V, random_mdm
from tests.backbones.test_block_cache_llama import TINY, away_from_init, dream_net, smdm_module
from tests.samplers.oracles import DenseEB, DenseThreshold, LogitsEB, LogitsThreshold

WIDE_V, WIDE_L = 300, 12

# name → (options, dense class, chunked class)
DECODERS = {
    "tau": ({"threshold": 0.3}, DenseThreshold, ThresholdSampler),
    "tau_margin": ({"threshold": 0.3, "score": "margin"}, DenseThreshold, ThresholdSampler),
    "tau_entropy_blocks": ({"threshold": 0.2, "score": "entropy", "block_length": 4}, DenseThreshold, ThresholdSampler),
    "factor": ({"factor": 1.5}, DenseThreshold, ThresholdSampler),
    "eb": ({"gamma": 0.8}, DenseEB, EBSampler),
    "eb_max_prob_blocks": ({"gamma": 1.5, "score": "max_prob", "block_length": 5}, DenseEB, EBSampler),
    "eb_margin": ({"gamma": 1.0, "score": "margin"}, DenseEB, EBSampler),
}


def wide_model(seed: int = 0) -> MaskedDenoiser:
    """logits[b, i] = 3·(A[x[b, i−1]] + B[x[b, i+1]]) over 300 tokens (several vocabulary chunks below), one −inf
    logit (a LLaMA-family [MASK] inside the vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    a, b = (torch.randn(WIDE_V + 1, WIDE_V, generator=g) for _ in range(2))

    def fn(x, t):
        left = torch.nn.functional.pad(x, (1, 0), value=WIDE_V)[:, :-1]
        right = torch.nn.functional.pad(x, (0, 1), value=WIDE_V)[:, 1:]
        logits = 3.0 * (a[left] + b[right])
        return logits.index_fill(-1, torch.tensor([5]), -torch.inf)

    return MaskedDenoiser(fn=fn, mask_id=WIDE_V)


def agree(dense, chunked, model, prompt, mask, nfe: int, seed: int = 3) -> None:
    """The two decoders' tokens, NFE and per-row NFE equal; confidences to float32 rounding."""
    with torch.no_grad():
        want = dense(model, prompt=prompt, prompt_mask=mask, nfe=nfe, generator=torch.Generator().manual_seed(seed))
        got = chunked(model, prompt=prompt, prompt_mask=mask, nfe=nfe, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(got.tokens, want.tokens)
    assert got.nfe == want.nfe and torch.equal(got.row_nfe, want.row_nfe)
    torch.testing.assert_close(got.confidence, want.confidence, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("name", DECODERS)
def test_the_chunked_decoders_decode_as_the_dense_oracle_over_several_chunks(name, temperature, monkeypatch):
    monkeypatch.setattr(summary_module, "CHUNK_BYTES", 4 * 64)  # chunks of 64 columns (MIN_CHUNK at its block)
    monkeypatch.setattr(summary_module, "MIN_CHUNK", 64)
    options, dense, chunked = DECODERS[name]
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, WIDE_V, (6, WIDE_L), generator=g)
    mask = torch.zeros_like(prompt, dtype=torch.bool)
    mask[:, :3] = True
    mask[2, 3:7] = True  # ragged rows
    for nfe in (2, 5, 12):
        agree(
            dense(temperature=temperature, **options),
            chunked(temperature=temperature, **options),
            wide_model(),
            prompt,
            mask,
            nfe,
        )


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("family", ["dit", "llama"])
def test_the_chunked_decoders_decode_as_the_dense_oracle_on_both_backbones(family, cache):
    model = (random_mdm() if family == "dit" else smdm_module()).denoiser()
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 7, (4, 24), generator=g)
    mask = torch.zeros_like(prompt, dtype=torch.bool)
    mask[:, :4] = True
    blocks = {"block_length": 4, "cache": cache} if cache != "none" else {}
    for temperature in (0.0, 1.0):
        for dense, chunked, rule in [
            (DenseThreshold, ThresholdSampler, {"threshold": 0.3}),
            (DenseEB, EBSampler, {"gamma": 0.5}),
        ]:
            options = {**rule, **blocks, "temperature": temperature}
            agree(dense(**options), chunked(**options), model, prompt, mask, nfe=12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_summary_is_the_dense_statistics(dtype):
    """log max p, argmax, margin and entropy from the chunks against a float64 log_softmax at |V| = 50 258 (the
    stated tolerances: 2e-5 relative for log max p, 1e-5 absolute for margin and H), with ties of the max across
    chunks (margin 0), a −inf column, and rows read alone bit for bit as in the whole call."""
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(3, 9, 50258, generator=g) * 3).to(dtype)
    logits[0, 0, [10, 40000]] = 30.0  # a tie of the max in two chunks: margin 0, the first index
    logits[1, 2, 7] = 40.0  # one sure position: H ≈ 0
    logits[..., 50257] = -torch.inf
    log_p = torch.log_softmax(logits.double(), -1)
    top2 = log_p.topk(2, dim=-1).values.exp()
    h = -(log_p.exp() * log_p.nan_to_num(neginf=0.0)).sum(-1)
    got = chunked_summary(logits, margin=True, entropy=True)
    assert torch.equal(got.argmax, log_p.argmax(-1)) and int(got.argmax[0, 0]) == 10
    torch.testing.assert_close(got.log_max.double(), top2[..., 0].log(), rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(got.margin.double(), top2[..., 0] - top2[..., 1], rtol=0, atol=1e-5)
    torch.testing.assert_close(got.entropy.double(), h, rtol=0, atol=1e-5)
    assert float(got.margin[0, 0]) == 0.0 and float(got.entropy[1, 2]) < 1e-4
    rows = torch.tensor([20, 0, 5, 13])
    alone = chunked_summary(logits, rows=rows, margin=True, entropy=True)
    for part, whole in zip(alone, got, strict=True):
        assert torch.equal(part, whole.reshape(-1)[rows])
    plain = chunked_summary(logits)
    assert plain.margin is None and plain.entropy is None and torch.equal(plain.log_max, got.log_max)


def test_the_dit_offers_its_head_whose_logits_are_the_networks():
    """MaskedModel.head_pass: the DiT up to its head's input and the head's data rows; features·Wᵀ + b is the
    denoiser's logits ([MASK] column dropped)."""
    model = random_mdm().denoiser()
    x = torch.randint(0, 8, (3, 24))
    t = torch.rand(3)
    features, weight, bias = model.head_fn(x, t)
    torch.testing.assert_close(torch.nn.functional.linear(features, weight, bias), model.fn(x, t))
    calls = []
    spied = dataclasses.replace(model, fn=lambda x, t: calls.append(1) or model.fn(x, t))
    prompt, mask = x, torch.zeros_like(x, dtype=torch.bool)
    with torch.no_grad():
        ThresholdSampler(threshold=0.5)(spied, prompt=prompt, prompt_mask=mask, nfe=6)
        assert calls == []  # the head in chunks: the network's whole logits are never made
        LogitsThreshold(threshold=0.5)(spied, prompt=prompt, prompt_mask=mask, nfe=6)
    assert len(calls) > 0


def llama_family() -> dict:
    """The tiny LLaMA family as the MDM samplers see it: SMDM's layout through the MDM module (``MaskedModel``, [MASK]
    an extra embedding row), Dream's (Qwen2, shifted logits, [MASK] inside the vocabulary) through
    ``BidirectionalLM.denoiser``, and LLaDA's ([MASK] inside the vocabulary) with its head tied to the embedding."""
    torch.manual_seed(1)
    tied = BidirectionalLM(embed_rows=V + 1, head_rows=V + 1, mask_id=V - 2, **TINY)
    away_from_init(tied)
    tied.lm_head.weight = tied.model.embed_tokens.weight
    return {"smdm": smdm_module().denoiser(), "dream": dream_net().denoiser(), "llada_tied": tied.eval().denoiser()}


def test_the_llama_family_offers_its_head_whose_logits_are_the_networks():
    """A LLaMA-family network with a plain Linear head (untied or tied) offers its head: features·Wᵀ + b is fn's
    logits ([MASK] inside the vocabulary at −∞), Dream's shift included; a LoRA-wrapped head offers none."""
    x = torch.randint(0, V, (3, 24))
    x[:, 5:9] = V  # [MASK] (SMDM, Dream); LLaDA's [MASK] is V − 2
    t = torch.rand(3)
    for name, model in llama_family().items():
        assert model.head_fn is not None, name
        with torch.no_grad():
            features, weight, bias = model.head_fn(x, t)
            torch.testing.assert_close(torch.nn.functional.linear(features, weight, bias), model.fn(x, t))
    with pytest.raises(ValueError, match="position 0"):  # Dream's shift: as fn, before any compute
        llama_family()["dream"].head_fn(torch.full((1, 24), V), t[:1])
    assert not MaskedModel(net=torch.nn.Identity(), data_vocab_size=V, mask_id=V).chunked_head()  # neither kind
    wrapped, dream = smdm_module(), dream_net()
    wrapped.net.lm_head, dream.lm_head = LoraLike(wrapped.net.lm_head), LoraLike(dream.lm_head)
    assert wrapped.denoiser().head_fn is None and dream.denoiser().head_fn is None


class LoraLike(torch.nn.Module):
    """A head that is not a plain Linear (an adapter's): the samplers must read its logits."""

    def __init__(self, base: torch.nn.Linear):
        super().__init__()
        self.base = base
        self.weight = base.weight

    def forward(self, h):
        return self.base(h)


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
@pytest.mark.parametrize(
    ("options", "with_head", "without"),
    [
        ({"threshold": 0.3}, ThresholdSampler, LogitsThreshold),
        ({"threshold": 0.3, "confidence": "max_prob"}, ThresholdSampler, LogitsThreshold),
        ({"gamma": 0.5, "score": "margin", "block_length": 4}, EBSampler, LogitsEB),
    ],
    ids=["threshold", "threshold_max_prob", "eb_margin_blocks"],
)
def test_the_head_in_chunks_decodes_as_the_networks_logits(options, with_head, without, temperature):
    """On the DiT the adaptive decoders read the head in vocabulary chunks at the eligible positions only, and draw
    from the committing rows' head product (the threshold's drawn-token rule at T > 0: at every eligible position in
    the same pass, ``chunked_head_draw``): tokens, NFE and confidences those of the logits path (T = 0, 1 and 0.7, one
    generator and per-row generators); the network's whole logits are never made."""
    plain = random_mdm().denoiser()
    calls = []
    model = dataclasses.replace(plain, fn=lambda x, t: calls.append(1) or plain.fn(x, t))
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(0, 7, (4, 24), generator=g)
    mask = torch.zeros_like(prompt, dtype=torch.bool)
    mask[:, :5] = True
    for gen in (lambda: torch.Generator().manual_seed(4), lambda: [torch.Generator().manual_seed(s) for s in range(4)]):
        with torch.no_grad():
            got = with_head(temperature=temperature, **options)(
                model, prompt=prompt, prompt_mask=mask, nfe=10, generator=gen()
            )
            assert calls == []
            want = without(temperature=temperature, **options)(
                model, prompt=prompt, prompt_mask=mask, nfe=10, generator=gen()
            )
            assert calls
            calls.clear()
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.row_nfe, want.row_nfe)
        torch.testing.assert_close(got.confidence, want.confidence, rtol=1e-5, atol=1e-6)


HEAD_SAMPLERS = {  # name → (sampler class, its logits-path oracle, options, NFE budget)
    "confidence": ("ConfidenceSampler", "LogitsConfidence", {}, 6),
    "ancestral": ("AncestralSampler", "LogitsAncestral", {}, 12),
    "ancestral_no_cache": ("AncestralSampler", "LogitsAncestral", {"cache": False}, 12),
    "semi_ar_sampled": ("SemiARConfidenceSampler", "LogitsSemiAR", {"block_length": 5}, 10),
    "semi_ar_max_prob": ("SemiARConfidenceSampler", "LogitsSemiAR", {"block_length": 5, "score": "max_prob"}, 10),
}


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
@pytest.mark.parametrize("name", HEAD_SAMPLERS)
def test_the_fixed_step_samplers_read_the_head_at_the_rows_they_need(name, temperature):
    """On the DiT the confidence sampler runs the head at its masked slots, the ancestral sampler at the rows that
    unmask (its no-change cache reusing the head's input), semi_ar at its block's slots, each drawing from the rows'
    head product: tokens, confidences, NFE and row NFE those of the logits path (tests/samplers/oracles.py
    ``Logits*``), one generator and per-row generators; the network's fn is never called."""
    import flowlm.samplers as samplers
    from tests.samplers import oracles

    kind, oracle, options, nfe = HEAD_SAMPLERS[name]
    head_path, logits_path = getattr(samplers, kind), getattr(oracles, oracle)
    model = random_mdm().denoiser()
    calls = []
    spied = dataclasses.replace(model, fn=lambda x, t: calls.append(1) or model.fn(x, t))
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 7, (4, 24), generator=g)
    # every row holds a given: with none (every position [MASK]) two positions' confidences lie 7e-10 apart at the
    # first step, inside the float32 rounding by which the head's chunked fold and the whole logits differ (≈ 1e-6 on
    # an AVX2 CPU), where their order is arbitrary: such a tie decodes either way and says nothing of the rows read
    mask = torch.arange(24) < torch.tensor([[3], [5], [1], [8]])
    options = {**options, "temperature": temperature}
    for gen in (lambda: torch.Generator().manual_seed(4), lambda: [torch.Generator().manual_seed(s) for s in range(4)]):
        with torch.no_grad():
            got = head_path(**options)(spied, prompt=prompt, prompt_mask=mask, nfe=nfe, generator=gen())
            assert calls == []
            want = logits_path(**options)(spied, prompt=prompt, prompt_mask=mask, nfe=nfe, generator=gen())
        assert calls and torch.equal(got.tokens, want.tokens) and got.nfe == want.nfe
        assert (got.row_nfe is None) == (want.row_nfe is None)
        assert got.row_nfe is None or torch.equal(got.row_nfe, want.row_nfe)
        torch.testing.assert_close(got.confidence, want.confidence, rtol=1e-5, atol=1e-6)
        calls.clear()


@pytest.mark.parametrize("autocast", [False, True])
def test_the_head_summary_is_the_dense_statistics_of_its_logits(autocast, monkeypatch):
    """chunked_head_summary (the DiT's head in vocabulary chunks, one product per chunk over every row, folded in
    row blocks) against a float64 log_softmax of the logits the head makes itself (F.linear, bf16 under autocast):
    the argmax exactly, log max p, margin and entropy within the stated tolerances, with a −∞ bias entry (a [MASK]
    inside the vocabulary: H finite), several chunks and several row blocks (the entropy's blocks are half the
    others'); under autocast the head's weight is cast to bf16 once a call, not once a chunk or row block."""
    monkeypatch.setattr(summary_module, "CHUNK_BYTES", 4 * 40 * 256)  # chunks of 256 columns for 40 rows
    monkeypatch.setattr(summary_module, "ROW_BLOCK_BYTES", 4 * 16 * 256)  # blocks of 16 rows (8 with the entropy)
    g = torch.Generator().manual_seed(3)
    n, d, vocab = 40, 16, 1000
    features, weight = torch.randn(n, d, generator=g), torch.randn(vocab, d, generator=g)
    bias = torch.randn(vocab, generator=g).index_fill(0, torch.tensor([7]), -torch.inf)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = torch.nn.functional.linear(features, weight, bias)
        casts = []
        with CastCount(casts):
            got = summary_module.chunked_head_summary(features, weight, bias, margin=True, entropy=True)
    assert logits.dtype == (torch.bfloat16 if autocast else torch.float32)
    assert sum(casts) <= (vocab * d + n * d + vocab if autocast else 0)  # each input once
    log_p = torch.log_softmax(logits.double(), -1)
    top2 = log_p.topk(2, dim=-1).values.exp()
    h = -(log_p.exp() * log_p.nan_to_num(neginf=0.0)).sum(-1)
    assert torch.equal(got.argmax, logits.float().argmax(-1))
    torch.testing.assert_close(got.log_max.double(), top2[:, 0].log(), rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(got.margin.double(), top2[:, 0] - top2[:, 1], rtol=0, atol=1e-5)
    torch.testing.assert_close(got.entropy.double(), h, rtol=0, atol=1e-5)
    plain = summary_module.chunked_summary(logits, margin=True, entropy=True)  # the logits path: float rounding
    for part, whole in zip(got, plain, strict=True):
        torch.testing.assert_close(part, whole, rtol=1e-5, atol=1e-6)


class CastCount(torch.utils._python_dispatch.TorchDispatchMode):
    """Appends the element count of every float32 → lower-precision cast (aten._to_copy) made inside it."""

    def __init__(self, counts: list):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and args[0].dtype == torch.float32:
            if kwargs.get("dtype") in (torch.bfloat16, torch.float16):
                self.counts.append(args[0].numel())
        return func(*args, **kwargs)


def test_a_chunk_all_minus_infinity_adds_nothing():
    """A vocabulary chunk whose logits are all −∞ (chunks of 64 columns) adds 0 to every sum: the statistics of
    the other columns, not NaN."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 256, generator=g) * 2
    logits[:, :64] = -torch.inf  # the whole first chunk
    got = chunked_summary(logits, chunk=64, margin=True, entropy=True)
    want = chunked_summary(logits[:, 64:], chunk=64, margin=True, entropy=True)
    assert torch.equal(got.argmax, want.argmax + 64)
    for part, whole in zip(got[::2] + got[3:], want[::2] + want[3:], strict=True):
        torch.testing.assert_close(part, whole)


LLAMA_SAMPLERS = {  # name → (sampler class, its logits-path oracle, options, NFE budget)
    **HEAD_SAMPLERS,
    "threshold": ("ThresholdSampler", "LogitsThreshold", {"threshold": 0.3}, 10),
    "threshold_max_prob": ("ThresholdSampler", "LogitsThreshold", {"threshold": 0.3, "confidence": "max_prob"}, 10),
    "eb_blocks": ("EBSampler", "LogitsEB", {"gamma": 0.5, "block_length": 4}, 10),
}


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
@pytest.mark.parametrize("name", LLAMA_SAMPLERS)
def test_every_mdm_sampler_reads_the_llama_familys_head_as_its_logits(name, temperature):
    """On the tiny LLaMA family (SMDM's layout, Dream's shifted logits, LLaDA's with a tied head) every MDM sampler
    reads the head in vocabulary chunks at the rows it needs: tokens, confidences, NFE and row NFE those of the
    logits path (one generator and per-row generators), the network's fn never called."""
    import flowlm.samplers as samplers
    from tests.samplers import oracles

    kind, oracle, options, nfe = LLAMA_SAMPLERS[name]
    head_path, logits_path = getattr(samplers, kind), getattr(oracles, oracle)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, V - 2, (4, 24), generator=g)  # no prompt id is LLaDA's [MASK] (V − 2)
    mask = torch.arange(24) < torch.tensor([[3], [5], [1], [8]])  # position 0 given (Dream predicts nothing there)
    options = {**options, "temperature": temperature}
    for family, model in llama_family().items():
        calls = []
        spied = dataclasses.replace(model, fn=lambda x, t, model=model, calls=calls: calls.append(1) or model.fn(x, t))
        for gen in (
            lambda: torch.Generator().manual_seed(4),
            lambda: [torch.Generator().manual_seed(s) for s in range(4)],
        ):
            with torch.no_grad():
                got = head_path(**options)(spied, prompt=prompt, prompt_mask=mask, nfe=nfe, generator=gen())
                assert calls == [], family
                want = logits_path(**options)(spied, prompt=prompt, prompt_mask=mask, nfe=nfe, generator=gen())
            assert calls and torch.equal(got.tokens, want.tokens) and got.nfe == want.nfe, family
            assert (got.row_nfe is None) == (want.row_nfe is None)
            assert got.row_nfe is None or torch.equal(got.row_nfe, want.row_nfe)
            torch.testing.assert_close(got.confidence, want.confidence, rtol=1e-5, atol=1e-6)
            calls.clear()


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_the_llama_family_under_the_block_cache_reads_its_windows_logits(cache):
    """Through the block KV cache the samplers read the windows' logits (the head is not run in chunks there): at
    T = 0 and 1 semi_ar, threshold and EB decode as their logits-path oracles on the LLaMA family's three layouts."""
    import flowlm.samplers as samplers
    from tests.samplers import oracles

    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, V - 2, (3, 24), generator=g)
    mask = torch.arange(24) < torch.tensor([[4], [2], [6]])
    for family, model in llama_family().items():
        for kind, oracle, options in [
            ("SemiARConfidenceSampler", "LogitsSemiAR", {"block_length": 4}),
            ("ThresholdSampler", "LogitsThreshold", {"threshold": 0.3, "block_length": 4}),
            ("EBSampler", "LogitsEB", {"gamma": 0.5, "block_length": 4}),
        ]:
            for temperature in (0.0, 1.0):
                options = {**options, "cache": cache, "temperature": temperature}
                with torch.no_grad():
                    got = getattr(samplers, kind)(**options)(
                        model, prompt=prompt, prompt_mask=mask, nfe=12, generator=torch.Generator().manual_seed(2)
                    )
                    want = getattr(oracles, oracle)(**options)(
                        model, prompt=prompt, prompt_mask=mask, nfe=12, generator=torch.Generator().manual_seed(2)
                    )
                assert torch.equal(got.tokens, want.tokens), (family, kind)
                torch.testing.assert_close(got.confidence, want.confidence, rtol=1e-5, atol=1e-6)


KEPT_SAMPLERS = {  # name → (sampler class, its two-pass oracle, its logits-path oracle, options, NFE budget)
    "confidence": ("ConfidenceSampler", "TwoPassConfidence", "LogitsConfidence", {}, 6),
    "semi_ar_max_prob": (
        "SemiARConfidenceSampler",
        "TwoPassSemiAR",
        "LogitsSemiAR",
        {"block_length": 6, "score": "max_prob"},
        8,
    ),
    "threshold_max_prob": (
        "ThresholdSampler",
        "TwoPassThreshold",
        "LogitsThreshold",
        {"threshold": 0.3, "confidence": "max_prob"},
        10,
    ),
    "eb": ("EBSampler", "TwoPassEB", "LogitsEB", {"gamma": 0.5}, 10),
    "eb_margin_blocks": ("EBSampler", "TwoPassEB", "LogitsEB", {"gamma": 0.5, "score": "margin", "block_length": 6}, 9),
}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("name", KEPT_SAMPLERS)
def test_the_samplers_that_rank_then_draw_read_the_heads_product_once(name, temperature, monkeypatch):
    """On a DiT over 300 tokens (its head in chunks of 64 columns: five chunks, five groups) the samplers that rank
    first and draw at the committing rows after fold the head's product once per call, keeping each ranked row's
    group masses for the draw (``chunked_head_keep``; the draw makes the drawn group's 64 logits again), where the
    path they replace folded it twice: tokens, NFE, row NFE and confidences those of that two-pass path and of the
    logits path (one generator and per-row generators; the same u: the stream unchanged); over the budget of kept
    masses, the two-pass path's."""
    import flowlm.samplers as samplers
    from tests.samplers import oracles

    monkeypatch.setattr(summary_module, "CHUNK_BYTES", 4 * 64)  # chunks of 64 columns at any row count
    monkeypatch.setattr(summary_module, "MIN_CHUNK", 64)
    folds = []
    fold = summary_module.head_fold
    monkeypatch.setattr(summary_module, "head_fold", lambda *a, **k: folds.append(1) or fold(*a, **k))
    kind, two_pass, logits_path, options, nfe = KEPT_SAMPLERS[name]
    options = {**options, "temperature": temperature}
    make = (getattr(samplers, kind), getattr(oracles, two_pass), getattr(oracles, logits_path))
    torch.manual_seed(0)
    module = MDMModule(data_vocab_size=WIDE_V, seq_len=24, backbone=BACKBONE, optim={})
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.4)
    model = module.eval().denoiser()
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, WIDE_V, (4, 24), generator=g)
    mask = torch.arange(24) < torch.tensor([[3], [5], [0], [8]])
    for gen in (lambda: torch.Generator().manual_seed(4), lambda: [torch.Generator().manual_seed(s) for s in range(4)]):
        runs = []
        for sampler in make:
            folds.clear()
            with torch.no_grad():
                runs.append(sampler(**options)(model, prompt=prompt, prompt_mask=mask, nfe=nfe, generator=gen()))
            runs.append(len(folds))
        got, got_folds, two, two_folds, want, _ = runs
        assert got_folds == got.nfe and two_folds > two.nfe, (got_folds, two_folds, got.nfe)  # once, not twice
        for other in (two, want):
            assert torch.equal(got.tokens, other.tokens) and got.nfe == other.nfe
            assert got.row_nfe is None or torch.equal(got.row_nfe, other.row_nfe)
            torch.testing.assert_close(got.confidence, other.confidence, rtol=1e-5, atol=1e-6)
    # over the kept masses' budget (``keeps_draw``) the draw makes its rows' head product again: the two-pass path
    monkeypatch.setattr(summary_module, "KEPT_BYTES", 4 * 5 - 1)  # under one row of five groups
    folds.clear()
    with torch.no_grad():
        over = make[0](**options)(model, prompt=prompt, prompt_mask=mask, nfe=nfe, generator=gen())
    assert len(folds) == two_folds and torch.equal(over.tokens, two.tokens)
    assert torch.equal(over.confidence, two.confidence)
