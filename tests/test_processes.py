"""The three noise processes share one call: ``noise(tokens, times, keep, generator=, draws=, embeddings=)`` →
``NoisedBatch(state, clean, noised)`` (flowlm/processes/base.py), checked by hand on a 3-token vocabulary."""

from __future__ import annotations

import math

import pytest
import torch

from flowlm.processes.base import NoisedBatch, NoiseProcess
from flowlm.processes.bridge import BridgeProcess
from flowlm.processes.gaussian_flow import GaussianFlowProcess
from flowlm.processes.masking import MaskingProcess

V = 3
TOKENS = torch.tensor([[0, 2, 1], [1, 1, 0]])
KEEP = torch.tensor([[True, False, False], [False, True, False]])  # e.g. the prompt / the context
EMB = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, -1.0]])  # E (|V| + 1, d = 2), [MASK] last


def test_masking_by_hand():
    """masked = (u < 1 − α_t = t) off ``keep``; the state holds [MASK] = 3 there, the ids elsewhere."""
    u = torch.tensor([[0.1, 0.3, 0.9], [0.2, 0.1, 0.5]])
    out = MaskingProcess(mask_id=V).noise(TOKENS, torch.tensor([0.5, 0.6]), KEEP, draws=u)
    # row 0 (t = 0.5): u = 0.1 kept (prompt), 0.3 < 0.5 masked, 0.9 not; row 1 (t = 0.6): 0.2 masked, 0.1 kept,
    # 0.5 masked
    assert torch.equal(out.noised, torch.tensor([[False, True, False], [True, False, True]]))
    assert torch.equal(out.state, torch.tensor([[0, 3, 1], [3, 1, 3]])) and torch.equal(out.clean, TOKENS)


def test_gaussian_flow_by_hand():
    """x_t = (1 − t)·ε + t·onehot(y) off ``keep``, the exact one-hot on it; per-token or per-sequence times."""
    eps = torch.tensor(
        [[[9.0, 9.0, 9.0], [1.0, 0.0, -1.0], [0.0, 2.0, 0.0]], [[0.5, 0.5, 0.5], [9.0, 9.0, 9.0], [0.0, 0.0, 0.0]]]
    )
    times = torch.tensor([[1.0, 0.25, 0.5], [0.75, 1.0, 0.0]])
    out = GaussianFlowProcess(vocab_size=V).noise(TOKENS, times, KEEP, draws=eps)
    # row 0: pos 0 kept, e₀; pos 1 (y = 2, t = 1/4) (3/4)·ε + (1/4)·e₂; pos 2 (y = 1, t = 1/2) ε/2 + e₁/2
    # row 1: pos 0 (y = 1, t = 3/4) ε/4 + (3/4)·e₁; pos 1 kept, e₁; pos 2 (t = 0) ε
    expected = torch.tensor(
        [
            [[1.0, 0.0, 0.0], [0.75, 0.0, -0.75 + 0.25], [0.0, 1.0 + 0.5, 0.0]],
            [[0.125, 0.125 + 0.75, 0.125], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]],
        ]
    )
    torch.testing.assert_close(out.state, expected)
    assert torch.equal(out.clean, torch.eye(V)[TOKENS]) and torch.equal(out.noised, ~KEEP)
    per_sequence = GaussianFlowProcess(vocab_size=V).noise(TOKENS, torch.tensor([0.25, 0.0]), KEEP, draws=eps)
    by_token = torch.where(KEEP, 1.0, torch.tensor([0.25, 0.0])[:, None])
    torch.testing.assert_close(
        per_sequence.state, GaussianFlowProcess(vocab_size=V).noise(TOKENS, by_token, KEEP, draws=eps).state
    )


def test_bridge_by_hand():
    """z_t = (1 − t)·m + t·E_y + σ·√(t(1 − t))·ε off ``keep``, E_y on it; m = E[MASK], the table's last row."""
    eps = torch.tensor([[[5.0, 5.0], [1.0, -1.0], [0.0, 2.0]], [[1.0, 1.0], [5.0, 5.0], [0.0, 0.0]]])
    out = BridgeProcess(sigma=0.2).noise(TOKENS, torch.tensor([0.5, 0.9]), KEEP, draws=eps, embeddings=EMB)
    # row 0, t = 1/2: σ√(1/4) = 0.1; pos 1 (y = 2, E = (1, 1)): (−1/2 + 1/2, −1/2 + 1/2) + 0.1·(1, −1);
    #   pos 2 (y = 1, E = (0, 1)): (−1/2, −1/2 + 1/2) + 0.1·(0, 2)
    # row 1, t = 0.9: σ√(0.09) = 0.06; pos 0 (y = 1): (−0.1, −0.1 + 0.9) + 0.06·(1, 1); pos 2 (y = 0, E = (1, 0)):
    #   (−0.1 + 0.9, −0.1)
    expected = torch.tensor([[[1.0, 0.0], [0.1, -0.1], [-0.5, 0.2]], [[-0.04, 0.86], [0.0, 1.0], [0.8, -0.1]]])
    torch.testing.assert_close(out.state, expected)
    assert torch.equal(out.clean, EMB[TOKENS]) and torch.equal(out.noised, ~KEEP)
    with pytest.raises(ValueError, match="embeddings"):
        BridgeProcess().noise(TOKENS, torch.tensor([0.5, 0.9]), KEEP, draws=eps)


@pytest.mark.parametrize(
    "process",
    [MaskingProcess(mask_id=V), GaussianFlowProcess(vocab_size=V), BridgeProcess()],
    ids=lambda p: type(p).__name__,
)
def test_one_interface_draws_from_the_generator_or_takes_the_draws(process: NoiseProcess):
    """Every process: the same NoisedBatch from a generator or from the same numbers passed as ``draws``; ``keep``
    positions hold their clean value exactly and are never noised."""
    times = torch.tensor([0.4, 0.7])
    kwargs = {"embeddings": EMB}
    out = process.noise(TOKENS, times, KEEP, generator=torch.Generator().manual_seed(0), **kwargs)
    assert isinstance(out, NoisedBatch) and not out.noised[KEEP].any()
    assert torch.equal(out.state[KEEP], out.clean[KEEP])
    shape = out.state.shape if out.state.dim() == 3 else TOKENS.shape
    draw = torch.rand if isinstance(process, MaskingProcess) else torch.randn
    given = process.noise(TOKENS, times, KEEP, draws=draw(shape, generator=torch.Generator().manual_seed(0)), **kwargs)
    assert torch.equal(given.state, out.state) and torch.equal(given.noised, out.noised)
    assert math.isfinite(out.state.float().sum().item())
