"""MQTT over WebSocket (MQTT 5.0 §6, 3.1.1 §6): a byte stream of binary frames for the MQTT shell.

The RFC 6455 handshake and framing are wsproto's (sans-I/O); this module only moves bytes
between it and the socket, so `MqttConnection` reads and writes MQTT bytes as it does over TCP.
MQTT packets may span frames and a frame may hold several packets (MQTT-6.0.0-2/3): the frames'
payloads are one stream. A text frame is a protocol error: the connection closes (MQTT-6.0.0-1).
The handshake must offer the subprotocol `mqtt` (MQTT-6.0.0-3/4); the answer names it. Anything
else gets an HTTP answer that says what this port is for: `curl` on it reads 426 Upgrade Required,
an upgrade without the subprotocol 400 Bad Request, bytes that are not HTTP 400 too.
"""

from __future__ import annotations

import anyio
import anyio.abc
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection, BytesMessage, CloseConnection, Ping, Request, TextMessage,
)
from wsproto.frame_protocol import CloseReason
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

SUBPROTOCOL = "mqtt"
READ_SIZE = 65536
HANDSHAKE_LIMIT = 16384  # bytes of HTTP upgrade request, at most
WHAT_THIS_PORT_IS = ("This is a FenceMQ MQTT over WebSocket port: connect an MQTT client over WebSocket "
                     "(ws://host:port/mqtt, subprotocol mqtt).")
REASONS = {400: "Bad Request", 426: "Upgrade Required"}


def http_refusal(status: int, why: str, headers: tuple[tuple[str, str], ...] = ()) -> bytes:
    """An HTTP/1.1 answer with a reason phrase and a plain-text body saying what went wrong; the
    connection closes after it."""
    body = f"{WHAT_THIS_PORT_IS}\n{why}\n".encode()
    head = [f"HTTP/1.1 {status} {REASONS[status]}", "Content-Type: text/plain; charset=utf-8",
            f"Content-Length: {len(body)}", "Connection: close", *(f"{k}: {v}" for k, v in headers)]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


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
                            offered = ", ".join(event.subprotocols) or "none"
                            await self._refuse(400, f"The upgrade must offer the subprotocol mqtt "
                                                    f"(Sec-WebSocket-Protocol: mqtt); it offered: {offered}.")
                            raise WebSocketRefused(f"subprotocols {event.subprotocols!r} do not include 'mqtt'")
                        await self._write(self.ws.send(AcceptConnection(subprotocol=SUBPROTOCOL)))
                        return
            except RemoteProtocolError as exc:
                if exc.__context__ is not None:  # raised while h11 failed to parse: not HTTP at all
                    await self._refuse(400, "What arrived is not an HTTP request.")
                else:  # HTTP, but not a WebSocket upgrade (curl, a browser's address bar)
                    await self._refuse(426, f"This request is not a WebSocket upgrade ({exc}).",
                                       (("Upgrade", "websocket"), ("Sec-WebSocket-Version", "13")))
                raise WebSocketRefused(f"not a WebSocket upgrade: {exc}") from None
            if seen > HANDSHAKE_LIMIT:
                raise WebSocketRefused("the WebSocket upgrade request is too long")

    async def _refuse(self, status: int, why: str, headers: tuple[tuple[str, str], ...] = ()) -> None:
        try:
            await self.stream.send(http_refusal(status, why, headers))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the peer left first: nobody to tell

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
