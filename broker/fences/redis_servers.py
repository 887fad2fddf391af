"""Reaching the broker's Redis through failovers: one server, a Cluster, or a primary behind Sentinel.

``--redis-url`` takes three forms (docs/operations.md, "Replicas, failover and Sentinel"):

- ``redis://host:port/db`` or ``rediss://…`` (TLS): one server — or any node of
  a Cluster, which the worker finds out by asking (``INFO cluster``);
- ``redis+sentinel://[user:password@]h1:26379,h2:26379/mymaster[/db]`` (and
  ``rediss+sentinel://`` for TLS to the Sentinels and to Redis): the primary
  Sentinel names, asked again at every new connection, so a worker follows
  every promotion. ``sentinel_username``/``sentinel_password`` in the query
  authenticate to the Sentinels; the URL's own user and password are Redis's.

**What the worker's client retries.** Only what never left it: a connection
that could not be made (refused, timed out, reset before anything was
written on it, a server still LOADING or answering the handshake with an
error) is tried again for up to
``connect_patience_s`` — nothing was sent, so nothing can run twice. A
command whose connection broke after it was written, or whose reply did not
come within the socket timeout, is never sent again by the client: it may
have run (a publish stored, a lease made), and only the caller knows whether
running it twice is safe. The client that sent it gets TRYAGAIN
(fences/redis_errors.py) and sends it again itself — a ``PUB … ID`` is
deduplicated by the fence. The Cluster client retries the same way: a node
it could not reach, ``CLUSTERDOWN`` and an uncovered slot (nothing ran), and
it follows ``MOVED``/``ASK`` (nothing ran either), never a command cut short.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

import hiredis
from redis.asyncio import Redis, RedisCluster
from redis.asyncio.cluster import ClusterPipeline, PipelineStrategy
from redis.asyncio.connection import Connection, SSLConnection, parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelManagedConnection, SentinelManagedSSLConnection
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import ClusterDownError, MasterDownError, SlotNotCoveredError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from fencemq.errors import BadArgument

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
CONNECT_PATIENCE_S = 5.0  # a connection that cannot be made is tried again this long (nothing was sent)
# a Cluster node: tried once more at once, then the Cluster client asks the other nodes where the slot went
CLUSTER_CONNECT_PATIENCE_S = 0.05
SOCKET_TIMEOUT_S = 5.0  # a reply that takes longer means the server (or its host) is gone
CONNECT_TIMEOUT_S = 1.0
HEALTH_CHECK_S = 2  # an idle connection (pub/sub's included) is PINGed before use after this long


def pack(args: tuple[Any, ...]) -> list[bytes]:
    """A command's bytes, packed by hiredis: about five times faster than redis-py's own packing,
    which was a fifth of a worker's CPU for a fence call carrying a batch of 100 messages."""
    # redis-py passes some commands as one string with a space ("SCRIPT LOAD").
    if isinstance(args[0], str) and " " in args[0]:
        args = (*args[0].split(), *args[1:])
    return [hiredis.pack_command(args)]


class NotSent(RedisConnectionError):
    """Redis could not be reached: the command never left the worker, so sending it again is safe."""


class ClosedBeforeWrite(NotSent):
    """The connection closed before a command was written on it: reset by the server, or closed by
    another task (the Cluster client drops a failed node's connections, those in use included)."""


class _Patient:
    """A connection that keeps trying to connect for a while, and says when it gave up (NotSent)."""

    patience_s = CONNECT_PATIENCE_S

    async def connect(self) -> None:
        delay, deadline = 0.05, time.monotonic() + self.patience_s
        while True:
            try:
                return await super().connect()  # type: ignore[misc]
            except NotSent as exc:
                if not isinstance(exc, ClosedBeforeWrite):  # a connection of its own gave up already
                    raise
                failed: Exception = exc  # closed during the handshake: not made, tried again like a refusal
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                failed = exc
            if time.monotonic() + delay >= deadline:
                raise NotSent(f"could not reach Redis for {self.patience_s:.1f} s: {failed}") from failed
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        # A pooled connection the server closed while it sat idle (a restart, a failover) is
        # connected again before the command goes: nothing was sent on it, nothing runs twice.
        reader = getattr(self, "_reader", None)
        if reader is not None and reader.at_eof():
            await self.disconnect()  # type: ignore[attr-defined]
        if not self.is_connected:  # type: ignore[attr-defined]
            await self.connect()
        try:
            await super().send_packed_command(command, check_health)  # type: ignore[misc]
        except RuntimeError as exc:
            # uvloop refuses to write on a transport the server has reset meanwhile (a node killed just
            # as the connection was made) with RuntimeError("… the handler is closed"), where asyncio's
            # loop raises ConnectionResetError; it checks before writing anything, so nothing was sent.
            if "closed" not in str(exc):
                raise
            raise ClosedBeforeWrite(f"the connection to Redis closed before the command was written: {exc}") from exc
        except AttributeError as exc:
            # closed by another task between the check above and the write (redis-py's write, run as a
            # task of its own, then finds no writer): nothing was sent
            if getattr(self, "_writer", True) is not None:
                raise
            raise ClosedBeforeWrite("the connection to Redis was closed before the command was written") from exc

    def pack_command(self, *args: Any) -> list[bytes]:
        return pack(args)


