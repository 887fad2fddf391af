"""When Redis fills up (issue 27): never on a Redis that evicts, publishers held back above the watermark,
consumers never (docs/operations.md, "Redis memory").

Each test sets the limits of the session's Redis (every master under ``--redis-cluster``) and puts them
back (tests/fences/memory_nodes.py). Limits are set relative to what Redis uses at that moment, so a
test does not depend on how much the broker's state weighs.
"""

from __future__ import annotations

import time

import pytest
import redis
from prometheus_client import REGISTRY

from fencemq.errors import EvictingRedis
from tests.fences.memory_nodes import Nodes
from tests.helpers import as_map, client, deliveries, wait_for, worker

SAMPLE_MS = 50


@pytest.fixture
def nodes(redis_server, redis_url):
    with Nodes(redis_server) as n:
        yield n


def pub_error(c: redis.Redis, topic: str = "orders") -> str | None:
    """The error a PUB gets now (its first word and the rest), or None when it is stored."""
    try:
        c.execute_command("PUB", topic, b"x")
    except redis.ResponseError as exc:
        return str(exc)
    return None


def alarm_on(kind: str) -> bool:
    return any((REGISTRY.get_sample_value("fencemq_alarm", {"alarm": kind, "node": n}) or 0) == 1
               for n in alarm_nodes())


def alarm_nodes() -> set[str]:
    return {s.labels["node"] for m in REGISTRY.collect() if m.name == "fencemq_alarm" for s in m.samples}


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-ttl"])
def test_a_worker_will_not_start_on_a_redis_that_may_evict_and_says_what_to_set(nodes, redis_url, policy) -> None:
    nodes.policy(policy)
    with pytest.raises(RuntimeError) as failed:
        worker(redis_url).start()
    cause = failed.value.__cause__
    leaves = list(cause.exceptions) if isinstance(cause, BaseExceptionGroup) else [cause]
    refusal = next(e for e in leaves if isinstance(e, EvictingRedis))
    assert f"maxmemory-policy {policy}" in refusal.message
    assert "CONFIG SET maxmemory-policy noeviction" in refusal.message


def test_a_policy_changed_at_run_time_raises_an_alarm_and_refuses_publishes_until_it_is_put_back(
        nodes, redis_url) -> None:
    with worker(redis_url, memory_sample_ms=SAMPLE_MS) as w:
        c = client(w.port, 2, "alice")
        handle = as_map(c.execute_command("SUB", "orders", "GROUP", "g"))["handle"]
        assert pub_error(c) is None
        nodes.policy("allkeys-lru", only_first=True)
        refusal = wait_for(lambda: pub_error(c), what="a PUB refused on an evicting Redis")
        assert refusal.startswith("EVICTING ") and "allkeys-lru" in refusal and "noeviction" in refusal
        # the refusal reads the policy itself; the alarm comes with the memory guard's next sample
        wait_for(lambda: alarm_on("eviction"), what="the eviction alarm")
        raw = redis.Redis.from_url(redis_url).hgetall("fmq:alarms") if len(nodes.clients) == 1 else None
        if raw is not None:
            assert [k.split(b"@")[0] for k in raw] == [b"eviction"]
        # consumers are not held back: what was stored is still read and settled
        got = deliveries(c.execute_command("PULL", handle, "COUNT", 100))
        assert got and c.execute_command("ACK", handle, *[d["tag"] for d in got]) == len(got)
        nodes.policy("noeviction")
        wait_for(lambda: pub_error(c) is None, what="publishing back once the policy is noeviction")
        wait_for(lambda: not alarm_on("eviction"), what="the eviction alarm to clear")


