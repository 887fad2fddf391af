"""Real MQTT clients (paho-mqtt 2.x, both protocol versions; mosquitto_pub/sub) against a worker's MQTT listener.

Tests are named after the normative statement they check where the standard has one.
"""

from __future__ import annotations

import queue
import shutil
import subprocess
import threading
import time
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from tests.helpers import RespConn, as_map, worker
from tests.server.mqtt.clients import VERSIONS, Client



@pytest.fixture
def w(redis_url):
    with worker(redis_url, mqtt_port=0, session_lease_ms=2000) as started:
        yield started


def Paho(port: int, client_id: str, version: str = "5.0", *, clean: bool = True, auto_ack: bool = True,
         will: tuple[str, bytes] | None = None) -> Client:
    """A paho client on its own network thread (tests/server/mqtt/clients.py); received messages land in ``inbox``."""
    return Client(port, client_id, version, clean=clean, auto_ack=auto_ack,
                  will=(will[0], will[1], {}) if will else None)


@pytest.mark.parametrize("version", VERSIONS)
def test_a_qos1_message_published_by_mqtt_reaches_an_mqtt_subscriber(w, version) -> None:
    sub, pub = Paho(w.worker.mqtt_port, "s1", version), Paho(w.worker.mqtt_port, "p1", version)
    try:
        sub.subscribe("sensors/+/temp")
        pub.publish("sensors/k1/temp", b"21.5")
        got = sub.take(1)
        assert [(m.topic, m.payload, m.qos) for m in got] == [("sensors/k1/temp", b"21.5", 1)]
    finally:
        sub.close(), pub.close()


@pytest.mark.parametrize("qos", [0, 1, 2])
def test_each_qos_arrives_capped_by_the_granted_qos(w, qos) -> None:
    sub, pub = Paho(w.worker.mqtt_port, "s-qos"), Paho(w.worker.mqtt_port, "p-qos")
    try:
        sub.subscribe("q/#", qos=qos)
        pub.publish("q/x", b"m", qos=2)
        got = sub.take(1)
        assert [m.payload for m in got] == [b"m"] and got[0].qos == qos
    finally:
        sub.close(), pub.close()


def test_one_topic_space_a_resp_pub_reaches_mqtt_and_an_mqtt_publish_reaches_resp(w) -> None:
    sub = Paho(w.worker.mqtt_port, "mqtt-side")
    resp = RespConn(w.port)
    resp.call("HELLO", 3, "SETNAME", "resp-side")
    try:
        sub.subscribe("mixed/#")
        handle = as_map(resp.call("SUB", "mixed/+"))["handle"]
        assert resp.call("PUB", "mixed/a", "from resp") == "1"
        assert [m.payload for m in sub.take(1)] == [b"from resp"]
        pub = Paho(w.worker.mqtt_port, "mqtt-pub")
        pub.publish("mixed/b", b"from mqtt")
        pub.close()
        got = resp.call("PULL", handle, "COUNT", 10)
        assert [as_map(d)["payload"] for d in got] == ["from resp", "from mqtt"]
    finally:
        sub.close()


def test_MQTT_4_8_2_a_shared_group_gives_each_message_to_one_member(w) -> None:
    a, b = Paho(w.worker.mqtt_port, "share-a"), Paho(w.worker.mqtt_port, "share-b")
    pub = Paho(w.worker.mqtt_port, "share-pub")
    try:
        a.subscribe("$share/g/jobs/#")
        b.subscribe("$share/g/jobs/#")
        for i in range(20):
            pub.publish("jobs/x", f"j{i}".encode())
        got_a, got_b = a.take(20, timeout=3), b.take(20, timeout=3)
        payloads = sorted(m.payload for m in got_a + got_b)
        assert payloads == sorted(f"j{i}".encode() for i in range(20)), "each message exactly once in the group"
        assert got_a and got_b, "both members got a share"
    finally:
        a.close(), b.close(), pub.close()


def test_a_qos1_message_of_a_member_that_disconnects_unacknowledged_goes_to_the_other_member(w) -> None:
    slow = Paho(w.worker.mqtt_port, "slow", auto_ack=False)  # takes and never acknowledges
    steady = Paho(w.worker.mqtt_port, "steady")
    pub = Paho(w.worker.mqtt_port, "loss-pub")
    try:
        slow.subscribe("$share/g2/work")
        steady.subscribe("$share/g2/work")
        for i in range(6):
            pub.publish("work", f"w{i}".encode())
        held = slow.take(3, timeout=3)
        assert held, "the round robin gave the slow member some"
        slow.close(clean_disconnect=True)  # a clean session ends: its unacknowledged messages go back
        got = steady.take(6, timeout=10)
        assert sorted(m.payload for m in got) == [f"w{i}".encode() for i in range(6)], "no QoS 1 message lost"
    finally:
        steady.close(), pub.close()