class FenceConnection(_Patient, Connection):
    pass


class FenceSSLConnection(_Patient, SSLConnection):
    pass


class FenceSentinelConnection(_Patient, SentinelManagedConnection):
    pass


class FenceSentinelSSLConnection(_Patient, SentinelManagedSSLConnection):
    pass


class FenceClusterConnection(FenceConnection):
    patience_s = CLUSTER_CONNECT_PATIENCE_S


class FenceClusterSSLConnection(FenceSSLConnection):
    patience_s = CLUSTER_CONNECT_PATIENCE_S


NEVER_RAN = (NotSent, ClusterDownError, MasterDownError, SlotNotCoveredError)


class _CarefulPipelineStrategy(PipelineStrategy):
    """redis-py's Cluster pipeline, but (1) it sends again only commands that never ran (no reply yet,
    or one saying so: NOT_RAN), never one that met a lost connection after it was written, and (2)
    after a master failed it refreshes the topology on the next call instead of closing every
    connection of the client (``aclose``): the other masters' commands in flight go on."""

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list[Any]:
        if not self._command_queue:
            return []
        client = self._pipe.cluster_client
        stack = self._command_queue
        # a command sent to a node by name (a confirmation: WAIT, ROLE) belongs to that node: redis-py
        # drops its target once tried, and sent again it would go anywhere. It is not sent again; one
        # that never ran says so (its caller answers UNCONFIRMED), never a reply from another node.
        targeted = {id(c) for c in stack if c.kwargs.get("target_nodes") is not None}
        first = True
        try:
            attempts = client.retry.get_retries()
            while True:
                todo = [c for c in stack if (c.result is None or isinstance(c.result, NEVER_RAN))
                        and (first or id(c) not in targeted)]
                for c in stack:
                    if not first and id(c) in targeted and c.result is None:
                        c.result = NotSent("not sent: the pipeline met a node that could not be reached")
                first = False
                try:
                    if client._initialize:
                        await client.initialize()
                    await self._execute(client, todo, raise_on_error=raise_on_error,
                                        allow_redirections=allow_redirections)
                    return [c.result for c in stack]
                except NEVER_RAN:
                    if attempts <= 0:
                        raise
                    attempts -= 1
                    client._initialize = True
                    # the client's own backoff (0.1 s doubling to 0.5 s: ~5 s in all, a promotion's
                    # length), not a fixed 0.05 s that gave up within 0.7 s, before any promotion
                    await asyncio.sleep(client.retry._backoff.compute(client.retry.get_retries() - attempts))
        finally:
            await self.reset()


class _CarefulPipeline(ClusterPipeline):
    def __init__(self, client: RedisCluster, transaction: bool | None = None) -> None:
        super().__init__(client, transaction)
        if not transaction:
            self._execution_strategy = _CarefulPipelineStrategy(self)


