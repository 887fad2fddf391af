"""Every error FenceMQ can report, in one table.

A Lua fence fails with ``raise('CODE', message)`` (lua/lib/base.lua); the first
word is the code. The same code is the RESP error word a worker sends to its
client and selects the Python exception the SDK raises, so a failure reads the
same in every layer. :data:`TABLE` is the one place a code is defined:
tests/fences/test_headers.py fails on a Lua ``raise`` of a code that is not in
it, and on a code defined twice.
"""

from __future__ import annotations

import builtins
import re
from dataclasses import dataclass

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
    code = "BADARG"


class NoAuth(FenceMQError):
    code = "NOAUTH"


class WrongPassword(FenceMQError):
    code = "WRONGPASS"


class NoPermission(FenceMQError):
    code = "NOPERM"


class Busy(FenceMQError):
    code = "BUSY"


class Stale(FenceMQError):
    code = "STALE"


class LimitExceeded(FenceMQError):
    code = "LIMIT"


class NotFound(FenceMQError):
    code = "NOTFOUND"


class PriorityOff(FenceMQError):
    """PUB … PRIORITY to a queue that does not honour priority (docs/protocol.md, "Priority")."""

    code = "NOPRIORITY"


class Full(FenceMQError):
    """A publish refused because the broker's Redis is above its memory watermark (or at maxmemory)."""

    code = "FULL"


class EvictingRedis(FenceMQError):
    """The broker's Redis may evict keys (``maxmemory-policy`` is not ``noeviction``): a worker refuses to
    start on it, the CLI's writes refuse to run, and publishes are refused while it stays so."""

    code = "EVICTING"


class TransactionAborted(FenceMQError):
    """EXEC of a transaction that had a command refused while it was queued: nothing ran."""

    code = "EXECABORT"


class InternalError(FenceMQError):
    """A fence failed inside Redis with an error no fence raises on purpose (a bug, or a key of the wrong type)."""

    code = "INTERNAL"


class TryAgain(FenceMQError):
    """The broker's Redis could not run the command now: a lost connection, a timeout, a failover or
    restart under way (READONLY, NOREPLICAS, MASTERDOWN, LOADING, CLUSTERDOWN, TRYAGAIN, MOVED/ASK
    past their retries). It may or may not have run: send it again (broker/fences/redis_errors.py)."""

    code = "TRYAGAIN"


class OutOfMemory(FenceMQError):
    """The broker's Redis is at its ``maxmemory`` and refuses writes (Redis's own ``OOM``): nothing was
    written. Consume (ACK) or purge to free memory, or raise maxmemory; then send it again."""

    code = "OOM"


class PersistenceFailing(FenceMQError):
    """The broker's Redis refuses writes because it cannot persist (Redis's own ``MISCONF``: a failed
    RDB/AOF write with stop-writes-on-bgsave-error): nothing was written. An operator must fix the disk."""

    code = "MISCONF"


class Unconfirmed(FenceMQError):
    """The command ran, but the ``durability`` setting's confirmation (WAIT for replicas, WAITAOF for
    the AOF) did not come in time: a failover may still undo it. Send it again (a PUB with the same
    ID stores nothing twice; an ACK of a settled tag settles nothing)."""

    code = "UNCONFIRMED"


class UnknownCommand(FenceMQError):
    """A verb the worker does not speak: Redis's own word, ``ERR``."""


@dataclass(frozen=True, slots=True)
class ErrorCode:
    code: str  # the RESP error word, and the first word of a fence's error
    exception: type[FenceMQError]
    meaning: str
    # Safe and sensible to send again unchanged after a pause: the failure was Redis's state, not the request.
    retriable: bool = False


