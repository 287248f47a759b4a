"""A first CUDA run rehearsed on PyTorch's ``meta`` device (docs/gpu.md): ``MetaCuda`` runs code whose model, inputs
and generators sit on "meta" where a GPU run puts them on "cuda", refuses what CUDA dispatch refuses, and counts what
would make the host wait for the device and the kernels the device would launch.

Refused (``MetaCuda.errors``, each with the project's file and line):
- tensor operands on two device types in one op (a 0-dim CPU tensor is a scalar CUDA accepts; copies move data
  between devices on purpose and are exempt) — a CPU index tensor indexing a device tensor included: CUDA would copy
  the indices over at every call, and indexing a host tensor by device indices CUDA refuses outright;
- a generator of another device than the draw's (CUDA: "Expected a 'cuda' device type for generator"): a draw on
  "meta" needs ``meta_generator()`` (``torch.Generator(device="meta")`` does not exist: inside the mode it returns
  one), a draw on the CPU a CPU generator.

Counted: ``syncs`` (op → project line): reading a device scalar (``.item()``, ``bool``/``int``/``float`` of a tensor),
data-dependent shapes (``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``, ``repeat_interleave``
without ``output_size``) and device→host copies (``.cpu()``, ``.tolist()``, ``.numpy()``) of device data; host data
read on the host costs nothing and is not counted. ``launches``: ops with a device operand or result that are not
views or metadata (``view``, ``expand``, ``select``, ``slice``, ``detach``, ``empty``, …), roughly one CUDA kernel each.

Meta tensors hold no values, so a sync gets a stand-in result (``fill`` for a scalar, every element for a
data-dependent shape, zeros for a copy): control flow that depends on device values runs one way only. The mode
checks placement and counts; results mean nothing. What it cannot see: kernels fused by ``torch.compile`` or
FlexAttention (``q.is_cuda`` is False on meta: the SDPA / written paths run), autocast's casts on meta (meta tensors
have no autocast key), timings and memory (``memory.py``).
"""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

META = torch.device("meta")
_ROOT = str(Path(__file__).resolve().parents[2]) + "/"

# Ops that move data between devices on purpose: mixed operands are their job (a D2H copy is counted as a sync).
_COPIES = {"_to_copy", "copy_", "_copy_from", "_copy_from_and_resize", "to", "lift_fresh", "lift_fresh_copy"}
# Ops that only allocate or describe memory: no kernel.
_NO_KERNEL = {"detach", "alias", "empty", "empty_like", "empty_strided", "set_", "resize_", "_reshape_alias"}
_NO_KERNEL |= {"_unsafe_view", "lift_fresh", "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel"}
_DATA_SHAPED = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive"}
_BOOL_INDEX = {"index", "index_put", "index_put_", "_index_put_impl_"}


class DeviceError(AssertionError):
    """An op a CUDA run would refuse (raised only by ``MetaCuda(strict=True)``; else collected in ``errors``)."""


class MetaGenerator(torch.Generator):
    """A CPU generator standing in for one on "meta": it reports ``device`` meta, so a draw on the device checks."""

    @property
    def device(self) -> torch.device:  # noqa: D102
        return META


def meta_generator(seed: int = 0) -> MetaGenerator:
    """A seeded stand-in for ``torch.Generator(device="meta").manual_seed(seed)``."""
    gen = MetaGenerator()
    gen.manual_seed(seed)
    return gen


