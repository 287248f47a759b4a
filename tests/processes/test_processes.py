"""The three noise processes share one interface (flowlm/processes/base.py): ``noise(tokens, times, keep,
generator=, draws=, embeddings=, mask_id=)`` → ``NoisedBatch(state, clean, noised)``, checked by hand on a 3-token
vocabulary, and the time law ``sample_t(n, generator=, device=, offset=, count=)``."""

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
    out = BridgeProcess(sigma=0.2).noise(TOKENS, torch.tensor([0.5, 0.9]), KEEP, draws=eps, embeddings=EMB, mask_id=V)
    # row 0, t = 1/2: σ√(1/4) = 0.1; pos 1 (y = 2, E = (1, 1)): (−1/2 + 1/2, −1/2 + 1/2) + 0.1·(1, −1);
    #   pos 2 (y = 1, E = (0, 1)): (−1/2, −1/2 + 1/2) + 0.1·(0, 2)
    # row 1, t = 0.9: σ√(0.09) = 0.06; pos 0 (y = 1): (−0.1, −0.1 + 0.9) + 0.06·(1, 1); pos 2 (y = 0, E = (1, 0)):
    #   (−0.1 + 0.9, −0.1)
    expected = torch.tensor([[[1.0, 0.0], [0.1, -0.1], [-0.5, 0.2]], [[-0.04, 0.86], [0.0, 1.0], [0.8, -0.1]]])
    torch.testing.assert_close(out.state, expected)
    assert torch.equal(out.clean, EMB[TOKENS]) and torch.equal(out.noised, ~KEEP)
    with pytest.raises(ValueError, match="embeddings"):
        BridgeProcess().noise(TOKENS, torch.tensor([0.5, 0.9]), KEEP, draws=eps)
    with pytest.raises(ValueError, match="mask_id"):
        BridgeProcess().noise(TOKENS, torch.tensor([0.5, 0.9]), KEEP, draws=eps, embeddings=EMB)


def test_bridge_mask_row_anywhere_in_the_table():
    """m = E[mask_id] wherever the row stands (LLaDA and Dream keep [MASK] inside the vocabulary): the same table
    with [MASK] moved to row 1 (data ids relabelled) gives the same state, from draws or from the generator."""
    order = torch.tensor([0, 3, 1, 2])  # new row r holds old row order[r]: [MASK] (old 3) at row 1
    inside = EMB[order]
    relabel = torch.argsort(order)  # old id → new row
    times = torch.tensor([0.3, 0.8])
    for kwargs in ({"draws": torch.randn(2, 3, 2)}, {"generator": torch.Generator().manual_seed(4)}):
        last = BridgeProcess().noise(TOKENS, times, KEEP, embeddings=EMB, mask_id=V, **kwargs)
        kwargs = {k: torch.Generator().manual_seed(4) if k == "generator" else v for k, v in kwargs.items()}
        moved = BridgeProcess().noise(relabel[TOKENS], times, KEEP, embeddings=inside, mask_id=1, **kwargs)
        assert torch.equal(moved.state, last.state) and torch.equal(moved.noised, last.noised)
    # at t → 0 every noised position sits at m: the moved row, not the table's last
    near = BridgeProcess().noise(
        relabel[TOKENS], torch.zeros(2), KEEP, embeddings=inside, mask_id=1, draws=torch.randn(2, 3, 2)
    )
    assert torch.equal(near.state[~KEEP], inside[1].expand(int((~KEEP).sum()), 2))


@pytest.mark.parametrize(
    "process",
    [MaskingProcess(mask_id=V), GaussianFlowProcess(vocab_size=V), BridgeProcess()],
    ids=lambda p: type(p).__name__,
)
def test_one_interface_draws_from_the_generator_or_takes_the_draws(process: NoiseProcess):
    """Every process: the same NoisedBatch from a generator or from the same numbers passed as ``draws``; ``keep``
    positions hold their clean value exactly and are never noised."""
    times = torch.tensor([0.4, 0.7])
    kwargs = {"embeddings": EMB, "mask_id": V}
    out = process.noise(TOKENS, times, KEEP, generator=torch.Generator().manual_seed(0), **kwargs)
    assert isinstance(out, NoisedBatch) and not out.noised[KEEP].any()
    assert torch.equal(out.state[KEEP], out.clean[KEEP])
    shape = out.state.shape if out.state.dim() == 3 else TOKENS.shape
    draw = torch.rand if isinstance(process, MaskingProcess) else torch.randn
    given = process.noise(TOKENS, times, KEEP, draws=draw(shape, generator=torch.Generator().manual_seed(0)), **kwargs)
    assert torch.equal(given.state, out.state) and torch.equal(given.noised, out.noised)
    assert math.isfinite(out.state.float().sum().item())


PROCESSES = [MaskingProcess(mask_id=V), GaussianFlowProcess(vocab_size=V), BridgeProcess()]


@pytest.mark.parametrize("process", PROCESSES, ids=lambda p: type(p).__name__)
def test_one_time_draw_shape(process: NoiseProcess):
    """``sample_t(n, generator=, device=, offset=, count=)``: float32 times (count,) on ``device``; a slice of a global
    draw is that slice of the whole draw (ranks and micro-batches share one draw); a bad slice is refused."""
    full = process.sample_t(16, generator=torch.Generator().manual_seed(2))
    assert full.shape == (16,) and full.dtype == torch.float32 and full.device.type == "cpu"
    assert 0 <= full.min() and full.max() <= 1
    part = process.sample_t(16, generator=torch.Generator().manual_seed(2), device="cpu", offset=4, count=8)
    assert torch.equal(part, full[4:12])
    with pytest.raises(ValueError, match="outside"):
        process.sample_t(16, generator=torch.Generator(), offset=10, count=8)


def test_time_laws_by_hand():
    """Masking: t = ε + (1 − ε)·(i + u_i)/n in stratum order; Gaussian flow: (i + u_i)/n in random order; bridge
    (uniform): t_min + (1 − 2·t_min)·u, i.i.d. (u_i the generator's float64 uniforms)."""
    n = 8
    u = torch.rand(n, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    strata = (torch.arange(n, dtype=torch.float64) + u) / n
    masking = MaskingProcess(mask_id=V, eps=0.01).sample_t(n, generator=torch.Generator().manual_seed(3))
    assert torch.equal(masking, (0.01 + 0.99 * strata).float())
    gen = torch.Generator().manual_seed(3)
    flow = GaussianFlowProcess(vocab_size=V).sample_t(n, generator=gen)
    torch.rand(n, generator=(ref := torch.Generator().manual_seed(3)), dtype=torch.float64)
    assert torch.equal(flow, strata[torch.randperm(n, generator=ref)].float())
    bridge = BridgeProcess(t_min=0.01).sample_t(n, generator=torch.Generator().manual_seed(3))
    assert torch.equal(bridge, (0.01 + 0.98 * u).clamp(0.01, 0.99).float())
