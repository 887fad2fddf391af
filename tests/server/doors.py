"""The doors of one worker, as a hostile or careless client meets them: RESP, MQTT 3.1.1 and 5.0
over TCP, MQTT over WebSocket, and the web UI the worker serves beside them (``serve --http-port``).

``Doors`` runs a worker with all of them on free ports, in a thread, as ``fencemq serve --mqtt-port
--mqtt-ws-port --http-port`` does. ``MqttWire`` is a bare MQTT client (the project's codec on a socket,
or on a WebSocket framed by wsproto): the tests need exact reason codes and hostile byte streams
that a full client library will not send.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from typing import Any

import anyio
import httpx
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, BytesMessage, CloseConnection, Ping, RejectConnection, Request

from fencemq.config import Config
from fencemq.model.keys import Keyspace
from fencemq.ops.users import UserStore
from fencemq.protocol.mqtt.codec import encode
from fencemq.protocol.mqtt.packets import (
    MQTT_5, MQTT_311, Connack, Connect, Disconnect, Puback, Publish, Suback, Subscribe, SubscriptionOptions, Will,
)
from fencemq.protocol.mqtt.properties import Properties
from fencemq.protocol.mqtt.stream import MqttStreamDecoder
from fencemq.server.runner import run
from fencemq.server.worker import Worker
from fencemq.ui.serving import worker_with_ui
from tests.helpers import RespConn, direct, direct_async, free_port, wait_for

DOORS = ("resp", "mqtt-3.1.1", "mqtt-5.0", "mqtt-ws", "ui")
MQTT_DOORS = ("mqtt-3.1.1", "mqtt-5.0", "mqtt-ws")
KEYS = Keyspace("fmq")


class Doors:
    """A worker serving every door (use as a context manager); ``port``, ``mqtt_port``, ``ws_port``, ``http``."""

    def __init__(self, redis_url: str, **settings: Any) -> None:
        settings.setdefault("users", True)
        self.config = Config(redis_url=redis_url, port=0, mqtt_port=0, mqtt_ws_port=0, **settings)
        self.redis_url = redis_url
        self.worker = Worker(self.config)
        self.http_port = free_port()
        self.ui_url: str | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="fencemq-doors", daemon=True)

    def _main(self) -> None:
        async def run_worker(config: Config, ready: Any) -> None:
            async with anyio.create_task_group() as tg:
                port = await tg.start(self.worker.run)
                ready(self.worker, port)

        def on_ui(url: str) -> None:
            self.ui_url = url.rstrip("/")

        try:
            run(worker_with_ui, self.config, None, self.http_port, run_worker, on_ui)
        except BaseException as exc:  # surfaced to the starting thread
            self._error = exc
        finally:
            self._ready.set()

    def __enter__(self) -> "Doors":
        self._thread.start()
        wait_for(lambda: self.ui_url is not None or self._error is not None, timeout=30, what="the doors to open")
        if self._error is not None:
            raise RuntimeError(f"the worker failed to start: {self._error!r}") from self._error
        wait_for(self._ui_answers, timeout=10, what="the UI to answer")
        return self

    def _ui_answers(self) -> bool:
        try:
            httpx.get(f"{self.ui_url}/static/app.css", timeout=1)
            return True
        except httpx.HTTPError:
            return False

    def __exit__(self, *exc: object) -> None:
        self.worker.drain()
        self._thread.join(10)

    @property
    def port(self) -> int:
        assert self.worker.port is not None
        return self.worker.port

    @property
    def mqtt_port(self) -> int:
        assert self.worker.mqtt_port is not None
        return self.worker.mqtt_port

    @property
    def ws_port(self) -> int:
        assert self.worker.mqtt_ws_port is not None
        return self.worker.mqtt_ws_port

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.ui_url, timeout=10, follow_redirects=False)

    def direct(self) -> Any:
        return direct(self.redis_url)

    def mqtt(self, door: str, **options: Any) -> "MqttWire":
        return MqttWire(self.ws_port if door == "mqtt-ws" else self.mqtt_port,
                        MQTT_311 if door == "mqtt-3.1.1" else MQTT_5, ws=door == "mqtt-ws", **options)


_RECORDS: dict[tuple[str, str, tuple[tuple[str, str], ...]], bytes] = {}


def add_user(redis_url: str, name: str, password: str, *grants: tuple[str, str]) -> None:
    """``fencemq user add``: the first time through UserStore (a scrypt hash, ~0.1 s), then its record
    again (the tests add the same few users over and over)."""
    key = (name, password, grants)
    if key not in _RECORDS:
        async def main() -> None:
            r = direct_async(redis_url)
            try:
                await UserStore(r, KEYS.users).add(name, password, list(grants))
                _RECORDS[key] = await r.hget(KEYS.users, name)
            finally:
                await r.aclose()
        anyio.run(main)
        return
    assert direct(redis_url).hsetnx(KEYS.users, name, _RECORDS[key]), f"user {name} exists"


def change_user(redis_url: str, how: str, name: str, *args: Any) -> None:
    """``how``: a UserStore method (grant, revoke, passwd, delete), as ``fencemq user`` calls it."""
    async def main() -> None:
        r = direct_async(redis_url)
        try:
            await getattr(UserStore(r, KEYS.users), how)(name, *args)
        finally:
            await r.aclose()
    anyio.run(main)


def resp(port: int, *auth: str, tls: ssl.SSLContext | None = None) -> RespConn:
    c = RespConn(port)
    if tls is not None:
        c.sock = tls.wrap_socket(c.sock, server_hostname="127.0.0.1")
    if auth:
        reply = c.call("AUTH", *auth)
        assert reply == "OK", f"AUTH {auth[0]} answered {reply!r}"
    return c


class WebSocketBytes:
    """A socket's worth of MQTT bytes carried in WebSocket binary messages (wsproto, client side)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.pending = bytearray()
        self.closed = False
        sock.sendall(self.ws.send(Request(host="127.0.0.1", target="/mqtt", subprotocols=["mqtt"])))
        while True:
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("the WebSocket handshake was not answered")
            self.ws.receive_data(data)
            for event in self.ws.events():
                if isinstance(event, AcceptConnection):
                    return
                if isinstance(event, RejectConnection):
                    raise ConnectionError("the WebSocket handshake was refused")

    def sendall(self, data: bytes) -> None:
        self.sock.sendall(self.ws.send(BytesMessage(data=data)))

    def send_raw_frame_start(self, size: int) -> None:
        """The header of a binary frame of ``size`` bytes (unmasked length; the body never follows)."""
        self.sock.sendall(bytes([0x82, 0xFF]) + size.to_bytes(8, "big") + b"\0\0\0\0")

    def recv(self, n: int) -> bytes:
        while not self.pending:
            if self.closed:
                return b""
            data = self.sock.recv(65536)
            if not data:
                return b""
            self.ws.receive_data(data)
            for event in self.ws.events():
                if isinstance(event, BytesMessage):
                    self.pending += event.data
                elif isinstance(event, Ping):
                    self.sock.sendall(self.ws.send(event.response()))
                elif isinstance(event, CloseConnection):
                    self.closed = True
        out = bytes(self.pending[:n])
        del self.pending[:n]
        return out

    def settimeout(self, t: float | None) -> None:
        self.sock.settimeout(t)

    def close(self) -> None:
        self.sock.close()


