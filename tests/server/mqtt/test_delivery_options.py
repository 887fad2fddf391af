"""What MQTT 5 subscriptions and message properties do to a delivery: subscription identifiers,
No Local, Retain As Published, Retain Handling, the message expiry countdown, `$` topics and the
message properties carried end to end. Named after the normative statements they check."""

from __future__ import annotations

import time

import pytest

from tests.helpers import RespConn, as_map, worker
from tests.server.mqtt.clients import Client


@pytest.fixture
def w(redis_url):
    with worker(redis_url, mqtt_port=0) as started:
        yield started


def test_MQTT_3_3_4_3_a_delivery_carries_the_identifier_of_its_subscription(w) -> None:
    sub = Client(w.worker.mqtt_port, "ids")
    try:
        sub.subscribe("ids/a/#", identifier=7)
        sub.subscribe("ids/b/#")
        sub.publish("ids/a/x", b"one")
        sub.publish("ids/b/x", b"two")
        got = {m.payload: m for m in sub.take(2)}
        assert got[b"one"].properties.SubscriptionIdentifier == [7]
        assert not hasattr(got[b"two"].properties, "SubscriptionIdentifier")
    finally:
        sub.close()


def test_MQTT_3_8_3_3_no_local_keeps_a_clients_own_publishes_from_it(w) -> None:
    me, other = Client(w.worker.mqtt_port, "me"), Client(w.worker.mqtt_port, "other")
    try:
        me.subscribe("chat/#", noLocal=True)
        me.publish("chat/room", b"mine")
        other.publish("chat/room", b"theirs")
        assert [m.payload for m in me.take(2, timeout=2)] == [b"theirs"]
    finally:
        me.close(), other.close()


def test_MQTT_3_8_3_3_no_local_off_gives_a_client_its_own_publishes(w) -> None:
    me = Client(w.worker.mqtt_port, "me-too")
    try:
        me.subscribe("echo/#")
        me.publish("echo/x", b"mine")
        assert [m.payload for m in me.take(1)] == [b"mine"]
    finally:
        me.close()


def test_MQTT_3_3_1_12_13_retain_as_published_keeps_the_flag_and_its_absence_clears_it(w) -> None:
    kept, cleared = Client(w.worker.mqtt_port, "rap-1"), Client(w.worker.mqtt_port, "rap-0")
    pub = Client(w.worker.mqtt_port, "rap-pub")
    try:
        kept.subscribe("rap/#", retainAsPublished=True, retainHandling=2)
        cleared.subscribe("rap/#", retainHandling=2)
        pub.publish("rap/x", b"live", retain=True)
        assert [(m.payload, m.retain) for m in kept.take(1)] == [(b"live", True)]
        assert [(m.payload, m.retain) for m in cleared.take(1)] == [(b"live", False)]
    finally:
        kept.close(), cleared.close(), pub.close()


@pytest.mark.parametrize(("handling", "expected"), [(0, 2), (1, 1), (2, 0)])
def test_MQTT_3_3_1_9_10_11_retain_handling_decides_when_retained_messages_are_sent(w, handling, expected) -> None:
    pub = Client(w.worker.mqtt_port, f"rh-pub-{handling}")
    pub.publish(f"rh{handling}/door", b"open", retain=True)
    pub.close()
    sub = Client(w.worker.mqtt_port, f"rh-{handling}")
    try:
        sub.subscribe(f"rh{handling}/+", retainHandling=handling)
        sub.subscribe(f"rh{handling}/+", retainHandling=handling)  # the same subscription again
        got = sub.take(expected + 1, timeout=2)
        assert [(m.payload, m.retain) for m in got] == [(b"open", True)] * expected  # MQTT-3.3.1-9: RETAIN 1
    finally:
        sub.close()


def test_MQTT_3_3_2_5_a_message_past_its_expiry_is_not_delivered(w) -> None:
    first = Client(w.worker.mqtt_port, "away", expiry=60, clean=False)
    first.subscribe("exp/#")
    first.close()
    pub = Client(w.worker.mqtt_port, "exp-pub")
    pub.publish("exp/short", b"stale", MessageExpiryInterval=1)
    pub.publish("exp/long", b"fresh", MessageExpiryInterval=3600)
    pub.close()
    time.sleep(1.5)
    back = Client(w.worker.mqtt_port, "away", expiry=60, clean=False)
    try:
        got = back.take(2, timeout=2)
        assert [m.payload for m in got] == [b"fresh"]
        # MQTT-3.3.2-6: the interval sent is what is left of it
        assert 3590 <= got[0].properties.MessageExpiryInterval < 3600
    finally:
        back.close()


