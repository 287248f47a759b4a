"""bf16 matrix products by float32 BLAS, for a CPU without bf16 kernels (AVX2 only).

Under bf16 autocast a matrix product takes bf16 operands and returns bf16; oneDNN's bf16 kernels (AVX-512 BF16, AMX)
multiply the bf16 values in float32 and accumulate in float32. Where the CPU has no such kernels torch computes the
bf16 products in a generic loop: a 1024² matmul ran at 1.0 GFLOP/s in bf16 against 95.6 in float32 (2 threads, an
AVX2 AMD EPYC, 2026-12-06), and a `tiny` DiT training step 11× slower than in float32. The product of two bf16
values is exact in float32 (8 + 8 significant bits ≤ 24), so

    bf16(float32_matmul(float32(bf16(a)), float32(bf16(b))))

is the arithmetic of a native bf16 kernel: the same numbers up to the order of the float32 accumulation (as between
any two BLAS libraries). ``bf16_products_in_float32`` registers that rule as CPU autocast's kernel of the matrix
products that autocast casts to bf16 (``PRODUCTS``); torch's own rule still casts every other op, and the compiled
graphs trace the rule like any decomposition. Measured on that CPU (benchmarks/cpu_bf16.py;
docs/performance.md#cpu-precision): the tables' training step 9.0× faster than torch's bf16 loop, 1.18× float32's;
checked in tests/lightning_modules/test_cpu_precision.py.

    with bf16_products_in_float32():      # or install_bf16_products() once for the process (runners)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(batch)
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch

# The matrix products of CPU autocast's lower-precision list (torch/csrc/autograd/autocast_mode.cpp) that the DiTs
# run; attention without a soft cap (SDPA), convolutions and addbmm (its bf16 kernel rounds each batch's sum) keep
# torch's rule: their bf16 kernels are not the exact-product rule above, so no float32 stand-in is "the same numbers".
PRODUCTS = ("mm", "bmm", "addmm", "baddbmm", "linear", "matmul")

_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
_installed: torch.library.Library | None = None  # the process-wide registration (install_bf16_products)


def _eligible(value: object) -> bool:
    """What autocast casts: a floating-point tensor other than float64."""
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64


def _map(fn, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``fn`` applied to what autocast casts among the arguments."""
    cast = lambda v: fn(v) if _eligible(v) else v  # noqa: E731
    return tuple(map(cast, args)), {k: cast(v) for k, v in kwargs.items()}


def _kernel(op):
    """CPU autocast's kernel of ``op``: under bf16 the rule of the module docstring; under another autocast dtype
    (float16), or beside a float64 operand, torch's own rule (cast what autocast casts, then the op)."""

    def kernel(*args, **kwargs):
        dtype = torch.get_autocast_dtype("cpu")
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            double = any(isinstance(v, torch.Tensor) and v.dtype == torch.float64 for v in (*args, *kwargs.values()))
            if dtype != torch.bfloat16 or double:
                args, kwargs = _map(lambda t: t.to(dtype), args, kwargs)
                return op(*args, **kwargs)
            args, kwargs = _map(lambda t: t.to(torch.bfloat16).float(), args, kwargs)  # the bf16 operands, exactly
            return op(*args, **kwargs).to(torch.bfloat16)  # float32 products and sums, rounded as a bf16 kernel's

    return kernel


def _register() -> torch.library.Library:
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # torch warns that autocast's own kernel is overridden: what is meant here
        warnings.filterwarnings("ignore", message="(?s).*overriding a previously registered kernel")
        for name in PRODUCTS:
            library.impl(name, _kernel(getattr(torch.ops.aten, name).default), "AutocastCPU")
    return library


@contextlib.contextmanager
def bf16_products_in_float32() -> Iterator[None]:
    """CPU autocast's bf16 matrix products by float32 BLAS within the block (torch's kernels after it); inside a
    process that installed them for good (``install_bf16_products``) nothing changes."""
    if _installed is not None:
        yield
        return
    library = _register()
    try:
        yield
    finally:
        library._destroy()


def install_bf16_products() -> bool:
    """CPU autocast's bf16 matrix products by float32 BLAS for the rest of the process (idempotent). Returns whether
    this call installed them."""
    global _installed
    if _installed is not None:
        return False
    _installed = _register()
    return True


def native_bf16_kernels() -> bool:
    """Whether this CPU computes bf16 products natively (oneDNN's bf16 kernels: AVX-512 BF16 or AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without the query: no native kernels known
        return False
