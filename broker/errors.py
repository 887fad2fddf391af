"""Every error FenceMQ can report, in one place.

A Lua fence fails with ``redis.error_reply("CODE message")``; the first word is
the code. The same code is the RESP error word a worker sends to its client and
selects the Python exception the SDK raises, so a failure reads the same in
every layer.
"""

from __future__ import annotations

import builtins
import re

import redis.exceptions


class FenceMQError(Exception):
    """Base class; ``code`` is the RESP error word."""

    code = "ERR"

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.message = message

    def resp(self) -> str:
        """The RESP error line (without the leading '-')."""
        return f"{self.code} {self.message}" if self.message else self.code


class BadArgument(FenceMQError):
    """The request is malformed; nothing was changed."""

    code = "BADARG"


class NoAuth(FenceMQError):
    code = "NOAUTH"


class WrongPassword(FenceMQError):
    code = "WRONGPASS"


class NoPermission(FenceMQError):
    code = "NOPERM"


class Busy(FenceMQError):
    """An exclusive subscription with POLICY reject is held by another client."""

    code = "BUSY"


class Stale(FenceMQError):
    """The caller acted on an epoch or session that has since moved on."""

    code = "STALE"


class LimitExceeded(FenceMQError):
    code = "LIMIT"


class NotFound(FenceMQError):
    code = "NOTFOUND"


class UnknownCommand(FenceMQError):
    code = "ERR"


class ConnectionLost(redis.exceptions.ConnectionError, builtins.ConnectionError):
    """SDK: the connection is gone; every pending and later call on the client raises this."""


class EndOfStream(Exception):
    """SDK: a push subscription reached its end (``TAKE`` replied ``EOS``)."""


_BY_CODE: dict[str, type[FenceMQError]] = {
    cls.code: cls
    for cls in (FenceMQError, BadArgument, NoAuth, WrongPassword, NoPermission, Busy, Stale, LimitExceeded, NotFound)
}


_SCRIPT_SUFFIX = re.compile(r"\s*script: [0-9a-f]+, on @user_script:\d+\.?$")


def from_reply(text: str) -> FenceMQError:
    """Turn an error line (from a Lua script or a worker) into its exception."""
    # Redis 7 appends where in the script the error was raised; clients need not see it.
    text = _SCRIPT_SUFFIX.sub("", text.strip())
    # redis-py prefixes script errors with the script context on some versions
    code, _, message = text.partition(" ")
    cls = _BY_CODE.get(code)
    if cls is None:
        return FenceMQError(text)
    return cls(message)


def translate(exc: BaseException) -> FenceMQError | None:
    """Map a redis-py ResponseError raised by a fence to a FenceMQError, else None."""
    text = str(exc)
    for code in _BY_CODE:
        if code != "ERR" and (text.startswith(code + " ") or text == code):
            return from_reply(text)
    # Lua errors may be wrapped: "Error running script ...: @user_script:12: BADARG ..."
    for code in _BY_CODE:
        marker = f" {code} "
        if code != "ERR" and marker in text:
            return from_reply(text[text.index(marker) + 1 :])
    return None
