"""What every part of the fences layer shares: Redis, the config, key names, the loaded fences.

The parts (one module per guarantee, plus publish, subscribe and sessions)
each take a :class:`FenceContext` and the parts below them; ``core.Core``
wires them together. None of them imports another's module but to call it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError

from fencemq.config import Config
from fencemq.errors import BadArgument, LimitExceeded
from fencemq.fences.registry import Fences
from fencemq.model.keys import Keyspace, QueueRef, check_name, check_topic
from fencemq.model.values import text

log = logging.getLogger(__name__)


@dataclass
class FenceContext:
    redis: Any  # redis.asyncio.Redis or RedisCluster
    config: Config
    keys: Keyspace = field(init=False)
    fences: Fences = field(init=False)
    # Set by a worker: runs a background write beside the reply (e.g. the
    # global lease schedule) instead of before it.
    spawn: Callable[..., None] | None = None
    _topic_kinds: dict[str, str] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.keys = Keyspace(self.config.prefix)
        self.fences = Fences(self.redis)

    async def check_topic_kind(self, topic: str, lite: bool) -> None:
        """A topic is lite or plain for good (the first use decides); using it the other way is BADARG."""
        want = "lite" if lite else "plain"
        kind = self._topic_kinds.get(topic)
        if kind is None:
            key = self.keys.topic(topic)
            await self.redis.hsetnx(key, "kind", want)
            kind = text(await self.redis.hget(key, "kind"))
            self._topic_kinds[topic] = kind
        if kind != want:
            how = "with LMQ name" if kind == "lite" else "without LMQ"
            raise BadArgument(f"topic {topic!r} is a {kind} topic; use it {how}")

    def queue(self, topic: str, lmq: str | None) -> QueueRef:
        """A plain topic's queue, or one lmq of a lite topic, with both names checked."""
        check_topic(topic)
        if lmq is not None:
            check_name(lmq, "lmq")
        return QueueRef(topic, lmq)

    def idle_ttl(self, ref: QueueRef) -> int:
        """An lmq's idle TTL: how long an unowned, empty lmq lives; 0 for queues that are never reclaimed."""
        return self.config.lmq_idle_ttl_ms if ref.lite else 0

    def journal_cap(self, ref: QueueRef) -> int:
        return self.config.lite_journal_cap if ref.lite else self.config.journal_cap

    def tags(self, tags: list[str]) -> list[str]:
        """Delivery tags of one ACK, NACK or RENEW: at least one, at most a batch."""
        if not tags:
            raise BadArgument("give at least one delivery tag")
        if len(tags) > self.config.max_batch:
            raise LimitExceeded(f"{len(tags)} tags exceed {self.config.max_batch}; settle in smaller batches")
        return tags

    async def schedule(self, qid: str, due_ms: int) -> None:
        """The global lease schedule: the queue is swept at ``due_ms`` at the latest."""
        await self.redis.zadd(self.keys.schedule, {qid: due_ms}, lt=True)

    async def schedule_soon(self, qid: str, due_ms: int) -> None:
        if self.spawn is not None:
            self.spawn(self._schedule_quietly, qid, due_ms)
        else:
            await self.schedule(qid, due_ms)

    async def _schedule_quietly(self, qid: str, due_ms: int) -> None:
        try:
            await self.schedule(qid, due_ms)
        except RedisError as exc:  # the session's lease expiry returns the checkouts anyway
            log.warning("could not schedule the sweep of %s: %s", qid, exc)


def opt(value: object) -> object:
    """An optional fence argument: '' stands for none."""
    return "" if value is None else value
