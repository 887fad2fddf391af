"""MQTT filter subscriptions: a registry in Redis and a trie cached per worker.

A filter subscription owns a queue (``f:<owner>:<filter>``); a publish to a
topic is copied into the queue of every matching filter, found through the
worker's FilterIndex — never a scan of all subscriptions. The registry is a
hash plus a version counter; a change is announced on a channel, and every
worker also re-reads the version at least once a second, so a missed
announcement costs at most that delay.
"""

from __future__ import annotations

import time
from typing import Any

import msgpack
from redis.asyncio import Redis

from fencemq.model.keys import Keyspace, QueueRef
from fencemq.fences.redis_client import pipeline_then_publish
from fencemq.model.keys import queue_ref
from fencemq.model.topics import FilterIndex

RECHECK_S = 1.0


class FilterRegistry:
    def __init__(self, redis: Redis, keys: Keyspace) -> None:
        self.redis = redis
        self.keys = keys
        self.index = FilterIndex()
        self.version: bytes | None = None
        self.checked_at = 0.0

    def invalidate(self) -> None:
        self.checked_at = 0.0

    async def _refresh(self) -> None:
        now = time.monotonic()
        if now - self.checked_at < RECHECK_S:
            return
        self.checked_at = now
        version = await self.redis.get(self.keys.filters_version)
        if version == self.version:
            return
        index = FilterIndex()
        for qid, raw in (await self.redis.hgetall(self.keys.filters)).items():
            filt = msgpack.unpackb(raw)[0]
            index.add(qid.decode(), filt)
        self.index, self.version = index, version

    async def matching(self, topic: str) -> list[QueueRef]:
        await self._refresh()
        return [queue_ref(qid) for qid in self.index.match(topic)]

    async def register(self, ref: QueueRef, share: str | None, client: str | None) -> None:

        def writes(pipe: Any) -> None:
            pipe.hsetnx(self.keys.filters, ref.qid, msgpack.packb([ref.topic, share, client]))
            pipe.incr(self.keys.filters_version)

        await pipeline_then_publish(self.redis, writes, self.keys.filters_channel, ref.qid)
        self.invalidate()

    async def unregister(self, ref: QueueRef) -> None:

        def writes(pipe: Any) -> None:
            pipe.hdel(self.keys.filters, ref.qid)
            pipe.incr(self.keys.filters_version)

        await pipeline_then_publish(self.redis, writes, self.keys.filters_channel, ref.qid)
        self.invalidate()
