"""The samplers' number options are checked for what they are (issue 49): NaN fails every comparison, so
``threshold=nan``, ``gamma=nan`` (and ``inf``) passed their constructors' range checks and decoded on."""

from __future__ import annotations

import math

import pytest

from flowlm.samplers.common import check_finite
from flowlm.samplers.mdm_confidence import ConfidenceSampler
from flowlm.samplers.mdm_eb import EBSampler
from flowlm.samplers.mdm_threshold import ThresholdSampler

NOT_FINITE = [math.nan, math.inf, -math.inf, float("nan")]


@pytest.mark.parametrize("value", NOT_FINITE)
@pytest.mark.parametrize(
    ("sampler", "option"),
    [(ThresholdSampler, "threshold"), (ThresholdSampler, "factor"), (EBSampler, "gamma"), (EBSampler, "temperature"),
     (ConfidenceSampler, "temperature")],
)  # fmt: skip
def test_a_number_option_that_is_not_finite_is_refused_naming_it(sampler, option, value):
    with pytest.raises(ValueError, match=rf"^{option} must be a finite number, got {value!r}$"):
        sampler(**{option: value})


@pytest.mark.parametrize("value", ["0.9", None, True])
def test_a_number_option_that_is_not_a_number_is_refused_naming_it(value):
    with pytest.raises(ValueError, match="^threshold must be a finite number"):
        ThresholdSampler(threshold=value)


def test_finite_values_keep_their_documented_meanings():
    """τ > 1 (the confidence schedule) and τ ≤ 0 (a block per call) are settings, γ = 0 one position per call."""
    assert ThresholdSampler(threshold=1.5).threshold == 1.5 and ThresholdSampler(threshold=-1).threshold == -1.0
    assert ThresholdSampler(factor=2).factor == 2 and EBSampler(gamma=0).gamma == 0.0
    assert check_finite("gamma", 3) == 3.0
    with pytest.raises(ValueError, match="gamma must be ≥ 0"):
        EBSampler(gamma=-0.1)
