"""The session a verb acts for: one connection's client, as this worker sees it.

The session itself lives in Redis (fencemq.fences.sessions); this is the
connection's side of it: the client id (named by HELLO/CLIENT SETNAME, or
anonymous and made on first use), whether this connection holds it, the
protocol version, authentication, whether the connection is ending, and the
way notices are pushed to a RESP3 client.

Connections presenting the same client id share its session (a client's
pool): each keeps it alive, and it is left to its lease (or ended, after a
QUIT) when the last of them closes. Taking it over from the others is
explicit (``HELLO … SETNAME id TAKEOVER``, ``CLIENT TAKEOVER``).

A session never touches the socket. The connection lends it two hooks: one
that watches for a hang-up while a verb waits, one that ends the connection
when another connection takes the session over. It also holds the
connection's transaction (MULTI … EXEC) while one is open, and its pass at the
gate (fencemq.server.gate): who logged in, counted against the limits.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgpack

from fencemq.errors import BadArgument, FenceMQError, NoPermission
from fencemq.ops.users import User
from fencemq.model.keys import check_name
from fencemq.model.handles import Handle
from fencemq.server.gate import Pass
from fencemq.server.lost_pulls import PullLedger
from fencemq.protocol.commands import Request
from fencemq.protocol.resp import Push
from fencemq.server.services import Services

# The connection is told which wait to cancel if its client hangs up (None: the wait is over).
HangupWatch = Callable[[anyio.CancelScope | None], None]
# The connection's way to push a frame to a RESP3 client now: False when it cannot take more
# (the client is not reading what it was sent), and the notice stays queued for HEARTBEAT.
Pusher = Callable[[Push], bool]


@dataclass(slots=True)
class Transaction:
    """Commands queued between MULTI and EXEC; one refused while queued aborts the EXEC."""

    queued: list[Request] = field(default_factory=list)
    refused: bool = False


def revoked_notice(handle: Handle) -> dict[str, Any]:
    """Told to a client whose subscription was dropped: its user may no longer subscribe to its topic."""
    notice: dict[str, Any] = {"type": "unsubscribe", "reason": "permission revoked", "topic": handle.queue.topic,
                              "handle": handle.encode()}
    if handle.queue.lmq is not None:
        notice["lmq"] = handle.queue.lmq
    return notice


class Session:
    # Slots, not an instance dict: a connection's session is the worker's largest per-connection
    # object, and CPython's instance dicts share their keys only up to 30 attributes: the 30th
    # (flat_deliveries) made every idle connection ~1.3 KB larger (bench.connections: 6.1 -> 7.4 KB).
    __slots__ = ("services", "token", "peer", "local", "opened", "last_active", "last_verb", "library",
                 "transaction", "waiting", "proto", "flat_deliveries", "client_id", "anonymous", "bound",
                 "authed", "gate_pass", "quit", "closing", "gone", "draining", "resumed", "linger_ms", "_waits",
                 "farewell", "pulls", "taken_over_afresh", "_watch_for_hangup", "_end_connection", "_push")

    def __init__(self, services: Services, token: str, *, watch_for_hangup: HangupWatch,
                 end_connection: Callable[[], None], addresses: tuple[str, str] = ("", ""),
                 gate_pass: Pass | None = None, push: Pusher | None = None) -> None:
        self.services = services
        self.token = token  # this connection, unique across the fleet: "<worker id>:<n>"
        self.peer, self.local = addresses  # host:port of the client and of the worker, for CLIENT INFO
        self.opened = self.last_active = time.monotonic()
        self.last_verb = ""
        self.library: dict[str, str] = {}  # CLIENT SETINFO lib-name / lib-ver
        self.transaction: Transaction | None = None
        self.waiting = False  # a long poll is in progress (INFO's blocked_clients)
        self.proto = 2
        # CLIENT DELIVERIES FLAT: each delivery as RESP2 writes it (a flat array of fields and values)
        # whatever the protocol, which a RESP3 client parses several times faster than a map
        self.flat_deliveries = False
        self.client_id: str | None = None
        self.anonymous = True
        self.bound = False  # this connection holds its session
        self.authed = not services.config.needs_auth
        # the connection at the gate: who logged in (None while no authentication is asked for)
        self.gate_pass = gate_pass or Pass("resp", self.peer.rsplit(":", 1)[0])
        if self.gate_pass.shut_out is None:
            self.gate_pass.shut_out = end_connection
        self.quit = False  # QUIT ends a named session too, not only the connection
        self.closing = False  # the connection ends once the commands in hand are answered
        self.gone = False  # the client hung up (or stopped reading): a reply would reach nobody
        self.draining = False  # the worker is shutting down: long polls answer at once
        self.resumed = False  # binding found the session there already (it outlived a connection)
        # how long a named session outlives its last connection (MQTT: its Session Expiry Interval)
        self.linger_ms = services.config.session_lease_ms
        self._waits: set[anyio.CancelScope] = set()  # long polls that a drain ends early
        self.farewell: Push | None = None  # a last notice to send before the connection closes
        self.pulls: PullLedger | None = None  # its PULLs, once it pulls: one cut off is answered by the next
        self.taken_over_afresh = False  # taken over by a connection that started the session anew
        self._watch_for_hangup = watch_for_hangup
        self._end_connection = end_connection
        self._push = push
        services.roster.enter(self)

    @property
    def number(self) -> int:
        """This connection's number on its worker (CLIENT ID)."""
        return int(self.token.rsplit(":", 1)[1])

    @property
    def user(self) -> User | None:
        """Who logged in on this connection (the gate keeps it current when the user's record changes)."""
        return self.gate_pass.user

    @property
    def anonymous_id(self) -> str:
        return "anon-" + self.token.replace(":", "-")

    def own(self, text: str) -> Handle:
        """The handle, if this broker issued it and it belongs to this session's client."""
        handle = self.services.handles.verify(text)
        if handle.member != self.client_id:
            if self.anonymous:
                raise NoPermission(
                    "this handle belongs to another client, and this connection is an anonymous session of its "
                    "own; name the session on every connection that acts for it (HELLO 3 SETNAME id, CLIENT "
                    "SETNAME id; redis-py: client_name=…) so that they share it")
            raise NoPermission("this handle belongs to another client; use the handle your own SUB returned")
        return handle

    def note_command(self, verb: str) -> None:
        """A command arrived (CLIENT INFO's idle and cmd, INFO's commands processed)."""
        self.last_active, self.last_verb = time.monotonic(), verb.lower()
        self.services.roster.commands_processed += 1

    def refused(self, exc: FenceMQError) -> None:
        """A command was refused: an open transaction will not run (EXEC answers EXECABORT)."""
        if self.transaction is not None:
            self.transaction.refused = True

    @asynccontextmanager
    async def until_hangup(self) -> AsyncIterator[None]:
        """Run the body while the connection watches the client.

        If the client hangs up meanwhile, the body is cancelled and ``closing``
        is set; whatever the client sent meanwhile stays buffered for later.
        """
        self.waiting = True
        scope = anyio.CancelScope()
        self._watch_for_hangup(scope)
        try:
            with scope:
                yield
        finally:
            self._watch_for_hangup(None)
            self.waiting = False

    @contextmanager
    def interruptible(self, scope: anyio.CancelScope) -> Iterator[None]:
        """A long poll's wait, which :meth:`drain` ends early (the verb still answers)."""
        if self.draining:
            scope.cancel()
        self._waits.add(scope)
        try:
            yield
        finally:
            self._waits.discard(scope)

    def drain(self) -> None:
        """The worker is shutting down: long polls answer now, and from now on at once."""
        self.draining = True
        for scope in self._waits:
            scope.cancel()

    # -- lifecycle -------------------------------------------------------------------

    async def ensure(self) -> str:
        """The client id, binding the session of an unnamed connection on first use."""
        if not self.bound:
            await self.bind(self.client_id or self.anonymous_id, anonymous=self.client_id is None)
        assert self.client_id is not None
        return self.client_id

    async def bind(self, client_id: str, anonymous: bool, *, takeover: bool = False, fresh: bool = False,
                   tell_revoked: bool = True) -> list[Handle]:
        """Join the client id's session (sharing it with its other connections), or take it over.

        A session taken up again keeps only the subscriptions its user may still hold (the gate
        checks them against the user's grants of now): those it dropped are returned, and told to
        the client as ``unsubscribe`` notices (reason ``permission revoked``) unless ``tell_revoked``
        is False (MQTT tells in its own way)."""
        check_name(client_id, "client")
        if self.bound and self.client_id != client_id:
            raise BadArgument("this connection already has a client id; open a new connection for another")
        services = self.services
        if not anonymous:
            services.gate.check_client_id(client_id, self.anonymous_id)
            await self._claim(client_id)
        following = self.client_id == client_id and self.bound
        self.client_id, self.anonymous = client_id, anonymous
        if not following:
            await services.wakeups.follow(services.keys.session_channel(client_id), self._on_message)
        try:
            generation, _ = await services.sessions.bind(client_id, self.token, services.worker_id,
                                                         takeover=takeover, fresh=fresh)
        except BaseException:
            if not following:
                with anyio.CancelScope(shield=True):
                    await services.wakeups.unfollow(services.keys.session_channel(client_id), self._on_message)
            raise
        self.bound = True
        self.resumed = generation > 1
        if anonymous or not self.resumed:
            return []  # a session this bind created holds no membership, nothing to check, yet
        await services.sessions.set_presence(client_id, online=True)
        revoked = await services.gate.drop_revoked(self.user, client_id)
        if revoked and tell_revoked:
            await services.sessions.notify_all([(client_id, revoked_notice(h)) for h in revoked])
        return revoked

    async def _claim(self, client_id: str) -> None:
        """A client id belongs to the user that first named a session with it: NOPERM for any other.

        Without authentication (no password, no users) there is nobody to tell
        apart; with the legacy password alone every connection is ``default``.
        An anonymous id embeds this connection's token, so nobody else can name it.
        """
        if self.user is None:
            return
        redis, key = self.services.redis, self.services.keys.client_owners
        if await redis.hsetnx(key, client_id, self.user.name):
            return
        owner = await redis.hget(key, client_id)
        owner = owner.decode("utf-8", "replace") if isinstance(owner, bytes) else owner
        if owner != self.user.name:
            raise NoPermission(f"client id '{client_id}' belongs to another user; "
                               f"user '{self.user.name}' may not name or take over its session")

    async def release(self) -> None:
        """The connection is over: stop hearing the session; end it, or leave it to its lease.

        A named session outlives its last connection until its lease runs out
        (the worker stops refreshing it now), or ends at once after a QUIT; an
        anonymous one ends. While other connections share it, it goes on.
        """
        self.services.roster.leave(self)
        await self._let_go()

    async def _let_go(self) -> None:
        if self.client_id is None:
            return
        services = self.services
        await services.wakeups.unfollow(services.keys.session_channel(self.client_id), self._on_message)
        if not self.bound:
            return
        if self.anonymous:
            self.bound = False
            await services.sessions.end(self.client_id, force=True)
            return
        # Bound (kept alive, and no sweeper of this worker's) until the leave has started the
        # session's own lease: the last connection's leave sets it in the same step.
        try:
            left = await services.sessions.leave(self.client_id, self.token, 0 if self.quit else self.linger_ms)
        finally:
            self.bound = False
        if left > 0:
            return
        if self.quit:
            await services.sessions.end(self.client_id, force=True)
        else:
            await services.sessions.set_presence(self.client_id, online=False)

    async def reset(self) -> None:
        """RESET: as a fresh connection (RESP2, no transaction, no session, authenticated only without a password)."""
        await self._let_go()
        self.client_id, self.anonymous, self.transaction, self.proto = None, True, None, 2
        self.flat_deliveries = False
        self.authed = not self.services.config.needs_auth
        self.services.gate.admit(self.gate_pass, None)
        self.library = {}

    @property
    def delivery_proto(self) -> int:
        """The protocol a delivery is written in: RESP2's flat array once CLIENT DELIVERIES FLAT asked."""
        return 2 if self.flat_deliveries else self.proto

    def tell(self, notice: dict[str, Any]) -> bool:
        """Push a notice about this connection (not queued for HEARTBEAT); False if it could not go."""
        return self._push is not None and self._push(Push(["notice", notice]))

    def _on_message(self, data: bytes) -> None:
        told = msgpack.unpackb(data)
        # a batch of notices (fences/sessions.py announce_many) is a list of them
        for notice in told if isinstance(told, list) else [told]:
            self._on_notice(notice)

    def _on_notice(self, notice: dict[str, Any]) -> None:
        if notice.get("type") == "takeover":
            if notice.get("conn") != self.token:
                # The same client id connected elsewhere: that connection owns the session now.
                self.bound = False
                self.closing = True
                self.taken_over_afresh = bool(notice.get("fresh"))
                self.farewell = Push(["notice", {"type": "session_taken_over", "client": self.client_id}])
                self._end_connection()
            return
        if self.proto == 3 and not self.closing and self._push is not None:
            # never blocks the pub/sub reader; what cannot go now stays queued for HEARTBEAT
            self._push(Push(["notice", self.services.handles.sign_notice(notice)]))
