"""Accepting connections without ever dying of it.

anyio's ``Listener.serve`` ends at the first failed ``accept()``: out of open files
(EMFILE), a worker would stop and drop every client it serves. Here a listener
outlives it. A client whose connection cannot be accepted for want of a descriptor
is shed the way libuv and nginx do it: the spare descriptor held for this is
closed, the connection accepted with it, told why where the protocol allows a word
before its handshake (RESP: ``-ERR max number of clients reached``), closed, and the
spare taken back. Connections the client dropped before they were accepted
(ECONNABORTED and the like) are skipped.

Normally ``max_connections`` (capped to the open files, server/file_limit.py)
refuses a connection long before: this is the last line, for descriptors taken by
what the worker does not count (the UI, a leak, a limit lowered from outside).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import AsyncExitStack, contextmanager
from typing import Any

import anyio
from anyio.abc import Listener, SocketAttribute, SocketStream, TaskGroup
from anyio.streams.stapled import MultiListener

log = logging.getLogger(__name__)

OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# The connection went away (or was refused by a firewall hook) between the kernel's accept and ours.
CLIENT_GONE = frozenset({errno.ECONNABORTED, errno.ECONNRESET, errno.EPROTO, errno.EPERM, errno.EINTR,
                         errno.EAGAIN, errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH})
RESP_REFUSAL = b"-ERR max number of clients reached\r\n"
REFUSALS_AT_ONCE = 16  # refusals that wait to say why, at most, at once (within file_limit.RESERVED)
LOG_EVERY_S = 10.0
# Connections accepted in one go from a crowd in the listen backlog before the event loop's other work
# gets a turn: a storm must leave the backlog (somaxconn) faster than it fills, or SYNs are dropped and
# come back only on TCP's retry schedule (1, 3, 7, 15 s...).
ACCEPTS_AT_ONCE = 4096  # (somaxconn here)


class SpareDescriptor:
    """One descriptor held back so that a connection can be accepted, refused and closed when none is left."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.take()

    def take(self) -> None:
        if self.fd is None:
            try:
                self.fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self.fd = None  # none to spare right now: the next shed tries again

    def give_back(self) -> bool:
        """Free the spare for a moment; False if there was none."""
        if self.fd is None:
            return False
        os.close(self.fd)
        self.fd = None
        return True

    def close(self) -> None:
        self.give_back()


class Refusals:
    """Connections being refused right now (past max_connections). A few at a time wait to be told
    why (MQTT's CONNACK needs the client's CONNECT first); past that a newcomer is closed at once,
    so a crowd being refused never holds more than a few descriptors of the reserve."""

    def __init__(self, at_once: int = REFUSALS_AT_ONCE) -> None:
        self.at_once = at_once
        self.now = 0
        self.refused = 0  # connections refused past max_connections, since the worker started
        self._logged_at, self._logged = 0.0, 0

    def _note(self) -> None:
        """One more refusal; said in the log at most every LOG_EVERY_S (a crowd being refused is one line)."""
        self.refused += 1
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY_S:
            log.warning("max_connections reached: refused %d connection(s) since the last report (connections "
                        "still ending count until their end is done; raise max_connections and the open-file "
                        "limit, or add workers)", self.refused - self._logged)
            self._logged_at, self._logged = now, self.refused

    def take(self) -> bool:
        """A place for a refusal that says why (False: close it at once); :meth:`give` it back."""
        self._note()
        if self.now >= self.at_once:
            return False
        self.now += 1
        return True

    def give(self) -> None:
        self.now -= 1

    @contextmanager
    def told(self) -> Iterator[bool]:
        """Whether this refusal may take the time to say why (and then holds a place while it does)."""
        self._note()
        if self.now >= self.at_once:
            yield False
            return
        self.now += 1
        try:
            yield True
        finally:
            self.now -= 1


