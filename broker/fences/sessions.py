"""Client sessions: one client id, one live connection, a lease in Redis.

``HELLO … SETNAME id`` binds a session to a connection; the same id binding
again takes the session over and the older connection is told to close.
Connected sessions are kept alive by their worker; a dropped connection stops
the refresh, so the session ends when its lease runs out — found by any
worker's sweeper, which makes a dead worker's sessions someone else's job. A
session that ends leaves every subscription it held: all its checkouts go
back to their queues and its markers are removed.
"""

from __future__ import annotations

import time
from typing import Any

import msgpack
from redis.asyncio import Redis

from fencemq.fences import session_index
from fencemq.fences.context import FenceContext
from fencemq.fences.lite import Lite, unsubscribe_notice
from fencemq.fences.redis_client import pipeline_then_publish
from fencemq.fences.subscribe import Subscriptions
from fencemq.model.keys import Handle

MAX_QUEUED_NOTICES = 1000
CLEANUP_RETRY_MS = 5_000


class RedisClock:
    """Milliseconds on Redis's clock, so every worker's leases agree."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self.offset_ms = 0.0
        self.synced_at = -1e9

    async def now_ms(self) -> int:
        local = time.time() * 1000
        if local - self.synced_at > 5000:
            seconds, micros = await self.redis.time()
            self.offset_ms = seconds * 1000 + micros / 1000 - local
            self.synced_at = local
        return int(local + self.offset_ms)


class Sessions:
    def __init__(self, ctx: FenceContext, subscriptions: Subscriptions, lite: Lite, clock: RedisClock,
                 lease_ms: int) -> None:
        self.redis = ctx.redis
        self.keys = ctx.keys
        self.subscriptions = subscriptions
        self.lite = lite
        self.clock = clock
        self.lease_ms = lease_ms

    async def bind(self, client: str, connection: str, worker: str) -> None:
        now = await self.clock.now_ms()

        def writes(pipe: Any) -> None:
            pipe.hset(self.keys.session(client), mapping={"conn": connection, "worker": worker, "since": now})
            pipe.zadd(self.keys.sessions, {client: now + self.lease_ms})

        takeover = msgpack.packb({"type": "takeover", "conn": connection})
        await pipeline_then_publish(self.redis, writes, self.keys.session_channel(client), takeover)

    async def keep_alive(self, clients: list[str]) -> None:
        if clients:
            deadline = await self.clock.now_ms() + self.lease_ms
            await self.redis.zadd(self.keys.sessions, {c: deadline for c in clients}, xx=True)

    async def end(self, client: str) -> int:
        """End a session now: leave every subscription. Returns checkouts returned."""
        returned = 0
        for h in await session_index.handles(self.redis, self.keys, client):
            returned += await self.subscriptions.unsubscribe(h, session_over=True)
        await self.redis.delete(
            self.keys.session(client), self.keys.session_handles(client), self.keys.session_notices(client),
            self.keys.session_lite_counts(client), *session_index.bucket_keys(self.keys, client),
        )
        await self.redis.zrem(self.keys.sessions, client)
        return returned

    async def resync(self, client: str, topic: str, group: str, lmqs: list[str]) -> None:
        """HEARTBEAT SYNC: the client's complete set of lmqs of (topic, group).

        Held but not listed: unsubscribed, markers included (a marker never
        outlives what the client says it holds). Listed and marked: the
        unsubscribe notice is sent again — notices are fire-and-forget, so
        every sync heals a lost one.
        """
        mine = await session_index.lite_handles(self.redis, self.keys, client, topic, group)
        held: dict[str, Handle] = {h.queue.lmq: h for h in mine}  # type: ignore[misc]
        listed = set(lmqs)
        for lmq, h in held.items():
            if lmq not in listed:
                await self.subscriptions.unsubscribe(h, session_over=True)
        still = [held[lmq] for lmq in lmqs if lmq in held]
        for h, marker in zip(still, await self.lite.marked(still)):
            if marker is not None:
                await self.notify(client, unsubscribe_notice(h, marker, resent=True))

    async def set_presence(self, client: str, online: bool) -> None:
        """Mark the client's memberships online or offline.

        Shared groups skip offline members when told to, and single-active
        groups never hand the active role to one. Lite subscriptions are left
        out: a client may hold a hundred thousand of them, and an lmq is held
        by its owner whether connected or not.
        """
        await self.subscriptions.set_presence(await session_index.non_lite_handles(self.redis, self.keys, client), online)

    async def claim_expired(self, limit: int = 100) -> list[str]:
        """Sessions whose lease ran out, claimed for cleaning.

        A claim moves the lease forward by CLEANUP_RETRY_MS instead of
        removing it: end() removes it once everything is left, so a cleaner
        that dies half-way is followed by another. Two cleaners at once are
        harmless — leaving a subscription is idempotent.
        """
        now = await self.clock.now_ms()
        expired = await self.redis.zrangebyscore(self.keys.sessions, "-inf", now, 0, limit)
        claimed = []
        for raw in expired:
            if await self.redis.zadd(self.keys.sessions, {raw: now + CLEANUP_RETRY_MS}, xx=True, gt=True, ch=True):
                claimed.append(raw.decode())
        return claimed

    async def notify(self, client: str, notice: dict[str, Any]) -> None:
        """Queue a notice for the client's next HEARTBEAT and push it if connected."""
        packed = msgpack.packb(notice)

        def queue(pipe: Any) -> None:
            pipe.rpush(self.keys.session_notices(client), packed)
            pipe.ltrim(self.keys.session_notices(client), -MAX_QUEUED_NOTICES, -1)

        await pipeline_then_publish(self.redis, queue, self.keys.session_channel(client), packed)

    async def drain_notices(self, client: str) -> list[dict[str, Any]]:
        key = self.keys.session_notices(client)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.lrange(key, 0, -1)
            pipe.delete(key)
            raw, _ = await pipe.execute()
        return [msgpack.unpackb(r) for r in raw]
