"""The meta-device stand-in for CUDA (tests/gpu_readiness/meta_cuda.py) refuses what CUDA refuses and counts what it
should, on ops written out by hand."""

from __future__ import annotations

import torch

from tests.gpu_readiness.meta_cuda import META, HostReads, MetaCuda, meta_generator


def test_the_stand_in_refuses_what_cuda_refuses():
    x = torch.ones(4, 3, device=META)
    with MetaCuda() as run:
        _ = x + torch.ones(3)  # a host tensor in a device op
        _ = x[torch.tensor([0, 2])]  # a host index tensor on a device tensor
        _ = torch.rand(4, device=META, generator=torch.Generator().manual_seed(0))  # a CPU generator, device draw
        _ = torch.rand(4, generator=meta_generator(0))  # a device generator for a host draw
    assert len(run.errors) == 4, run.errors
    assert all("test_meta_cuda_harness.py" in e for e in run.errors)
    with MetaCuda() as clean:
        _ = x + torch.tensor(2.0)  # a 0-dim host scalar: CUDA takes it
        _ = x.to("meta"), torch.ones(3).to(META)  # copies move data on purpose
        _ = torch.rand(4, device=META, generator=meta_generator(0))
        _ = torch.Generator(device=META).manual_seed(1)  # inside the mode, the device generator exists
        _ = x[torch.tensor([0, 2], device=META)]
        _ = torch.ones(3)[torch.tensor([0, 1])].sum().item()  # host work: nothing to count
    assert clean.errors == [] and clean.sync_count == 0, (clean.errors, clean.sync_where)


def test_the_stand_in_counts_host_syncs_and_launches():
    x, mask = torch.ones(6, device=META), torch.ones(6, dtype=torch.bool, device=META)
    with MetaCuda() as run:
        _ = x.sum().item()
        _ = bool(mask.any())
        _ = mask.nonzero()
        _ = x[mask]
        _ = x.cpu()
        _ = x.tolist()
    assert run.syncs == {"_local_scalar_dense": 2, "nonzero": 1, "index": 1, "_to_copy (device→host)": 2}, run.syncs
    with MetaCuda() as launches:
        y = x.view(2, 3).t().expand(2, 3, 2)[0]  # views: no kernel
        _ = (y * 2).exp()  # two kernels
    assert launches.launches == {"mul": 1, "exp": 1}, launches.launches


def test_a_cpu_twin_replays_its_reads_on_meta():
    def call(device):
        v = torch.tensor([0.0, 3.0, 0.0, 5.0], device="cpu").to(device)
        n = int((v > 0).sum())
        return n, v[v > 0].shape[0]

    with HostReads() as reads:
        assert call(torch.device("cpu")) == (2, 2)
    with MetaCuda(replay=reads) as run:
        assert call(META) == (2, 2)  # no values on meta: the twin's read and shape
    assert run.sync_count == 2
