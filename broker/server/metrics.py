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
from redis.exceptions import RedisError

from fencemq.model.keys import Keyspace
from fencemq.ops.operations import now_ms, queue_rows, scan_queues

log = logging.getLogger(__name__)

# A `_created` series per counter doubles what Prometheus stores and nobody alerts on it.
disable_created_metrics()

COMMANDS = Counter("fencemq_commands_total", "Commands handled", ["verb"])
ERRORS = Counter("fencemq_errors_total", "Error replies sent", ["code"])
PUBLISHED = Counter("fencemq_published_total", "Messages published")
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
SAMPLED_QUEUES = Gauge("fencemq_sampled_queues", "Queues the last sample read (capped by metrics_scan_limit)")
# The memory guard's sample (fences/memory.py, every memory_sample_ms), per Redis node (a Cluster's primaries)
REDIS_MEMORY = Gauge("fencemq_redis_memory_bytes", "Redis memory as counted against maxmemory (sampled)", ["node"])
REDIS_MEMORY_LIMIT = Gauge("fencemq_redis_memory_limit_bytes",
                           "What the memory watermarks are fractions of: maxmemory, or its fallback", ["node"])
ALARM = Gauge("fencemq_alarm", "1 while an alarm is on: memory (publishes refused FULL), eviction "
              "(maxmemory-policy is not noeviction: publishes refused EVICTING)", ["alarm", "node"])


def memory_sampled(guard: Any) -> None:
    """After each sample of the memory guard: its figures and alarms, per node."""
    for node, n in guard.nodes.items():
        REDIS_MEMORY.labels(node).set(n.used)
        REDIS_MEMORY_LIMIT.labels(node).set(n.limit(guard.config.memory_limit_bytes))
        for kind in ("memory", "eviction"):
            ALARM.labels(kind, node).set(1 if f"{kind}@{node}" in guard.alarms else 0)


def observe_fence(name: str, seconds: float) -> None:
    FENCE_SECONDS.labels(name).observe(seconds)


async def oldest_pending_ms(redis: Any, keys: Keyspace, rows: list[dict[str, Any]]) -> dict[str, int]:
    """Publish time of each queue's oldest message not yet acknowledged by every group.

    That message is the lowest of: each group's cursor (its next unread id), the
    first returned message waiting in ``rd``, and the checkout due first (an
    approximation of the oldest checkout that costs one lookup, not a scan; likewise
    ``rd``'s first entry is its first group's oldest).
    """
    firsts: dict[str, int] = {}
    async with redis.pipeline(transaction=False) as pipe:
        for row in rows:
            k = keys.queue_by_id(row["qid"])
            pipe.zrange(k.ready, 0, 0)
            pipe.zrange(k.deadlines, 0, 0)
        replies = await pipe.execute() if rows else []
    async with redis.pipeline(transaction=False) as pipe:
        asked = []
        for i, row in enumerate(rows):
            ready, due = replies[2 * i : 2 * i + 2]
            candidates = [row["oldest_unread"]] if row.get("oldest_unread") is not None else []
            if ready:
                candidates.append(int(ready[0].split(b"\0")[1]))
            if due:
                k = keys.queue_by_id(row["qid"])
                pipe.hget(k.checkouts, due[0])
                asked.append((row["qid"], candidates, True))
            else:
                asked.append((row["qid"], candidates, False))
        checkout_replies = iter(await pipe.execute()) if any(a[2] for a in asked) else iter(())
    async with redis.pipeline(transaction=False) as pipe:
        looked = []
        for qid, candidates, has_due in asked:
            if has_due and (record := next(checkout_replies)):
                candidates.append(int(record.split(b"\0")[2]))
            if candidates:
                pipe.hget(keys.queue_by_id(qid).log, min(candidates))
                looked.append(qid)
        entries = await pipe.execute() if looked else []
    for qid, entry in zip(looked, entries, strict=True):
        if entry:
            firsts[qid] = int(entry.split(b":", 1)[0])  # the publish ms the fence stamped
    return firsts


async def sample(redis: Any, keys: Keyspace, *, scan_limit: int, max_topics: int, top_lmqs: int) -> None:
    """Read the broker's gauges from Redis once and set them (the previous label sets are dropped)."""
    now = await now_ms(redis)
    sessions = await redis.zcount(keys.sessions, now, "+inf")
    page = await scan_queues(redis, keys, limit=scan_limit)
    rows = await queue_rows(redis, keys, page.qids)
    firsts = await oldest_pending_ms(redis, keys, rows)
    by_topic: dict[str, list[float]] = {}
    lmqs: list[tuple[int, str, str, float]] = []
    for row in rows:
        backlog = row["backlog"] or 0
        age = max(0.0, (now - firsts[row["qid"]]) / 1000) if row["qid"] in firsts else 0.0
        total = by_topic.setdefault(row["topic"], [0, 0.0])
        total[0] += backlog
        total[1] = max(total[1], age)
        if row["lmq"] is not None:
            lmqs.append((backlog, row["topic"], row["lmq"], age))
    topics = sorted(by_topic.items(), key=lambda kv: kv[1][0], reverse=True)[:max_topics]
    lmqs = sorted(lmqs, reverse=True)[:top_lmqs]
    SESSIONS.set(sessions)
    SAMPLED_QUEUES.set(len(rows))
    for gauge in (BACKLOG, OLDEST_UNACKED):
        gauge.clear()
    for topic, (backlog, age) in topics:
        BACKLOG.labels(topic, "").set(backlog)
        OLDEST_UNACKED.labels(topic, "").set(age)
    for backlog, topic, lmq, age in lmqs:
        BACKLOG.labels(topic, lmq).set(backlog)
        OLDEST_UNACKED.labels(topic, lmq).set(age)


async def run_sampler(redis: Any, keys: Keyspace, *, every_ms: int, scan_limit: int, max_topics: int,
                      top_lmqs: int) -> None:
    """Sample the gauges for ever (a Redis outage skips samples, it never ends the worker)."""
    while True:
        try:
            await sample(redis, keys, scan_limit=scan_limit, max_topics=max_topics, top_lmqs=top_lmqs)
        except (OSError, RedisError) as exc:
            log.warning("could not sample the metrics gauges: %s", exc)
        except Exception:  # a sampling bug must never take the worker down: the gauges just go stale
            log.exception("sampling the metrics gauges failed")
        await anyio.sleep(every_ms / 1000)