def test_MQTT_3_3_2_5_an_expired_retained_message_is_not_sent_to_a_new_subscriber(w) -> None:
    pub = Client(w.worker.mqtt_port, "exp-ret-pub")
    pub.publish("expret/a", b"short-lived", retain=True, MessageExpiryInterval=1)
    pub.publish("expret/b", b"lasting", retain=True)
    pub.close()
    time.sleep(1.5)
    sub = Client(w.worker.mqtt_port, "exp-ret-sub")
    try:
        sub.subscribe("expret/+")
        assert [m.payload for m in sub.take(2, timeout=2)] == [b"lasting"]
    finally:
        sub.close()


def test_MQTT_3_3_2_message_properties_reach_the_subscriber_unaltered(w) -> None:
    sub, pub = Client(w.worker.mqtt_port, "props-sub"), Client(w.worker.mqtt_port, "props-pub")
    try:
        sub.subscribe("rpc/#")
        pub.publish("rpc/call", b"{}", PayloadFormatIndicator=1, ContentType="application/json",
                    ResponseTopic="rpc/reply/7", CorrelationData=b"\x00\x01corr",
                    UserProperty=[("a", "1"), ("b", "2"), ("a", "3")])
        (m,) = sub.take(1)
        p = m.properties
        assert (p.PayloadFormatIndicator, p.ContentType, p.ResponseTopic, p.CorrelationData) == (
            1, "application/json", "rpc/reply/7", b"\x00\x01corr")
        assert p.UserProperty == [("a", "1"), ("b", "2"), ("a", "3")]  # MQTT-3.3.2-17/18: order and repeats
    finally:
        sub.close(), pub.close()


def test_a_resp_publishers_headers_reach_an_mqtt5_subscriber_as_user_properties(w) -> None:
    sub = Client(w.worker.mqtt_port, "hdr-sub")
    resp = RespConn(w.port)
    try:
        sub.subscribe("hdr/#")
        resp.call("PUB", "hdr/x", "body", "HDR", "trace", "abc")
        (m,) = sub.take(1)
        assert m.properties.UserProperty == [("trace", "abc")]
    finally:
        sub.close()


def test_MQTT_4_7_2_1_a_dollar_topic_is_not_matched_by_a_leading_wildcard(w) -> None:
    resp = RespConn(w.port)
    sub = Client(w.worker.mqtt_port, "dollar")
    try:
        sub.subscribe("#")
        sub.subscribe("+/status")
        sub.subscribe("$SYS/status")
        resp.call("PUB", "$SYS/status", "up")
        got = sub.take(3, timeout=2)
        assert [(m.topic, m.payload) for m in got] == [("$SYS/status", b"up")]  # only by "$SYS/status"
    finally:
        sub.close()


def test_v311_subscribers_get_the_payload_without_properties(w) -> None:
    sub = Client(w.worker.mqtt_port, "old", "3.1.1")
    pub = Client(w.worker.mqtt_port, "new")
    try:
        sub.subscribe("mix/#")
        pub.publish("mix/x", b"p", ContentType="text/plain", MessageExpiryInterval=60)
        assert [m.payload for m in sub.take(1)] == [b"p"]
    finally:
        sub.close(), pub.close()


def test_an_mqtt_publish_keeps_its_properties_as_headers_for_resp_consumers(w) -> None:
    resp = RespConn(w.port)
    resp.call("HELLO", 3, "SETNAME", "resp-reader")
    handle = as_map(resp.call("SUB", "seen/+"))["handle"]
    pub = Client(w.worker.mqtt_port, "seen-pub")
    try:
        pub.publish("seen/x", b"p", ContentType="text/plain")
        (d,) = resp.call("PULL", handle, "COUNT", 10)
        assert as_map(as_map(d)["headers"])["mqtt-content-type"] == "text/plain"
    finally:
        pub.close()
