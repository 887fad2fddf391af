"""The async Redis client every worker uses: one server, a Cluster, or a primary behind Sentinel.

How it reaches Redis through failovers, and what it retries (only what never
left the worker), is fences/redis_servers.py; commands are packed by hiredis.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis, RedisCluster
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


def connect(url: str, **options: Any) -> Redis:
    """An async client for the broker's Redis (a plain URL, or a ``redis+sentinel://`` one).

    It tries again to connect while Redis restarts or fails over, and never
    sends a command again once it was written (fences/redis_servers.py).
    """
    options.setdefault("max_connections", 256)
    if is_sentinel_url(url):
        return sentinel_client(url, **options)
    tls = url.startswith("rediss://")
    options.setdefault("connection_class", FenceSSLConnection if tls else FenceConnection)
    return Redis.from_url(url, **client_options(**options))


async def open_redis(url: str, *, insist: bool = False) -> Redis | RedisCluster:
    """A worker's client: asks the server at ``url`` whether it is a Cluster node.

    A Cluster gets redis-py's cluster client (every fence names keys of one
    slot, so each call goes to the master that owns it); Sentinel, or anything
    else, the single-server client of :func:`connect`. ``insist``: a server
    that does not answer is an error (the worker's start waits and asks
    again), not taken for a single server.
    """
    if is_sentinel_url(url):
        return connect(url)
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
        return connect(url)
    cluster = cluster_client(url, max_connections=256)
    await cluster.initialize()
    return cluster


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
