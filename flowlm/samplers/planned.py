"""The call shared by the MDM and flow samplers: the NFE budget checked, and the loop planned from it, before any
network call (``schedule``), then the loop (``sample``)."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch
from torch import Tensor

from flowlm.samplers.base import FlowDenoiser, MaskedDenoiser, SampleOutput, Sampler


class PlannedSampler(Sampler):
    """A sampler whose loop follows from its budget: ``schedule`` checks the budget and returns what the loop needs
    from it, ``sample`` runs the loop."""

    def __call__(
        self,
        model: MaskedDenoiser | FlowDenoiser,
        *,
        prompt: Tensor,
        prompt_mask: Tensor,
        nfe: int,
        generator: torch.Generator | None = None,
    ) -> SampleOutput:
        """Sample completions of ``prompt`` with at most ``nfe`` network evaluations."""
        return self.sample(model, prompt, prompt_mask, self.schedule(nfe, prompt, prompt_mask), generator)

    def schedule(self, nfe: int, prompt: Tensor, prompt_mask: Tensor) -> Any:
        """The budget itself, checked against the whole row (at most the positions to generate: no host read)."""
        self.check_budget(nfe, free_positions=prompt.shape[-1])
        return nfe

    @abstractmethod
    def sample(
        self, model: MaskedDenoiser | FlowDenoiser, prompt: Tensor, prompt_mask: Tensor, schedule: Any, generator
    ) -> SampleOutput:
        """The loop, given what ``schedule`` returned for the budget."""
