"""A paho-mqtt 2.x client for the MQTT tests: its own network thread, received messages in ``inbox``."""

from __future__ import annotations

import queue
import socket
import threading
import time
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

from fencemq.protocol.mqtt.codec import encode
from fencemq.protocol.mqtt.packets import MQTT_5, Connect
from fencemq.protocol.mqtt.properties import Properties as MqttProperties
from fencemq.protocol.mqtt.stream import MqttStreamDecoder

VERSIONS = {"3.1.1": mqtt.MQTTv311, "5.0": mqtt.MQTTv5}


def props(packet: int, **values: Any) -> Properties:
    p = Properties(packet)
    for name, value in values.items():
        setattr(p, name, value)
    return p


class Client:
    """``expiry``: the Session Expiry Interval asked for (5.0); ``will``: (topic, payload, properties)."""

    def __init__(self, port: int, client_id: str, version: str = "5.0", *, clean: bool = True,
                 expiry: int | None = None, auto_ack: bool = True, receive_maximum: int | None = None,
                 will: tuple[str, bytes, dict[str, Any]] | None = None) -> None:
        self.inbox: queue.Queue[Any] = queue.Queue()
        self.connected = threading.Event()
        self.session_present: bool | None = None
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=VERSIONS[version],
                             clean_session=clean if version == "3.1.1" else None)
        self.c.manual_ack_set(not auto_ack)
        self.c.on_message = lambda _c, _u, msg: self.inbox.put(msg)
        self.c.on_connect = self._on_connect
        if will:
            topic, payload, will_props = will
            self.c.will_set(topic, payload, qos=1, properties=props(PacketTypes.WILLMESSAGE, **will_props)
                            if will_props else None)
        kwargs: dict[str, Any] = {}
        if version == "5.0":
            values = {}
            if expiry is not None:
                values["SessionExpiryInterval"] = expiry
            if receive_maximum is not None:
                values["ReceiveMaximum"] = receive_maximum
            kwargs = {"clean_start": clean, "properties": props(PacketTypes.CONNECT, **values) if values else None}
        self.c.connect("127.0.0.1", port, keepalive=30, **kwargs)
        self.c.loop_start()
        assert self.connected.wait(10), "no CONNACK"

    def _on_connect(self, _c: Any, _u: Any, flags: Any, _reason: Any, _props: Any) -> None:
        self.session_present = bool(flags.session_present)
        self.connected.set()

    def subscribe(self, filt: str, qos: int = 1, *, identifier: int | None = None, **options: Any) -> None:
        done = threading.Event()
        self.c.on_subscribe = lambda *_a: done.set()
        kwargs: dict[str, Any] = {}
        if identifier is not None:
            kwargs["properties"] = props(PacketTypes.SUBSCRIBE, SubscriptionIdentifier=identifier)
        if options:
            self.c.subscribe(filt, options=SubscribeOptions(qos=qos, **options), **kwargs)
        else:
            self.c.subscribe(filt, qos=qos, **kwargs)
        assert done.wait(10), "no SUBACK"

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False, **properties: Any) -> None:
        p = props(PacketTypes.PUBLISH, **properties) if properties else None
        self.c.publish(topic, payload, qos=qos, retain=retain, properties=p).wait_for_publish(10)

    def take(self, n: int, timeout: float = 10.0) -> list[Any]:
        got, deadline = [], time.monotonic() + timeout
        while len(got) < n and time.monotonic() < deadline:
            try:
                got.append(self.inbox.get(timeout=max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                break
        return got

    def close(self, clean_disconnect: bool = True) -> None:
        if clean_disconnect:
            self.c.disconnect()
        else:
            self.c.socket().close()  # the network goes: no DISCONNECT
        self.c.loop_stop()


class RawClient:
    """An MQTT client spoken with FenceMQ's own codec: it sends exactly what a test says, nothing
    else (``send_all``: several packets in one write)."""

    def __init__(self, port: int, client_id: str, *, clean_start: bool = True, expiry: int = 0,
                 level: int = MQTT_5, connect: bool = True, **connect_fields: Any) -> None:
        self.level = level
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.decoder = MqttStreamDecoder(protocol_level=level)
        self.connack: Any = None
        if connect:
            props = MqttProperties(session_expiry_interval=expiry) if level == MQTT_5 and expiry else MqttProperties()
            self.send(Connect(client_id=client_id, clean_start=clean_start, keep_alive=30, properties=props,
                              protocol_level=level, **connect_fields))
            self.connack = self.next()

    def send(self, packet: Any) -> None:
        self.sock.sendall(encode(packet, self.level))

    def send_all(self, packets: list[Any]) -> None:
        self.sock.sendall(b"".join(encode(p, self.level) for p in packets))

    def next(self, timeout: float = 10.0) -> Any:
        self.sock.settimeout(timeout)
        while (got := self.decoder.next_packet()) is None:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed")
            self.decoder.feed(chunk)
        return got

    def close(self) -> None:
        self.sock.close()
