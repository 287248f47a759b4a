"""A stop request honoured between a sampler's network calls, not only between batches.

A sampler's loop can run for minutes inside one batch (a large budget, a large model), and a training loop checks
for a stop (SIGTERM) only between batches. ``Sampler`` (base.py) therefore hands every sampler a copy of its model
view whose functions call the active stop check first (``interruptible``): one read of a module global while none
is active, never a device synchronisation. A runner activates one with ``stop_check(check)``, a callable that
raises to stop (runners/common.py raises Lightning's ``SIGTERMException`` once SIGTERM has arrived).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

View = TypeVar("View")

_active: Callable[[], None] | None = None  # the check of the innermost ``stop_check``, or None


@contextmanager
def stop_check(check: Callable[[], None]) -> Iterator[None]:
    """Within the block, call ``check`` before every network call of a sampler's model view; it raises to stop."""
    global _active
    previous, _active = _active, check
    try:
        yield
    finally:
        _active = previous


def _is_function(value: object) -> bool:
    return callable(value) and not isinstance(value, type)


def checked(fn: Callable) -> Callable:
    """``fn`` preceded by the active stop check; a function it returns (a windowed reader) is checked too."""
    if getattr(fn, "stop_checked", False):
        return fn

    @functools.wraps(fn, updated=())  # a module's __dict__ is not the function's
    def call(*args: Any, **kwargs: Any) -> Any:
        if _active is not None:
            _active()
        out = fn(*args, **kwargs)
        return checked(out) if _is_function(out) else out

    call.stop_checked = True  # type: ignore[attr-defined]
    return call


def interruptible(view: View) -> View:
    """A copy of a model view (a dataclass: ``MaskedDenoiser``, ``FlowDenoiser``, ``BridgeDenoiser``,
    ``CausalDenoiser``) whose function fields are ``checked``; any other object is returned as it is."""
    if not dataclasses.is_dataclass(view) or isinstance(view, type):
        return view
    fields = {f.name: getattr(view, f.name) for f in dataclasses.fields(view) if f.init}
    wrapped = {name: checked(value) for name, value in fields.items() if _is_function(value)}
    return dataclasses.replace(view, **wrapped) if wrapped else view


def with_interruptible_view(call: Callable) -> Callable:
    """A sampler's ``__call__`` that receives its model view (the first argument, or ``model=``) ``interruptible``."""

    @functools.wraps(call)
    def sample(self, *args: Any, **kwargs: Any) -> Any:
        if args:
            args = (interruptible(args[0]), *args[1:])
        elif "model" in kwargs:
            kwargs["model"] = interruptible(kwargs["model"])
        return call(self, *args, **kwargs)

    return sample
