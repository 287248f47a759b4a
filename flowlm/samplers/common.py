"""What several samplers share beside the contract (``base.py``): their option checks, the MDM start state, the
blocks of the semi-autoregressive samplers, times as per-sequence tensors, and network calls on the rows that need
them."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from flowlm.removed import REMOVED_SAMPLER_OPTIONS, check_removed

BUDGET_PER_POSITION = 16  # the largest NFE budget per position to generate, a loose cap (docs/reliability.md)


def check_budget(owner: str, nfe: int, free_positions: int | None = None) -> None:
    """An NFE budget is an integer ≥ 1 and, for sequences with ``free_positions`` non-prompt tokens, at most
    ``BUDGET_PER_POSITION`` NFE per position."""
    if not isinstance(nfe, int) or nfe < 1:
        raise ValueError(f"{owner}: NFE budget must be an integer ≥ 1, got {nfe!r}")
    cap = BUDGET_PER_POSITION * max(free_positions or 0, 1)
    if free_positions is not None and nfe > cap:
        raise ValueError(
            f"{owner}: NFE budget {nfe} is above the cap of {cap} for {free_positions} positions to generate "
            f"({BUDGET_PER_POSITION} NFE per position, docs/reliability.md); lower it (eval.nfe)"
        )


def check_finite(name: str, value: float) -> float:
    """A number option: a real, finite number (NaN fails every comparison, so ``gamma=nan`` passed ``gamma ≥ 0``)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def check_temperature(temperature: float) -> float:
    """A sampling temperature: 0 means argmax, > 0 scales the logits."""
    check_finite("temperature", temperature)
    if temperature < 0:
        raise ValueError(f"temperature must be ≥ 0, got {temperature}")
    return temperature


SCORES = ("max_prob", "sampled")


def check_score(score: str) -> str:
    """How a commit loop ranks positions at temperature > 0: by the max probability ("max_prob") or by the
    probability of the token drawn ("sampled"); at temperature 0 they coincide."""
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    return score


def check_draws(owner: str, draws: str) -> None:
    """``draws``, removed: MDM samplers draw their float64 categorical at the positions that commit or unmask in a
    step only (the same law: which positions commit does not depend on the draw); the whole-tensor Gumbel-max stream
    is a test oracle (tests/samplers/oracles.py)."""
    check_removed(
        owner,
        "draws",
        draws,
        REMOVED_SAMPLER_OPTIONS["draws"],
        "the categorical is drawn where a step commits (the same law)",
    )


def masked_start(prompt: Tensor, prompt_mask: Tensor, mask_id: int) -> tuple[Tensor, Tensor]:
    """The all-[MASK] state with the prompt in place, and its confidence (1 on the prompt, 0 elsewhere)."""
    return torch.where(prompt_mask, prompt, mask_id), prompt_mask.float()