def test_MQTT_3_1_2_5_a_resumed_session_keeps_its_subscription_and_gets_what_was_published_meanwhile(w) -> None:
    first = Paho(w.worker.mqtt_port, "durable", "3.1.1", clean=False)
    first.subscribe("news/#")
    first.close()
    pub = Paho(w.worker.mqtt_port, "news-pub")
    pub.publish("news/today", b"while away")
    pub.close()
    again = Paho(w.worker.mqtt_port, "durable", "3.1.1", clean=False)
    try:
        assert [m.payload for m in again.take(1)] == [b"while away"]
    finally:
        again.close()


def test_MQTT_3_3_1_5_a_retained_message_is_sent_to_a_new_subscriber(w) -> None:
    pub = Paho(w.worker.mqtt_port, "ret-pub")
    pub.publish("state/door", b"open", retain=True)
    pub.close()
    sub = Paho(w.worker.mqtt_port, "ret-sub")
    try:
        sub.subscribe("state/+")
        assert [m.payload for m in sub.take(1)] == [b"open"]
    finally:
        sub.close()


def test_MQTT_3_1_2_8_the_will_is_published_when_the_network_goes(w) -> None:
    watcher = Paho(w.worker.mqtt_port, "watcher")
    watcher.subscribe("wills/#")
    dying = Paho(w.worker.mqtt_port, "dying", will=("wills/dying", b"gone"))
    try:
        dying.close(clean_disconnect=False)
        assert [m.payload for m in watcher.take(1)] == [b"gone"]
    finally:
        watcher.close()


def test_MQTT_3_1_4_3_a_second_connection_with_the_same_client_id_takes_the_session_over(w) -> None:
    first = Paho(w.worker.mqtt_port, "twice")
    gone = threading.Event()
    first.c.on_disconnect = lambda *_a: gone.set()
    second = Paho(w.worker.mqtt_port, "twice")
    try:
        assert gone.wait(10), "the older connection was disconnected"
    finally:
        second.close()
        first.c.loop_stop()


@pytest.mark.skipif(not shutil.which("mosquitto_sub"), reason="mosquitto_pub/mosquitto_sub are not installed")
def test_mosquitto_pub_and_sub_talk_through_the_worker(w) -> None:
    port = str(w.worker.mqtt_port)
    sub = subprocess.Popen(["mosquitto_sub", "-p", port, "-t", "cli/#", "-q", "1", "-C", "1", "-W", "10"],
                           stdout=subprocess.PIPE, text=True)
    # mosquitto_sub says nothing when it has subscribed: publish until it has the message (one published
    # before its SUBSCRIBE reaches no one), instead of guessing how long subscribing takes
    while sub.poll() is None:
        subprocess.run(["mosquitto_pub", "-p", port, "-t", "cli/x", "-q", "1", "-m", "hello"], check=True, timeout=10)
        try:
            sub.wait(0.3)
        except subprocess.TimeoutExpired:
            pass
    out, _ = sub.communicate(timeout=15)
    assert sub.returncode == 0 and out.strip() == "hello"


def test_a_tls_worker_serves_mqtt_over_tls_with_the_same_certificates(redis_url, tmp_path) -> None:
    from tests.server.test_tls import Files

    files = Files(tmp_path)
    with worker(redis_url, mqtt_port=0, tls_cert_file=str(files.cert), tls_key_file=str(files.key)) as tw:
        got: queue.Queue[Any] = queue.Queue()
        connected = threading.Event()
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="tls-mqtt", protocol=mqtt.MQTTv5)
        c.tls_set(ca_certs=str(files.ca))
        c.on_connect = lambda *_a: connected.set()
        c.on_message = lambda _c, _u, msg: got.put(msg.payload)
        c.connect("127.0.0.1", tw.worker.mqtt_port)
        c.loop_start()
        try:
            assert connected.wait(10), "no CONNACK over TLS"
            subscribed = threading.Event()
            c.on_subscribe = lambda *_a: subscribed.set()
            c.subscribe("secure/#", qos=1)
            assert subscribed.wait(10), "no SUBACK over TLS"  # published before it, the message reaches no one
            c.publish("secure/x", b"sealed", qos=1).wait_for_publish(10)
            assert got.get(timeout=10) == b"sealed"
        finally:
            c.disconnect()
            c.loop_stop()