class MqttWire:
    """A bare MQTT client: packets out through the project's codec, packets in through its decoder."""

    def __init__(self, port: int, level: int, *, ws: bool = False, timeout: float = 5.0,
                 tls: ssl.SSLContext | None = None, rcvbuf: int | None = None) -> None:
        sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        if tls is not None:
            sock = tls.wrap_socket(sock, server_hostname="127.0.0.1")
        self.raw = sock
        self.sock: Any = WebSocketBytes(sock) if ws else sock
        self.level = level
        self.timeout = timeout
        self.decoder = MqttStreamDecoder(protocol_level=level)
        self.packets: list[Any] = []
        self.next_id = 1

    def send(self, packet: Any) -> None:
        self.sock.sendall(encode(packet, self.level))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def receive(self, timeout: float | None = None) -> Any:
        """The next packet from the server; None when the connection closed."""
        if self.packets:
            return self.packets.pop(0)
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no packet from the worker")
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                raise TimeoutError("no packet from the worker") from None
            except (ConnectionResetError, BrokenPipeError, ssl.SSLError):
                data = b""
            if not data:
                return None
            self.packets += self.decoder.packets(data)
            if self.packets:
                return self.packets.pop(0)

    def expect(self, kind: type, timeout: float | None = None) -> Any:
        """The next packet of ``kind`` (PUBLISHes met on the way are kept aside in ``published``)."""
        while True:
            packet = self.receive(timeout)
            if packet is None or isinstance(packet, kind):
                return packet
            if isinstance(packet, Publish):
                self.published.append(packet)

    published: list[Publish]

    def connect(self, client_id: str, user: str | None = None, password: str | None = None, *,
                clean: bool = True, keep_alive: int = 0, will: Will | None = None,
                expiry: int | None = None) -> Connack | None:
        """CONNECT; the CONNACK (None: closed without one)."""
        self.published = []
        props = Properties(session_expiry_interval=expiry) if expiry is not None and self.level == MQTT_5 \
            else Properties()
        self.send(Connect(client_id, self.level, clean, keep_alive, user,
                          password.encode() if password is not None else None, will, props))
        return self.expect(Connack)

    def subscribe(self, *filters: str, qos: int = 1) -> list[int] | None:
        packet_id, self.next_id = self.next_id, self.next_id + 1
        self.send(Subscribe(packet_id, tuple((f, SubscriptionOptions(qos)) for f in filters)))
        ack = self.expect(Suback)
        return None if ack is None else list(ack.reason_codes)

    def publish(self, topic: str, payload: bytes = b"x", *, qos: int = 1, retain: bool = False) -> int | None:
        """PUBLISH; the PUBACK's reason code at QoS 1 (0 on 3.1.1, which has none; None: closed)."""
        packet_id = None
        if qos:
            packet_id, self.next_id = self.next_id, self.next_id + 1
        self.send(Publish(topic, payload, qos, retain, False, packet_id))
        if not qos:
            return 0
        ack = self.expect(Puback)
        return None if ack is None else ack.reason_code

    def disconnect(self) -> None:
        try:
            self.send(Disconnect(0))
        except OSError:
            pass
        self.close()

    def take(self, timeout: float = 1.0) -> list[Publish]:
        """The PUBLISHes that arrive within ``timeout`` (acknowledged at QoS 1)."""
        got = list(self.published)
        self.published = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                packet = self.receive(max(0.01, deadline - time.monotonic()))
            except TimeoutError:
                break
            if packet is None:
                break
            if isinstance(packet, Publish):
                got.append(packet)
                if packet.qos == 1 and packet.packet_id is not None:
                    self.send(Puback(packet.packet_id))
        return got

    def is_closed(self, timeout: float = 2.0) -> bool:
        """True if the worker closes the connection within ``timeout`` (packets meanwhile are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                if self.receive(left) is None:
                    return True
            except TimeoutError:
                return False
            except OSError:
                return True

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def will(topic: str, payload: bytes = b"gone", *, retain: bool = False, delay: int | None = None) -> Will:
    return Will(topic, payload, 1, retain, Properties(will_delay_interval=delay) if delay else Properties())


def accepted(ack: Connack | None) -> bool:
    """A CONNACK that lets the client in (3.1.1's return code 0, 5.0's reason code 0)."""
    return ack is not None and ack.reason_code == 0



