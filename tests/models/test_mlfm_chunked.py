"""MLFM sampling from the head's vocabulary chunks (``MLFMModule.posterior``, ``MLFMSampler`` with ``posterior_fn``):
the adapter's head read in parts computes its logits (LoRA on the head included); the posterior's mode, max and
x̂₁ = p·E equal the dense softmax's; every sampler setting gives the same tokens, NFE and confidences both ways
(CCFG, OTP in the trajectory and by rounds, both final decodes, the smallest budgets that fall back to the guided
decode), under bf16 autocast at |V| = 3 000 too; a greedy call makes no (B, L, |V|) tensor, the dense path does."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import flowlm.ops.summary as summary_module
from flowlm.samplers import MLFMSampler
from lightning_modules.mlfm import MLFMModule
from tests.models.oracles import dense_view
from tests.models.test_greedy_summary import LargestTensor

BACKBONE = {"size": "tiny", "n_layers": 2, "d_model": 16, "n_heads": 2, "cond_dim": 16}


def mlfm_module(vocab: int, *, lora_head: bool = True) -> MLFMModule:
    """An MLFM whose every weight (LoRA B and the zero-initialised modulations too) is random: a LoRA on the head
    that changes the logits, a confident head."""
    module = MLFMModule(
        data_vocab_size=vocab,
        seq_len=10,
        backbone=BACKBONE,
        optim={},
        init_from="unused.ckpt",
        adapter={"lora_rank": 4, "lora_head": lora_head},
    )
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.normal_(0, 0.5 if "final.linear" in name else 0.1)
    return module.eval()


@pytest.mark.parametrize("lora_head", [True, False])
def test_head_parts_compute_the_logits(lora_head):
    """features·Wᵀ + b + u·Bᵀ is the adapter's forward, bit for bit up to float rounding; train mode refuses."""
    module = mlfm_module(40, lora_head=lora_head)
    gen = torch.Generator().manual_seed(1)
    z, t = torch.randn(3, 10, 16, generator=gen), torch.rand(3, generator=gen)
    time, base_time = module.process.condition(t), torch.zeros_like(t)
    with torch.no_grad():
        want = module.net(z, time, base_time)
        features, weight, bias, low_rank = module.net.head_parts(z, time, base_time)
        got = F.linear(features, weight, bias)
        assert (low_rank is not None) == lora_head
        if low_rank is not None:
            assert F.linear(*low_rank).abs().max() > 0.05  # the LoRA term is not negligible here
            got = got + F.linear(*low_rank)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    module.train()
    with pytest.raises(RuntimeError, match="evaluation"):
        module.net.head_parts(z, time, base_time)


def test_posterior_is_the_softmax_read_off():
    """(log max p, argmax, p·E) over the data vocabulary ([MASK] dropped) from the chunks = the dense softmax's."""
    module = mlfm_module(40)
    gen = torch.Generator().manual_seed(2)
    z, t = torch.randn(3, 10, 16, generator=gen), torch.rand(3, generator=gen)
    view = module.denoiser()
    assert view.posterior_fn is not None and module.train().denoiser().posterior_fn is None  # training: logits only
    module.eval()
    with torch.no_grad():
        p = F.softmax(view.fn(z, t).float(), -1)
        log_max, mode, mean = view.posterior_fn(z, t)
        assert view.posterior_fn(z, t, mean=False)[2] is None
    assert torch.equal(mode, p.argmax(-1))
    assert torch.allclose(log_max, p.amax(-1).log(), atol=2e-5, rtol=1e-5)
    assert torch.allclose(mean, p @ view.embeddings.float(), atol=1e-5, rtol=1e-4)


def recorded(view, seen: list):
    """``view`` whose network calls (``fn``, ``posterior_fn``) record their input state z."""

    def wrap(fn):
        def call(z, *args, **kwargs):
            seen.append(z.clone())
            return fn(z, *args, **kwargs)

        return call

    return dataclasses.replace(
        view, fn=wrap(view.fn), posterior_fn=None if view.posterior_fn is None else wrap(view.posterior_fn)
    )


