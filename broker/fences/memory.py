"""The broker's Redis memory: the eviction policy it must have, the watermark, and the alarms.

Every byte of the broker's state is in Redis, so Redis's memory limit is the
broker's (docs/operations.md, "Redis memory"):

* A Redis that may evict keys (``maxmemory-policy`` other than ``noeviction``)
  deletes acknowledged messages, sessions and leases without a word. A worker
  refuses to start on one (:meth:`MemoryGuard.start`), and so do the CLI's
  writes; when a node's policy changes at run time an *eviction* alarm goes up
  and publishes are refused (``EVICTING``) until it is put back.
* Above the *high watermark* (``memory_high_watermark`` of a node's limit) a
  *memory* alarm goes up and publishes are refused (``FULL``) until the node
  falls below the *low watermark* (hysteresis: the alarm does not flap). What
  consumes always works: the fences that do are flagged ``allow-oom``
  (lua_sources.py), so they run at ``maxmemory`` itself.

A node's limit is its ``maxmemory``; with ``maxmemory 0`` (Redis's default: no
limit) the ``memory_limit_bytes`` setting, else the machine's memory as Redis
reports it (``total_system_memory``). The guard samples ``INFO memory`` of every
node it uses (each primary of a Cluster) every ``memory_sample_ms``, and at once
after a publish met Redis's own OOM. Alarms are records in Redis (``alarms``:
what, since when) so every worker, ``fencemq status`` and the web UI show the
same ones; each worker keeps the state it acts on, so a publish is refused
without a round trip.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
from redis.asyncio import RedisCluster
from redis.exceptions import OutOfMemoryError

from fencemq.config import Config
from fencemq.errors import BadArgument, EvictingRedis, FenceMQError, Full
from fencemq.fences.redis_errors import REDIS_FAILURES
from fencemq.fences.registry import Fences, fence
from fencemq.model.keys import Keyspace
from fencemq.model.values import text

log = logging.getLogger(__name__)

ALARM = fence("alarm", "alarms", "name detail")
SAFE_POLICY = "noeviction"
MEMORY, EVICTION = "memory", "eviction"


@dataclass(frozen=True, slots=True)
class NodeMemory:
    """One node's ``INFO memory``: what the guard judges."""

    node: str  # host:port
    used: int  # as Redis counts it against maxmemory (used_memory - mem_not_counted_for_evict)
    maxmemory: int
    policy: str
    total_system: int

    def limit(self, fallback: int = 0) -> int:
        """The bytes the watermarks are fractions of (see the module's docstring)."""
        return self.maxmemory or fallback or self.total_system

    def share(self, fallback: int = 0) -> float:
        limit = self.limit(fallback)
        return self.used / limit if limit else 0.0


def node_memory(node: str, info: dict[str, Any]) -> NodeMemory:
    def number(name: str) -> int:
        try:
            return int(info.get(name) or 0)
        except (TypeError, ValueError):
            return 0

    return NodeMemory(node=node, used=max(0, number("used_memory") - number("mem_not_counted_for_evict")),
                      maxmemory=number("maxmemory"), policy=text(info.get("maxmemory_policy") or "unknown"),
                      total_system=number("total_system_memory"))


async def read_nodes(redis: Any) -> list[NodeMemory]:
    """``INFO memory`` of every node the broker writes to: each primary of a Cluster, else the one server."""
    if isinstance(redis, RedisCluster):
        out = []
        for node in sorted(redis.get_primaries(), key=lambda n: n.name):
            info = await redis.execute_command("INFO", "memory", target_nodes=node)
            if isinstance(info, dict) and "used_memory" not in info and len(info) == 1:
                info = next(iter(info.values()))  # some redis-py versions key a one-node reply by node
            out.append(node_memory(node.name, info))
        return out
    info = await redis.info("memory")
    kwargs = redis.connection_pool.connection_kwargs
    name = f"{kwargs['host']}:{kwargs.get('port', 6379)}" if kwargs.get("host") else kwargs.get("path") or "redis"
    return [node_memory(name, info)]


def mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def evicting_message(node: NodeMemory) -> str:
    return (f"Redis at {node.node} has maxmemory-policy {node.policy}: it may evict the broker's keys "
            "(acknowledged messages, sessions, leases) without a word. Set it to noeviction "
            "(CONFIG SET maxmemory-policy noeviction, and maxmemory-policy noeviction in its redis.conf)")


@dataclass(frozen=True, slots=True)
class Alarm:
    """An alarm as the records in Redis hold it (:func:`read_alarms`)."""

    kind: str  # memory | eviction
    node: str
    since_ms: int
    detail: str

    @property
    def name(self) -> str:
        return f"{self.kind}@{self.node}"


def decode_alarms(raw: dict[Any, Any]) -> list[Alarm]:
    """The alarms hash (HGETALL) as Alarms, the oldest first; a record that does not parse is shown as is."""
    out = []
    for name, value in raw.items():
        kind, _, node = text(name).partition("@")
        since, _, detail = text(value).partition(" ")
        out.append(Alarm(kind, node, int(since) if since.isdigit() else 0, detail))
    return sorted(out, key=lambda a: (a.since_ms, a.kind, a.node))


async def read_alarms(redis: Any, keys: Keyspace) -> list[Alarm]:
    return decode_alarms(await redis.hgetall(keys.alarms))


def is_oom(exc: BaseException) -> bool:
    """Redis refused a write for memory (its own OOM, as redis-py or a FenceMQError code names it)."""
    return isinstance(exc, OutOfMemoryError) or getattr(exc, "code", None) == "OOM" or str(exc).startswith("OOM ")


