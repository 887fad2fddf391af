"""Publishing: appending messages to a queue's log (lua/publish.lua).

One fence call per batch (MPUB, pipelined PUBs): ids are assigned in order,
the publish time is Redis's, a dedup id repeated within the window returns
the first id and stores nothing, retention trims from the head. A dedup id
may cover a run of messages (``dedup_ids`` of ``[id, None, None]``: an
MPUB … ID): one dedup entry for the batch, and a repeat of it returns the
run's ids. Then the
queue's push members get their share (fences/mailbox.py). Every publish
asks the memory guard first (fences/memory.py): above the watermark, or on
a Redis that may evict keys, it is refused (FULL, EVICTING) before anything
is written, whichever door it came through. A publish with ``delay_ms`` or ``at_ms`` is
scheduled (fences/schedule.py): stored at once, appended to the log when due.
A message with a TTL (``PUB … TTL ms``, MQTT's Message Expiry Interval) carries its
deadline (:func:`expiry_deadline`, the one rule of every door) and is settled
unsent by the fences once it has passed (lua/lib/expiry.lua).
Protocol: docs/protocol.md, "Publishing", "Scheduled messages", "Message expiry".
"""

from __future__ import annotations

from typing import Any

from fencemq.errors import BadArgument, LimitExceeded
from fencemq.fences.context import FenceContext, opt
from fencemq.fences.mailbox import Mailboxes, parse_push_members
from fencemq.fences.memory import is_oom
from fencemq.fences.registry import fence
from fencemq.model.keys import QueueRef
from fencemq.model.messages import EXPIRES, MAX_TTL_MS, pack_body, with_expiry
from fencemq.model.values import text


def check_delay(config: Any, delay_ms: int | None, at_ms: int | None) -> None:
    """BADARG for a DELAY beyond ``max_delay_ms``, or DELAY and AT both (AT's bound needs Redis's clock:
    the fence checks it)."""
    if delay_ms is not None and at_ms is not None:
        raise BadArgument("give DELAY or AT, not both")
    limit = config.max_delay_ms
    if delay_ms is not None and not 0 <= delay_ms <= limit:
        raise BadArgument(f"DELAY must be between 0 and {limit} ms (max_delay_ms)")
    if at_ms is not None and not 0 <= at_ms <= 2**53 - 1:
        raise BadArgument("AT must be a unix time in ms from 0 to 2^53-1")



def check_ttl(ttl_ms: int) -> None:
    """BADARG for a TTL that is not 1 ms to MAX_TTL_MS."""
    if not 1 <= ttl_ms <= MAX_TTL_MS:
        raise BadArgument(f"TTL must be between 1 and {MAX_TTL_MS} ms")


def expiry_deadline(now_ms: int, ttl_ms: int, delay_ms: int | None = None, at_ms: int | None = None) -> int:
    """When a message published at ``now_ms`` (Redis's clock) with ``ttl_ms`` expires: TTL after it becomes
    deliverable, which for a scheduled message is its due time (DELAY, AT; an AT past is now). Every door
    (RESP's TTL, MQTT's Message Expiry Interval) stamps its deadline here."""
    start = now_ms + delay_ms if delay_ms is not None else (at_ms if at_ms is not None else now_ms)
    return max(start, now_ms) + ttl_ms


PUBLISH = fence("publish",
                "meta log dedup dedup_ids wake dead journal checkouts deadlines owned held ready delayed waiters "
                "scheduled scheduled_bodies totals backlogs priority rest",
                "maxlen maxage_ms dedup_window_ms idle_ttl_ms journal_cap keep maxbytes spans intent_at intent_ms "
                "default_lock_ms delay_ms at_ms max_delay_ms priority clock_ids local_wids", argv_rest="messages")


