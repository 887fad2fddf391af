"""Shared subscriptions (guarantee 4) and MQTT-style filters: fan-out at publish.

A publish to a plain topic lands in the topic's own log (for queue-style
groups) and is copied into the queue of every matching filter subscription:
``SUB a/+/c`` (the client's own) and ``SUB $share/g/a/#`` (one queue per
shared group, whose members are served one message each by the group's
strategy: lua/lib/shared.lua). Overlapping filters each get their own copy.
Filter subscriptions are push subscriptions: their members TAKE from
mailboxes.

A shared group lives while it has members: when the last one leaves, its
queue and undelivered messages are deleted. A member's QoS 1 messages still
unsettled when its session ends go back to the group's queue and on to
another member — the group's queue is the subscription's, so they are
re-matched by the subscription's filter, not by their source topic.

The filters are found through a registry in Redis and a trie cached per worker
(fences/filter_registry.py). Protocol: docs/protocol.md, "Filters and shared subscriptions".
"""

from __future__ import annotations

import logging

import anyio

from fencemq.errors import BadArgument, FenceMQError
from fencemq.fences import at_rest
from fencemq.fences.context import FenceContext
from fencemq.fences.filter_registry import FilterRegistry
from fencemq.fences.memory import is_oom
from fencemq.fences.priority import check_level
from fencemq.fences.publish import Publishing
from fencemq.fences.redis_errors import REDIS_FAILURES
from fencemq.fences.retained import Retained
from fencemq.fences.schedule import Scheduling, release_dedup_id
from fencemq.fences.subscribe import Subscription, Subscriptions
from fencemq.model.keys import QueueRef
from fencemq.model.messages import pack_body, unpack_delivery
from fencemq.model.topics import SHARE_PREFIX, check_topic_name, has_wildcard, parse_target

log = logging.getLogger(__name__)


def is_filter_target(target: str) -> bool:
    return target.startswith(SHARE_PREFIX) or has_wildcard(target)


