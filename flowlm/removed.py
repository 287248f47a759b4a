"""Options the runtime no longer has (their earlier paths live on as test oracles): a saved config or checkpoint that
still names one at its kept value loads unchanged; any other value is refused before compute, naming what replaced
it. A leaf of the ground floor."""

from __future__ import annotations

# The samplers' removed options at their kept values: settings recorded before a removal name them, later ones do
# not; it is the same sampler either way (analysis leaves them out when it compares recorded settings).
REMOVED_SAMPLER_OPTIONS = {"draws": "committed", "otp_order": "before_step"}


def check_removed(owner: str, name: str, value: object, kept: object, replacement: str) -> None:
    """Raise ValueError unless ``value`` is ``kept``, the one behaviour left of the removed option ``name``."""
    if value != kept:
        raise ValueError(
            f"{owner}: {name}={value!r} was removed; {replacement}. Leave {name} out (or {name}={kept!r}, what "
            "saved configs hold)."
        )
