"""The SDK's connection: one session, every concurrent call pipelined, reconnected by itself.

A client holds one link (fencemq.sdk.link: a socket, HELLO, the write FIFO, the reader)
to one of its workers. When the link is lost, or its worker says it drains, the client
opens another to any of its addresses (fencemq.sdk.reconnect) under the same client id,
so the session resumes; the calls whose replies never came go out again on it, in their
order, before anything newer. :class:`fencemq.sdk.client.Client` builds the verbs on it.
How and why: docs/sdk.md, "How the client works" and "Reconnecting".
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any, Self

from redis.asyncio.connection import Connection

from fencemq.errors import RETRIABLE, FenceMQError, SessionExpired, \
    SessionTakenOver
from fencemq.sdk.link import HIREDIS, Call, Link
from fencemq.sdk.moving import Moving
from fencemq.sdk.reconnect import Addresses, Reconnect, Target, reconnect_policy
from fencemq.sdk.replies import ConnectionLost, _notice, _str, _tree

if HIREDIS:
    import hiredis

log = logging.getLogger(__name__)

DEFAULT_URL = "redis://127.0.0.1:7379"
MAX_QUEUED_NOTICES = 10_000
REMEMBERED_NOTICES = 10_000  # notice ids kept to tell a pushed notice from the same one drained by HEARTBEAT
QUIT_TIMEOUT_S = 1.0  # closing a client whose session the SDK named: how long QUIT (ending it at once) may take
# Commands safe to send again when the connection dropped before their reply (execute()): PUB and MPUB
# only with a dedup ID; anything else (a transaction, a Redis command) raises ConnectionLost instead.
RESENDABLE = frozenset({"PING", "ECHO", "HEARTBEAT", "SUB", "PULL", "TAKE", "ACK", "NACK", "RENEW", "SEEK",
                        "UNSUB", "UNPUB", "INFO", "TIME", "COMMAND"})


def resendable(args: Sequence[Any]) -> bool:
    verb = _str(args[0]).upper() if args else ""
    if verb in ("PUB", "MPUB"):
        return any(_str(a).upper() == "ID" for a in args[3:])
    return verb in RESENDABLE


class PipelinedConnection(Moving):
    """One session, every concurrent call pipelined on one connection at a time (docs/sdk.md).

    ``url``: a worker's URL, a list of them, or a name with a DNS record per worker. ``client_id``
    names the session (connections with the same id share it; ``takeover=True`` takes it from them
    instead, and they get :class:`~fencemq.errors.SessionTakenOver`); without one, a reconnecting
    client names it itself. ``on_notice`` is called with each notice, once: the worker's, and the
    client's own ``disconnected``, ``reconnected``, ``session_expired`` and ``connection_lost``.
    ``reconnect``: a :class:`~fencemq.sdk.reconnect.Reconnect`, True (its defaults) or False.
    """

    def __init__(
        self,
        url: str | Sequence[str] = DEFAULT_URL,
        client_id: str | None = None,
        protocol: int = 3,
        password: str | None = None,
        username: str | None = None,
        *,
        on_notice: Callable[[dict[str, Any]], None] | None = None,
        connect_timeout: float | None = 10.0,
        takeover: bool = False,
        reconnect: Reconnect | bool = True,
    ) -> None:
        if protocol not in (2, 3):
            raise ValueError("protocol must be 2 or 3")
        self.addresses = Addresses(url)
        self.url = self.addresses.urls[0]
        self.protocol = protocol
        self.on_notice = on_notice
        self.takeover = takeover  # take the client id's session from the connections that hold it
        self.reconnect = reconnect_policy(reconnect)
        self.connect_timeout = connect_timeout
        self.hello: dict[str, Any] = {}
        if client_id is None:
            client_id = self.addresses.client_name  # a URL's ?client_name= may name the session
        if takeover and client_id is None:
            raise ValueError("takeover needs a client_id: the session to take over")
        # A session resumes only under its name: a reconnecting client without one makes one up (and
        # ends that session when it closes: nobody else can resume it).
        self._named_here = client_id is None and self.reconnect is not None
        if self._named_here:
            client_id = f"sdk-{uuid.uuid4().hex[:20]}"
        self._client_id = client_id
        self._id: str | None = client_id
        self._password = password if password is not None else self.addresses.password
        self._username = username if username is not None else self.addresses.username
        self._link: Link | None = None  # the one new calls go to
        self._leaving: list[Link] = []  # older links whose replies are still coming (a drain)
        self._resend: list[tuple[int, list[Call]]] = []  # lost with a link: (its number, its calls)
        self._ready: asyncio.Event | None = None  # set while a usable link is current (or it is over)
        self._reconnecting: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._final: ConnectionLost | None = None  # given up, taken over or closed: every call raises it
        self._closed = False
        self._opened = False
        self._generation = 0  # of the session: one more each time it was found gone after a reconnect
        self._had_session = False
        self._notices: asyncio.Queue[dict[str, Any] | None] | None = None
        self._seen_notices: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.reconnects = 0  # links opened after the first
        self._packer = Connection(protocol=protocol)  # packs what hiredis does not take; never connected
        self._init_state()

    def _init_state(self) -> None:
        """What a subclass keeps per client (the Client: epochs and subscriptions)."""

    # -- lifecycle ---------------------------------------------------------------

    @classmethod
    async def connect(
        cls,
        url: str | Sequence[str] = DEFAULT_URL,
        client_id: str | None = None,
        protocol: int = 3,
        password: str | None = None,
        username: str | None = None,
        *,
        on_notice: Callable[[dict[str, Any]], None] | None = None,
        connect_timeout: float | None = 10.0,
        takeover: bool = False,
        reconnect: Reconnect | bool = True,
    ) -> Self:
        """A connected client (the arguments of the constructor)."""
        client = cls(url, client_id, protocol, password, username, on_notice=on_notice,
                     connect_timeout=connect_timeout, takeover=takeover, reconnect=reconnect)
        await client.open()
        return client

    async def open(self) -> Self:
        """Connect and say HELLO (to the first of the addresses that answers); a no-op when open.

        The first connection is not retried: a wrong address or credentials fail here, at once."""
        if self._opened:
            return self
        if self._closed:
            raise ConnectionLost("this client was closed; create a new one")
        self._loop = asyncio.get_running_loop()
        self._ready = asyncio.Event()
        self._notices = asyncio.Queue()
        errors: list[str] = []
        for target in await self.addresses.targets(shuffle=False):
            try:
                link = await self._open_link(target, takeover=self.takeover)
            except ConnectionLost as exc:
                errors.append(str(exc))
                continue
            except BaseException:
                self._closed = True
                raise
            self._adopt(link, first=True)
            self._opened = True
            return self
        self._closed = True
        raise ConnectionLost("; ".join(errors) or f"cannot connect to {self.url}")

    async def _open_link(self, target: Target, *, takeover: bool = False) -> Link:
        link = Link(target, self.protocol, self.connect_timeout, self._on_push, self._link_lost, self._link_idle)
        args: list[Any] = ["HELLO", self.protocol]
        if self._password is not None:
            args += ["AUTH", self._username or "default", self._password]
        if self._client_id is not None:
            args += ["SETNAME", self._client_id]
            if takeover:
                args.append("TAKEOVER")
        try:
            await link.open(args)
        except BaseException:
            link.closing = True
            raise
        return link

    async def close(self) -> None:
        """Close the connection; calls still pending raise ConnectionLost."""
        if self._closed:
            return
        self._closed = True
        task = self._reconnecting
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])
        link = self._link
        if self._named_here and self._final is None and link is not None and link.usable \
                and self.hello.get("server") == "fencemq":
            # nobody else knows this session's name: QUIT ends it now rather than after its lease
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._call(["QUIT"], resend=False), QUIT_TIMEOUT_S)
        if self._final is None:
            self._final = ConnectionLost("client closed")
        for one in [*self._leaving, *([link] if link is not None else [])]:
            await one.close()
        self._fail_waiting(self._final)

    async def __aenter__(self) -> Self:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def id(self) -> str | None:
        """The session's client id: the one given (or made up), else the worker's (after HELLO or the first SUB)."""
        return self._id

    @property
    def closed(self) -> bool:
        """Closed, given up, or taken over: no call will succeed (a client that is reconnecting is not)."""
        return self._closed or self._final is not None

    @property
    def connected(self) -> bool:
        """Whether a connection is up right now (False while the client reconnects)."""
        return self._link is not None and self._link.usable and not self.closed

    @property
    def worker(self) -> str | None:
        """The worker the client is connected to (its HELLO's id)."""
        value = self.hello.get("worker")
        return None if value is None else str(value)

    # -- calls ------------------------------------------------------------------------

    async def _call(self, args: Iterable[Any], convert: Callable[[Any], Any] | None = None, *,
                    resend: bool = True, generation: int | None = None) -> Any:
        """Send one command and await its reply (decoded by ``convert`` in the reader).

        ``resend``: the command may go out again if its connection is lost before the reply (the
        verbs decide: a PUB carries a dedup id, an ACK settles nothing twice). ``generation``: the
        session generation the command acts in (a subscription's): SessionExpired once it is gone.
        """
        if self._final is not None:
            raise self._final
        if self._loop is None:
            raise ConnectionLost("client is not connected; use `await Client.connect(...)`")
        if generation is not None and generation != self._generation:
            raise self._expired()
        packed = self._pack(args)
        rounds, first_refusal = 0, 0.0
        while True:
            call = Call(packed, convert, self._loop.create_future(), resend, generation)
            await self._submit(call)
            try:
                return await call.future
            except asyncio.CancelledError:
                call.future.cancel()  # the reader discards the reply (after its bookkeeping)
                raise
            except FenceMQError as exc:
                # The broker's Redis failing over (TRYAGAIN…): wait, and send it again
                policy = self.reconnect
                if exc.code not in RETRIABLE or policy is None or not resend:
                    raise
                now = self._loop.time()
                first_refusal = first_refusal or now
                rounds += 1
                if policy.gives_up(rounds, now - first_refusal):
                    raise
                await asyncio.sleep(policy.delay(rounds))

    async def _submit(self, call: Call) -> None:
        """Queue the call on the current link, waiting for one while the client reconnects."""
        while True:
            if self._final is not None:
                raise self._final
            link = self._link
            if link is None or not link.usable:
                assert self._ready is not None
                if self._ready.is_set():
                    await asyncio.sleep(0.001)  # the link is being replaced this very moment
                await self._ready.wait()
                continue
            if call.generation is not None and call.generation != self._generation:
                raise self._expired()  # found gone by the reconnect it waited for
            async with link.wlock:
                await link.flow_control()  # a caller cancelled here has queued nothing
                if link is self._link and link.usable:
                    link.submit(call)  # nothing suspends from here: FIFO order is wire order
                    return

    def _pack(self, args: Iterable[Any]) -> list[bytes]:
        """A command's RESP bytes: hiredis packs them in C (an MPUB of 100 payloads ~5x faster than
        redis-py's Python); what it does not take (a memoryview, say) redis-py packs."""
        if HIREDIS:
            try:
                return [hiredis.pack_command(tuple(args))]
            except TypeError:
                pass
        return self._packer.pack_command(*args)

    def _expired(self) -> SessionExpired:
        return SessionExpired(
            f"session {self._id!r} ended while this client was away (it reconnected after its lease ran "
            "out): its subscriptions and checkouts are gone; subscribe again")

    # -- notices -------------------------------------------------------------------------

    def _on_push(self, link: Link, frame: Any) -> None:
        try:
            kind = _str(frame[0]) if frame else ""
            if kind == "notice" and len(frame) == 2:
                notice = _notice(frame[1])
            else:
                notice = {"type": kind, "data": _tree(list(frame[1:]))}
        except Exception:  # noqa: BLE001 - a malformed push must not kill the reader
            log.warning("ignoring a malformed push frame: %r", frame)
            return
        kind = notice.get("type")
        if kind == "session_taken_over" and self._final is None:
            # The worker closes this connection next: every call from now on says why.
            self._final = SessionTakenOver(
                f"session {notice.get('client') or self._id!r} was taken over by another connection (TAKEOVER); "
                "this client no longer acts for it")
        if self._first_time(notice):
            self._deliver(notice)
        if kind == "draining":
            self._move(link, notice)

    def _deliver(self, notice: dict[str, Any]) -> None:
        self._notice_received(notice)
        self._tell(notice)

    def _tell(self, notice: dict[str, Any]) -> None:
        """Hand a notice out: the notices() queue and the on_notice callback."""
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
        """Every notice from the worker, pushed or drained by HEARTBEAT, passes here first (the client acts on some)."""

    async def notices(self) -> AsyncIterator[dict[str, Any]]:
        """Notices (RESP3 pushes and the client's own), in arrival order, until the client closes.
        One consumer at a time."""
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
        """Any command, raw reply (bytes, not decoded); errors raise fencemq.errors exceptions.

        Sent again after a reconnect only when that is safe (:data:`RESENDABLE`, a PUB/MPUB with ID);
        otherwise a reply lost with its connection raises ConnectionLost."""
        return await self._call(args, resend=resendable(args))

    # what tests and benchmarks look at: the frames not yet written
    @property
    def _out(self) -> list[bytes]:
        return self._link.out if self._link is not None else []

    @property
    def _flush_scheduled(self) -> bool:
        return self._link.flush_scheduled if self._link is not None else False
