"""A first CUDA run rehearsed on the meta device (tests/gpu_readiness/meta_cuda.py, docs/gpu.md): a training step of
every method family (MDM's and FMLM+'s also at OpenWebText's shape, FMLM+'s loss fused), every MDM sampler (block
cache included), PR and the lm-eval likelihood estimator run with their model, inputs and generators on "meta", each
against its budget: no op CUDA would refuse, the host syncs the docs state, and kernel launches per NFE (per step)
within a stated factor of one network forward at the same shape."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from flowlm.metrics.likelihood import mdm_elbo_estimate
from flowlm.ops.draws import draw_rows
from flowlm.ops.fused_ce import fused_capped_ce
from flowlm.ops.summary import (
    chunked_head_draw,
    chunked_head_keep,
    chunked_head_summary,
    chunked_summary,
    draw_kept,
    head_expectation,
)
from flowlm.samplers import (
    AncestralSampler,
    ConfidenceSampler,
    EBSampler,
    PosteriorRefinementSampler,
    SemiARConfidenceSampler,
    ThresholdSampler,
)
from lightning_modules.ar import ARModule
from lightning_modules.fmlm_plus import FMLMPlusModule
from lightning_modules.mdm import MDMModule
from tests.gpu_readiness.meta_cuda import META, HostReads, MetaCuda, generator, meta_generator, on_meta, rehearse
from tests.lightning_modules.test_mlfm import adapted, perturb_adapter

TWIN = {"size": "tiny", "n_layers": 2, "d_model": 32, "n_heads": 2, "cond_dim": 16}  # the CPU twin: cheap
SMALL = {"size": "small"}  # the meta run: DiT `small` (12 blocks, d 768), what a GPU runs; free on meta
V, L = 6, 12


def _random(module: torch.nn.Module) -> torch.nn.Module:
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return module


def _module(family: str, vocab: int, length: int, backbone: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    kw = {"data_vocab_size": vocab, "seq_len": length, "backbone": backbone, "optim": {}}
    if family == "mdm":
        return _random(MDMModule(**kw))
    if family == "flow":
        return _random(FMLMPlusModule(**kw))
    raise ValueError(family)


# ---------------------------------------------------------------------------------------------- training steps
def _training_module(method: str) -> torch.nn.Module:
    torch.manual_seed(0)
    kw = {"data_vocab_size": V, "seq_len": L, "backbone": TWIN, "optim": {}}
    if method == "mdm":
        return _random(MDMModule(**kw))
    if method == "fmlm":
        return FMLMPlusModule(**kw, context=False)
    if method == "fmlm_plus":
        return FMLMPlusModule(**kw)
    if method == "fmlm_plus_distill":
        module = FMLMPlusModule(**kw, teacher="mdm.ckpt", shares={"distill": 0.25})
        teacher = _random(MDMModule(**kw)).eval()
        module.add_module("_teacher_for_the_test", teacher)  # moved with the module, as on_fit_start loads it
        object.__setattr__(module, "_teacher", teacher)
        return module
    if method == "mlfm":
        module = adapted(_random(MDMModule(**kw)))
        perturb_adapter(module)
        return module
    if method == "ar":
        return ARModule(**kw)
    raise ValueError(method)


@pytest.mark.parametrize("method", ["mdm", "fmlm", "fmlm_plus", "fmlm_plus_distill", "mlfm", "ar"])
def test_a_training_step_runs_on_the_device_without_reading_it(method):
    """Draw, loss under bf16 autocast, backward and AdamW on "meta": no device error, no host sync (the step's one
    read, the finite-loss guard's, is the callback's: tests/samplers/test_host_syncs.py)."""
    module = _training_module(method).train()

    def step(device: torch.device) -> None:
        # built per device: moving a module to "meta" replaces its Parameter objects
        opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-3)
        tokens = torch.randint(0, V, (8, L), generator=torch.Generator().manual_seed(0)).to(device)
        batch = {"tokens": tokens, "prompt_mask": (torch.arange(L) < 3).expand(8, L).to(device)}
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = module.loss(batch, module.draw(batch, 0, stage="train")).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

    run = rehearse(step, module)
    assert run.errors == [], run.errors
    assert run.sync_count == 0, run.sync_where
    assert run.launch_count > 100 and run.launches["addcdiv_"] > 0  # the step and AdamW ran on the device


# Kernel launches of one training step at OpenWebText's paper shape (DiT `small`, micro batch 16 × 1 024,
# |V| = 50 258) over one MDM forward's at that shape (558): the step after a first one (AdamW's state made), AdamW
# with ``foreach`` as torch picks it on CUDA (on meta it would fall back to its per-tensor loop). FMLM+'s student
# loss runs fused (flowlm/ops/fused_ce.py), its blocks of rows sized per device (``vocab_sizes``). Measured
# 2026-12-06: MDM 2.44; FMLM+ 5.84 (a student forward, two teacher forwards on the 8 jump rows, the backward, the
# fused loss in 14 blocks), 10.46 with the CPU's 32 MiB blocks on the device (100 blocks). docs/gpu.md states them.
TEXT_STEP = (16, 1024, 50258)  # (micro batch, length, |V|)
TRAIN_LAUNCH_FACTOR = {"mdm": 3.0, "fmlm_plus": 7.0}
CE_LAUNCHES = 600  # the fused loss alone at TEXT_STEP, a quarter of its rows soft: 433 (2 969 with the CPU's blocks)


def _text_step(method: str) -> MetaCuda:
    """The meta run of ``method``'s second training step at ``TEXT_STEP`` (draw, bf16 loss, backward, AdamW)."""
    batch, length, vocab = TEXT_STEP
    torch.manual_seed(0)
    kw = {"data_vocab_size": vocab, "seq_len": length, "backbone": SMALL, "optim": {}}
    with torch.device(META):
        module = (MDMModule if method == "mdm" else FMLMPlusModule)(**kw).train()
    assert method == "mdm" or module.fused_head() is not None  # fused_loss=auto fuses FMLM+'s loss at |V| > d
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-3, foreach=True)
    data = {
        "tokens": torch.zeros(batch, length, dtype=torch.long, device=META),
        "prompt_mask": torch.zeros(batch, length, dtype=torch.bool, device=META),
    }
    for _ in range(2):  # the second step is counted: the first also makes AdamW's state
        with MetaCuda() as run:
            with torch.autocast(META.type, dtype=torch.bfloat16):
                loss = module.loss(data, module.draw(data, 0, stage="train")).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
    return run


