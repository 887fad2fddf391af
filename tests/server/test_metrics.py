"""What a worker exports to Prometheus, read off a real `fencemq serve` over HTTP."""

from __future__ import annotations

import json
import os
import re
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import client, fencemq_serve, free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "grafana" / "fencemq-dashboard.json"

pytestmark = pytest.mark.standalone


class Served:
    def __init__(self, port: int, metrics_port: int) -> None:
        self.port, self.metrics_port = port, metrics_port

    def exposition(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as resp:
            return resp.read().decode()

    def samples(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        out = {}
        for family in text_string_to_metric_families(self.exposition()):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def value(self, name: str, **labels: str) -> float | None:
        return self.samples().get((name, tuple(sorted(labels.items()))))


@pytest.fixture
def served(redis_url: str) -> Iterator[Served]:
    port, metrics_port = free_port(), free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FENCEMQ_METRICS_SAMPLE_MS": "100", "FENCEMQ_MAX_FAILURES": "1",
           "FENCEMQ_METRICS_TOP_LMQS": "3"}
    env.pop("FENCEMQ_REDIS_URL", None)
    with fencemq_serve("--port", str(port), "--redis-url", redis_url, "--metrics-port", str(metrics_port), env=env,
                       cwd=ROOT, stop=signal.SIGKILL):
        yield Served(port, metrics_port)


def _workload(port: int) -> None:
    """5 orders published, one NACKed into the dead letters (max_failures 1), an lmq preempted,
    5 lmqs of growing backlog, one refused command."""
    producer = client(port, name="producer")
    consumer = client(port, name="consumer")
    for i in range(5):
        producer.execute_command("PUB", "orders", f"o{i}")
    handle = consumer.execute_command("SUB", "orders", "GROUP", "billing", "FROM", "EARLIEST")[1]
    got = consumer.execute_command("PULL", handle, "COUNT", 2)
    tag = got[0][3]
    assert consumer.execute_command("NACK", handle, tag) == 1
    first, second = client(port, name="phone-1"), client(port, name="phone-2")
    first.execute_command("SUB", "chat", "LMQ", "room-1")
    second.execute_command("SUB", "chat", "LMQ", "room-1")  # takes room-1 from phone-1
    reader = client(port, name="phone-3")
    for n in range(1, 6):
        reader.execute_command("SUB", "chat", "LMQ", f"busy-{n}")
        for i in range(n):
            producer.execute_command("PUB", "chat", f"m{i}", "LMQ", f"busy-{n}")
    with pytest.raises(redis.ResponseError):
        producer.execute_command("PUB", "orders")  # an error reply: the errors counter gets its first series
    for c in (producer, consumer, first, second, reader):
        c.close()


def test_the_counters_operators_alert_on_count_what_happened(served: Served) -> None:
    _workload(served.port)
    assert served.value("fencemq_nacked_total") == 1
    assert served.value("fencemq_dead_lettered_total") == 1
    assert served.value("fencemq_preemptions_total") == 1
    assert served.value("fencemq_evictions_total", reason="preempted") == 1
    assert served.value("fencemq_fence_seconds_count", fence="publish") >= 5
    assert served.value("fencemq_fence_seconds_bucket", fence="ack", le="+Inf") is None  # no ACK ran


def test_backlog_and_oldest_unacked_are_sampled_per_topic_and_for_the_top_lmqs_only(served: Served) -> None:
    _workload(served.port)

    def settled() -> dict | None:
        # The sampler runs every 100 ms beside the workload: a sample taken while the lmq publishes were
        # still going has the orders backlog already right and the lmqs not. Wait for a scrape of a sample
        # taken after the whole workload (all 15 lmq messages) and written whole (the scrape runs in its own
        # thread: it may catch the gauges being rewritten), then hold every figure of that one scrape.
        samples = served.samples()
        chat = {dict(labels)["lmq"]: value for (name, labels), value in samples.items()
                if name == "fencemq_backlog_messages" and dict(labels)["topic"] == "chat"}
        orders = [(name, (("lmq", ""), ("topic", "orders"))) in samples
                  for name in ("fencemq_backlog_messages", "fencemq_oldest_unacked_age_seconds")]
        return samples if chat.get("") == 15 and len(chat) == 4 and all(orders) else None

    samples = wait_for(settled, what="a sample taken after the whole workload")

    def value(name: str, **labels: str) -> float | None:
        return samples.get((name, tuple(sorted(labels.items()))))

    # orders: 5 published, 2 checked out (1 dead-lettered, 1 leased): 3 unread + the leased one pending
    assert value("fencemq_backlog_messages", topic="orders", lmq="") == 3
    age = value("fencemq_oldest_unacked_age_seconds", topic="orders", lmq="")
    assert age is not None and 0 <= age < 60
    lmq_series = sorted(dict(labels)["lmq"] for (name, labels) in samples
                        if name == "fencemq_backlog_messages" and dict(labels)["lmq"])
    assert lmq_series == ["busy-3", "busy-4", "busy-5"]  # FENCEMQ_METRICS_TOP_LMQS=3, largest backlogs
    assert value("fencemq_backlog_messages", topic="chat", lmq="busy-5") == 5
    assert value("fencemq_sessions") >= 4


def test_no_created_series_are_exported(served: Served) -> None:
    _workload(served.port)
    assert not [line for line in served.exposition().splitlines() if "_created" in line]


def test_every_metric_the_grafana_dashboard_queries_exists(served: Served) -> None:
    _workload(served.port)
    wait_for(lambda: served.value("fencemq_backlog_messages", topic="orders", lmq="") is not None, what="a sample")
    exported = {name for name, _ in served.samples()}
    # (and those declared without a series yet: a replica's lag on a server without replicas)
    exported |= {family.name for family in text_string_to_metric_families(served.exposition())}
    exported |= {re.sub(r"_total$", "", n) for n in exported}
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"\bfencemq_[a-z_]+", target["expr"])}
    queried |= set(re.findall(r"\bfencemq_[a-z_]+", json.dumps(dashboard["templating"])))
    assert len(queried) >= 12
    missing = sorted(queried - exported)
    assert not missing, f"the dashboard queries metrics no worker exports: {missing}"