def test_MQTT_3_1_4_5_a_subscribe_sent_in_the_same_write_as_connect_is_served(w) -> None:
    import socket

    s = socket.create_connection(("127.0.0.1", w.worker.mqtt_port), timeout=10)
    connect = bytes([0x10, 13, 0, 4]) + b"MQTT" + bytes([4, 2, 0, 30, 0, 1]) + b"z"
    subscribe = bytes([0x82, 8, 0, 1, 0, 3]) + b"p/#" + bytes([1])
    s.sendall(connect + subscribe)  # one write: the worker reads both at once
    got = b""
    while len(got) < 4 + 5:
        chunk = s.recv(64)
        assert chunk, f"the worker closed the connection after {got!r}"
        got += chunk
    assert got[:4] == bytes([0x20, 2, 0, 0]), "CONNACK accepted"
    assert got[4:9] == bytes([0x90, 3, 0, 1, 1]), "SUBACK granting QoS 1 came without anything more sent"
    s.close()


def test_a_client_the_server_disconnects_may_still_write_and_then_reads_why_not_a_reset(w) -> None:
    """The server half-closes and reads on for a moment: a client still writing (the Paho suite's
    test_flow_control2 answers PUBRECs with PUBRELs) is not reset before it reads the DISCONNECT."""
    from fencemq.protocol.mqtt.packets import Connect, Disconnect, Pingreq
    from tests.server.mqtt.clients import RawClient

    c = RawClient(w.worker.mqtt_port, "violator")
    c.send(Connect(client_id="again"))  # a second CONNECT: DISCONNECT 0x82 (MQTT-3.1.0-2)
    time.sleep(0.2)  # the server has ended the connection by now
    for _ in range(20):  # a client that has not read yet goes on writing
        c.send(Pingreq())
        time.sleep(0.01)
    packet = c.next()
    while not isinstance(packet, Disconnect):
        packet = c.next()
    assert packet.reason_code == 0x82
    c.close()


def test_MQTT_3_3_4_8_a_client_past_the_receive_maximum_reads_its_disconnect_0x93_while_it_still_writes(w) -> None:
    from fencemq.protocol.mqtt.packets import Disconnect, Publish, Pubrec, Pubrel
    from tests.server.mqtt.clients import RawClient

    c = RawClient(w.worker.mqtt_port, "too-many")
    allowed = c.connack.properties.receive_maximum
    for i in range(1, allowed + 2):  # one write each, read nothing meanwhile
        c.send(Publish("flow/a", b"m%d" % i, qos=2, packet_id=i))
    # as the Paho suite's client does: each PUBREC read is answered with a PUBREL, while the
    # server has already ended the connection; the DISCONNECT must still be read, not a reset
    while True:
        packet = c.next(timeout=20)
        if isinstance(packet, Disconnect):
            break
        assert isinstance(packet, Pubrec)
        c.send(Pubrel(packet.packet_id))
    assert packet.reason_code == 0x93  # Receive Maximum exceeded
    c.close()


def test_MQTT_3_2_2_21_a_worker_configured_with_a_server_keep_alive_gives_it_to_every_v5_client(redis_url) -> None:
    from tests.server.mqtt.clients import RawClient

    with worker(redis_url, mqtt_port=0, mqtt_server_keep_alive_s=60) as w:
        c = RawClient(w.worker.mqtt_port, "kept-alive")  # asks for 30
        assert c.connack.properties.server_keep_alive == 60
        c.close()


@pytest.mark.parametrize("round_", range(5))
def test_a_subscribe_read_before_another_clients_publish_is_in_place_for_it(w, round_) -> None:
    """MQTT promises no order across connections, but on one worker a SUBSCRIBE read before a
    PUBLISH gets it, as on a single-threaded broker: the Paho suite's test_subscribe_options and
    test_request_response publish right behind another client's SUBSCRIBE, without its SUBACK."""
    from fencemq.protocol.mqtt.packets import Publish, Puback, Suback, Subscribe, SubscriptionOptions
    from tests.server.mqtt.clients import RawClient

    topic = f"order/{round_}"
    b = RawClient(w.worker.mqtt_port, f"order-b-{round_}")
    a = RawClient(w.worker.mqtt_port, f"order-a-{round_}")
    b.send(Subscribe(1, ((topic, SubscriptionOptions(qos=1)),)))
    a.send(Publish(topic, b"right behind", qos=1, packet_id=1))
    assert isinstance(a.next(), Puback)
    got = [b.next(), b.next()]
    assert isinstance(got[0], Suback)
    assert isinstance(got[1], Publish) and got[1].payload == b"right behind"
    a.close(), b.close()
