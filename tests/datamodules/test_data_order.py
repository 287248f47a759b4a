"""Training data order and random draws: the same global batches on 1 or N ranks × A accumulation steps, resumable
at any optimizer step (the in-process half of issue 7's DDP-equivalence and resume guarantees)."""

from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import TensorDataset

from datamodules.base import GlobalBatchSampler


def _global_batches(n, global_batch, world, accum, seed=3, steps_done=0):
    """The global batches of one epoch as sets of indices, reassembled from every rank's micro-batches."""
    data = TensorDataset(torch.arange(n))
    per_rank = []
    for rank in range(world):
        sampler = GlobalBatchSampler(
            data,
            global_batch=global_batch,
            num_replicas=world,
            rank=rank,
            accumulate=accum,
            seed=seed,
            steps_done=lambda: steps_done,
        )
        order = list(sampler)
        micro = sampler.micro_batch
        per_rank.append([order[i : i + micro] for i in range(0, len(order), micro)])
    steps = len(per_rank[0]) // accum
    batches = []
    for step in range(steps):
        rows = []
        for rank in range(world):  # rank-major then micro-batch: the order global_batch_slice assigns
            for m in range(accum):
                rows += per_rank[rank][step * accum + m]
        batches.append(rows)
    return batches


@pytest.mark.parametrize(("world", "accum"), [(2, 1), (1, 4), (2, 2), (4, 1)])
def test_same_global_batches_on_any_world_size_and_accumulation(world, accum):
    reference = _global_batches(50, 8, 1, 1)
    assert len(reference) == 50 // 8  # the remainder is dropped: an epoch is a whole number of optimizer steps
    assert _global_batches(50, 8, world, accum) == reference
    flat = [i for batch in reference for i in batch]
    assert len(set(flat)) == len(flat)  # no example twice within an epoch


def test_resumes_at_the_optimizer_step_and_rolls_over_epochs():
    full = _global_batches(40, 8, 2, 2)  # 5 steps per epoch
    assert _global_batches(40, 8, 2, 2, steps_done=3) == full[3:]
    second_epoch = _global_batches(40, 8, 2, 2, steps_done=5)
    assert len(second_epoch) == 5 and second_epoch != full  # epoch 1 has its own permutation
    assert _global_batches(40, 8, 2, 2, steps_done=7) == second_epoch[2:]


def test_rejects_a_dataset_smaller_than_one_global_batch_and_indivisible_batches():
    data = TensorDataset(torch.arange(10))
    with pytest.raises(ValueError, match="fewer than one global batch"):
        GlobalBatchSampler(data, global_batch=16)
    with pytest.raises(ValueError, match="not divisible"):
        GlobalBatchSampler(data, global_batch=6, num_replicas=4)


def test_mdm_draws_do_not_depend_on_world_size_or_accumulation():
    """Times and mask uniforms each example gets are the same whether the global batch is split or not."""
    from lightning_modules.mdm import MDMModule

    backbone = {"d_model": 16, "n_layers": 1, "n_heads": 2, "cond_dim": 8}
    module = MDMModule(data_vocab_size=4, seq_len=6, backbone=backbone, optim={}, seed=5)

    def draws(world, accum):
        local = 12 // (world * accum)
        times, uniforms = [], []
        for rank in range(world):
            for micro in range(accum):
                module._trainer = SimpleNamespace(
                    world_size=world, accumulate_grad_batches=accum, global_step=9, global_rank=rank
                )
                times.append(module.sample_times(local, batch_idx=micro))
                uniforms.append(module.global_rand((local, 6), batch_idx=micro, stream=1))
        return torch.cat(times), torch.cat(uniforms)

    t1, u1 = draws(1, 1)
    for world, accum in [(2, 1), (3, 2), (1, 4)]:
        t, u = draws(world, accum)
        assert torch.equal(t, t1) and torch.equal(u, u1), (world, accum)