class MemoryGuard:
    """One worker's (or CLI's) view of the broker's Redis memory, and the alarms it raises and clears."""

    def __init__(self, redis: Any, config: Config, keys: Keyspace, fences: Fences) -> None:
        self.high, self.low = config.memory_high_watermark, config.memory_low_watermark
        if not 0 < self.low <= self.high <= 1:
            raise BadArgument(f"memory watermarks must be 0 < low <= high <= 1 (low {self.low}, high {self.high})")
        self.redis, self.config, self.keys, self.fences = redis, config, keys, fences
        self.nodes: dict[str, NodeMemory] = {}  # the last sample, by node
        self.alarms: dict[str, Alarm] = {}  # the alarms this guard holds on, by name
        self.on_sample: Callable[[MemoryGuard], None] | None = None  # told after each sample (metrics)
        self._wake = anyio.Event()
        self._failing = False

    # -- what the publish path asks ------------------------------------------------------------

    def check_publish(self) -> None:
        """Raise EVICTING or FULL while an alarm is on; nothing to do (one dict lookup) otherwise."""
        if not self.alarms:
            return
        for alarm in self.alarms.values():
            if alarm.kind == EVICTION:
                raise EvictingRedis(f"publishing is refused: {alarm.detail}")
        alarm = next(iter(self.alarms.values()))
        raise Full(alarm.detail)

    def refused_by_redis(self, exc: BaseException) -> FenceMQError:
        """A publish met Redis's own OOM (memory rose past the watermark between two samples): FULL,
        and a sample now, so the alarm goes up for the next ones."""
        self._wake.set()
        return Full(f"Redis is at its maxmemory ({' '.join(str(exc).split())[:120]}): consume and ACK to drain "
                    "it, or raise its maxmemory; retry later")

    # -- sampling ------------------------------------------------------------------------------

    async def start(self) -> None:
        """At start: take up the alarms raised before (a memory alarm holds until memory falls below the
        low watermark, whoever raised it), sample, and refuse a Redis that may evict keys."""
        for alarm in await read_alarms(self.redis, self.keys):
            if alarm.kind == MEMORY:
                self.alarms[alarm.name] = alarm
        await self.sample()
        bad = [n for n in self.nodes.values() if n.policy != SAFE_POLICY]
        if bad:
            raise EvictingRedis("; ".join(evicting_message(n) for n in bad))
        unlimited = [n.node for n in self.nodes.values() if not n.maxmemory]
        if unlimited and not self.config.memory_limit_bytes:
            log.warning("Redis at %s has no maxmemory: the memory watermark is %.0f%% of the machine's memory as "
                        "Redis reports it (%s); set maxmemory (or FENCEMQ_MEMORY_LIMIT_BYTES)",
                        ", ".join(unlimited), 100 * self.high, mib(self.nodes[unlimited[0]].total_system))

    async def sample(self) -> None:
        """Read every node's memory and policy; raise and clear alarms accordingly.

        Every alarm is judged before any is written, and the exported figures follow at once: the
        publish path's refusal (``check_publish``) and ``fencemq_alarm`` change together, not a
        write to Redis per node apart (which a Cluster of three made a visible gap)."""
        nodes = await read_nodes(self.redis)
        self.nodes = {n.node: n for n in nodes}
        records = [r for n in nodes for r in (*self._judge_memory(n), *self._judge_policy(n))]
        if self.on_sample is not None:
            self.on_sample(self)
        for name, detail in records:
            await self.fences.run(ALARM, None, extra_keys={"alarms": self.keys.alarms}, name=name, detail=detail)

    async def run(self) -> None:
        """Sample every ``memory_sample_ms`` (sooner when asked) for as long as the worker runs; a Redis
        error is logged (once per outage) and the next sample tries again: it never ends the worker."""
        every = self.config.memory_sample_ms / 1000
        while True:
            with anyio.move_on_after(every):
                await self._wake.wait()
            self._wake = anyio.Event()
            try:
                await self.sample()
                self._failing = False
            except REDIS_FAILURES as exc:
                if not self._failing:
                    log.warning("could not sample the memory of the broker's Redis: %s", exc)
                self._failing = True
            except Exception:  # a bug (or a client library's surprise) must not end the worker: the next sample
                log.exception("sampling the memory of the broker's Redis failed")

    # A judge changes the alarms this guard holds and says which records to write: (name, detail),
    # detail "" to clear one. An alarm still on is written again: a record cleared elsewhere (or lost
    # in a failover) comes back.

    def _judge_memory(self, n: NodeMemory) -> list[tuple[str, str]]:
        name = f"{MEMORY}@{n.node}"
        limit = n.limit(self.config.memory_limit_bytes)
        if not limit:
            return []
        on = name in self.alarms
        if not on and n.used >= self.high * limit:
            detail = (f"Redis at {n.node} is {100 * n.used / limit:.0f}% full ({mib(n.used)} of {mib(limit)}): "
                      f"publishing stops at {100 * self.high:.0f}% and resumes below {100 * self.low:.0f}%; "
                      "consume and ACK to drain it, or raise its maxmemory; retry later")
            return self._raise(Alarm(MEMORY, n.node, int(time.time() * 1000), detail))
        if on and n.used < self.low * limit:
            return self._clear(name, f"Redis at {n.node} is down to {100 * n.used / limit:.0f}% "
                                     f"({mib(n.used)} of {mib(limit)}): publishing resumes")
        return [(name, self.alarms[name].detail)] if on else []

    def _judge_policy(self, n: NodeMemory) -> list[tuple[str, str]]:
        name = f"{EVICTION}@{n.node}"
        on = name in self.alarms
        if n.policy != SAFE_POLICY and not on:
            return self._raise(Alarm(EVICTION, n.node, int(time.time() * 1000), evicting_message(n)))
        if n.policy == SAFE_POLICY and on:
            return self._clear(name, f"Redis at {n.node} is back to maxmemory-policy noeviction: publishing resumes")
        return [(name, self.alarms[name].detail)] if on else []

    def _raise(self, alarm: Alarm) -> list[tuple[str, str]]:
        self.alarms[alarm.name] = alarm
        log.error("%s alarm: %s", alarm.kind, alarm.detail)
        return [(alarm.name, alarm.detail)]

    def _clear(self, name: str, why: str) -> list[tuple[str, str]]:
        alarm = self.alarms.pop(name)
        log.warning("%s alarm cleared: %s", alarm.kind, why)
        return [(name, "")]


async def check_policy(redis: Any) -> None:
    """Refuse a Redis that may evict keys (EVICTING, saying what to set): the CLI's writes call this."""
    bad = [n for n in await read_nodes(redis) if n.policy != SAFE_POLICY]
    if bad:
        raise EvictingRedis("; ".join(evicting_message(n) for n in bad))
