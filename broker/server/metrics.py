"""What a worker exports to Prometheus (``fencemq serve --metrics-port``; docs/operations.md, "Metrics").

Counters count what *this worker* did (Prometheus sums them over workers).
The backlog, oldest-unacked and session gauges are read from Redis by a
sampler every ``metrics_sample_ms``, so they are the broker's, not the
worker's: aggregate them with ``max``, not ``sum``. Their labels are bounded:
one series per topic (at most ``metrics_max_topics``, the largest backlogs)
plus the ``metrics_top_lmqs`` lmqs with the largest backlogs; nothing is
labelled by client id or tag.
"""

from __future__ import annotations

import logging
from typing import Any

import anyio
from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics

from fencemq.fences.priority import level_counts
from fencemq.fences.redis_errors import REDIS_FAILURES
from fencemq.model.keys import Keyspace, queue_ref
from fencemq.ops.dashboard import oldest_pending_ms
from fencemq.ops.operations import now_ms, queue_rows, scan_queues
from fencemq.ops.priority import LEVELS_SHOWN, backlog_by_level
from fencemq.ops.redis_health import HealthReader
from fencemq.ops.totals import SharedReading, read_totals

log = logging.getLogger(__name__)

# A `_created` series per counter doubles what Prometheus stores and nobody alerts on it.
disable_created_metrics()

COMMANDS = Counter("fencemq_commands_total", "Commands handled", ["verb"])
ERRORS = Counter("fencemq_errors_total", "Error replies sent", ["code"])
PUBLISHED = Counter("fencemq_published_total", "Messages published")
SCHEDULED = Counter("fencemq_scheduled_total", "Messages published for later (PUB … DELAY | AT), counted in published too")
SCHEDULED_RELEASED = Counter("fencemq_scheduled_released_total", "Scheduled messages appended to their log when due")
SCHEDULED_CANCELLED = Counter("fencemq_scheduled_cancelled_total", "Scheduled messages cancelled before due (UNPUB)")
DELIVERED = Counter("fencemq_delivered_total", "Messages checked out to consumers")
ACKED = Counter("fencemq_acked_total", "Checkouts settled by ACK")
NACKED = Counter("fencemq_nacked_total", "Checkouts returned (or discarded) by NACK")
DEAD_LETTERED = Counter("fencemq_dead_lettered_total", "Messages moved to a dead-letter list (NACKed too often)")
PREEMPTIONS = Counter("fencemq_preemptions_total", "SUBs that took a queue or lmq from its owner")
EVICTIONS = Counter("fencemq_evictions_total", "Members evicted, by why", ["reason"])
LEASE_TIMEOUTS = Counter("fencemq_lease_timeouts_total", "Checkouts returned because their lease expired")
RENEWALS = Counter("fencemq_renewals_total", "Leases extended by RENEW")
SUSPICIONS = Counter("fencemq_suspicions_total", "Consumers marked suspected after a lease expiry")
SESSIONS_EXPIRED = Counter("fencemq_sessions_expired_total", "Sessions ended by lease expiry")
EXPIRED = Gauge("fencemq_expired_messages", "Messages settled unsent because they had expired (PUB … TTL, MQTT "
                "Message Expiry), once per group that met them, since the broker's Redis was new (sampled)")
CONNECTIONS = Gauge("fencemq_connections", "Open client connections")
# A fence is one EVALSHA: from sub-millisecond (an ACK) to tens of ms (a large MPUB on a loaded Redis).
FENCE_SECONDS = Histogram("fencemq_fence_seconds", "Time of one fence call (EVALSHA round trip)", ["fence"],
                          buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                   1.0))

SESSIONS = Gauge("fencemq_sessions", "Sessions alive in the broker (sampled from Redis)")
BACKLOG = Gauge("fencemq_backlog_messages", "Messages not yet delivered to the slowest group (sampled)",
                ["topic", "lmq"])
