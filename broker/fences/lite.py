"""Exclusive lite queues with eviction fences (guarantee 1): markers, quotas, notices.

A lite topic holds many tiny ordered queues (lmqs). In an exclusive group the
last subscriber wins: lua/subscribe.lua switches the owner and writes an
eviction *marker* for the old one in the same atomic call; an operator's
evict (lua/evict.lua) marks without a new owner. A marked member's pulls
get nothing. Markers end only with the member: a resubscribe, a HEARTBEAT
SYNC that no longer lists the lmq (fences/sessions.py), the session's end.
Lua side: lua/lib/lite.lua. Protocol: docs/protocol.md, "Lite queues".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fencemq.errors import LimitExceeded
from fencemq.fences import at_rest, session_index
from fencemq.fences.context import FenceContext
from fencemq.fences.registry import fence
from fencemq.model.handles import Handle
from fencemq.model.values import text

EVICT = fence("evict", "meta log checkouts deadlines owned held ready wake journal totals backlogs rest", "group member by")
LITE_HOLD = fence("lite_hold", "counts", "topic quota", keys_rest="buckets", argv_rest="entries")
LITE_RELEASE = fence("lite_release", "bucket counts", "entry older topic")


def marker_field(handle: Handle) -> str:
    """The meta field holding a member's eviction marker (who evicted it)."""
    return f"m|{handle.group}|{handle.member}|mk"


def unsubscribe_notice(handle: Handle, by: str, resent: bool = False) -> dict[str, Any]:
    """Told to a client whose subscription was taken (preempted or evicted)."""
    notice: dict[str, Any] = {
        "type": "unsubscribe", "reason": "preempted", "by": by, "topic": handle.queue.topic, "handle": handle.encode(),
    }
    if handle.queue.lmq is not None:
        notice["lmq"] = handle.queue.lmq
    if resent:
        notice["resent"] = True
    return notice


class Lite:
    def __init__(self, ctx: FenceContext) -> None:
        self.ctx = ctx

    async def evict(self, handle: Handle, by: str = "operator") -> int:
        """Fence a member off its subscription; -1 when it is not a member."""
        k = self.ctx.keys.queue(handle.queue)
        return int(await self.ctx.fences.run(EVICT, k, group=handle.group, member=handle.member, by=by))

    async def marked(self, handles: list[Handle]) -> list[str | None]:
        """Who evicted each member (its eviction marker), None where unmarked."""
        async with self.ctx.redis.pipeline(transaction=False) as pipe:
            for h in handles:
                at_rest.pipe_fields(pipe, self.ctx.keys.queue(h.queue), [marker_field(h)])
            replies = await pipe.execute()
        marks = [at_rest.queue_fields(replies[2 * i : 2 * i + 2], [marker_field(h)])[0] for i, h in enumerate(handles)]
        return [None if v is None else text(v) for v in marks]

    async def hold(self, handle: Handle) -> bool:
        """The client takes hold of a lite subscription (lua/lite_hold.lua): within its quota of
        ``lite_quota`` lmqs per topic (LIMIT otherwise, nothing written), in its session index, counted.
        True when it was not held yet. One call in the client's slot, before the subscribe fence."""
        held = (await self.hold_many([handle]))[0]
        if isinstance(held, Exception):
            raise held
        return held

    async def hold_many(self, handles: list[Handle]) -> list[bool | Exception]:
        """:meth:`hold` for many handles, one call per client and topic; a refusal (LIMIT) comes
        back as its exception, in the handle's place."""
        by_client_topic: dict[tuple[str, str], list[int]] = {}
        for i, h in enumerate(handles):
            by_client_topic.setdefault((h.member, h.queue.topic), []).append(i)
        out: list[bool | Exception] = [False] * len(handles)
        quota = self.ctx.config.lite_quota
        keys = self.ctx.keys
        for (client, topic), at in by_client_topic.items():
            some = [handles[i] for i in at]
            replies = await self.ctx.fences.run(
                LITE_HOLD, None, extra_keys={"counts": keys.session_lite_counts(client)},
                keys_rest=[session_index.bucket_key(keys, h) for h in some],
                topic=topic, quota=quota, args_rest=[f for h in some for f in session_index.entry_args(h)])
            for i, reply in zip(at, replies, strict=True):
                out[i] = LimitExceeded(f"the client holds {quota} lite subscriptions of {topic}, the quota; "
                                       f"unsubscribe some first") if int(reply) < 0 else bool(int(reply))
        return out

    async def release(self, handle: Handle) -> bool:
        """The client lets go of a lite subscription (lua/lite_release.lua): out of its index and
        counted off, if it was there. True if it was."""
        return bool(int(await self.ctx.fences.run(
            LITE_RELEASE, None, extra_keys=self._session_keys(handle), entry=session_index.field(handle),
            older=session_index.legacy_field(handle), topic=handle.queue.topic)))

    def _session_keys(self, handle: Handle) -> dict[str, str]:
        keys = self.ctx.keys
        return {"bucket": session_index.bucket_key(keys, handle), "counts": keys.session_lite_counts(handle.member)}


# -- churn, kept without the journal (lua/lib/lite.lua `count_churn`) ---------------------------------

CHURN = "ch"  # group field: "preemptions,evictions,fenced pulls,first ms,last ms"
CHURN_WHO = "chw"  # group field: the clients around the churn, newline-separated
CHURN_WHO_MAX = 8  # at most this many distinct clients are named


@dataclass(frozen=True)
class Churn:
    """A group's churn counters, since its first preemption / eviction (all zero: none)."""

    preemptions: int = 0
    evictions: int = 0
    fenced_pulls: int = 0
    first_ms: int | None = None
    last_ms: int | None = None
    clients: tuple[str, ...] = ()

    @property
    def clients_capped(self) -> bool:
        """True when more clients may have taken part than the ones named."""
        return len(self.clients) >= CHURN_WHO_MAX


def churn_of(group_fields: dict[str, Any]) -> Churn:
    """The churn of a group from its meta fields (``g|<group>|…`` names stripped)."""
    raw = group_fields.get(CHURN)
    if not raw:
        return Churn()
    p, e, f, first, last = (int(x) for x in text(raw).split(","))
    who = text(group_fields.get(CHURN_WHO) or "")
    return Churn(p, e, f, first, last, tuple(w for w in who.split("\n") if w))
