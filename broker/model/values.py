"""Reading values back from Redis replies: bytes or str, maybe missing."""

from __future__ import annotations

from typing import Any


def text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def integer(value: Any, default: int | None = 0) -> int | None:
    """An integer field, or ``default`` when it is missing or not a number."""
    if value is None or value == b"" or value == "":
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        try:
            return int(float(value))
        except (TypeError, ValueError):
            return default