SETTINGS = [
    ("plain", {}, 4),
    ("ccfg", {"guidance": 1.5}, 5),
    ("ccfg_smallest", {"guidance": 1.5}, 2),  # one step, no room for the final call: the guided decode
    ("ccfg_otp", {"guidance": 1.5, "otp_eps": 0.4}, 5),
    ("ccfg_context", {"guidance": 1.0, "guidance_scope": "context", "otp_eps": 0.4}, 7),
    ("rounds", {"otp_eps": 0.3, "otp_mode": "rounds", "rounds": 2}, 6),
    ("density_grid", {"grid": "density"}, 3),
]
GREEDY = {"plain", "ccfg", "ccfg_otp", "ccfg_context", "rounds", "density_grid"}


@pytest.mark.parametrize("wide", [False, True], ids=["V40", "V3000_bf16"])
@pytest.mark.parametrize(("name", "options", "nfe"), SETTINGS, ids=[s[0] for s in SETTINGS])
def test_mlfm_sampler_same_both_ways(name, options, nfe, wide, monkeypatch):
    """Chunked and dense: the network sees the same states (to float rounding), the same tokens and NFE,
    confidences to float rounding; no (B, L, |V|) tensor on the chunked path of a greedy call (chunks of 512
    columns), one on the dense path."""
    vocab = 3000 if wide else 40
    module = mlfm_module(vocab)
    b, length = 3, 10
    prompt = torch.randint(0, vocab, (b, length), generator=torch.Generator().manual_seed(4))
    prompt_mask = torch.zeros(b, length, dtype=torch.bool)
    prompt_mask[:2, :3] = True  # two conditional rows, one unconditional
    monkeypatch.setattr(summary_module, "CHUNK_BYTES", 4 * b * length * 512)
    sampler = MLFMSampler(**options)
    outs, largest, states = [], [], []
    for summary in ("chunked", "dense"):
        watch, seen = LargestTensor(), []
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=wide), watch:
            gen = torch.Generator().manual_seed(5)
            view = recorded(module.denoiser() if summary == "chunked" else dense_view(module.denoiser()), seen)
            outs.append(sampler(view, prompt=prompt, prompt_mask=prompt_mask, nfe=nfe, generator=gen))
        largest.append(watch.most)
        states.append(seen)
    assert len(states[0]) == len(states[1]) == outs[0].nfe
    # bf16: the dense path's q·E runs under autocast (bf16 rounding, ≈ 4e-3 relative), the chunks' p·E in float32;
    # that rounding may flip a near-tie between two tokens of a row (measured: row 0 of "rounds" at its 4th call),
    # after which that row legitimately differs. In float32 every row agrees; in bf16 at most one of the three rows
    # may flip, and every row that ends with the same tokens had the same states at every call.
    tol = {"atol": 3e-3, "rtol": 1e-2} if wide else {"atol": 1e-5, "rtol": 1e-4}
    same = (outs[0].tokens == outs[1].tokens).all(-1)
    assert bool(same.all()) if not wide else int(same.sum()) >= b - 1, same
    for got, want in zip(*states, strict=True):
        assert torch.allclose(got[same], want[same], **tol), (got - want)[same].abs().max()
    assert outs[0].nfe == outs[1].nfe
    # bf16: the states' rounding difference moves the final posteriors by a few per cent
    assert torch.allclose(outs[0].confidence[same], outs[1].confidence[same], **({"rtol": 0.1} if wide else tol))
    assert largest[1] >= b * length * vocab  # the dense path reads whole posteriors
    if name in GREEDY and wide:
        assert largest[0] < b * length * vocab, largest


def test_a_draw_reads_the_whole_posterior():
    """At temperature > 0 the sampler takes the dense path (it draws from the posterior): the same tokens with or
    without ``posterior_fn``."""
    module = mlfm_module(40)
    prompt = torch.randint(0, 40, (3, 10), generator=torch.Generator().manual_seed(6))
    prompt_mask = torch.zeros(3, 10, dtype=torch.bool)
    sampler = MLFMSampler(temperature=1.0, guidance=1.0)
    outs = []
    for summary in ("chunked", "dense"):
        with torch.no_grad():
            view = module.denoiser() if summary == "chunked" else dense_view(module.denoiser())
            outs.append(sampler(view, prompt=prompt, prompt_mask=prompt_mask, nfe=4, generator=torch.manual_seed(7)))
    assert torch.equal(outs[0].tokens, outs[1].tokens) and torch.equal(outs[0].confidence, outs[1].confidence)


