"""FSDP2 sharding and per-block ``torch.compile`` of the DiT, applied in ``FlowLMModule.configure_model``.

Lightning's ``ModelParallelStrategy`` (trainer=fsdp2) hands the module a device mesh and leaves the sharding to it:
each DiT block becomes one FSDP2 unit (one all-gather per block in forward and backward), then every child module
of the LightningModule that holds parameters (the DiT, an MLFM adapter) becomes the unit of what is left (embedding,
time MLPs, final layer, adapter parameters). Frozen parameters stay replicated (FSDP2 ``ignored_params``): they need
no gradient reduction, and methods read some of them outside a forward pass (MLFM's embedding table builds its
bridge states), where a sharded parameter would be a DTensor shard.

A pretrained LLaMA-family source is read by rank 0 alone: the other ranks build the model on the meta device
(``flowlm.pretrained.files.tensors_from_rank_zero``, entered by ``runners/train.py``), and ``shard`` broadcasts rank 0's
full weights and buffers into the sharded model (torch's ``set_model_state_dict(broadcast_from_rank0=True)``), so an
8 B source costs one host copy on the node instead of one per rank.

Activation checkpointing (``activation_checkpointing: true`` in the run config) recomputes each such unit's
activations in backward instead of storing them (torch's composable non-reentrant ``checkpoint``: parameter names,
hence checkpoints, unchanged); it is applied before sharding, as torch's FSDP2 examples do.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from flowlm.backbones.dit import DiTBlock


def dit_blocks(module: nn.Module) -> list[nn.Module]:
    """Every DiT block inside ``module`` (the units of sharding and compilation)."""
    return [m for m in module.modules() if isinstance(m, DiTBlock)]


def shard_units(module: nn.Module) -> list[nn.Module]:
    """The units FSDP2 shards one by one: every DiT block, and every decoder layer of a LLaMA-family backbone."""
    from flowlm.backbones.llama import BidirectionalLM  # transformers, imported only when sharding

    units = dit_blocks(module)
    for backbone in (m for m in module.modules() if isinstance(m, BidirectionalLM)):
        units += list(backbone.layers)
    return units


def checkpoint_activations(module: nn.Module) -> int:
    """Activation checkpointing on every shard unit of ``module`` (DiT blocks, LLaMA decoder layers): their
    activations are recomputed in backward (same loss and gradients, less memory, about one more forward).
    Idempotent; returns how many units were newly wrapped.

    A module that feeds the units per-call state outside their arguments (the LLaMA adaLN adapter's modulation,
    read by forward hooks) gives ``recompute_context()``: a context manager, captured at forward time, that
    restores that state while the unit is recomputed in backward.
    """
    from torch.distributed._composable import checkpoint

    units = [u for u in shard_units(module) if not getattr(u, "_flowlm_checkpointed", False)]
    if not units and not shard_units(module):
        raise ValueError(f"{type(module).__name__} holds no DiT block or decoder layer: nothing to checkpoint")
    owners = [m for m in module.modules() if callable(getattr(m, "recompute_context", None))]

    def context_fn():
        captured = [owner.recompute_context() for owner in owners]  # at forward time
        return contextlib.nullcontext(), _entered(captured)

    for unit in units:
        checkpoint(unit, context_fn=context_fn)
        unit._flowlm_checkpointed = True
    return len(units)


@contextlib.contextmanager
def _entered(contexts: list) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for ctx in contexts:
            stack.enter_context(ctx)
        yield


def fsdp_modules(module: nn.Module) -> list[nn.Module]:
    """The modules inside ``module`` that FSDP2 (``fully_shard``) manages; empty when it is not sharded."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def is_sharded(module: nn.Module) -> bool:
    """True once ``fully_shard`` has been applied inside ``module``."""
    return bool(fsdp_modules(module))


