"""The SDK's connection: one session over one socket, every concurrent call pipelined on it.

Connecting (HELLO), the write FIFO, the reader task, RESP3 push frames and the
notices they carry; :class:`fencemq.sdk.client.Client` builds the verbs on it.
How and why: docs/sdk.md, "How the client works".
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, ClassVar, Self

import redis.exceptions
from redis._parsers import _AsyncRESP3Parser
from redis.asyncio.connection import AbstractConnection, Connection, parse_url
from redis.exceptions import ResponseError

from fencemq.errors import FenceMQError, SessionTakenOver, from_reply
from fencemq.sdk.replies import ConnectionLost, _notice, _str, _tree

try:  # hiredis >= 3.2 marks push frames; older versions would hand them over as replies
    import hiredis
    from redis._parsers import _AsyncHiredisParser

    _HIREDIS = hasattr(hiredis, "PushNotification")
except ImportError:  # pragma: no cover - hiredis is a dependency
    _HIREDIS = False

log = logging.getLogger(__name__)

DEFAULT_URL = "redis://127.0.0.1:7379"
MAX_QUEUED_NOTICES = 10_000
REMEMBERED_NOTICES = 10_000  # notice ids kept to tell a pushed notice from the same one drained by HEARTBEAT


# Newer redis-py takes driver_info (None: no CLIENT SETINFO) and deprecates lib_name/lib_version.
_NO_SETINFO: dict[str, Any] = (
    {"driver_info": None} if "driver_info" in inspect.signature(AbstractConnection.__init__).parameters
    else {"lib_name": None, "lib_version": None}
)

_PUSHED = object()  # what the parser returns for a push frame: "not a reply, read on"


def _parser_class(protocol: int) -> type:
    base: type = _AsyncHiredisParser if _HIREDIS else _AsyncRESP3Parser
    if not _HIREDIS and protocol == 2:
        from redis._parsers import _AsyncRESP2Parser

        base = _AsyncRESP2Parser

    class _Parser(base):  # type: ignore[misc, valid-type]
        # Every error reply stays a plain ResponseError carrying the whole line.
        EXCEPTION_CLASSES: ClassVar[dict] = {}
        on_push: Callable[[Any], None] | None = None

        async def handle_push_response(self, response: Any, *args: Any, **kwargs: Any) -> Any:
            if self.on_push is not None:
                self.on_push(response)
            return _PUSHED

    return _Parser


# -- the async client -----------------------------------------------------------------


_Entry = tuple["asyncio.Future[Any]", "Callable[[Any], Any] | None"]


class PipelinedConnection:
    """One session over one connection, every concurrent call pipelined on it (docs/sdk.md).

    :class:`fencemq.sdk.client.Client` adds the verbs. ``client_id`` names the session (connections with
    the same id share it; ``takeover=True`` takes it from them instead, and they get
    :class:`~fencemq.errors.SessionTakenOver`); ``on_notice`` is called with each notice, once.
    """

    def __init__(
        self,
        url: str = DEFAULT_URL,
        client_id: str | None = None,
        protocol: int = 3,
        password: str | None = None,
        username: str | None = None,
        *,
        on_notice: Callable[[dict[str, Any]], None] | None = None,
        connect_timeout: float | None = 10.0,
        takeover: bool = False,
    ) -> None:
        if protocol not in (2, 3):
            raise ValueError("protocol must be 2 or 3")
        self.url = url
        self.protocol = protocol
        self.on_notice = on_notice
        self.takeover = takeover  # take the client id's session from the connections that hold it
        self.hello: dict[str, Any] = {}
        kwargs: dict[str, Any] = dict(parse_url(url))
        # The client owns these; a URL's ?client_name= may name the session.
        url_name = kwargs.pop("client_name", None)
        for key in ("protocol", "socket_timeout", "socket_connect_timeout", "lib_name", "lib_version"):
            kwargs.pop(key, None)
        if client_id is None:
            client_id = url_name
        if takeover and client_id is None:
            raise ValueError("takeover needs a client_id: the session to take over")
        self._client_id = client_id
        self._id: str | None = client_id
        self._password = password if password is not None else kwargs.pop("password", None)
        self._username = username if username is not None else kwargs.pop("username", None)
        kwargs.pop("password", None)
        kwargs.pop("username", None)
        kwargs.pop("db", None)  # a worker has one database
        conn_class = kwargs.pop("connection_class", Connection)
        self._conn = conn_class(
            **kwargs,
            protocol=protocol,
            **_NO_SETINFO,
            socket_timeout=None,  # a reply may take as long as a BLOCK: no read timeout
            socket_connect_timeout=connect_timeout,
            parser_class=_parser_class(protocol),
            redis_connect_func=self._arm_parser,
        )
        self._pending: collections.deque[_Entry] = collections.deque()
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self._wlock: asyncio.Lock | None = None
        self._reader: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._broken: ConnectionLost | None = None
        self._closed = False
        self._notices: asyncio.Queue[dict[str, Any] | None] | None = None
        self._seen_notices: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._init_state()

    def _init_state(self) -> None:
        """What a subclass keeps per client (the Client: epochs and subscriptions)."""

    # -- lifecycle ---------------------------------------------------------------

    @classmethod
    async def connect(
        cls,
        url: str = DEFAULT_URL,
        client_id: str | None = None,
        protocol: int = 3,
        password: str | None = None,
        username: str | None = None,
        *,
        on_notice: Callable[[dict[str, Any]], None] | None = None,
        connect_timeout: float | None = 10.0,
        takeover: bool = False,
    ) -> Self:
        """A connected client (the arguments of the constructor)."""
        client = cls(url, client_id, protocol, password, username, on_notice=on_notice,
                     connect_timeout=connect_timeout, takeover=takeover)
        await client.open()
        return client

    @staticmethod
    def _arm_parser(conn: Connection) -> None:
        conn._parser.on_connect(conn)  # what redis-py's own on_connect does first; we send HELLO ourselves

    async def open(self) -> Self:
        """Connect and say HELLO; a no-op when already open."""
        if self._reader is not None:
            return self
        if self._closed:
            raise ConnectionLost("this client was closed; create a new one")
        self._loop = asyncio.get_running_loop()
        self._wlock = asyncio.Lock()
        self._notices = asyncio.Queue()
        conn = self._conn
        conn._parser.on_push = self._on_push
        try:
            await conn.connect()
        except redis.exceptions.RedisError as exc:  # refused, timed out, TLS...: the builtin kind too
            self._closed = True
            raise ConnectionLost(f"cannot connect to {self.url}: {exc}") from exc
        args: list[Any] = ["HELLO", self.protocol]
        if self._password is not None:
            args += ["AUTH", self._username or "default", self._password]
        if self._client_id is not None:
            args += ["SETNAME", self._client_id]
            if self.takeover:
                args.append("TAKEOVER")
        try:
            await conn.send_packed_command(conn.pack_command(*args), check_health=False)
            while (raw := await conn.read_response(disable_decoding=True, push_request=True)) is _PUSHED:
                pass
        except ResponseError as exc:
            await conn.disconnect()
            self._closed = True
            raise from_reply(str(exc)) from None
        except (redis.exceptions.ConnectionError, OSError) as exc:
            # e.g. a worker that wants a client certificate closes after the TLS handshake
            await conn.disconnect()
            self._closed = True
            raise ConnectionLost(f"{self.url} closed the connection before HELLO was answered: {exc}") from exc
        except BaseException:
            await conn.disconnect()
            self._closed = True
            raise
        self.hello = _notice(raw)
        given = self.hello.get("id")
        if self.hello.get("server") == "fencemq" and given or self._id is None and given not in (None, ""):
            self._id = str(given)
        self._reader = self._loop.create_task(self._read_loop(), name=f"fencemq-reader-{self._id}")
        return self

    async def close(self) -> None:
        """Close the connection; calls still pending raise ConnectionLost."""
        if self._closed:
            return
        self._closed = True
        reader = self._reader
        if reader is not None and not reader.done():
            reader.cancel()
            await asyncio.wait([reader])  # its own end is not the closer's error
        self._fail(ConnectionLost("client closed"))
        with contextlib.suppress(Exception):
            await self._conn.disconnect(nowait=True)

    async def __aenter__(self) -> Self:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def id(self) -> str | None:
        """The session's client id: the one given, else the worker's (known after HELLO or the first SUB)."""
        return self._id

    @property
    def closed(self) -> bool:
        return self._closed or self._broken is not None

    # -- the multiplexer ---------------------------------------------------------------

    def _flush(self) -> None:
        self._flush_scheduled = False
        out, self._out = self._out, []
        writer = self._conn._writer
        if out and writer is not None and self._broken is None:
            writer.writelines(out)

    async def _call(self, args: Iterable[Any], convert: Callable[[Any], Any] | None = None) -> Any:
        """Send one command and await its reply (decoded by ``convert`` in the reader)."""
        if self._broken is not None:
            raise self._broken
        if self._reader is None:
            raise ConnectionLost("client is not connected; use `await Client.connect(...)`")
        packed = self._pack(args)
        fut: asyncio.Future[Any] = self._loop.create_future()  # type: ignore[union-attr]
        writer = self._conn._writer
        async with self._wlock:  # type: ignore[union-attr]
            # Flow control first: cancelling a caller here has queued nothing.
            if writer is not None:
                try:
                    await writer.drain()
                except (ConnectionError, OSError) as exc:
                    self._fail(ConnectionLost(f"connection lost: {exc}"))
            if self._broken is not None:
                raise self._broken
            # From here on nothing suspends: FIFO order is wire order.
            self._pending.append((fut, convert))
            self._out.extend(packed)
            if not self._flush_scheduled:
                self._flush_scheduled = True
                self._loop.call_soon(self._flush)  # type: ignore[union-attr]
        try:
            return await fut
        except asyncio.CancelledError:
            fut.cancel()  # the reader will discard the reply (after its bookkeeping)
            raise

    def _pack(self, args: Iterable[Any]) -> list[bytes]:
        """A command's RESP bytes: hiredis packs them in C (an MPUB of 100 payloads ~5x faster than
        redis-py's Python); what it does not take (a memoryview, say) redis-py packs."""
        if _HIREDIS:
            try:
                return [hiredis.pack_command(tuple(args))]
            except TypeError:
                pass
        return self._conn.pack_command(*args)

    async def _read_loop(self) -> None:
        conn, pending = self._conn, self._pending
        try:
            while True:
                try:
                    raw = await conn.read_response(disable_decoding=True, push_request=True)
                    error = None
                except ResponseError as exc:
                    raw, error = None, from_reply(str(exc))
                if raw is _PUSHED:
                    continue
                if not pending:
                    raise ConnectionLost(f"reply without a request: {raw!r:.100}")
                fut, convert = pending.popleft()
                if error is None and convert is not None:
                    try:
                        raw = convert(raw)  # runs even if the caller went away: epochs must advance
                    except Exception as exc:  # noqa: BLE001 - a bad reply fails its own call only
                        error = exc if isinstance(exc, FenceMQError) else FenceMQError(f"bad reply: {exc!r}")
                if fut.done():
                    continue
                if error is not None:
                    fut.set_exception(error)
                else:
                    fut.set_result(raw)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001
            lost = exc if isinstance(exc, ConnectionLost) else ConnectionLost(f"connection lost: {exc}")
            self._fail(lost)
            with contextlib.suppress(Exception):
                await conn.disconnect(nowait=True)

    def _fail(self, exc: ConnectionLost) -> None:
        if self._broken is None:
            self._broken = exc
        exc = self._broken  # the first cause (a takeover) is what every pending call reports
        while self._pending:
            fut, _ = self._pending.popleft()
            if not fut.done():
                fut.set_exception(exc)
        self._out = []
        if self._notices is not None:
            self._notices.put_nowait(None)  # ends notices()

    def _on_push(self, frame: Any) -> None:
        try:
            kind = _str(frame[0]) if frame else ""
            if kind == "notice" and len(frame) == 2:
                notice = _notice(frame[1])
            else:
                notice = {"type": kind, "data": _tree(list(frame[1:]))}
        except Exception:  # noqa: BLE001 - a malformed push must not kill the reader
            log.warning("ignoring a malformed push frame: %r", frame)
            return
        if notice.get("type") == "session_taken_over" and self._broken is None:
            # The worker closes this connection next: every call from now on says why.
            self._broken = SessionTakenOver(
                f"session {notice.get('client') or self._id!r} was taken over by another connection (TAKEOVER); "
                "this client no longer acts for it")
        if not self._first_time(notice):
            return
        self._notice_received(notice)
        q = self._notices
        if q is not None:
            if q.qsize() >= MAX_QUEUED_NOTICES:
                q.get_nowait()  # drop the oldest: HEARTBEAT still has them
            q.put_nowait(notice)
        if self.on_notice is not None:
            try:
                self.on_notice(notice)
            except Exception:
                log.exception("on_notice callback failed")

    def _first_time(self, notice: dict[str, Any]) -> bool:
        """False for a notice already seen (pushed, then drained by HEARTBEAT, or the other way round)."""
        nid = notice.get("nid")
        if nid is None:
            return True
        if nid in self._seen_notices:
            return False
        self._seen_notices[nid] = None
        if len(self._seen_notices) > REMEMBERED_NOTICES:
            self._seen_notices.popitem(last=False)
        return True

    def _notice_received(self, notice: dict[str, Any]) -> None:
        """Every notice, pushed or drained by HEARTBEAT, passes here first (the client acts on some)."""

    async def notices(self) -> AsyncIterator[dict[str, Any]]:
        """Pushed notices (RESP3), in arrival order, until the client closes. One consumer at a time."""
        q = self._notices
        if q is None:
            return
        while True:
            if q.empty() and self.closed:
                return
            notice = await q.get()
            if notice is None:
                return
            yield notice

    async def execute(self, *args: Any) -> Any:
        """Any command, raw reply (bytes, not decoded); errors raise fencemq.errors exceptions."""
        return await self._call(args)
