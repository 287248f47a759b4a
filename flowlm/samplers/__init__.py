"""Samplers: each returns tokens, per-token confidence and the NFE it really spent."""

from flowlm.samplers.base import MaskedDenoiser, SampleOutput, Sampler
from flowlm.samplers.mdm_ancestral import AncestralSampler
from flowlm.samplers.mdm_confidence import ConfidenceSampler

__all__ = ["AncestralSampler", "ConfidenceSampler", "MaskedDenoiser", "SampleOutput", "Sampler"]
