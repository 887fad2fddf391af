"""What carries an MQTT connection's bytes, and the tasks it runs while it has something to do.

Over TCP (and TLS) a connection is :class:`MqttWire`, an asyncio protocol: the event loop reads into
the buffer all connections share (fencemq.server.reading) and hands each read to the
connection (``received``); an idle client holds no task. Over WebSocket the frames come from a
stream (fencemq.server.mqtt.websocket) that :class:`StreamWire` reads in a task. Both give the
connection the same few calls: ``send`` (whole, waiting while the client leaves what it was sent
unread), ``send_eof``, ``closed_by_peer``, ``aclose``, ``pause_reading`` and ``resume_reading``.

:class:`ConnectionTasks` runs a connection's tasks (handling what the client sent, one task per
subscription that delivers, a drain) in the worker's group of connections, each under a cancel
scope of the connection's, cancelled together when the connection ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import anyio

from fencemq.protocol.mqtt.events import ConnectRequested, MqttServerLimits
from fencemq.protocol.mqtt.session import MqttServerSession
from fencemq.server import reading

log = logging.getLogger(__name__)

CLOSE_S = 1.0  # what was written last has this long to leave before the socket is cut


class MqttWire(asyncio.BufferedProtocol):
    """An MQTT connection's TCP (or TLS) transport, without a task of its own."""

    __slots__ = ("received", "transport", "_room", "_gone")

    def __init__(self, received: Callable[[bytes], None]) -> None:
        self.received = received  # the connection's: each read, then b"" once the client is gone
        self.transport: asyncio.Transport | None = None
        self._room: asyncio.Event | None = None  # while the client leaves what it was sent unread
        self._gone: asyncio.Event | None = None  # set once the client has closed (or the network went)

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return reading.buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self.received(reading.received(nbytes))

    def eof_received(self) -> bool:
        self._peer_gone()
        return False

    def connection_lost(self, exc: BaseException | None) -> None:
        room, self._room = self._room, None
        if room is not None:
            room.set()
        self._peer_gone()

    def _peer_gone(self) -> None:
        if self._gone is None:
            self._gone = asyncio.Event()
        if not self._gone.is_set():
            self._gone.set()
            self.received(b"")

    def pause_writing(self) -> None:
        if self._room is None:
            self._room = asyncio.Event()

    def resume_writing(self) -> None:
        room, self._room = self._room, None
        if room is not None:
            room.set()

    async def send(self, data: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            raise anyio.BrokenResourceError
        transport.write(data)
        room = self._room
        if room is not None:
            await room.wait()

    async def send_eof(self) -> None:
        transport = self.transport
        if transport is None or not transport.can_write_eof():
            raise NotImplementedError  # TLS cannot half-close
        transport.write_eof()

    async def closed_by_peer(self) -> None:
        """Until the client has closed its side (what it sends meanwhile is dropped)."""
        if self._gone is None:
            self._gone = asyncio.Event()
        await self._gone.wait()

    def pause_reading(self) -> None:
        if self.transport is not None and self.transport.is_reading():
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.transport.is_closing() and not self.transport.is_reading():
            self.transport.resume_reading()

    async def aclose(self) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.close()
            if transport.get_write_buffer_size():
                asyncio.get_running_loop().call_later(CLOSE_S, transport.abort)


class StreamWire:
    """An MQTT connection over a byte stream (WebSocket): a task reads it, a read at a time, handing
    each to the connection and waiting until the connection has handled it before the next."""

    def __init__(self, stream: Any, received: Callable[[bytes], None], caught_up: Callable[[], Any]) -> None:
        self.stream = stream
        self.received = received
        self.caught_up = caught_up  # awaitable once what the connection was handed is handled

    async def read(self) -> None:
        while True:
            try:
                data = await self.stream.receive(reading.READ_SIZE)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                data = b""
            self.received(data)
            if not data:
                return
            await self.caught_up()

    async def send(self, data: bytes) -> None:
        await self.stream.send(data)

    async def send_eof(self) -> None:
        await self.stream.send_eof()

    async def closed_by_peer(self) -> None:
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            while await self.stream.receive(reading.READ_SIZE):
                pass

    def pause_reading(self) -> None:
        pass  # the reading task waits for the connection instead

    def resume_reading(self) -> None:
        pass

    async def aclose(self) -> None:
        await self.stream.aclose()


class ConnectionTasks:
    """A connection's tasks in the worker's group, cancelled together; ``failed`` is told about a
    task that raised (the connection ends; the worker goes on)."""

    __slots__ = ("_spawn", "_failed", "_scopes", "_starting", "_done", "cancelled")

    def __init__(self, spawn: Callable[..., None], failed: Callable[[], None]) -> None:
        self._spawn = spawn
        self._failed = failed
        self._scopes: list[anyio.CancelScope] = []
        self._starting = 0
        self._done: asyncio.Event | None = None
        self.cancelled = False

    @property
    def cancel_scope(self) -> ConnectionTasks:
        """The group's cancel scope, as a task group has (``.cancel()`` cancels them all)."""
        return self

    def start_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        if not self.cancelled:
            self._starting += 1
            self._spawn(self._run, fn, args)

    async def _run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self._starting -= 1
        scope = anyio.CancelScope()
        self._scopes.append(scope)
        if self.cancelled:
            scope.cancel()
        try:
            with scope:
                await fn(*args)
        except Exception:  # one connection's failure must never take the worker down
            log.exception("MQTT connection failed")
            self._failed()
        finally:
            self._scopes.remove(scope)
            if self._done is not None and not self._scopes and not self._starting:
                self._done.set()

    def cancel(self) -> None:
        self.cancelled = True
        for scope in list(self._scopes):
            scope.cancel()

    async def finished(self) -> None:
        """Until every task has ended."""
        while self._scopes or self._starting:
            self._done = asyncio.Event()
            await self._done.wait()


class QuietLock:
    """An async lock that holds nothing while nobody holds it (anyio's keeps a queue of waiters from
    the start: some 600 bytes for each lock of each idle connection)."""

    __slots__ = ("_lock", "_users")

    def __init__(self) -> None:
        self._lock: anyio.Lock | None = None
        self._users = 0  # holding it or waiting for it

    async def __aenter__(self) -> None:
        if self._lock is None:
            self._lock = anyio.Lock(fast_acquire=True)
        lock = self._lock
        self._users += 1
        try:
            await lock.acquire()
        except BaseException:
            self._leave()
            raise

    async def __aexit__(self, *exc: object) -> None:
        assert self._lock is not None
        self._lock.release()
        self._leave()

    def _leave(self) -> None:
        self._users -= 1
        if not self._users:
            self._lock = None


class _NobodyWaits:
    """What a connection's ``quota_freed`` is until a delivery waits for quota (it then puts an
    event there): setting it wakes nobody, and costs no event per connection."""

    __slots__ = ()

    def set(self) -> None:
        pass


NOBODY_WAITS = _NobodyWaits()


class Refusal(asyncio.BufferedProtocol):
    """Refuse an MQTT connection before anything is allocated for it: read its CONNECT (for the
    protocol version), answer CONNACK ``reason`` (3.1.1: 0x03 Server unavailable), close; closed
    at once after ``wait_s`` without a CONNECT. ``over`` is called once it is closed."""

    MAX_CONNECT = 65536  # a refused client's CONNECT is read up to this size

    def __init__(self, reason: int, over: Callable[[], None], wait_s: float = 1.0) -> None:
        self.reason, self.over, self.wait_s = reason, over, wait_s
        self.machine = MqttServerSession(MqttServerLimits(maximum_packet_size=self.MAX_CONNECT))
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.timer = asyncio.get_running_loop().call_later(self.wait_s, transport.abort)

    def get_buffer(self, sizehint: int) -> memoryview:
        return reading.buffer()

    def buffer_updated(self, nbytes: int) -> None:
        machine, transport = self.machine, self.transport
        events = machine.receive_bytes(reading.received(nbytes), time.monotonic())
        if any(isinstance(e, ConnectRequested) for e in events):
            machine.refuse(self.reason)
        if machine.closed and transport is not None:
            transport.write(machine.outbound())
            transport.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.over()
