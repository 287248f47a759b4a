"""The block KV cache's reader giving the head's input (``BlockCachedReader(head=True)``, 2026-12-06): the decoders
run the output head at the rows they read only, where the windowed passes' logits cost the head over the whole
window. Its oracle is the logits path it replaced (``reads_head = False``: the windowed passes' logits through the
same cache): the head's product of the reader's features is the logits reader's output at every position, and
semi_ar / threshold / eb decode the same tokens, NFE and confidences through either, under the approximate cache
(prefix and dual, refreshed at block entries and every 2 steps), at T = 0 and T = 1, on the DiT, an SMDM Llama and a
shifted-logits Qwen2 (Dream)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flowlm.samplers import EBSampler, SemiARConfidenceSampler, ThresholdSampler
from flowlm.samplers.block_cache import BlockCachedReader
from tests.backbones.test_block_cache import L, V, prompts, random_mdm
from tests.backbones.test_block_cache_llama import dream_net, smdm_module
from tests.samplers.oracles import LogitsEB, LogitsThreshold

MODELS = {
    "dit": lambda: random_mdm(std=0.3).denoiser(),
    "llama": lambda: smdm_module().denoiser(),
    "qwen2_shifted": lambda: dream_net().denoiser(),
}


class LogitsSemiAR(SemiARConfidenceSampler):
    """``SemiARConfidenceSampler`` reading the windowed passes' logits (its path before the reader gave the head's
    input)."""

    reads_head = False


DECODERS = {  # name → (sampler, its logits oracle, options, budget)
    "semi_ar": (SemiARConfidenceSampler, LogitsSemiAR, {"block_length": 4}, 10),
    "threshold": (ThresholdSampler, LogitsThreshold, {"threshold": 0.6, "block_length": 4}, 12),
    "eb": (EBSampler, LogitsEB, {"gamma": 0.4, "block_length": 4}, 12),
}


def spying(model):
    """``model`` (a MaskedDenoiser) whose block caches record the ``head`` they were asked for, and that record."""
    asked = []

    def windowed(length, head=False):
        asked.append(head)
        return model.windowed(length, head=head)

    return dataclasses.replace(model, windowed=windowed), asked


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("family", MODELS)
def test_the_readers_features_through_the_head_are_the_logits_readers_output(family, cache):
    """A full pass, then two windowed calls with changed tokens (rows at different blocks): at every position the
    head's product of the kept features is what the logits reader keeps."""
    model = MODELS[family]()
    x = torch.randint(0, V, (2, L), generator=torch.Generator().manual_seed(6))
    x[:, 0] = 1  # Dream predicts nothing at position 0: keep it unmasked
    readers = {head: BlockCachedReader(model, cache, None, L, head=head) for head in (False, True)}
    t = torch.zeros(2)
    with torch.no_grad():
        for reader in readers.values():
            reader.block(torch.tensor([4, 10]), torch.tensor([8, 14]))
        for call in range(3):
            y = x.clone()
            y[:, 4 + call : 14] = V  # [MASK] over the blocks, fewer each call
            logits = readers[False](y, t)
            features, weight, bias = readers[True](y, t)
            assert features.shape[-1] != logits.shape[-1]  # the head's input, not its output
            product = features @ weight.T + (0 if bias is None else bias)
            torch.testing.assert_close(product, logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("refresh", [None, 2])
@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("family", MODELS)
def test_the_cached_decoders_read_the_head_as_the_logits_path_decodes(family, decoder, cache, refresh, temperature):
    model = MODELS[family]()
    spied, asked = spying(model)
    tokens, mask = prompts()
    sampler, oracle, options, nfe = DECODERS[decoder]
    outs = {}
    with torch.no_grad():
        for make in (sampler, oracle):
            decode = make(**options, cache=cache, refresh=refresh, temperature=temperature)
            generator = torch.Generator().manual_seed(0) if temperature > 0 else None
            outs[make] = decode(spied, prompt=tokens, prompt_mask=mask, nfe=nfe, generator=generator)
    assert asked == [True, False]  # the decoder asked its cache for the head's input, the oracle for logits
    got, want = outs[sampler], outs[oracle]
    assert (got.tokens != model.mask_id).all()
    assert torch.equal(got.tokens, want.tokens) and got.nfe == want.nfe
    assert (got.row_nfe is None and want.row_nfe is None) or torch.equal(got.row_nfe, want.row_nfe)
    torch.testing.assert_close(got.confidence, want.confidence, atol=1e-5, rtol=1e-5)