def test_above_the_high_watermark_publishes_get_full_until_memory_falls_below_the_low_one(nodes, redis_url) -> None:
    with worker(redis_url, memory_sample_ms=SAMPLE_MS, memory_high_watermark=0.9,
                memory_low_watermark=0.8) as w:
        c = client(w.port, 2, "alice")
        handle = as_map(c.execute_command("SUB", "orders", "GROUP", "g"))["handle"]
        c.execute_command("MPUB", "orders", 3, b"a", b"b", b"c")
        nodes.limit_at(0.95)
        refusal = wait_for(lambda: pub_error(c), what="FULL above the watermark")
        assert refusal.startswith("FULL Redis at ") and "% full" in refusal and "drain" in refusal
        with pytest.raises(redis.ResponseError, match="^FULL "):
            c.execute_command("MPUB", "orders", 2, b"d", b"e")
        assert alarm_on("memory")
        got = deliveries(c.execute_command("PULL", handle, "COUNT", 100))  # (and the PUBs stored before the sample)
        assert [d["payload"] for d in got][:3] == ["a", "b", "c"]
        assert c.execute_command("ACK", handle, *[d["tag"] for d in got]) == len(got)
        nodes.limit_at(0.85)  # between the watermarks: still held back (hysteresis)
        time.sleep(6 * SAMPLE_MS / 1000)
        assert (pub_error(c) or "").startswith("FULL ")
        nodes.limit_at(0.7)
        wait_for(lambda: pub_error(c) is None, what="publishing back below the low watermark")
        assert not alarm_on("memory")


def test_the_exported_alarm_goes_up_and_down_with_the_refusal_before_any_alarm_record_is_written(
        nodes, redis_url) -> None:
    # the refusal went up with the first node's alarm and fencemq_alarm only after every node's record
    # was written: a scrape (or a test) between saw FULL with no alarm (red in a Cluster run)
    with worker(redis_url, memory_sample_ms=SAMPLE_MS, memory_high_watermark=0.9,
                memory_low_watermark=0.8) as w:
        guard = w.worker.services.core.ctx.memory
        seen: list[tuple[bool, bool]] = []  # at each record written: (publishes refused, alarm exported)

        class WatchedFences:
            def __init__(self, fences) -> None:
                self.fences = fences

            async def run(self, *args, **kwargs):
                seen.append((bool(guard.alarms), alarm_on("memory")))
                return await self.fences.run(*args, **kwargs)

        guard.fences = WatchedFences(guard.fences)
        nodes.limit_at(0.95)
        wait_for(lambda: (True, True) in seen, what="the alarm recorded")
        nodes.limit_at(0.7)
        wait_for(lambda: seen[-1] == (False, False), what="the alarm cleared")
    assert all(refused == exported for refused, exported in seen), seen


def test_at_maxmemory_itself_every_consuming_verb_works_and_only_publishing_is_refused(nodes, redis_url) -> None:
    with worker(redis_url, memory_sample_ms=SAMPLE_MS, sweep_interval_ms=50) as w:
        c = client(w.port, 2, "alice")
        pulled = as_map(c.execute_command("SUB", "orders", "GROUP", "g", "LOCK", 60_000))["handle"]
        pushed = as_map(c.execute_command("SUB", "orders", "GROUP", "p", "PUSH", "CAPACITY", 8))["handle"]
        timing = as_map(c.execute_command("SUB", "orders", "GROUP", "t", "LOCK", 300))["handle"]
        other = client(w.port, 2, "bob")
        successor = as_map(other.execute_command("SUB", "orders", "GROUP", "t"))["handle"]
        leaving = client(w.port, 2)  # an anonymous session: it ends when its connection does
        gone = as_map(leaving.execute_command("SUB", "orders", "GROUP", "s"))["handle"]
        taker = client(w.port, 2, "carol")
        kept = as_map(taker.execute_command("SUB", "orders", "GROUP", "s"))["handle"]
        c.execute_command("MPUB", "orders", 20, *[f"m{i}".encode() for i in range(20)])
        held = deliveries(c.execute_command("PULL", pulled, "COUNT", 4))
        assert len(deliveries(leaving.execute_command("PULL", gone, "COUNT", 20))) == 20

        nodes.limit_at(1.02)  # Redis itself now refuses every write that is not allowed when full
        assert (pub_error(c) or "").startswith("FULL ")
        got = deliveries(c.execute_command("PULL", pulled, "COUNT", 4))
        assert [d["payload"] for d in got] == ["m4", "m5", "m6", "m7"]
        assert c.execute_command("ACK", pulled, held[0]["tag"], *[d["tag"] for d in got]) == 5
        assert c.execute_command("NACK", pulled, held[1]["tag"]) == 1
        assert c.execute_command("RENEW", pulled, held[2]["tag"]) == 1
        taken = as_map(c.execute_command("TAKE", pushed))
        assert taken["payload"] == "m0" and c.execute_command("ACK", pushed, taken["tag"]) == 1
        assert deliveries(c.execute_command("PULL", timing, "COUNT", 1))[0]["payload"] == "m0"
        assert int(c.execute_command("SEEK", pulled, "EARLIEST")) >= 1
        assert c.execute_command("UNSUB", pushed) in (b"OK", "OK")
        leaving.close()  # its session ends: its 20 checkouts go back to group s
        again = wait_for(lambda: deliveries(taker.execute_command("PULL", kept, "COUNT", 20)),
                         what="a gone session's checkouts back for its group")
        assert len(again) == 20
        # the lease of group t's member runs out: the sweep hands m0 on to the member left
        seen: list[str] = []

        def m0_back() -> bool:
            seen.extend(d["payload"] for d in deliveries(other.execute_command("PULL", successor, "COUNT", 50)))
            return "m0" in seen

        wait_for(m0_back, timeout=10, what="an expired lease returned by the sweeper")
        assert (pub_error(c) or "").startswith("FULL ")
        nodes.restore()
        wait_for(lambda: pub_error(c) is None, what="publishing back once maxmemory is raised")


