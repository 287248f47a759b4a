"""The performance benchmarks run end to end in a tiny mode and print their ratio lines (no timing assertions)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RATIO = r"\d+\.\d{3}"
COMMANDS = {
    "throughput": [
        "benchmarks/throughput.py",
        *("--batch 2 --seq-len 8 --vocab 200 --steps 3 --warmup 1 --reps 1 --memory".split()),
        *("--methods mdm fmlm_plus mlfm fmlm_plus_dense fmlm_plus_onehot fmlm_plus_fused".split()),
    ],
    "sampler_overhead": [
        "benchmarks/sampler_overhead.py",
        *("--batch 2 --seq-len 12 --vocab 6 --nfe 2 --reps 1".split()),
    ],
}


def run_benchmark(script: str, args: str) -> subprocess.CompletedProcess:
    """benchmarks/``script`` with ``args`` in its own process on one thread, offline; its output captured."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args.split()],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture(scope="module")
def outputs() -> dict[str, subprocess.CompletedProcess]:
    """Both scripts, started together (two processes: the imports dominate), each on one thread."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    procs = {
        name: subprocess.Popen(
            [sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name, args in COMMANDS.items()
    }
    done = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done


def test_throughput_prints_lightning_vs_bare_and_fmlm_cost_ratios(outputs):
    run = outputs["throughput"]
    assert run.returncode == 0, run.stderr[-3000:]
    for method in ("mdm", "fmlm_plus", "mlfm"):
        assert re.search(rf"^ratio lightning/bare \[{method}\]: {RATIO} ", run.stdout, re.M), run.stdout
    for flow in ("fmlm_plus", "fmlm_plus_dense", "fmlm_plus_onehot", "fmlm_plus_fused"):  # defaults; earlier paths
        assert re.search(
            rf"^ratio {flow}/mdm step cost: {RATIO} \(bare loop\), {RATIO} \(Lightning\)", run.stdout, re.M
        )
    assert "theory 1.333" in run.stdout  # batch 2: one diagonal row, one off-diagonal row → 1 + 2·(1/2)/3
    for flow in ("fmlm_plus", "fmlm_plus_dense", "fmlm_plus_onehot", "fmlm_plus_fused"):  # the FLOP-counted limit
        limit = re.search(
            rf"FLOPs of one step \(FlopCounterMode, forward \+ backward\): {flow} / mdm = ({RATIO})", run.stdout
        )
        assert limit and float(limit.group(1)) > 1.0, run.stdout  # the teachers' passes add to the student's
    for method in ("mdm", "fmlm_plus"):  # --memory: one training step's peak
        assert re.search(rf"^peak memory of one training step \[{method}\]: \d+\.\d MiB", run.stdout, re.M)


def test_step_flops_count_the_backward():
    """One MDM step's matrix-product FLOPs are ≈ 3× its loss's forward (the backward's two products per forward
    product; the input embedding is a lookup, its attention's backward counted by torch as such)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch
    from common import build_module, matmul_flops, synthetic_batch
    from throughput import loss_function, step_flops

    module = build_module("mdm", backbone="tiny", vocab=200, seq_len=8, seed=0)
    batch = synthetic_batch(4, 8, 200, seed=0)
    loss = loss_function("mdm", module)
    step = step_flops(module, loss, batch, precision="32-true", device=torch.device("cpu"))
    with torch.no_grad():
        forward = matmul_flops(lambda: loss(batch, 0))
    assert 2.9 < step / forward <= 3.0
    assert all(p.grad is None for p in module.parameters())  # the count leaves no gradients behind


def test_sampler_overhead_prints_a_ratio_per_sampler(outputs):
    run = outputs["sampler_overhead"]
    assert run.returncode == 0, run.stderr[-3000:]
    names = sorted(p.stem for p in (ROOT / "conf" / "sampler").glob("*.yaml") if p.stem != "ar")
    variants = ["pr_n2", "mlfm_ccfg_otp", "pr_onehot", "a_priori_onehot", "flow_map_onehot", "pr_dense"]
    variants += ["a_priori_dense", "block_dense", "confidence_dense"]  # the full log δ; the dense ranking
    variants += ["flow_map_dense", "flm_euler_dense", "pr_n2_dense", "mlfm_dense", "mlfm_ccfg_otp_dense"]
    for name in [*names, *variants, "confidence_full", "ancestral_full"]:
        assert re.search(rf"^ratio sampler/\(NFE × forward\) \[{name}\]: {RATIO} ", run.stdout, re.M), run.stdout
    assert re.search(r"^ratio sampler/\(NFE × forward\) \[ar\]: n/a", run.stdout, re.M)
    assert "matmul FLOPs / (NFE × forward) |" in run.stdout  # the limit where a step needs a |V|×d product
    assert "ms / MDM forward" in run.stdout  # the denominator: the network's own cost, an MDM forward on ids
    assert re.search(rf"^ratio flow forward/MDM forward: {RATIO} \(states over the vocabulary", run.stdout, re.M)


def test_sampler_overhead_fits_semi_ar_blocks_to_the_budget():
    """At a length whose default blocks outnumber the budget (72 positions, blocks of 32, NFE 2), the semi-AR rows run
    with the fewest blocks the budget allows (as the block sampler's), instead of stopping the benchmark (the papers'
    shape, 1 024 positions at NFE 4, stopped it)."""
    run = run_benchmark(
        "sampler_overhead.py", "--batch 1 --seq-len 72 --vocab 6 --nfe 2 --reps 1 --samplers semi_ar semi_ar_t1"
    )
    assert run.returncode == 0, run.stderr[-3000:]
    for name in ("semi_ar", "semi_ar_t1"):
        assert f"note: {name}'s block_length 36 here, so that 72 positions fit 2 NFE" in run.stdout, run.stdout
        assert re.search(rf"^\| {name} \| mdm \| 2 \|", run.stdout, re.M), run.stdout  # two blocks, one call each


def test_gpu_check_fails_fast_without_cuda():
    """Without a CUDA device the GPU script stops at once with a clear message (before importing the suite)."""
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    run = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert run.returncode != 0
    assert "no CUDA device" in run.stdout + run.stderr


def test_likelihood_rows_prints_item_rows_shorter_than_max_length():
    """benchmarks/likelihood_rows.py at a tiny size (its own process, one thread): the table's columns for both row
    layouts, and the positions counted on the network: item rows run (mc_samples + 1 greedy) × the mean item length
    positions a request, strictly fewer than max_length rows' (mc_samples + 1) × max_length; the limit is their
    ratio, and the FLOP limit above it (the attention)."""
    args = "--items 6 --min-len 10 --max-len 30 --max-length 64 --mc-samples 4 --width 32 --layers 1 --reps 1"
    run = run_benchmark("likelihood_rows.py", args)
    assert run.returncode == 0, run.stderr[-3000:]
    header = "| rows | s / pass | requests / s | positions / request | network calls | speed-up | limit | speed-up / "
    assert header in run.stdout, run.stdout
    number = r"\d+\.\d+"
    for rows in ("max_length", "item"):
        cells = rf"^\| {rows} \| {number} \| {number} \| {number} \| \d+ \| {number}× \| {number}× \| {RATIO} \| "
        cells += rf"{number}× \| {RATIO} \|$"
        assert re.search(cells, run.stdout, re.M), run.stdout
    mean = float(re.search(rf"^mean item length: ({RATIO}) tokens; max_length 64$", run.stdout, re.M).group(1))
    positions = re.search(rf"^row positions per request: item ({RATIO}), max_length ({RATIO})$", run.stdout, re.M)
    item, full = float(positions.group(1)), float(positions.group(2))
    assert item < full, run.stdout  # item rows strictly shorter
    assert full == 5 * 64 and item == pytest.approx(5 * mean, abs=0.01)  # 4 Monte-Carlo rows + the greedy call
    line = rf"^ratio item/max_length requests per second: ({RATIO}) \(limit ({RATIO}): {RATIO} of it; "
    line += rf"FLOP limit ({RATIO})"
    ratio = re.search(line, run.stdout, re.M)
    assert ratio and float(ratio.group(2)) == pytest.approx(64 / mean, abs=2e-3), run.stdout
    assert float(ratio.group(3)) > float(ratio.group(2))  # the attention, quadratic in the row, favours short rows


def test_cpu_bf16_prints_the_rule_against_torchs_bf16_and_float32():
    """benchmarks/cpu_bf16.py on a tiny batch: on a CPU without bf16 kernels its three loops, each over float32 and
    over the FLOP limit, and the losses' distances; with the kernels, one line saying there is nothing to compare."""
    from flowlm.ops.bf16_products import native_bf16_kernels

    run = run_benchmark("cpu_bf16.py", "--reps 1 --steps 1 --torch-steps 1 --warmup 1 data.batch_size=8")
    assert run.returncode == 0, run.stderr[-3000:]
    if native_bf16_kernels():
        assert "this CPU has bf16 kernels" in run.stdout
        return
    for label in ("float32 (32-true)", "bf16-mixed, products by float32 BLAS", "bf16-mixed, torch's own bf16"):
        assert re.search(
            rf"\| {re.escape(label)}[^|]* \| \d+\.\d{{4}} \| \d+\.\d\d \| \d+\.\d\d \| \d+\.\d{{5}} \|", run.stdout
        ), (
            label,
            run.stdout,
        )
    assert re.search(r"the rule's loss against torch's bf16: \d\.\de[+-]\d\d relative", run.stdout), run.stdout


def test_sweep_step_compare_prints_each_models_step_against_the_first(capsys):
    """benchmarks/sweep_step.py --compare: one row per model in the order named, its tokens a step, its FLOPs and its
    time each over the first model's (what splits a campaign's plan): the unconditional board's 36 tokens a row cost
    less than the conditional's 84 at one batch size. In this process (the imports are the script's cost)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import sweep_step

    argv = "--compare sudoku_mdm_easy,sudoku_mdm_uncond --reps 1 --bare-steps 1 --warmup 1 "
    argv += "data.batch_size=8 data.num_train=64 data.num_val=16"
    sweep_step.compare(sweep_step.parser().parse_args(argv.split()))
    out = capsys.readouterr().out
    number = r"(\d+\.\d+)"
    rows = re.findall(
        rf"^\| (sudoku_\w+) \| 8 × (\d+) \| {number} \| {number} \| {number} \| {number} \| {number} \|$", out, re.M
    )
    assert [(name, length) for name, length, *_ in rows] == [("sudoku_mdm_easy", "84"), ("sudoku_mdm_uncond", "36")]
    (_, _, gflop_a, s_a, time_a, flops_a, _), (_, _, gflop_b, s_b, time_b, flops_b, _) = rows
    assert float(time_a) == float(flops_a) == 1.0
    assert float(flops_b) == pytest.approx(float(gflop_b) / float(gflop_a), abs=0.06)
    assert float(time_b) == pytest.approx(float(s_b) / float(s_a), abs=0.06)
    assert 0.2 < float(flops_b) < 0.6, out  # 36 against 84 tokens a row; attention's share is quadratic
