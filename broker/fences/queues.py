"""The core operations as an async API: publish, subscribe, pull, settle, seek.

Each operation validates its input, names the keys through the keyspace and
runs exactly one fence (one atomic Lua call) on the queue's slot. The global
lease schedule lives in another slot, so it is updated after the fence with
ZADD LT; a schedule entry that is too early only costs an empty sweep.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from redis.asyncio import Redis
from redis.exceptions import RedisError

from fencemq.fences import session_index
from fencemq.config import Config
from fencemq.errors import BadArgument, FenceMQError, LimitExceeded
from fencemq.model.keys import Handle, Keyspace, QueueRef, check_name, check_topic
from fencemq.model.messages import Delivery, pack_body, unpack_delivery
from fencemq.fences.registry import Fences

log = logging.getLogger(__name__)

MODES = ("exclusive", "shared", "single-active")
POLICIES = ("preempt", "reject")
FROM_KINDS = ("earliest", "latest", "id", "time")
STRATEGIES = ("round-robin", "sticky", "hash")


@dataclass(slots=True)
class Subscription:
    handle: str
    mode: str
    epoch: int
    owner: str
    evicted: str | None
    returned: int
    cursor: int
    qos: int = 1
    new_member: bool = False

    def as_reply(self) -> dict[str, object]:
        reply: dict[str, object] = {"handle": self.handle, "mode": self.mode, "epoch": self.epoch, "qos": self.qos}
        if self.owner:
            reply["owner"] = self.owner
        return reply


@dataclass(slots=True)
class PullResult:
    epoch: int
    status: str  # ok | evicted | suspected | standby | ended
    deliveries: list[Delivery] = field(default_factory=list)


@dataclass(slots=True)
class SweepResult:
    next_due: int
    returned: int
    timeouts: list[tuple[str, str, list[str], str]]  # group, member, tags, new active member
    newly_suspected: list[tuple[str, str]] = field(default_factory=list)  # (group, member)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Queues:
    """Core operations over one Redis connection pool."""

    def __init__(self, redis: Redis, config: Config) -> None:
        self.redis = redis
        self.config = config
        self.keys = Keyspace(config.prefix)
        self.fences = Fences(redis)
        self._topic_kinds: dict[str, str] = {}
        self.on_queue_dropped: Callable[[QueueRef], Awaitable[None]] | None = None
        # Set by a worker: run schedule writes beside the reply instead of before it.
        self.spawn: Callable[..., None] | None = None

    # -- topics -----------------------------------------------------------------

    async def _check_topic_kind(self, topic: str, lite: bool) -> None:
        """A topic is lite or plain for good; using it the other way is BADARG."""
        want = "lite" if lite else "plain"
        kind = self._topic_kinds.get(topic)
        if kind is None:
            key = self.keys.topic(topic)
            await self.redis.hsetnx(key, "kind", want)
            kind = _text(await self.redis.hget(key, "kind"))
            self._topic_kinds[topic] = kind
        if kind != want:
            how = "with LMQ name" if kind == "lite" else "without LMQ"
            raise BadArgument(f"topic {topic!r} is a {kind} topic; use it {how}")

    def _idle_ttl(self, ref: QueueRef) -> int:
        return self.config.lmq_idle_ttl_ms if ref.lite else 0

    def _journal_cap(self, ref: QueueRef) -> int:
        return self.config.lite_journal_cap if ref.lite else self.config.journal_cap

    def _queue(self, topic: str, lmq: str | None) -> QueueRef:
        check_topic(topic)
        if lmq is not None:
            check_name(lmq, "lmq")
        return QueueRef(topic, lmq)

    # -- publish ----------------------------------------------------------------

    async def publish(
        self,
        topic: str,
        payloads: list[bytes],
        *,
        lmq: str | None = None,
        qos: int = 1,
        dedup_ids: list[str] | None = None,
        headers: dict[str, str] | None = None,
        producer: str | None = None,
    ) -> list[str]:
        ref = self._queue(topic, lmq)
        if not payloads:
            raise BadArgument("nothing to publish; give at least one payload")
        if len(payloads) > self.config.max_batch:
            raise LimitExceeded(f"batch of {len(payloads)} exceeds {self.config.max_batch} messages; split it")
        if qos not in (0, 1):
            raise BadArgument("QOS must be 0 or 1")
        for p in payloads:
            if len(p) > self.config.max_payload:
                raise LimitExceeded(f"payload of {len(p)} bytes exceeds {self.config.max_payload}; split it")
        await self._check_topic_kind(topic, lmq is not None)
        return await self.append(ref, [pack_body(p, headers, qos, producer) for p in payloads], dedup_ids)

    async def append(self, ref: QueueRef, bodies: list[bytes], dedup_ids: list[str] | None = None) -> list[str]:
        """Append packed bodies to one queue and fill its push members' mailboxes."""
        k = self.keys.queue(ref)
        args: list[Any] = [
            self.config.retention_maxlen,
            self.config.retention_maxage_ms,
            self.config.dedup_window_ms,
            self._idle_ttl(ref),
            len(bodies),
            self._journal_cap(ref),
        ]
        for body, dedup in zip(bodies, dedup_ids or [""] * len(bodies), strict=True):
            args.append(body)
            args.append(dedup)
        ids, push_members = await self.fences.call(
            "publish", [k.meta, k.log, k.dedup, k.dedup_ids, k.wake, k.dead, k.journal], args
        )
        if push_members:
            await self.dispatch(ref, [tuple(_text(line).split("\t", 1)) for line in push_members.split(b"\n")])
        return [_text(i) for i in ids]

    async def dispatch(self, ref: QueueRef, members: list[tuple[str, str]]) -> list[int]:
        """Fill these members' push mailboxes; returns how many each got."""
        k = self.keys.queue(ref)
        keys = [*k.lease_keys(), k.wake, *(k.mailbox(g, m) for g, m in members), k.journal]
        return await self.fences.call("dispatch", keys, [x for pair in members for x in pair])

    async def push_members(self, ref: QueueRef) -> list[tuple[str, str]]:
        raw = await self.redis.hget(self.keys.queue(ref).meta, "push")
        return [tuple(_text(line).split("\t", 1)) for line in raw.split(b"\n")] if raw else []

    # -- subscribe ---------------------------------------------------------------

    async def subscribe(
        self,
        client: str,
        topic: str,
        *,
        lmq: str | None = None,
        group: str | None = None,
        mode: str | None = None,
        policy: str | None = None,
        start: tuple[str, int | None] = ("earliest", None),
        lock_ms: int | None = None,
        epoch: int | None = None,
        max_messages: int | None = None,
        capacity: int | None = None,
        qos: int = 1,
        on_preempt: str | None = None,
        strategy: str | None = None,
        skip_offline: bool = False,
        queue: QueueRef | None = None,
    ) -> Subscription:
        """Join a subscription. ``queue`` names a filter subscription's own queue."""
        ref = queue or self._queue(topic, lmq)
        check_name(client, "client")
        if group is not None:
            check_name(group, "group")
        else:
            # Lite queues are held per group; without GROUP a plain topic
            # subscription is the client's own.
            group = "default" if lmq is not None else "~" + client
        if mode is not None and mode not in MODES:
            raise BadArgument(f"MODE must be one of {', '.join(MODES)}")
        if policy is not None and policy not in POLICIES:
            raise BadArgument("POLICY must be preempt or reject")
        if start[0] not in FROM_KINDS:
            raise BadArgument("FROM takes earliest, latest, ID id or TIME ms")
        if lock_ms is not None and not 0 < lock_ms <= self.config.max_lock_ms:
            raise BadArgument(f"LOCK must be between 1 and {self.config.max_lock_ms} ms")
        if max_messages is not None and max_messages < 0:
            raise BadArgument("MAX must be 0 or more")
        if capacity is not None and not 0 < capacity <= 1_000_000:
            raise BadArgument("CAPACITY must be between 1 and 1000000")
        if qos not in (0, 1):
            raise BadArgument("QOS must be 0 or 1")
        if on_preempt is not None and on_preempt not in ("keep", "earliest", "latest"):
            raise BadArgument("ON-PREEMPT must be keep, earliest or latest")
        if strategy is not None and strategy not in STRATEGIES:
            raise BadArgument(f"STRATEGY must be one of {', '.join(STRATEGIES)}")
        if queue is None:
            await self._check_topic_kind(topic, lmq is not None)
        held = Handle(ref, group, client)
        handle = held.encode()
        if ref.lite:
            await self._check_lite_quota(client, topic, held)
        # The session learns of the handle before the fence makes the
        # membership: whatever fails next, its end will leave it (idempotently).
        added = await session_index.add(self.redis, self.keys, held)
        # Without GROUP the subscription is the client's own: exclusive to it.
        default_mode = "exclusive" if (lmq is not None or group.startswith("~")) else "shared"
        k = self.keys.queue(ref)

        def opt(v: object) -> object:
            return "" if v is None else v

        try:
            res = await self.fences.call(
                "subscribe",
                [k.meta, k.log, k.checkouts, k.deadlines, k.owned, k.ready, k.wake, k.delayed, k.dedup, k.dedup_ids,
                 k.dead, k.journal],
                [
                    group, client, opt(mode), default_mode, opt(policy), start[0], opt(start[1]), opt(lock_ms),
                    opt(epoch), opt(max_messages), opt(capacity), qos, opt(on_preempt), self._journal_cap(ref),
                    opt(strategy), int(skip_offline), int(ref.lite),
                ],
            )
        except FenceMQError:
            if added:  # refused (BADARG, BUSY): nothing to leave
                await session_index.remove(self.redis, self.keys, held)
            raise
        if ref.lite and int(res[6]):
            await self.redis.hincrby(self.keys.session_lite_counts(client), topic, 1)
        if capacity is not None:
            # All of the queue's push members: a shared group's strategy sees its whole group.
            await self.dispatch(ref, await self.push_members(ref))
        evicted = _text(res[3]) or None
        return Subscription(
            handle, _text(res[0]), int(res[1]), _text(res[2]), evicted, int(res[4]), int(res[5]), qos,
            new_member=bool(int(res[6])),
        )

    async def _check_lite_quota(self, client: str, topic: str, handle: Handle) -> None:
        held = int(await self.redis.hget(self.keys.session_lite_counts(client), topic) or 0)
        if held >= self.config.lite_quota and not await session_index.contains(self.redis, self.keys, handle):
            raise LimitExceeded(
                f"client {client} holds {held} lite subscriptions of {topic!r}, the quota; unsubscribe some first"
            )

    async def drop_if_empty(self, ref: QueueRef) -> bool:
        """Delete a filter subscription's queue once no member is left (MQTT groups)."""
        k = self.keys.queue(ref)
        dropped = bool(await self.fences.call("drop_if_empty", k.all_keys(), []))
        if dropped and self.on_queue_dropped is not None:
            await self.on_queue_dropped(ref)
        return dropped

    async def set_presence(self, handles: list[Handle], online: bool) -> None:
        for h in handles:
            k = self.keys.queue(h.queue)
            await self.fences.call("presence", [k.meta, k.journal], [h.group, h.member, int(online)])

    async def evict(self, handle: Handle, by: str = "operator") -> int:
        """Fence a member off its subscription; -1 when it is not a member."""
        k = self.keys.queue(handle.queue)
        return int(await self.fences.call(
            "evict", [k.meta, k.log, k.checkouts, k.deadlines, k.owned, k.ready, k.wake, k.journal],
            [handle.group, handle.member, by],
        ))

    async def marked(self, handles: list[Handle]) -> list[str | None]:
        """Who evicted each member (its eviction marker), None where unmarked."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for h in handles:
                pipe.hget(self.keys.queue(h.queue).meta, f"m|{h.group}|{h.member}|mk")
            return [None if v is None else _text(v) for v in await pipe.execute()]

    # -- pull and settle ----------------------------------------------------------

    async def pull(self, handle: Handle, count: int = 1) -> PullResult:
        if not 0 < count <= self.config.max_batch:
            raise BadArgument(f"COUNT must be between 1 and {self.config.max_batch}")
        k = self.keys.queue(handle.queue)
        res = await self.fences.call(
            "pull", [*k.lease_keys(), k.journal], [handle.group, handle.member, count, self.config.default_lock_ms]
        )
        epoch, deadline, status = int(res[0]), int(res[1]), _text(res[2])
        topic, lmq = handle.queue.topic, handle.queue.lmq
        deliveries = [
            unpack_delivery(topic, lmq, epoch, res[i], int(res[i + 1]), int(res[i + 2]), res[i + 3])
            for i in range(3, len(res), 4)
        ]
        if deadline >= 0:
            await self._schedule_soon(handle.queue.qid, deadline)
        return PullResult(epoch, status, deliveries)

    def _tags(self, tags: list[str]) -> list[str]:
        if not tags:
            raise BadArgument("give at least one delivery tag")
        if len(tags) > self.config.max_batch:
            raise LimitExceeded(f"{len(tags)} tags exceed {self.config.max_batch}; settle in smaller batches")
        return tags

    async def ack(self, handle: Handle, tags: list[str]) -> int:
        k = self.keys.queue(handle.queue)
        return int(
            await self.fences.call(
                "ack",
                [k.meta, k.checkouts, k.deadlines, k.owned, k.ready, k.delayed, k.log, k.dedup, k.dedup_ids, k.dead,
                 k.journal],
                [handle.group, handle.member, self._idle_ttl(handle.queue), *self._tags(tags)],
            )
        )

    async def nack(self, handle: Handle, tags: list[str], *, delay_ms: int = 0, discard: bool = False) -> int:
        if not 0 <= delay_ms <= self.config.max_lock_ms:
            raise BadArgument(f"DELAY must be between 0 and {self.config.max_lock_ms} ms")
        k = self.keys.queue(handle.queue)
        res = await self.fences.call(
            "nack",
            [*k.lease_keys(), k.dead, k.wake, k.journal],
            [handle.group, handle.member, delay_ms, int(discard), self.config.max_failures, *self._tags(tags)],
        )
        if int(res[2]) >= 0:
            await self.schedule(handle.queue.qid, int(res[2]))
        return int(res[0])

    async def renew(self, handle: Handle, tags: list[str], *, lock_ms: int | None = None) -> int:
        if lock_ms is not None and not 0 < lock_ms <= self.config.max_lock_ms:
            raise BadArgument(f"LOCK must be between 1 and {self.config.max_lock_ms} ms")
        k = self.keys.queue(handle.queue)
        res = await self.fences.call(
            "renew",
            [k.meta, k.checkouts, k.deadlines],
            [handle.group, handle.member, lock_ms or 0, self.config.default_lock_ms, *self._tags(tags)],
        )
        if int(res[0]):
            # A shorter LOCK can move a deadline before the queue's schedule entry.
            await self._schedule_soon(handle.queue.qid, int(res[1]))
        return int(res[0])

    async def unsubscribe(self, handle: Handle, *, session_over: bool = False) -> int:
        """Leave the subscription; all checkouts go back at once. Idempotent.

        A push member that cancels keeps its handle until it TAKEs the
        end-of-stream sentinel seated here; when its session is over it goes
        at once.
        """
        k = self.keys.queue(handle.queue)
        res = await self.fences.call(
            "unsubscribe",
            [k.meta, k.log, k.checkouts, k.deadlines, k.owned, k.ready, k.wake, k.mailbox(handle.group, handle.member),
             k.delayed, k.dedup, k.dedup_ids, k.dead, k.journal],
            [handle.group, handle.member, "leave" if session_over else "cancel", self._idle_ttl(handle.queue)],
        )
        await session_index.remove(self.redis, self.keys, handle)
        if handle.queue.lite and int(res[2]):
            await self.redis.hincrby(self.keys.session_lite_counts(handle.member), handle.queue.topic, -1)
        if int(res[0]):
            # The returned messages go to another member now, not at the next publish.
            members = await self.push_members(handle.queue)
            if members:
                await self.dispatch(handle.queue, members)
        if int(res[2]) and handle.queue.is_filter:
            await self.drop_if_empty(handle.queue)
        return int(res[0])

    async def end_after(self, handle: Handle, max_messages: int) -> bool:
        """Arm MAX: end after that many deliveries in total; True if already ended."""
        k = self.keys.queue(handle.queue)
        res = await self.fences.call(
            "end_after",
            [*k.lease_keys(), k.wake, k.mailbox(handle.group, handle.member), k.journal],
            [handle.group, handle.member, max_messages],
        )
        return bool(res)

    async def take(self, handle: Handle) -> Delivery | None | str:
        """Next delivery from the member's push mailbox, None when empty, "EOS" at the end."""
        k = self.keys.queue(handle.queue)
        res = await self.fences.call(
            "take",
            [*k.lease_keys(), k.wake, k.mailbox(handle.group, handle.member), k.journal],
            [handle.group, handle.member, self.config.default_lock_ms],
        )
        kind = _text(res[0])
        if kind != "eos" and int(res[-1]):
            # A shared group's member took one: the group's strategy refills.
            await self.dispatch(handle.queue, await self.push_members(handle.queue))
        if kind == "eos":
            await session_index.remove(self.redis, self.keys, handle)
            if handle.queue.lite:
                await self.redis.hincrby(self.keys.session_lite_counts(handle.member), handle.queue.topic, -1)
            if handle.queue.is_filter:
                await self.drop_if_empty(handle.queue)
            return "EOS"
        if kind == "none":
            return None
        epoch, deadline, tag, msg_id, acq, body, _refill = res[1:]
        if int(deadline) >= 0:
            await self._schedule_soon(handle.queue.qid, int(deadline))
        return unpack_delivery(handle.queue.topic, handle.queue.lmq, int(epoch), tag, int(msg_id), int(acq), body)

    async def seek(self, handle: Handle, kind: str, arg: int | None = None) -> tuple[int, int, bool]:
        """Move the group's cursor; returns (new epoch, cursor, clamped to retention)."""
        if kind not in FROM_KINDS:
            raise BadArgument("SEEK takes ID id, TIME ms, EARLIEST or LATEST")
        k = self.keys.queue(handle.queue)
        res = await self.fences.call(
            "seek", [*k.lease_keys(), k.wake, k.journal], [handle.group, kind, "" if arg is None else arg]
        )
        return int(res[0]), int(res[1]), bool(int(res[2]))

    # -- leases -------------------------------------------------------------------

    async def _schedule_soon(self, qid: str, due_ms: int) -> None:
        if self.spawn is not None:
            self.spawn(self._schedule_quietly, qid, due_ms)
        else:
            await self.schedule(qid, due_ms)

    async def _schedule_quietly(self, qid: str, due_ms: int) -> None:
        try:
            await self.schedule(qid, due_ms)
        except RedisError as exc:  # the session's lease expiry returns the checkouts anyway
            log.warning("could not schedule the sweep of %s: %s", qid, exc)

    async def schedule(self, qid: str, due_ms: int) -> None:
        await self.redis.zadd(self.keys.schedule, {qid: due_ms}, lt=True)

    async def sweep(self, qid: str) -> SweepResult:
        """Return one queue's expired leases and reschedule it."""
        k = self.keys.queue_by_id(qid)
        res = await self.fences.call(
            "sweep", [*k.lease_keys(), k.wake, k.journal], [self.config.sweep_batch]
        )
        next_due = int(res[0])
        if next_due < 0:
            await self.redis.zrem(self.keys.schedule, qid)
        else:
            await self.redis.zadd(self.keys.schedule, {qid: next_due})
        # A checkout made between the sweep and the line above was scheduled
        # with LT against the old (due) entry, which we just overwrote: look again.
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrange(k.deadlines, 0, 0, withscores=True)
            pipe.zrange(k.delayed, 0, 0, withscores=True)
            firsts = await pipe.execute()
        dues = [int(f[0][1]) for f in firsts if f]
        if dues:
            await self.schedule(qid, min(dues))
        timeouts = [(_text(g), _text(m), [_text(t) for t in tags], _text(s)) for g, m, tags, s, _ in res[2]]
        newly = [(_text(g), _text(m)) for g, m, _, _, fresh in res[2] if int(fresh)]
        return SweepResult(next_due, int(res[1]), timeouts, newly)

    async def due_queues(self, now_ms: int, limit: int = 100) -> list[str]:
        return [_text(q) for q in await self.redis.zrangebyscore(self.keys.schedule, "-inf", now_ms, 0, limit)]
