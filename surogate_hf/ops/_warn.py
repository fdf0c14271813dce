"""Warn once per reason when a slower path is taken (never a silent fallback)."""

from __future__ import annotations

import warnings

_seen: set[tuple[str, str]] = set()


def warn_once(key: str, message: str) -> None:
    """One warning per (key, message): a new reason warns again."""
    if (key, message) in _seen:
        return
    _seen.add((key, message))
    warnings.warn(message, RuntimeWarning, stacklevel=3)
