"""Helpers shared by the CLI commands: Redis URLs, reachability, one-line errors."""

from __future__ import annotations

import os
import sys
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

ENV_REDIS_URL = "FENCEMQ_REDIS_URL"
EXIT_UNREACHABLE = 2  # no Redis URL, or the Redis at it does not answer


class CliError(Exception):
    """A failure the user can fix: printed as one line to stderr, then exit ``code``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def fail(command: str, error: CliError) -> None:
    print(f"fencemq {command}: {error.message}", file=sys.stderr, flush=True)


def redis_url_given(flag: str | None) -> str | None:
    """--redis-url, else $FENCEMQ_REDIS_URL, else None (empty strings count as unset)."""
    return flag or os.environ.get(ENV_REDIS_URL) or None


def broker_redis(command: str, flag: str | None, prefix: str | None) -> tuple[str, str]:
    """The Redis URL and key prefix a command works on: --redis-url, else $FENCEMQ_REDIS_URL, else the
    private Redis of the one `fencemq serve` running here (cli/local_broker.py; said on stderr). Else its
    one-line error and exit 2 (no URL, or a bad prefix)."""
    from fencemq.errors import BadArgument
    from fencemq.model.keys import Keyspace

    url = redis_url_given(flag)
    local = None if url else _the_local_broker(command)
    key_prefix = prefix or os.environ.get("FENCEMQ_PREFIX") or (local.prefix if local else None) or "fmq"
    try:
        Keyspace(key_prefix)
    except BadArgument as exc:
        fail(command, CliError(f"bad prefix {key_prefix!r}: {exc}"))
        raise SystemExit(EXIT_UNREACHABLE) from None
    if local is not None:
        url = local.redis_url
        print(f"fencemq {command}: the broker of `fencemq serve` here (pid {local.pid}, worker {local.worker}): "
              f"redis {safe_url(url)}, prefix {key_prefix}", file=sys.stderr, flush=True)
    return url, key_prefix  # type: ignore[return-value]


def _the_local_broker(command: str):
    from fencemq.cli.local_broker import running, runtime_dir

    found = running()
    if len(found) == 1:
        return found[0]
    if not found:
        message = (f"no Redis URL: pass --redis-url or set {ENV_REDIS_URL} to the broker's Redis (and no "
                   f"`fencemq serve` of this user with a private Redis runs here: {runtime_dir()} has none)")
    else:
        which = "; ".join(f"pid {b.pid}, worker {b.worker}, since {b.started}: {b.path}" for b in found)
        message = (f"{len(found)} `fencemq serve` with a private Redis run here ({which}); say which with "
                   f"--redis-url or {ENV_REDIS_URL} (the URL is the record's redis_url)")
    fail(command, CliError(message, EXIT_UNREACHABLE))
    raise SystemExit(EXIT_UNREACHABLE)


def safe_url(url: str) -> str:
    """The URL without its password, for messages and logs."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        user = f"{parts.username}:***@" if parts.username else ":***@"
        netloc = user + host + (f":{parts.port}" if parts.port else "")
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    except ValueError:
        return "<unparsable URL>"


def unreachable_message(url: str, exc: BaseException | None) -> str:
    why = f" ({type(exc).__name__}: {exc})" if exc is not None else ""
    shown = safe_url(url)
    return f"cannot reach Redis at {shown}{why}; is Redis running at {shown}? set --redis-url or {ENV_REDIS_URL}"


def async_client(url: str, cluster: bool):
    """The asyncio client the operator commands use (the URL has answered connect() already): the
    worker's own (fences/redis_client.py), so every URL a worker takes — a Cluster node, a
    ``redis+sentinel://`` one — the CLI takes too. With connect(), the one place the CLI makes a client."""
    from fencemq.fences.redis_client import connect as worker_client
    from fencemq.fences.redis_servers import cluster_client

    options = {"socket_connect_timeout": 3, "socket_timeout": 30, "max_connections": 16}
    return cluster_client(url, **options) if cluster else worker_client(url, **options)


def _sync_client(url: str, **kwargs: object) -> redis.Redis:
    """A blocking client for ``url``, read as the worker reads it (fences/redis_servers.py)."""
    from fencemq.fences.redis_servers import is_sentinel_url, parse_sentinel_url

    if not is_sentinel_url(url):
        return redis.Redis.from_url(url, **kwargs)
    from redis.sentinel import Sentinel, SentinelManagedSSLConnection

    target = parse_sentinel_url(url)  # BadArgument when malformed
    options = {**target.redis_options, **kwargs}
    options.pop("ssl", None)
    if target.tls:
        options["connection_class"] = SentinelManagedSSLConnection
    sentinel = Sentinel(list(target.sentinels), sentinel_kwargs={"socket_timeout": 3, "socket_connect_timeout": 3,
                                                                 **target.sentinel_options})
    return sentinel.master_for(target.service, **options)


def connect(url: str, **kwargs: object) -> redis.Redis:
    """A redis-py client that has answered PING; CliError(code 2) otherwise.

    No retries: an operator asking for status wants an answer in a second or
    two, not after redis-py's backoff schedule.
    """
    from fencemq.errors import BadArgument

    try:
        client = _sync_client(url, socket_connect_timeout=3, socket_timeout=10, retry=Retry(NoBackoff(), 0), **kwargs)
    except (ValueError, BadArgument) as exc:
        raise CliError(
            f"{safe_url(url)!r} is not a Redis URL ({exc}); give one like redis://host:6379/0 "
            f"with --redis-url or {ENV_REDIS_URL}",
            EXIT_UNREACHABLE,
        ) from None
    try:
        client.ping()
    except redis.AuthenticationError as exc:
        client.close()
        raise CliError(
            f"Redis at {safe_url(url)} refused the credentials ({exc}); put the right password in the URL "
            f"(redis://:password@host:port/0)",
            EXIT_UNREACHABLE,
        ) from None
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        client.close()
        raise CliError(unreachable_message(url, exc), EXIT_UNREACHABLE) from None
    except redis.ResponseError as exc:  # e.g. NOAUTH from a server that needs a password
        client.close()
        raise CliError(
            f"Redis at {safe_url(url)} answered PING with an error ({exc}); check the URL's password and database",
            EXIT_UNREACHABLE,
        ) from None
    return client


def text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)
