"""An lmq at rest has no key of its own: reading its meta wherever it lies.

An lmq with one owner, nothing in its log and nothing checked out keeps its compact meta hash as a
field of its slot's rest hash (``QueueKeys.rest``, field ``QueueKeys.rest_field``) and has no meta
key; the first fence that touches it puts the hash back (lua/lib/meta.lua, ``put_to_rest`` and
``wake_from_rest``; docs/data-model.md, "Lmqs at rest"). Code outside the fences that reads a meta
hash reads it through here, so an lmq at rest reads like any other queue.
"""

from __future__ import annotations

from typing import Any

from fencemq.model import meta
from fencemq.model.keys import QueueKeys

# A fence may move the hash between the two reads (rest -> key or key -> rest, each in one step):
# reading again finds it in its new place.
_READS = 3


async def meta_hash(redis: Any, k: QueueKeys) -> dict[Any, Any]:
    """The queue's meta hash as HGETALL gives it (compact or not; ``meta.expand`` spells it out),
    ``{}`` when the queue does not exist."""
    for _ in range(_READS):
        raw = await redis.hgetall(k.meta)
        if raw or not is_lmq(k):
            return raw
        rested = meta.from_rest(await redis.hget(k.rest, k.rest_field))
        if rested:
            return rested
    return {}


async def exists(redis: Any, k: QueueKeys) -> bool:
    """Whether the queue has a meta hash, as a key or at rest."""
    if await redis.exists(k.meta):
        return True
    return is_lmq(k) and bool(await meta_hash(redis, k))


def is_lmq(k: QueueKeys) -> bool:
    """Only an lmq rests: any other queue names its own meta key as its rest (keys.py)."""
    return k.rest != k.meta


def queue_meta(pipe_results: tuple[Any, Any]) -> dict[Any, Any]:
    """What ``pipe.hgetall(k.meta)`` then ``pipe.hget(k.rest, k.rest_field)`` read, as one meta hash
    (for readers that pipeline many queues; see :func:`pipe_meta`)."""
    raw, packed = pipe_results
    return raw or meta.from_rest(packed)


def pipe_meta(pipe: Any, k: QueueKeys) -> int:
    """Queue both reads of :func:`queue_meta` on a pipeline; returns how many results they add (2)."""
    pipe.hgetall(k.meta)
    pipe.hget(k.rest, k.rest_field)
    return 2


def no_key_ttl(ttl: int, found: bool) -> int:
    """The PTTL of a queue whose meta was ``found``: an lmq at rest has no meta key (PTTL -2) but is
    never set to expire (it has an owner), so it reads as a key without a TTL (-1)."""
    return -1 if int(ttl) == -2 and found else int(ttl)


async def pttl(redis: Any, k: QueueKeys) -> int:
    """PTTL of the queue's meta, an lmq at rest's included (:func:`no_key_ttl`)."""
    ttl = int(await redis.pttl(k.meta))
    return no_key_ttl(ttl, ttl == -2 and is_lmq(k) and await exists(redis, k))


def pipe_fields(pipe: Any, k: QueueKeys, names: list[str]) -> int:
    """Queue what :func:`queue_fields` reads of ``names`` (HMGET, or the rest field); returns 2."""
    pipe.hmget(k.meta, names)
    pipe.hget(k.rest, k.rest_field)
    return 2


def queue_fields(pipe_results: tuple[Any, Any], names: list[str]) -> list[Any]:
    """HMGET's answer for ``names``, read from the rest field when the lmq is at rest."""
    values, packed = pipe_results
    if packed is None or any(v is not None for v in values):
        return list(values)
    rested = meta.from_rest(packed)
    return [rested.get(name) for name in names]


async def meta_fields(redis: Any, k: QueueKeys, names: list[str]) -> list[Any]:
    """HMGET of the queue's meta hash, wherever it lies: one round trip for a queue with a key."""
    if not is_lmq(k):
        return list(await redis.hmget(k.meta, names))
    for _ in range(_READS):
        async with redis.pipeline(transaction=False) as pipe:
            pipe.hmget(k.meta, names)
            pipe.exists(k.meta)
            values, there = await pipe.execute()
        if there:
            return list(values)
        packed = await redis.hget(k.rest, k.rest_field)
        if packed is not None:
            return queue_fields((values, packed), names)
        # gone, or woken between the two reads: read again
    return [None] * len(names)