OLDEST_UNACKED = Gauge("fencemq_oldest_unacked_age_seconds",
                       "Age of the oldest message some group has not acknowledged (sampled)", ["topic", "lmq"])
SCHEDULED_MESSAGES = Gauge("fencemq_scheduled_messages", "Messages published for later (PUB … DELAY | AT), not yet "
                           "due, per topic (sampled; a lite topic's: all its lmqs')", ["topic"])
PRIORITY_BACKLOG = Gauge("fencemq_priority_backlog_messages", "A priority topic's backlog per level 0-9: at each "
                         "level, the most messages one group has not read (sampled)", ["topic", "level"])
SAMPLED_QUEUES = Gauge("fencemq_sampled_queues", "Queues the last sample read (capped by metrics_scan_limit)")
# The memory guard's sample (fences/memory.py, every memory_sample_ms), per Redis node (a Cluster's primaries)
REDIS_MEMORY = Gauge("fencemq_redis_memory_bytes", "Redis memory as counted against maxmemory (sampled)", ["node"])
REDIS_MEMORY_LIMIT = Gauge("fencemq_redis_memory_limit_bytes",
                           "What the memory watermarks are fractions of: maxmemory, or its fallback", ["node"])
ALARM = Gauge("fencemq_alarm", "1 while an alarm is on: memory (publishes refused FULL), eviction "
              "(maxmemory-policy is not noeviction: publishes refused EVICTING), and the health watcher's "
              "(docs/ui.md, Alarms); node is the alarm's subject", ["alarm", "node"])


# Every node's health (ops/redis_health.py), read by each worker's sampler: aggregate with max
REDIS_UP = Gauge("fencemq_redis_up", "1 while the Redis node answers", ["node", "role"])
REDIS_MAXMEMORY = Gauge("fencemq_redis_maxmemory_bytes", "The node's maxmemory (0: no limit)", ["node"])
REDIS_FRAGMENTATION = Gauge("fencemq_redis_fragmentation_ratio", "RSS over used memory (mem_fragmentation_ratio)",
                            ["node"])
REDIS_EVICTED = Gauge("fencemq_redis_evicted_keys", "Keys the node has evicted since it started (must stay 0)",
                      ["node"])
REDIS_OPS = Gauge("fencemq_redis_ops_per_second", "Commands per second the node reports", ["node"])
REDIS_LATENCY = Gauge("fencemq_redis_latency_seconds", "Round trip of a PING to the node", ["node"])
REDIS_PERSISTENCE_OK = Gauge("fencemq_redis_persistence_ok", "1 while the last RDB save and AOF write succeeded",
                             ["node"])
REDIS_REPLICAS = Gauge("fencemq_redis_connected_replicas", "Replicas connected to the primary", ["node"])
REDIS_LAG_BYTES = Gauge("fencemq_redis_replication_lag_bytes", "How far a replica's offset trails its primary's",
                        ["node", "primary"])
REDIS_LAG_SECONDS = Gauge("fencemq_redis_replication_lag_seconds",
                          "Seconds since the replica's last acknowledgement, as its primary sees it", ["node"])
REDIS_SLOTS_OK = Gauge("fencemq_redis_cluster_slots_ok", "Slots the Cluster node sees served (of 16384)", ["node"])
REDIS_CLUSTER_OK = Gauge("fencemq_redis_cluster_state_ok", "1 while the Cluster node sees the state ok", ["node"])
_HEALTH_GAUGES = (REDIS_UP, REDIS_MAXMEMORY, REDIS_FRAGMENTATION, REDIS_EVICTED, REDIS_OPS, REDIS_LATENCY,
                  REDIS_PERSISTENCE_OK, REDIS_REPLICAS, REDIS_LAG_BYTES, REDIS_LAG_SECONDS, REDIS_SLOTS_OK,
                  REDIS_CLUSTER_OK)
_exported_alarms: set[tuple[str, str]] = set()


