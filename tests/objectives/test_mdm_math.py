"""MDM math: schedule weight, stratified times, SUBS loss, overfitting a tiny set."""

import math

import torch

from flowlm.backbones.dit import DiT
from flowlm.objectives.mdm import mdm_elbo_loss, subs_log_probs
from flowlm.processes.masking import LogLinearSchedule, MaskingProcess, stratified_times


def test_elbo_weight_is_one_over_t():
    sched = LogLinearSchedule()
    t = torch.tensor([0.01, 0.25, 0.5, 1.0], dtype=torch.float64)
    # −α'_t / (1 − α_t) with α_t = 1 − t, α' computed by autograd rather than assumed
    tt = t.clone().requires_grad_(True)
    (d_alpha,) = torch.autograd.grad(sched.alpha(tt).sum(), tt)
    expected = -d_alpha / (1 - sched.alpha(t))
    torch.testing.assert_close(sched.loss_weight(t), expected)
    torch.testing.assert_close(sched.loss_weight(t), 1 / t)


def test_stratified_times_cover_the_global_batch():
    n = 64
    full = stratified_times(n, offset=0, count=n, eps=1e-3, generator=torch.Generator().manual_seed(3))
    assert full.min() >= 1e-3 and full.max() <= 1
    strata = ((full - 1e-3) / (1 - 1e-3) * n).floor().long()
    assert sorted(strata.tolist()) == list(range(n))  # exactly one draw per stratum
    # two "ranks" with the same seed take disjoint slices of the same draw
    a = stratified_times(n, offset=0, count=32, eps=1e-3, generator=torch.Generator().manual_seed(3))
    b = stratified_times(n, offset=32, count=32, eps=1e-3, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(torch.cat([a, b]), full)


def test_masking_spares_the_prompt():
    proc = MaskingProcess(mask_id=9)
    tokens = torch.randint(0, 9, (4, 20))
    prompt = torch.zeros(4, 20, dtype=torch.bool)
    prompt[:, :5] = True
    noised = proc.noise(tokens, torch.ones(4), prompt, generator=torch.Generator().manual_seed(0))
    x_t, masked = noised.state, noised.noised
    assert not masked[:, :5].any() and masked[:, 5:].all()  # t = 1 masks every non-prompt token
    assert (x_t[:, :5] == tokens[:, :5]).all() and (x_t[:, 5:] == 9).all()


def test_loss_is_weighted_ce_on_masked_positions_only():
    torch.manual_seed(0)
    v, mask_id = 5, 5
    logits = torch.randn(2, 6, v + 1)
    tokens = torch.randint(0, v, (2, 6))
    masked = torch.tensor([[1, 0, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1]], dtype=torch.bool)
    t = torch.tensor([0.2, 0.8])
    loss_mask = torch.ones(2, 6, dtype=torch.bool)
    out = mdm_elbo_loss(logits, tokens, masked, 1 / t, loss_mask, mask_id)
    loss = out.loss
    assert (out.per_token[~masked] == 0).all()  # unmasked positions contribute exactly zero
    # hand computation: CE over the data vocabulary ([MASK] logit removed), weighted by 1/t, / #tokens
    total = 0.0
    for b in range(2):
        for pos in range(6):
            if masked[b, pos]:
                lp = logits[b, pos, :v].log_softmax(-1)[tokens[b, pos]]
                total += -lp.item() / t[b].item()
    assert math.isclose(loss.item(), total / 12, rel_tol=1e-5)
    # changing logits at unmasked positions does not change the loss
    logits2 = logits.clone()
    logits2[~masked] += 3 * torch.randn_like(logits2[~masked])
    assert math.isclose(mdm_elbo_loss(logits2, tokens, masked, 1 / t, loss_mask, mask_id).loss.item(), loss.item())
    # the [MASK] logit gets zero probability under SUBS
    assert subs_log_probs(logits, mask_id).shape[-1] == v


def test_loss_decreases_on_a_tiny_overfit_set():
    torch.manual_seed(0)
    v, length = 4, 8
    net = DiT(vocab_size=v + 1, d_model=32, n_layers=2, n_heads=2, cond_dim=16)
    proc = MaskingProcess(mask_id=v)
    data = torch.randint(0, v, (1, length)).expand(4, length)  # one sequence to memorise
    prompt = torch.zeros_like(data, dtype=torch.bool)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)

    def loss_at(gen_seed):
        gen = torch.Generator().manual_seed(gen_seed)
        t = stratified_times(4, offset=0, count=4, eps=1e-3, generator=gen)
        noised = proc.noise(data, t, prompt, generator=gen)
        return mdm_elbo_loss(net(noised.state, torch.zeros(4)), data, noised.noised, 1 / t, ~prompt, v).loss

    with torch.no_grad():
        before = sum(loss_at(s).item() for s in range(20))
    for step in range(200):
        opt.zero_grad()
        loss_at(1000 + step).backward()
        opt.step()
    with torch.no_grad():
        after = sum(loss_at(s).item() for s in range(20))
    assert after < 0.75 * before


def test_module_times_are_stratified_over_ranks_and_accumulation():
    from types import SimpleNamespace

    from lightning_modules.mdm import MDMModule

    backbone = {"d_model": 16, "n_layers": 1, "n_heads": 2, "cond_dim": 8}
    module = MDMModule(data_vocab_size=4, seq_len=6, backbone=backbone, optim={})
    local, world, accum = 4, 2, 3
    times = []
    for rank in range(world):
        for micro in range(accum):
            module._trainer = SimpleNamespace(
                world_size=world, accumulate_grad_batches=accum, global_step=7, global_rank=rank
            )
            times.append(module.sample_times(local, batch_idx=30 + micro))
    t = torch.cat(times)
    n = local * world * accum
    strata = ((t - 1e-3) / (1 - 1e-3) * n).floor().long()
    assert sorted(strata.tolist()) == list(range(n))  # one draw per stratum of the *global* batch
