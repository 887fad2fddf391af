"""The async Redis client every worker uses.

redis-py's asyncio connection packs commands in pure Python; a fence call with
a batch of 100 messages carries 200+ arguments, and packing them was a fifth
of a worker's CPU. hiredis packs the same bytes about five times faster.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hiredis
from redis.asyncio import Redis, RedisCluster
from redis.asyncio.connection import Connection, SSLConnection
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError


def _pack(args: tuple[Any, ...]) -> list[bytes]:
    # redis-py passes some commands as one string with a space ("SCRIPT LOAD").
    if isinstance(args[0], str) and " " in args[0]:
        args = (*args[0].split(), *args[1:])
    return [hiredis.pack_command(args)]


class HiredisPackedConnection(Connection):
    def pack_command(self, *args: Any) -> list[bytes]:
        return _pack(args)


class HiredisPackedSSLConnection(SSLConnection):
    def pack_command(self, *args: Any) -> list[bytes]:
        return _pack(args)


def connect(url: str, **options: Any) -> Redis:
    """An async client for the broker's Redis, retrying across restarts and failovers."""
    options.setdefault("max_connections", 256)
    # A Redis restart drops every pooled connection: retry on a fresh one
    # rather than failing the client's command.
    options.setdefault("retry", Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=8))
    options.setdefault("retry_on_error", [RedisConnectionError, RedisTimeoutError])
    tls = url.startswith("rediss://")
    options.setdefault("connection_class", HiredisPackedSSLConnection if tls else HiredisPackedConnection)
    return Redis.from_url(url, **options)


def _cluster(url: str, **options: Any) -> RedisCluster:
    options.setdefault("max_connections", 256)
    options.setdefault("retry", Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=8))
    options.setdefault("retry_on_error", [RedisConnectionError, RedisTimeoutError])
    return RedisCluster.from_url(url, **options)


async def open_redis(url: str) -> Redis | RedisCluster:
    """A worker's client: asks the server at ``url`` whether it is a Cluster node.

    A Cluster gets redis-py's cluster client (every fence names keys of one
    slot, so each call goes to the master that owns it); anything else the
    single-server client of :func:`connect`.
    """
    probe = connect(url, retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=2))
    try:
        enabled = int((await probe.info("cluster")).get("cluster_enabled", 0)) == 1
    except (RedisConnectionError, RedisTimeoutError, OSError):
        enabled = False  # not answering yet: the single-server client connects (and retries) lazily, as before
    finally:
        await probe.aclose()
    if not enabled:
        return connect(url)
    cluster = _cluster(url)
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
