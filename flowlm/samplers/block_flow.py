"""Block-diffusion sampling of FMLM+ (the released code's other sampler): flow-map jumps block by block."""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from flowlm.samplers.base import FlowDenoiser, SampleOutput
from flowlm.samplers.common import block_ids
from flowlm.samplers.flow_map import flow_jumps_summary, summary_at_slots
from flowlm.samplers.planned import PlannedSampler


class BlockFlowSampler(PlannedSampler):
    """Non-prompt positions in blocks of ``block_size`` (left to right). For block b, the block and every position
    after it jump together 0 → 1 in K flow-map steps (earlier blocks are committed at s = t = 1, later positions
    restart from their initial noise); the block is then committed as the argmax of the last δ.
    NFE = ⌈free positions / block_size⌉ × K; ``steps_per_block=None`` takes K = budget // blocks.
    """

    family = "flow"
    confidence_kind = "a-posteriori"  # max_v δ at the end of the block's jumps 0 → 1

    def __init__(self, *, block_size: int, steps_per_block: int | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be ≥ 1, got {block_size}")
        if steps_per_block is not None and steps_per_block < 1:
            raise ValueError(f"steps_per_block must be ≥ 1, got {steps_per_block}")
        self.block_size, self.steps_per_block = block_size, steps_per_block

    def plan(self, nfe: int, free_positions: int) -> tuple[int, int]:
        """(blocks, steps per block) for a budget, or a clear error."""
        super().check_budget(nfe, free_positions=free_positions)
        n_blocks = max(1, math.ceil(free_positions / self.block_size))
        steps = self.steps_per_block or nfe // n_blocks
        if steps < 1 or n_blocks * steps > nfe:
            raise ValueError(
                f"{n_blocks} blocks × {max(steps, 1)} steps need {n_blocks * max(steps, 1)} NFE, "
                f"above the budget of {nfe}"
            )
        return n_blocks, steps

    def check_budget(self, nfe: int, *, free_positions: int | None = None) -> None:  # noqa: D102
        if free_positions is None:
            super().check_budget(nfe)
        else:
            self.plan(nfe, free_positions)

    def schedule(self, nfe: int, prompt: Tensor, prompt_mask: Tensor) -> tuple[int, int]:
        """(blocks, steps per block) for the row with the most positions to generate."""
        return self.plan(nfe, int((~prompt_mask).sum(-1).max()))

    def sample(self, model: FlowDenoiser, prompt: Tensor, prompt_mask: Tensor, schedule, generator) -> SampleOutput:
        """Sample with exactly blocks × K network calls."""
        n_blocks, steps = schedule
        block_id = block_ids(~prompt_mask, self.block_size)
        space = model.states
        noise = space.noise(prompt.shape, generator, prompt.device)
        tokens, committed, confidence = prompt.clone(), prompt_mask.clone(), prompt_mask.float()
        calls = 0
        for b in range(n_blocks):
            z = torch.where(committed[..., None], space.data(tokens), noise)
            block = block_id == b
            # the greedy draft's summary, the head at the block's positions only (at most block_size a row)
            read = functools.partial(flow_jumps_summary, model, z, committed, steps)
            log_max, argmax = summary_at_slots(read, block, self.block_size)
            calls += steps
            tokens = torch.where(block, argmax, tokens)
            confidence = torch.where(block, log_max.exp(), confidence)
            committed = committed | block
        return SampleOutput(tokens=tokens, confidence=confidence, nfe=calls)