@pytest.mark.parametrize("method", sorted(TRAIN_LAUNCH_FACTOR))
def test_a_training_step_at_a_text_vocabulary(method):
    """MDM's and FMLM+'s training step at ``TEXT_STEP`` on "meta": no device error, no host sync, launches ≤
    ``TRAIN_LAUNCH_FACTOR`` forwards — FMLM+'s fused loss in a handful of memory-bounded blocks, not in the CPU's
    cache-sized ones."""
    run = _text_step(method)
    assert run.errors == [] and run.sync_count == 0, (run.errors, run.sync_where)
    per_forward = run.launch_count / _forward_launches(*TEXT_STEP)
    assert per_forward <= TRAIN_LAUNCH_FACTOR[method], (per_forward, run.launches.most_common(10))


def test_the_fused_loss_on_the_device_is_a_handful_of_blocks():
    """FMLM+'s fused cross-entropy alone at ``TEXT_STEP`` (d 768; 4 of the 16 rows soft, as distill or teacher
    targets), forward with its gradient and backward under bf16 autocast: ≤ ``CE_LAUNCHES`` kernels, 14 blocks of
    1 335 rows at most (some 30 launches each) where the CPU's 32 MiB blocks of 166 rows launched 2 969."""
    batch, length, vocab = TEXT_STEP
    with torch.device(META):
        features = torch.empty(batch, length, 768, requires_grad=True)
        weight, bias = torch.empty(vocab, 768, requires_grad=True), torch.empty(vocab, requires_grad=True)
        tokens, weights = torch.zeros(batch, length, dtype=torch.long), torch.empty(batch, length)
        soft = (torch.arange(4), torch.empty(4, length, vocab))
    with MetaCuda() as run:
        with torch.autocast(META.type, dtype=torch.bfloat16):
            loss, _ = fused_capped_ce(features, weight, bias, tokens, weights, soft, cap=30.0)
        loss.backward()
    assert run.errors == [] and run.sync_count == 0, (run.errors, run.sync_where)
    assert run.launches["mm"] == 2 * 14  # ∂features and ∂W, one block at a time
    assert 0 < run.launch_count <= CE_LAUNCHES, (run.launch_count, run.launches.most_common(5))


