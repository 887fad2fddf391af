"""Client sessions: one client id, one live connection, a lease in Redis.

``HELLO … SETNAME id`` binds a session to a connection (lua/session_bind.lua);
the same id binding again takes the session over and the older connection is
told to close. A connected session is kept alive by its worker
(lua/session_alive.lua) and is never without a lease; a dropped connection
stops the refresh, so the session ends when its lease runs out — found by any
worker's sweeper, which makes a dead worker's sessions someone else's job. A
session that ends leaves every subscription it held: all its checkouts go
back to their queues and its markers are removed.

Ending is atomic against a reconnect: the cleaner holds the session's
``ending`` lock (lua/session_lock.lua, which also re-checks that the lease
really ran out) from the first unsubscribe to the deletion of the session's
keys (lua/session_finish.lua); a bind meanwhile waits for the end and gets a
fresh session, and a keep-alive meanwhile learns that its session is gone.
A session whose worker still holds its own lease is that worker's to end:
another worker's sweeper leaves it alone until the worker has been silent for
a whole session lease more (a Redis outage shorter than that ends no
connected session).
"""

from __future__ import annotations

import secrets
import time
import uuid
from dataclasses import dataclass
from collections.abc import Callable, Collection
from typing import Any

import anyio

import msgpack
from redis.asyncio import Redis

from fencemq.errors import Busy
from fencemq.fences import session_index
from fencemq.fences.context import FenceContext
from fencemq.fences.registry import fence
from fencemq.fences.lite import Lite, unsubscribe_notice
from fencemq.fences.gathering import Gathering
from fencemq.fences.redis_client import pipeline_then_publish_all
from fencemq.fences.subscribe import Subscriptions
from fencemq.model.handles import Handle
from fencemq.model.keys import QueueRef
from fencemq.model.values import text

MAX_QUEUED_NOTICES = 1000
LOCK_TTL_MS = 10_000  # a cleaner renews its lock while it works; one that died is followed after this
BIND_WAIT_S = LOCK_TTL_MS / 1000 + 1

SESSION_BIND = fence("session_bind", "session ending conns", "conn worker lease_ms takeover")
SESSION_LEAVE = fence("session_leave", "session ending conns", "conn lease_ms")
SESSION_ALIVE = fence("session_alive", "session ending", "lease_ms")
SESSION_LOCK = fence("session_lock", "session ending", "token ttl_ms force")
SESSION_FINISH = fence("session_finish", "session ending", "token", keys_rest="state")
SESSION_UNLOCK = fence("session_unlock", "ending", "token")
SESSION_UNLIST = fence("session_unlist", "sessions", "client upto")
SESSION_LINGER = fence("session_linger", "session ending conns", "lease_ms")
SESSION_NOTIFY = fence("session_notify", "notices channel", "cap announce", argv_rest="notices")


@dataclass(frozen=True, slots=True)
class _Bind:
    client: str
    connection: str
    worker: str
    takeover: int
    fresh: int


class SessionEnding(Busy):
    """The session is being ended right now; bind again once it is over."""