def redis_health_read(health: Any) -> None:
    """Every node of a Health (ops/redis_health.py) as gauges; nodes no longer listed are dropped."""
    for gauge in _HEALTH_GAUGES:
        gauge.clear()
    for n in health.nodes:
        REDIS_UP.labels(n.node, n.role).set(1 if n.up else 0)
        if not n.up:
            continue
        REDIS_MEMORY.labels(n.node).set(n.used_memory)
        REDIS_MAXMEMORY.labels(n.node).set(n.maxmemory)
        if n.fragmentation is not None:
            REDIS_FRAGMENTATION.labels(n.node).set(n.fragmentation)
        REDIS_EVICTED.labels(n.node).set(n.evicted_keys)
        REDIS_OPS.labels(n.node).set(n.ops_per_sec)
        if n.latency_ms is not None:
            REDIS_LATENCY.labels(n.node).set(n.latency_ms / 1000)
        REDIS_PERSISTENCE_OK.labels(n.node).set(1 if n.persistence_ok else 0)
        if n.role == "primary":
            REDIS_REPLICAS.labels(n.node).set(n.replicas)
        if n.lag_bytes is not None:
            REDIS_LAG_BYTES.labels(n.node, n.primary or "").set(n.lag_bytes)
        if n.lag_s is not None:
            REDIS_LAG_SECONDS.labels(n.node).set(n.lag_s)
        if n.slots_ok is not None:
            REDIS_SLOTS_OK.labels(n.node).set(n.slots_ok)
        if n.cluster_state is not None:
            REDIS_CLUSTER_OK.labels(n.node).set(1 if n.cluster_state == "ok" else 0)


def alarms_seen(alarms: Any) -> None:
    """The alarms of the store (fences/memory.py Alarm records) as fencemq_alarm: 1 while on; one that
    cleared is dropped. The memory guard sets its own kinds (memory, eviction) after each sample."""
    on = {(a.kind, a.node) for a in alarms if a.kind not in ("memory", "eviction")}
    for labels in _exported_alarms - on:
        ALARM.remove(*labels)
    for labels in on:
        ALARM.labels(*labels).set(1)
    _exported_alarms.clear()
    _exported_alarms.update(on)


def memory_sampled(guard: Any) -> None:
    """After each sample of the memory guard: its figures and alarms, per node."""
    for node, n in guard.nodes.items():
        REDIS_MEMORY.labels(node).set(n.used)
        REDIS_MEMORY_LIMIT.labels(node).set(n.limit(guard.config.memory_limit_bytes))
        for kind in ("memory", "eviction"):
            ALARM.labels(kind, node).set(1 if f"{kind}@{node}" in guard.alarms else 0)


# The labelled children of the per-call metrics, looked up once each: ``labels()`` takes a lock and
# checks its values on every call, twice per command on the hot path. A child is the very object
# ``labels()`` returns for those values (prometheus_client keeps it until the metric is cleared,
# which these two never are), so what is counted is the same.
_command_counts: dict[str, Any] = {}
_fence_times: dict[str, Any] = {}


def count_command(verb: str) -> None:
    """``COMMANDS.labels(verb).inc()``."""
    child = _command_counts.get(verb)
    if child is None:
        child = _command_counts[verb] = COMMANDS.labels(verb)
    child.inc()


def observe_fence(name: str, seconds: float) -> None:
    """``FENCE_SECONDS.labels(name).observe(seconds)``."""
    child = _fence_times.get(name)
    if child is None:
        child = _fence_times[name] = FENCE_SECONDS.labels(name)
    child.observe(seconds)


