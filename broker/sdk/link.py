"""One socket to one worker: HELLO, the pipelined write FIFO, the reader, push frames.

A client (fencemq.sdk.connection) holds one current link, and while it moves off a
draining worker, older links whose replies are still coming. A link knows nothing of
reconnecting: it reads replies into the futures of its calls, hands push frames to
its client, and when the socket goes it hands back every call still unanswered.
How and why: docs/sdk.md, "How the client works".
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import socket
from collections.abc import Callable
from typing import Any, ClassVar

import redis.exceptions
from redis._parsers import _AsyncRESP3Parser
from redis.asyncio.connection import AbstractConnection, Connection
from redis.exceptions import ResponseError

from fencemq.errors import FenceMQError, from_reply
from fencemq.sdk.reconnect import Target
from fencemq.sdk.replies import ConnectionLost, _notice

try:  # hiredis >= 3.2 marks push frames; older versions would hand them over as replies
    import hiredis
    from redis._parsers import _AsyncHiredisParser

    HIREDIS = hasattr(hiredis, "PushNotification")
except ImportError:  # pragma: no cover - hiredis is a dependency
    HIREDIS = False

# Newer redis-py takes driver_info (None: no CLIENT SETINFO) and deprecates lib_name/lib_version.
_NO_SETINFO: dict[str, Any] = (
    {"driver_info": None} if "driver_info" in inspect.signature(AbstractConnection.__init__).parameters
    else {"lib_name": None, "lib_version": None}
)
# Newer redis-py turns on "maintenance notifications" by itself (CLIENT MAINT_NOTIFICATIONS): off,
# a worker answers with its own draining notice.
_NO_MAINTENANCE: dict[str, Any] = (
    {"maint_notifications_config": None}
    if "maint_notifications_config" in inspect.signature(AbstractConnection.__init__).parameters else {}
)

PUSHED = object()  # what the parser returns for a push frame: "not a reply, read on"
_MORE = object()  # what the link's own hiredis reader returns when a reply is not whole yet
READ_SIZE = 65536  # bytes asked of the socket at a time (redis-py's default)

# TCP keepalive: probes after 5 s of silence, every 2 s, 5 unanswered ones drop the connection
KEEPALIVE: dict[int, int] = {opt: value for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2),
                                                              ("TCP_KEEPCNT", 5))
                             if (opt := getattr(socket, name, None)) is not None}


def _parser_class(protocol: int) -> type:
    base: type = _AsyncHiredisParser if HIREDIS else _AsyncRESP3Parser
    if not HIREDIS and protocol == 2:
        from redis._parsers import _AsyncRESP2Parser

        base = _AsyncRESP2Parser

    class _Parser(base):  # type: ignore[misc, valid-type]
        # Every error reply stays a plain ResponseError carrying the whole line.
        EXCEPTION_CLASSES: ClassVar[dict] = {}
        on_push: Callable[[Any], None] | None = None

        async def handle_push_response(self, response: Any, *args: Any, **kwargs: Any) -> Any:
            if self.on_push is not None:
                self.on_push(response)
            return PUSHED

    return _Parser


class Call:
    """One command: its frame, how its reply is read, who waits for it, whether it may go out again."""

    __slots__ = ("packed", "convert", "future", "resend", "generation", "sends")

    def __init__(self, packed: list[bytes], convert: Callable[[Any], Any] | None, future: asyncio.Future[Any],
                 resend: bool, generation: int | None) -> None:
        self.packed = packed
        self.convert = convert
        self.future = future
        self.resend = resend  # safe to send again when its reply was lost with a connection
        self.generation = generation  # the session generation it acts in (None: any)
        self.sends = 0  # connections it went out on


class Link:
    """One connection to one worker. ``on_push(link, frame)`` gets each push frame; ``on_lost(link,
    calls, exc)`` gets the calls left unanswered when the connection ends, once."""

    _numbers = iter(range(1, 1 << 62))
    # Replies are read by the link's own hiredis reader (``_read_own``) where hiredis marks push frames;
    # else (and in the tests that hold the two to each other) by redis-py's ``read_response``.
    own_reader: bool = HIREDIS

    def __init__(self, target: Target, protocol: int, connect_timeout: float | None,
                 on_push: Callable[[Link, Any], None],
                 on_lost: Callable[[Link, list[Call], ConnectionLost], None],
                 on_idle: Callable[[Link], None]) -> None:
        self.target = target
        self.number = next(self._numbers)  # links made later have larger numbers: wire order across links
        settings = dict(target.settings)
        conn_class = settings.pop("connection_class", Connection)
        if issubclass(conn_class, Connection) and "socket_keepalive" not in settings:
            # A worker whose host vanishes without a reset (powered off, cut off) is noticed by TCP
            # keepalive within ~15 s; a reply may take as long as a BLOCK, so no read timeout can.
            settings.update(socket_keepalive=True, socket_keepalive_options=KEEPALIVE)
        self.conn = conn_class(
            **settings,
            protocol=protocol,
            **_NO_SETINFO,
            **_NO_MAINTENANCE,
            socket_timeout=None,  # a reply may take as long as a BLOCK: no read timeout
            socket_connect_timeout=connect_timeout,
            parser_class=_parser_class(protocol),
            redis_connect_func=self._arm_parser,
        )
        self.pending: collections.deque[Call] = collections.deque()
        self.out: list[bytes] = []
        self.flush_scheduled = False
        self.held = False  # frames wait (an older link's replies are still coming): wire order across links
        self.draining = False  # its worker asked clients to move: nothing new goes out here
        self.closing = False  # closed by the client: its end is no loss
        self.lost: ConnectionLost | None = None
        self.wlock = asyncio.Lock()
        self.hello: dict[str, Any] = {}
        self._on_push, self._on_lost, self._on_idle = on_push, on_lost, on_idle
        self._reader: asyncio.Task[None] | None = None
        self._hiredis: Any = None  # the link's own reply reader (own_reader)
        self._loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"<Link {self.number} to {self.target.name}>"

    @staticmethod
    def _arm_parser(conn: Connection) -> None:
        conn._parser.on_connect(conn)  # what redis-py's own on_connect does first; we send HELLO ourselves

    @property
    def usable(self) -> bool:
        return self.lost is None and not self.draining and not self.closing

    async def open(self, hello: list[Any]) -> dict[str, Any]:
        """Connect, send ``hello`` and read its reply before anything else; start reading.

        Raises ConnectionLost (refused, timed out, closed before the reply) or the error HELLO
        was answered with."""
        self._loop = asyncio.get_running_loop()
        conn = self.conn
        conn._parser.on_push = lambda frame: self._on_push(self, frame)
        try:
            await conn.connect()
        except redis.exceptions.RedisError as exc:  # refused, timed out, TLS...: the builtin kind too
            raise ConnectionLost(f"cannot connect to {self.target.name}: {exc}") from exc
        if self.own_reader:
            # Every byte this connection receives goes through this reader: redis-py's parser
            # (armed at connect) is never fed, so nothing it buffered can be lost between the two.
            self._hiredis = hiredis.Reader(protocolError=redis.exceptions.InvalidResponse,
                                           replyError=ResponseError, notEnoughData=_MORE)
        # In RESP3 the deliveries are asked for as flat arrays (docs/protocol.md, "Deliveries"), in the
        # same write: hiredis builds a map ~5x slower. A worker that does not know CLIENT DELIVERIES
        # refuses it and sends maps, which the SDK reads as well.
        flat = self.conn.protocol in (3, "3")

        async def reply() -> Any:  # the next reply, push frames handed on
            if not self.own_reader:
                while (raw := await conn.read_response(disable_decoding=True, push_request=True)) is PUSHED:
                    pass
                return raw
            while type(raw := await self._next()) is hiredis.PushNotification:
                self._on_push(self, raw)
            if type(raw) is ResponseError:
                raise raw
            return raw

        try:
            packed = conn.pack_command(*hello)
            if flat:
                packed += conn.pack_command("CLIENT", "DELIVERIES", "FLAT")
            await conn.send_packed_command(packed, check_health=False)
            raw = await reply()
            if flat:
                with contextlib.suppress(ResponseError):
                    await reply()
        except ResponseError as exc:
            await conn.disconnect()
            raise from_reply(str(exc)) from None
        except (redis.exceptions.ConnectionError, OSError, ConnectionLost) as exc:
            # e.g. a worker that wants a client certificate closes after the TLS handshake
            await conn.disconnect()
            raise ConnectionLost(f"{self.target.name} closed the connection before HELLO was answered: {exc}") from exc
        except BaseException:
            await conn.disconnect()
            raise
        self.hello = _notice(raw)
        self._reader = self._loop.create_task(self._read_loop(), name=f"fencemq-reader-{self.target.name}")
        return self.hello

    # -- writing: FIFO order is wire order -------------------------------------------------

    async def flow_control(self) -> None:
        """Wait for the transport's room (a caller cancelled here has queued nothing)."""
        writer = self.conn._writer
        if writer is not None and self.lost is None:
            try:
                await writer.drain()
            except (ConnectionError, OSError) as exc:
                self.fail(ConnectionLost(f"connection to {self.target.name} lost: {exc}"))

    def submit(self, call: Call) -> None:
        """Queue a call's frame (nothing here suspends); it leaves with the next flush."""
        call.sends += 1
        self.pending.append(call)
        self.out.extend(call.packed)
        self._schedule_flush()

    def submit_first(self, calls: list[Call]) -> None:
        """Put calls ahead of every other (only while held: nothing of this link is on the wire)."""
        assert self.held or not self.pending, "calls put first on a link whose frames already left"
        self.pending.extendleft(reversed(calls))
        self.out[:0] = [frame for call in calls for frame in call.packed]
        self._schedule_flush()

    def release(self) -> None:
        """The older links are done: what waited here goes out."""
        self.held = False
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self.flush_scheduled and self._loop is not None:
            self.flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self.flush_scheduled = False
        if self.held:
            return
        out, self.out = self.out, []
        writer = self.conn._writer
        if out and writer is not None and self.lost is None:
            writer.writelines(out)

    # -- reading ------------------------------------------------------------------------

    async def _next(self) -> Any:
        """The next whole reply or push frame off the socket, through the link's own reader."""
        gets = self._hiredis.gets
        while (raw := gets(False)) is _MORE:
            data = await self.conn._reader.read(READ_SIZE)
            if not data:
                raise ConnectionLost(f"{self.target.name} closed the connection")
            self._hiredis.feed(data)
        return raw

    async def _read_loop(self) -> None:
        """Read replies into their calls' futures, push frames to the client, until the socket goes."""
        try:
            await (self._read_own() if self.own_reader else self._read_through_redis_py())
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001
            lost = exc if isinstance(exc, ConnectionLost) else \
                ConnectionLost(f"connection to {self.target.name} lost: {exc or type(exc).__name__}")
            self.fail(lost)

    async def _read_own(self) -> None:
        """Through the link's own hiredis reader: every reply already in its buffer is answered with
        no await between (redis-py's read_response is four coroutines, a timeout check and a host
        string a reply); each call gets what :meth:`_read_through_redis_py` gives it."""
        stream, reader, answer = self.conn._reader, self._hiredis, self._answer
        gets, feed, push = reader.gets, reader.feed, hiredis.PushNotification
        while True:
            raw = gets(False)
            if raw is _MORE:
                data = await stream.read(READ_SIZE)
                if not data:
                    raise ConnectionLost(f"connection to {self.target.name} lost: the worker closed it")
                feed(data)
            elif type(raw) is push:
                self._on_push(self, raw)
            elif type(raw) is ResponseError:
                answer(None, from_reply(str(raw)))
            else:
                answer(raw, None)

    async def _read_through_redis_py(self) -> None:
        conn = self.conn
        while True:
            try:
                raw = await conn.read_response(disable_decoding=True, push_request=True)
            except ResponseError as exc:
                self._answer(None, from_reply(str(exc)))
                continue
            if raw is not PUSHED:
                self._answer(raw, None)

    def _answer(self, raw: Any, error: BaseException | None) -> None:
        """The oldest call unanswered gets this reply (converted) or error."""
        pending = self.pending
        if not pending:
            raise ConnectionLost(f"reply without a request: {raw or error!r:.100}")
        call = pending.popleft()
        if error is None and call.convert is not None:
            try:
                raw = call.convert(raw)  # runs even if the caller went away: epochs must advance
            except Exception as exc:  # noqa: BLE001 - a bad reply fails its own call only
                error = exc if isinstance(exc, FenceMQError) else FenceMQError(f"bad reply: {exc!r}")
        if not call.future.done():
            if error is not None:
                call.future.set_exception(error)
            else:
                call.future.set_result(raw)
        if not pending and self.draining:
            self._on_idle(self)

    def fail(self, exc: ConnectionLost) -> None:
        """The connection is gone: hand every unanswered call back, once, and let go of the socket."""
        if self.lost is not None:
            return
        self.lost = exc
        calls = list(self.pending)
        self.pending.clear()
        self.out = []
        with contextlib.suppress(Exception):
            self.conn._writer and self.conn._writer.transport.abort()  # type: ignore[union-attr]
        if self._reader is not None and self._reader is not asyncio.current_task() and not self._reader.done():
            self._reader.cancel()
        self._on_lost(self, calls, exc)

    async def close(self) -> None:
        """Close it on purpose (its calls, if any, are handed back as lost)."""
        self.closing = True
        reader = self._reader
        if reader is not None and not reader.done():
            reader.cancel()
            await asyncio.wait([reader])  # its own end is not the closer's error
        self.fail(ConnectionLost("connection closed by the client"))
        with contextlib.suppress(Exception):
            await self.conn.disconnect(nowait=True)
