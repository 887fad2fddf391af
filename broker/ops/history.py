"""The broker's recent history, kept in Redis for the overview's charts: bounded, in three resolutions.

The health watcher (server/health_watch.py: one worker at a time) appends a
point to each series whose last point is at least its step old: the
broker's totals (the event counters, from which the charts draw rates, and
the figures held), sessions alive and connections. Each series is a list
capped at what its range shows plus two points (LPUSH, LTRIM), so the
history's size never grows: 5 s points for 5 minutes, 30 s for an hour,
10 min for a day — 62 + 122 + 146 points of ~300 bytes, about 100 KB of
Redis in all. Any process that serves the UI reads the same history.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fencemq.model.keys import Keyspace
from fencemq.ops.totals import EVENTS, FIGURES


@dataclass(frozen=True)
class Series:
    name: str  # what the overview's range selector calls it
    label: str
    step_ms: int
    range_ms: int

    @property
    def step_s(self) -> int:
        return self.step_ms // 1000

    @property
    def kept(self) -> int:
        return self.range_ms // self.step_ms + 2


SERIES = (Series("5m", "5 min", 5_000, 300_000), Series("1h", "1 h", 30_000, 3_600_000),
          Series("24h", "24 h", 600_000, 86_400_000))
BY_NAME = {s.name: s for s in SERIES}
POINT_FIELDS = EVENTS + FIGURES + ("sessions", "connections")
# chart name -> the counter a rate is drawn from
RATE_FIELDS = {"publish": "published", "deliver": "delivered", "ack": "acked", "redeliver": "redelivered",
               "nack": "nacked", "timeout": "timeouts", "dead_letter": "dead_lettered"}


def counted_within(points: list[dict[str, Any]], counter: str) -> int | None:
    """How much an event counter grew from the first point to the last (None: fewer than two)."""
    if len(points) < 2:
        return None
    return max(0, int(points[-1].get(counter) or 0) - int(points[0].get(counter) or 0))


def key(keys: Keyspace, series: Series) -> str:
    return f"{keys.prefix}:history:{series.name}"


async def due(redis: Any, keys: Keyspace, now: int) -> list[Series]:
    """The series whose newest point is a step old or more (or that have none)."""
    async with redis.pipeline(transaction=False) as pipe:
        for s in SERIES:
            pipe.lindex(key(keys, s), 0)
        newest = await pipe.execute()
    out = []
    for s, raw in zip(SERIES, newest, strict=True):
        try:
            last = int(json.loads(raw)["t"]) if raw else None
        except (ValueError, KeyError, TypeError):
            last = None
        if last is None or now - last >= s.step_ms or last > now:
            out.append(s)
    return out


async def record(redis: Any, keys: Keyspace, series: list[Series], now: int, figures: dict[str, int]) -> None:
    """Append one point to each of ``series`` and cut each to its length."""
    point = json.dumps({"t": now, **{f: int(figures.get(f, 0)) for f in POINT_FIELDS}}, separators=(",", ":"))
    async with redis.pipeline(transaction=False) as pipe:
        for s in series:
            pipe.lpush(key(keys, s), point)
            pipe.ltrim(key(keys, s), 0, s.kept - 1)
        await pipe.execute()


async def value_at(redis: Any, keys: Keyspace, series: Series, name: str, at_ms: int) -> int | None:
    """A field of the series' newest point at ``at_ms`` or before (None: no point that old)."""
    for item in await redis.lrange(key(keys, series), 0, series.kept - 1):  # newest first
        try:
            p = json.loads(item)
            if int(p["t"]) <= at_ms:
                return int(p.get(name, 0))
        except (ValueError, KeyError, TypeError):
            continue
    return None


async def read(redis: Any, keys: Keyspace, series: Series, now: int) -> list[dict[str, Any]]:
    """The series' points within its range, oldest first, each with the rates since the point before
    it (``publish``, ``deliver``…, per second; None for the first) beside what the point holds."""
    raw = await redis.lrange(key(keys, series), 0, series.kept - 1)
    points = []
    for item in reversed(raw):
        try:
            p = json.loads(item)
        except ValueError:
            continue
        if isinstance(p, dict) and isinstance(p.get("t"), int) and p["t"] >= now - series.range_ms - series.step_ms:
            points.append(p)
    out = []
    for before, p in zip([None, *points], points, strict=False):
        row = {"t": p["t"], **{f: p.get(f) for f in POINT_FIELDS}}
        span = (p["t"] - before["t"]) / 1000 if before is not None else 0
        for name, counter in RATE_FIELDS.items():
            row[name] = (max(0, p.get(counter, 0) - before.get(counter, 0)) / span) if span > 0 else None
        out.append(row)
    return out
