"""The block KV cache on the LLaMA family (flowlm/backbones/llama.py ``BidirectionalLM.forward_window``:
transformers' own decoder layers over a transformers ``Cache``), a tiny random Llama in SMDM's layout through the MDM
module (``MaskedModel``) and a tiny random Qwen2 in Dream's (shifted logits, [MASK] inside the vocabulary) through
``BidirectionalLM.denoiser``: windowed passes read the full pass where their keys are fresh (Dream's shift at the
window's left edge included), a refresh at every step decodes as no cache (semi_ar, threshold, eb; prefix and dual),
and a row decodes alike alone and inside a batch of 8 under the approximate cache."""

from __future__ import annotations

import pytest
import torch

from flowlm.backbones.llama import BidirectionalLM
from lightning_modules.mdm import MDMModule
from tests.backbones.test_block_cache import (
    L,
    V,
    assert_refresh_every_step_is_no_cache,
    assert_rows_decode_alike_alone,
    assert_windows_read_the_full_pass_where_keys_are_fresh,
    prompts,
)

TINY = {"hidden_size": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "intermediate_size": 64, "max_positions": 64}


def away_from_init(net: torch.nn.Module) -> None:
    """Every weight N(0, 0.3²): logits far from uniform, so stale keys visibly move them."""
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, 0.3)


def smdm_module(seed: int = 0) -> MDMModule:
    """The MDM module on a tiny Llama: [MASK] = the extra embedding row V, the head predicts the V data ids."""
    torch.manual_seed(seed)
    backbone = {"_target_": "flowlm.backbones.llama.BidirectionalLM", **TINY, "embed_rows": V + 1, "head_rows": V}
    module = MDMModule(data_vocab_size=V, seq_len=L, backbone={**backbone, "mask_id": V}, optim={})
    away_from_init(module)
    return module.eval()


def dream_net(seed: int = 0) -> BidirectionalLM:
    """A tiny Qwen2 with Dream's shifted logits and [MASK] = id V inside its V + 1 rows."""
    torch.manual_seed(seed)
    net = BidirectionalLM(arch="qwen2", embed_rows=V + 1, head_rows=V + 1, mask_id=V, shift_logits=True, **TINY)
    away_from_init(net)
    return net.eval()


FAMILIES = {
    "llama": (lambda seed=0: smdm_module(seed).net, lambda seed=0: smdm_module(seed).denoiser()),
    "qwen2_shifted": (dream_net, lambda seed=0: dream_net(seed).denoiser()),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_windowed_passes_read_the_full_pass_where_their_keys_are_fresh(family):
    net = FAMILIES[family][0]()
    assert_windows_read_the_full_pass_where_keys_are_fresh(net, torch.zeros(2), V)


def test_the_shifted_window_reads_the_output_left_of_its_edge():
    """Dream: the window's first position is predicted by the output at start − 1; the window's own first output
    (what an unshifted reading would give it) is another position's prediction."""
    net = dream_net()
    x = torch.randint(0, V, (2, L), generator=torch.Generator().manual_seed(3))
    cache = net.new_block_cache(L)
    with torch.no_grad():
        full = net(x)
        net.forward_window(x, None, cache, 0)
        got = net.forward_window(x[:, 8:16], None, cache, 8)
        raw = net.lm_head(net.model(input_ids=x).last_hidden_state)  # unshifted outputs
    torch.testing.assert_close(got, raw[:, 7:15], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, full[:, 8:16], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got[:, 0], raw[:, 8], atol=1e-3)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("decoder", ["semi_ar", "threshold", "eb"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_refresh_at_every_step_decodes_as_no_cache(family, decoder, cache):
    assert_refresh_every_step_is_no_cache(FAMILIES[family][1](), decoder, cache, *prompts())


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("decoder", ["semi_ar", "threshold"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_row_decodes_alike_alone_and_inside_a_batch_of_eight(family, decoder, cache):
    assert_rows_decode_alike_alone(FAMILIES[family][1](seed=2), decoder, cache)


def test_the_window_refusals_come_before_any_compute():
    net = dream_net()
    with pytest.raises(ValueError, match="max_positions"):
        net.new_block_cache(TINY["max_positions"] + 1)
    x = torch.randint(0, V, (1, L))
    with pytest.raises(ValueError, match="full pass"):  # a shifted window reads its edge's id from a filled cache
        net.forward_window(x[:, 4:8], None, net.new_block_cache(L), 4)
    read = net.denoiser().windowed(L)
    x[:, 0] = V
    with pytest.raises(ValueError, match="position 0"):
        read(x, torch.zeros(1), 0)
