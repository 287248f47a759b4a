"""Samplers: each returns tokens, per-token confidence and the NFE it really spent."""

from flowlm.samplers.autoregressive import AutoregressiveSampler, CausalDenoiser
from flowlm.samplers.base import CONFIDENCE_KINDS, FlowDenoiser, MaskedDenoiser, SampleOutput, Sampler
from flowlm.samplers.block_flow import BlockFlowSampler
from flowlm.samplers.flow_map import FlowMapSampler
from flowlm.samplers.guidance import GuidedSampler
from flowlm.samplers.mdm_adaptive import AdaptiveMDMSampler
from flowlm.samplers.mdm_ancestral import AncestralSampler
from flowlm.samplers.mdm_confidence import ConfidenceSampler
from flowlm.samplers.mdm_eb import EBSampler
from flowlm.samplers.mdm_semi_ar import SemiARConfidenceSampler
from flowlm.samplers.mdm_threshold import ThresholdSampler
from flowlm.samplers.mlfm import BridgeDenoiser, MLFMSampler
from flowlm.samplers.planned import PlannedSampler
from flowlm.samplers.posterior_refinement import PosteriorRefinementSampler

__all__ = [
    "CONFIDENCE_KINDS",
    "AdaptiveMDMSampler",
    "AncestralSampler",
    "AutoregressiveSampler",
    "BlockFlowSampler",
    "BridgeDenoiser",
    "CausalDenoiser",
    "ConfidenceSampler",
    "EBSampler",
    "FlowDenoiser",
    "FlowMapSampler",
    "GuidedSampler",
    "MLFMSampler",
    "MaskedDenoiser",
    "PlannedSampler",
    "PosteriorRefinementSampler",
    "SampleOutput",
    "Sampler",
    "SemiARConfidenceSampler",
    "ThresholdSampler",
]