class Publishing:
    def __init__(self, ctx: FenceContext, mailboxes: Mailboxes, clock: Any) -> None:
        self.ctx = ctx
        self.mailboxes = mailboxes
        self.clock = clock  # Redis's clock (fences/sessions.py RedisClock): expiry deadlines

    async def expiring(self, headers: dict[str, str] | None, ttl_ms: int | None, delay_ms: int | None = None,
                       at_ms: int | None = None) -> dict[str, str] | None:
        """``headers`` with the expiry of a message published now with ``ttl_ms`` (None: none); BADARG for a
        TTL out of range, or an expiry header set by hand that is not a deadline in ms."""
        if ttl_ms is None:
            if headers and EXPIRES in headers and not headers[EXPIRES].isdigit():
                raise BadArgument(f"header {EXPIRES} is a deadline in ms on the broker's clock; give TTL ms instead")
            return headers
        check_ttl(ttl_ms)
        return with_expiry(headers, expiry_deadline(await self.clock.now_ms(), ttl_ms, delay_ms, at_ms))

    async def publish(
        self,
        topic: str,
        payloads: list[bytes],
        *,
        lmq: str | None = None,
        qos: int = 1,
        dedup_ids: list[str | None] | None = None,
        headers: dict[str, str] | None = None,
        producer: str | None = None,
        delay_ms: int | None = None,
        at_ms: int | None = None,
    ) -> list[str]:
        return (await self.publish_reading(topic, payloads, None, lmq=lmq, qos=qos, dedup_ids=dedup_ids,
                                           headers=headers, producer=producer, delay_ms=delay_ms,
                                           at_ms=at_ms))[0]

    async def publish_reading(
        self,
        topic: str,
        payloads: list[bytes],
        read_key: str | None,
        *,
        lmq: str | None = None,
        qos: int = 1,
        dedup_ids: list[str | None] | None = None,
        headers: dict[str, str] | None = None,
        producer: str | None = None,
        delay_ms: int | None = None,
        at_ms: int | None = None,
    ) -> tuple[list[str], bytes | None]:
        """:meth:`publish`, reading ``read_key`` (another slot's) in the same round trip: the ids and its value."""
        ref = self.check(topic, payloads, lmq=lmq, qos=qos, delay_ms=delay_ms, at_ms=at_ms)
        return await self.publish_checked(ref, payloads, read_key, qos=qos, dedup_ids=dedup_ids, headers=headers,
                                          producer=producer, delay_ms=delay_ms, at_ms=at_ms)

    def check(self, topic: str, payloads: list[bytes], *, lmq: str | None = None, qos: int = 1,
              delay_ms: int | None = None, at_ms: int | None = None) -> QueueRef:
        """The queue a publish goes to, once every check that needs no Redis has passed (the
        topic's kind is :meth:`publish_checked`'s): BADARG or LIMIT saying what to fix, then FULL or
        EVICTING while a memory alarm is on (the worker's own state: no round trip)."""
        config = self.ctx.config
        ref = self.ctx.queue(topic, lmq)
        if not payloads:
            raise BadArgument("nothing to publish; give at least one payload")
        if len(payloads) > config.max_batch:
            raise LimitExceeded(f"batch of {len(payloads)} exceeds {config.max_batch} messages; split it")
        if qos not in (0, 1):
            raise BadArgument("QOS must be 0 or 1")
        if delay_ms is not None or at_ms is not None:
            check_delay(config, delay_ms, at_ms)
        limit = config.max_payload
        if max(map(len, payloads)) > limit:
            size = next(len(p) for p in payloads if len(p) > limit)
            raise LimitExceeded(f"payload of {size} bytes exceeds {limit}; split it")
        self.ctx.memory.check_publish()  # FULL, EVICTING: the broker's Redis is short of memory (fences/memory.py)
        return ref

    async def publish_checked(self, ref: QueueRef, payloads: list[bytes], read_key: str | None, *, qos: int = 1,
                              dedup_ids: list[str | None] | None = None, headers: dict[str, str] | None = None,
                              producer: str | None = None, delay_ms: int | None = None,
                              at_ms: int | None = None, priority: int | None = None) -> tuple[list[str], bytes | None]:
        """Publish to ``ref`` what :meth:`check` passed (at most max_batch messages); ``priority``: the
        level of every message (fences/priority.py)."""
        await self.ctx.check_topic_kind(ref.topic, ref.lite)
        return await self._append(ref, [pack_body(p, headers, qos, producer) for p in payloads], dedup_ids, read_key,
                                  (delay_ms, at_ms), priority)

    async def append(self, ref: QueueRef, bodies: list[bytes], dedup_ids: list[str | None] | None = None) -> list[str]:
        """Append packed bodies to one queue and fill its push members' mailboxes."""
        return (await self._append(ref, bodies, dedup_ids, None))[0]

    async def _append(self, ref: QueueRef, bodies: list[bytes], dedup_ids: list[str | None] | None,
                      read_key: str | None, when: tuple[int | None, int | None] = (None, None),
                      priority: int | None = None) -> tuple[list[str], bytes | None]:
        config = self.ctx.config
        messages: list[bytes | str] = []
        spans: list[str] = []
        if dedup_ids is None:
            for body in bodies:
                messages += (body, "")
        else:
            head = 0  # the message whose dedup id covers a run (dedup ids of None after it)
            for i, (body, dedup) in enumerate(zip(bodies, dedup_ids, strict=True), start=1):
                messages += (body, dedup or "")
                if dedup is not None:
                    if head and i - head > 1:
                        spans.append(f"{head}:{i - head}")
                    head = i if dedup else 0
            if head and len(bodies) + 1 - head > 1:
                spans.append(f"{head}:{len(bodies) + 1 - head}")
        delay_ms, at_ms = when
        scheduling = delay_ms is not None or at_ms is not None
        args = dict(dedup_window_ms=config.dedup_window_ms, idle_ttl_ms=self.ctx.idle_ttl(ref),
                    journal_cap=self.ctx.journal_cap(ref), spans=",".join(spans), default_lock_ms=config.default_lock_ms,
                    delay_ms=opt(delay_ms), at_ms=opt(at_ms), max_delay_ms=config.max_delay_ms, priority=opt(priority),
                    clock_ids=self.ctx.clock_ids(ref), local_wids=self.ctx.local_wids,
                    **await self.ctx.retention.args(ref.topic))
        keys = self.ctx.keys.queue(ref)

        async def call(intent: dict[str, Any]) -> Any:
            if read_key is None:
                return await self.ctx.fences.run(PUBLISH, keys, args_rest=messages, **args, **intent), None
            return await self.ctx.fences.run_reading(PUBLISH, keys, read_key, args_rest=messages, **args, **intent)

        try:
            if scheduling:  # listed for the sweep before it is stored: whenever this worker dies, it is found
                (ids, push_members, handed, here), value = await self.ctx.under_intent(ref.qid, call)
            else:
                (ids, push_members, handed, here), value = await call(await self.ctx.handoff_intent(ref.qid))
        except Exception as exc:
            # Redis refuses the fence whole (it is not allow-oom): nothing was stored
            if is_oom(exc):
                raise self.ctx.memory.refused_by_redis(exc) from None
            raise
        if scheduling and ids and text(ids[0])[:1] == "s":
            if int(handed) > 0:
                await self.ctx.schedule(ref.qid, int(handed))  # swept when due
            return [text(i) for i in ids], value
        if here and self.ctx.handed_here is not None:
            # a long poll of this worker was handed messages: it gets them now, not from the pub/sub
            # copy of the wake-up (which follows, and finds it served)
            self.ctx.handed_here(keys.wake, here)
        await self.ctx.waiters_seen(ref.qid, int(handed))
        members = parse_push_members(push_members)
        if members:
            await self.mailboxes.dispatch(ref, members)
        return [text(i) for i in ids], value
