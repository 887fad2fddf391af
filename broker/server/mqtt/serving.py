"""The MQTT listeners of a worker: TCP (``--mqtt-port``) and WebSocket (``--mqtt-ws-port``),
each connection an :class:`fencemq.server.mqtt.listener.MqttConnection`.

Each connection enters the worker's gate before anything is read from it (max_connections,
counted with RESP's and the UI's), and leaves it when it closes; with TLS, the handshake is the
gate's to time (fencemq.server.tls), and so is a WebSocket's upgrade (auth_timeout_ms)."""

from __future__ import annotations

import logging
from typing import Any

import anyio
import anyio.abc

from fencemq.errors import LimitExceeded
from fencemq.server.gate import client_host
from fencemq.server.mqtt.listener import MqttConnection
from fencemq.server.tls import guarded_tls

log = logging.getLogger(__name__)


async def serve_mqtt(worker: Any, port: int | None, tls: Any, *, ws_port: int | None = None,
                     task_status: anyio.abc.TaskStatus[int | None] = anyio.TASK_STATUS_IGNORED) -> None:
    """Accept MQTT connections until cancelled: over TCP on ``port``, over WebSocket on ``ws_port``
    (either may be None: off; both with TLS when the worker has certificates). Reports the TCP
    port it listens on and sets ``worker.mqtt_ws_port``."""
    from anyio.abc import SocketAttribute

    from fencemq.server.mqtt.websocket import MqttWebSocketStream, WebSocketRefused

    numbers = iter(range(1, 1 << 62))
    gate = worker.services.gate

    async def listen(at: int) -> tuple[Any, int]:
        listener: Any = await anyio.create_tcp_listener(local_host=worker.config.host, local_port=at)
        bound = listener.extra(SocketAttribute.local_port)
        if tls is not None:
            listener = guarded_tls(listener, tls, gate)
        return listener, bound

    async def one(stream: anyio.abc.ByteStream, door: str = "mqtt") -> None:
        try:
            gate_pass = gate.enter(door, client_host(stream))
        except LimitExceeded:
            log.info("MQTT connection refused: max_connections (%d) reached", worker.config.max_connections)
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
        await conn.will_after_delay()

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
            await listener.serve(handler)

    task_status.started(tcp_bound)
    async with anyio.create_task_group() as tg:
        for listener, handler in listeners:
            tg.start_soon(serve, listener, handler)
