"""The head's weight laid out (d, |V|) once a decode (``flowlm.samplers.common.column_major_head``, 2026-12-06,
night) and the block cache's unmasked window writes (``BlockCachedReader``: ``fresh`` None where every row's window
spans the call's columns): the chunked head's product reads each chunk's columns contiguously, one copy of the weight
a decode, made again after an in-place update of the weight; semi_ar / threshold / eb decode the tokens, NFE and
confidences of the row-major weight (``column_major = False``, the path before) with and without the block cache, at
T = 0 and T = 1, on a Llama in SMDM's layout with a vocabulary of several chunks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flowlm.ops.summary as summary
from flowlm.samplers import EBSampler, SemiARConfidenceSampler, ThresholdSampler
from flowlm.samplers.block_cache import BlockCachedReader
from flowlm.samplers.common import column_major_head
from lightning_modules.mdm import MDMModule
from tests.backbones.test_block_cache import L, prompts
from tests.backbones.test_block_cache_llama import TINY, away_from_init

V = 1000  # several of the narrowed chunks below


def llama_mdm() -> MDMModule:
    """A tiny random Llama MDM in SMDM's layout ([MASK] = the extra embedding row V) over V data ids."""
    torch.manual_seed(0)
    backbone = {"_target_": "flowlm.backbones.llama.BidirectionalLM", **TINY, "embed_rows": V + 1, "head_rows": V}
    module = MDMModule(data_vocab_size=V, seq_len=L, backbone={**backbone, "mask_id": V}, optim={})
    away_from_init(module)
    return module.eval()


def decoders(column_major: bool):
    """semi_ar, threshold and eb with blocks, the head's weight laid out or not."""
    kinds = {
        "semi_ar": (SemiARConfidenceSampler, {"block_length": 4}, 10),
        "threshold": (ThresholdSampler, {"threshold": 0.6, "block_length": 4}, 12),
        "eb": (EBSampler, {"gamma": 0.4, "block_length": 4}, 12),
    }
    return {
        name: (type(f"{cls.__name__}Layout", (cls,), {"column_major": column_major}), options, nfe)
        for name, (cls, options, nfe) in kinds.items()
    }


def test_one_copy_a_decode_made_again_after_an_update():
    """The weight handed on is the head's values as a (d, |V|)-contiguous view, the same copy at every call; an
    in-place update of the weight makes a new one; float64, or with gradients on, the weight passes as it is."""
    weight, bias = torch.randn(12, 5), torch.randn(12)
    features = torch.randn(2, 3, 5)
    head = column_major_head(lambda x, t: (features, weight[:10], bias[:10]))
    with torch.no_grad():
        _, first, b = head(None, None)
        _, again, _ = head(None, None)
        assert torch.equal(first, weight[:10]) and b is not None and torch.equal(b, bias[:10])
        assert first.stride() == (1, 10) and first.t().is_contiguous()
        assert again.data_ptr() == first.data_ptr()  # no copy at the second call
        weight.mul_(2)  # an optimizer step between two decodes through one view
        _, updated, _ = head(None, None)
        assert torch.equal(updated, weight[:10]) and updated.data_ptr() != first.data_ptr()
    assert head(None, None)[1].stride() == (5, 1)  # gradients on: untouched
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 autocast casts each chunk: untouched
        assert column_major_head(lambda x, t: (features, weight, None))(None, None)[1] is weight
    wide = weight.double()
    with torch.no_grad():
        assert column_major_head(lambda x, t: (features, wide, None))(None, None)[1] is wide
    assert column_major_head(None) is None


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("decoder", ["semi_ar", "threshold", "eb"])
def test_the_fold_reads_one_column_major_copy_a_decode(monkeypatch, decoder, cache):
    """Every chunked head product of a decode gets the same (d, |V|)-contiguous weight (the row-major one before)."""
    seen = []
    fold = summary.head_fold

    def spy(features, weight, *args, **kwargs):
        seen.append((weight.stride(), weight.data_ptr()))
        return fold(features, weight, *args, **kwargs)

    monkeypatch.setattr(summary, "head_fold", spy)
    model = llama_mdm().denoiser()
    tokens, mask = prompts()
    sampler, options, nfe = decoders(True)[decoder]
    with torch.no_grad():
        sampler(**options, cache=cache)(model, prompt=tokens, prompt_mask=mask, nfe=nfe, generator=None)
    assert len(seen) >= 3
    assert {stride for stride, _ in seen} == {(1, V)}
    assert len({ptr for _, ptr in seen}) == 1


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("decoder", ["semi_ar", "threshold", "eb"])
def test_column_major_decodes_as_row_major(monkeypatch, decoder, cache, temperature):
    """The same tokens, NFE and confidences with the weight laid out as without, chunks of 256 columns (on this CPU
    the chunk products are equal bit for bit; the confidences are compared to float rounding)."""
    monkeypatch.setattr(summary, "CHUNK_BYTES", 4 * 256)  # one chunk of 256 columns whatever the rows
    model = llama_mdm().denoiser()
    tokens, mask = prompts()
    outs = []
    with torch.no_grad():
        for column_major in (True, False):
            sampler, options, nfe = decoders(column_major)[decoder]
            generator = torch.Generator().manual_seed(0) if temperature > 0 else None
            decode = sampler(**options, cache=cache, temperature=temperature)
            outs.append(decode(model, prompt=tokens, prompt_mask=mask, nfe=nfe, generator=generator))
    got, want = outs
    assert (got.tokens != model.mask_id).all()
    assert torch.equal(got.tokens, want.tokens) and got.nfe == want.nfe
    torch.testing.assert_close(got.confidence, want.confidence, atol=1e-6, rtol=1e-6)


def test_windows_in_step_write_unmasked(monkeypatch):
    """A call whose rows' windows all span its columns (a batch in step, every full pass) hands the network no
    ``fresh`` mask (plain slice writes, no ``torch.where`` over the keys); rows at different blocks still get one."""
    model = llama_mdm().denoiser()
    asked = []

    def windowed(length, head=False):
        read = model.windowed(length, head=head)

        def spy(x, t, start, fresh=None):
            asked.append((start, x.shape[1], None if fresh is None else fresh.clone()))
            return read(x, t, start, fresh)

        return spy

    reader = BlockCachedReader(dataclasses.replace(model, windowed=windowed), "dual", None, L, head=True)
    x = torch.randint(0, V, (2, L))
    t = torch.zeros(2)
    with torch.no_grad():
        reader.block(torch.tensor([8, 8]), torch.tensor([12, 12]))
        reader(x, t)  # the full pass
        reader(x, t)  # both rows' block [8, 12)
        reader.block(torch.tensor([4, 12]), torch.tensor([8, 16]))  # rows at different blocks
        reader(x, t)
        reader(x, t)
    assert [(start, n, fresh is None) for start, n, fresh in asked[:3]] == [(0, L, True), (8, 4, True), (0, L, True)]
    start, n, fresh = asked[3]
    assert (start, n) == (4, 12) and fresh is not None
    assert fresh[0, :4].all() and not fresh[0, 4:].any() and fresh[1, 8:].all() and not fresh[1, :8].any()