class RedisClock:
    """Milliseconds on Redis's clock, so every worker's leases agree."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self.offset_ms = 0.0
        self.synced_at = -1e9

    async def now_ms(self) -> int:
        local = time.time() * 1000
        if local - self.synced_at > 5000:
            # Redis read TIME somewhere within the round trip: its middle is the best guess (off by at
            # most half of it). A slow first trip (a connection being made, a loaded machine: it put
            # message expiry deadlines 250 ms late) is tried again, and the quicker one kept.
            best = None
            for _ in range(3):
                before = time.time() * 1000
                seconds, micros = await self.redis.time()
                after = time.time() * 1000
                if best is None or after - before < best[0]:
                    best = (after - before, seconds * 1000 + micros / 1000 - (before + after) / 2)
                if after - before <= 5:
                    break
            self.offset_ms = best[1]
            self.synced_at = local = time.time() * 1000
        return int(local + self.offset_ms)


def announce_many(packed: list[bytes]) -> bytes:
    """One session-channel message for several packed notices: a msgpack array of them
    (its header, then the notices as they are: nothing is packed twice)."""
    n = len(packed)
    header = bytes([0x90 | n]) if n < 16 else (b"\xdc" + n.to_bytes(2, "big") if n < 65536 else b"\xdd" + n.to_bytes(4, "big"))
    return header + b"".join(packed)


def timeout_notice(handle: Handle, tags: list[str], successor: str = "") -> dict[str, Any]:
    """The ``message_timeout`` notice (docs/protocol.md, "Notices") of tags whose leases ran out."""
    ref = handle.queue
    notice: dict[str, Any] = {"type": "message_timeout", "handle": handle.encode(), "topic": ref.topic, "tags": tags}
    if ref.lmq is not None:
        notice["lmq"] = ref.lmq
    if successor:
        notice["replaced_by"] = successor
    return notice


class Sessions:
    def __init__(self, ctx: FenceContext, subscriptions: Subscriptions, lite: Lite, clock: RedisClock,
                 lease_ms: int) -> None:
        self.ctx = ctx
        self.redis = ctx.redis
        self.keys = ctx.keys
        self.fences = ctx.fences
        self.subscriptions = subscriptions
        self.lite = lite
        self.clock = clock
        self.lease_ms = lease_ms
        # the binds and presence changes of concurrent connects (a reconnect storm) go out together
        self._binds: Gathering[_Bind, Any] = Gathering(self._bind_batch, lambda: ctx.spawn)
        self._presence: Gathering[tuple[str, bool], None] = Gathering(self._presence_batch, lambda: ctx.spawn)
        self._leaves: Gathering[tuple[str, str, int], Any] = Gathering(self._leave_batch, lambda: ctx.spawn)
        self._lingers: Gathering[tuple[str, int], Any] = Gathering(self._linger_batch, lambda: ctx.spawn)

    def _session_keys(self, client: str) -> dict[str, str]:
        return {"session": self.keys.session(client), "ending": self.keys.session_ending(client)}

    async def bind(self, client: str, connection: str, worker: str, *, takeover: bool = False,
                   fresh: bool = False) -> tuple[int, int]:
        """Bind the session to this connection; waits out a session's end in progress, then binds fresh.

        The connection joins the others that share the session (a client's
        pool), unless ``takeover``: then they are told to close. Returns the
        session's generation (1: this bind created it; more: it was there, and
        is resumed) and how many connections share it now.
        """
        call = _Bind(client, connection, worker, int(takeover), int(fresh))
        # The wait for an end under way is bounded, never a bind in flight: cancelled, that one
        # may have bound in Redis all the same (a worker behind in a connect storm).
        until = time.monotonic() + BIND_WAIT_S
        while True:
            res = await self._binds(call)
            if res[0] in (b"bound", "bound"):
                return int(res[1]), int(res[3])
            if time.monotonic() >= until:
                raise SessionEnding(f"the session of {client} is being ended; connect again in a moment")
            await anyio.sleep(0.05)

    async def _bind_batch(self, calls: list[_Bind]) -> list[Any]:
        """SESSION_BIND for each call in one pipeline, then the bound sessions' leases in the
        sessions index (one ZADD) and the takeover notices (PUBLISH) in one more round trip.
        A call's reply is its fence's (or its error); ``ending`` ones are the caller's to retry."""
        replies = await self.fences.run_many(SESSION_BIND, [
            (None, {**self._session_keys(c.client), "conns": self.keys.session_conns(c.client)}, (),
             {"conn": c.connection, "worker": c.worker, "lease_ms": self.lease_ms, "takeover": c.takeover})
            for c in calls])
        deadlines: dict[str, int] = {}
        told: list[tuple[str, bytes]] = []
        for c, res in zip(calls, replies):
            if isinstance(res, Exception) or res[0] not in (b"bound", "bound"):
                continue
            deadlines[c.client] = max(int(res[2]), deadlines.get(c.client, 0))
            if c.takeover:
                # ``fresh``: the new connection starts the session afresh (MQTT Clean Start), which ends
                # the old one's session: its MQTT will goes at once rather than after its delay
                told.append((self.keys.session_channel(c.client),
                             msgpack.packb({"type": "takeover", "conn": c.connection, "fresh": c.fresh})))
        if deadlines:
            await self.ctx.set_scores(self.keys.sessions, deadlines, "GT")
        if told:
            await pipeline_then_publish_all(self.redis, lambda _pipe: None, told)
        return replies

    async def leave(self, client: str, connection: str, lease_ms: int = 0) -> int:
        """A connection of the session closes: how many connections still share it. The last one
        to leave starts the session's lease from now, ``lease_ms`` long (0: the lease stays as the
        last keep-alive left it), in the same step: a connectionless session never runs on an old
        lease, however far behind the worker is with its cleanups."""
        return int((await self._leaves((client, connection, lease_ms)))[0])

    async def _leave_batch(self, calls: list[tuple[str, str, int]]) -> list[Any]:
        replies = await self.fences.run_many(SESSION_LEAVE, [
            (None, {**self._session_keys(client), "conns": self.keys.session_conns(client)}, (),
             {"conn": connection, "lease_ms": lease_ms}) for client, connection, lease_ms in calls])
        deadlines = {client: int(r[1]) for (client, _, _), r in zip(calls, replies)
                     if not isinstance(r, Exception) and int(r[1])}
        if deadlines:
            await self.ctx.set_scores(self.keys.sessions, deadlines)  # not GT: it may be sooner
        return replies

    async def linger(self, client: str, lease_ms: int) -> bool:
        """A session none of whose connections is left lives ``lease_ms`` more (an MQTT Session
        Expiry Interval), shorter or longer than the worker's lease; False if a connection holds it."""
        return bool(await self._lingers((client, lease_ms)))

    async def _linger_batch(self, calls: list[tuple[str, int]]) -> list[Any]:
        replies = await self.fences.run_many(SESSION_LINGER, [
            (None, {**self._session_keys(client), "conns": self.keys.session_conns(client)}, (), {"lease_ms": lease_ms})
            for client, lease_ms in calls])
        deadlines = {client: int(r) for (client, _), r in zip(calls, replies) if not isinstance(r, Exception) and int(r)}
        if deadlines:
            await self.ctx.set_scores(self.keys.sessions, deadlines)  # not GT: it may be sooner
        return replies

    async def keep_alive(self, clients: list[str]) -> list[str]:
        """Move the leases of connected sessions on; returns those that are gone (their connections must close)."""
        if not clients:
            return []
        replies = await self.fences.run_many(
            SESSION_ALIVE, [(None, self._session_keys(c), (), {"lease_ms": self.lease_ms}) for c in clients])
        alive = {c: int(r) for c, r in zip(clients, replies) if isinstance(r, (int, bytes)) and int(r) > 0}
        if alive:
            # GT, not XX: a connected session is never without an entry (after an outage removed one)
            await self.ctx.set_scores(self.keys.sessions, alive, "GT")
        return [c for c, r in zip(clients, replies) if not isinstance(r, Exception) and int(r) == 0]

    async def end(self, client: str, *, force: bool = False) -> int | None:
        """End a session: leave every subscription, then delete it. Returns checkouts returned.

        Only once its lease has really run out, unless ``force`` (QUIT, an
        anonymous session's disconnect). None when there was nothing to do
        (alive after all, or another cleaner is at it).
        """
        token = uuid.uuid4().hex
        keys = self._session_keys(client)
        state = await self.fences.run(SESSION_LOCK, None, extra_keys=keys, token=token, ttl_ms=LOCK_TTL_MS,
                                      force=int(force))
        if state[0] not in (b"locked", "locked"):
            return None
        returned = 0
        try:
            for n, h in enumerate(await session_index.handles(self.redis, self.keys, client)):
                returned += await self.subscriptions.unsubscribe(h, session_over=True)
                if n % 100 == 99:
                    await self.redis.pexpire(keys["ending"], LOCK_TTL_MS)
        except BaseException:
            # what is left is the next sweep's (leaving is idempotent): let go of the session now
            with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                await self.fences.run(SESSION_UNLOCK, None, extra_keys=keys, token=token)
            raise
        rest = [self.keys.session_handles(client), self.keys.session_notices(client), self.keys.session_conns(client),
                self.keys.session_lite_counts(client), *session_index.bucket_keys(self.keys, client)]
        if await self.fences.run(SESSION_FINISH, None, extra_keys=keys, keys_rest=rest, token=token):
            await self.fences.run(SESSION_UNLIST, None, extra_keys={"sessions": self.keys.sessions}, client=client,
                                  upto=int(state[1]))
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
        await self._presence((client, online))

    async def _presence_batch(self, calls: list[tuple[str, bool]]) -> list[None]:
        """The memberships of many clients, read in one pipeline and marked in one more."""
        held = await self.ctx.linked.many([("SMEMBERS", self.keys.session_handles(client)) for client, _ in calls])
        marks = [(Handle.decode(text(raw)), online) for (_, online), raws in zip(calls, held) for raw in raws]
        if marks:
            await self.subscriptions.set_presence_many(marks)
        return [None] * len(calls)

    async def claim_expired(self, worker_id: str = "",
                            attached: Collection[str] | Callable[[], Collection[str]] = frozenset(),
                            limit: int = 100) -> list[str]:
        """Sessions whose lease ran out and that no live worker answers for: for end() to clean.

        A session bound through a worker that still holds its own lease is
        that worker's (``worker_id`` ends its own sessions that none of its
        connections holds, ``attached``: asked only when some lease ran out,
        since a worker with many connections takes a while to list them); another worker
        takes it only once that worker has been silent for a whole session
        lease more — so a Redis outage shorter than that ends no live session.
        end() itself re-checks the lease under the session's lock.
        """
        now = await self.clock.now_ms()
        expired = [c.decode() if isinstance(c, bytes) else c
                   for c in await self.redis.zrangebyscore(self.keys.sessions, "-inf", now, 0, limit)]
        if not expired:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for client in expired:
                pipe.hget(self.keys.session(client), "worker")
            workers = await pipe.execute()
        named = {w for w in workers if w}
        leases: dict[Any, float] = {}
        if named:
            scores = await self.redis.zmscore(self.keys.workers, list(named))
            leases = dict(zip(named, scores))
        mine = worker_id.encode()
        held = attached() if callable(attached) else attached
        return [c for c, w in zip(expired, workers)
                if c not in held and (not w or w == mine or (leases.get(w) or 0) < now - self.lease_ms)]

    async def notify(self, client: str, notice: dict[str, Any]) -> None:
        """Queue a notice for the client's next HEARTBEAT and push it if connected.

        Its ``nid`` lets a client that hears it both ways (pushed, then drained by
        HEARTBEAT) act on it once."""
        await self.notify_all([(client, notice)])

    async def notify_all(self, notices: list[tuple[str, dict[str, Any]]]) -> None:
        """:meth:`notify` for many (client, notice) pairs, in one round trip on one server: a
        client's notices are queued by one RPUSH and announced by one message (a list of them)."""
        by_client: dict[str, list[bytes]] = {}
        for client, notice in notices:
            by_client.setdefault(client, []).append(msgpack.packb({**notice, "nid": secrets.token_hex(8)}))

        replies = await self.fences.run_each([
            (SESSION_NOTIFY, None,
             {"notices": self.keys.session_notices(client), "channel": self.keys.session_channel(client)}, (),
             {"cap": MAX_QUEUED_NOTICES, "announce": packed[0] if len(packed) == 1 else announce_many(packed)},
             packed)
            for client, packed in by_client.items()])
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply

    async def tell_timeouts(self, ref: QueueRef, timeouts: list[tuple[str, str, list[str], str]]) -> None:
        """Each member a sweep took leases from (SweepResult.timeouts: group, member, tags, new active
        member) gets its ``message_timeout`` notice, all in one round trip: one member's failing session
        node keeps no other from its notice."""
        if timeouts:
            await self.notify_all([(member, timeout_notice(Handle(ref, group, member), tags, successor))
                                   for group, member, tags, successor in timeouts])

    async def drain_notices(self, client: str) -> list[dict[str, Any]]:
        key = self.keys.session_notices(client)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.lrange(key, 0, -1)
            pipe.delete(key)
            raw, _ = await pipe.execute()
        return [msgpack.unpackb(r) for r in raw]
