"""Scheduled messages: ``PUB … DELAY ms | AT unix-ms`` (lua/lib/schedule.lua).

A scheduled message is stored at once, outside the log (the queue's ``scheduled`` zset and
``scheduled_bodies`` hash), under a schedule id (``s`` and digits) that the publish answers and
``UNPUB`` cancels by. Its queue is listed in the global lease schedule for its due time, so the
sweeper that returns expired leases also releases it (lua/release.lua): appended to the log
then, with a message id of that moment, it reaches every group that exists then as any new
message does. Before the release, the sweeper copies a plain topic's due messages to the
filter subscriptions that match it then (fences/shared.py), with dedup ids made from their
schedule ids, so a sweeper that dies between the two copies nothing twice.
Protocol: docs/protocol.md, "Scheduled messages".
"""

from __future__ import annotations

import re
from typing import Any

from fencemq.errors import BadArgument, LimitExceeded
from fencemq.fences.context import FenceContext
from fencemq.fences.mailbox import Mailboxes, parse_push_members
from fencemq.fences.registry import fence
from fencemq.model.keys import QueueKeys, QueueRef
from fencemq.model.values import text

RELEASE = fence("release", "meta log scheduled scheduled_bodies held ready delayed journal wake dedup dedup_ids dead "
                "totals backlogs priority rest",
                "upto limit maxlen maxage_ms maxbytes keep idle_ttl_ms journal_cap clock_ids")
UNPUB = fence("unpub", "meta scheduled scheduled_bodies journal totals backlogs rest", "", argv_rest="sids")

_SCHEDULE_ID = re.compile(r"s\d+(?:p\d)?")


def is_schedule_id(message_id: str) -> bool:
    """``s<n>``, or ``s<n>p<level>`` for a message published with a PRIORITY (lib/priority.lua)."""
    return _SCHEDULE_ID.fullmatch(message_id) is not None


def release_dedup_id(ref: QueueRef, sid: str) -> str:
    """The dedup id of a released message's copy to a filter queue: one per (queue, schedule id)."""
    return f"\0release\0{ref.qid}\0{sid}"


class Scheduling:
    def __init__(self, ctx: FenceContext, mailboxes: Mailboxes) -> None:
        self.ctx = ctx
        self.mailboxes = mailboxes

    async def due(self, ref: QueueRef, upto: int, limit: int) -> list[tuple[str, bytes]]:
        """The scheduled messages due at or before ``upto`` (at most ``limit``): (schedule id, stored body)."""
        k = self.ctx.keys.queue(ref)
        sids = await self.ctx.redis.zrangebyscore(k.scheduled, "-inf", upto, 0, limit)
        if not sids:
            return []
        bodies = await self.ctx.redis.hmget(k.scheduled_bodies, sids)
        return [(text(s), b) for s, b in zip(sids, bodies, strict=True) if b is not None]

    async def release(self, ref: QueueRef, upto: int) -> tuple[list[str], int]:
        """Append what is due at or before ``upto`` to the log; the message ids it got, and when the
        next scheduled message is due (-1: none). The push members are dispatched to."""
        k = self.ctx.keys.queue(ref)
        res = await self.ctx.fences.run(RELEASE, k, upto=upto, limit=self.ctx.config.sweep_batch,
                                        idle_ttl_ms=self.ctx.idle_ttl(ref), journal_cap=self.ctx.journal_cap(ref),
                                        clock_ids=self.ctx.clock_ids(ref), **await self.ctx.retention.args(ref.topic))
        ids, members, next_due = [text(i) for i in res[0]], parse_push_members(res[1]), int(res[2])
        if ids and members:
            await self.mailboxes.dispatch(ref, members)
        return ids, next_due

    async def cancel(self, ref: QueueRef, sids: list[str]) -> int:
        """Cancel scheduled messages by schedule id: how many were still waiting (UNPUB)."""
        check_schedule_ids(sids, self.ctx.config.max_batch)
        return int(await self.ctx.fences.run(UNPUB, self.ctx.keys.queue(ref), args_rest=sids))

    async def pending(self, ref: QueueRef) -> int:
        """How many messages of ``ref`` wait for their time."""
        return int(await self.ctx.redis.zcard(self.ctx.keys.queue(ref).scheduled))


def check_schedule_ids(sids: list[str], max_batch: int) -> None:
    """BADARG (or LIMIT) unless ``sids`` are 1 … max_batch schedule ids."""
    if not sids:
        raise BadArgument("give at least one schedule id")
    if len(sids) > max_batch:
        raise LimitExceeded(f"{len(sids)} ids exceed {max_batch}; cancel in smaller batches")
    bad = next((s for s in sids if not is_schedule_id(s)), None)
    if bad is not None:
        raise BadArgument(f"{bad[:32]!r} is not a schedule id: UNPUB takes the ids PUB … DELAY | AT answered "
                          "(s and digits)")


async def scheduled_messages(redis: Any, k: QueueKeys, limit: int = 100) -> list[dict[str, Any]]:
    """The first ``limit`` scheduled messages of a queue by due time: schedule id, due ms, publish ms, size."""
    entries = await redis.zrange(k.scheduled, 0, limit - 1, withscores=True)
    if not entries:
        return []
    bodies = await redis.hmget(k.scheduled_bodies, [s for s, _ in entries])
    out = []
    for (sid, due), body in zip(entries, bodies, strict=True):
        if body is not None:
            out.append({"id": text(sid), "due_ms": int(due), "published_ms": int(body.split(b":", 1)[0]),
                        "size": len(body)})
    return out