TABLE: tuple[ErrorCode, ...] = (
    ErrorCode("ERR", FenceMQError, "a generic error: wrong arity, an unknown command (as Redis says it)"),
    ErrorCode("BADARG", BadArgument, "the request is malformed or out of range; nothing was changed"),
    ErrorCode("NOAUTH", NoAuth, "authenticate first (AUTH, or HELLO … AUTH)"),
    ErrorCode("WRONGPASS", WrongPassword, "the user name or password is wrong"),
    ErrorCode("NOPERM", NoPermission, "the caller may not do this (another client's handle, a missing permission)"),
    ErrorCode("BUSY", Busy, "an exclusive subscription with POLICY reject is held by another client"),
    ErrorCode("STALE", Stale, "the caller acted on an epoch or session that has since moved on"),
    ErrorCode("LIMIT", LimitExceeded, "a size, count or quota limit was reached; nothing was changed"),
    ErrorCode("NOTFOUND", NotFound, "no such subscription, queue or member (any more)"),
    ErrorCode("NOPRIORITY", PriorityOff, "PUB … PRIORITY to a queue not set to honour priority (`fencemq priority set "
              "TOPIC on`; lite queues and filter subscriptions never do), or priority switched while the queue's log "
              "holds messages; nothing was changed"),
    ErrorCode("FULL", Full, "the broker's Redis is above its memory watermark: publishing is refused until consumers "
              "drain it below the low watermark (or an operator raises maxmemory); consuming always works; nothing "
              "was stored: send it again later", True),
    ErrorCode("EVICTING", EvictingRedis, "the broker's Redis may evict keys (maxmemory-policy is not noeviction): "
              "set it to noeviction; until then workers do not start and publishing is refused: send it again once "
              "an operator did", True),
    ErrorCode("EXECABORT", TransactionAborted, "EXEC found a command refused while queued; none of them ran"),
    ErrorCode("INTERNAL", InternalError, "a fence failed inside Redis unexpectedly; the reply names it, the worker "
              "logged it"),
    ErrorCode("TRYAGAIN", TryAgain, "the broker's Redis is failing over, restarting or unreachable; the command "
              "may or may not have run: send it again (a PUB with the same ID stores nothing twice)", True),
    ErrorCode("OOM", OutOfMemory, "the broker's Redis is out of memory (maxmemory) and refuses writes; nothing "
              "was written: consume or purge to free memory, then send it again", True),
    ErrorCode("MISCONF", PersistenceFailing, "the broker's Redis cannot persist (RDB/AOF write failed) and refuses "
              "writes; nothing was written: an operator must fix its disk, then send it again", True),
    ErrorCode("UNCONFIRMED", Unconfirmed, "the command ran but the durability setting's replicas/AOF did not "
              "confirm it in time, so a failover may undo it: send it again (the same PUB ID stores nothing "
              "twice)", True),
)

RETRIABLE: frozenset[str] = frozenset(e.code for e in TABLE if e.retriable)
# What a fence may raise itself; the retriable codes name Redis's state, never a fence's verdict.
_FENCE_CODES: tuple[str, ...] = tuple(e.code for e in TABLE if not e.retriable and e.code != "ERR")

_REDIS_BUSY = "BUSY Redis is busy"

BY_CODE: dict[str, type[FenceMQError]] = {e.code: e.exception for e in TABLE}


class ConnectionLost(redis.exceptions.ConnectionError, builtins.ConnectionError):
    """SDK: the connection is gone; every pending and later call on the client raises this."""


class SessionTakenOver(ConnectionLost):
    """SDK: another connection took this client id's session over (``TAKEOVER``); this client no longer acts
    for it. Connect again (with TAKEOVER) to take it back."""


class SessionExpired(NotFound):
    """SDK: the session ended while the client was away (it reconnected after its lease ran out, or
    the session was ended meanwhile): every subscription it held is gone, and so are its checkouts —
    what it had fetched was handed to others. Subscribe again; its publishes went on."""


class EndOfStream(Exception):
    """SDK: a push subscription reached its end (``TAKE`` replied ``EOS``)."""


_SCRIPT_SUFFIX = re.compile(r"\s*script: [0-9a-f]+, on @user_script:\d+\.?$")


def from_reply(text: str) -> FenceMQError:
    """Turn an error line (from a Lua script or a worker) into its exception."""
    # Redis 7 appends where in the script the error was raised; clients need not see it.
    text = _SCRIPT_SUFFIX.sub("", text.strip())
    code, _, message = text.partition(" ")
    cls = BY_CODE.get(code)
    if cls is None:
        return FenceMQError(text)
    return cls(message)


def translate(exc: BaseException) -> FenceMQError | None:
    """Map a redis-py ResponseError raised by a fence to a FenceMQError, else None.

    Only the codes fences raise: Redis's own refusals (OOM, MISCONF, TRYAGAIN, READONLY…) are named by
    fencemq.fences.redis_errors, with what to do."""
    text = str(exc)
    if isinstance(exc, redis.exceptions.NoPermissionError) and "@user_script" in text:
        # redis-py strips a NOPERM prefix it knows; from a fence (not Redis's ACL) it is ours
        return from_reply("NOPERM " + text)
    if text.startswith(_REDIS_BUSY):
        return None  # Redis's own BUSY (a script outran lua-time-limit), not an exclusive subscription's
    for code in _FENCE_CODES:
        if text.startswith(code + " ") or text == code:
            return from_reply(text)
    # Lua errors may be wrapped: "Error running script ...: @user_script:12: BADARG ..."
    for code in _FENCE_CODES:
        marker = f" {code} "
        if marker in text:
            return from_reply(text[text.index(marker) + 1 :])
    return None
