"""The lm-eval model's ELBO estimators (flowlm/metrics/likelihood.py, issue 48) against exact enumeration on a tiny
MDM trained for seconds (benchmarks/elbo_estimators.py builds it and prints the table in docs/evaluation.md):
``auto`` is count for a time-agnostic MDM, time for a time-conditioned one; ``mdm_elbo_estimate`` enumerates
whenever 2ⁿ − 1 ≤ S; count is unbiased with an sd far below time's; the floor bounds time's weights."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest
import torch

from flowlm.metrics.likelihood import check_estimator, elbo_draws, mdm_elbo_estimate, mdm_elbo_exact
from flowlm.samplers.base import MaskedDenoiser

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from elbo_estimators import estimates, item, trained_mdm  # noqa: E402


@pytest.fixture(scope="module")
def trained():
    return trained_mdm(steps=150)


def test_auto_is_count_for_a_time_agnostic_mdm_and_time_for_a_time_conditioned_one():
    agnostic = MaskedDenoiser(fn=lambda x, t: x, mask_id=0)
    conditioned = MaskedDenoiser(fn=lambda x, t: x, mask_id=0, time_conditioned=True)
    assert check_estimator("auto", agnostic) == "count" and check_estimator("auto", conditioned) == "time"
    with pytest.raises(ValueError, match="estimator must be one of"):
        check_estimator("exact", agnostic)


def test_short_continuations_are_enumerated_and_long_ones_estimated(trained):
    """n = 3 (7 rows) within S = 8: the exact ELBO, standard error 0; n = 4 (15 rows) is not: Monte Carlo."""
    model = trained.denoiser()
    rows = [item(trained, n, seed=5 + n) for n in (3, 4)]
    tokens, pinned, scored = (torch.cat(parts) for parts in zip(*rows, strict=True))
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    mean, stderr = mdm_elbo_estimate(model, tokens, pinned, scored, samples=8, generators=gens)
    exact = mdm_elbo_exact(model, tokens, pinned, scored)
    assert float(mean[0]) == pytest.approx(float(exact[0]), abs=1e-9) and float(stderr[0]) == 0.0
    assert float(stderr[1]) > 0 and float(mean[1]) != pytest.approx(float(exact[1]), abs=1e-9)
    _, everything = mdm_elbo_estimate(model, tokens, pinned, scored, samples=15, generators=gens)
    assert everything.tolist() == [0.0, 0.0]  # 2⁴ − 1 = 15 ≤ S: both exact


def test_count_is_unbiased_with_a_far_smaller_sd_than_time(trained):
    """n = 4 scored tokens, 20 seeds × 64 terms: count's estimates centre on the exact ELBO (within 4 standard errors
    of their mean) and their sd is below half the floorless time estimator's (0.09 vs 0.40 in the table)."""
    row = item(trained, 4)
    with torch.no_grad():
        exact = float(mdm_elbo_exact(trained.denoiser(), *row)[0])
        count = estimates(trained, row, "count", 0.0, 64, 20)
        time = estimates(trained, row, "time", 0.0, 64, 20)
    assert abs(statistics.mean(count) - exact) <= 4 * statistics.stdev(count) / 20**0.5 + 1e-9
    assert statistics.stdev(count) < 0.5 * statistics.stdev(time)


def test_the_time_floor_bounds_every_weight():
    """ε = 10⁻³ (the training's floor): every weight (1 − ε)/t ≤ 1/ε; without it the first stratum reaches 1/t ≫."""
    scored = torch.ones(4, dtype=torch.bool)
    _, _, floored = elbo_draws(scored, 4096, torch.Generator().manual_seed(0), "time")
    _, _, bare = elbo_draws(scored, 4096, torch.Generator().manual_seed(0), "time", eps=0.0)
    assert float(floored.max()) <= 1e3 and float(bare.max()) > 1e3


def test_auto_rows_are_the_item_for_the_llama_family_and_max_length_for_the_dit(trained):
    from flowlm.metrics.likelihood import row_layout
    from tests.backbones.test_block_cache_llama import smdm_module

    assert row_layout("auto", smdm_module().net) == "item" and row_layout("auto", trained.net) == "max_length"
    assert row_layout("max_length", smdm_module().net) == "max_length"
