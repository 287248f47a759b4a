"""Measuring in the performance benchmarks (throughput.py, sampler_overhead.py, gpu_check.py): timers read after the
device is idle, medians, and the peak memory and matrix-product FLOPs of one call."""

from __future__ import annotations

import statistics
import time


def sync(device) -> None:
    """Wait for queued device work (CUDA kernels run asynchronously), so a timer reads finished work."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def now(device) -> float:
    """perf_counter after the device is idle."""
    sync(device)
    return time.perf_counter()


def clock(device) -> tuple[float, float]:
    """(wall, process CPU) seconds after the device is idle. On a shared CPU the process's CPU time is the steadier
    measure of the work done (other processes stretch the wall time, not it); on a GPU only the wall time means
    anything."""
    sync(device)
    return time.perf_counter(), time.process_time()


def elapsed(start: tuple[float, float], device) -> tuple[float, float]:
    """(wall, CPU) seconds since ``start`` (a ``clock`` reading)."""
    end = clock(device)
    return end[0] - start[0], end[1] - start[1]


def median(values: list[float]) -> float:
    """Median (robust to the outliers of a shared, noisy machine)."""
    return statistics.median(values)


def matmul_flops(call) -> float:
    """The matrix-product FLOPs of one call, its backward included when the call runs one (torch's FlopCounterMode:
    mm, addmm, bmm, attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        call()
    return float(counter.get_total_flops())


def peak_memory(call, device) -> float:
    """Bytes a call adds at its peak over what the process held before it: CUDA's peak allocated memory, or on a
    CPU the process's peak resident set (VmHWM, reset first through /proc/self/clear_refs)."""
    import gc
    from pathlib import Path

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        call()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before

    def status(key: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"{key} not in /proc/self/status")

    try:  # hand freed heap memory back first, so the call's allocations show as growth
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    before = status("VmRSS")
    call()
    return status("VmHWM") - before
