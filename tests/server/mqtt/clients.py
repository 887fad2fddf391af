"""A paho-mqtt 2.x client for the MQTT tests: its own network thread, received messages in ``inbox``."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

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