class SheddingListener(Listener[SocketStream]):
    """A TCP listener whose ``serve`` sheds connections it has no descriptor for, and goes on."""

    def __init__(self, listener: Listener[SocketStream], spare: SpareDescriptor, refusal: bytes = b"") -> None:
        self.listener = listener
        self.spare = spare
        self.refusal = refusal  # what a shed client is told (empty: a close, for protocols with a handshake first)
        self.shed = 0  # connections shed for want of a descriptor
        self._logged_at = -LOG_EVERY_S
        self._logged_shed = 0

    @property
    def extra_attributes(self) -> Mapping[Any, Callable[[], Any]]:
        return self.listener.extra_attributes

    async def accept(self) -> SocketStream:  # pragma: no cover - serve() is what the worker uses
        return await self.listener.accept()  # type: ignore[attr-defined]

    async def aclose(self) -> None:
        await self.listener.aclose()

    async def serve(self, handler: Callable[[SocketStream], Any], task_group: TaskGroup | None = None) -> None:
        async with AsyncExitStack() as stack:
            if task_group is None:
                task_group = await stack.enter_async_context(anyio.create_task_group())
            while True:
                stream = await self._accept_one(self.listener.accept)  # type: ignore[attr-defined]
                if stream is not None:
                    task_group.start_soon(handler, stream)

    async def serve_sockets(self, handler: Callable[[socket.socket, Any], Awaitable[None]]) -> None:
        """Accept bare sockets (non-blocking, TCP_NODELAY) and ``await handler(sock, address)`` for each:
        for a door that makes its own transport (fencemq.server.connection)."""
        raw: socket.socket = self.listener.extra(SocketAttribute.raw_socket)
        loop = asyncio.get_running_loop()

        async def accept() -> tuple[socket.socket, Any]:
            try:
                # a crowd waiting to be accepted (a storm) is taken without a readiness round each
                sock, address = raw.accept()
                sock.setblocking(False)
                return sock, address
            except BlockingIOError:
                pass
            try:
                return await loop.sock_accept(raw)
            except asyncio.CancelledError:
                with contextlib.suppress(ValueError, NotImplementedError):
                    loop.remove_reader(raw)  # (bpo-41317: a cancelled sock_accept may leave its reader)
                raise

        taken = 0
        while True:
            accepted = await self._accept_one(accept)
            if accepted is not None:
                sock, address = accepted
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                await handler(sock, address)
                taken += 1
                if taken % ACCEPTS_AT_ONCE == 0:
                    # a handler that does not wait (MQTT's admission) leaves the loop to others now and then
                    await anyio.lowlevel.checkpoint()

    async def serve_sockets_threaded(self, handler: Callable[[socket.socket, Any], Awaitable[None]]) -> None:
        """:meth:`serve_sockets`, the accepting done by a thread of its own, for a door whose handler never
        waits (MQTT's: it only counts the connection and queues it for its turn, server/admission.py).

        In a reconnect storm the event loop's first turns after the drop are long (thousands of
        connections ending at once), and a loop that accepts once a turn leaves the kernel's listen
        backlog full meanwhile: a SYN that finds it full is dropped, and the client sends it again
        only 1, 3, 7, 15 s later (10,000 devices on a worker waited 9-16 s at the median for that
        while the worker spent 5 s of CPU). The thread empties the backlog as the SYNs come (it waits
        for the GIL a switch interval at most: ``sys.getswitchinterval()``, 5 ms) and hands the sockets
        to the loop, which runs ``handler`` for each. Running out of descriptors is left to the loop
        (:meth:`_shed_one`), the thread pausing meanwhile."""
        raw: socket.socket = self.listener.extra(SocketAttribute.raw_socket)
        loop = asyncio.get_running_loop()
        taken: deque[tuple[socket.socket, Any]] = deque()  # (appended by the thread, taken by the loop)
        failed: deque[OSError] = deque()
        ready = asyncio.Event()
        stop = threading.Event()
        going = threading.Event()  # cleared while the loop sheds for want of descriptors
        going.set()

        def accepting() -> None:
            poller = select.poll()
            poller.register(raw.fileno(), select.POLLIN)
            while not stop.is_set():
                if not going.wait(0.1) or not poller.poll(100) or stop.is_set():
                    continue
                got = 0
                while got < ACCEPTS_AT_ONCE:
                    try:
                        sock, address = raw.accept()
                    except BlockingIOError:
                        break
                    except OSError as exc:
                        if exc.errno in CLIENT_GONE:
                            continue
                        failed.append(exc)  # out of descriptors (or the listener closed): the loop's to handle
                        going.clear()
                        break
                    sock.setblocking(False)
                    with contextlib.suppress(OSError):
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    taken.append((sock, address))
                    got += 1
                if got or failed:
                    try:
                        loop.call_soon_threadsafe(ready.set)
                    except RuntimeError:  # the loop is closed: nobody to hand them to
                        return

        thread = threading.Thread(target=accepting, name="fencemq-accept", daemon=True)
        thread.start()
        handed = 0
        try:
            while True:
                await ready.wait()
                ready.clear()
                while taken:
                    sock, address = taken.popleft()
                    await handler(sock, address)
                    handed += 1
                    if handed % ACCEPTS_AT_ONCE == 0:
                        await anyio.lowlevel.checkpoint()
                while failed:
                    exc = failed.popleft()
                    if exc.errno in OUT_OF_DESCRIPTORS:
                        await self._shed_one()
                    else:
                        raise exc
                going.set()
        finally:
            stop.set()
            going.set()
            while taken:  # accepted, never handed over: closed
                taken.popleft()[0].close()

    async def _accept_one(self, accept: Callable[[], Awaitable[Any]]) -> Any:
        """One accepted connection, or None when there was none to take (shed, or gone before it was)."""
        try:
            return await accept()
        except OSError as exc:
            if exc.errno in OUT_OF_DESCRIPTORS:
                await self._shed_one()
            elif exc.errno not in CLIENT_GONE:
                raise
            return None

    async def _shed_one(self) -> None:
        raw: socket.socket = self.listener.extra(SocketAttribute.raw_socket)
        freed = self.spare.give_back()
        try:
            conn, _ = raw.accept()
        except OSError:
            conn = None  # none left even so (the whole system is out), or the client is gone
        if conn is not None:
            self.shed += 1
            with conn:
                conn.setblocking(False)
                try:
                    if self.refusal:
                        conn.send(self.refusal)  # a fresh socket's send buffer is empty: never blocks
                except OSError:
                    pass
        self.spare.take()
        self._log()
        if conn is None or not freed:
            # Nothing could be done for the client this time: let descriptors come free before the
            # listener (still readable) is tried again, rather than spin.
            await anyio.sleep(0.05)
        else:
            await anyio.lowlevel.checkpoint()

    def _log(self) -> None:
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY_S:
            log.warning("out of open files: shed %d connection(s) since the last report (raise the limit, "
                        "lower max_connections, or look for what holds descriptors)", self.shed - self._logged_shed)
            self._logged_at, self._logged_shed = now, self.shed


def shedding(listener: Any, spare: SpareDescriptor, refusal: bytes = b"") -> Listener[SocketStream]:
    """``listener`` (one from ``anyio.create_tcp_listener``) with each of its sockets shedding."""
    if isinstance(listener, MultiListener):
        return MultiListener([SheddingListener(one, spare, refusal) for one in listener.listeners])
    return SheddingListener(listener, spare, refusal)


async def serve_sockets(listener: Any, handler: Callable[[socket.socket, Any], Awaitable[None]], *,
                        threaded: bool = False) -> None:
    """:meth:`SheddingListener.serve_sockets` on every socket of a :func:`shedding` listener
    (``threaded``: :meth:`SheddingListener.serve_sockets_threaded`, for a handler that never waits)."""
    listeners = listener.listeners if isinstance(listener, MultiListener) else [listener]
    async with anyio.create_task_group() as tg:
        for one in listeners:
            tg.start_soon(one.serve_sockets_threaded if threaded else one.serve_sockets, handler)
