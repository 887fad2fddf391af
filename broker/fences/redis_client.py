"""The async Redis client every worker uses: one server, a Cluster, or a primary behind Sentinel.

How it reaches Redis through failovers, and what it retries (only what never
left the worker), is fences/redis_servers.py; commands are packed by hiredis.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.connection import ConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from fencemq.fences.redis_servers import (
    FenceConnection,
    FenceSSLConnection,
    client_options,
    cluster_client,
    is_sentinel_url,
    sentinel_client,
)


class WaitingConnectionPool(ConnectionPool):
    """A pool whose commands wait for a connection while all of them are in use.

    redis-py's own pool fails a command past ``max_connections`` ("Too many
    connections"): a crowd of clients connecting at once would be told that Redis
    did not answer. Here they queue, first come first served, for at most
    ``wait_s`` seconds; the pool's size is a share of the worker's open files
    (server/file_limit.py), so it never grows past what the worker may open.
    """

    def __init__(self, *args: Any, wait_s: float = 30.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.wait_s = wait_s
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()

    def _exhausted(self) -> bool:
        return not self._available_connections and len(self._in_use_connections) >= self.max_connections

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        if self._exhausted():
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.wait_s
            woken_before = False
            while self._exhausted():
                waiter: asyncio.Future[None] = loop.create_future()
                # woken, then beaten to the connection by a newcomer: first in line again
                (self._waiting.appendleft if woken_before else self._waiting.append)(waiter)
                try:
                    await asyncio.wait_for(waiter, max(0.0, deadline - loop.time()))
                except BaseException as exc:
                    if waiter.done() and not waiter.cancelled():
                        self._wake_one()  # woken but leaving: the connection is the next one's
                    elif waiter in self._waiting:
                        self._waiting.remove(waiter)
                    if isinstance(exc, TimeoutError):
                        raise RedisConnectionError(f"no connection to Redis came free within {self.wait_s:.0f} s "
                                                   f"(all {self.max_connections} in use)") from None
                    raise
                woken_before = True
        return await super().get_connection(*args, **kwargs)

    async def release(self, connection: Any) -> None:
        await super().release(connection)
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


def connect(url: str, **options: Any) -> Redis:
    """An async client for the broker's Redis (a plain URL, or a ``redis+sentinel://`` one).

    It tries again to connect while Redis restarts or fails over, and never
    sends a command again once it was written (fences/redis_servers.py).
    ``max_connections`` (default 256) bounds the pool; past it a command waits
    for a connection (WaitingConnectionPool)."""
    options.setdefault("max_connections", 256)
    if is_sentinel_url(url):
        return sentinel_client(url, **options)
    tls = url.startswith("rediss://")
    options.setdefault("connection_class", FenceSSLConnection if tls else FenceConnection)
    return Redis.from_pool(WaitingConnectionPool.from_url(url, **client_options(**options)))


async def open_redis(url: str, max_connections: int = 256, *, insist: bool = False) -> Redis | RedisCluster:
    """A worker's client: asks the server at ``url`` whether it is a Cluster node.

    A Cluster gets redis-py's cluster client (every fence names keys of one
    slot, so each call goes to the master that owns it); Sentinel, or anything
    else, the single-server client of :func:`connect`. ``max_connections``:
    per server. ``insist``: a server that does not answer is an error (the
    worker's start waits and asks again), not taken for a single server.
    """
    if is_sentinel_url(url):
        return connect(url, max_connections=max_connections)
    probe = connect(url)
    try:
        enabled = int((await probe.info("cluster")).get("cluster_enabled", 0)) == 1
    except (RedisConnectionError, RedisTimeoutError, OSError):
        if insist:
            raise
        enabled = False  # not answering yet: the single-server client connects (and retries) lazily, as before
    finally:
        await probe.aclose()
    if not enabled:
        return connect(url, max_connections=max_connections)
    cluster = cluster_client(url, max_connections=max_connections)
    await cluster.initialize()
    return cluster


def servers_of(redis: Redis | RedisCluster) -> int:
    """How many servers the client opens connections to: a Cluster's masters, else one."""
    return len(redis.get_primaries()) if isinstance(redis, RedisCluster) else 1


def limit_connections(redis: Redis | RedisCluster, per_server: int) -> None:
    """Lower the connections the client opens to each server (a Cluster's pools are made per node)."""
    if isinstance(redis, RedisCluster):
        for node in redis.get_nodes():
            node.max_connections = min(node.max_connections, per_server)
    else:
        redis.connection_pool.max_connections = min(redis.connection_pool.max_connections, per_server)


async def pipeline_then_publish(redis: Redis | RedisCluster, build: Callable[[Any], None], channel: str,
                                message: bytes | str) -> list[Any]:
    """Run the commands ``build(pipe)`` queues, and PUBLISH a message.

    One round trip on one server. A Cluster's pipelines refuse PUBLISH (it
    goes to every node, not to a slot's master), so there it follows the
    pipeline. Returns the pipeline's replies, without PUBLISH's.
    """
    return await pipeline_then_publish_all(redis, build, [(channel, message)])


async def pipeline_then_publish_all(redis: Redis | RedisCluster, build: Callable[[Any], None],
                                    messages: list[tuple[str, bytes | str]]) -> list[Any]:
    """:func:`pipeline_then_publish` with any number of (channel, message) to PUBLISH."""
    cluster = isinstance(redis, RedisCluster)
    async with redis.pipeline(transaction=False) as pipe:
        build(pipe)
        if not cluster:
            for channel, message in messages:
                pipe.publish(channel, message)
        replies = await pipe.execute()
    if cluster:
        for channel, message in messages:
            await redis.publish(channel, message)
        return list(replies)
    return list(replies[: len(replies) - len(messages)])