# ---------------------------------------------------------------------------------------------- samplers
# (sampler, family, host syncs per call as a function of the NFE budget n): docs/gpu.md states each.
SAMPLERS = {
    "ancestral": (lambda b: AncestralSampler(), "mdm", lambda n: 1 + n),  # and one per step (n steps): how many unmask
    "ancestral_t0": (lambda b: AncestralSampler(temperature=0.0), "mdm", lambda n: 1 + n),
    "confidence": (lambda b: ConfidenceSampler(), "mdm", lambda n: 1),  # the loop length
    "confidence_t1": (lambda b: ConfidenceSampler(temperature=1.0, score="sampled"), "mdm", lambda n: 1),
    "confidence_t07": (lambda b: ConfidenceSampler(temperature=0.7), "mdm", lambda n: 1),  # the draw from kept masses
    "threshold": (lambda b: ThresholdSampler(), "mdm", lambda n: n),  # per call: which positions are eligible
    "eb": (lambda b: EBSampler(), "mdm", lambda n: n),
    "eb_t1": (lambda b: EBSampler(temperature=1.0), "mdm", lambda n: 2 * n),  # and per call: which positions commit
    "semi_ar": (lambda b: SemiARConfidenceSampler(block_length=b), "mdm", lambda n: 2),  # the plan: unique, tolist
    "semi_ar_prefix": (lambda b: SemiARConfidenceSampler(block_length=b, cache="prefix"), "mdm", lambda n: 2 + n),
    "semi_ar_dual": (lambda b: SemiARConfidenceSampler(block_length=b, cache="dual"), "mdm", lambda n: 2 + n),
    "threshold_dual": (lambda b: ThresholdSampler(block_length=b, cache="dual"), "mdm", lambda n: 2 * n),
    "eb_prefix": (lambda b: EBSampler(block_length=b, cache="prefix"), "mdm", lambda n: 2 * n),
    "pr": (lambda b: PosteriorRefinementSampler(), "flow", lambda n: 1),  # the most uncommitted positions of a row
    "pr_t1": (lambda b: PosteriorRefinementSampler(temperature=1.0), "flow", lambda n: 0),
}
# Launches per NFE over one DiT forward's at the same shape: the budget (docs/gpu.md). At a text vocabulary the
# passes over the logits are chunked; on the device the chunks are bounded by memory, not by a CPU cache
# (flowlm/ops/summary.py ``vocab_sizes``), so a pass is a handful of chunks at any batch. Measured 2026-12-06
# (NFE 4, no prompt): 1.09–1.21 at 1 × 256 and 1.14–1.39 at 8 × 1 024, PR the highest (its flow head's mean δ·E);
# with the CPU's cache-sized chunks on the device 1.2–2.8 and 3.5–46.
LAUNCH_FACTOR = 1.75
TEXT_LAUNCH_FACTOR = 2.0
TEXT_SHAPES = [(1, 256), (8, 1024)]  # (batch, length) at |V| = 50 258
PASS_LAUNCHES = 400  # one vocabulary pass at 8 192 rows on the device (a DiT `small` forward: ≈ 560)