def block_ids(free: Tensor, block_length: int) -> Tensor:
    """The block of each ``free`` (non-prompt) position, counting a row's free positions in order, ``block_length``
    to a block; −1 on the prompt."""
    return torch.where(free, (free.cumsum(-1) - 1) // block_length, -1)


def sequence_times(x: Tensor, s: float | Tensor, t: float | Tensor) -> tuple[Tensor, Tensor]:
    """Times (scalars or (B,)) as (B,) tensors of x's dtype, without a host copy."""
    b = x.shape[0]
    s, t = (time.to(x.dtype).expand(b) if isinstance(time, Tensor) else x.new_full((b,), time) for time in (s, t))
    return s, t


def read_counts(*counts: Tensor, bound: int) -> list[int]:
    """Device counts (0-dim integer tensors, each in [0, ``bound``]) read back in one host read: packed into one
    integer in base ``bound`` + 1, one ``.item()`` (a GPU waits once, and tests/host_syncs.py sees the read)."""
    base, packed = bound + 1, counts[0]
    for count in counts[1:]:
        packed = packed * base + count
    value, out = int(packed), []
    for _ in counts:
        value, count = divmod(value, base)
        out.append(count)
    return out[::-1]


def rows_to_call(model, need: Tensor, n_need: int) -> Tensor:
    """The rows (n,) a call computes: those ``need`` (B,) marks, ``n_need`` of them (read with the caller's other
    counts: ``torch.nonzero_static``, no host read), or every row where the view holds the batch (``rows_alone``
    False: CFG's guided view)."""
    if not model.rows_alone:
        return torch.arange(need.shape[0], device=need.device)
    return torch.nonzero_static(need, size=n_need).view(-1)


def call_rows(
    call, x: Tensor, t: Tensor, rows: Tensor, into: Tensor | None = None
) -> tuple[Tensor | None, list | None]:
    """The network ``call(x, t)`` (``fn``: logits; ``head_fn``: the head's input, weight and bias) on ``rows`` (n,)
    only, the rows that need a call, each row's output as alone (no row reads another): a batch costs the calls its
    rows need, not its most demanding row's calls for every row. ``rows`` comes sized from a count the caller read
    with its others (``torch.nonzero_static``: no host read here). Returns the (B, L, ·) output, the rows' results
    written into ``into`` (the rows' earlier outputs: the ancestral no-change cache's) or beside zeros, and the
    call's other values; (``into``, None) when no row needs it (no call)."""
    if rows.numel() == 0:
        return into, None
    whole = rows.numel() == x.shape[0]
    out = call(x, t) if whole else call(x.index_select(0, rows), t.index_select(0, rows))
    out, *rest = out if isinstance(out, tuple) else (out,)
    if whole:
        return out, rest
    into = out.new_zeros((x.shape[0], *out.shape[1:])) if into is None else into
    return into.index_copy(0, rows, out), rest


def slots(flag: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """(B, width) distinct positions per row, those where ``flag`` holds first (in position order, all of them when a
    row has at most ``width``), and whether each slot is flagged: a fixed-size view of a ragged set, with no host
    read."""
    length = flag.shape[-1]
    positions = torch.arange(length, device=flag.device)
    key = torch.where(flag, positions, positions + length)  # flagged first; distinct keys
    slot = key.topk(min(width, length), dim=-1, largest=False, sorted=True).indices
    return slot, flag.gather(1, slot)


def column_major_head(head):
    """``head`` (a ``MaskedDenoiser.head_fn``, or a block cache's reader with ``head``) for one decode, its weight W
    (|V|, d) handed on, on the CPU in float32, as a view of a contiguous (d, |V|) copy made at the first call and
    reused while the calls hand the same W (the same view of the same storage, unchanged): the chunked head's
    product (``flowlm.ops.summary.head_fold``) then reads each chunk's columns contiguously, 0.65× the time of the
    transposed row-major chunk at 64 rows, d 128, |V| = 50 257 on one thread, the same values bit for bit on that
    CPU (docs/performance.md, block cache). None stays None; elsewhere the weight passes as it is, under the CPU's
    bf16 autocast too: the product casts each chunk to bf16, and a column-major chunk's cast made it 1.2–1.4× slower
    at 320–512 rows (equal at 64; docs/performance.md, the flow head at the positions a greedy draft reads)."""
    if head is None:
        return None
    memo: dict = {}

    def call(x: Tensor, t: Tensor):
        features, weight, bias = head(x, t)
        cpu = weight.device.type == "cpu"
        if not cpu or weight.dtype != torch.float32 or torch.is_grad_enabled() or torch.is_autocast_enabled("cpu"):
            return features, weight, bias
        key = (weight.untyped_storage().data_ptr(), weight.storage_offset(), weight.shape, weight.stride())
        key += (weight._version,)  # an in-place update of the weight makes a new copy
        if memo.get("key") != key:
            memo["key"], memo["weight"] = key, weight.t().contiguous().t()
        return features, memo["weight"], bias

    return call
