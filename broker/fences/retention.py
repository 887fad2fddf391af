"""Retention by choice (docs/operations.md, "Retention"): what a queue's log keeps.

Without a retention policy a message every group has settled is deleted: the
ACK, NACK or publish after it trims the log's head (lua/lib/retention.lua), so
the log holds only what some group may still be given — plus, for a queue no
group reads yet, what it holds for its first subscriber, up to the caps of the
config (``retention_maxlen``, ``retention_maxage_ms``: against a backlog nobody
drains). A topic's *policy* — a count, an age, a size in bytes, any of them —
keeps its messages, read or not, until the policy trims them from the oldest,
and replaces those caps. Policies are an operator's (``fencemq retention``),
kept in one hash (``Keyspace.retention``: topic -> ``"count age_ms bytes"``),
and every worker reads them again about :data:`REFRESH_S` after a change (Retention.policies).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from fencemq.config import Config
from fencemq.errors import BadArgument
from fencemq.fences.redis_errors import REDIS_FAILURES
from fencemq.model.keys import Keyspace, check_topic
from fencemq.model.values import text

log = logging.getLogger(__name__)
REFRESH_S = 1.0  # how stale a worker's copy of the policies may be (while their master answers)


@dataclass(frozen=True, slots=True)
class Policy:
    """What a topic keeps: at most ``count`` messages, none older than ``age_ms``, at most ``bytes`` of log per
    queue (Redis's estimate of the log's memory). 0 is no limit; a policy has at least one limit."""

    count: int = 0
    age_ms: int = 0
    bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("count", "age_ms", "bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0 or value > 2**53 - 1:
                raise BadArgument(f"retention {name} must be an integer from 0 to 2^53-1")
        if not (self.count or self.age_ms or self.bytes):
            raise BadArgument("a retention policy keeps by count, age or bytes: give at least one "
                              "(to keep only what is unread, clear the policy)")

    def encode(self) -> str:
        return f"{self.count} {self.age_ms} {self.bytes}"

    @classmethod
    def decode(cls, raw: Any) -> "Policy":
        count, age_ms, size = (int(x) for x in text(raw).split())
        return cls(count, age_ms, size)

    def as_dict(self) -> dict[str, int]:
        return {"count": self.count, "age_ms": self.age_ms, "bytes": self.bytes}


class Retention:
    """A worker's copy of the policies, and the retention arguments of the fences that trim a log."""

    def __init__(self, redis: Any, keys: Keyspace, config: Config) -> None:
        self.redis, self.keys, self.config = redis, keys, config
        self._policies: dict[str, Policy] = {}
        self._read_at = float("-inf")
        self._have_copy = False  # read at least once: later reads run beside the calls
        self._reading: asyncio.Future[None] | None = None

    def invalidate(self) -> None:
        self._read_at = float("-inf")

    async def policies(self) -> dict[str, Policy]:
        """The policies, read again once the copy is :data:`REFRESH_S` old — beside the call that
        found it old, which goes on with the copy: on a Cluster the policies' hash lives on one
        master, and while that one fails over a publish, ACK or NACK on every other master must
        not wait for it. A read that fails keeps the copy (no policy can be set or cleared
        meanwhile: that write fails too) and is tried again :data:`REFRESH_S` later. A worker that
        never read them waits for the read, like any call."""
        if time.monotonic() - self._read_at <= REFRESH_S:
            return self._policies
        if not self._have_copy:
            await self._read()
        elif self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(self._read_beside())
        return self._policies

    async def _read(self) -> None:
        self._policies = await read_policies(self.redis, self.keys)
        self._have_copy = True
        self._read_at = time.monotonic()

    async def _read_beside(self) -> None:
        try:
            await self._read()
        except REDIS_FAILURES as exc:
            log.info("retention policies not read again (%s): this worker's copy stands", exc)
            self._read_at = time.monotonic()

    async def args(self, topic: str) -> dict[str, int]:
        """ARGV ``keep maxlen maxage_ms maxbytes`` for publish.lua, ack.lua and nack.lua."""
        policy = (await self.policies()).get(topic)
        if policy is None:
            return {"keep": 0, "maxlen": self.config.retention_maxlen, "maxage_ms": self.config.retention_maxage_ms,
                    "maxbytes": 0}
        return {"keep": 1, "maxlen": policy.count, "maxage_ms": policy.age_ms, "maxbytes": policy.bytes}


async def read_policies(redis: Any, keys: Keyspace) -> dict[str, Policy]:
    out = {}
    for topic, raw in (await redis.hgetall(keys.retention)).items():
        try:
            out[text(topic)] = Policy.decode(raw)
        except (ValueError, BadArgument):
            continue  # a record this version cannot read keeps nothing rather than failing every ACK
    return out


async def set_policy(redis: Any, keys: Keyspace, topic: str, policy: Policy) -> None:
    await redis.hset(keys.retention, check_topic(topic), policy.encode())


async def clear_policy(redis: Any, keys: Keyspace, topic: str) -> bool:
    return bool(await redis.hdel(keys.retention, check_topic(topic)))
