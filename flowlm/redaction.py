"""Credentials kept out of what the suite writes: a URI's password (``postgresql://user:secret@host/db``, a tracking
store's URI; ``https://user:token@host/...``, a data file's) becomes ``***`` wherever a URI is recorded (run configs,
checkpoints and exports, MLflow params and artifacts, messages). A leaf of the ground floor (docs/reliability.md,
Secrets never leave)."""

from __future__ import annotations

import re
from typing import Any

REDACTED = "***"
# scheme://user:password@ (a "/", "@" or ":" in a password is percent-encoded in a valid URI)
_USERINFO = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s:/@]*):(?P<secret>[^\s/@]*)@")


def redact_uri(text: str) -> str:
    """``text`` with the password of every URI in it replaced by ``***`` (the user name and the rest kept)."""
    return _USERINFO.sub(lambda m: f"{m['head']}:{REDACTED}@", text)


def redact(value: Any) -> Any:
    """``value`` (a string, or dicts, lists and tuples of them, nested) with ``redact_uri`` applied to every string,
    keys included; other values as they are."""
    if isinstance(value, str):
        return redact_uri(value)
    if isinstance(value, dict):
        return {redact(k): redact(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(redact(v) for v in value)
    return value
