"""Redis health and the alarms, over HTTP against real workers and Redis servers: every node (a primary
and its replica) on the Redis page and the overview, and alarms that go up when their condition holds
and clear when it ends — a replica stopped, a worker that missed its beats, connections near the
limit — on the overview, the alarms page and /metrics (fencemq_alarm)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest
import redis

from fencemq.config import Config
from fencemq.ops import alarm_rules
from fencemq.ops.redis_health import Health, NodeHealth
from fencemq.server.embedded import EmbeddedRedis
from fencemq.ui.pages import UI
from fencemq.ui.serving import DashboardThread
from tests.helpers import client, wait_for, worker
from tests.ui.test_ui_pages import rows, text

FAST = {"health_sample_ms": 100}


@pytest.fixture
def replicated() -> Iterator[tuple[EmbeddedRedis, EmbeddedRedis]]:
    """A primary and one replica of it, both private to the test."""
    with EmbeddedRedis() as primary:
        primary.client().config_set("repl-diskless-sync-delay", "0")  # (5 s by default before a first sync)
        replica = EmbeddedRedis(extra_args=["--replicaof", "127.0.0.1", str(primary.port)]).start()
        try:
            wait_for(lambda: replica.client().info("replication")["master_link_status"] == "up", timeout=15,
                     what="the replica in sync")
            yield primary, replica
        finally:
            replica.stop()


def dashboard(url: str) -> tuple[DashboardThread, httpx.Client]:
    d = DashboardThread(UI(url, interval=0.1)).start()
    return d, httpx.Client(base_url=d.url.rstrip("/"), timeout=10)


def alarm_names(r: redis.Redis) -> set[str]:
    return {k.decode() for k in r.hgetall("fmq:alarms")}


def test_the_redis_page_lists_the_primary_and_its_replica_with_memory_lag_and_persistence(replicated) -> None:
    primary, replica = replicated
    primary.client().config_set("maxmemory", str(256 << 20))
    d, http = dashboard(primary.url)
    try:
        page = http.get("/redis")
        assert page.status_code == 200
        found = {r.split()[0]: r for r in rows(page.text)[1:]}
        p, rp = found[f"127.0.0.1:{primary.port}"], found[f"127.0.0.1:{replica.port}"]
        assert "primary" in p and "1 replica" in p and "of 256.0 MiB" in p and "noeviction" in p
        assert f"replica of 127.0.0.1:{primary.port}" in rp and "link up" in rp and "behind" in rp
        assert re.search(r"\d+\.\d+ ms", p), "a PING's round trip"
        overview = text(http.get("/").text)
        assert "Redis" in overview and f"127.0.0.1:{replica.port}" in overview
    finally:
        http.close()
        d.stop()


def test_a_stopped_replica_raises_an_alarm_everywhere_and_its_return_clears_it(replicated) -> None:
    primary, replica = replicated
    r = primary.client()
    name = f"replica@127.0.0.1:{replica.port}"
    with worker(primary.url, metrics_port=0, **FAST):
        d, http = dashboard(primary.url)
        try:
            wait_for(lambda: r.hexists("fmq:redis:nodes", f"127.0.0.1:{replica.port}"), what="the replica noted")
            assert name not in alarm_names(r)
            replica.stop()
            wait_for(lambda: name in alarm_names(r), timeout=10, what="the replica's alarm")
            wait_for(lambda: name in http.get("/").text, what="the alarm on the overview")
            alarms = text(http.get("/alarms").text)
            assert f"replica 127.0.0.1:{replica.port}" in alarms and "is not connected" in alarms
            assert re.search(r'fencemq_alarm\{alarm="replica",node="127\.0\.0\.1:%d"\} 1\.0' % replica.port,
                             http.get("/metrics").text)
            down = {row.split()[0]: row for row in rows(http.get("/redis").text)[1:]}
            assert "down" in down[f"127.0.0.1:{replica.port}"]
            replica.start(_same_port=True)
            wait_for(lambda: name not in alarm_names(r), timeout=20, what="the alarm cleared")
            wait_for(lambda: "No alarms" in http.get("/").text, what="the overview clear again")
            assert f'fencemq_alarm{{alarm="replica",node="127.0.0.1:{replica.port}"}}' not in http.get("/metrics").text
        finally:
            http.close()
            d.stop()


def test_a_worker_that_missed_its_beats_raises_an_alarm_until_it_beats_or_is_forgotten(redis_url) -> None:
    r = redis.Redis.from_url(redis_url)
    with worker(redis_url, worker_forget_ms=60_000, **FAST):
        now = int(r.time()[0]) * 1000
        r.zadd("fmq:workers", {"ghost-1": now - 5_000, "gone-2": now - 120_000})
        wait_for(lambda: "worker@ghost-1" in alarm_names(r), what="the missing worker's alarm")
        assert r.zscore("fmq:workers", "gone-2") is None, "a worker silent past worker_forget_ms is forgotten"
        assert "worker@gone-2" not in alarm_names(r)
        r.zadd("fmq:workers", {"ghost-1": now + 60_000})  # it beats again
        wait_for(lambda: "worker@ghost-1" not in alarm_names(r), what="the alarm cleared")


def test_connections_near_max_connections_raise_the_workers_limits_alarm(redis_url) -> None:
    r = redis.Redis.from_url(redis_url)
    with worker(redis_url, max_connections=10, **FAST) as w:
        name = f"limits@{w.worker.id}"
        held = [client(w.port) for _ in range(9)]
        for c in held:
            c.ping()
        wait_for(lambda: name in alarm_names(r), what="the limits alarm")
        assert "9 connections of max_connections 10" in r.hget("fmq:alarms", name).decode()
        for c in held[:3]:
            c.close()
        wait_for(lambda: name not in alarm_names(r), what="the limits alarm cleared")
        for c in held[3:]:
            c.close()


def test_a_worker_that_drains_takes_its_limits_alarm_with_it(redis_url) -> None:
    r = redis.Redis.from_url(redis_url)
    w = worker(redis_url, max_connections=2, **FAST).start()
    held = [client(w.port) for _ in range(2)]
    for c in held:
        c.ping()
    name = f"limits@{w.worker.id}"
    wait_for(lambda: name in alarm_names(r), what="the limits alarm")
    with worker(redis_url, **FAST):
        w.stop()
        for c in held:
            c.close()
        wait_for(lambda: name not in alarm_names(r), what="the alarm of a worker gone cleared by another")


# -- the rules alone -------------------------------------------------------------------------------


def test_the_replication_rules_name_a_lagging_replica_a_missing_one_and_a_shard_short_of_replicas() -> None:
    config = Config(alarm_replication_lag_bytes=1000, alarm_replication_lag_s=10, durability="replicas=2")
    health = Health("single", [
        NodeHealth("p:1", "primary", replicas=1),
        NodeHealth("r:1", "replica", primary="p:1", link_up=True, lag_bytes=5000, lag_s=0),
        NodeHealth("r:2", "replica", primary="p:1", up=False, error="gone"),
        NodeHealth("r:3", "replica", primary="p:1", link_up=True, lag_bytes=10, lag_s=30),
        NodeHealth("r:4", "replica", primary="p:1", link_up=True, lag_bytes=999, lag_s=10),
    ])
    got = {w.name: w.detail for w in alarm_rules.redis_alarms(health, config)}
    assert set(got) == {"replication@r:1", "replica@r:2", "replication@r:3", "replicas@p:1"}
    assert "behind its primary's offset" in got["replication@r:1"]
    assert "30 s ago" in got["replication@r:3"]
    assert "1 connected replica(s) of the 2 expected" in got["replicas@p:1"]


def test_the_cluster_and_sentinel_rules_name_failing_nodes_and_a_failover() -> None:
    health = Health("cluster", [
        NodeHealth("a:1", "primary", cluster_state="ok", slots_ok=16384, flags=""),
        NodeHealth("b:1", "primary", up=False, error="refused", flags="fail"),
        NodeHealth("c:1", "primary", cluster_state="fail", slots_ok=10923, slots_fail=5461, flags=""),
    ], sentinel={"service": "mymaster", "primary": "a:1", "flags": "master,s_down"})
    got = {w.name for w in alarm_rules.redis_alarms(health, Config())}
    assert got == {"redis@b:1", "cluster@b:1", "cluster@c:1", "failover@mymaster"}


def test_only_an_alarm_of_the_judged_kinds_is_cleared() -> None:
    from fencemq.fences.memory import Alarm

    on = [Alarm("memory", "n:1", 1, "x"), Alarm("worker", "w1", 1, "y"), Alarm("limits", "w2", 1, "z")]
    raise_, clear = alarm_rules.differences([alarm_rules.Wanted("worker", "w3", "d")], on, alarm_rules.WATCHED)
    assert [w.name for w in raise_] == ["worker@w3"] and clear == ["worker@w1"]
    raise_, clear = alarm_rules.differences([], on, alarm_rules.OWN, subject="w1")
    assert raise_ == [] and clear == []


def test_limits_and_unacked_and_dead_letter_rules_hold_their_thresholds() -> None:
    c = Config(max_connections=100, max_connections_per_user=10, max_subscriptions=50, alarm_limit_share=0.9,
               alarm_unacked_age_ms=60_000, alarm_dead_letter_growth=5)
    assert alarm_rules.limit_alarms("w", 89, {"u": 8}, {"s": 44}, c) == []
    (got,) = alarm_rules.limit_alarms("w", 90, {"u": 9}, {"s": 45}, c)
    assert "90 connections" in got.detail and "user 'u' holds 9" in got.detail and "session 's' holds 45" in got.detail
    assert alarm_rules.unacked_alarm(("t:x", 1_000), 60_999, c) == []
    assert alarm_rules.unacked_alarm(("t:x", 1_000), 61_000, c)[0].name == "unacked@broker"
    assert alarm_rules.dead_letter_alarm(4, c) == [] and alarm_rules.dead_letter_alarm(None, c) == []
    assert alarm_rules.dead_letter_alarm(5, c)[0].name == "dead-letters@broker"