def _caller(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame of the project (not torch, not this file, not a package installed in a virtualenv that
    lives inside the checkout, as make venv's .venv does): where a report points."""
    for frame in reversed(stack):
        if frame.filename.startswith(_ROOT) and frame.filename != __file__ and "-packages" not in frame.filename:
            return f"{frame.filename[len(_ROOT) :]}:{frame.lineno}"
    return "?"


def _device_type(t: torch.Tensor) -> str:
    return t.device.type


class _Generators(TorchFunctionMode):
    """The generator check: at the Python level the generator object a draw is given is still the caller's (the
    dispatcher hands on a new wrapper without the stand-in's device)."""

    def __init__(self, owner: MetaCuda) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        gens = [g for g in (*args, *kwargs.values()) if isinstance(g, torch.Generator)]
        if gens:
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            where = {_device_type(t) for t in (outs or ins)}
            for gen in gens:
                if where and gen.device.type not in where:
                    self.owner.refuse(
                        f"a {gen.device.type} generator drives a draw on {'/'.join(sorted(where))} "
                        f"({getattr(func, '__name__', func)})"
                    )
        return out


class MetaCuda(TorchDispatchMode):
    """``with MetaCuda() as run: ...`` then ``run.errors``, ``run.syncs`` (Counter op → count), ``run.sync_where``,
    ``run.launches``. A sync's stand-in result is what ``replay`` (a ``HostReads`` of the same call on the CPU)
    read at the same line, in order; without one, ``fill`` for a scalar and every element for a data-dependent
    shape. ``strict`` raises at the first error."""

    def __init__(self, *, fill: int | float = 1, replay: HostReads | None = None, strict: bool = False) -> None:
        super().__init__()
        self.fill, self.strict = fill, strict
        self.replay = {site: deque(values) for site, values in (replay.values if replay else {}).items()}
        self.errors: list[str] = []
        self.syncs: Counter[str] = Counter()
        self.sync_where: list[str] = []
        self.launches: Counter[str] = Counter()
        self._stack = contextlib.ExitStack()

    @property
    def sync_count(self) -> int:
        """Host syncs seen."""
        return sum(self.syncs.values())

    @property
    def launch_count(self) -> int:
        """Kernel launches seen."""
        return sum(self.launches.values())

    def refuse(self, message: str) -> None:
        """Record (or raise) an op CUDA would refuse, with the project line that made it."""
        message = f"{message} at {_caller(traceback.extract_stack()[:-1])}"
        if self.strict:
            raise DeviceError(message)
        self.errors.append(message)

    def _sync(self, name: str) -> str:
        site = _caller(traceback.extract_stack()[:-1])
        self.syncs[name] += 1
        self.sync_where.append(f"{name} at {site}")
        return site

    def _replayed(self, site: str, default):
        """The value the CPU twin read at ``site`` (in order), else ``default``."""
        queue = self.replay.get(site)
        return queue.popleft() if queue else default

    def __enter__(self) -> MetaCuda:
        self._stack.enter_context(_meta_aware_torch())
        self._stack.enter_context(_Generators(self))
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._stack.close()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_device = [t for t in tensors if t.device.type == "meta"]
        if not on_device and not _makes_device_tensor(kwargs):
            return func(*args, **kwargs)  # host work: CUDA never sees it
        if name in _COPIES:
            return self._copy(func, name, args, kwargs, tensors)
        hosts = [t for t in tensors if t.device.type != "meta" and t.dim() > 0]
        if hosts:
            shapes = ", ".join(f"{t.device.type} {tuple(t.shape)}" for t in hosts)
            self.refuse(f"{name} mixes devices: meta operands with {shapes}")
            kwargs = {k: _to_meta(v) for k, v in kwargs.items()}
            args = tuple(_to_meta(a) for a in args)
        if name == "_local_scalar_dense":
            site = self._sync(name)
            return _scalar(args[0].dtype, self._replayed(site, self.fill))
        if _data_shaped(name, args, kwargs):
            site = self._sync(name)
            self.launches[name] += 1
            return _stand_in(func, name, args, kwargs, self._replayed(site, None))
        if not func.is_view and name not in _NO_KERNEL:
            self.launches[name] += 1
        return func(*args, **kwargs)

    def _copy(self, func, name, args, kwargs, tensors):
        """A copy between devices: device→host is a sync (zeros come back), host→device a launch (a DMA)."""
        to_host = (name in {"_to_copy", "to"} and _target(args, kwargs) not in (None, "meta")) or (
            name == "copy_" and args[0].device.type != "meta"
        )
        if to_host:
            read = self._replayed(self._sync(f"{name} (device→host)"), None)  # the twin's values, where it read
            src = args[1] if name == "copy_" else args[0]
            values = read if isinstance(read, torch.Tensor) and read.shape == src.shape else torch.zeros(src.shape)
            if name == "copy_":
                return args[0].copy_(values)
            return values.to(dtype=kwargs.get("dtype") or src.dtype, device=_target(args, kwargs))
        self.launches[name] += 1
        return func(*args, **kwargs)


def _target(args, kwargs) -> str | None:
    device = kwargs.get("device")
    return None if device is None else torch.device(device).type


def _makes_device_tensor(kwargs) -> bool:
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "meta"


def _to_meta(value):
    if isinstance(value, torch.Tensor) and value.device.type != "meta" and value.dim() > 0:
        return value.to("meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_to_meta(v) for v in value)
    return value


def _scalar(dtype: torch.dtype, fill):
    if dtype == torch.bool:
        return bool(fill)
    return float(fill) if dtype.is_floating_point else int(fill)


def _bool_indexed(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


def _unsized_repeat(name: str, args, kwargs) -> bool:
    return name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) < 3


def _data_shaped(name: str, args, kwargs) -> bool:
    return name in _DATA_SHAPED or (name in _BOOL_INDEX and _bool_indexed(args)) or _unsized_repeat(name, args, kwargs)


def _selected(name: str, args, out) -> int:
    """How many elements a data-dependent op selected (the length its output's shape depends on)."""
    if name in _BOOL_INDEX:
        return int(sum(int(i.sum()) for i in args[1] if isinstance(i, torch.Tensor) and i.dtype == torch.bool))
    first = out[0] if isinstance(out, (tuple, list)) else out
    return first.shape[0]


def _stand_in(func, name, args, kwargs, n: int | None):
    """A data-dependent op's result on meta with ``n`` elements selected (None: every element)."""
    x = args[0]
    if name in _BOOL_INDEX:
        # a bool index becomes as many position indices as it has dimensions, each of length n
        indices = []
        for i in args[1]:
            if isinstance(i, torch.Tensor) and i.dtype == torch.bool:
                count = i.numel() if n is None else n
                indices += [torch.empty(count, dtype=torch.long, device=META)] * i.dim()
            else:
                indices.append(i)
        return func(x, indices, *args[2:], **kwargs)
    if name == "nonzero":
        return torch.empty((x.numel() if n is None else n, x.dim()), dtype=torch.long, device=META)
    if name == "masked_select":
        size = torch.broadcast_shapes(x.shape, args[1].shape).numel()
        return torch.empty((size if n is None else n,), dtype=x.dtype, device=META)
    if name == "repeat_interleave":
        return torch.empty((x.numel() if n is None else n,), dtype=torch.long, device=META)
    values = torch.empty((x.numel() if n is None else n,), dtype=x.dtype, device=META)
    if name in {"_unique2", "unique_consecutive", "unique_dim"}:
        return values, torch.empty(x.shape, dtype=torch.long, device=META), torch.empty_like(values, dtype=torch.long)
    return values


class HostReads(TorchDispatchMode):
    """The CPU twin of a ``MetaCuda`` run: the same call on the CPU, recording what each line's sync read (a scalar,
    the length of a data-dependent shape, the values ``.tolist()`` / ``.cpu()`` / ``.numpy()`` copy out), for the meta
    run to replay, so loops run as long as on real data and host decisions see real values."""

    def __init__(self) -> None:
        super().__init__()
        self.values: defaultdict[str, list] = defaultdict(list)
        self._copies = _HostCopies(self.values)

    def __enter__(self) -> HostReads:
        self._copies.__enter__()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._copies.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        if name == "_local_scalar_dense":
            self.values[_caller(traceback.extract_stack()[:-1])].append(out)
        elif _data_shaped(name, args, kwargs):
            self.values[_caller(traceback.extract_stack()[:-1])].append(_selected(name, args, out))
        return out


class _HostCopies(TorchFunctionMode):
    """The twin's copies out (no aten op on the CPU): each ``tolist`` / ``cpu`` / ``numpy`` result, by line."""

    _METHODS = {torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy}

    def __init__(self, values: defaultdict[str, list]) -> None:
        super().__init__()
        self.values = values

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self._METHODS and isinstance(args[0], torch.Tensor):
            copied = out.clone() if isinstance(out, torch.Tensor) else torch.as_tensor(out, dtype=args[0].dtype)
            self.values[_caller(traceback.extract_stack()[:-1])].append(copied)
        return out


# ------------------------------------------------------------------------------------ meta-aware torch
@contextlib.contextmanager
def _meta_aware_torch() -> Iterator[None]:
    """Inside the mode, what CUDA has and "meta" lacks: ``torch.Generator(device="meta")`` gives a stand-in, and
    autocast for "meta" is the CPU's (bf16 regions enter and leave as on a GPU; meta tensors are not cast)."""
    real_generator, real_autocast = torch.Generator, torch.autocast
    amp_autocast = torch.amp.autocast

    class _GeneratorType(type(real_generator)):
        def __instancecheck__(cls, obj) -> bool:
            return isinstance(obj, real_generator)

        def __call__(cls, device=None):
            if device is not None and torch.device(device).type == "meta":
                return MetaGenerator()
            return real_generator() if device is None else real_generator(device)

    class Generator(real_generator, metaclass=_GeneratorType):
        pass

    class Autocast(real_autocast):
        def __init__(self, device_type: str, *args, **kwargs) -> None:
            super().__init__("cpu" if device_type == "meta" else device_type, *args, **kwargs)

    torch.Generator = Generator
    torch.autocast = torch.amp.autocast = Autocast
    try:
        yield
    finally:
        torch.Generator, torch.autocast, torch.amp.autocast = real_generator, real_autocast, amp_autocast


def on_meta(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with its parameters and buffers on "meta" (no values): where a GPU run puts them on "cuda"."""
    return module.to(META)


def generator(device: torch.device | str, seed: int) -> torch.Generator:
    """A seeded generator for draws on ``device``: a CPU generator, or the meta stand-in."""
    if torch.device(device).type == "meta":
        return meta_generator(seed)
    return torch.Generator().manual_seed(seed)


def rehearse(call: Callable[[torch.device], object], module: torch.nn.Module | None = None, **options) -> MetaCuda:
    """``call(device)`` on the CPU (its twin: the host reads recorded), then with ``module`` moved to "meta" under a
    ``MetaCuda(replay=..., **options)``, which is returned."""
    with HostReads() as reads:
        call(torch.device("cpu"))
    if module is not None:
        on_meta(module)
    with MetaCuda(replay=reads, **options) as run:
        call(META)
    return run
