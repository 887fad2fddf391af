"""Every Redis failure, by name: what a client is told when the broker's Redis fails a command.

Redis is a replicated service that fails over, restarts and fills up; a
client of FenceMQ must read each of those as a documented code with what to
do (broker/errors.py), never as ``INTERNAL`` (kept for a fence that fails
inside Redis with an error no fence raises: a bug, a key of the wrong type)
and never as a dropped connection. Every door — RESP, MQTT, the web UI —
answers through :func:`redis_failure`.

- ``TRYAGAIN``: the command met Redis unavailable — the connection lost or
  timed out, a failover under way (``READONLY`` from a demoted primary,
  ``NOREPLICAS`` under ``min-replicas-to-write``, ``MASTERDOWN``,
  ``CLUSTERDOWN``, Cluster's own ``TRYAGAIN``, ``MOVED``/``ASK`` past the
  client's redirections), a restart (``LOADING``), a script outrunning
  ``lua-time-limit`` (``BUSY Redis is busy``). It may or may not have run.
- ``OOM``: Redis is at ``maxmemory`` and refuses writes; nothing was written.
- ``MISCONF``: Redis cannot persist and refuses writes; nothing was written.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

from redis.exceptions import (
    AskError,
    ClusterError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from fencemq.errors import FenceMQError, InternalError, OutOfMemory, PersistenceFailing, TryAgain, translate

log = logging.getLogger(__name__)

# What a call to Redis may raise besides a fence's own coded error: catch these where Redis is called.
REDIS_FAILURES: tuple[type[BaseException], ...] = (RedisError, RedisClusterException, OSError)

# Redis's replies (first word) that mean "not now": a failover, a restart, a Cluster reconfiguring.
UNAVAILABLE_WORDS = frozenset({"READONLY", "NOREPLICAS", "MASTERDOWN", "LOADING", "CLUSTERDOWN", "TRYAGAIN",
                               "MOVED", "ASK", "UNBLOCKED"})
_WORD = re.compile(r"(?:^|[\s:-])(READONLY|NOREPLICAS|MASTERDOWN|LOADING|CLUSTERDOWN|TRYAGAIN|MOVED|ASK|UNBLOCKED"
                   r"|OOM|MISCONF)\b")
_SHA = re.compile(r"(?:script: |f_)([0-9a-f]{40})")
_WARN_EVERY_S = 1.0
_last_warned: dict[str, float] = {}
_logged: set[tuple[str, str]] = set()  # (fence, first words of the error) already logged by this process
_MAX_LOGGED = 1000


def _warn(message: str, verb: str, said: str) -> None:
    """A warning, at most once a second per kind: a failover fails thousands of commands."""
    now = time.monotonic()
    kind = message[:12] + said[:24]
    if now - _last_warned.get(kind, -_WARN_EVERY_S) >= _WARN_EVERY_S:
        if len(_last_warned) > 1000:
            _last_warned.clear()
        _last_warned[kind] = now
        log.warning(message, verb, said)


def _said(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:160] or type(exc).__name__


def reason(exc: BaseException) -> str:
    """What went wrong, in one short line: the Redis word (or the exception's name) and its message."""
    return f"{redis_word(exc) or type(exc).__name__}: {_said(exc)[:120]}"


def redis_word(exc: BaseException) -> str | None:
    """The Redis error word behind a redis-py exception (``READONLY``, ``OOM``…), when it has one.

    redis-py strips the words it knows from the message (keeping them in
    ``status_code``); a script's ``redis.call`` that failed keeps its word first
    (Redis 7) or after ``-`` inside the wrapped message (Redis 6)."""
    word = getattr(exc, "status_code", None)
    if word:
        return str(word)
    text = str(exc)
    if text.startswith("BUSY Redis is busy"):
        return "BUSY"
    match = _WORD.search(text[:200])
    return match.group(1) if match else None


def unavailable(exc: BaseException) -> bool:
    """True for a failure that says Redis cannot serve now (TRYAGAIN), whatever the command."""
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError, ClusterError, RedisClusterException, AskError,
                        TryAgainError, ReadOnlyError, OSError)):
        return True
    if isinstance(exc, ResponseError):
        word = redis_word(exc)
        return word in UNAVAILABLE_WORDS or word == "BUSY"
    return False


def redis_failure(exc: BaseException, verb: str = "the command", fences: Any = None, *,
                  quiet: bool = False) -> FenceMQError:
    """The reply to a command that failed in Redis: a documented code and what to do.

    ``fences`` (a fences.registry.Fences) names the fence a script error came
    from. A fence's own coded error (BADARG, STALE…) comes back as itself.
    ``quiet``: the caller says it itself (Redis's state is not logged here).
    """
    warn = (lambda *a: None) if quiet else _warn
    if isinstance(exc, FenceMQError):
        return exc
    if isinstance(exc, ResponseError) and (mapped := translate(exc)) is not None:
        return mapped
    word = redis_word(exc)
    if isinstance(exc, OutOfMemoryError) or word == "OOM":
        warn("%s refused: Redis is out of memory (%s)", verb, _said(exc))
        return OutOfMemory(f"the broker's Redis is out of memory (maxmemory) and refused {verb}; nothing was "
                           f"written: consume (ACK) or purge to free memory, then send it again")
    if word == "MISCONF":
        log.error("%s refused: Redis cannot persist (%s)", verb, _said(exc))
        return PersistenceFailing(f"the broker's Redis cannot persist (RDB/AOF write failed) and refused {verb}; "
                                  f"nothing was written: send it again once an operator fixed its disk")
    if unavailable(exc):
        warn("%s failed against Redis: %s", verb, _said(exc))
        why = word or type(exc).__name__
        return TryAgain(f"the broker's Redis is unavailable during {verb} ({why}: {_said(exc)[:100]}); it may or "
                        f"may not have run: send it again (a PUB with the same ID stores nothing twice)")
    if isinstance(exc, ResponseError):
        text = " ".join(str(exc).split())
        match = _SHA.search(text)
        sha = match.group(1) if match else ""
        scripts = getattr(fences, "scripts", {}) if sha else {}
        fence = next((name for name, script in scripts.items() if script.sha == sha), "a Redis command")
        key = (fence, text[:80])
        if key not in _logged and len(_logged) < _MAX_LOGGED:
            _logged.add(key)
            log.error("fence %s failed inside Redis during %s: %s", fence, verb, text[:500])
        return InternalError(f"fence {fence} failed inside Redis during {verb}; the worker logged it "
                             f"({text[:160]})")
    warn("%s failed against Redis: %s", verb, _said(exc))
    return TryAgain(f"the broker's Redis failed during {verb} ({type(exc).__name__}: {_said(exc)[:100]}); "
                    f"send it again")