def test_a_publish_that_meets_redis_own_oom_between_samples_gets_full_and_stores_nothing(nodes, redis_url) -> None:
    # sampled rarely: the publish meets Redis's OOM before the watermark's alarm is up
    with worker(redis_url, memory_sample_ms=60_000) as w:
        c = client(w.port, 2, "alice")
        handle = as_map(c.execute_command("SUB", "orders", "GROUP", "g"))["handle"]
        nodes.limit_at(1.02)
        refusal = pub_error(c)
        assert refusal is not None and refusal.startswith("FULL Redis is at its maxmemory")
        nodes.restore()
        assert deliveries(c.execute_command("PULL", handle, "COUNT", 10)) == []


def test_an_mqtt_publish_above_the_watermark_gets_quota_exceeded_and_a_will_is_refused_too(nodes, redis_url) -> None:
    from paho.mqtt.client import MQTTMessageInfo  # noqa: F401 - paho is the MQTT tests' client

    from tests.server.mqtt.clients import Client

    with worker(redis_url, memory_sample_ms=SAMPLE_MS, mqtt_port=0) as w:
        port = w.worker.mqtt_port
        c = client(w.port, 2, "alice")
        handle = as_map(c.execute_command("SUB", "orders", "GROUP", "g"))["handle"]
        reasons: list[int] = []
        mq = Client(port, "sensor", "5.0", will=("orders", b"will", {}))
        mq.c.on_publish = lambda _c, _u, _mid, reason, _p: reasons.append(reason.value)
        nodes.limit_at(0.95)
        wait_for(lambda: pub_error(c), what="the memory alarm")
        before = deliveries(c.execute_command("PULL", handle, "COUNT", 100))  # stored before the sample
        assert "m" not in [d["payload"] for d in before]
        mq.c.publish("orders", b"m", qos=1)
        wait_for(lambda: reasons, what="PUBACK")
        assert reasons == [0x97]
        mq.close(clean_disconnect=False)  # the will is refused as any publish: nothing reaches the group
        time.sleep(0.3)
        assert deliveries(c.execute_command("PULL", handle, "COUNT", 10)) == []


def test_an_mqtt_3_1_1_publish_above_the_watermark_is_not_acknowledged_and_arrives_once_memory_is_back(
        nodes, redis_url) -> None:
    from tests.server.mqtt.clients import Client

    with worker(redis_url, memory_sample_ms=SAMPLE_MS, mqtt_port=0) as w:
        port = w.worker.mqtt_port
        c = client(w.port, 2, "alice")
        handle = as_map(c.execute_command("SUB", "orders", "GROUP", "g"))["handle"]
        mq = Client(port, "sensor", "3.1.1", clean=False)
        mq.c.reconnect_delay_set(0.1, 0.2)  # paho reconnects by itself and sends what was not acknowledged
        nodes.limit_at(0.95)
        wait_for(lambda: pub_error(c), what="the memory alarm")
        deliveries(c.execute_command("PULL", handle, "COUNT", 100))  # what was stored before the sample
        sent = mq.c.publish("orders", b"m", qos=1)
        time.sleep(0.5)
        assert not sent.is_published()  # no PUBACK: 3.1.1 cannot say no, so the connection was closed
        nodes.restore()
        sent.wait_for_publish(10)
        assert sent.is_published()
        got = wait_for(lambda: deliveries(c.execute_command("PULL", handle, "COUNT", 10)), what="the message")
        assert [d["payload"] for d in got] == ["m"]
        mq.close()
