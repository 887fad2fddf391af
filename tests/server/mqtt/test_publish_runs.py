"""PUBLISHes that arrive in one read are published together, but each packet keeps its own fate:
checked as if alone, acknowledged with its own reason code, stored once or not at all (issue #30)."""

from __future__ import annotations

import pytest
from redis.exceptions import SlotNotCoveredError

from fencemq.protocol.mqtt.packets import MQTT_5, MQTT_311, Disconnect, Puback, Publish, Pubrec
from tests.helpers import worker
from tests.server.mqtt.clients import RawClient
from tests.server.test_pipelined_runs import stored


@pytest.fixture
def w(redis_url):
    with worker(redis_url, mqtt_port=0, max_payload=1024, max_batch=4) as started:
        yield started


def acks(c: RawClient, n: int) -> list[tuple[int, int]]:
    got = [c.next() for _ in range(n)]
    assert all(isinstance(p, (Puback, Pubrec)) for p in got), got
    return [(p.packet_id, p.reason_code) for p in got]


@pytest.mark.parametrize("qos", [1, 2])
def test_small_oversized_small_in_one_write_are_acknowledged_each_with_its_own_reason(w, redis_url, qos):
    c = RawClient(w.worker.mqtt_port, f"runs-{qos}")
    c.send_all([Publish("runs/a", b"small", qos=qos, packet_id=1), Publish("runs/a", b"x" * 2000, qos=qos, packet_id=2),
                Publish("runs/a", b"small too", qos=qos, packet_id=3)])
    assert acks(c, 3) == [(1, 0x00), (2, 0x83), (3, 0x00)]
    c.close()
    assert stored(redis_url, "runs/a") == 2


def test_four_small_and_one_oversized_are_four_stored_and_four_reported_stored(w, redis_url):
    c = RawClient(w.worker.mqtt_port, "runs-5")
    c.send_all([*[Publish("runs/b", b"s%d" % i, qos=1, packet_id=i + 1) for i in range(4)],
                Publish("runs/b", b"x" * 2000, qos=1, packet_id=5)])
    assert acks(c, 5) == [(1, 0), (2, 0), (3, 0), (4, 0), (5, 0x83)]
    c.close()
    assert stored(redis_url, "runs/b") == 4


def test_a_run_longer_than_max_batch_is_stored_whole_in_order(w, redis_url):
    c = RawClient(w.worker.mqtt_port, "runs-9", level=MQTT_311)
    c.send_all([Publish("runs/c", b"m%d" % i, qos=1, packet_id=i + 1) for i in range(9)])
    assert [pid for pid, _ in acks(c, 9)] == list(range(1, 10))
    c.close()
    assert stored(redis_url, "runs/c") == 9


def test_a_version_5_client_refused_a_publish_keeps_its_connection(w, redis_url):
    c = RawClient(w.worker.mqtt_port, "runs-keep", level=MQTT_5)
    c.send(Publish("runs/d", b"x" * 2000, qos=1, packet_id=1))
    assert acks(c, 1) == [(1, 0x83)]
    c.send(Publish("runs/d", b"fine", qos=1, packet_id=2))
    assert acks(c, 1) == [(2, 0)]
    c.close()
    assert stored(redis_url, "runs/d") == 1


@pytest.mark.parametrize("failure", [OSError(111, "Connection refused"),
                                     SlotNotCoveredError("slot 5 not covered: a shard gone dark")],
                         ids=["socket", "cluster"])
def test_a_publish_meeting_a_redis_failure_outside_redis_error_is_answered_server_busy_and_the_worker_serves_on(
        w, redis_url, monkeypatch, failure):
    # the MQTT door catches what fences.redis_errors.REDIS_FAILURES names, not redis-py's RedisError alone
    shared = w.worker.core.shared
    real = shared.publish_many

    async def dark(*_args, **_kwargs):
        raise failure

    monkeypatch.setattr(shared, "publish_many", dark)
    c = RawClient(w.worker.mqtt_port, "runs-dark", level=MQTT_5)
    c.send(Publish("runs/e", b"m", qos=1, packet_id=1))
    told = c.next()
    assert isinstance(told, Disconnect) and told.reason_code == 0x89, told  # Server busy: send it again
    c.close()
    monkeypatch.setattr(shared, "publish_many", real)
    again = RawClient(w.worker.mqtt_port, "runs-dark", level=MQTT_5)
    again.send(Publish("runs/e", b"m", qos=1, packet_id=1))
    assert acks(again, 1) == [(1, 0)]
    again.close()
    assert stored(redis_url, "runs/e") == 1
