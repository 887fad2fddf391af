"""A worker's start: it waits for its Redis, saying so, rather than exit.

Redis may be down, restarting (LOADING), failing over (its primary gone, a
Sentinel not yet naming the new one), or refusing writes for want of replicas
(NOREPLICAS): the worker waits — logging what it waits for when it starts
waiting and every ``SAY_EVERY_S`` after — until Redis answers and takes its
first write (the fleet's handle secret). What waiting cannot mend is refused
at once: a ``durability`` the server cannot give (fences/durability.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import anyio
from redis.asyncio import Redis, RedisCluster

from fencemq.config import Config
from fencemq.fences.durability import check_server
from fencemq.fences.redis_client import open_redis
from fencemq.fences.redis_errors import REDIS_FAILURES, reason
from fencemq.server.services import Services

log = logging.getLogger(__name__)

SAY_EVERY_S = 10.0
PAUSE_S = (0.1, 2.0)  # between attempts: from, doubling up to


def shown_url(url: str) -> str:
    """The Redis URL without its password, for the log."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return parts._replace(netloc=netloc).geturl()


async def ready_services(config: Config, worker_id: str, *, max_connections: int = 256,
                         prepare: Callable[[Services], Awaitable[None]] | None = None,
                         ) -> tuple[Redis | RedisCluster, Services]:
    """The worker's Redis client and services, once Redis answers and takes writes
    (and ``prepare(services)``, a start-up check of Redis, passed)."""
    assert config.redis_url
    pause, said_at, since = PAUSE_S[0], 0.0, time.monotonic()
    while True:
        redis: Any = None
        try:
            redis = await open_redis(config.redis_url, max_connections, insist=True)
            services = Services.over(redis, config, worker_id)
            await check_server(redis, services.core.durability)
            await services.handles.load(redis, services.keys.handle_secret)
            if prepare is not None:
                await prepare(services)
            if said_at:
                log.warning("Redis at %s answers after %.1f s; starting", shown_url(config.redis_url),
                            time.monotonic() - since)
            return redis, services
        except REDIS_FAILURES as exc:
            if redis is not None:
                with anyio.CancelScope(shield=True):
                    await redis.aclose()
            now = time.monotonic()
            if now - said_at >= SAY_EVERY_S:
                said_at = now
                log.warning("waiting for Redis at %s (%.0f s so far): %s", shown_url(config.redis_url), now - since,
                            reason(exc))
            await anyio.sleep(pause)
            pause = min(pause * 2, PAUSE_S[1])
