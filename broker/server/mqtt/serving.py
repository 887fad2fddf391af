"""The MQTT listeners of a worker: TCP (``--mqtt-port``) and WebSocket (``--mqtt-ws-port``),
each connection an :class:`fencemq.server.mqtt.listener.MqttConnection`.

Each connection enters the worker's gate before anything is read from it (max_connections,
counted with RESP's and the UI's; past it a few at a time are told CONNACK 0x97, the rest closed),
and leaves it when it closes; with TLS, the handshake is the gate's to time (fencemq.server.tls),
and so is a WebSocket's upgrade (auth_timeout_ms). Over TCP and TLS a connection is an asyncio
protocol (mqtt/wire.py) that holds no task while its client idles; over WebSocket a task reads it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from collections import deque
from functools import partial
from typing import Any

import anyio
import anyio.abc

from fencemq.errors import LimitExceeded
from fencemq.protocol.mqtt.reasons import ReasonCode
from fencemq.server.accepting import serve_sockets, shedding
from fencemq.server.admission import Admission
from fencemq.server.gate import client_host
from fencemq.server.mqtt.driving import Deadlines
from fencemq.server.mqtt.listener import MqttConnection, server_limits
from fencemq.server.mqtt.wire import MqttWire, Refusal, StreamWire
from fencemq.server.tls import guarded_tls

log = logging.getLogger(__name__)


async def serve_mqtt(worker: Any, port: int | None, tls: Any, *, ws_port: int | None = None,
                     connections: anyio.abc.TaskGroup | None = None,
                     task_status: anyio.abc.TaskStatus[int | None] = anyio.TASK_STATUS_IGNORED) -> None:
    """Accept MQTT connections until cancelled: over TCP on ``port``, over WebSocket on ``ws_port``
    (either may be None: off; both with TLS when the worker has certificates). Reports the TCP
    port it listens on and sets ``worker.mqtt_ws_port``. Connections run in ``connections`` when
    given, so they outlive the accepting (a drain stops accepting, then lets them finish)."""
    from anyio.abc import SocketAttribute

    from fencemq.server.mqtt.websocket import MqttWebSocketStream, WebSocketRefused

    numbers = iter(range(1, 1 << 62))
    gate = worker.services.gate
    limits = server_limits(worker.config, gate)  # one for every connection
    deadlines = Deadlines()  # every connection's CONNECT and keep-alive deadline, on one timer

    async def listen(at: int) -> tuple[Any, int]:
        listener: Any = await anyio.create_tcp_listener(local_host=worker.config.host, local_port=at)
        bound = listener.extra(SocketAttribute.local_port)
        # MQTT says nothing before the CONNECT: a client shed for want of a descriptor is closed
        return shedding(listener, worker.spare), bound

    # connections in their connect phase at once (admission.py): the rest of a storm waits accepted
    admission = worker.mqtt_admission = Admission(worker.config.max_connecting)

    # A dropped connection counts against max_connections until its end is done (its session let go in
    # Redis), though its socket, and so its descriptor, went at once. In a storm the new connections are all
    # accepted while the old ones still end: one that finds the gate full only of those is held, accepted and
    # unread, until one of them is done (at most as many as hold a count and no descriptor, and for the
    # connect timeout at most), instead of being refused for what is gone already.
    ended_sockets = 0  # connections over TCP whose socket is closed and whose end is not done yet
    held: deque[tuple[socket.socket, str, float]] = deque()  # (socket, host, since): waiting for a count
    door: dict[str, Any] = {}  # the task group the door's connections run in, once it serves

    def socket_closed() -> None:
        nonlocal ended_sockets
        ended_sockets += 1

    def over(conn: MqttConnection) -> None:
        nonlocal ended_sockets
        conn.admission_done()  # (ended before its CONNECT was done with)
        worker.connections.pop(conn.token, None)
        gate.leave(conn.gate_pass)
        wire = conn.stream
        if isinstance(wire, _DoorWire):
            if wire.closed_hook is None:  # its socket closed before: counted among the ended ones
                ended_sockets -= 1
            else:
                wire.closed_hook = None  # done: its socket closing later counts for nothing
        while held:
            sock, host, _ = held[0]
            try:
                gate_pass = gate.enter("mqtt", host)
            except LimitExceeded:
                break
            held.popleft()
            admit(door["tasks"], sock, gate_pass)

    async def expire_held() -> None:
        """Those held longer than the connect timeout are refused as at the limit."""
        while held:
            await anyio.sleep(0.25)
            now = time.monotonic()
            while held and now - held[0][2] >= gate.connect_timeout_s:
                sock, _, _ = held.popleft()
                refuse(door["tasks"], sock)

    def connection(door: str, gate_pass: Any) -> MqttConnection:
        conn = MqttConnection(worker, f"{worker.id}:mqtt{next(numbers)}", gate_pass, limits)
        worker.connections[conn.token] = conn
        return conn

    def refuse(tasks: anyio.abc.TaskGroup, sock: socket.socket) -> None:
        """Past max_connections (every door counted): CONNACK 0x97 / 3.1.1 0x03, a few at a time, else a close."""
        if worker.refusals.take():
            tasks.start_soon(_attach, Refusal(ReasonCode.QUOTA_EXCEEDED, worker.refusals.give), sock,
                             tls, gate.handshake_timeout_s)
        else:
            sock.close()

    async def one(tasks: anyio.abc.TaskGroup, sock: socket.socket, address: Any) -> None:
        host = address[0] if isinstance(address, tuple) else ""
        try:
            gate_pass = gate.enter("mqtt", host)
        except LimitExceeded:
            if len(held) < ended_sockets:  # a count comes free once an ended connection is done
                held.append((sock, host, time.monotonic()))
                if len(held) == 1:
                    tasks.start_soon(expire_held)
                return
            refuse(tasks, sock)
            return
        admit(tasks, sock, gate_pass)

    def admit(tasks: anyio.abc.TaskGroup, sock: socket.socket, gate_pass: Any) -> None:

        def start(done: Any) -> None:
            # made only now: its connect timeout runs from its admission, not from its accept
            conn = connection("mqtt", gate_pass)
            conn.admission_done = done
            wire = _DoorWire(conn.received, socket_closed)
            conn.stream = wire
            conn._start_driving(tasks.start_soon, over, deadlines)
            # attached in a task of its own (with TLS, the handshake too): the accept loop goes on taking
            # the crowd out of the listen backlog meanwhile
            tasks.start_soon(_attach_or_cut, conn, wire, sock, tls, gate.handshake_timeout_s)

        def abandon() -> None:  # the worker stops accepting: never admitted, closed unread
            sock.close()
            gate.leave(gate_pass)

        admission.admit(start, abandon)

    async def one_ws(tasks: anyio.abc.TaskGroup, stream: anyio.abc.ByteStream) -> None:
        try:
            gate_pass = gate.enter("mqtt-ws", client_host(stream))
        except LimitExceeded:
            await anyio.aclose_forcefully(stream)  # no CONNACK before the upgrade: closed
            return
        # a place among the connections in their connect phase, as over TCP: the upgrade is read, and the
        # connect timeout starts, only at its turn (a storm over WebSocket waits accepted too)
        try:
            done = await admission.place()
        except BaseException:
            await anyio.aclose_forcefully(stream)
            gate.leave(gate_pass)
            raise
        if done is None:  # the worker stops accepting: closed unread
            await anyio.aclose_forcefully(stream)
            gate.leave(gate_pass)
            return
        ws = MqttWebSocketStream(stream)
        try:
            with anyio.fail_after(gate.connect_timeout_s):
                await ws.handshake()
        except (WebSocketRefused, TimeoutError) as exc:
            log.info("MQTT WebSocket refused: %s", exc)
            await anyio.aclose_forcefully(stream)
            gate.leave(gate_pass)
            done()
            return
        except BaseException:
            done()
            raise
        conn = connection("mqtt-ws", gate_pass)
        conn.admission_done = done
        wire = StreamWire(ws, conn.received, conn.caught_up)
        conn.stream = wire
        conn._start_driving(tasks.start_soon, over, deadlines)
        assert conn.tasks is not None
        conn.tasks.start_soon(wire.read)

    async def serve(tasks: anyio.abc.TaskGroup) -> None:
        door["tasks"] = tasks
        task_status.started(tcp_bound)
        async with anyio.create_task_group() as tg:
            if tcp is not None:
                async def accepted(sock: socket.socket, address: Any) -> None:
                    await one(tasks, sock, address)

                # accepted by a thread of its own: a storm leaves the listen backlog as fast as it comes
                tg.start_soon(_serve_closing, tcp, partial(serve_sockets, threaded=True), tcp, accepted)
            if ws is not None:
                listener = guarded_tls(ws, tls, gate) if tls is not None else ws

                async def upgraded(stream: anyio.abc.ByteStream) -> None:
                    await one_ws(tasks, stream)

                tg.start_soon(_serve_closing, listener, listener.serve, upgraded, tasks)

    tcp = ws = None
    tcp_bound = None
    if port is not None:
        tcp, tcp_bound = await listen(port)
    if ws_port is not None:
        ws, worker.mqtt_ws_port = await listen(ws_port)
    try:
        if connections is not None:
            await serve(connections)
        else:
            async with anyio.create_task_group() as own:
                await serve(own)
    finally:
        while held:  # (they hold no count)
            held.popleft()[0].close()
        if abandoned := admission.abandon_waiting():
            log.info("MQTT: %d accepted connection(s) closed before their turn (the worker stops accepting)",
                     abandoned)


class _DoorWire(MqttWire):
    """An MQTT connection's TCP transport that tells the door when its socket is closed (its descriptor free)."""

    __slots__ = ("closed_hook",)

    def __init__(self, received: Any, closed_hook: Any) -> None:
        super().__init__(received)
        self.closed_hook = closed_hook

    def connection_lost(self, exc: BaseException | None) -> None:
        super().connection_lost(exc)
        hook, self.closed_hook = self.closed_hook, None
        if hook is not None:
            hook()