class Shared:
    """Filter subscriptions (a client's own, or a ``$share`` group's) and the fan-out that feeds them."""

    def __init__(self, ctx: FenceContext, publishing: Publishing, subscriptions: Subscriptions,
                 scheduling: Scheduling) -> None:
        self.publishing = publishing
        self.scheduling = scheduling
        self.subscriptions = subscriptions
        self.redis = ctx.redis
        self.keys = ctx.keys
        self.config = ctx.config
        self.registry = FilterRegistry(ctx.redis, ctx.keys, ctx.shards, lambda: ctx.spawn)
        self.retained = Retained(ctx)
        subscriptions.on_queue_dropped = self._forget

    async def _forget(self, ref: QueueRef) -> None:
        await self.registry.unregister(ref)
        # A subscriber may have created the queue again between the drop and
        # the unregistering: then it must stay registered.
        if await at_rest.exists(self.redis, self.keys.queue(ref)):
            owner = ref.owner or ""
            share = owner[len(SHARE_PREFIX):] if owner.startswith(SHARE_PREFIX) else None
            await self.registry.register(ref, share, None if share else owner)

    async def subscribe(
        self,
        client: str,
        target: str,
        *,
        qos: int = 1,
        capacity: int | None = None,
        max_messages: int | None = None,
        lock_ms: int | None = None,
        strategy: str | None = None,
        offline: str | None = None,
        epoch: int | None = None,
        retained: bool = True,
    ) -> Subscription:
        """``retained=False``: the caller sends the retained messages itself, or none (MQTT's Retain Handling)."""
        parsed = parse_target(target)
        if parsed.share is None and (strategy is not None or offline is not None):
            raise BadArgument("STRATEGY, QUEUE-OFFLINE and SKIP-OFFLINE apply to shared subscriptions ($share/<group>/<filter>)")
        if parsed.share is not None:
            ref, group, mode = QueueRef(parsed.filter, None, SHARE_PREFIX + parsed.share), parsed.share, "shared"
        else:
            ref, group, mode = QueueRef(parsed.filter, None, client), "~" + client, "exclusive"
        sub = await self.subscriptions.subscribe(
            client, parsed.filter, group=group, mode=mode, start=("latest", None), qos=qos,
            capacity=capacity or self.config.mailbox_capacity, max_messages=max_messages, lock_ms=lock_ms,
            strategy=strategy, offline=offline, queue=ref, epoch=epoch,
        )
        await self.registry.register(ref, parsed.share, None if parsed.share else client)
        if parsed.share is None and sub.new_member and retained:
            await self._send_retained(ref, parsed.filter)  # MQTT 5: never to shared subscriptions
        return sub

    async def _send_retained(self, ref: QueueRef, filt: str) -> None:
        async for bodies in self.retained.matching(filt):
            for start in range(0, len(bodies), self.config.max_batch):
                await self.publishing.append(ref, bodies[start : start + self.config.max_batch])

    def check_publish(self, topic: str, payloads: list[bytes], *, lmq: str | None = None, qos: int = 1,
                      retain: bool = False, delay_ms: int | None = None, at_ms: int | None = None,
                      priority: int | None = None) -> QueueRef:
        """The queue a publish goes to, once every check that needs no Redis has passed, in the
        order a publish meets them: BADARG or LIMIT saying what to fix (NOPRIORITY: a PRIORITY for an lmq)."""
        check_level(priority, QueueRef(topic, lmq))
        if lmq is None:
            check_topic_name(topic)
        elif retain:
            raise BadArgument("RETAIN applies to plain topics, not lite queues")
        if retain and (delay_ms is not None or at_ms is not None):
            raise BadArgument("RETAIN keeps the last message now; it takes no DELAY or AT")
        return self.publishing.check(topic, payloads, lmq=lmq, qos=qos, delay_ms=delay_ms, at_ms=at_ms)

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
        retain: bool = False,
        delay_ms: int | None = None,
        at_ms: int | None = None,
        ttl_ms: int | None = None,
        priority: int | None = None,
    ) -> list[str]:
        """Publish to the topic's own queue, then copy to every matching filter. With ``delay_ms`` or
        ``at_ms``, scheduled: stored in the topic's queue, released and copied when due
        (:meth:`release_due`). With ``ttl_ms``, it expires that long after it becomes deliverable:
        every copy (and a retained one) carries the one deadline. With ``priority`` (0–9), at that level in a
        queue set to honour priority (fences/priority.py; NOPRIORITY elsewhere); the copies to filter
        subscriptions have none."""
        ref = self.check_publish(topic, payloads, lmq=lmq, qos=qos, retain=retain, delay_ms=delay_ms, at_ms=at_ms,
                                 priority=priority)
        headers = await self.publishing.expiring(headers, ttl_ms, delay_ms, at_ms)
        if delay_ms is not None or at_ms is not None:
            return (await self.publishing.publish_checked(ref, payloads, None, qos=qos, dedup_ids=dedup_ids,
                                                          headers=headers, producer=producer, delay_ms=delay_ms,
                                                          at_ms=at_ms, priority=priority))[0]
        return await self._publish_checked(ref, payloads, qos=qos, dedup_ids=dedup_ids, headers=headers,
                                           producer=producer, retain=retain, priority=priority)

    async def publish_many(
        self,
        topic: str,
        commands: list[list[bytes]],
        *,
        lmq: str | None = None,
        qos: int = 1,
        dedup_ids: list[list[str | None] | None] | None = None,
        headers: dict[str, str] | None = None,
        producer: str | None = None,
    ) -> list[list[str] | Exception]:
        """Pipelined publishes to one queue (RESP PUBs, an MQTT PUBLISH run), each command's
        payloads: one outcome per command, its ids or its refusal as an exception.

        A batch is an optimisation, never a semantic: each command is checked as it would be
        alone, only those that pass are merged, into calls of at most max_batch messages that
        never split a command (an MPUB stays atomic). A call that fails is every one of its
        commands' failure: none runs again, since the call may have committed.
        """
        outcomes: list[list[str] | Exception | None] = [None] * len(commands)
        passed: list[int] = []
        ref: QueueRef | None = None
        for i, payloads in enumerate(commands):
            try:
                ref = self.check_publish(topic, payloads, lmq=lmq, qos=qos)
            except FenceMQError as exc:
                outcomes[i] = exc
                continue
            passed.append(i)
        calls: list[list[int]] = []
        size = self.config.max_batch
        for i in passed:
            if size + len(commands[i]) > self.config.max_batch:
                calls.append([])
                size = 0
            calls[-1].append(i)
            size += len(commands[i])
        for call in calls:
            assert ref is not None
            payloads = [p for i in call for p in commands[i]]
            dedup = None  # a command without dedup ids: "" for each of its messages
            if dedup_ids is not None and any(dedup_ids[i] for i in call):
                dedup = [d for i in call for d in (dedup_ids[i] or [""] * len(commands[i]))]
            try:
                ids = await self._publish_checked(ref, payloads, qos=qos, dedup_ids=dedup, headers=headers,
                                                  producer=producer)
            except (FenceMQError, *REDIS_FAILURES) as exc:
                for i in call:
                    outcomes[i] = exc
                continue
            at = 0
            for i in call:
                outcomes[i] = ids[at:at + len(commands[i])]
                at += len(commands[i])
        return outcomes  # type: ignore[return-value]

    async def release_due(self, ref: QueueRef, now_ms: int) -> int:
        """Release the scheduled messages of ``ref`` due by ``now_ms`` (the sweeper's clock reading):
        a plain topic's are first copied to the filter subscriptions that match it now — with dedup
        ids of their schedule ids, so a sweep that dies in between and is run again copies nothing
        twice — then appended to its log (lua/release.lua), at most ``sweep_batch`` per call, until
        none is due. Returns how many were released."""
        released = 0
        limit = self.config.max_batch
        while True:
            if not ref.lite and not ref.is_filter:
                refs = await self.registry.matching(ref.topic)
                due = await self.scheduling.due(ref, now_ms, self.config.sweep_batch) if refs else []
                for start in range(0, len(due), limit):
                    chunk = due[start:start + limit]
                    copies = [self._copy_body(ref.topic, body) for _, body in chunk]
                    dedup: list[str | None] = [release_dedup_id(ref, sid) for sid, _ in chunk]
                    async with anyio.create_task_group() as tg:
                        for target in refs:
                            tg.start_soon(self.publishing.append, target, copies, dedup)
            ids, next_due = await self.scheduling.release(ref, now_ms)
            released += len(ids)
            if not ids or next_due < 0 or next_due > now_ms:
                return released

    @staticmethod
    def _copy_body(topic: str, stored: bytes) -> bytes:
        """A scheduled message's stored body as a filter queue's copy (it names its source topic)."""
        d = unpack_delivery(topic, None, 0, b"", 0, 1, stored)
        return pack_body(d.payload, d.headers or None, d.qos, d.producer, topic)

    async def _publish_checked(self, ref: QueueRef, payloads: list[bytes], *, qos: int,
                               dedup_ids: list[str | None] | None, headers: dict[str, str] | None,
                               producer: str | None, retain: bool = False, priority: int | None = None) -> list[str]:
        topic = ref.topic
        if ref.lite:
            return (await self.publishing.publish_checked(ref, payloads, None, qos=qos, dedup_ids=dedup_ids,
                                                          headers=headers, producer=producer))[0]
        # The registry's version is read in the publish's round trip: a filter SUB answered
        # before this publish began has raised it already, so the copies below reach it.
        version_key = self.registry.version_key(topic)
        ids, version = await self.publishing.publish_checked(
            ref, payloads, version_key, qos=qos, dedup_ids=dedup_ids, headers=headers,
            producer=producer, priority=priority,
        )
        if retain:
            # The last retained message per topic; an empty payload clears it.
            if payloads[-1]:
                try:
                    await self.retained.keep(topic, pack_body(payloads[-1], headers, qos, producer, topic))
                except REDIS_FAILURES as exc:
                    if is_oom(exc):  # past the watermark between two samples: the publish is stored, not retained
                        raise self.publishing.ctx.memory.refused_by_redis(exc) from None
                    raise
            else:
                await self.retained.clear(topic)
        if await self.registry.after_subscribes(topic):
            refs = await self.registry.matching(topic)  # the version again: they have raised it
        else:
            refs = await self.registry.matching(topic, version, version_key)
        if refs:
            # a copy names its source topic (the filter queue's is the filter)
            bodies = [pack_body(p, headers, qos, producer, topic) for p in payloads]
            try:
                async with anyio.create_task_group() as tg:
                    for ref in refs:
                        # the producer's dedup ids go with every copy: a repeated publish adds
                        # nothing anywhere, and completes a fan-out a crash cut short
                        tg.start_soon(self.publishing.append, ref, bodies, dedup_ids)
            except* FenceMQError as group:  # a copy refused (FULL at maxmemory): the publish's answer is its error
                raise group.exceptions[0] from None
        return ids
