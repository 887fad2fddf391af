"""Client identifiers MQTT allows and FenceMQ's RESP names do not (spaces, non-ASCII UTF-8, up to
65,535 bytes) connect, keep their sessions, and stay their user's (issue #30: the Eclipse Paho
suites' set-up connects as 'clean retained')."""

from __future__ import annotations

import pytest
import redis

from fencemq.model.keys import Keyspace
from fencemq.protocol.mqtt.client_ids import session_name
from fencemq.protocol.mqtt.packets import Connack, Publish, Subscribe, SubscriptionOptions
from tests.helpers import worker
from tests.server.mqtt.clients import Client, RawClient
from tests.server.test_users_auth import add_user


@pytest.fixture
def w(redis_url):
    with worker(redis_url, mqtt_port=0) as started:
        yield started


@pytest.mark.parametrize("client_id", ["clean retained", "capteur-é-1", "温度 sensor", "100% | sure"])
@pytest.mark.parametrize("version", ["3.1.1", "5.0"])
def test_a_client_id_with_spaces_or_non_ascii_connects_publishes_receives_and_resumes(w, redis_url, client_id,
                                                                                       version) -> None:
    sub = Client(w.worker.mqtt_port, client_id, version, clean=False, expiry=60)
    sub.subscribe("ids/#")
    pub = Client(w.worker.mqtt_port, client_id + " (publisher)", version)
    try:
        pub.publish("ids/a", b"hello")
        assert [m.payload for m in sub.take(1)] == [b"hello"]
        sub.close()
        pub.publish("ids/a", b"while away")
        # the session RESP sees, under the documented name
        assert redis.Redis.from_url(redis_url).exists(Keyspace("fmq").session(session_name(client_id)))
        again = Client(w.worker.mqtt_port, client_id, version, clean=False, expiry=60)
        assert again.session_present is True
        assert [m.payload for m in again.take(1)] == [b"while away"]
        again.close()
    finally:
        pub.close()


def test_a_client_id_of_65535_bytes_connects_and_keeps_its_session(w) -> None:
    longest = "é" * 32767 + "x"  # 65,535 bytes: the longest MQTT string
    first = RawClient(w.worker.mqtt_port, longest, expiry=60)
    assert isinstance(first.connack, Connack) and first.connack.reason_code == 0
    first.send(Subscribe(1, (("long/#", SubscriptionOptions(qos=1)),)))
    first.next()
    first.close()
    again = RawClient(w.worker.mqtt_port, longest, clean_start=False, expiry=60)
    assert again.connack.reason_code == 0 and again.connack.session_present
    other = RawClient(w.worker.mqtt_port, "é" * 32767 + "y", clean_start=False, expiry=60)
    assert not other.connack.session_present  # the same first 64 KiB but one: another session
    other.send(Publish("long/a", b"to the long one", qos=0))
    assert again.next().payload == b"to the long one"
    again.close(), other.close()


def test_a_mapped_client_id_stays_its_users(redis_url) -> None:
    add_user(redis_url, "alice", "alice secret", ("all", "#"))
    add_user(redis_url, "mallory", "mallory secret", ("all", "#"))
    with worker(redis_url, mqtt_port=0, users=True) as w:
        alice = RawClient(w.worker.mqtt_port, "my sensor é", username="alice", password=b"alice secret")
        assert alice.connack.reason_code == 0
        alice.close()
        mallory = RawClient(w.worker.mqtt_port, "my sensor é", username="mallory", password=b"mallory secret")
        assert mallory.connack.reason_code >= 0x80  # the id is alice's: refused, her session untouched
        mallory.close()
