"""The evaluation's samplers in micro batches (``callbacks.sampling_eval.sample_rows``): with per-row generators a
validation batch sampled in chunks of ``micro_batch_size`` rows gives the samples, costs and metric of one call, no
forward taking more rows; with one generator per batch the batch runs whole (chunks would change its samples)."""

from __future__ import annotations

import pytest
import torch

from callbacks.sampling_eval import joined
from flowlm.backbones.dit import DiTBlock
from flowlm.samplers import AncestralSampler, ConfidenceSampler, ThresholdSampler
from flowlm.samplers.base import SampleOutput
from tests.backbones.test_block_cache import random_mdm
from tests.conftest import validating_trainer
from tests.samplers.test_batch_invariance import Filled, ragged_prompts

SAMPLERS = {
    "confidence": (ConfidenceSampler(temperature=1.0), 4),
    "ancestral": (AncestralSampler(temperature=1.0), 8),
    "threshold": (ThresholdSampler(temperature=1.0), 8),  # adaptive: its rows' NFE differ
}


def validate_once(name: str, row_generators: bool, micro: int | None) -> tuple[dict, list[int]]:
    """One validation batch of the 8 ragged prompts through the callback: its state and the rows of every forward."""
    from callbacks.sampling_eval import SamplingEvaluation

    sampler, budget = SAMPLERS[name]
    evaluation = SamplingEvaluation(
        samplers={name: sampler}, nfe=[budget], metric=Filled, row_generators=row_generators, num_logged_samples=8
    )
    trainer, model = validating_trainer(), random_mdm()
    model.run_config = {"micro_batch_size": micro}
    seen: list[int] = []
    for block in model.modules():
        if isinstance(block, DiTBlock):
            block.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[0]))
    evaluation._datamodule = None
    evaluation.on_validation_epoch_start(trainer, model)
    tokens, mask = ragged_prompts()
    evaluation.on_validation_batch_end(trainer, model, None, {"tokens": tokens, "prompt_mask": mask}, 0)
    return evaluation._states[(name, budget)], seen


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_per_row_generators_sample_alike_in_micro_batches(name):
    whole, whole_rows = validate_once(name, row_generators=True, micro=None)
    chunked, chunked_rows = validate_once(name, row_generators=True, micro=3)
    # whole: at most the batch's 8 rows a forward (the adaptive and ancestral samplers' calls take the rows that
    # need them, samplers/common.py call_rows), the first with all 8
    assert whole_rows[0] == 8 and max(whole_rows) == 8 and chunked_rows and max(chunked_rows) <= 3, chunked_rows
    assert torch.equal(torch.stack(whole["samples"]), torch.stack(chunked["samples"]))
    assert torch.equal(whole["row_nfe"].compute(), chunked["row_nfe"].compute())
    for key in ("metric", "nfe", "tpf"):
        torch.testing.assert_close(chunked[key].compute(), whole[key].compute())


def test_one_generator_per_batch_runs_the_batch_whole():
    whole, _ = validate_once("confidence", row_generators=False, micro=None)
    same, rows = validate_once("confidence", row_generators=False, micro=3)
    assert set(rows) == {8}
    assert torch.equal(torch.stack(whole["samples"]), torch.stack(same["samples"]))


def test_joined_gives_each_row_its_chunks_nfe():
    """Chunks of a fixed-step sampler that spent different NFE: each row reports its chunk's; the same NFE: none."""
    a = SampleOutput(tokens=torch.zeros(2, 3, dtype=torch.long), confidence=torch.ones(2, 3), nfe=4)
    b = SampleOutput(tokens=torch.ones(1, 3, dtype=torch.long), confidence=torch.ones(1, 3), nfe=2)
    out = joined([a, b])
    assert out.tokens.tolist() == [[0, 0, 0], [0, 0, 0], [1, 1, 1]] and out.nfe == 4
    assert out.row_nfe.tolist() == [4, 4, 2] and out.mean_nfe() == pytest.approx(10 / 3)
    assert joined([a, a]).row_nfe is None and joined([a, a]).mean_nfe() == 4