@functools.cache
def _forward_launches(batch: int, length: int, vocab: int) -> int:
    """Kernel launches of one DiT `small` MDM forward on ids (B, L) at data vocabulary ``vocab``."""
    with torch.device(META):
        model = MDMModule(data_vocab_size=vocab, seq_len=length, backbone=SMALL, optim={}).eval()
    x = torch.zeros(batch, length, dtype=torch.long, device=META)
    with torch.no_grad(), MetaCuda() as run:
        model.denoiser().fn(x, torch.ones(batch, device=META))
    assert run.errors == []
    return run.launch_count


def _sample(name: str, *, batch: int, length: int, vocab: int, nfe: int, prompt: int) -> tuple[MetaCuda, int]:
    """The sampler's call on a CPU twin (tiny DiT, |V| = 6: its host reads recorded), then on a `small` DiT on meta
    at the same (B, L) and ``vocab``; the meta run and the NFE spent."""
    make, family, _ = SAMPLERS[name]
    sampler = make(length // 4)  # semi-AR blocks: a quarter of the sequence
    twin = _module(family, V, length, TWIN).eval()
    with torch.device(META):
        model = _module(family, vocab, length, SMALL).eval()

    def call(module: torch.nn.Module, device: torch.device):
        ids = torch.randint(0, V, (batch, length), generator=torch.Generator().manual_seed(0)).to(device)
        mask = (torch.arange(length) < prompt).expand(batch, length).to(device)
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
            return sampler(module.denoiser(), prompt=ids, prompt_mask=mask, nfe=nfe, generator=generator(device, 1))

    with HostReads() as reads:
        spent = call(twin, torch.device("cpu")).nfe
    with MetaCuda(replay=reads) as run:
        call(on_meta(model), META)
    return run, spent


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_a_sampler_call_on_the_device(name):
    """Every MDM sampler and PR at a Sudoku-sized batch (3 × 12, a 3-token prompt, NFE 8): no device error, the
    documented host syncs, launches per NFE ≤ ``LAUNCH_FACTOR`` forwards."""
    run, spent = _sample(name, batch=3, length=L, vocab=V, nfe=8, prompt=3)
    assert run.errors == [], run.errors
    assert run.sync_count <= SAMPLERS[name][2](8), run.sync_where
    per_nfe = run.launch_count / spent / _forward_launches(3, L, V)
    assert per_nfe <= LAUNCH_FACTOR, (per_nfe, run.launches.most_common(10))


@pytest.mark.parametrize("shape", TEXT_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize(
    "name", ["ancestral", "confidence", "confidence_t07", "threshold", "eb", "eb_t1", "semi_ar", "pr"]
)
def test_a_sampler_call_at_a_text_vocabulary(name, shape):
    """The same at |V| = 50 258 (1 × 256 and 8 × 1 024, no prompt, NFE 4), where passes over the vocabulary are
    chunked: launches per NFE ≤ ``TEXT_LAUNCH_FACTOR`` forwards for every sampler, at either batch (the chunks sized
    for the device, not for a CPU cache, so that more rows do not mean more chunks)."""
    batch, length = shape
    run, spent = _sample(name, batch=batch, length=length, vocab=50258, nfe=4, prompt=0)
    assert run.errors == [], run.errors
    assert run.sync_count <= SAMPLERS[name][2](4), run.sync_where
    per_nfe = run.launch_count / spent / _forward_launches(batch, length, 50258)
    assert per_nfe <= TEXT_LAUNCH_FACTOR, (per_nfe, run.launches.most_common(10))


@pytest.mark.parametrize(
    "op", ["summary", "summary_rows", "head_summary", "head_draw", "head_keep", "draw_rows", "expectation"]
)
def test_a_vocabulary_pass_on_the_device_is_a_handful_of_chunks(op):
    """Each chunked pass over a text vocabulary (|V| = 50 258) at 8 × 1 024 rows launches ≤ ``PASS_LAUNCHES``
    kernels on the device: its chunks and tiles bounded by memory (a few hundred MiB), the rows in one block — with
    the CPU's cache-sized chunks 3 500 to 72 000 (measured). The LLaMA family and the block cache's windows read
    ``chunked_summary`` / ``draw_rows`` on logits; the DiT's head the others; PR ``head_expectation``."""
    n, vocab, d = 8192, 50258, 768
    with torch.device(META):
        logits = torch.empty(n, vocab, dtype=torch.bfloat16)
        features, weight, table = torch.empty(n, d), torch.empty(vocab, d), torch.empty(vocab, d)
        bias, rows = torch.empty(vocab), torch.arange(n)
    calls = {
        "summary": lambda: chunked_summary(logits, margin=True, entropy=True),
        "summary_rows": lambda: chunked_summary(logits, rows=rows),
        "head_summary": lambda: chunked_head_summary(features, weight, bias, margin=True, entropy=True),
        "head_draw": lambda: chunked_head_draw(features, weight, bias, 0.7, meta_generator(0), entropy=True),
        "head_keep": lambda: draw_kept(  # the fold keeping its group masses, then a draw at a quarter of its rows
            chunked_head_keep(features, weight, bias, 0.7, entropy=True)[1], rows[::4], meta_generator(0)
        ),
        "draw_rows": lambda: draw_rows(logits, 0.7, meta_generator(0)),
        "expectation": lambda: head_expectation(features, weight, bias, cap=30.0, table=table),
    }
    with MetaCuda() as run:
        calls[op]()
    assert run.errors == [] and run.sync_count == 0, (run.errors, run.sync_where)
    assert 0 < run.launch_count <= PASS_LAUNCHES, (run.launch_count, run.launches.most_common(5))


# ---------------------------------------------------------------------------------------------- likelihood
@pytest.mark.parametrize("estimator", ["count", "time"])
def test_the_lm_eval_likelihood_estimator_on_the_device(estimator):
    """``mdm_elbo_estimate`` (lm-eval's loglikelihood) with per-request generators on the device: no device error;
    one host sync per call (the scored counts, read to choose exact enumeration or draws per row) and one per row
    (an enumerated row's scored positions; under the count estimator a drawn row's n), not one per enumerated subset;
    launches within ``LAUNCH_FACTOR`` of the network rows."""
    batch, samples = 3, 4
    twin = _module("mdm", V, L, TWIN).eval()
    with torch.device(META):
        model = _module("mdm", V, L, SMALL).eval()
    rows = {}

    def call(module: torch.nn.Module, device: torch.device) -> None:
        tokens = torch.randint(0, V, (batch, L), generator=torch.Generator().manual_seed(0)).to(device)
        pinned = (torch.arange(L) < 4).expand(batch, L).to(device)
        scored = ((torch.arange(L) >= 4) & (torch.arange(L) < 4 + torch.tensor([[2], [5], [8]]))).to(device)
        denoiser = module.denoiser()

        def counting(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:  # the network rows each device runs
            rows[device.type] = rows.get(device.type, 0) + x.shape[0]
            return denoiser.fn(x, t)

        gens = [generator(device, 10 + b) for b in range(batch)]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            mdm_elbo_estimate(
                dataclasses.replace(denoiser, fn=counting),
                tokens,
                pinned,
                scored,
                samples=samples,
                generators=gens,
                estimator=estimator,
            )

    with HostReads() as reads:
        call(twin, torch.device("cpu"))
    with MetaCuda(replay=reads) as run:
        call(on_meta(model), META)
    assert run.errors == [], run.errors
    assert run.sync_count <= 1 + batch, run.sync_where  # the counts, then one per row (see the docstring)
    forwards = rows["meta"] / batch  # network rows in units of one forward over the batch
    assert run.launch_count / max(forwards, 1) / _forward_launches(batch, L, V) <= LAUNCH_FACTOR