def test_a_worker_without_metrics_times_no_fence(redis_url: str) -> None:
    from tests.helpers import worker

    with worker(redis_url) as w:
        assert w.worker.core.fences.observe is None
        r = redis.Redis(port=w.port)
        assert r.execute_command("PUB", "t", "x") == b"1"
        r.close()


def test_scheduled_messages_are_sampled_per_topic_and_a_priority_topics_backlog_per_level(
        served: Served, redis_url: str) -> None:
    from tests.helpers import honour_priority, pulled, subscribed

    honour_priority(redis_url, "urgent")
    c = client(served.port, name="producer")
    fast, slow = subscribed(c, "urgent", "GROUP", "fast"), subscribed(c, "urgent", "GROUP", "slow")
    for body, level in (("c", 1), ("d", 1), ("e", 1), ("a", 9), ("b", 9)):  # ids 1-3 at level 1, 4-5 at 9
        c.execute_command("PUB", "urgent", body, "PRIORITY", level)
    assert [d["payload"] for d in pulled(c, fast, 3)] == ["a", "b", "c"]
    assert [d["payload"] for d in pulled(c, slow, 1)] == ["a"]
    for topic in ("urgent", "orders", "orders"):
        c.execute_command("PUB", topic, "later", "DELAY", 600_000)
    c.close()

    def settled() -> dict | None:
        samples = served.samples()
        return samples if samples.get(("fencemq_scheduled_messages", (("topic", "orders"),))) == 2 else None

    samples = wait_for(settled, what="a sample taken after the scheduled publishes")
    assert samples[("fencemq_scheduled_messages", (("topic", "urgent"),))] == 1
    per_level = {dict(labels)["level"]: v for (name, labels), v in samples.items()
                 if name == "fencemq_priority_backlog_messages"}
    # level 9: slow has read 1 of 2; level 1: fast has read 1 of 3, slow none: the slowest group's
    assert per_level == {str(lv): {9: 1, 1: 3}.get(lv, 0) for lv in range(10)}, per_level
    # the topic's backlog counts by level too: slow has read only a (id 4), its cursor stays at 1, 4 unread
    assert samples[("fencemq_backlog_messages", (("lmq", ""), ("topic", "urgent")))] == 4
    assert not any(dict(labels)["topic"] == "orders" for (name, labels) in samples
                   if name == "fencemq_priority_backlog_messages"), "a plain topic has no per-level series"
