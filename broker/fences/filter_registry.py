"""The filter registry: which filter subscriptions a publish copies to, on every worker.

The filters are found through a registry in Redis and a trie cached per
worker — never a scan of all subscriptions. The registry is a hash plus a
version counter; a change is announced on a channel, and every worker also
re-reads the version at least once a second, so a missed announcement costs
at most that delay.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgpack
from redis.exceptions import RedisClusterException

from fencemq.fences.gathering import Gathering
from fencemq.fences.redis_client import pipeline_then_publish, pipeline_then_publish_all
from fencemq.fences.schedule_shards import ScheduleShards
from fencemq.model.keys import Keyspace, QueueRef, queue_ref
from fencemq.model.topics import FilterIndex, matches

log = logging.getLogger(__name__)

SUBSCRIBE_WAIT_S = 1.0  # the longest a publish waits for a SUBSCRIBE under way on its worker


_stale_said = [0.0]


def _say_stale(exc: BaseException) -> None:
    now = time.monotonic()
    if now - _stale_said[0] > 10.0:
        _stale_said[0] = now
        log.warning("the filter registry's version could not be read (%s); publishing with this worker's copy",
                    " ".join(str(exc).split())[:160])


class FilterRegistry:
    """Every worker's copy of the filter registry, checked against its version on every publish.

    A filter SUB on one worker increments the version before it answers, so a publish
    that reaches another worker after that answer reads the new version (one GET, run
    beside the publish fence) and copies to the new filter: no message published after
    a SUB returned misses it, whichever worker each goes through. The pub/sub
    invalidation only spares the GET's round trip from mattering (it is cheap either way).

    On a Cluster the version a publish reads is a copy in the slot of a lease schedule
    shard on its own queue's master (``version_key``; fences/schedule_shards.py), and a
    (un)registration raises every copy before it answers: the registry's own master is on
    no publish's path, so its failing over stalls no other master's publishes. Each copy
    is a counter of its own; the index is known to be current for each copy at the value
    it was last read at (``_seen``), so copies that drift apart (a registration cut short)
    never hide a later one.
    """

    def __init__(self, redis: Any, keys: Keyspace, shards: ScheduleShards | None = None,
                 spawn: Callable[[], Callable[..., None] | None] = lambda: None) -> None:
        self.redis = redis
        self.keys = keys
        # the registrations of concurrent SUBSCRIBEs (a crowd subscribing or resubscribing) in one round trip
        self._registrations: Gathering[tuple[QueueRef, str | None, str | None], None] = Gathering(
            self._register_batch, spawn)
        self.shards = shards if shards is not None else ScheduleShards(redis, keys)
        self.index = FilterIndex()
        # Per version key, the value the index includes every registration before; None is a
        # value too (no filter was ever registered): a key not in it is "not read yet".
        self._seen: dict[str, bytes | None] = {}
        self._reads = 0  # registry reads begun (the index installed is the latest begun of those done)
        self._index_read = 0  # the number of the read the index came from (0: never read)
        self._stale_upto = 0  # an index from this read or an earlier one is known stale (a change was announced)
        self._being_made: list[tuple[str, anyio.Event]] = []  # (filter, done) of SUBSCRIBEs under way here

    def invalidate(self) -> None:
        self._seen.clear()
        self._stale_upto = self._reads

    def version_key(self, topic: str) -> str:
        """The version a publish to ``topic`` reads: the registry's own on one server; on a Cluster
        the copy on the master of the topic's queue."""
        if not self.shards.cluster:
            return self.keys.filters_version
        try:
            return self.keys.filters_version_copy(self.shards.first_shard_of(QueueRef(topic).qid))
        except RedisClusterException:  # the slots not known (yet): the registry's own, raised with every copy
            return self.keys.filters_version

    def _version_keys(self) -> list[str]:
        """Every version a (un)registration raises."""
        if not self.shards.cluster:
            return [self.keys.filters_version]
        return [self.keys.filters_version, *(self.keys.filters_version_copy(s) for s in self.shards.all())]

    @asynccontextmanager
    async def announcing(self, filters: list[str]) -> AsyncIterator[None]:
        """Filter subscriptions being made on this worker: a publish that reaches its fan-out
        meanwhile waits for them (at most SUBSCRIBE_WAIT_S), so a SUBSCRIBE this worker read
        before a PUBLISH is in place for it, as on a single-threaded broker. (MQTT promises no
        order across connections, but clients count on it: the Paho suites publish right behind
        another client's SUBSCRIBE.) Enter it before the first await of the SUBSCRIBE."""
        done = anyio.Event()
        entries = [(f, done) for f in filters]
        self._being_made += entries
        try:
            yield
        finally:
            for entry in entries:
                self._being_made.remove(entry)
            done.set()

    async def after_subscribes(self, topic: str) -> bool:
        """Wait for the filter subscriptions being made on this worker that ``topic`` matches;
        True when there were some (the registry's version must then be read again)."""
        if not self._being_made:
            return False
        waits = {id(done): done for filt, done in self._being_made if matches(filt, topic)}
        for done in waits.values():
            with anyio.move_on_after(SUBSCRIBE_WAIT_S):
                await done.wait()
        return bool(waits)

    async def _refresh(self, key: str, version: bytes | None) -> None:
        if key in self._seen and self._seen[key] == version:
            return
        self._reads += 1
        number = self._reads
        registry = await self.redis.hgetall(self.keys.filters)  # read after ``version`` was
        if number > self._index_read:  # (a read begun later may have finished first: keep the later)
            index = FilterIndex()
            for qid, raw in registry.items():
                filt = msgpack.unpackb(raw)[0]
                index.add(qid.decode(), filt)
            self.index, self._index_read = index, number
        self._seen[key] = version  # the index installed was read after ``version``: it holds all before it

    async def matching(self, topic: str, version: Any = ..., key: str | None = None) -> list[QueueRef]:
        """The filter queues ``topic`` reaches, by the registry at ``version`` of ``key`` (both read
        now if not given; ``key`` is ``version_key(topic)`` when the version was read).

        ``version`` may be the error its read met (the version's master failing over): the copy
        this worker holds is used then, so a publish to a healthy shard goes on — no filter can be
        registered meanwhile (registering writes the version), and the pub/sub notice of one made
        just before still reaches this worker. A worker that holds no copy yet reads it again."""
        if key is None or version is ...:
            key = self.version_key(topic)
            version = ...
        if isinstance(version, BaseException):
            if self._index_read > self._stale_upto:
                _say_stale(version)
                return [queue_ref(qid) for qid in self.index.match(topic)]
            version = ...  # nothing to fall back on: wait for the version
        await self._refresh(key, await self.redis.get(key) if version is ... else version)
        return [queue_ref(qid) for qid in self.index.match(topic)]

    async def register(self, ref: QueueRef, share: str | None, client: str | None) -> None:
        await self._registrations((ref, share, client))

    async def _register_batch(self, calls: list[tuple[QueueRef, str | None, str | None]]) -> list[None]:
        """Each registration's writes and announcement, as each would make them alone, in one pipeline."""

        def writes(pipe: Any) -> None:
            for ref, share, client in calls:
                pipe.hsetnx(self.keys.filters, ref.qid, msgpack.packb([ref.topic, share, client]))
                for key in self._version_keys():
                    pipe.incr(key)

        await pipeline_then_publish_all(self.redis, writes, [(self.keys.filters_channel, ref.qid) for ref, _, _ in calls])
        self.invalidate()
        return [None] * len(calls)

    async def unregister(self, ref: QueueRef) -> None:

        def writes(pipe: Any) -> None:
            pipe.hdel(self.keys.filters, ref.qid)
            for key in self._version_keys():
                pipe.incr(key)

        await pipeline_then_publish(self.redis, writes, self.keys.filters_channel, ref.qid)
        self.invalidate()
