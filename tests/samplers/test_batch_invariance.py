"""Batch invariance of every MDM sampler at temperature 1 with per-row generators (flowlm/ops/draws.py
``Generators``, issue 37): 8 prompts decoded alone (generator seeded s_i) and inside one batch of 8 (generators
[s_0, …, s_7]) give the same tokens and NFE, on a tiny DiT MDM and a tiny LLaMA-family MDM; tokens change with the
seeds (so the check is not vacuous); bad generators are refused before any network call; per-row draws read nothing
back from the device; the evaluation callback's ``row_generators`` seeds each row from its validation-set index."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torchmetrics import MeanMetric

from callbacks.sampling_eval import SamplingEvaluation
from flowlm.ops.draws import check_generators, draw_rows, draw_uniforms
from flowlm.samplers import (
    AncestralSampler,
    ConfidenceSampler,
    EBSampler,
    FlowMapSampler,
    SemiARConfidenceSampler,
    ThresholdSampler,
)
from tests.backbones.test_block_cache import L, V, random_mdm
from tests.backbones.test_block_cache_llama import smdm_module
from tests.conftest import validating_trainer
from tests.host_syncs import HostSyncs

SEEDS = [11 + 7 * i for i in range(8)]
MODELS = {"dit": lambda: random_mdm().denoiser(), "llama": lambda: smdm_module().denoiser()}
SAMPLERS = {  # name → (sampler at T = 1, NFE budget)
    "ancestral": (AncestralSampler(temperature=1.0), 8),  # time-agnostic models: the no-change cache is on
    "ancestral_no_cache": (AncestralSampler(temperature=1.0, cache=False), 8),
    "confidence_max_prob": (ConfidenceSampler(temperature=1.0), 8),
    "confidence_sampled": (ConfidenceSampler(temperature=1.0, score="sampled"), 8),
    "confidence_cfg": (ConfidenceSampler(temperature=1.0, cfg_scale=1.5), 12),
    "semi_ar_sampled": (SemiARConfidenceSampler(block_length=4, temperature=1.0), 8),
    "semi_ar_max_prob": (SemiARConfidenceSampler(block_length=4, temperature=1.0, score="max_prob"), 8),
    "semi_ar_dual_cache": (SemiARConfidenceSampler(block_length=4, cache="dual", refresh=2, temperature=1.0), 12),
    "threshold_max_prob": (ThresholdSampler(threshold=0.5, temperature=1.0), 10),
    "threshold_margin": (ThresholdSampler(threshold=0.5, score="margin", temperature=1.0), 10),
    "threshold_entropy": (ThresholdSampler(threshold=0.5, score="entropy", temperature=1.0), 10),
    "threshold_blocks_cache": (ThresholdSampler(threshold=0.5, block_length=4, cache="prefix", temperature=1.0), 12),
    "eb": (EBSampler(gamma=0.3, temperature=1.0), 10),
}


def ragged_prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """8 rows, row r a prompt prefix of 2 + r positions (22 − r to fill) and a given at position 20 − r."""
    tokens = torch.randint(0, V, (8, L), generator=torch.Generator().manual_seed(5))
    mask = torch.arange(L).expand(8, L) < torch.arange(2, 10)[:, None]
    mask[torch.arange(8), 20 - torch.arange(8)] = True
    return tokens, mask


def generators(seeds: list[int]) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


def each_alone(sampler, model, tokens: torch.Tensor, mask: torch.Tensor, nfe: int) -> list:
    """Row i decoded alone with the generator seeded ``SEEDS[i]``."""
    return [
        sampler(model, prompt=tokens[i : i + 1], prompt_mask=mask[i : i + 1], nfe=nfe, generator=generators([s]))
        for i, s in enumerate(SEEDS)
    ]


@pytest.mark.parametrize("name", SAMPLERS)
@pytest.mark.parametrize("family", MODELS)
def test_a_row_decodes_alike_alone_and_inside_a_batch_of_eight(family, name):
    sampler, nfe = SAMPLERS[name]
    model = MODELS[family]()
    tokens, mask = ragged_prompts()
    with torch.no_grad():
        batch = sampler(model, prompt=tokens, prompt_mask=mask, nfe=nfe, generator=generators(SEEDS))
        alone = each_alone(sampler, model, tokens, mask, nfe)
        reseeded = sampler(model, prompt=tokens, prompt_mask=mask, nfe=nfe, generator=generators(SEEDS[::-1]))
    for i, row in enumerate(alone):
        assert torch.equal(row.tokens[0], batch.tokens[i]), i
        torch.testing.assert_close(row.confidence[0], batch.confidence[i])
        if not name.startswith("confidence"):  # adaptive, semi-AR and ancestral samplers: each row's own calls
            assert int(row.row_nfe[0]) == int(batch.row_nfe[i]), i
    spent = [row.nfe for row in alone]
    if name == "ancestral":  # the no-change cache skips a call only when no row of the batch changed
        assert max(spent) <= batch.nfe <= nfe
    else:  # the batch runs until its most demanding row is done
        assert batch.nfe == max(spent), (batch.nfe, spent)
    assert torch.equal(batch.tokens[mask], tokens[mask]) and not (batch.tokens == model.mask_id).any()
    differs = (reseeded.tokens != batch.tokens).any(-1)
    assert int(differs.sum()) >= 4, differs  # other seeds, other tokens: the rows really sample


@pytest.mark.parametrize("name", ["ancestral_no_cache", "ancestral"])
def test_ancestral_rows_end_at_different_steps_alone(name):
    """The ancestral NFE checks above are not vacuous: alone, rows spend different NFE (a row whose positions all
    unmask before the last step stops early; with the no-change cache a step that changes nothing in the row spends
    nothing), ``row_nfe`` in the batch is each row's own, and the batch spends at least its most demanding row's
    (more with the cache, which skips a call only when no row of the batch changed)."""
    sampler, nfe = SAMPLERS[name]
    model = MODELS["dit"]()
    tokens, mask = ragged_prompts()
    mask[:, :18] = True  # few positions to fill: rows finish early at random
    mask[0] = True  # nothing to fill: its one call alone is not one it needs
    with torch.no_grad():
        alone = each_alone(sampler, model, tokens, mask, nfe)
        batch = sampler(model, prompt=tokens, prompt_mask=mask, nfe=nfe, generator=generators(SEEDS))
    spent = [row.nfe for row in alone]
    assert len(set(spent[1:])) > 1 and [int(row.row_nfe[0]) for row in alone] == [0, *spent[1:]], spent
    assert batch.row_nfe.tolist() == [0, *spent[1:]], (spent, batch.row_nfe)
    if name == "ancestral":
        assert batch.nfe > max(spent) and batch.mean_nfe() < batch.nfe, (batch.nfe, spent)
    else:
        assert batch.nfe == max(spent), (batch.nfe, spent)


class CountingRows:
    """A MaskedDenoiser whose ``fn`` and ``head_fn`` count the rows they compute."""

    def __init__(self, model, head: bool = True):
        self.model, self.rows = model, 0
        head_fn = model.head_fn if head else None  # without: the samplers read the network's logits
        self.view = dataclasses.replace(
            model, fn=self.counted(model.fn), head_fn=None if head_fn is None else self.counted(head_fn)
        )

    def counted(self, call):
        def counting(x, t):
            self.rows += x.shape[0]
            return call(x, t)

        return counting


@pytest.mark.parametrize("head", [True, False], ids=["head", "logits"])
@pytest.mark.parametrize("name", ["ancestral", "ancestral_no_cache", "threshold_max_prob", "eb"])
@pytest.mark.parametrize("family", MODELS)
def test_the_network_computes_only_the_rows_that_need_a_call(family, name, head):
    """Issue 50: a batch costs the calls its rows need. Rows that finish early (few positions to fill) or whose input
    did not change (the ancestral no-change cache) are not computed again: the rows the network computes sum to the
    rows' own NFE, fewer than the batch's calls × its rows, and each row decodes as alone."""
    sampler, nfe = SAMPLERS[name]
    counting = CountingRows(MODELS[family](), head)
    tokens, mask = ragged_prompts()
    mask[:, :16] = True  # 4 to 6 positions to fill: the rows finish at different calls
    with torch.no_grad():
        batch = sampler(counting.view, prompt=tokens, prompt_mask=mask, nfe=nfe, generator=generators(SEEDS))
        alone = each_alone(sampler, counting.model, tokens, mask, nfe)
    assert counting.rows == int(batch.row_nfe.sum()) < batch.nfe * len(SEEDS), (counting.rows, batch.row_nfe)
    assert all(torch.equal(row.tokens[0], batch.tokens[i]) for i, row in enumerate(alone))


def test_draw_uniforms_per_row_are_each_rows_own_stream():
    """Row b's block comes from generator b alone, in its own order; one generator keeps torch.rand's stream."""
    got = draw_uniforms(generators([3, 4]), (2, 5), torch.device("cpu"))
    want = [torch.rand(5, generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in (3, 4)]
    assert torch.equal(got, torch.stack(want))
    one = draw_uniforms(torch.Generator().manual_seed(3), (2, 5), torch.device("cpu"))
    assert torch.equal(one, torch.rand((2, 5), generator=torch.Generator().manual_seed(3), dtype=torch.float64))


def test_draw_rows_reads_the_given_uniform_of_each_drawn_row():
    """p = (0.2, 0.3, 0.5) in every row: u = 0.1 draws token 0, u = 0.6 token 2 (the first with CDF > u), read at
    ``rows``; per-row generators draw nothing inside draw_rows."""
    logits = torch.tensor([0.2, 0.3, 0.5]).log().expand(3, 3)
    u = torch.tensor([0.6, 0.1, 0.45], dtype=torch.float64)
    drawn, log_p = draw_rows(logits, 1.0, generators([1, 2, 3]), rows=torch.tensor([1, 0]), uniforms=u)
    assert drawn.tolist() == [0, 2]
    torch.testing.assert_close(log_p.exp(), torch.tensor([0.2, 0.5], dtype=torch.float64))
    assert draw_rows(logits, 1.0, None, uniforms=u)[0].tolist() == [2, 0, 1]
    with pytest.raises(TypeError, match="per-row generators draw through"):
        draw_rows(logits, 1.0, generators([1, 2, 3]))


class Refusing:
    """A MaskedDenoiser stand-in whose network must never be called."""

    mask_id = V
    time_conditioned = False
    windowed = None

    def fn(self, x, t):
        raise AssertionError("the network was called before the generators were checked")


@pytest.mark.parametrize("name", ["ancestral", "confidence_max_prob", "semi_ar_sampled", "eb"])
@pytest.mark.parametrize(
    ("gens", "error"),
    [
        (lambda: generators(SEEDS[:3]), "got 3 for a batch of 8 rows"),
        (lambda: [*generators(SEEDS[:7]), 5], "must be a torch.Generator"),
    ],
)
def test_bad_generators_are_refused_before_any_call(name, gens, error):
    sampler, nfe = SAMPLERS[name]
    tokens, mask = ragged_prompts()
    with pytest.raises((ValueError, TypeError), match=error):
        sampler(Refusing(), prompt=tokens, prompt_mask=mask, nfe=nfe, generator=gens())


def test_generators_on_another_device_are_refused():
    with pytest.raises(ValueError, match=r"generator on \['cpu'\] for tensors on cuda"):
        check_generators(generators([1, 2]), 2, torch.device("cuda"))
    check_generators(None, 2, torch.device("cpu"))  # one generator, torch's default, or one per row: accepted
    check_generators(torch.Generator(), 2, torch.device("cpu"))


@pytest.mark.parametrize("name", ["ancestral", "confidence_max_prob", "semi_ar_max_prob", "threshold_max_prob"])
def test_per_row_generators_read_nothing_more_from_the_device(name):
    """The per-row draws add no host read to the loops (tests/samplers/test_host_syncs.py counts the same)."""
    sampler, nfe = SAMPLERS[name]
    model = MODELS["dit"]()
    tokens, mask = ragged_prompts()
    counts = []
    with torch.no_grad():
        for gen in (torch.Generator().manual_seed(1), generators(SEEDS)):
            sampler(model, prompt=tokens, prompt_mask=mask, nfe=nfe, generator=gen)  # warms host-side grids
            with HostSyncs() as syncs:
                sampler(model, prompt=tokens, prompt_mask=mask, nfe=nfe, generator=gen)
            counts.append(syncs.count)
    assert counts[1] == counts[0], counts


def evaluation(**options) -> SamplingEvaluation:
    return SamplingEvaluation(
        samplers={"confidence": ConfidenceSampler(temperature=1.0)}, nfe=[4], metric=lambda **_: None, **options
    )


def test_row_generators_seed_each_row_from_its_validation_index():
    """Local row j of rank r (of 2) is validation row j·2 + r, seeded seed·2³² + index, however rows are batched."""
    tokens, trainer = torch.zeros(3, L, dtype=torch.long), SimpleNamespace(global_rank=1, world_size=2)
    one = evaluation(seed=5, row_generators=True).generators(tokens, 1, 3, trainer)  # rank 1's rows 3, 4, 5
    split = evaluation(seed=5, row_generators=True).generators(tokens[:1], 4, 5, trainer)  # its row 5, alone
    states = [torch.Generator().manual_seed(5 * 2**32 + index).get_state() for index in (7, 9, 11)]
    assert all(torch.equal(g.get_state(), state) for g, state in zip(one, states, strict=True))
    assert torch.equal(split[0].get_state(), one[2].get_state())
    batch = evaluation(seed=5).generators(tokens, 1, 3, trainer)  # off: one generator for the batch, as committed
    assert torch.equal(batch.get_state(), torch.Generator().manual_seed(5 * 1_000_003 + 1009 + 1).get_state())


def test_row_generators_refuse_a_sampler_with_one_generator_per_batch():
    with pytest.raises(ValueError, match="per-row generators are taken by the MDM samplers only"):
        SamplingEvaluation(samplers={"fm": FlowMapSampler()}, nfe=[4], metric=lambda **_: None, row_generators=True)
    assert evaluation(row_generators=True).row_generators


class Filled(MeanMetric):
    """The fraction of positions decoded to a data id, as ``filled``: a task metric for the callback."""

    def __init__(self, **_) -> None:
        super().__init__()

    def update(self, pred, target) -> None:  # noqa: D102
        super().update((pred < V).float().mean())

    def compute(self) -> dict:  # noqa: D102
        return {"filled": super().compute()}


def validation_samples(row_generators: bool, sizes: list[int]) -> torch.Tensor:
    """The callback's logged samples of one validation pass over the 8 ragged prompts, in batches of ``sizes``."""
    evaluation = evaluation_of(ConfidenceSampler(temperature=1.0), row_generators)
    trainer = validating_trainer()
    model = random_mdm()
    evaluation._datamodule = None
    evaluation.on_validation_epoch_start(trainer, model)
    tokens, mask = ragged_prompts()
    for i, rows in enumerate(torch.arange(8).split(sizes)):
        batch = {"tokens": tokens[rows], "prompt_mask": mask[rows]}
        evaluation.on_validation_batch_end(trainer, model, None, batch, i)
    return torch.stack(evaluation._states[("confidence", 4)]["samples"])


def evaluation_of(sampler, row_generators: bool) -> SamplingEvaluation:
    return SamplingEvaluation(
        samplers={"confidence": sampler}, nfe=[4], metric=Filled, row_generators=row_generators, num_logged_samples=8
    )


def test_the_callbacks_row_generators_make_samples_independent_of_the_batching():
    """Per-row generators: the validation rows sample alike in one batch of 8 and in batches of 3, 3, 2; with one
    generator per batch (the default) they do not."""
    assert torch.equal(validation_samples(True, [8]), validation_samples(True, [3, 3, 2]))
    assert not torch.equal(validation_samples(False, [8]), validation_samples(False, [3, 3, 2]))
