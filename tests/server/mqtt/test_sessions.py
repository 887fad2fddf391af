"""MQTT sessions on FenceMQ sessions: the Session Expiry Interval as the lease, unacknowledged
messages again with DUP, the Will Delay Interval, and shared groups that lose nothing.

Named after the normative statements of MQTT 5.0 they check, and the broker issues they guard against.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

import pytest

from fencemq.protocol.mqtt.codec import MQTT_5, MQTT_311
from fencemq.protocol.mqtt.packets import Connect
from tests.helpers import worker
from tests.server.mqtt.clients import Client, RawClient


@pytest.fixture
def w(redis_url):
    # a short worker lease: a session that outlives it does so by its own Session Expiry Interval
    with worker(redis_url, mqtt_port=0, session_lease_ms=300) as started:
        yield started


def test_MQTT_3_1_2_23_a_session_within_its_expiry_resumes_with_what_was_published_meanwhile(w) -> None:
    first = Client(w.worker.mqtt_port, "lasting", expiry=60, clean=False)
    first.subscribe("news/#")
    first.close()
    time.sleep(1.0)  # well past the worker's session lease
    pub = Client(w.worker.mqtt_port, "news-pub")
    pub.publish("news/today", b"while away")
    pub.close()
    again = Client(w.worker.mqtt_port, "lasting", expiry=60, clean=False)
    try:
        assert again.session_present is True
        assert [m.payload for m in again.take(1)] == [b"while away"]
    finally:
        again.close()


def test_MQTT_3_1_2_23_a_session_past_its_expiry_is_gone_with_its_messages(redis_url) -> None:
    with worker(redis_url, mqtt_port=0, session_lease_ms=60_000) as w:  # the worker's lease would keep it
        first = Client(w.worker.mqtt_port, "brief", expiry=1, clean=False)
        first.subscribe("brief/#")
        first.close()
        pub = Client(w.worker.mqtt_port, "brief-pub")
        pub.publish("brief/x", b"for a session that expires")
        time.sleep(1.8)
        again = Client(w.worker.mqtt_port, "brief", expiry=1, clean=False)
        try:
            assert again.session_present is False
            assert again.take(1, timeout=1.0) == []
        finally:
            again.close(), pub.close()


def test_v311_clean_session_0_outlives_the_worker_lease_by_the_server_default(w) -> None:
    first = Client(w.worker.mqtt_port, "durable311", "3.1.1", clean=False)
    first.subscribe("d/#")
    first.close()
    time.sleep(1.0)
    pub = Client(w.worker.mqtt_port, "d-pub", "3.1.1")
    pub.publish("d/x", b"kept")
    pub.close()
    again = Client(w.worker.mqtt_port, "durable311", "3.1.1", clean=False)
    try:
        assert again.session_present is True
        assert [m.payload for m in again.take(1)] == [b"kept"]
    finally:
        again.close()


@pytest.mark.parametrize("version", ["3.1.1", "5.0"])
def test_MQTT_4_4_0_1_a_resumed_session_gets_its_unacknowledged_message_again_with_dup_and_its_packet_id(
        w, version) -> None:
    first = Client(w.worker.mqtt_port, f"forgetful-{version}", version, clean=False, expiry=60, auto_ack=False)
    first.subscribe("jobs/#")
    pub = Client(w.worker.mqtt_port, f"jobs-pub-{version}", version)
    pub.publish("jobs/0", b"done")
    pub.publish("jobs/1", b"do it")
    got = first.take(2)
    assert [(m.payload, m.dup) for m in got] == [(b"done", False), (b"do it", False)]
    first.c.ack(got[0].mid, got[0].qos)
    pub.publish("jobs/2", b"sent once held")  # waits in FenceMQ: must not take the held message's id
    first.close(clean_disconnect=False)  # "do it" never acknowledged
    again = Client(w.worker.mqtt_port, f"forgetful-{version}", version, clean=False, expiry=60)
    try:
        again_got = {m.payload: m for m in again.take(2)}
        assert sorted(again_got) == [b"do it", b"sent once held"]
        assert again_got[b"do it"].dup is True  # MQTT-3.3.1-1
        assert again_got[b"do it"].mid == got[1].mid  # MQTT-4.4.0-1: its original packet identifier
    finally:
        again.close(), pub.close()


def test_MQTT_4_8_2_a_shared_member_whose_network_goes_with_qos1_in_flight_loses_nothing_mosquitto_2662(w) -> None:
    leaving = Client(w.worker.mqtt_port, "leaving", expiry=300, auto_ack=False)
    staying = Client(w.worker.mqtt_port, "staying")
    pub = Client(w.worker.mqtt_port, "g-pub")
    try:
        leaving.subscribe("$share/g/orders")
        staying.subscribe("$share/g/orders")
        for i in range(10):
            pub.publish("orders", f"o{i}".encode())
        assert leaving.take(1, timeout=5), "the round robin gave the leaving member some"
        leaving.close(clean_disconnect=False)  # its session lives on (300 s): its messages must not wait for it
        for i in range(10, 14):
            pub.publish("orders", f"o{i}".encode())
        got = staying.take(14, timeout=10)
        missing = sorted(set(f"o{i}".encode() for i in range(14)) - {m.payload for m in got})
        assert missing == [], f"lost: {missing} of {len(got)}"
    finally:
        staying.close(), pub.close()


@contextlib.contextmanager
def leaving_and_staying(w, name: str, messages: int) -> Iterator[tuple[Client, Client]]:
    """A shared group of two on topic ``name``: a member about to go, with one message in flight (Receive
    Maximum 1, never acknowledged, its session kept 300 s), and one that stays; ``messages`` published
    (payloads ``name`` + i)."""
    leaving = Client(w.worker.mqtt_port, f"leaving-{name}", expiry=300, auto_ack=False, receive_maximum=1)
    staying = Client(w.worker.mqtt_port, f"staying-{name}")
    pub = Client(w.worker.mqtt_port, f"{name}-pub")
    try:
        leaving.subscribe(f"$share/g/{name}")
        staying.subscribe(f"$share/g/{name}")
        for i in range(messages):
            pub.publish(name, f"{name}{i}".encode())
        assert len(leaving.take(1, timeout=5)) == 1  # in flight: its send quota is spent
        yield leaving, staying
    finally:
        staying.close(), pub.close()


def test_MQTT_4_8_2_a_shared_member_that_goes_between_checking_messages_out_and_sending_them_loses_nothing(
        w, redis_url) -> None:
    # The connection's delivery task checks a batch out, then sends it: a network that goes between the
    # two leaves checkouts neither in flight nor in the mailbox. They go back with the rest, not after
    # their lock (the race behind the test above losing o10 about once in 20 runs).
    with leaving_and_staying(w, "jobs", 8) as (leaving, staying):
        # what its delivery task would check out next, through the same fence, and never send
        assert asyncio.run(check_out_for(redis_url, "leaving-jobs")), "the leaving member's mailbox was empty"
        leaving.close(clean_disconnect=False)
        got = {m.payload for m in staying.take(8, timeout=5)}
        assert got == {f"jobs{i}".encode() for i in range(8)}, f"lost for their lock: {sorted(got)}"


def test_MQTT_4_8_2_what_a_departing_shared_member_had_in_flight_goes_to_the_group_with_nothing_else_published(
        w) -> None:
    # A NACK returns the message to the group's ready set, where no push member looks: the group
    # hands it to a member at once (before, it waited for the next publish to dispatch).
    with leaving_and_staying(w, "tasks", 2) as (leaving, staying):  # one each: the leaver's mailbox is empty
        leaving.close(clean_disconnect=False)
        got = {m.payload for m in staying.take(2, timeout=5)}
        assert got == {b"tasks0", b"tasks1"}, f"waiting for a publish: {sorted(got)}"


async def check_out_for(redis_url: str, client: str) -> list[str]:
    """The tags checked out to the MQTT client's one subscription, as its connection's delivery task does."""
    from redis.asyncio import Redis

    from fencemq.config import Config
    from fencemq.fences import session_index
    from fencemq.fences.core import Core
    from fencemq.model.keys import Keyspace

    r = Redis.from_url(redis_url)
    try:
        (handle,) = await session_index.non_lite_handles(r, Keyspace("fmq"), client)
        return [d.tag for d in (await Core(r, Config(redis_url=redis_url)).leases.pull(handle, 10)).deliveries]
    finally:
        await r.aclose()


def test_MQTT_4_8_2_messages_queued_for_a_member_go_to_the_group_when_its_session_expires_emqx_9094_12257(w) -> None:
    # Receive Maximum 1: one message in flight, the rest queued for it in FenceMQ
    slow = Client(w.worker.mqtt_port, "slow", expiry=1, auto_ack=False, receive_maximum=1)
    fast = Client(w.worker.mqtt_port, "fast")
    pub = Client(w.worker.mqtt_port, "q-pub")
    try:
        slow.subscribe("$share/q/tasks")
        fast.subscribe("$share/q/tasks")
        for i in range(20):
            pub.publish("tasks", f"t{i}".encode())
        slow.take(1, timeout=5)
        slow.close(clean_disconnect=False)
        got = fast.take(20, timeout=10)
        assert sorted(m.payload for m in got) == sorted(f"t{i}".encode() for i in range(20))
    finally:
        fast.close(), pub.close()


def test_MQTT_3_1_3_9_no_will_when_the_session_is_taken_up_again_within_the_will_delay(w) -> None:
    watcher = Client(w.worker.mqtt_port, "will-watch")
    watcher.subscribe("wills/#")
    flaky = Client(w.worker.mqtt_port, "flaky", expiry=60, clean=False,
                   will=("wills/flaky", b"gone", {"WillDelayInterval": 1}))
    flaky.close(clean_disconnect=False)
    back = Client(w.worker.mqtt_port, "flaky", expiry=60, clean=False)
    try:
        assert watcher.take(1, timeout=2.0) == [], "the will was sent though the client came back in time"
    finally:
        back.close(), watcher.close()


@pytest.mark.parametrize("clean_start", [True, False])
def test_MQTT_3_1_2_5_a_takeover_sends_the_old_connections_will_unless_it_resumes_within_the_will_delay(
        w, clean_start: bool) -> None:
    watcher = Client(w.worker.mqtt_port, f"will-watch-t{clean_start}")
    watcher.subscribe("wills/#")
    old = Client(w.worker.mqtt_port, f"twin-{clean_start}", expiry=60, clean=False,
                 will=(f"wills/twin-{clean_start}", b"replaced", {"WillDelayInterval": 30}))
    new = Client(w.worker.mqtt_port, f"twin-{clean_start}", expiry=60, clean=clean_start)  # takes the session
    try:
        got = [m.payload for m in watcher.take(1, timeout=3.0)]
        # Clean Start 1 ends the old session: its will now, not after 30 s; Clean Start 0 resumes it: none
        assert got == ([b"replaced"] if clean_start else [])
    finally:
        new.close(), old.close(), watcher.close()


def test_MQTT_3_1_3_9_the_will_comes_after_its_delay_with_its_properties(w) -> None:
    watcher = Client(w.worker.mqtt_port, "will-watch2")
    watcher.subscribe("wills/#")
    started = time.monotonic()
    gone = Client(w.worker.mqtt_port, "gone", expiry=60, will=(
        "wills/gone", b"bye", {"WillDelayInterval": 1, "ContentType": "text/plain",
                               "UserProperty": [("why", "network")]}))
    gone.close(clean_disconnect=False)
    try:
        got = watcher.take(1, timeout=5)
        assert [m.payload for m in got] == [b"bye"]
        assert time.monotonic() - started >= 1.0, "not before the Will Delay Interval"
        assert got[0].properties.ContentType == "text/plain"
        assert got[0].properties.UserProperty == [("why", "network")]
    finally:
        watcher.close()


def test_MQTT_3_1_2_8_the_will_comes_when_the_session_ends_before_the_will_delay(w) -> None:
    watcher = Client(w.worker.mqtt_port, "will-watch3")
    watcher.subscribe("wills/#")
    gone = Client(w.worker.mqtt_port, "short", expiry=1, will=("wills/short", b"ended", {"WillDelayInterval": 3600}))
    gone.close(clean_disconnect=False)
    try:
        assert [m.payload for m in watcher.take(1, timeout=5)] == [b"ended"]
    finally:
        watcher.close()


def test_a_connected_mqtt_session_is_kept_alive_by_its_worker_past_the_session_lease(w) -> None:
    steady = Client(w.worker.mqtt_port, "kept", expiry=0)
    try:
        steady.subscribe("alive/#")
        time.sleep(1.0)  # three worker leases: only the worker's keep-alive holds the session now
        steady.publish("alive/x", b"still here")
        assert [m.payload for m in steady.take(1)] == [b"still here"]
    finally:
        steady.close()


def test_MQTT_3_14_2_a_disconnect_that_sets_the_session_expiry_to_0_ends_the_session(w, redis_url) -> None:
    import redis
    from paho.mqtt.packettypes import PacketTypes

    from fencemq.model.keys import Keyspace
    from tests.helpers import wait_for
    from tests.server.mqtt.clients import props

    first = Client(w.worker.mqtt_port, "changes-mind", expiry=60, clean=False)
    first.subscribe("mind/#")
    first.c.disconnect(properties=props(PacketTypes.DISCONNECT, SessionExpiryInterval=0))
    first.c.loop_stop()
    r = redis.Redis.from_url(redis_url)
    # a reconnect racing the DISCONNECT would share the session instead: wait until it has ended
    wait_for(lambda: not r.exists(Keyspace("fmq").session("changes-mind")), what="the session to end")
    again = Client(w.worker.mqtt_port, "changes-mind", expiry=60, clean=False)
    try:
        assert again.session_present is False
    finally:
        again.close()


def test_MQTT_4_3_3_a_qos2_delivery_received_before_the_connection_dropped_is_released_on_resume_not_sent_again(
        w) -> None:
    import socket

    from fencemq.protocol.mqtt.packets import Pubcomp, Publish, Pubrec, Pubrel, Subscribe, SubscriptionOptions
    from tests.helpers import client

    first = RawClient(w.worker.mqtt_port, "q2-resume", clean_start=True, expiry=300)
    first.send(Subscribe(1, (("q2/+", SubscriptionOptions(qos=2)),)))
    first.next()  # SUBACK
    producer = client(w.port)
    producer.execute_command("PUB", "q2/a", "once", "HDR", "mqtt-qos", "2")
    publish = first.next()
    assert isinstance(publish, Publish) and publish.qos == 2 and publish.payload == b"once"
    first.send(Pubrec(publish.packet_id))
    pubrel = first.next()
    assert isinstance(pubrel, Pubrel) and pubrel.packet_id == publish.packet_id
    first.close()  # gone before its PUBCOMP

    again = RawClient(w.worker.mqtt_port, "q2-resume", clean_start=False, expiry=300)
    assert again.connack.session_present
    released = again.next()
    assert isinstance(released, Pubrel) and released.packet_id == publish.packet_id  # not the message again
    again.send(Pubcomp(publish.packet_id))
    with pytest.raises(socket.timeout):
        again.next(timeout=1.5)  # nothing more: the message is settled, never redelivered
    again.close()
    producer.close()


def test_MQTT_4_3_3_10_a_qos2_publish_retransmitted_on_a_resumed_session_is_stored_once(w) -> None:
    from fencemq.protocol.mqtt.packets import Pubcomp, Publish, Pubrec, Pubrel
    from tests.helpers import client, deliveries

    first = RawClient(w.worker.mqtt_port, "q2-pub", clean_start=True, expiry=300)
    first.send(Publish("q2in/a", b"exactly once", qos=2, packet_id=7))
    assert isinstance(first.next(), Pubrec)
    first.close()  # gone before its PUBREL: the client will send the PUBLISH again (DUP)

    again = RawClient(w.worker.mqtt_port, "q2-pub", clean_start=False, expiry=300)
    assert again.connack.session_present
    again.send(Publish("q2in/a", b"exactly once", qos=2, packet_id=7, dup=True))
    assert isinstance(again.next(), Pubrec)  # recorded: acknowledged again, not stored again
    again.send(Pubrel(7))
    assert isinstance(again.next(), Pubcomp)
    again.close()
    reader = client(w.port)
    handle = reader.execute_command("SUB", "q2in/a", "GROUP", "g", "FROM", "EARLIEST")[1]
    got = deliveries(reader.execute_command("PULL", handle, "COUNT", 10))
    assert [d["payload"] for d in got] == ["exactly once"]
    reader.close()


def test_MQTT_3_1_2_4_clean_start_leaves_every_subscription_of_the_session_its_lmqs_included(w, redis_url) -> None:
    from tests.helpers import RespConn, as_map, direct, held_handles

    with RespConn(w.port) as resp:
        resp.hello(3, "both-doors")
        as_map(resp.call("SUB", "chat", "LMQ", "s1"))
        as_map(resp.call("SUB", "plain-orders", "GROUP", "g"))
    r = direct(redis_url)
    assert len(held_handles(r, "both-doors")) == 2
    c = Client(w.worker.mqtt_port, "both-doors", clean=True, expiry=60)
    try:
        assert c.session_present is False
        assert held_handles(r, "both-doors") == set()
    finally:
        c.close()


def test_MQTT_3_2_2_2_a_session_with_no_subscriptions_is_still_present_when_resumed(w) -> None:
    first = Client(w.worker.mqtt_port, "no-subs", clean=False, expiry=60)
    first.close()
    again = Client(w.worker.mqtt_port, "no-subs", clean=False, expiry=60)
    try:
        assert again.session_present is True
    finally:
        again.close()


def test_MQTT_3_1_2_24_a_client_silent_past_a_keep_alive_shorter_than_the_connect_timeout_has_its_will_sent_then(
        w) -> None:
    import socket

    from fencemq.protocol.mqtt.codec import encode
    from fencemq.protocol.mqtt.packets import Connect, Will

    watcher = Client(w.worker.mqtt_port, "will-watcher")
    watcher.subscribe("gone/silent", qos=0)
    silent = socket.create_connection(("127.0.0.1", w.worker.mqtt_port))
    silent.sendall(encode(Connect(client_id="silent", keep_alive=2, will=Will("gone/silent", b"bye", 0, False))))
    started = time.monotonic()
    try:
        got = watcher.take(1, timeout=8)
        assert [m.payload for m in got] == [b"bye"]
        assert time.monotonic() - started < 5  # 1.5 x 2 s, not the 10 s connect timeout
    finally:
        silent.close(), watcher.close()


def _connack(port: int, client_id: str, level: int) -> int:
    """The reason code of the CONNACK a CONNECT gets (Redis may keep the worker 10 s and more)."""
    c = RawClient(port, client_id, level=level, connect=False)
    try:
        c.send(Connect(client_id=client_id, clean_start=False, keep_alive=30, protocol_level=level))
        return int(c.next(timeout=40).reason_code)
    finally:
        c.close()


def test_a_connect_that_meets_redis_unreachable_is_answered_server_busy_not_closed(fresh_redis) -> None:
    """A CONNECT whose session bind fails in Redis (here: Redis is gone) gets CONNACK 0x89 Server busy
    (3.1.1: 0x03 Server unavailable), never a bare close the client cannot tell from a network fault,
    however long Redis kept the worker past the connect timeout; once Redis is back the client connects."""
    with worker(fresh_redis.url, mqtt_port=0) as started:
        port = started.worker.mqtt_port
        assert _connack(port, "before", MQTT_5) == 0x00
        fresh_redis.stop()
        try:
            assert _connack(port, "during-5", MQTT_5) == 0x89
            assert _connack(port, "during-311", MQTT_311) == 0x03
        finally:
            fresh_redis.start(_same_port=True)
        deadline = time.monotonic() + 30
        while (code := _connack(port, "during-5", MQTT_5)) != 0x00:
            assert code == 0x89 and time.monotonic() < deadline
            time.sleep(0.2)
