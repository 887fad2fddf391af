"""Priority queues (``PUB … PRIORITY p``; docs/protocol.md, "Priority"; lua/lib/priority.lua).

A plain topic's queue honours priority once an operator sets it (``fencemq priority set TOPIC
on``, lua/prioritize.lua), only while its log is empty. It then keeps, beside its id-ordered log,
an index of every message by level (``QueueKeys.priority``: ids scored ``(9 - level) · 2^48 +
id``), and each group reads the levels 9 first, FIFO within one, from a cursor per level. A
PRIORITY for any other queue (one not set, an lmq, a filter subscription's) is NOPRIORITY and
stores nothing; a level outside 0–9 is BADARG. :func:`level_counts` is what operators see.
"""

from __future__ import annotations

from typing import Any

from fencemq.errors import BadArgument, PriorityOff
from fencemq.fences import at_rest
from fencemq.fences.registry import fence
from fencemq.model import meta
from fencemq.model.keys import QueueKeys, QueueRef
from fencemq.model.values import text

PRIORITIZE = fence("prioritize", "meta log priority totals backlogs rest", "on")
LEVELS = 10
LEVEL_SPAN = 2**48  # a priority queue's message ids stay below it (lua/lib/priority.lua)


def check_level(priority: int | None, ref: QueueRef | None = None) -> None:
    """BADARG for a level outside 0–9; NOPRIORITY for an lmq (the fence says it for every other queue
    that does not honour priority)."""
    if priority is None:
        return
    if not isinstance(priority, int) or not 0 <= priority < LEVELS:
        raise BadArgument(f"PRIORITY must be an integer from 0 to {LEVELS - 1}")
    if ref is not None and ref.lite:
        raise PriorityOff("lite queues (lmqs) have no priority; publish without PRIORITY")


def level_range(level: int) -> tuple[int, int]:
    low = (LEVELS - 1 - level) * LEVEL_SPAN
    return low, low + LEVEL_SPAN - 1


async def level_counts(redis: Any, k: QueueKeys) -> dict[str, Any] | None:
    """A priority queue's messages per level (held in its log), and each group's unread per level;
    None when the queue does not honour priority. O(levels · (groups + 1) · log n)."""
    raw = await at_rest.meta_hash(redis, k)
    fields = {text(f): text(v) for f, v in raw.items()}
    if fields.get(meta.PRIORITY) != "1":
        return None
    groups = [g for g in fields.get(meta.GROUPS, "").split("\n") if g]
    first = int(fields.get(meta.FIRST) or 1)
    async with redis.pipeline(transaction=False) as pipe:
        for level in range(LEVELS):
            low, high = level_range(level)
            pipe.zcount(k.priority, low, high)
        for g in groups:
            cur = max(int(fields.get(meta.group_field(g, meta.CURSOR)) or first), first)
            pcs = fields.get(meta.group_field(g, meta.LEVEL_CURSORS))
            cursors = [int(c) for c in pcs.split()] if pcs else [cur] * LEVELS
            for level in range(LEVELS):
                low, high = level_range(level)
                pipe.zcount(k.priority, low + max(cursors[level], first), high)
        replies = [int(n) for n in await pipe.execute()]
    held = {level: replies[level] for level in range(LEVELS) if replies[level]}
    unread = {}
    for i, g in enumerate(groups):
        row = replies[LEVELS * (i + 1) : LEVELS * (i + 2)]
        unread[g] = {level: n for level, n in enumerate(row) if n}
    return {"levels": held, "unread": unread}
