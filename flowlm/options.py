"""Option values checked for what they are, shared by every layer: a switch is a boolean (``as_bool``), a seed an
integer (``as_int``). Values arrive as strings from command lines (Hydra keeps ``no`` a string, lm-eval's
``model_args`` keeps ``no`` and ``yes``), and a non-empty string is truthy: ``trust_pickle=no`` unpickled a crafted
checkpoint. A leaf of the ground floor (docs/reliability.md, Booleans are booleans)."""

from __future__ import annotations

TRUE_WORDS = ("true", "yes", "on", "1")
FALSE_WORDS = ("false", "no", "off", "0")


def as_bool(name: str, value: object) -> bool:
    """``value`` as a bool: a real bool, 0 or 1, or one of ``TRUE_WORDS`` / ``FALSE_WORDS`` (any case); anything
    else is a ValueError naming the option ``name``."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in TRUE_WORDS:
            return True
        if word in FALSE_WORDS:
            return False
    raise ValueError(
        f"{name} must be true or false (also yes/no, on/off, 1/0), got {value!r}: give {name}=true or {name}=false"
    )


def as_int(name: str, value: object, *, minimum: int | None = None) -> int:
    """``value`` as an int: an int (not a bool) or a string of one; a fraction, a word or a value under ``minimum``
    is a ValueError naming the option ``name``."""
    number = value
    if isinstance(value, str):
        try:
            number = int(value.strip())
        except ValueError:
            number = value
    if isinstance(number, bool) or not isinstance(number, int) or (minimum is not None and number < minimum):
        floor = "" if minimum is None else f" ≥ {minimum}"
        raise ValueError(f"{name} must be an integer{floor}, got {value!r}: give e.g. {name}={max(minimum or 0, 0)}")
    return number
