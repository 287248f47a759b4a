"""Training steps read nothing back from the device but the finite-loss guard's one flag per optimizer step
(tests/host_syncs.py counts the ops that would make the host wait for a GPU)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.optim.swa_utils import AveragedModel

import flowlm.objectives.fmlm_plus as objective
from callbacks.ema import EMA, HostCountedAverage
from flowlm.objectives.fmlm_plus import BOUNDARY, DIAGONAL, DISTILL, KIND_NAMES, OFF_DIAGONAL
from flowlm.samplers import (
    AncestralSampler,
    BlockFlowSampler,
    ConfidenceSampler,
    FlowMapSampler,
    PosteriorRefinementSampler,
    SemiARConfidenceSampler,
)
from flowlm.samplers.mlfm import MLFMSampler
from lightning_modules.fmlm_plus import FMLMPlusModule
from runners.train import train
from tests.conftest import FAST, compose_config
from tests.host_syncs import HostSyncs, SyncProbe
from tests.lightning_modules.test_mlfm import BB, L, V, adapted, perturb_adapter, random_mdm


def test_the_counter_sees_reads_and_data_dependent_shapes_only():
    x, mask, idx = torch.randn(6), torch.rand(6) < 0.5, torch.tensor([0, 2])
    with HostSyncs() as syncs:
        _ = x[mask]  # boolean indexing: nonzero inside
        _ = bool(mask.any())
        _ = x.nonzero()
        x[mask] = 0.0
        _ = torch.repeat_interleave(torch.arange(2), torch.tensor([1, 2]))
    assert syncs.ops == {"index": 1, "_local_scalar_dense": 1, "nonzero": 1, "index_put_": 1, "repeat_interleave": 1}
    assert all("test_host_syncs.py" in where for where in syncs.where)
    with HostSyncs() as none:
        _ = torch.where(mask, x, 1.0), x[idx], x.gather(0, idx)
        x[idx] = 1.0
        _ = torch.repeat_interleave(torch.arange(2), torch.tensor([1, 2]), output_size=3)
        model = torch.nn.Linear(3, 3)
        model(torch.randn(2, 3)).sum().backward()
        torch.optim.AdamW(model.parameters()).step()  # its step counters live on the host for GPU parameters
    assert none.count == 0, none.where


def _probe_run(experiment: str, *extra: str) -> list[HostSyncs]:
    probe = SyncProbe()
    original = pl.Trainer.__init__

    def with_probe(self, *args, callbacks=None, **kwargs):
        original(self, *args, callbacks=[*(callbacks or []), probe], **kwargs)

    # No progress display: it reads the logged loss back when it prints (every progress_every_s and at the last
    # step, as Lightning's bar does at each refresh), which is the display's read, not the training step's.
    overrides = [f"experiment={experiment}", "scale=cpu", *FAST, "logger=none", "trainer.max_steps=3", *extra]
    overrides.append("trainer.enable_progress_bar=false")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pl.Trainer, "__init__", with_probe)
        train(compose_config(overrides=[*overrides, "trainer.val_check_interval=3", "trainer.log_every_n_steps=50"]))
    return probe.per_batch


@pytest.mark.parametrize("experiment", ["sudoku_mdm_uncond", "sudoku_fmlm_plus_scratch_easy"])
def test_a_training_step_reads_the_device_once(runs_env, experiment):
    """Forward, teacher passes, backward, clipping, AdamW and the EMA update: one read per step, the finite-loss
    guard's (plus the EMA's count, read once at the first update)."""
    batches = _probe_run(experiment)
    assert len(batches) == 3
    for i, syncs in enumerate(batches):
        expected = ["finite_loss.py"] + (["ema.py"] if i == 0 else [])
        assert [where.split(" at ")[1].split(":")[0].rsplit("/", 1)[1] for where in syncs.where] == expected, (
            syncs.where
        )


def test_fmlm_plus_with_a_teacher_and_mlfm_losses_read_nothing_back():
    torch.manual_seed(0)
    mdm = random_mdm()
    flow = FMLMPlusModule(
        data_vocab_size=V, seq_len=L, backbone=BB, optim={}, teacher="mdm.ckpt", shares={"distill": 0.25}
    )
    object.__setattr__(flow, "_teacher", mdm.eval())
    tokens = torch.randint(0, V, (8, L))
    batch = {"tokens": tokens, "prompt_mask": torch.arange(L).expand(8, L) < 3}
    kinds = torch.tensor([DIAGONAL, DIAGONAL, OFF_DIAGONAL, OFF_DIAGONAL, BOUNDARY, DISTILL, DISTILL, DIAGONAL])
    s, t = torch.rand(8) * 0.5, torch.rand(8) * 0.5 + 0.5
    mlfm = adapted(mdm)
    perturb_adapter(mlfm)
    with HostSyncs() as syncs:
        flow.loss(batch, flow.draws_at(batch, kinds, s, t, torch.Generator().manual_seed(1))).loss.backward()
        gens = torch.Generator().manual_seed(2), torch.Generator().manual_seed(3)
        mlfm.loss(batch, mlfm.draws_at(batch, *gens)).loss.backward()
    assert syncs.count == 0, syncs.where


def test_per_kind_losses_are_the_means_over_each_kinds_scored_tokens(monkeypatch):
    torch.manual_seed(0)
    flow = FMLMPlusModule(data_vocab_size=V, seq_len=L, backbone=BB, optim={})
    tokens = torch.randint(0, V, (6, L))
    batch = {"tokens": tokens, "prompt_mask": torch.zeros(6, L, dtype=torch.bool)}
    batch["loss_mask"] = torch.arange(L).expand(6, L) < L - 2
    kinds = torch.tensor([DIAGONAL, OFF_DIAGONAL, DIAGONAL, OFF_DIAGONAL, BOUNDARY, DIAGONAL])
    s, t = torch.tensor([0.2, 0.1, 0.5, 0.3, 0.0, 0.9]), torch.tensor([0.2, 0.6, 0.5, 0.8, 1.0, 0.9])
    captured = {}
    real = objective.soft_targets

    def spy(*args, **kwargs):
        captured["args"], captured["kwargs"] = args, kwargs
        return real(*args, **kwargs)

    monkeypatch.setattr(objective, "soft_targets", spy)
    out = flow.loss(batch, flow.draws_at(batch, kinds, s, t, torch.Generator().manual_seed(1)), parts=True)
    assert set(out.parts) == {KIND_NAMES[k] for k in (DIAGONAL, OFF_DIAGONAL, BOUNDARY)}
    # the reference: the dense soft CE against the dense targets, boolean indexing on its per-token losses
    kinds_seen, x_s, times, (s_tok, t_tok), active = captured["args"]
    with torch.no_grad():
        log_d = flow(x_s, s_tok, t_tok)
        onehot = torch.nn.functional.one_hot(tokens, V).float()
        target = objective.targets(kinds_seen, x_s, times, (s_tok, t_tok), onehot, active, **captured["kwargs"])
        per_token = -(target * log_d).sum(-1)
    scored = active & batch["loss_mask"]
    for kind in (DIAGONAL, OFF_DIAGONAL, BOUNDARY):
        rows = (kinds == kind)[:, None] & scored
        assert out.parts[KIND_NAMES[kind]] == pytest.approx(per_token[rows].mean().item(), rel=1e-5)
    no_parts = flow.loss(batch, flow.draws_at(batch, kinds, s, t, torch.Generator().manual_seed(1)))
    assert no_parts.parts == {} and torch.equal(no_parts.loss, out.loss)


def test_host_counted_average_matches_torchs_averaged_model_and_survives_a_load():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    ema = EMA(decay=0.9, warmup=True)
    ours = HostCountedAverage(model, multi_avg_fn=ema._update, use_buffers=True)
    reference = AveragedModel(model, multi_avg_fn=ema._update, use_buffers=True)
    for _ in range(5):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        model(torch.randn(8, 4))  # moves the BatchNorm running statistics (buffers are averaged too)
        ours.update_parameters(model)
        reference.update_parameters(model)
    for a, b in zip(ours.state_dict().values(), reference.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert int(ours.n_averaged) == 5
    with HostSyncs() as torchs:
        reference.update_parameters(model)
    with HostSyncs() as mine:
        ours.update_parameters(model)
    # torch tests its device count twice and hands it on as a device tensor (read again per dtype group)
    assert torchs.ops["_local_scalar_dense"] == 4 and mine.count == 0
    restored = HostCountedAverage(model, multi_avg_fn=ema._update, use_buffers=True)
    restored.update_parameters(model)  # count 1 on the host …
    restored.load_state_dict(ours.state_dict())  # … then 6 from the checkpoint
    restored.update_parameters(model)
    reference.update_parameters(model)
    for a, b in zip(reference.state_dict().values(), restored.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("family", "sampler", "reads"),
    [
        ("flow", FlowMapSampler(), 0),
        ("flow", FlowMapSampler(euler=True), 0),
        ("flow", PosteriorRefinementSampler(), 1),  # the plan: the most uncommitted positions of a row
        ("flow", PosteriorRefinementSampler(flow_steps=2), 1),
        ("flow", PosteriorRefinementSampler(confidence="a_priori"), 1),
        ("flow", BlockFlowSampler(block_size=3), 1),  # the plan: the longest response
        ("mdm", ConfidenceSampler(), 1),  # the loop length: the most masked row
        ("mdm", ConfidenceSampler(temperature=1.0), 1),  # the committing draw's size is tracked on the host
        ("mdm", SemiARConfidenceSampler(block_length=4), 1),  # the plan: the longest response
        ("mdm", SemiARConfidenceSampler(block_length=4, temperature=1.0), 1),
        ("mdm", SemiARConfidenceSampler(block_length=4, temperature=1.0, score="max_prob"), 1),
        ("mdm", AncestralSampler(), 1 + 8),  # and one per step: how many positions unmask
        ("mlfm", MLFMSampler(guidance=1.0, otp_eps=0.05), 1),  # CCFG: does the batch have a prompt to corrupt
        ("mlfm", MLFMSampler(guidance=1.0, otp_eps=0.05, check_context=False), 0),
        ("mlfm", MLFMSampler(otp_eps=0.05), 0),
        ("mlfm", MLFMSampler(otp_eps=0.05, otp_mode="rounds", rounds=2), 0),
    ],
)
def test_samplers_read_the_device_at_most_once_per_call(family, sampler, reads):
    """No host read inside the sampling loops (the ancestral sampler's one per step excepted, by design)."""
    mdm = random_mdm()
    mlfm = adapted(mdm)
    perturb_adapter(mlfm)
    flow = FMLMPlusModule(data_vocab_size=V, seq_len=L, backbone=BB, optim={})
    for p in flow.parameters():
        torch.nn.init.normal_(p, std=0.3)
    model = {"flow": flow, "mdm": mdm, "mlfm": mlfm}[family].eval().denoiser()
    prompt = torch.randint(0, V, (3, L), generator=torch.Generator().manual_seed(0))
    mask = torch.arange(L).expand(3, L) < 3
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        sampler(model, prompt=prompt, prompt_mask=mask, nfe=8, generator=gen)  # warms cached host-side grids
        with HostSyncs() as syncs:
            out = sampler(model, prompt=prompt, prompt_mask=mask, nfe=8, generator=gen)
    assert out.nfe <= 8 and syncs.count == reads, syncs.where
