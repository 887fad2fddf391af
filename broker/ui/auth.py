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
from typing import Any

from fencemq.ops.users import DEFAULT_USER, User

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