def mixed_precision_policy(precision: str | None):
    """FSDP2's policy for the trainer's precision: with ``bf16-mixed`` parameters are all-gathered and used in bf16
    (half the communication and unsharded memory of fp32) while the sharded master weights, the optimizer and the
    gradient reduce-scatter stay fp32 (a bf16 sum over ranks loses low bits); autocast still runs around the
    forward, so the DiT's own fp32 islands (time features, log-softmax) stay fp32. Other precisions: no policy."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision is not None and str(precision).startswith("bf16-mixed"):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard(module: nn.Module, mesh, *, precision: str | None = None) -> bool:
    """``fully_shard`` each DiT block, then each parameter-holding child of ``module``, over the data-parallel part of
    ``mesh`` (Lightning's ("data_parallel", "tensor_parallel") mesh or a 1-D one). Returns False (and does nothing)
    when ``module`` is already sharded, so a second ``configure_model`` call is harmless."""
    from torch.distributed.fsdp import fully_shard

    if is_sharded(module):
        return False
    names = mesh.mesh_dim_names or ()
    if "tensor_parallel" in names and mesh["tensor_parallel"].size() > 1:
        raise ValueError("the DiT has no tensor-parallel plan: use tensor_parallel_size=1 (trainer=fsdp2 does)")
    dp_mesh = mesh["data_parallel"] if "data_parallel" in names else mesh
    frozen = {p for p in module.parameters() if not p.requires_grad}
    policy = mixed_precision_policy(precision)
    blocks = shard_units(module)
    if not blocks:
        raise ValueError(f"{type(module).__name__} holds no DiT block or decoder layer: nothing to shard")
    from_rank_zero = _weights_deferred(module, dp_mesh)
    full = module.state_dict() if from_rank_zero and dist.get_rank() == 0 else {}  # the full tensors, kept alive
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, ignored_params=frozen)
    for child in module.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=dp_mesh, mp_policy=policy, ignored_params=frozen)
    unmanaged = [name for name, p in module.named_parameters() if p.requires_grad and not is_dtensor(p)]
    if unmanaged:  # their gradients would never be reduced: ranks would drift apart silently
        raise RuntimeError(f"trainable parameters outside every sharded module: {unmanaged[:4]}")
    if from_rank_zero:
        broadcast_from_rank_zero(module, full, torch.device(dp_mesh.device_type))
    return True


def _weights_deferred(module: nn.Module, mesh) -> bool:
    """Whether some rank built ``module`` on the meta device (its weights to come from rank 0), agreed by every rank
    (a MAX all-reduce). Rank 0 itself must hold real weights."""
    here = any(t.is_meta for t in (*module.parameters(), *module.buffers()))
    if here and dist.get_rank() == 0:
        raise RuntimeError("rank 0 holds meta-device weights: it must read the pretrained source itself")
    flag = torch.tensor([int(here)], device=torch.device(mesh.device_type))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


@torch.no_grad()
def broadcast_from_rank_zero(module: nn.Module, full: dict, device: torch.device) -> None:
    """Fill every rank's (sharded) ``module`` with rank 0's weights: ``full`` is rank 0's ``state_dict()`` taken
    before sharding (empty elsewhere). Every parameter and persistent buffer comes through torch's
    ``set_model_state_dict(full_state_dict, broadcast_from_rank0)`` (each rank keeps its shard; meta tensors are
    assigned), the non-persistent buffers (RoPE's inverse frequencies) by a broadcast of their own. Nothing is left on
    the meta device, so Lightning's ``_materialize_distributed_module`` has nothing to re-initialise."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    module._apply(lambda t: t if t.is_meta else t.to(device))  # one device besides meta, as torch's broadcast needs
    set_model_state_dict(module, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    persistent = set(module.state_dict().keys())
    for owner_name, owner in module.named_modules():
        for name, buffer in list(owner._buffers.items()):
            key = f"{owner_name}.{name}" if owner_name else name
            if buffer is None or key in persistent:
                continue
            value = torch.empty_like(buffer, device=device) if buffer.is_meta else buffer.to(device)
            dist.broadcast(value, src=0)
            owner._buffers[name] = value
    left = [name for name, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"still on the meta device after the broadcast from rank 0: {left[:4]}")
    rank_zero_info(f"weights broadcast from rank 0 into the sharded model ({len(full)} tensors)")


def compile_blocks(module: nn.Module) -> bool:
    """``torch.compile`` each DiT block in place (``Module.compile``: parameter names, hence checkpoints, unchanged;
    after sharding, FSDP2's hooks run outside the compiled graph). Returns False with a warning when compilation is
    unavailable here (no dynamo/inductor for this platform, or no C++ compiler for CPU kernels); a block compiled
    before is left as is."""
    reason = compile_unavailable(next(module.parameters()).device)
    if reason:
        warnings.warn(f"compile: true ignored, the DiT blocks run eagerly: {reason}", stacklevel=2)
        return False
    for block in dit_blocks(module):
        if getattr(block, "_compiled_call_impl", None) is None:
            block.compile()
    return True


def compile_unavailable(device: torch.device) -> str | None:
    """Why ``torch.compile`` cannot work here, or None. Only what is cheap to check before the first call; a
    compiler failure on the first step still raises (then set compile: false)."""
    try:
        import torch._dynamo as dynamo
        import torch._inductor  # noqa: F401 - the default backend must import
    except Exception as err:  # noqa: BLE001 - any import failure means no compile on this build
        return f"torch._dynamo/inductor do not import ({type(err).__name__}: {err})"
    if not dynamo.is_dynamo_supported():
        return "torch._dynamo does not support this Python/platform"
    if device.type == "cpu" and not (shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")):
        return "no C++ compiler on PATH for inductor's CPU kernels (set CXX or install g++)"
    return None


@contextlib.contextmanager
def full_parameters(module: nn.Module) -> Iterator[None]:
    """Inside, a sharded module holds its full (unsharded) parameters and keeps them across forward calls.

    Evaluation needs this: samplers stop early or take data-dependent numbers of steps, so ranks run different
    numbers of forward passes, and FSDP2's per-forward all-gathers would then wait on each other forever. Here every
    all-gather happens once, on entry, on every rank together; parameters read outside a forward (an embedding
    table) are plain tensors too. A module that is not sharded is left alone.
    """
    units = fsdp_modules(module)
    if not units:
        yield
        return
    tops = [m for m in units if not any(m is not o and _contains(o, m) for o in units)]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            # FSDP2's defaults for training: inner units reshard after forward, the outermost do not (their
            # parameters are needed again at once in backward)
            unit.set_reshard_after_forward(not any(unit is top for top in tops), recurse=False)


def reshard_all(module: nn.Module) -> None:
    """Bring every FSDP2 unit back to its sharded parameters (an outermost unit keeps its parameters gathered after
    a forward pass without backward, e.g. validation); a no-op for an unsharded module."""
    for unit in fsdp_modules(module):
        unit.reshard()


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def is_dtensor(tensor: object) -> bool:
    """A parameter/tensor sharded by FSDP2 (a DTensor)."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)
