"""The MQTT listeners of a worker: TCP (``--mqtt-port``) and WebSocket (``--mqtt-ws-port``),
each connection an :class:`fencemq.server.mqtt.listener.MqttConnection`.

Each connection enters the worker's gate before anything is read from it (max_connections,
counted with RESP's and the UI's; past it a few at a time are told CONNACK 0x97, the rest closed),
and leaves it when it closes; with TLS, the handshake is the
gate's to time (fencemq.server.tls), and so is a WebSocket's upgrade (auth_timeout_ms)."""

from __future__ import annotations

import logging
import time
from typing import Any

import anyio
import anyio.abc

from fencemq.errors import LimitExceeded
from fencemq.protocol.mqtt.events import ConnectRequested, MqttServerLimits
from fencemq.protocol.mqtt.reasons import ReasonCode
from fencemq.protocol.mqtt.session import MqttServerSession
from fencemq.server.accepting import shedding
from fencemq.server.gate import client_host
from fencemq.server.mqtt.listener import MqttConnection
from fencemq.server.tls import guarded_tls

log = logging.getLogger(__name__)
REFUSAL_READ = 65536  # a refused client's CONNECT is read up to this size (its protocol version is all it is read for)


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

    async def listen(at: int) -> tuple[Any, int]:
        listener: Any = await anyio.create_tcp_listener(local_host=worker.config.host, local_port=at)
        bound = listener.extra(SocketAttribute.local_port)
        listener = shedding(listener, worker.spare)  # MQTT says nothing before the CONNECT: a shed client is closed
        if tls is not None:
            listener = guarded_tls(listener, tls, gate)
        return listener, bound

    async def one(stream: anyio.abc.ByteStream, door: str = "mqtt") -> None:
        try:
            gate_pass = gate.enter(door, client_host(stream))
        except LimitExceeded:  # past max_connections (every door counted): CONNACK 0x97 / 3.1.1 0x03
            with worker.refusals.told() as telling:
                if telling and door == "mqtt":
                    await refuse_connect(stream, ReasonCode.QUOTA_EXCEEDED)
            await anyio.aclose_forcefully(stream)
            return
        try:
            if door == "mqtt-ws":
                ws = MqttWebSocketStream(stream)
                try:
                    with anyio.fail_after(gate.connect_timeout_s):
                        await ws.handshake()
                except (WebSocketRefused, TimeoutError) as exc:
                    log.info("MQTT WebSocket refused: %s", exc)
                    await anyio.aclose_forcefully(stream)
                    return
                stream = ws
            conn = MqttConnection(worker, stream, f"{worker.id}:mqtt{next(numbers)}", gate_pass)
            worker.connections[conn.token] = conn
            try:
                await conn.run()
            except Exception:
                log.exception("MQTT connection failed")
            finally:
                worker.connections.pop(conn.token, None)
        finally:
            gate.leave(gate_pass)
        try:
            await conn.will_after_delay()
        except Exception:  # one connection's failure (Redis, out of open files) must never take the worker down
            log.exception("the will of MQTT connection %s failed", conn.token)

    async def one_ws(stream: anyio.abc.ByteStream) -> None:
        await one(stream, "mqtt-ws")

    listeners = []
    tcp_bound = None
    if port is not None:
        listener, tcp_bound = await listen(port)
        listeners.append((listener, one))
    if ws_port is not None:
        listener, worker.mqtt_ws_port = await listen(ws_port)
        listeners.append((listener, one_ws))
    async def serve(listener: Any, handler: Any) -> None:
        async with listener:
            await listener.serve(handler, task_group=connections)

    task_status.started(tcp_bound)
    async with anyio.create_task_group() as tg:
        for listener, handler in listeners:
            tg.start_soon(serve, listener, handler)


async def refuse_connect(stream: anyio.abc.ByteStream, reason: int, wait_s: float = 1.0) -> None:
    """Refuse a connection before anything is allocated for it: read its CONNECT (for the protocol
    version), answer CONNACK ``reason`` (3.1.1: 0x03 Server unavailable), close."""
    machine = MqttServerSession(MqttServerLimits(maximum_packet_size=REFUSAL_READ))
    with anyio.move_on_after(wait_s):
        try:
            while not machine.closed:
                events = machine.receive_bytes(await stream.receive(REFUSAL_READ), time.monotonic())
                if any(isinstance(e, ConnectRequested) for e in events):
                    machine.refuse(reason)
                if machine.closed:
                    await stream.send(machine.outbound())
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
    await anyio.aclose_forcefully(stream)
