"""Pub/sub for one worker: queue wake-ups and per-session messages.

Long-polls wait on a queue's sharded channel (SSUBSCRIBE, slot-local on
Cluster) instead of polling. A waiter is registered before its final look at
the queue and the subscription is confirmed before that look, so a publish can
never fall between the look and the wait.

On one server one pub/sub connection carries everything. On a Cluster the
classic channels (this worker's control channel, sessions' channels: PUBLISH
reaches every node) ride one connection, and each master that owns a watched
queue's slot gets a connection of its own for the sharded channels, read by a
task of its own (redis-py's ClusterPubSub keeps them; one reader per master,
so a quiet master never delays another's wake-ups).

Redis fails over: no error of Redis's ever leaves this module's tasks. A
reader that loses its connection wakes every waiter (whatever fired meanwhile
is lost, so each looks at its queue again) and reconnects — to the new
primary behind Sentinel, or, on a Cluster, redis-py moves each sharded
channel to the master that owns its slot now and a reader starts for it. Until
the channels are back, waiters look again every ``RECOVERING_LOOK_S``. A
subscribe or unsubscribe that fails is done again by the next idle tick.
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections import defaultdict
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

import anyio
import msgpack
from redis.asyncio import ConnectionPool, Redis, RedisCluster

from fencemq.fences.redis_errors import REDIS_FAILURES

from fencemq.fences.gathering import Gathering

log = logging.getLogger(__name__)
LINGER_S = 30.0
CONFIRM_S = 2.0  # a subscription not confirmed by then is waited on anyway, looking again often
RECOVERING_LOOK_S = 0.5  # how often a waiter looks at its queue while pub/sub recovers
RECOVERY_S = 5.0  # how long after the last pub/sub failure waiters keep looking on their own
CLASSIC_MOVE_S = 2.0  # Cluster: classic channels failing this long move to another node
RETRY_S = 0.5  # the pause after a failed read, before the next one (redis-py reconnects in it)
# redis-py's PubSub has one socket. A subscribe that finds it closed reconnects, and reads the
# handshake's reply while this module's reader may be waiting on that same socket: asyncio allows one
# reader ("RuntimeError: read() called while another coroutine is already waiting for incoming data",
# redis-py 8 after a Redis restart). That is the connection being replaced: a pub/sub failure like any
# other, never the long poll's or the session's.
PUBSUB_FAILURES: tuple[type[BaseException], ...] = (*REDIS_FAILURES, RuntimeError)


class Waiter:
    """Wakes its owner each time the channel fires after the last wait, or hands it what a publish
    checked out to it (``handed``: the fence's reply, laid out as PULL's; lua/lib/waiters.lua)."""

    def __init__(self, wakeups: Wakeups | None = None, wid: str = "") -> None:
        self.event = anyio.Event()
        self.wakeups = wakeups
        self.wid = wid
        self.handed: list[Any] | None = None

    def fire(self) -> None:
        self.event.set()

    def hand(self, reply: list[Any]) -> None:
        self.handed = reply
        self.event.set()

    async def wait(self) -> None:
        pause = self.wakeups.look_again_s() if self.wakeups is not None else None
        if pause is None:
            await self.event.wait()
        else:
            with anyio.move_on_after(pause):
                await self.event.wait()
        # No await between the wake and the new event: nothing can be missed,
        # and the caller looks at the queue again before waiting again.
        self.event = anyio.Event()


class Wakeups:
    def __init__(self, redis: Redis, control_channel: str) -> None:
        self.redis = redis
        self.cluster = isinstance(redis, RedisCluster)
        # sharded channels: redis-py's ClusterPubSub on a Cluster (a connection per master)
        self.shards = redis.pubsub(ignore_subscribe_messages=False)
        # classic channels: the same connection on one server; on a Cluster one node's (any will do:
        # PUBLISH reaches them all), changed for another node when it fails
        self.pubsub = self._classic_pubsub() if self.cluster else self.shards
        self._classic_failing_since: float | None = None
        self.shard_readers: set[str] = set()  # Cluster: masters whose sharded channels a task reads
        self._tasks: anyio.abc.TaskGroup | None = None
        self.control_channel = control_channel
        self.waiters: dict[str, set[Waiter]] = defaultdict(set)
        self.confirmed: dict[str, anyio.Event] = {}
        self.last_used: dict[str, float] = {}
        self.session_handlers: dict[str, list[Callable[[bytes], None]]] = defaultdict(list)
        self.ready = anyio.Event()
        # long polls' waiter ids: unique in the broker (a worker's random prefix and a counter)
        self.wid_prefix = uuid.uuid4().hex[:10]
        self._wids = itertools.count(1)
        self.failed_at = -RECOVERY_S  # anyio time of the last pub/sub failure
        self._unsubscribe_later: set[str] = set()
        self._sunsubscribe_later: set[str] = set()
        self._channel_changes: Gathering[tuple[bool, str], None] = Gathering(
            self._change_channels, lambda: self._tasks.start_soon if self._tasks is not None else None)

    def _classic_pubsub(self, avoid: str | None = None) -> Any:
        nodes = [n for n in self.redis.get_nodes() if n.name != avoid] or self.redis.get_nodes()
        node = nodes[int(anyio.current_time() * 1000) % len(nodes)] if avoid else self.redis.get_default_node()
        kwargs = {k: v for k, v in node.connection_kwargs.items() if k not in ("host", "port", "response_callbacks")}
        pool = ConnectionPool(connection_class=node.connection_class, host=node.host, port=node.port, **kwargs)
        return Redis(connection_pool=pool).pubsub(ignore_subscribe_messages=False)

    async def _move_classic(self) -> None:
        """Cluster: the classic channels' node has failed for a while: the same channels on another node."""
        old = self.pubsub
        channels = list(old.channels)
        failed_node = f"{old.connection_pool.connection_kwargs.get('host')}:" \
                      f"{old.connection_pool.connection_kwargs.get('port')}"
        with anyio.CancelScope(shield=True):
            try:
                await old.aclose()
            except REDIS_FAILURES:
                pass
        self.pubsub = self._classic_pubsub(avoid=failed_node)
        if channels:
            await self.pubsub.subscribe(*channels)
        self._classic_failing_since = None

    def look_again_s(self) -> float | None:
        """How long a waiter may wait without a wake-up: for ever, unless pub/sub is recovering."""
        return RECOVERING_LOOK_S if anyio.current_time() - self.failed_at < RECOVERY_S else None

    async def run(self) -> None:
        try:
            async with anyio.create_task_group() as tasks:
                self._tasks = tasks
                while True:
                    try:
                        await self.pubsub.subscribe(self.control_channel)
                        break
                    except REDIS_FAILURES as exc:
                        self._failed("subscribing the worker's control channel", exc)
                        await anyio.sleep(RETRY_S)
                self.ready.set()
                await self._read(lambda timeout: self.pubsub.get_message(timeout=timeout), None)
        finally:
            with anyio.CancelScope(shield=True):
                for pubsub in {id(self.pubsub): self.pubsub, id(self.shards): self.shards}.values():
                    try:
                        await pubsub.aclose()
                    except REDIS_FAILURES:
                        pass

    def _failed(self, doing: str, exc: BaseException) -> None:
        self.failed_at = anyio.current_time()
        log.warning("pub/sub: %s failed (%s); trying again", doing, " ".join(str(exc).split())[:200])
        # whatever fired meanwhile is lost: every waiter looks again
        for waiters in self.waiters.values():
            for waiter in waiters:
                waiter.fire()

    async def _read(self, get: Callable[..., Any], node_name: str | None) -> None:
        """Hand each message of one pub/sub connection to whoever waits for it.

        ``node_name``: a Cluster master's sharded channels; the reader ends when
        redis-py no longer keeps a connection to it (its channels moved)."""
        while True:
            if node_name is not None and node_name not in getattr(self.shards, "node_pubsub_mapping", {}):
                self.shard_readers.discard(node_name)
                return
            try:
                msg = await get(timeout=1.0)
                if node_name is None:
                    self._classic_failing_since = None
                if msg is None:
                    if node_name is None:
                        await self._tick()
                    continue
                self._dispatch(msg)
            except anyio.get_cancelled_exc_class():
                raise
            except PUBSUB_FAILURES as exc:
                self._failed("reading" + (f" from {node_name}" if node_name else ""), exc)
                if node_name is None and self.cluster:
                    now = anyio.current_time()
                    if self._classic_failing_since is None:
                        self._classic_failing_since = now
                    elif now - self._classic_failing_since > CLASSIC_MOVE_S:
                        try:
                            await self._move_classic()
                        except REDIS_FAILURES as again:
                            self._failed("moving the classic channels to another node", again)
                await anyio.sleep(RETRY_S)
            except Exception:  # noqa: BLE001 - a reader must outlive any surprise: log it, go on
                log.exception("pub/sub reader: unexpected failure; reading on")
                await anyio.sleep(RETRY_S)

    def _dispatch(self, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        kind = kind.decode() if isinstance(kind, bytes) else kind
        channel = msg["channel"].decode() if isinstance(msg["channel"], bytes) else msg["channel"]
        if kind == "ssubscribe" and channel in self.confirmed:
            self.confirmed[channel].set()
        elif kind == "smessage":
            self._wake(self.waiters.get(channel, ()), msg["data"])
        elif kind == "message":
            for handler in list(self.session_handlers.get(channel, ())):
                handler(msg["data"])

    def handed_here(self, channel: str, data: bytes) -> None:
        """A publish of this worker handed messages to long polls on ``channel``, some of them this
        worker's: theirs now, as the pub/sub copy would (which follows: a waiter it finds served
        has left, or takes the same reply twice and reads it once)."""
        self._wake(self.waiters.get(channel, ()), data)

    def _wake(self, waiters: Any, data: Any) -> None:
        """A queue's channel fired: wake its waiters. A publish that handed messages to long polls sends
        ``H`` + msgpack [rest, wid, reply, …]: those waiters get their reply, the others are woken only
        if ``rest`` says something is left for them."""
        rest, replies = 1, {}
        if isinstance(data, bytes) and data[:1] == b"H":
            try:
                rest, *pairs = msgpack.unpackb(data[1:], raw=True)
                replies = {wid.decode(): reply for wid, reply in zip(pairs[::2], pairs[1::2])}
            except (ValueError, TypeError, AttributeError, msgpack.UnpackException):
                log.warning("a hand-off that does not parse (%d bytes); its waiters look again", len(data))
                rest, replies = 1, {}
        for waiter in waiters:
            reply = replies.get(waiter.wid) if replies else None
            if reply is not None:
                waiter.hand(reply)
            elif rest:
                waiter.fire()

    async def _tick(self) -> None:
        """Between messages: finish what failed, start readers for new masters, let idle channels go."""
        if self.cluster:
            for name in list(getattr(self.shards, "node_pubsub_mapping", {})):
                self._start_reader(name)
        for channel in list(self._unsubscribe_later):
            if channel in self.session_handlers:
                self._unsubscribe_later.discard(channel)
                continue
            await self.pubsub.unsubscribe(channel)
            self._unsubscribe_later.discard(channel)
        missing = [c for c in self.session_handlers if c.encode() not in self.pubsub.channels
                   and c not in self.pubsub.channels]
        if missing:
            await self.pubsub.subscribe(*missing)
        if self._sunsubscribe_later:
            gone = list(self._sunsubscribe_later)
            await self.shards.sunsubscribe(*gone)
            self._sunsubscribe_later.difference_update(gone)
        await self._prune()

    def _start_reader(self, name: str) -> None:
        """Cluster: a task reads the sharded channels of the master ``name`` (once)."""
        if name in self.shard_readers or self._tasks is None:
            return
        self.shard_readers.add(name)
        pubsub = self.shards

        async def get(timeout: float) -> Any:
            node = pubsub.cluster.get_node(node_name=name)
            if node is None:  # gone from the topology: its pubsub is dropped by redis-py's reconciliation
                await anyio.sleep(timeout)
                return None
            return await pubsub.get_sharded_message(target_node=node, timeout=timeout)

        self._tasks.start_soon(self._read, get, name)

    async def _prune(self) -> None:
        now = anyio.current_time()
        idle = [c for c, t in self.last_used.items() if not self.waiters.get(c) and now - t > LINGER_S]
        for channel in idle:
            del self.last_used[channel]
            self.confirmed.pop(channel, None)
            self.waiters.pop(channel, None)
        if idle:
            self._sunsubscribe_later.update(idle)
            await self.shards.sunsubscribe(*idle)
            self._sunsubscribe_later.difference_update(idle)

    @asynccontextmanager
    async def watching(self, channel: str) -> AsyncIterator[Waiter]:
        """A waiter woken whenever the channel fires; subscribed on entry.

        A failing Redis never fails the caller here: the waiter then looks
        again on its own (``look_again_s``) until the channel is back.

        A long poll on a channel already confirmed (every one but a queue's first) enters without
        yielding to the event loop: waiting on an event that is set only yields (anyio's
        checkpoint), a task switch per PULL … BLOCK for nothing. A cancelled caller still stops
        here, as it did at that checkpoint."""
        if self.ready.is_set():
            await anyio.lowlevel.checkpoint_if_cancelled()
        else:
            await self.ready.wait()
        waiter = Waiter(self, f"{self.wid_prefix}{next(self._wids)}")
        self.waiters[channel].add(waiter)
        self.last_used[channel] = anyio.current_time()
        try:
            if channel not in self.confirmed:
                self.confirmed[channel] = anyio.Event()
                self._sunsubscribe_later.discard(channel)
                try:
                    await self.shards.ssubscribe(channel)
                    if self.cluster:
                        node = self.redis.get_node_from_key(channel)
                        self._start_reader(node.name)
                except PUBSUB_FAILURES as exc:
                    self.confirmed.pop(channel, None)
                    self._failed(f"subscribing {channel}", exc)
            confirmed = self.confirmed.get(channel)
            if confirmed is not None and not confirmed.is_set():
                with anyio.move_on_after(CONFIRM_S) as waited:
                    await confirmed.wait()
                if waited.cancelled_caught:
                    self.failed_at = anyio.current_time()  # not confirmed: look again on our own
            yield waiter
        finally:
            self.waiters[channel].discard(waiter)
            self.last_used[channel] = anyio.current_time()

    async def follow(self, channel: str, handler: Callable[[bytes], None]) -> None:
        """Call handler with every message on a (non-sharded) channel, e.g. a session's.

        A subscribe that fails (Redis failing over) is done again by the reader's next tick."""
        await self.ready.wait()
        # Two connections of one client id may overlap on this worker during a
        # takeover: both must hear it, so the older one can close.
        self.session_handlers[channel].append(handler)
        self._unsubscribe_later.discard(channel)
        await self._channel_changes((True, channel))

    async def unfollow(self, channel: str, handler: Callable[[bytes], None]) -> None:
        handlers = self.session_handlers.get(channel, [])
        if handler in handlers:
            handlers.remove(handler)
        if not handlers:
            self.session_handlers.pop(channel, None)
            await self._channel_changes((False, channel))

    async def _change_channels(self, changes: list[tuple[bool, str]]) -> list[None]:
        """The SUBSCRIBEs and UNSUBSCRIBEs of many sessions (a connect storm), in their order, each
        run of one kind as one command."""
        start = 0
        while start < len(changes):
            subscribing = changes[start][0]
            end = start
            while end < len(changes) and changes[end][0] == subscribing:
                end += 1
            channels = list(dict.fromkeys(channel for _, channel in changes[start:end]))
            try:
                await (self.pubsub.subscribe if subscribing else self.pubsub.unsubscribe)(*channels)
            except PUBSUB_FAILURES as exc:
                # Redis failing over: the reader's next tick subscribes what is followed and
                # unsubscribes what is not (a closing connection's session must not fail for it)
                if not subscribing:
                    self._unsubscribe_later.update(channels)
                self._failed(f"{'subscribing' if subscribing else 'unsubscribing'} {len(channels)} channels", exc)
            start = end
        return [None] * len(changes)
