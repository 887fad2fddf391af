"""Who is logged in to the UI, what they may do, and the CSRF token of their forms.

Login is as a FenceMQ user (broker/ops/users.py): the name and password of
``fencemq user add``, checked by :meth:`UserStore.authenticate`. The legacy
password (``--password`` / ``$FENCEMQ_PASSWORD``) is the ``default`` user, with
every permission, as it is for the workers. A broker with no password and no
users is open to every client, so the UI is too: the ``default`` user logs in
with an empty password (still a login, a CSRF token and a confirmation before
any write). docs/ui.md says the same.

Sessions live in this process's memory (a random token in an HttpOnly,
SameSite=Strict cookie): a restart logs everybody out, and each process that
serves the UI has its own.
"""

from __future__ import annotations

import hmac
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from fencemq.ops.users import DEFAULT_USER, User, UserStore, default_user

COOKIE = "fencemq_ui"
SESSION_S = 8 * 3600
# The operator actions the UI offers, each under the permission that guards it.
ACTION_PERMISSION = {"evict": "evict", "seek": "seek", "purge": "purge", "replay": "dlq", "discard": "dlq"}


@dataclass
class Login:
    user: User
    csrf: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    expires: float = field(default_factory=lambda: time.monotonic() + SESSION_S)

    def may(self, action: str, topic: str = "#") -> bool:
        return self.user.may(ACTION_PERMISSION[action], topic)

    def may_any(self, topic: str = "#") -> bool:
        return any(self.may(a, topic) for a in ACTION_PERMISSION)

    def csrf_ok(self, token: Any) -> bool:
        return isinstance(token, str) and hmac.compare_digest(token, self.csrf)


class Logins:
    """Tokens to logins, in memory."""

    def __init__(self, password: str | None) -> None:
        self.password = password
        self._by_token: dict[str, Login] = {}

    async def authenticate(self, store: UserStore, name: str, password: str) -> User | None:
        if name == DEFAULT_USER:
            if self.password is None:
                return None if await store.any() else default_user()
            return default_user() if hmac.compare_digest(password.encode(), self.password.encode()) else None
        return await store.authenticate(name, password)

    def start(self, user: User) -> str:
        token = secrets.token_urlsafe(32)
        self._by_token[token] = Login(user)
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
