"""An lmq at rest has no key of its own: reading its meta wherever it lies.

An lmq with one owner, nothing in its log and nothing checked out keeps its compact meta hash as a
field of its slot's rest hash (``QueueKeys.rest``, field ``QueueKeys.rest_field``) and has no meta
key; the first fence that touches it puts the hash back (lua/lib/meta.lua, ``put_to_rest`` and
``wake_from_rest``; docs/data-model.md, "Lmqs at rest"). Code outside the fences that reads a meta
hash reads it through here, so an lmq at rest reads like any other queue.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from fencemq.model import meta
from fencemq.model.keys import Keyspace, QueueKeys
from fencemq.model.slots import SLOTS
from fencemq.model.values import text

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


# -- which lmqs are at rest: the rest hashes, slot after slot -----------------------------------
# A listing walks them in slot order and each one's fields (queue ids) sorted, so a page can end
# between two fields and the next start after the last it listed (ops/operations.py, scan_queues).

REST_CHUNK = 1024  # rest hashes looked for in one round trip (16 for every slot)


async def rested_slots(redis: Any, keys: Keyspace, start: int = 0) -> AsyncIterator[int]:
    """The slots from ``start`` on whose rest hash holds some lmq, ascending."""
    for low in range(start, SLOTS, REST_CHUNK):
        slots = range(low, min(low + REST_CHUNK, SLOTS))
        async with redis.pipeline(transaction=False) as pipe:
            for key in keys.rest_keys(slots):
                pipe.exists(key)
            found = await pipe.execute()
        for slot, there in zip(slots, found, strict=True):
            if there:
                yield slot


async def rested_in_slot(redis: Any, keys: Keyspace, slot: int, match: str = "*") -> list[str]:
    """The ids of the lmqs at rest in ``slot`` that the glob ``match`` accepts, sorted (each once:
    HSCAN may return a field twice)."""
    (key,) = keys.rest_keys([slot])
    found: set[str] = set()
    cursor = 0
    while True:
        cursor, batch = await redis.hscan(key, cursor, match=match, count=1000)
        found.update(text(f) for f in batch)
        if int(cursor) == 0:
            return sorted(found)


async def rested_qids(redis: Any, keys: Keyspace, match: str = "*") -> AsyncIterator[list[str]]:
    """The ids of every lmq at rest that ``match`` accepts, one slot's (sorted) at a time."""
    async for slot in rested_slots(redis, keys):
        qids = await rested_in_slot(redis, keys, slot, match)
        if qids:
            yield qids


def rested_qids_sync(client: Any, keys: Keyspace, match: str = "*") -> Iterator[str]:
    """:func:`rested_qids` for a blocking client (``fencemq status``), one id at a time."""
    for low in range(0, SLOTS, REST_CHUNK):
        rest = keys.rest_keys(range(low, min(low + REST_CHUNK, SLOTS)))
        with client.pipeline(transaction=False) as pipe:
            for key in rest:
                pipe.exists(key)
            found = pipe.execute()
        for key, there in zip(rest, found, strict=True):
            if there:
                yield from sorted({text(f) for f, _ in client.hscan_iter(key, match=match, count=1000)})


async def rested_page(redis: Any, keys: Keyspace, match: str, start: tuple[int, str], room: int,
                      accepts: Any = None) -> tuple[list[str], tuple[int, str] | None, int]:
    """Up to ``room`` ids of lmqs at rest (those ``accepts`` keeps, of those the glob ``match`` does)
    in walk order from ``start`` = (slot, the last id listed in it, or ""): the ids, where the next
    page starts (None: no slot is left) and how many ids were read. A page ends between two ids of
    one slot when the slot holds more than its room, so no id is listed twice in one walk."""
    slot, after = start
    found: list[str] = []
    read = 0
    async for s in rested_slots(redis, keys, slot):
        qids = await rested_in_slot(redis, keys, s, match)
        read += len(qids)
        qids = [q for q in qids if (s != slot or q > after) and (accepts is None or accepts(q))]
        if len(qids) > room - len(found):
            found += qids[: room - len(found)]
            return found, (s, found[-1] if found else after), read
        found += qids
        if len(found) >= room:
            return found, ((s + 1, "") if s + 1 < SLOTS else None), read
    return found, None, read