class FenceCluster(RedisCluster):
    """redis-py's Cluster client, retrying only what never ran (module docstring).

    (redis-py compares the exception's exact type against this tuple.)"""

    ERRORS_ALLOW_RETRY = NEVER_RAN

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> ClusterPipeline:
        if shard_hint:
            return super().pipeline(transaction, shard_hint)
        return _CarefulPipeline(self, transaction)

    def __init__(self, *args: Any, node_connection_class: type[Connection] = FenceClusterConnection,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # redis-py picks the nodes' connection class itself; nodes made later read this same dict
        self.connection_kwargs["connection_class"] = node_connection_class
        for node in self.nodes_manager.startup_nodes.values():
            node.connection_class = node_connection_class


def no_command_retries() -> Retry:
    """What the worker's connections retry by themselves once a command was written: nothing."""
    return Retry(NoBackoff(), 0)


@dataclass(frozen=True)
class SentinelTarget:
    """A ``redis+sentinel://`` URL, read: where the Sentinels are and what to ask them."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    tls: bool
    redis_options: dict[str, Any] = field(default_factory=dict)  # the primary's connections
    sentinel_options: dict[str, Any] = field(default_factory=dict)  # the Sentinels' connections


def is_sentinel_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in SENTINEL_SCHEMES


def parse_sentinel_url(url: str) -> SentinelTarget:
    """``redis+sentinel://[user:pass@]h1:26379,h2:26379/service[/db][?options]``; BadArgument when malformed."""
    scheme, _, rest = url.partition("://")
    tls = scheme.lower() == "rediss+sentinel"
    parts = urlsplit("//" + rest)
    netloc = parts.netloc
    userinfo, _, hosts = netloc.rpartition("@")
    sentinels = []
    for hostport in filter(None, hosts.split(",")):
        host, colon, port = hostport.rpartition(":")
        if not colon:
            host, port = hostport, "26379"
        try:
            sentinels.append((host.strip("[]"), int(port)))
        except ValueError:
            raise BadArgument(f"Sentinel address {hostport!r} in the Redis URL has no valid port") from None
    path = [p for p in parts.path.split("/") if p]
    if not sentinels or not path:
        raise BadArgument("a Sentinel URL is redis+sentinel://host:26379[,host:26379…]/service-name[/db]: "
                          f"{url.split('@')[-1]!r} names no Sentinel or no service")
    options: dict[str, Any] = dict(parse_url("redis://localhost/?" + parts.query)) if parts.query else {}
    options.pop("host", None)
    options.pop("port", None)
    sentinel_options = {k: options.pop(k) for k in ("socket_timeout", "socket_connect_timeout") if k in options}
    for key in ("sentinel_username", "sentinel_password"):
        if key in options:
            sentinel_options[key.removeprefix("sentinel_")] = options.pop(key)
    if userinfo:
        user, _, password = userinfo.partition(":")
        if user:
            options["username"] = unquote(user)
        if password:
            options["password"] = unquote(password)
    if len(path) > 1:
        try:
            options["db"] = int(path[1])
        except ValueError:
            raise BadArgument(f"the database in a Sentinel URL is a number, not {path[1]!r}") from None
    if tls:
        sentinel_options["ssl"] = True
        for key, value in options.items():
            if key.startswith("ssl_"):
                sentinel_options.setdefault(key, value)
    elif any(k.startswith("ssl_") for k in options):
        raise BadArgument("ssl_* options need TLS: use rediss+sentinel://")
    return SentinelTarget(tuple(sentinels), unquote(path[0]), tls, options, sentinel_options)


def client_options(**options: Any) -> dict[str, Any]:
    """The options every client of the worker's gets unless told otherwise."""
    options.setdefault("socket_timeout", SOCKET_TIMEOUT_S)
    options.setdefault("socket_connect_timeout", CONNECT_TIMEOUT_S)
    options.setdefault("health_check_interval", HEALTH_CHECK_S)
    options.setdefault("retry", no_command_retries())
    return options


def sentinel_client(url: str, **options: Any) -> Redis:
    """A client of the primary that the Sentinels of ``url`` name, asked again at every new connection."""
    target = parse_sentinel_url(url)
    sentinel_kwargs = {"socket_timeout": CONNECT_TIMEOUT_S, "socket_connect_timeout": CONNECT_TIMEOUT_S,
                       **target.sentinel_options}
    options = client_options(**{**target.redis_options, **options})
    options["connection_class"] = FenceSentinelSSLConnection if target.tls else FenceSentinelConnection
    options.pop("ssl", None)
    sentinel = Sentinel(list(target.sentinels), sentinel_kwargs=sentinel_kwargs)
    return sentinel.master_for(target.service, **options)


def cluster_client(url: str, **options: Any) -> RedisCluster:
    tls = url.startswith("rediss://")
    options = client_options(**options)
    options.pop("health_check_interval", None)
    options["node_connection_class"] = FenceClusterSSLConnection if tls else FenceClusterConnection
    # The Cluster's own retries: each after a fresh look at the topology, only of what never ran.
    options["retry"] = Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=12)
    return FenceCluster.from_url(url, **options)
