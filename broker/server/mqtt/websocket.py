"""MQTT over WebSocket (MQTT 5.0 §6, 3.1.1 §6): a byte stream of binary frames for the MQTT shell.

The RFC 6455 handshake and framing are wsproto's (sans-I/O); this module only moves bytes
between it and the socket, so `MqttConnection` reads and writes MQTT bytes as it does over TCP.
MQTT packets may span frames and a frame may hold several packets (MQTT-6.0.0-2/3): the frames'
payloads are one stream. A text frame is a protocol error: the connection closes (MQTT-6.0.0-1).
The handshake must offer the subprotocol `mqtt` (MQTT-6.0.0-3/4); the answer names it.
"""

from __future__ import annotations

import anyio
import anyio.abc
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection, BytesMessage, CloseConnection, Ping, RejectConnection, Request, TextMessage,
)
from wsproto.frame_protocol import CloseReason
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

SUBPROTOCOL = "mqtt"
READ_SIZE = 65536
HANDSHAKE_LIMIT = 16384  # bytes of HTTP upgrade request, at most


class WebSocketRefused(Exception):
    """The peer did not ask for an MQTT WebSocket (not an upgrade, or no `mqtt` subprotocol)."""


class MqttWebSocketStream(anyio.abc.ByteStream):
    """The MQTT bytes carried in a WebSocket's binary messages, over ``stream``."""

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self.stream = stream
        self.ws = WSConnection(ConnectionType.SERVER)
        self._pending = bytearray()
        self._closed = False  # the peer sent a close frame (answered), or broke the protocol
        self._send_lock = anyio.Lock()  # a pong from the reader never cuts into a frame being written

    async def handshake(self) -> None:
        """Read the HTTP upgrade and accept it with the `mqtt` subprotocol; raises WebSocketRefused."""
        seen = 0
        while True:
            try:
                data = await self.stream.receive(READ_SIZE)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                raise WebSocketRefused("the connection closed during the WebSocket handshake") from None
            seen += len(data)
            try:
                self.ws.receive_data(data)
                for event in self.ws.events():
                    if isinstance(event, Request):
                        if SUBPROTOCOL not in event.subprotocols:
                            await self._write(self.ws.send(RejectConnection(status_code=400)))
                            raise WebSocketRefused(f"subprotocols {event.subprotocols!r} do not include 'mqtt'")
                        await self._write(self.ws.send(AcceptConnection(subprotocol=SUBPROTOCOL)))
                        return
            except RemoteProtocolError as exc:
                raise WebSocketRefused(f"not a WebSocket upgrade: {exc}") from None
            if seen > HANDSHAKE_LIMIT:
                raise WebSocketRefused("the WebSocket upgrade request is too long")

    async def receive(self, max_bytes: int = READ_SIZE) -> bytes:
        while not self._pending:
            if self._closed:
                raise anyio.EndOfStream
            data = await self.stream.receive(READ_SIZE)
            try:
                self.ws.receive_data(data)
                for event in self.ws.events():
                    await self._on(event)
            except RemoteProtocolError:
                self._closed = True  # a broken frame: the MQTT session sees the network go
        out = bytes(self._pending[:max_bytes])
        del self._pending[:max_bytes]
        return out

    async def _on(self, event: object) -> None:
        if isinstance(event, BytesMessage):
            self._pending += event.data
        elif isinstance(event, Ping):
            await self._write(self.ws.send(event.response()))
        elif isinstance(event, CloseConnection):
            if not self._closed:
                await self._write(self.ws.send(event.response()))
            self._closed = True
        elif isinstance(event, TextMessage):  # MQTT-6.0.0-1: close the network connection
            await self._write(self.ws.send(CloseConnection(code=CloseReason.UNSUPPORTED_DATA)))
            self._closed = True

    async def send(self, item: bytes) -> None:
        if self._closed:
            raise anyio.ClosedResourceError
        await self._write(self.ws.send(BytesMessage(data=item)))

    async def _write(self, data: bytes) -> None:
        if data:
            async with self._send_lock:
                await self.stream.send(data)

    async def send_eof(self) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                with anyio.move_on_after(1):
                    await self._write(self.ws.send(CloseConnection(code=CloseReason.NORMAL_CLOSURE)))
            except (LocalProtocolError, anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass
        await self.stream.aclose()
