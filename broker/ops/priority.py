"""Operators' side of priority queues (docs/protocol.md, "Priority"): switch a topic's queue to
honour PUB … PRIORITY (lua/prioritize.lua) and read its per-level counts (fences/priority.py)."""

from __future__ import annotations

from typing import Any

from fencemq.errors import PriorityOff
from fencemq.fences.priority import PRIORITIZE, level_counts
from fencemq.fences.registry import Fences
from fencemq.model.keys import Keyspace, QueueRef
from fencemq.ops.operations import display_name, queue_info

LEVELS_SHOWN = tuple(range(9, -1, -1))  # how every door lists a priority queue's levels: 9 (read first) to 0


async def set_priority(redis: Any, keys: Keyspace, ref: QueueRef, on: bool) -> dict[str, Any]:
    """Set a plain topic's queue to honour priority (``on``) or not: whether it changed. NOPRIORITY
    for an lmq or a filter subscription's queue, or while the queue's log holds messages."""
    if ref.lite or ref.owner is not None:
        raise PriorityOff("only a plain topic's queue honours priority (not an lmq, not a filter subscription's)")
    changed = int(await Fences(redis).run(PRIORITIZE, keys.queue(ref), on=1 if on else 0))
    return {**queue_info(ref.qid), "queue": display_name(ref), "priority": on, "changed": bool(changed)}


async def priority_counts(redis: Any, keys: Keyspace, ref: QueueRef) -> dict[str, Any]:
    """Whether ``ref`` honours priority; if so, its messages per level and each group's unread per level."""
    counts = await level_counts(redis, keys.queue(ref))
    return {**queue_info(ref.qid), "queue": display_name(ref), "priority": counts is not None, **(counts or {})}


def backlog_by_level(counts: dict[str, Any] | None) -> dict[int, int]:
    """A priority queue's backlog per level: at each level, the most messages one group has not read (the
    slowest group there, as a queue's backlog is its slowest group's), from :func:`level_counts`' reply
    (``inspect_queue``'s ``priority``); levels with none are left out, a queue without groups has none.
    The UI, the metrics and the snapshot all read it from here."""
    out: dict[int, int] = {}
    for by_level in (counts or {}).get("unread", {}).values():
        for level, n in by_level.items():
            out[int(level)] = max(out.get(int(level), 0), int(n))
    return {level: n for level, n in sorted(out.items(), reverse=True) if n}