async def sample(redis: Any, keys: Keyspace, *, scan_limit: int, max_topics: int, top_lmqs: int,
                 totals: SharedReading | None = None) -> None:
    """Read the broker's gauges from Redis once and set them (the previous label sets are dropped)."""
    now = await now_ms(redis)
    sessions = await redis.zcount(keys.sessions, now, "+inf")
    page = await scan_queues(redis, keys, limit=scan_limit)
    rows = await queue_rows(redis, keys, page.qids)
    firsts = await oldest_pending_ms(redis, keys, rows)
    by_topic: dict[str, list[float]] = {}
    scheduled: dict[str, int] = {}
    priority: list[str] = []  # qids of the priority queues (plain topics' only: one per topic)
    lmqs: list[tuple[int, str, str, float]] = []
    for row in rows:
        if row["scheduled"]:
            scheduled[row["topic"]] = scheduled.get(row["topic"], 0) + row["scheduled"]
        if row["priority"]:
            priority.append(row["qid"])
        backlog = row["backlog"] or 0
        age = max(0.0, (now - firsts[row["qid"]]) / 1000) if row["qid"] in firsts else 0.0
        total = by_topic.setdefault(row["topic"], [0, 0.0])
        total[0] += backlog
        total[1] = max(total[1], age)
        if row["lmq"] is not None:
            lmqs.append((backlog, row["topic"], row["lmq"], age))
    topics = sorted(by_topic.items(), key=lambda kv: kv[1][0], reverse=True)[:max_topics]
    lmqs = sorted(lmqs, reverse=True)[:top_lmqs]
    # the same cap as the backlog's: the max_topics topics with the most scheduled; per level, the
    # priority topics among those the backlog gauge exports (at most max_topics · 10 series)
    most_scheduled = sorted(scheduled.items(), key=lambda kv: kv[1], reverse=True)[:max_topics]
    exported = {topic for topic, _ in topics}
    levels: dict[str, dict[int, int]] = {}
    for qid in priority:
        ref = queue_ref(qid)
        if ref.topic in exported:
            levels[ref.topic] = backlog_by_level(await level_counts(redis, keys.queue(ref)))
    SESSIONS.set(sessions)
    EXPIRED.set(((await totals.read())[0] if totals is not None else await read_totals(redis, keys))["expired"])
    SAMPLED_QUEUES.set(len(rows))
    for gauge in (BACKLOG, OLDEST_UNACKED, SCHEDULED_MESSAGES, PRIORITY_BACKLOG):
        gauge.clear()
    for topic, n in most_scheduled:
        SCHEDULED_MESSAGES.labels(topic).set(n)
    for topic, by_level in levels.items():
        for level in LEVELS_SHOWN:  # every level, 0 too: a level that drains reads 0, not gone
            PRIORITY_BACKLOG.labels(topic, str(level)).set(by_level.get(level, 0))
    for topic, (backlog, age) in topics:
        BACKLOG.labels(topic, "").set(backlog)
        OLDEST_UNACKED.labels(topic, "").set(age)
    for backlog, topic, lmq, age in lmqs:
        BACKLOG.labels(topic, lmq).set(backlog)
        OLDEST_UNACKED.labels(topic, lmq).set(age)


async def run_sampler(redis: Any, keys: Keyspace, *, every_ms: int, scan_limit: int, max_topics: int,
                      top_lmqs: int, url: str | None = None, totals: SharedReading | None = None) -> None:
    """Sample the gauges for ever, the Redis nodes' health with them (a Redis outage skips samples, it
    never ends the worker)."""
    reader = HealthReader(redis, keys, url)
    try:
        while True:
            try:
                await sample(redis, keys, scan_limit=scan_limit, max_topics=max_topics, top_lmqs=top_lmqs,
                             totals=totals)
                redis_health_read(await reader.read())
            except REDIS_FAILURES as exc:
                log.warning("could not sample the metrics gauges: %s", exc)
            except Exception:  # a sampling bug must never take the worker down: the gauges just go stale
                log.exception("sampling the metrics gauges failed")
            await anyio.sleep(every_ms / 1000)
    finally:
        with anyio.CancelScope(shield=True):
            await reader.aclose()