async def _serve_closing(listener: Any, serve: Any, *args: Any) -> None:
    async with listener:
        await serve(*args)


async def _attach(protocol: asyncio.BaseProtocol, sock: socket.socket, tls: ssl.SSLContext | None = None,
                  handshake_s: float | None = None) -> bool:
    """The socket under ``protocol``'s transport (after the TLS handshake, with certificates); False
    (and the socket closed) for a client gone before, or a handshake failed or not done in time."""
    loop = asyncio.get_running_loop()
    try:
        if tls is None:
            await loop.connect_accepted_socket(lambda: protocol, sock)
        else:
            await loop.connect_accepted_socket(lambda: protocol, sock, ssl=tls, ssl_handshake_timeout=handshake_s)
        return True
    except (OSError, asyncio.TimeoutError, ssl.SSLError) as exc:
        why = "no handshake within the timeout" if isinstance(exc, TimeoutError) else \
            (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        log.info("MQTT %s failed: %s", "TLS handshake" if tls is not None else "connection", why)
        sock.close()
        if isinstance(protocol, Refusal):
            protocol.connection_lost(None)
        return False


async def _attach_or_cut(conn: MqttConnection, wire: MqttWire, sock: socket.socket, tls: ssl.SSLContext | None,
                         handshake_s: float | None) -> None:
    if not await _attach(wire, sock, tls, handshake_s):
        conn.cut()
