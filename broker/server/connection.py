"""One RESP client connection: an asyncio protocol that holds no task while its client is idle.

The event loop reads: each read lands in the buffer all connections share (fencemq.server.reading)
and is fed to the request reader (fencemq.protocol.request_reader,
no I/O). A task runs only while there are requests to answer: it runs them (fencemq.server.pipeline,
for the session they act for: fencemq.server.session), writes the replies, lingers a moment for the
next request of a busy client, and ends. An idle connection is its transport, this object, its
reader and its session; its timers (idle, request, authentication) are the event loop's handles.

While a verb waits (a long poll) reading goes on: a hang-up cancels the wait at once, and what the
client sends meanwhile is buffered up to ``max_read_ahead``, then reading pauses and TCP holds the
client back. Replies and pushes are written whole to the transport; a client that leaves them unread
past the transport's high-water mark for ``output_timeout_ms`` is closed, as Redis'
client-output-buffer-limit does, and a push it has no room for stays queued for HEARTBEAT.
Whatever fails inside one connection closes that connection only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import anyio

from fencemq.errors import FenceMQError
from fencemq.fences.redis_errors import REDIS_FAILURES
from fencemq.protocol.request_reader import RequestReader
from fencemq.protocol.resp import ErrorReply, Push, RequestError, RequestTooLarge, encode_many
from fencemq.server import reading
from fencemq.server.gate import Pass
from fencemq.server.long_poll import ClientGone
from fencemq.server.pipeline import Pipeline
from fencemq.server.services import Services
from fencemq.server.session import Session
from fencemq.server.verbs import Verbs

log = logging.getLogger(__name__)

# Commands parsed and run in one go: the replies of one batch are one write, so
# this bounds what a pipelining client makes the worker hold for it at once.
MAX_PIPELINE = 256
LINGER_S = 0.25  # a task that answered waits this long for the client's next request before it ends
PUSH_ROOM = 256 * 1024  # bytes unread by the client past which a push waits for HEARTBEAT instead
FAREWELL_S = 1.0  # what is written last (a farewell notice) has this long to leave before the socket is cut


class ClientConnection(Pipeline, asyncio.BufferedProtocol):
    __slots__ = ("services", "config", "gate", "verbs", "token", "session", "parser", "transport", "_spawn",
                 "_on_closed", "_preauth", "_busy", "_scope", "_hangup", "_more", "_write_room", "_reading_paused",
                 "_lost", "_eof", "_ending", "_auth_timer", "_idle_timer", "_drain_timer", "_request_timer",
                 "_last_read")

    def __init__(self, services: Services, verbs: Verbs, token: str, gate_pass: Pass, *,
                 addresses: tuple[str, str], spawn: Callable[..., None],
                 on_closed: Callable[[ClientConnection], None]) -> None:
        self.services, self.config, self.gate, self.verbs, self.token = (
            services, services.config, services.gate, verbs, token)
        self._spawn = spawn  # starts a task in the worker's group of connections
        self._on_closed = on_closed  # the worker's bookkeeping, once the connection is closed
        self.transport: asyncio.Transport | None = None
        self.session = Session(services, token, watch_for_hangup=self._watch_for_hangup, end_connection=self.cut,
                               addresses=addresses, gate_pass=gate_pass, push=self._push)
        # The parser's limits only guard memory (the connection is closed past
        # them); payload and batch limits are checked per command, so a client
        # that sends one oversize payload gets LIMIT and keeps its connection.
        self.parser = RequestReader(max_bulk=self.config.frame_bulk_limit, max_args=self.config.frame_args_limit)
        self._preauth = False
        self._set_frame_limits()
        self._busy = False  # a task is answering this client's requests
        self._scope: anyio.CancelScope | None = None  # that task's: cut() cancels what is in hand
        self._hangup: anyio.CancelScope | None = None  # a verb's wait, which the client hanging up ends
        self._more: asyncio.Future[bool] | None = None  # the lingering task waits on it for the next request
        self._write_room: asyncio.Event | None = None  # while the client leaves our writes unread
        self._reading_paused = False
        self._lost = self._eof = self._ending = False
        self._auth_timer: asyncio.TimerHandle | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        self._drain_timer: asyncio.TimerHandle | None = None
        self._request_timer: asyncio.TimerHandle | None = None
        self._last_read = 0.0

    # -- the event loop's side -----------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        loop = asyncio.get_running_loop()
        if not self.session.authed and self.gate.auth_timeout_s is not None:
            self._auth_timer = loop.call_later(self.gate.auth_timeout_s, self._auth_expired)
        if self.gate.idle_timeout_s != float("inf"):
            self._last_read = time.monotonic()
            self._idle_timer = loop.call_later(self.gate.idle_timeout_s, self._idle_check)

    def get_buffer(self, sizehint: int) -> memoryview:
        return reading.buffer()

    def buffer_updated(self, nbytes: int) -> None:
        parser = self.parser
        parser.feed(reading.received(nbytes))
        if self._idle_timer is not None:
            self._last_read = time.monotonic()
        if parser.mid_request:
            if self._request_timer is None and self.gate.request_timeout_s != float("inf"):
                self._request_timer = asyncio.get_running_loop().call_later(self.gate.request_timeout_s,
                                                                            self._request_expired)
        elif self._request_timer is not None:
            self._request_timer.cancel()
            self._request_timer = None
        if self._busy:
            more = self._more
            if more is not None and not more.done():
                more.set_result(True)
        elif not self._ending:
            commands, fatal = self._parsed()
            if commands or fatal is not None:
                self._busy = True
                self._spawn(self._serve, commands, fatal)
        if parser.buffered >= self.config.max_read_ahead and not self._reading_paused and self.transport is not None:
            # past the budget (what the client sends while its commands wait): the socket's own
            # back-pressure holds the client back
            self.transport.pause_reading()
            self._reading_paused = True

    def eof_received(self) -> bool:
        """The client will send no more: what it sent is answered, then the connection closes."""
        self._eof = True
        if self._hangup is not None:  # a verb waiting for it: it is gone (as a hang-up)
            self._client_gone()
        elif not self._busy:
            self._begin_close()
        # keep writing what is being answered (TLS cannot half-close: asyncio closes it anyway)
        return self.transport is None or self.transport.get_extra_info("sslcontext") is None

    def connection_lost(self, exc: BaseException | None) -> None:
        self._lost = True
        self._client_gone()
        room = self._write_room
        if room is not None:
            room.set()
        if not self._busy:
            self._begin_close()

    def pause_writing(self) -> None:
        if self._write_room is None:
            self._write_room = asyncio.Event()

    def resume_writing(self) -> None:
        room, self._write_room = self._write_room, None
        if room is not None:
            room.set()

    def _client_gone(self) -> None:
        self.session.closing = self.session.gone = True
        if self._hangup is not None:
            self._hangup.cancel()

    def _watch_for_hangup(self, scope: anyio.CancelScope | None) -> None:
        """The session's hook: while a verb waits, a hang-up cancels ``scope``."""
        self._hangup = scope
        if scope is not None and (self._lost or self._eof):
            self._client_gone()

    # -- timers --------------------------------------------------------------------------------

    def _auth_expired(self) -> None:
        """A connection that never authenticates holds nothing for long (slowloris)."""
        if not self.session.authed:
            log.info("closing %s: not authenticated within %d ms", self.session.peer, self.config.auth_timeout_ms)
            self.cut()

    def _idle_check(self) -> None:
        idle_s = self.gate.idle_timeout_s
        left = self._last_read + idle_s - time.monotonic()
        if self._busy or left > 0 or self.parser.mid_request:
            self._idle_timer = asyncio.get_running_loop().call_later(idle_s if self._busy else max(left, 0.05),
                                                                     self._idle_check)
            return
        log.info("closing %s: idle for %d ms", self.session.peer, self.config.idle_timeout_ms)
        self.cut()

    def _request_expired(self) -> None:
        self._request_timer = None
        if self.parser.mid_request and not self._busy:
            log.info("closing %s: a request unfinished for %d ms", self.session.peer, self.config.request_timeout_ms)
            self.cut()
        elif self.parser.mid_request:  # timed again from when the requests in hand are answered
            self._request_timer = asyncio.get_running_loop().call_later(self.gate.request_timeout_s,
                                                                        self._request_expired)

    # -- answering -----------------------------------------------------------------------------

    def _set_frame_limits(self) -> None:
        """Tiny frames until the connection authenticates (again, after a RESET)."""
        preauth = not self.session.authed
        if preauth != self._preauth:
            self._preauth = preauth
            config = self.config
            if preauth:
                self.parser.set_limits(max_bulk=config.preauth_max_bulk, max_args=config.preauth_max_args)
            else:
                self.parser.set_limits(max_bulk=config.frame_bulk_limit, max_args=config.frame_args_limit)

    def _parsed(self) -> tuple[list[list[bytes]], RequestError | None]:
        """The next batch of complete commands (and a fatal framing error, if one came); reading
        resumes if it paused and the reader has room again."""
        # Before authentication one command at a time: what follows an AUTH is
        # read with the limits that AUTH's outcome sets.
        most = 1 if self._preauth else MAX_PIPELINE
        commands: list[list[bytes]] = []
        fatal: RequestError | None = None
        try:
            while len(commands) < most and (cmd := self.parser.gets()) is not None:
                commands.append(cmd)
        except RequestError as exc:
            if self._preauth and isinstance(exc, RequestTooLarge):
                exc = RequestError(f"NOAUTH before authentication a frame holds at most "
                                   f"{self.config.preauth_max_args} arguments of at most "
                                   f"{self.config.preauth_max_bulk} bytes; authenticate first")
            fatal = exc
        if self._reading_paused and self.parser.buffered < self.config.max_read_ahead // 2 and fatal is None:
            self._reading_paused = False
            if self.transport is not None and not self._lost:
                self.transport.resume_reading()
        return commands, fatal

    async def _serve(self, commands: list[list[bytes]], fatal: RequestError | None) -> None:
        session = self.session
        scope = self._scope = anyio.CancelScope()
        try:
            with scope:
                while True:
                    await self._answer(commands, fatal)
                    if session.closing or self._lost:
                        return
                    commands, fatal = self._parsed()
                    if commands or fatal is not None:
                        # A client that keeps its buffer full (PINGs, say) must not keep the event loop
                        # from every other connection while it lasts.
                        await anyio.lowlevel.checkpoint()
                        continue
                    if self._eof or not await self._next_request():
                        return
                    commands, fatal = self._parsed()
        except Exception:  # one connection's failure must never take the worker down
            log.exception("connection %s failed; closing it", self.token)
            session.closing = True
        finally:
            self._busy = False
            self._scope = None
            if session.closing or self._lost or self._eof:
                self._begin_close()

    async def _next_request(self) -> bool:
        """Linger for the client's next request; False if none came (the task ends, the connection idles)."""
        loop = asyncio.get_running_loop()
        more = self._more = loop.create_future()
        timer = loop.call_later(LINGER_S, _settle, more, False)
        try:
            return await more
        finally:
            timer.cancel()
            self._more = None

    async def _answer(self, commands: list[list[bytes]], fatal: RequestError | None) -> None:
        session = self.session
        try:
            replies = await self.execute(commands) if commands else []
        except ClientGone:
            session.closing = True
            return
        if fatal is not None:
            replies.append(ErrorReply(fatal.message))
            session.closing = True
        self._set_frame_limits()
        if replies:
            await self._write(encode_many(replies, session.proto))

    async def _write(self, data: bytes) -> None:
        transport = self.transport
        if self._lost or transport is None or transport.is_closing():
            self.session.closing = self.session.gone = True
            return
        transport.write(data)
        room = self._write_room
        if room is None:
            return
        with anyio.move_on_after(self.gate.output_timeout_s) as waited:
            await room.wait()
        if waited.cancelled_caught:
            # The client has not read its earlier replies for output_timeout_ms: as
            # Redis' client-output-buffer-limit, close it rather than hold more for it.
            log.info("closing %s: it has not read its replies for %d ms", self.session.peer,
                     self.config.output_timeout_ms)
            self.session.closing = self.session.gone = True

    def _push(self, push: Push) -> bool:
        """The session's hook: a push frame goes out now, unless the client leaves too much unread."""
        transport = self.transport
        if self._lost or self._ending or transport is None or transport.get_write_buffer_size() > PUSH_ROOM:
            return False
        transport.write(encode_many([push], 3))
        return True

    # -- ending --------------------------------------------------------------------------------

    def drain(self, notice: dict[str, Any] | None = None, move_s: float = 0.0) -> None:
        """The worker is shutting down: long polls answer now; finish the commands in hand, then close.

        A RESP3 client is told first (``notice``, a ``draining`` push) and served on for ``move_s``, so
        a client that moves (the SDK) opens its next connection and collects its replies here before
        this one closes; a RESP2 client, which cannot be told, is closed once idle.
        """
        self.session.drain()
        if notice is not None and self.session.proto == 3 and move_s > 0 and not self._ending:
            self.session.tell(notice)  # a client with no room for it: the close tells it instead
            self._drain_timer = asyncio.get_running_loop().call_later(move_s, self._close_when_idle)
            return
        self._close_when_idle()

    def _close_when_idle(self) -> None:
        self.session.closing = True
        if not self._busy:
            self._begin_close()

    def cut(self) -> None:
        """Close now, whatever is in hand."""
        self.session.closing = True
        if self._scope is not None:
            self._scope.cancel()  # the task ends, then closes
        elif not self._busy:
            self._begin_close()

    def _begin_close(self) -> None:
        if self._ending:
            return
        self._ending = True
        for timer in (self._auth_timer, self._idle_timer, self._drain_timer, self._request_timer):
            if timer is not None:
                timer.cancel()
        self._spawn(self._close)

    async def _close(self) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await self.session.release()
            except (*REDIS_FAILURES, FenceMQError) as exc:  # out of open files, Redis gone, the worker stopping
                log.warning("cleanup of %s failed, its lease will expire: %s", self.session.client_id, exc)
            except Exception:  # a bug in a cleanup must not stop the worker either
                log.exception("cleanup of %s failed, its lease will expire", self.session.client_id)
            transport = self.transport
            if transport is not None:
                farewell = self.session.farewell
                if farewell is not None and self.session.proto == 3 and not self._lost:
                    # Say why before hanging up (a session taken over), if the client still reads.
                    transport.write(encode_many([farewell], 3))
                transport.close()
                if transport.get_write_buffer_size():
                    asyncio.get_running_loop().call_later(FAREWELL_S, transport.abort)
            self._on_closed(self)


def _settle(future: asyncio.Future[bool], value: bool) -> None:
    if not future.done():
        future.set_result(value)
