"""The broker's alarms beyond memory: each threshold (a setting with a default, broker/config.py) turned
into the alarms that should be on now. Pure: observations in, wanted alarms out.

The alarms themselves are one store for every kind, the memory guard's (fences/memory.py: the
``alarms`` hash, ``kind@subject`` -> since and detail, raised and cleared by ``alarm.lua``);
server/health_watch.py reads what these rules need, asks them, and raises what they want on and
clears what they no longer want. docs/ui.md ("Alarms") lists every kind with its threshold.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fencemq.config import Config
from fencemq.ops.redis_health import Health

# The kinds the health watcher (one worker at a time) judges, and the kind each worker judges for itself.
WATCHED = ("redis", "replica", "replicas", "replication", "cluster", "failover", "worker", "unacked",
           "dead-letters")
OWN = ("limits",)


@dataclass(frozen=True)
class Wanted:
    """An alarm that should be on: ``kind@subject`` in the store, with what is wrong and what to do."""

    kind: str
    subject: str
    detail: str

    @property
    def name(self) -> str:
        return f"{self.kind}@{self.subject}"


def mib(n: float) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def expected_replicas(config: Config) -> int:
    """The replicas every primary should have: alarm_min_replicas, or what the durability waits for."""
    want = config.alarm_min_replicas
    for part in config.durability.split("+"):
        if part.startswith("replicas="):
            try:
                n = part.partition("=")[2]
                want = max(want, 1 if n == "all" else int(n))
            except ValueError:
                pass
    return want


def redis_alarms(health: Health, config: Config) -> list[Wanted]:
    """A node that does not answer, a replica gone or behind, a shard short of replicas, a Cluster node
    failing or seeing failed slots, a primary Sentinel sees down or failing over."""
    out: list[Wanted] = []
    need = expected_replicas(config)
    for n in health.nodes:
        if n.role == "primary" and not n.up:
            out.append(Wanted("redis", n.node, f"Redis primary {n.node} does not answer ({n.error}): the broker's "
                                               "writes to it fail until it is back or a replica is promoted"))
        elif n.role == "replica" and not n.up:
            out.append(Wanted("replica", n.node, f"replica {n.node} of {n.primary or '?'} is not connected: "
                                                 f"{n.error}; start it again or remove it (it is forgotten after "
                                                 f"{config.replica_forget_ms // 60_000} min away)"))
        elif n.role == "replica" and (n.link_up is False or (n.lag_bytes or 0) > config.alarm_replication_lag_bytes
                                      or (n.lag_s or 0) > config.alarm_replication_lag_s):
            why = "its link to the primary is down" if n.link_up is False else (
                f"{mib(n.lag_bytes or 0)} behind its primary's offset" if (n.lag_bytes or 0)
                > config.alarm_replication_lag_bytes else f"its last acknowledgement was {n.lag_s:.0f} s ago")
            out.append(Wanted("replication", n.node,
                              f"replica {n.node} of {n.primary} lags: {why} (alarm above "
                              f"{mib(config.alarm_replication_lag_bytes)} or {config.alarm_replication_lag_s} s); "
                              "a failover now would lose what it has not received"))
        if n.role == "primary" and n.up and n.replicas < need:
            out.append(Wanted("replicas", n.node, f"primary {n.node} has {n.replicas} connected replica(s) of the "
                                                  f"{need} expected (alarm_min_replicas, durability): a failure of "
                                                  "it would lose data and stop the broker's writes to its slots"))
        failing = {"fail", "fail?"} & set(n.flags.split(","))
        if failing or (n.up and n.cluster_state not in (None, "ok")):
            what = f"is marked {'/'.join(sorted(failing))} by the Cluster" if failing else (
                f"sees the Cluster state {n.cluster_state} ({n.slots_ok} of 16384 slots ok, {n.slots_fail} failed, "
                f"{n.slots_pfail} suspected)")
            out.append(Wanted("cluster", n.node, f"Redis Cluster node {n.node} {what}: a failover is under way, "
                                                 "or a shard has no replica left to promote"))
    s = health.sentinel
    if s is not None:
        flags = set(str(s.get("flags", "")).split(","))
        bad = flags & {"s_down", "o_down", "failover_in_progress", "failover_state_wait_promotion"}
        if bad:
            out.append(Wanted("failover", str(s.get("service")),
                              f"Sentinel sees primary {s.get('primary')} of '{s.get('service')}' as "
                              f"{', '.join(sorted(bad))}: a failover is under way; clients are told TRYAGAIN"))
    return out


def worker_alarms(workers: Iterable[tuple[str, int]], now_ms: int, config: Config) -> list[Wanted]:
    """A listed worker whose lease ran out: it missed its beats (it renews a third of a lease in)."""
    out = []
    for worker, deadline in workers:
        if deadline < now_ms:
            beat = deadline - config.session_lease_ms
            out.append(Wanted("worker", worker, f"worker {worker} missed its beat: its last was {(now_ms - beat) / 1000:.0f} s "
                                                f"ago; its sessions go to other workers; it is forgotten after "
                                                f"{config.worker_forget_ms // 60_000} min"))
    return out


def unacked_alarm(oldest: tuple[str, int] | None, now_ms: int, config: Config) -> list[Wanted]:
    """``oldest``: (queue id, publish ms) of the oldest message some group has not acknowledged."""
    if oldest is None or now_ms - oldest[1] < config.alarm_unacked_age_ms:
        return []
    qid, at = oldest
    return [Wanted("unacked", "broker", f"queue {qid} holds a message published {(now_ms - at) / 60_000:.0f} min "
                                       f"ago that a group has not acknowledged (alarm after "
                                       f"{config.alarm_unacked_age_ms // 60_000} min): a consumer is stuck or gone")]


def dead_letter_alarm(grown: int | None, config: Config) -> list[Wanted]:
    """``grown``: messages dead-lettered within the last alarm_dead_letter_window_ms (None: not known yet)."""
    if grown is None or grown < config.alarm_dead_letter_growth:
        return []
    return [Wanted("dead-letters", "broker", f"{grown:,} messages were dead-lettered in the last "
                                             f"{config.alarm_dead_letter_window_ms // 60_000} min (alarm at "
                                             f"{config.alarm_dead_letter_growth:,}): consumers NACK them; see the "
                                             "dead-letter lists of the busiest queues")]


def limit_alarms(worker: str, connections: int, by_user: dict[str, int], crowded: dict[str, int],
                 config: Config) -> list[Wanted]:
    """This worker's connections, a user's connections on it and its sessions' subscriptions near their
    limits (alarm_limit_share of max_connections, max_connections_per_user, max_subscriptions)."""
    share = config.alarm_limit_share
    near: list[str] = []
    if config.max_connections and connections >= share * config.max_connections:
        near.append(f"{connections:,} connections of max_connections {config.max_connections:,}")
    per_user = config.max_connections_per_user
    for user, held in sorted(by_user.items(), key=lambda kv: -kv[1])[:3]:
        if per_user and held >= share * per_user:
            near.append(f"user '{user}' holds {held:,} connections of max_connections_per_user {per_user:,}")
    for client, held in sorted(crowded.items(), key=lambda kv: -kv[1])[:3]:
        if held >= share * config.max_subscriptions:
            near.append(f"session '{client}' holds {held:,} subscriptions of max_subscriptions "
                        f"{config.max_subscriptions:,}")
    if not near:
        return []
    return [Wanted("limits", worker, f"worker {worker} is near its limits ({100 * share:.0f}% or more): "
                                     + "; ".join(near) + "; new ones are refused at the limit")]


def differences(wanted: Iterable[Wanted], on: Iterable[Any], kinds: Iterable[str],
                subject: str | None = None) -> tuple[list[Wanted], list[str]]:
    """(to raise, names to clear) for alarms of ``kinds`` (and of ``subject`` only, when given), from the
    wanted ones and those ``on`` (memory.Alarm records)."""
    kinds = set(kinds)
    want = {w.name: w for w in wanted}
    have = {a.name for a in on if a.kind in kinds and (subject is None or a.node == subject)}
    return [w for n, w in want.items() if n not in have], sorted(have - set(want))
