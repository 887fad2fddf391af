"""The gate: where every door — RESP, MQTT (TCP, TLS, WebSocket) and the web UI — learns who a caller
is, whether a grant allows what it asks, and what it may cost the worker (docs/security.md).

A door asks; the gate answers with a value, or with a FenceMQError (WrongPassword, NoPermission,
LimitExceeded, BadArgument) that the door translates into its own reply: a RESP error word, an MQTT
reason code, an HTTP status. No door keeps a rule of its own.

* Identity: :meth:`Gate.log_in` (the legacy password is the ``default`` user; users live in Redis,
  fencemq.ops.users), throttled per client address before any password is hashed
  (fencemq.server.guard).
* Grants: :meth:`Gate.check` — one matcher (:meth:`fencemq.ops.users.User.may`) for a topic or a
  filter, for every action, at every door.
* Names: the broker's namespaces (client ids starting with ``$`` or ``anon-``, group names starting
  with ``~``) cannot be entered by a name a client chooses.
* Limits and budgets: every connection of every door is a :class:`Pass`, counted here against
  ``max_connections`` and, once its user is known, ``max_connections_per_user``; the timeouts and
  pre-authentication sizes each door applies are read from here.
* The current record: a user whose record changes (``fencemq user``) is announced on the users
  channel; each pass of that user is updated in place when nothing was taken away, else its door is
  told to end it (:meth:`Gate.user_changed`). Checks that need Redis (subscriptions of a resumed
  session, group-wide actions) are fencemq.server.gate_checks's.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.abc import SocketAttribute

from fencemq.config import Config
from fencemq.errors import BadArgument, LimitExceeded, NoPermission, WrongPassword
from fencemq.model.keys import Keyspace
from fencemq.model.topics import SHARE_PREFIX
from fencemq.ops.users import DEFAULT_USER, User, UserStore, default_user
from fencemq.server.gate_checks import SessionChecks
from fencemq.server.guard import AuthThrottle, PasswordChecks

log = logging.getLogger(__name__)

PRIVATE_GROUP = "~"  # a client's own subscription (no GROUP) is group ~<client id>
ANONYMOUS = "anon-"  # the sessions of connections that named none


@dataclass(eq=False)
class Pass:
    """One caller at one door: a connection (RESP, MQTT), a UI event stream, or a UI login attempt."""

    door: str  # "resp", "mqtt", "mqtt-ws" or "ui"
    address: str  # the client's host, without its port: what logins are throttled by
    user: User | None = None  # who logged in; None before (or without authentication)
    failures: int = 0  # failed logins on this connection
    closing: bool = False  # too many failed logins: the door closes the connection after its reply
    counted: bool = False  # among the worker's connections (max_connections)
    # The door's way to end this connection when its user's record changed (RESP: close; MQTT:
    # DISCONNECT 0x98; the UI ends the login): set by the door, called by the gate.
    shut_out: Callable[[], None] | None = field(default=None, repr=False)


class Gate(SessionChecks):
    """One per worker (the UI of ``fencemq dashboard`` has one of its own, without ``core``)."""

    def __init__(self, config: Config, users: UserStore, *, keys: Keyspace | None = None, core: Any = None) -> None:
        self.config = config
        self.users = users
        self.redis = users.redis
        self.keys = keys or Keyspace(config.prefix)
        self.core = core
        self.throttle = AuthThrottle(config.auth_delay_ms / 1000, config.auth_delay_max_ms / 1000)
        self.passwords = PasswordChecks(config.max_password_checks)
        self.connections = 0
        self._by_user: dict[str, set[Pass]] = {}
        self.crowded: dict[str, int] = {}
        self.spawn: Callable[..., Any] | None = None  # a task group's start_soon, once the worker runs

    # -- connections -------------------------------------------------------------------

    def enter(self, door: str, address: str) -> Pass:
        """A new connection at ``door``: counted, or LimitExceeded past max_connections (nothing held)."""
        if self.connections >= self.config.max_connections:
            raise LimitExceeded("max number of clients reached")
        self.connections += 1
        return Pass(door, address, counted=True)

    def leave(self, p: Pass) -> None:
        """The connection is over: it counts no more, for the worker or for its user."""
        self._forget_user(p)
        if p.counted:
            p.counted = False
            self.connections -= 1

    def admit(self, p: Pass, user: User | None) -> None:
        """``p`` acts for ``user`` from now on (None: nobody, after a RESET): LimitExceeded past
        max_connections_per_user, and ``p`` keeps whom it had."""
        if user is not None and (p.user is None or p.user.name != user.name) and p.counted:
            limit = self.config.max_connections_per_user
            exempt = user.name == DEFAULT_USER and not self.config.users  # the legacy password: everybody
            held = len(self._by_user.get(user.name, ()))
            if limit and not exempt and held >= limit:
                raise LimitExceeded(f"user '{user.name}' already holds {held} connections on this worker "
                                    f"(max_connections_per_user {limit}); close one first")
        self._forget_user(p)
        p.user = user
        if user is not None and p.counted:
            self._by_user.setdefault(user.name, set()).add(p)

    def _forget_user(self, p: Pass) -> None:
        if p.user is not None:
            held = self._by_user.get(p.user.name)
            if held is not None:
                held.discard(p)
                if not held:
                    del self._by_user[p.user.name]

    def held_by(self, name: str) -> int:
        return len(self._by_user.get(name, ()))

    def users_held(self) -> dict[str, int]:
        """Each logged-in user's connections on this worker (the limits alarm)."""
        return {name: len(held) for name, held in self._by_user.items()}

    # -- identity ----------------------------------------------------------------------

    @property
    def needs_auth(self) -> bool:
        return self.config.needs_auth

    async def users_exist(self) -> bool:
        """A broker with users: started with them (--users), or (for the UI) with users in its Redis."""
        return bool(self.config.users) or await self.users.any()

    async def log_in(self, p: Pass, name: str | None, password: bytes) -> User:
        """The user ``name`` (None: ``default``) if ``password`` is its own, admitted at ``p``'s door.

        Throttled per address: attempts from one address are checked one at a time, each after the
        delay its address's recent failures set, and only then is the password hashed (at most
        max_password_checks at a time per worker). WrongPassword (``p.closing`` once the connection
        failed auth_max_failures times) or LimitExceeded (max_connections_per_user).
        """
        name = name or DEFAULT_USER
        async with self.passwords.turn(p.address):
            await anyio.sleep(self.throttle.wait(p.address, time.monotonic()))
            user = await self._check(p.door, name, password)
            if user is None:
                self.throttle.failed(p.address, time.monotonic())
                p.failures += 1
                if p.failures >= self.config.auth_max_failures and p.door == "resp":
                    p.closing = True
                    raise WrongPassword(f"invalid username-password pair or user is disabled; "
                                        f"{p.failures} failures, closing the connection")
                raise WrongPassword("invalid username-password pair or user is disabled.")
            self.throttle.succeeded(p.address)
        self.admit(p, user)
        return user

    async def _check(self, door: str, name: str, password: bytes) -> User | None:
        expected = self.config.password
        legacy = expected is not None and hmac.compare_digest(password, expected.encode())
        if door == "ui":
            # The UI is an operator's door, over the users in Redis whether or not the worker was
            # started with --users: on a broker with users each operator logs in as themselves (the
            # legacy password is for applications written before users); on an open broker anybody
            # may do anything, so default logs in without a password.
            if name != DEFAULT_USER:
                return await self._hashed(name, password)
            if await self.users_exist():
                return None
            return default_user() if expected is None or legacy else None
        if expected is not None and (name == DEFAULT_USER or not self.config.users):
            # the legacy single password is the default user's: every permission (without users,
            # any user name goes with it, as before users existed)
            return default_user() if legacy else None
        if not self.config.users:
            return None
        return await self._hashed(name, password)

    async def _hashed(self, name: str, password: bytes) -> User | None:
        """A user's password checked against its scrypt hash (~16 MiB, tens of ms), bounded per worker."""
        async with self.passwords.hashing():
            return await self.users.authenticate(name, password.decode("utf-8", "replace"))

    # -- grants --------------------------------------------------------------------------

    @staticmethod
    def allows(user: User | None, action: str, target: str) -> bool:
        """``user`` may do ``action`` on ``target`` (a topic name, or a filter: every topic it can match).
        None is nobody's login: a broker without authentication, where everything is allowed."""
        return user is None or user.may(action, target)

    async def current(self, user: User) -> User | None:
        """``user``'s record of now (None: removed). The legacy password's ``default`` stands as long as
        the broker has no users (the UI's rule: on a broker with users, default never logs in there)."""
        if user.superuser:
            return None if await self.users_exist() else user
        return await self.users.get(user.name)

    async def allows_now(self, user: User | None, action: str, target: str) -> bool:
        """:meth:`allows` for an action deferred past its connection (an MQTT will going out), against
        the user's record of now: a removed user, or one whose grant was revoked since, may not."""
        if user is None or user.superuser:
            return True
        current = await self.users.get(user.name)
        return current is not None and current.may(action, target)

    @staticmethod
    def check(user: User | None, action: str, target: str) -> None:
        """NoPermission naming what is missing, unless :meth:`allows`."""
        if user is not None and not user.may(action, target):
            raise NoPermission(user.missing(action, target))

    # -- names ---------------------------------------------------------------------------

    @staticmethod
    def check_client_id(client_id: str, own_anonymous_id: str) -> None:
        """Client ids are the client's choice, except where they would enter the broker's namespaces."""
        if client_id.startswith("$"):
            raise BadArgument(f"client id '{client_id[:64]}' starts with '$': such names are the broker's "
                              f"(a shared group's queue is owned by $share/<group>); choose another id")
        if client_id.startswith(ANONYMOUS) and client_id != own_anonymous_id:
            raise NoPermission("client ids starting with 'anon-' name other connections' anonymous sessions; "
                               "choose another id")

    @staticmethod
    def check_group(group: str | None) -> None:
        if group is not None and group.startswith(PRIVATE_GROUP):
            raise BadArgument(f"group '{group[:64]}': names starting with '~' are the broker's (a subscription "
                              f"without GROUP is the client's own group ~<client id>); choose another name")

    @classmethod
    def check_target(cls, target: str, group: str | None = None) -> None:
        """A SUB target and its GROUP (an MQTT filter, maybe shared) stay out of the broker's names."""
        if target.startswith(SHARE_PREFIX):
            cls.check_group(target[len(SHARE_PREFIX):].partition("/")[0])
        cls.check_group(group)

    # -- users whose record changed ------------------------------------------------------

    def user_changed(self, name: str) -> None:
        """The users channel said ``name`` changed: look its record up, then act on its passes."""
        if name in self._by_user and self.spawn is not None:
            self.spawn(self._apply_change, name)

    async def _apply_change(self, name: str) -> None:
        try:
            current = await self.users.get(name)
        except Exception as exc:  # noqa: BLE001 - Redis away: the change applies at the next login
            log.warning("could not read the changed record of user %r: %s", name, exc)
            return
        for p in list(self._by_user.get(name, ())):
            if p.user is None or p.user.superuser:
                continue
            if current is not None and still_covers(current, p.user):
                p.user = current  # only given more: the connection goes on with it
                continue
            log.info("ending a %s connection of user %r: its record %s", p.door, name,
                     "was removed" if current is None else "changed")
            if p.shut_out is not None:
                p.shut_out()

    # -- budgets: what each door applies -------------------------------------------------

    @property
    def auth_timeout_s(self) -> float | None:
        """A connection that has not logged in by then is closed (None: never)."""
        ms = self.config.auth_timeout_ms
        return ms / 1000 if ms and self.needs_auth else None

    @property
    def connect_timeout_s(self) -> float:
        """An MQTT connection without an accepted CONNECT (or a WebSocket without its upgrade) by then
        is closed: auth_timeout_ms, which MQTT applies with or without authentication."""
        return (self.config.auth_timeout_ms or 10_000) / 1000

    @property
    def preauth_max_bytes(self) -> int | None:
        """The largest request before a login (RESP: per argument; MQTT: the CONNECT; the UI: the
        login form); None on a broker that asks for no login."""
        return self.config.preauth_max_bulk if self.needs_auth else None

    @property
    def request_timeout_s(self) -> float:
        ms = self.config.request_timeout_ms
        return ms / 1000 if ms else float("inf")

    @property
    def idle_timeout_s(self) -> float:
        ms = self.config.idle_timeout_ms
        return ms / 1000 if ms else float("inf")

    @property
    def output_timeout_s(self) -> float:
        return self.config.output_timeout_ms / 1000

    @property
    def handshake_timeout_s(self) -> float:
        return self.config.tls_handshake_timeout_ms / 1000


def still_covers(current: User, before: User) -> bool:
    """``current`` keeps the password and every grant of ``before`` (it may have more)."""
    return current.credential == before.credential and set(before.grants) <= set(current.grants)


def client_host(stream: Any) -> str:
    """The client's host (no port) of a socket stream, TLS or not: what logins are throttled by."""
    try:
        return str(stream.extra(SocketAttribute.remote_address)[0])
    except (anyio.TypedAttributeLookupError, TypeError, IndexError):  # a Unix socket, a wrapper without it
        return ""
