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
"""

from __future__ import annotations

import logging
from collections import defaultdict
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

import anyio
from redis.asyncio import Redis, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from fencemq.fences.gathering import Gathering

log = logging.getLogger(__name__)
LINGER_S = 30.0


class Waiter:
    """Wakes its owner each time the channel fires after the last wait."""

    def __init__(self) -> None:
        self.event = anyio.Event()

    def fire(self) -> None:
        self.event.set()

    async def wait(self) -> None:
        await self.event.wait()
        # No await between the wake and the new event: nothing can be missed,
        # and the caller looks at the queue again before waiting again.
        self.event = anyio.Event()


class Wakeups:
    def __init__(self, redis: Redis, control_channel: str) -> None:
        self.redis = redis
        self.pubsub = redis.pubsub(ignore_subscribe_messages=False)
        self.cluster = isinstance(redis, RedisCluster)
        self.shard_readers: set[str] = set()  # Cluster: masters whose sharded channels a task reads
        self._tasks: anyio.abc.TaskGroup | None = None
        self.control_channel = control_channel
        self.waiters: dict[str, set[Waiter]] = defaultdict(set)
        self.confirmed: dict[str, anyio.Event] = {}
        self.last_used: dict[str, float] = {}
        self.session_handlers: dict[str, list[Callable[[bytes], None]]] = defaultdict(list)
        self.ready = anyio.Event()
        self._channel_changes: Gathering[tuple[bool, str], None] = Gathering(
            self._change_channels, lambda: self._tasks.start_soon if self._tasks is not None else None)

    async def run(self) -> None:
        await self.pubsub.subscribe(self.control_channel)
        try:
            async with anyio.create_task_group() as tasks:
                self._tasks = tasks
                self.ready.set()
                await self._read(self.pubsub.get_message, True)
        finally:
            with anyio.CancelScope(shield=True):
                await self.pubsub.aclose()

    async def _read(self, get: Callable[..., Any], prune: bool) -> None:
        """Hand each message of one pub/sub connection to whoever waits for it."""
        while True:
            try:
                msg = await get(timeout=1.0)
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                # redis-py reconnects and subscribes again on the next call;
                # whatever fired meanwhile is lost, so every waiter looks again.
                log.warning("pub/sub connection lost (%s); reconnecting", exc)
                for waiters in self.waiters.values():
                    for waiter in waiters:
                        waiter.fire()
                await anyio.sleep(0.5)
                continue
            if msg is None:
                if prune:
                    await self._prune()
                continue
            kind = msg["type"]
            channel = msg["channel"].decode() if isinstance(msg["channel"], bytes) else msg["channel"]
            if kind == "ssubscribe" and channel in self.confirmed:
                self.confirmed[channel].set()
            elif kind == "smessage":
                for waiter in self.waiters.get(channel, ()):
                    waiter.fire()
            elif kind == "message":
                for handler in list(self.session_handlers.get(channel, ())):
                    handler(msg["data"])

    def _read_shards_of(self, channel: str) -> None:
        """Cluster: make sure a task reads the sharded channels of the master that owns this one."""
        node = self.redis.get_node_from_key(channel)
        if node.name in self.shard_readers or self._tasks is None:
            return
        self.shard_readers.add(node.name)

        async def get(timeout: float) -> Any:
            return await self.pubsub.get_sharded_message(target_node=node, timeout=timeout)

        self._tasks.start_soon(self._read, get, False)

    async def _prune(self) -> None:
        now = anyio.current_time()
        idle = [c for c, t in self.last_used.items() if not self.waiters.get(c) and now - t > LINGER_S]
        for channel in idle:
            del self.last_used[channel]
            self.confirmed.pop(channel, None)
            self.waiters.pop(channel, None)
        if idle:
            await self.pubsub.sunsubscribe(*idle)

    @asynccontextmanager
    async def watching(self, channel: str) -> AsyncIterator[Waiter]:
        """A waiter woken whenever the channel fires; subscribed on entry."""
        await self.ready.wait()
        waiter = Waiter()
        self.waiters[channel].add(waiter)
        self.last_used[channel] = anyio.current_time()
        try:
            if channel not in self.confirmed:
                self.confirmed[channel] = anyio.Event()
                await self.pubsub.ssubscribe(channel)
                if self.cluster:
                    self._read_shards_of(channel)
            await self.confirmed[channel].wait()
            yield waiter
        finally:
            self.waiters[channel].discard(waiter)
            self.last_used[channel] = anyio.current_time()

    async def follow(self, channel: str, handler: Callable[[bytes], None]) -> None:
        """Call handler with every message on a (non-sharded) channel, e.g. a session's."""
        await self.ready.wait()
        # Two connections of one client id may overlap on this worker during a
        # takeover: both must hear it, so the older one can close.
        self.session_handlers[channel].append(handler)
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
            await (self.pubsub.subscribe if subscribing else self.pubsub.unsubscribe)(*channels)
            start = end
        return [None] * len(changes)
