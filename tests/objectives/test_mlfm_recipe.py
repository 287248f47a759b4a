"""MLFM's mask recipe (flowlm/objectives/mlfm.py ``mlfm_inputs``) against the training module's earlier code path,
copied below as an oracle: the same random numbers in the same order, so z, t and the masked set are bit-identical,
for a [MASK] row at the end of the embedding table (DiT, SMDM) and inside it (LLaDA, Dream)."""

from __future__ import annotations

import pytest
import torch

from flowlm.objectives.mlfm import mlfm_inputs
from flowlm.processes.bridge import BridgeProcess, t_of_gamma

B, L, V, D = 64, 16, 11, 5


def oracle(tokens, prompt, process, emb, mask_id, full_response_mask_prob, gen_cpu, gen):
    """``MLFMModule.mlfm_loss`` up to z, as it stood (``self.`` → arguments), with the bridge's earlier ``sample_t``
    and ``sample`` written out."""
    b, length = tokens.shape
    s = process.mask_prob(b, generator=gen_cpu, device=tokens.device)
    if full_response_mask_prob > 0:
        full = torch.rand(b, generator=gen_cpu).to(tokens.device, non_blocking=True) < full_response_mask_prob
        s = torch.where(full, 1.0, s)
    free = ~prompt
    masked = (torch.rand(b, length, generator=gen, device=tokens.device) < s[:, None]) & free
    empty = ~masked.any(-1) & free.any(-1)
    pick = torch.rand(b, length, generator=gen, device=tokens.device).masked_fill(~free, -1).argmax(-1)
    masked |= empty[:, None] & (torch.arange(length, device=tokens.device) == pick[:, None])
    # t = process.sample_t(b, generator=gen_cpu, device=tokens.device)
    u = torch.rand(b, generator=gen_cpu, dtype=torch.float64)
    if process.time_dist == "uniform":
        t = process.t_min + (1 - 2 * process.t_min) * u
    else:
        t = t_of_gamma(process.gamma_quantile(u), process.sigma)
    t = t.clamp(process.t_min, 1 - process.t_min).float().to(tokens.device, non_blocking=True)
    # z = process.sample(emb[mask_id], emb[tokens], t, masked, gen)
    m, e_y = emb[mask_id], emb[tokens]
    tt = t.reshape(-1, 1, 1).to(e_y.dtype)
    mean, std = (1 - tt) * m + tt * e_y, process.sigma * torch.sqrt((tt * (1 - tt)).clamp_min(0))
    eps = torch.randn(e_y.shape, generator=gen, device=e_y.device, dtype=e_y.dtype)
    z = torch.where(masked[..., None], mean + std * eps.to(e_y.dtype), e_y)
    return z, t, masked, empty


def batch(mask_id: int, seed: int):
    """Tokens off [MASK]; prompts of 0 to L positions (a row with no response among them)."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.tensor([v for v in range(V) if v != mask_id])
    tokens = data[torch.randint(0, len(data), (B, L), generator=gen)]
    prompt = torch.arange(L) < torch.randint(0, L + 1, (B, 1), generator=gen)
    prompt[0], prompt[1] = True, False  # one row all prompt, one all response
    return tokens, prompt


def gens(seed: int) -> tuple[torch.Generator, torch.Generator]:
    """(gen_cpu, gen): the host generator (s, the full-response coin, t) and the device one (masks, pick, ε)."""
    return torch.Generator().manual_seed(100 + seed), torch.Generator().manual_seed(200 + seed)


@pytest.mark.parametrize("time_dist", ["uniform", "gamma_mixture"])
@pytest.mark.parametrize("full_response_mask_prob", [0.0, 0.5])
@pytest.mark.parametrize("mask_id", [V - 1, 3], ids=["mask_last", "mask_inside"])
def test_mlfm_inputs_are_the_module_recipe_bit_for_bit(mask_id, full_response_mask_prob, time_dist):
    process = BridgeProcess(time_dist=time_dist, s_min=0.01)
    emb = torch.randn(V, D, generator=torch.Generator().manual_seed(7))  # [MASK] at row mask_id of this table
    fired = False
    for seed in range(3):
        tokens, prompt = batch(mask_id, seed)
        z_ref, t_ref, masked_ref, empty = oracle(
            tokens, prompt, process, emb, mask_id, full_response_mask_prob, *gens(seed)
        )
        gen_cpu, gen = gens(seed)
        z, t, masked = mlfm_inputs(
            tokens, prompt, process, emb, mask_id,
            full_response_mask_prob=full_response_mask_prob, gen_cpu=gen_cpu, gen=gen,
        )  # fmt: skip
        assert torch.equal(masked, masked_ref) and torch.equal(t, t_ref) and torch.equal(z, z_ref)
        # both generators were left where the oracle left them: nothing more, nothing less was drawn
        ref_cpu, ref = gens(seed)
        oracle(tokens, prompt, process, emb, mask_id, full_response_mask_prob, ref_cpu, ref)
        assert torch.equal(gen_cpu.get_state(), ref_cpu.get_state()) and torch.equal(gen.get_state(), ref.get_state())
        fired |= bool(empty.any())
        # the recipe's promises: the prompt clean and never masked, every row with a response has a masked position
        assert not masked[prompt].any() and masked.any(-1).eq((~prompt).any(-1)).all()
        assert torch.equal(z[~masked], emb[tokens][~masked])
    assert fired  # the at-least-one rule (and its pick) decided some row
