"""The CPU trainer's precision follows the hardware: bf16 autocast only where the CPU has bf16 kernels (emulated bf16
is 7–10× slower per training step on an AVX2-only CPU), an explicit ``trainer.precision`` still wins."""

import pytest
import torch
from conftest import compose_config

from runners.resolvers import cpu_precision


@pytest.mark.parametrize(("native", "expected"), [(True, "bf16-mixed"), (False, "32-true")])
def test_cpu_precision_follows_bf16_support(monkeypatch, native, expected):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: native)
    assert cpu_precision() == expected
    cfg = compose_config(overrides=["experiment=sudoku_mdm_easy", "scale=cpu"])
    assert cfg.trainer.accelerator == "cpu" and cfg.trainer.precision == expected


def test_cpu_precision_without_the_query_is_float32(monkeypatch):
    def missing():
        raise AttributeError("no such op")

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", missing)
    assert cpu_precision() == "32-true"


def test_an_explicit_precision_wins(monkeypatch):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    cfg = compose_config(overrides=["experiment=sudoku_mdm_easy", "scale=cpu", "trainer.precision=bf16-mixed"])
    assert cfg.trainer.precision == "bf16-mixed"