LLAMA_LAYOUTS = {
    "smdm": {"arch": "llama", "embed_rows": 9, "head_rows": 8, "mask_id": 8},  # [MASK] the extra embedding row
    "dream": {"arch": "qwen2", "embed_rows": 8, "head_rows": 8, "mask_id": 5, "shift_logits": True},  # inside
}


def llama_mlfm(layout: dict) -> MLFMModule:
    """An MLFM on a tiny random LLaMA-family MDM (LoRA on every projection and the head), every weight random."""
    from tests.pretrained.test_llama_modules import tiny_llama

    torch.manual_seed(0)
    module = MLFMModule(
        data_vocab_size=8, seq_len=10, backbone=tiny_llama(**layout), optim={}, init_from="(not read here)"
    )
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.normal_(0, 0.5 if "lm_head" in name else 0.1)
    return module.eval()


@pytest.mark.parametrize("layout", LLAMA_LAYOUTS, ids=list(LLAMA_LAYOUTS))
def test_llama_family_mlfm_same_both_ways(layout):
    """On the LLaMA family (SMDM's [MASK] as the extra embedding row; Dream's inside the vocabulary, shifted
    logits): the head read in parts computes the adapter's logits, the posterior never puts mass on [MASK], and
    the sampler sees the same states and gives the same tokens both ways, with and without CCFG + OTP."""
    module = llama_mlfm(LLAMA_LAYOUTS[layout])
    gen = torch.Generator().manual_seed(1)
    z, t = torch.randn(3, 10, 32, generator=gen) * 0.1, torch.rand(3, generator=gen)
    time = module.process.condition(t)
    with torch.no_grad():
        features, weight, bias, low_rank = module.net.head_parts(z, time)
        got = F.linear(features, weight, bias) + F.linear(*low_rank)
        assert torch.allclose(got, module.net(z, time), atol=1e-5, rtol=1e-5)
        view = module.denoiser()
        p = F.softmax(view.fn(z, t).float(), -1)
        log_max, mode, mean = view.posterior_fn(z, t)
    assert torch.equal(mode, p.argmax(-1)) and torch.allclose(log_max, p.amax(-1).log(), atol=2e-5, rtol=1e-5)
    assert torch.allclose(mean, p @ view.embeddings.float(), atol=1e-5, rtol=1e-4)
    data_ids = torch.tensor([i for i in range(8) if i != module.mask_id])
    prompt = data_ids[torch.randint(0, len(data_ids), (3, 10), generator=gen)]
    prompt_mask = torch.zeros(3, 10, dtype=torch.bool)
    prompt_mask[:2, :3] = True
    for options, nfe in (({}, 4), ({"guidance": 1.5, "otp_eps": 0.4}, 5)):
        outs, states = [], []
        for summary in ("chunked", "dense"):
            seen = []
            with torch.no_grad():
                view = recorded(module.denoiser() if summary == "chunked" else dense_view(module.denoiser()), seen)
                sampler = MLFMSampler(**options)
                outs.append(
                    sampler(view, prompt=prompt, prompt_mask=prompt_mask, nfe=nfe, generator=torch.manual_seed(2))
                )
            states.append(seen)
        for got_z, want_z in zip(*states, strict=True):
            assert torch.allclose(got_z, want_z, atol=1e-5, rtol=1e-4)
        assert torch.equal(outs[0].tokens, outs[1].tokens) and outs[0].nfe == outs[1].nfe
        assert not (outs[0].tokens[~prompt_mask] == module.mask_id).any()
        assert torch.allclose(outs[0].confidence, outs[1].confidence, atol=1e-5, rtol=1e-4)
