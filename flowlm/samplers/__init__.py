"""Samplers: each returns tokens, per-token confidence and the NFE it really spent."""

from flowlm.samplers.base import FlowDenoiser, MaskedDenoiser, SampleOutput, Sampler
from flowlm.samplers.block_flow import BlockFlowSampler
from flowlm.samplers.flow_map import FlowMapSampler
from flowlm.samplers.mdm_ancestral import AncestralSampler
from flowlm.samplers.mdm_confidence import ConfidenceSampler
from flowlm.samplers.posterior_refinement import PosteriorRefinementSampler

__all__ = [
    "AncestralSampler",
    "BlockFlowSampler",
    "ConfidenceSampler",
    "FlowDenoiser",
    "FlowMapSampler",
    "MaskedDenoiser",
    "PosteriorRefinementSampler",
    "SampleOutput",
    "Sampler",
]
