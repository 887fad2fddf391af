"""How the UI's templates write numbers, times and a member's state (Jinja2 filters)."""

from __future__ import annotations

import time
from typing import Any


def ago(ms: int | None, now: int | None) -> str:
    if ms is None or now is None:
        return "–"
    s = (now - ms) / 1000
    return span(s) + " ago" if s >= 0 else "in " + span(-s)


def span(s: float) -> str:
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{s / 60:.1f} min"
    if s < 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


def span_in(s: float | None) -> str:
    if s is None:
        return "–"
    return ("in " + span(s)) if s >= 0 else (span(-s) + " overdue")


def num(v: Any, digits: int = 0) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:,.{digits or 1}f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def clock(ms: int | None) -> str:
    """A moment (ms since 1970, Redis's clock) as UTC date and time."""
    if ms is None:
        return "–"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ms / 1000))


def size(n: int | None) -> str:
    """Bytes as people read them: 512 B, 1.5 KiB, 12.3 MiB, 2.0 GiB."""
    if n is None:
        return "–"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} B"


def member_state(m: dict[str, Any]) -> str:
    """One word for a member, as the queue page lists it."""
    if m.get("ended"):
        return "ended"
    if m.get("marker"):
        return "evicted"
    if m.get("suspected"):
        return "suspected"
    if not m.get("online", True):
        return "offline"
    if m.get("owner"):
        return "active"
    return "standby" if m.get("mode") == "single-active" else "active"
