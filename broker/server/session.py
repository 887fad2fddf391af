"""The session a verb acts for: one connection's client, as this worker sees it.

The session itself lives in Redis (fencemq.fences.sessions); this is the
connection's side of it: the client id (named by HELLO/CLIENT SETNAME, or
anonymous and made on first use), whether this connection holds it, the
protocol version, authentication, whether the connection is ending, and the
outbox of notices pushed to a RESP3 client.

A session never touches the socket. The connection lends it two hooks: one
that watches for a hang-up while a verb waits, one that ends the connection
when another connection takes the session over.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import anyio
import msgpack

from fencemq.errors import BadArgument, NoPermission
from fencemq.model.keys import Handle, check_name
from fencemq.protocol.resp import Push
from fencemq.server.services import Services

OUTBOX_SIZE = 64

HangupWatch = Callable[[anyio.CancelScope], Awaitable[None]]


class Session:
    def __init__(self, services: Services, token: str, *, watch_for_hangup: HangupWatch,
                 end_connection: Callable[[], None]) -> None:
        self.services = services
        self.token = token  # this connection, unique across the fleet: "<worker id>:<n>"
        self.proto = 2
        self.client_id: str | None = None
        self.anonymous = True
        self.bound = False  # this connection holds its session
        self.authed = services.config.password is None
        self.quit = False  # QUIT ends a named session too, not only the connection
        self.closing = False  # the connection ends once the commands in hand are answered
        self._watch_for_hangup = watch_for_hangup
        self._end_connection = end_connection
        self._outbox, self.outbox = anyio.create_memory_object_stream[Push](OUTBOX_SIZE)

    @property
    def anonymous_id(self) -> str:
        return "anon-" + self.token.replace(":", "-")

    def own(self, text: str) -> Handle:
        """The handle, if it belongs to this session's client."""
        handle = Handle.decode(text)
        if handle.member != self.client_id:
            raise NoPermission("this handle belongs to another client; use the handle your own SUB returned")
        return handle

    @asynccontextmanager
    async def until_hangup(self) -> AsyncIterator[None]:
        """Run the body while the connection watches the client.

        If the client hangs up meanwhile, the body is cancelled and ``closing``
        is set; whatever the client sent meanwhile stays buffered for later.
        """
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch_for_hangup, tg.cancel_scope)
            yield
            tg.cancel_scope.cancel()

    # -- lifecycle -------------------------------------------------------------------

    async def ensure(self) -> str:
        """The client id, binding the session of an unnamed connection on first use."""
        if not self.bound:
            await self.bind(self.client_id or self.anonymous_id, anonymous=self.client_id is None)
        assert self.client_id is not None
        return self.client_id

    async def bind(self, client_id: str, anonymous: bool) -> None:
        check_name(client_id, "client")
        if self.bound and self.client_id != client_id:
            raise BadArgument("this connection already has a client id; open a new connection for another")
        self.client_id, self.anonymous = client_id, anonymous
        services = self.services
        await services.wakeups.follow(services.keys.session_channel(client_id), self._on_message)
        await services.sessions.bind(client_id, self.token, services.worker_id)
        self.bound = True
        if not anonymous:
            await services.sessions.set_presence(client_id, online=True)

    async def release(self) -> None:
        """The connection is over: stop hearing the session; end it, or leave it to its lease."""
        if self.client_id is None:
            return
        services = self.services
        await services.wakeups.unfollow(services.keys.session_channel(self.client_id), self._on_message)
        # A named session outlives its connection until its lease runs out (the
        # worker stops refreshing it now); an anonymous one ends.
        if self.bound and (self.anonymous or self.quit):
            await services.sessions.end(self.client_id, force=True)
        elif self.bound:
            await services.sessions.set_presence(self.client_id, online=False)

    def _on_message(self, data: bytes) -> None:
        notice = msgpack.unpackb(data)
        if notice.get("type") == "takeover":
            if notice.get("conn") != self.token:
                # The same client id connected elsewhere: that connection owns the session now.
                self.bound = False
                self.closing = True
                self._end_connection()
            return
        if self.proto == 3 and not self.closing:
            try:
                self._outbox.send_nowait(Push(["notice", notice]))
            except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError):
                pass  # never block the pub/sub reader; the notice stays queued for HEARTBEAT
