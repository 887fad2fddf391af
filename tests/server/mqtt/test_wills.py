"""A will with a Will Delay Interval waits in Redis, not in a worker (server/mqtt/wills.py): a
draining worker publishes none early, a worker killed with -9 loses none, and a session taken up
again within the delay cancels it — whichever worker it moved to.

Real workers on one Redis: in threads (drained as SIGTERM drains them) and in a process of its own
(killed with SIGKILL).
"""

from __future__ import annotations

import time

import pytest
import redis

from fencemq.model.keys import Keyspace, QueueRef
from fencemq.protocol.mqtt.packets import Disconnect, Will
from fencemq.protocol.mqtt.properties import Properties
from tests.helpers import KillableMqttWorker, wait_for, worker
from tests.server.mqtt.clients import Client, RawClient

pytestmark = pytest.mark.standalone
KEYS = Keyspace("fmq")
LEASE_MS = 1000  # session and worker leases: a killed worker's sessions end about two of them later


def waiting(redis_url: str, topic: str) -> int:
    """Scheduled messages of ``topic`` not yet due."""
    return redis.Redis.from_url(redis_url).zcard(KEYS.queue(QueueRef(topic)).scheduled)


def with_will(port: int, client_id: str, topic: str, delay_s: int, expiry: int = 60) -> RawClient:
    return RawClient(port, client_id, clean_start=False, expiry=expiry,
                     will=Will(topic, b"gone:" + client_id.encode(), 1, False,
                               Properties(will_delay_interval=delay_s)))


def told_to_move(c: RawClient) -> None:
    """The draining worker's DISCONNECT 0x8B, then the client closes."""
    got = c.next(timeout=10)
    assert isinstance(got, Disconnect) and got.reason_code == 0x8B, got
    c.sock.close()


@pytest.fixture
def elsewhere(redis_url):
    """The worker clients move to, and a watcher on it subscribed to every will."""
    with worker(redis_url, mqtt_port=0, session_lease_ms=LEASE_MS, sweep_interval_ms=50) as w:
        watcher = Client(w.worker.mqtt_port, f"watch-{time.monotonic_ns()}")
        watcher.subscribe("wills/#")
        w.watcher = watcher  # type: ignore[attr-defined]
        try:
            yield w
        finally:
            watcher.close()


def test_a_client_of_a_draining_worker_that_reconnects_elsewhere_within_its_will_delay_has_no_will_sent(
        redis_url, elsewhere) -> None:
    with worker(redis_url, mqtt_port=0, drain_timeout_ms=1000) as draining:
        mover = with_will(draining.worker.mqtt_port, "mover", "wills/mover", delay_s=3)
        draining.drain()
        told_to_move(mover)
        wait_for(lambda: waiting(redis_url, "wills/mover") == 1, timeout=5, what="the will scheduled in Redis")
    back = RawClient(elsewhere.worker.mqtt_port, "mover", clean_start=False, expiry=60)
    try:
        assert back.connack.session_present
        assert waiting(redis_url, "wills/mover") == 0, "the resume cancelled the scheduled will"
        assert elsewhere.watcher.take(1, timeout=5) == [], "a will for a client that came back in time"
    finally:
        back.send(Disconnect(0)), back.sock.close()


def test_a_client_of_a_drained_worker_that_does_not_come_back_has_its_will_sent_after_its_delay_not_before(
        redis_url, elsewhere) -> None:
    with worker(redis_url, mqtt_port=0, drain_timeout_ms=1000) as draining:
        gone = with_will(draining.worker.mqtt_port, "gone-for-good", "wills/gone", delay_s=3)
        drained_at = time.monotonic()
        draining.drain()
        told_to_move(gone)
        assert elsewhere.watcher.take(1, timeout=1.0) == [], "the drain published the will early"
    # the drained worker has exited: what remains of the will is in Redis
    got = elsewhere.watcher.take(1, timeout=10)
    assert [m.payload for m in got] == [b"gone:gone-for-good"]
    assert time.monotonic() - drained_at >= 3.0, "not before the Will Delay Interval"


@pytest.fixture
def killed(redis_url):
    k = KillableMqttWorker(redis_url, session_lease_ms=LEASE_MS)
    yield k
    if k.proc.poll() is None:
        k.kill()


def test_the_will_of_a_client_whose_worker_is_killed_is_sent_after_its_delay(redis_url, elsewhere, killed) -> None:
    victim = with_will(killed.mqtt_port, "victim", "wills/victim", delay_s=1)
    killed_at = time.monotonic()
    killed.kill()
    victim.sock.close()
    # the session's lease lapses with its worker's, and the sweeper that ends it publishes the will
    got = elsewhere.watcher.take(1, timeout=10)
    assert [m.payload for m in got] == [b"gone:victim"]
    assert time.monotonic() - killed_at >= 1.0, "not before the Will Delay Interval"


def test_a_client_whose_worker_is_killed_and_that_resumes_elsewhere_has_no_will_sent(
        redis_url, elsewhere, killed) -> None:
    victim = with_will(killed.mqtt_port, "survivor", "wills/survivor", delay_s=1)
    killed.kill()
    victim.sock.close()
    back = RawClient(elsewhere.worker.mqtt_port, "survivor", clean_start=False, expiry=1)  # no will now
    assert back.connack.session_present
    back.send(Disconnect(0))
    back.sock.close()
    # the session lingers 1 s, then the sweeper ends it: the killed connection's will is not its
    assert elsewhere.watcher.take(1, timeout=4) == [], "the will of a connection whose session was resumed"


def test_a_will_scheduled_at_a_drain_goes_at_once_when_a_new_connection_starts_the_session_anew(
        redis_url, elsewhere) -> None:
    with worker(redis_url, mqtt_port=0, drain_timeout_ms=1000) as draining:
        mover = with_will(draining.worker.mqtt_port, "restarter", "wills/restarter", delay_s=30)
        draining.drain()
        told_to_move(mover)
    started = time.monotonic()
    fresh = RawClient(elsewhere.worker.mqtt_port, "restarter", clean_start=True, expiry=60)
    try:
        # Clean Start ends the session, and so its will is due (MQTT-3.1.2-5), not 30 s later
        assert [m.payload for m in elsewhere.watcher.take(1, timeout=5)] == [b"gone:restarter"]
        assert time.monotonic() - started < 10
        assert waiting(redis_url, "wills/restarter") == 0
    finally:
        fresh.send(Disconnect(0)), fresh.sock.close()
