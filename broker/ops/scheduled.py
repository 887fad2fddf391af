"""Operators' view of scheduled messages (PUB … DELAY | AT): list a queue's, cancel some.

The same fence as a publisher's UNPUB (lua/unpub.lua) cancels; the listing reads the queue's
schedule (fences/schedule.py). docs/operations.md, "Scheduled messages".
"""

from __future__ import annotations

from typing import Any

from fencemq.fences.registry import Fences
from fencemq.fences.schedule import UNPUB, check_schedule_ids, scheduled_messages
from fencemq.model.keys import Keyspace, QueueRef
from fencemq.ops.operations import display_name, queue_info

MAX_IDS = 1000


async def list_scheduled(redis: Any, keys: Keyspace, ref: QueueRef, limit: int = 100) -> dict[str, Any]:
    """How many messages of ``ref`` wait for their time, and the first ``limit`` of them by due time."""
    k = keys.queue(ref)
    total = int(await redis.zcard(k.scheduled))
    return {**queue_info(ref.qid), "queue": display_name(ref), "scheduled": total,
            "messages": await scheduled_messages(redis, k, limit)}


async def cancel_scheduled(redis: Any, keys: Keyspace, ref: QueueRef, ids: list[str]) -> dict[str, Any]:
    """Cancel scheduled messages of ``ref`` by schedule id: how many still waited."""
    check_schedule_ids(ids, MAX_IDS)
    cancelled = int(await Fences(redis).run(UNPUB, keys.queue(ref), args_rest=ids))
    return {**queue_info(ref.qid), "queue": display_name(ref), "cancelled": cancelled, "asked": len(ids)}
