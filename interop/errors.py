"""The one exception of the interop package that is a user's configuration problem, not a bug."""
from __future__ import annotations


class InteropRefused(ValueError):
    """A setting the other side cannot represent exactly (a mixerlab setting on export, an HF config field on
    import); the message is one line naming the key, its value and the nearest target that holds it (or none)."""


def refuse(key: str, value, why: str, nearest: str = "none") -> InteropRefused:
    return InteropRefused(f"{key}={value!r}: {why}; nearest target that holds it: {nearest}")
