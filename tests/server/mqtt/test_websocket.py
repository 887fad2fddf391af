"""MQTT over WebSocket (MQTT 5.0 §6): paho-mqtt's websocket transport in both protocol versions, and TLS."""

from __future__ import annotations

import queue
import socket
import threading
import urllib.error
import urllib.request
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from tests.helpers import worker

VERSIONS = {"3.1.1": mqtt.MQTTv311, "5.0": mqtt.MQTTv5}


@pytest.fixture
def w(redis_url):
    with worker(redis_url, mqtt_port=0, mqtt_ws_port=0) as started:
        yield started


def ws_client(port: int, client_id: str, version: str, got: queue.Queue[Any], *, ca: str | None = None) -> Any:
    connected = threading.Event()
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=VERSIONS[version],
                    transport="websockets")
    if ca:
        c.tls_set(ca_certs=ca)
    c.on_connect = lambda *_a: connected.set()
    c.on_message = lambda _c, _u, msg: got.put((msg.topic, msg.payload, msg.qos))
    c.connect("127.0.0.1", port, keepalive=30)
    c.loop_start()
    assert connected.wait(10), "no CONNACK over the WebSocket"
    return c


def subscribe(c: Any, filt: str, qos: int = 1) -> None:
    done = threading.Event()
    c.on_subscribe = lambda *_a: done.set()
    c.subscribe(filt, qos=qos)
    assert done.wait(10), "no SUBACK"


@pytest.mark.parametrize("version", VERSIONS)
def test_MQTT_6_0_0_a_websocket_client_subscribes_and_gets_what_a_tcp_client_publishes(w, version) -> None:
    got: queue.Queue[Any] = queue.Queue()
    sub = ws_client(w.worker.mqtt_ws_port, f"ws-sub-{version}", version, got)
    tcp = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="tcp-pub", protocol=VERSIONS[version])
    tcp.connect("127.0.0.1", w.worker.mqtt_port)
    tcp.loop_start()
    try:
        subscribe(sub, "ws/#")
        tcp.publish("ws/a", b"over tcp", qos=1).wait_for_publish(10)
        sub.publish("ws/b", b"x" * 70_000, qos=1).wait_for_publish(10)  # a packet larger than one read
        assert got.get(timeout=10) == ("ws/a", b"over tcp", 1)
        assert got.get(timeout=10) == ("ws/b", b"x" * 70_000, 1)
    finally:
        sub.disconnect(), sub.loop_stop(), tcp.disconnect(), tcp.loop_stop()


def test_MQTT_6_0_0_4_a_handshake_without_the_mqtt_subprotocol_is_refused(w) -> None:
    s = socket.create_connection(("127.0.0.1", w.worker.mqtt_ws_port), timeout=10)
    s.sendall(b"GET /mqtt HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
              b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
              b"Sec-WebSocket-Protocol: chat\r\n\r\n")
    reply = _whole_reply(s)
    assert reply.startswith(b"HTTP/1.1 400 Bad Request\r\n"), reply[:40]
    assert b"offer the subprotocol mqtt" in reply and b"it offered: chat" in reply, reply


def _whole_reply(s: socket.socket) -> bytes:
    reply = b""
    while chunk := s.recv(4096):
        reply += chunk
    s.close()
    return reply


def test_plain_http_on_the_websocket_port_is_told_what_the_port_is_for(w) -> None:
    url = f"http://127.0.0.1:{w.worker.mqtt_ws_port}/"
    with pytest.raises(urllib.error.HTTPError) as refused:  # curl's request, from urllib
        urllib.request.urlopen(url, timeout=10)
    assert (refused.value.code, refused.value.reason) == (426, "Upgrade Required")
    assert refused.value.headers["Upgrade"] == "websocket"
    body = refused.value.read().decode()
    assert "MQTT over WebSocket port" in body and "not a WebSocket upgrade" in body, body


def test_bytes_that_are_not_http_on_the_websocket_port_get_a_400_that_says_so(w) -> None:
    s = socket.create_connection(("127.0.0.1", w.worker.mqtt_ws_port), timeout=10)
    s.sendall(bytes([0x10, 0x10, 0, 4]) + b"MQTT" + bytes([4, 2, 0, 60, 0, 4]) + b"test")  # MQTT over bare TCP
    reply = _whole_reply(s)
    assert reply.startswith(b"HTTP/1.1 400 Bad Request\r\n"), reply[:40]
    assert b"not an HTTP request" in reply, reply


