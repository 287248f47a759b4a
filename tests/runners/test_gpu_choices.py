"""GPU choices made for the GPU, tested without one (issue 51 item 3): a trainer's precision comes from its
accelerator, not from the host CPU; flowlm-eval and MT-Bench take the GPU (in bf16) where CUDA is available and say
so when they fall back to the CPU; TF32 is on wherever train, eval, lm-eval or MT-Bench run on CUDA. CUDA's
presence is monkeypatched (``torch.cuda.is_available``), the CPU's bf16 support too (the resolvers' query)."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import compose_config

import runners.common  # noqa: F401  (registers the ${flowlm.*} resolvers and eval's data/from_checkpoint)
import runners.resolvers as resolvers
from runners.common import gpu_choices, use_tf32

TRAIN = ["experiment=sudoku_mdm_uncond", "scale=cpu"]


@pytest.fixture
def cpu_without_bf16(monkeypatch):
    """A host CPU without bf16 kernels (an AVX2-only EPYC, a DGX A100's): the CPU resolver answers 32-true."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert resolvers.cpu_precision() == "32-true"
    monkeypatch.setattr(resolvers, "_said", set())  # each test sees its own fallback lines


def with_cuda(monkeypatch, present: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: present)


@pytest.fixture
def matmul_flags():
    """TF32 off before the test (torch's defaults: matmul `highest`, cuDNN TF32 on), restored after."""
    saved = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cudnn.allow_tf32 = saved[1]


def tf32_on() -> bool:
    matmul = torch.get_float32_matmul_precision() == "high" and torch.backends.cuda.matmul.allow_tf32
    return matmul and torch.backends.cudnn.allow_tf32


def tf32_untouched() -> bool:
    return torch.get_float32_matmul_precision() == "highest" and not torch.backends.cudnn.allow_tf32


@pytest.mark.parametrize(
    ("trainer", "accelerator", "precision"),
    [("cpu", "cpu", "32-true"), ("gpu", "gpu", "bf16-mixed"), ("ddp", "auto", "bf16-mixed")]
    + [("fsdp2", "auto", "bf16-mixed"), ("auto", "gpu", "bf16-mixed")],
)
def test_every_gpu_trainer_composes_to_bf16_on_a_host_cpu_without_bf16(
    cpu_without_bf16, monkeypatch, trainer, accelerator, precision
):
    with_cuda(monkeypatch, True)
    cfg = compose_config(overrides=[*TRAIN, f"trainer={trainer}"])
    assert (cfg.trainer.accelerator, cfg.trainer.precision) == (accelerator, precision)


@pytest.mark.parametrize("trainer", ["ddp", "fsdp2", "auto"])
def test_without_cuda_the_auto_trainers_run_cpu_processes_at_the_cpus_precision(cpu_without_bf16, monkeypatch, trainer):
    with_cuda(monkeypatch, False)
    assert compose_config(overrides=[*TRAIN, f"trainer={trainer}"]).trainer.precision == "32-true"
    with_cuda(monkeypatch, True)  # CPU processes asked for on a GPU machine (what the CPU tests run)
    cfg = compose_config(overrides=[*TRAIN, f"trainer={trainer}", "trainer.accelerator=cpu"])
    assert cfg.trainer.precision == "32-true"
    forced = compose_config(overrides=[*TRAIN, f"trainer={trainer}", "trainer.precision=32-true"])
    assert forced.trainer.precision == "32-true"  # an explicit precision still wins


def test_flowlm_eval_takes_the_gpu_in_bf16_where_there_is_one(cpu_without_bf16, monkeypatch, caplog):
    with_cuda(monkeypatch, True)
    with caplog.at_level(logging.WARNING):
        cfg = compose_config("eval", ["ckpt_path=x.ckpt"])
        assert (cfg.trainer.accelerator, cfg.trainer.precision, cfg.trainer.devices) == ("gpu", "bf16-mixed", 1)
    assert "CPU" not in caplog.text


def test_flowlm_eval_falls_back_to_the_cpu_in_one_log_line(cpu_without_bf16, monkeypatch, caplog):
    with_cuda(monkeypatch, False)
    with caplog.at_level(logging.WARNING):
        cfg = compose_config("eval", ["ckpt_path=x.ckpt"])
        assert (cfg.trainer.accelerator, cfg.trainer.precision) == ("cpu", "32-true")
        assert cfg.trainer.accelerator == "cpu"  # read again: still one line
    lines = [r.getMessage() for r in caplog.records if "no CUDA device" in r.getMessage()]
    assert len(lines) == 1 and "trainer=auto runs on the CPU" in lines[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert compose_config("eval", ["ckpt_path=x.ckpt", "trainer=cpu"]).trainer.accelerator == "cpu"
    assert "no CUDA device" not in caplog.text  # chosen, not fallen back to


def test_mt_bench_generates_in_bf16_on_the_gpu_and_says_when_it_falls_back(monkeypatch, caplog):
    monkeypatch.setattr(resolvers, "_said", set())
    with_cuda(monkeypatch, True)
    assert compose_config("mt_bench").generate.dtype == "bfloat16"
    assert compose_config("mt_bench", ["generate.device=cpu"]).generate.dtype == "float32"
    assert compose_config("mt_bench", ["generate.dtype=float16"]).generate.dtype == "float16"
    with_cuda(monkeypatch, False)
    with caplog.at_level(logging.WARNING):
        assert compose_config("mt_bench").generate.dtype == "float32"
    assert "flowlm-mt-bench: no CUDA device here, generating on the CPU in float32" in caplog.text


@pytest.mark.parametrize(("trainer", "cuda", "expected"), [("gpu", True, True), ("ddp", True, True)])
def test_tf32_is_on_when_the_trainer_runs_on_cuda(matmul_flags, monkeypatch, trainer, cuda, expected):
    with_cuda(monkeypatch, cuda)
    assert gpu_choices(compose_config(overrides=[*TRAIN, f"trainer={trainer}"])) is expected
    assert tf32_on()


@pytest.mark.parametrize(
    ("trainer", "cuda", "extra"),
    [("cpu", True, []), ("ddp", False, []), ("auto", False, []), ("gpu", True, ["tf32=false"])],
)
def test_tf32_is_left_alone_on_the_cpu_and_when_turned_off(matmul_flags, monkeypatch, trainer, cuda, extra):
    with_cuda(monkeypatch, cuda)
    assert gpu_choices(compose_config(overrides=[*TRAIN, f"trainer={trainer}", *extra])) is False
    assert tf32_untouched()


def test_the_environment_switch_turns_tf32_off_for_lm_eval_and_mt_bench(matmul_flags, monkeypatch):
    monkeypatch.setenv("FLOWLM_TF32", "0")
    assert use_tf32("cuda") is False and tf32_untouched()
    monkeypatch.delenv("FLOWLM_TF32")
    assert use_tf32("cpu") is False and tf32_untouched()
    assert use_tf32("cuda") is True and tf32_on()


def test_flowlm_train_sets_tf32_on_cuda_before_anything_else(matmul_flags, monkeypatch, tmp_path):
    """The runner's own call: a run refused right after (a bad run name) has already set TF32 on CUDA."""
    from runners.train import train

    with_cuda(monkeypatch, True)
    cfg = compose_config(overrides=[*TRAIN, "trainer=gpu", f"paths.root={tmp_path}", "run_name=../out", "logger=none"])
    with pytest.raises(ValueError, match="run_name"):
        train(cfg)
    assert tf32_on()


def test_flowlm_train_on_the_cpu_leaves_tf32_alone(matmul_flags, monkeypatch, tmp_path):
    from runners.train import train

    with_cuda(monkeypatch, True)
    cfg = compose_config(overrides=[*TRAIN, "trainer=cpu", f"paths.root={tmp_path}", "run_name=../out", "logger=none"])
    with pytest.raises(ValueError, match="run_name"):
        train(cfg)
    assert tf32_untouched()


def test_flowlm_eval_sets_tf32_on_cuda_before_reading_the_checkpoint(matmul_flags, monkeypatch, tmp_path):
    from runners.evaluate import evaluate

    with_cuda(monkeypatch, True)
    cfg = compose_config("eval", [f"ckpt_path={tmp_path / 'missing.ckpt'}", f"paths.root={tmp_path}", "logger=none"])
    with pytest.raises(FileNotFoundError):
        evaluate(cfg)
    assert tf32_on()


def test_lm_eval_and_mt_bench_set_tf32_on_cuda_before_reading_the_checkpoint(matmul_flags, monkeypatch, tmp_path):
    """MT-Bench generates through the same lm-eval model class (runners/mt_bench.py PASSED_TO_FLOWLM)."""
    from runners.lm_harness import FlowLM

    with_cuda(monkeypatch, True)
    with pytest.raises(FileNotFoundError):
        FlowLM(checkpoint=str(tmp_path / "missing.ckpt"))
    assert tf32_on()
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    with pytest.raises(FileNotFoundError):
        FlowLM(checkpoint=str(tmp_path / "missing.ckpt"), device="cpu")
    assert tf32_untouched()
