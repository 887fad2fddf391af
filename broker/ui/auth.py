"""Who is logged in to the UI, what they may see and do, and the CSRF token of their forms.

The UI is a door of the gate (fencemq.server.gate), as RESP and MQTT are: a login is the gate's
``log_in`` (throttled per address, one check at a time per address, the password hashes bounded),
every page and action asks the gate's one matcher, and the UI's event streams are connections
the gate counts. The UI only turns the answers into HTTP: a redirect to ``/login``, 401, 403, 413,
429, 503.

* On a broker with users (``serve --users``, or users in its Redis for ``fencemq dashboard``)
  every page needs a login and the ``inspect`` grant, ``default`` never logs in, and a payload is
  shown only with the ``subscribe`` grant on its topic. With the legacy password alone
  (``--password``), ``default`` logs in with it, with every permission, as on the wire. On an open
  broker (no password, no users) reading needs no login, and ``default`` logs in without a password
  for the actions (still a login, a CSRF token and a confirmation before any write).
* A login is held to its user's current record at every request: a changed or removed user's UI
  sessions end.

Sessions live in this process's memory (a random token in an HttpOnly, SameSite=Strict cookie): a
restart logs everybody out, and each process that serves the UI has its own.
"""

from __future__ import annotations

import hmac
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from urllib.parse import parse_qsl, urlencode

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response, StreamingResponse

from fencemq.config import Config
from fencemq.errors import BadArgument, NoPermission
from fencemq.model.keys import Keyspace
from fencemq.ops.users import DEFAULT_USER, User, UserStore
from fencemq.server.gate import Gate, Pass

COOKIE = "fencemq_ui"
SESSION_S = 8 * 3600
# The operator actions the UI offers, each under the permission that guards it.
ACTION_PERMISSION = {"evict": "evict", "seek": "seek", "purge": "purge", "replay": "dlq", "discard": "dlq"}
MAX_LOGINS = 10_000  # logins kept per process; the oldest go first


@dataclass
class Login:
    user: User
    csrf: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    expires: float = field(default_factory=lambda: time.monotonic() + SESSION_S)

    def may(self, action: str, topic: str = "#") -> bool:
        """What the page offers (the POST is checked again by the gate, with the same matcher)."""
        return self.user.may(ACTION_PERMISSION[action], topic)

    def may_any(self, topic: str = "#") -> bool:
        return any(self.may(a, topic) for a in ACTION_PERMISSION)

    def csrf_ok(self, token: Any) -> bool:
        return isinstance(token, str) and hmac.compare_digest(token, self.csrf)


class Logins:
    """Tokens to logins, in memory."""

    def __init__(self) -> None:
        self._by_token: dict[str, Login] = {}

    def start(self, user: User) -> str:
        token = secrets.token_urlsafe(32)
        self._by_token[token] = Login(user)
        while len(self._by_token) > MAX_LOGINS:
            del self._by_token[next(iter(self._by_token))]
        return token

    def get(self, token: str | None) -> Login | None:
        if not token:
            return None
        login = self._by_token.get(token)
        if login is None:
            return None
        if login.expires < time.monotonic():
            del self._by_token[token]
            return None
        return login

    def end(self, token: str | None) -> None:
        if token:
            self._by_token.pop(token, None)


def same_record(login: User, current: User | None) -> bool:
    """The login's user is still the user of this record: same password, same grants."""
    if current is None:
        return False
    if login.name == DEFAULT_USER and login.superuser:
        return current.superuser
    return current.credential == login.credential and set(current.grants) == set(login.grants)


class UIGate:
    """What the UI asks of its gate for each request (a mixin of fencemq.ui.app.UI)."""

    gate: Gate | None
    logins: Logins
    password: str | None
    redis: Any
    keys: Keyspace

    def login(self, request: Request) -> Login | None:
        """The request's login, as :meth:`resolve` found it."""
        return getattr(request.state, "login", None)

    def error(self, request: Request, exc: Exception, status: int = 400) -> Response: ...

    def render(self, request: Request, template: str, status: int = 200, **context: Any) -> Response: ...

    async def posted_form(self, request: Request, back: Callable[[dict[str, str]], str],
                          why: str) -> tuple[Login, Any] | Response:
        """A form a logged-in user posted, its CSRF token checked: (login, form); else the answer to send,
        the login page (coming back to ``back(the small form read before any login)``, saying ``why``)
        or a 403."""
        login = await self.resolve(request)
        if login is None:
            form = await small_form(request, PREAUTH_FORM_BYTES) or {}
            return self.render(request, "login.html", status=401, page="login", next=back(form), failed=why)
        form = await request.form()
        if not login.csrf_ok(form.get("csrf")):
            return self.error(request, BadArgument("the form's CSRF token does not match your login; reload the "
                                                   "page"), 403)
        return login, form

    def own_gate(self) -> Gate:
        """``fencemq dashboard``'s gate: the broker's password, and the users in its Redis."""
        return Gate(Config(prefix=self.keys.prefix, password=self.password), UserStore(self.redis, self.keys.users),
                    keys=self.keys)

    async def resolve(self, request: Request) -> Login | None:
        """The request's login, held to its user's record of now: a changed or removed user's ends."""
        token = request.cookies.get(COOKIE)
        login = self.logins.get(token)
        if login is not None:
            assert self.gate is not None
            if not same_record(login.user, await self.gate.current(login.user)):
                self.logins.end(token)
                login = None
        request.state.login = login
        return login

    async def refused(self, request: Request, topic: str) -> Response | None:
        """None when the request may read about ``topic`` (``#``: the whole broker); else the response
        that says why not. On a broker with a password or users every page needs a login, and then the
        user's inspect grant; an open broker (no password, no users) lets anybody read."""
        assert self.gate is not None
        login = await self.resolve(request)
        if login is None:
            if self.gate.needs_auth or await self.gate.users_exist():
                path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
                return RedirectResponse("/login?" + urlencode({"next": path}), status_code=303)
            return None
        try:
            self.gate.check(login.user, "inspect", topic)
        except NoPermission as exc:
            return self.error(request, exc, 403)
        return None

    def shows_payload(self, request: Request, topic: str) -> bool:
        """A message's payload is read, on any door, only with the subscribe grant on its topic."""
        assert self.gate is not None
        login = self.login(request)
        return self.gate.allows(login.user if login else None, "subscribe", topic)


PREAUTH_FORM_BYTES = 16_384  # a login form before any login, on a broker that asks for none (else the gate's)


class CountedStream(StreamingResponse):
    """An event stream, counted by the gate as one of the worker's connections while it is open."""

    def __init__(self, content: Any, gate: Gate, gate_pass: Pass, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.gate, self.gate_pass = gate, gate_pass

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.gate.leave(self.gate_pass)


async def small_form(request: Request, limit: int) -> dict[str, str] | None:
    """An url-encoded form of at most ``limit`` bytes, refused (None) from its Content-Length or as
    it streams in, before more is read."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        return None
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return None
    return dict(parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True))


def client_address(request: Request) -> str:
    return request.client.host if request.client else ""


def safe_next(nxt: str | None) -> str:
    """Only a path of this site (no scheme, no host): an open redirect is a phishing aid."""
    if not nxt or not nxt.startswith("/") or nxt.startswith("//") or "\\" in nxt:
        return "/"
    return nxt