def test_MQTT_6_0_0_1_a_text_frame_closes_the_connection(w) -> None:
    s = socket.create_connection(("127.0.0.1", w.worker.mqtt_ws_port), timeout=10)
    s.sendall(b"GET /mqtt HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
              b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
              b"Sec-WebSocket-Protocol: mqtt\r\n\r\n")
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(4096)
    assert head.startswith(b"HTTP/1.1 101") and b"sec-websocket-protocol: mqtt" in head.lower()
    s.sendall(bytes([0x81, 0x82, 1, 2, 3, 4]) + bytes(b ^ k for b, k in zip(b"hi", [1, 2])))  # masked text "hi"
    rest = b""
    while chunk := s.recv(4096):
        rest += chunk
    s.close()
    assert rest[:1] == bytes([0x88]), "a close frame, then the connection closed"
    assert int.from_bytes(rest[2:4], "big") == 1003


def test_mqtt_over_websocket_over_tls_with_the_workers_certificates(redis_url, tmp_path) -> None:
    from tests.server.test_tls import Files

    files = Files(tmp_path)
    with worker(redis_url, mqtt_ws_port=0, tls_cert_file=str(files.cert), tls_key_file=str(files.key)) as tw:
        got: queue.Queue[Any] = queue.Queue()
        c = ws_client(tw.worker.mqtt_ws_port, "wss", "5.0", got, ca=str(files.ca))
        try:
            subscribe(c, "wss/#")
            c.publish("wss/x", b"sealed", qos=1).wait_for_publish(10)
            assert got.get(timeout=10) == ("wss/x", b"sealed", 1)
        finally:
            c.disconnect(), c.loop_stop()


UPGRADE = (b"GET /mqtt HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
           b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
           b"Sec-WebSocket-Protocol: mqtt\r\n\r\n")


def _upgraded(port: int) -> socket.socket:
    """A WebSocket upgraded for MQTT that has sent no CONNECT yet: in its connect phase."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(UPGRADE)
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(4096)
    assert head.startswith(b"HTTP/1.1 101"), head[:40]
    return s


@pytest.fixture
def one_at_a_time(redis_url):
    # one connection in its connect phase at a time, whatever its door
    with worker(redis_url, mqtt_port=0, mqtt_ws_port=0, max_connecting=1) as started:
        yield started


def test_a_websocket_client_past_the_admission_bound_waits_its_turn_unanswered_then_connects(one_at_a_time) -> None:
    w = one_at_a_time.worker
    holder = _upgraded(w.mqtt_ws_port)  # upgraded, its CONNECT not sent: it holds the one place
    waiting = socket.create_connection(("127.0.0.1", w.mqtt_ws_port), timeout=10)
    waiting.sendall(UPGRADE)
    waiting.settimeout(1.0)
    with pytest.raises(TimeoutError):  # its upgrade unread: not even the 101 before its turn
        waiting.recv(4096)
    assert w.mqtt_admission.most_waiting >= 1
    holder.close()  # gone before its CONNECT: its place is given back, and the waiting one's turn comes
    waiting.settimeout(10)
    head = b""
    while b"\r\n\r\n" not in head:
        head += waiting.recv(4096)
    assert head.startswith(b"HTTP/1.1 101"), head[:40]
    waiting.close()
    got: queue.Queue[Any] = queue.Queue()
    c = ws_client(w.mqtt_ws_port, "after-the-wait", "5.0", got)  # every place given back: a client connects
    c.disconnect(), c.loop_stop()


def test_the_doors_share_one_bound_and_a_refused_upgrade_gives_its_place_back(one_at_a_time) -> None:
    w = one_at_a_time.worker
    s = socket.create_connection(("127.0.0.1", w.mqtt_ws_port), timeout=10)
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # not an upgrade: refused (426), and its place freed
    assert _whole_reply(s).startswith(b"HTTP/1.1 426")
    holder = _upgraded(w.mqtt_ws_port)
    tcp = socket.create_connection(("127.0.0.1", w.mqtt_port), timeout=10)
    tcp.sendall(bytes([0x10, 0x10, 0, 4]) + b"MQTT" + bytes([4, 2, 0, 60, 0, 4]) + b"test")
    tcp.settimeout(1.0)
    with pytest.raises(TimeoutError):  # the WebSocket holds the place: the TCP client's CONNECT waits unread
        tcp.recv(4)
    holder.close()
    tcp.settimeout(10)
    assert tcp.recv(4) == bytes([0x20, 0x02, 0x00, 0x00]), "CONNACK, accepted, once the place came free"
    tcp.close()
    assert w.mqtt_admission.admitted == 0
