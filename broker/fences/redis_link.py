"""One pipelined connection to a single Redis for the fences' own calls: the worker's hot path.

redis-py's asyncio client spends ~50 µs of Python on every call (a pool, a
lock, a retry wrapper, a timeout, observability hooks) where the call itself
needs a write and a parse: measured with uvloop, 48 µs of CPU per EVALSHA
against 13 µs here. A worker makes a few fence calls per client command, so
that was a large share of its CPU per message.

A :class:`RedisLink` is one connection multiplexed by every task of the worker:
a call appends its command to a buffer that goes out once per turn of the
event loop (calls made by many connections in the same turn share one write,
so Redis reads them in one go too) and waits for its reply, which comes back in
the order sent (RESP has no ids: the replies are matched to the waiting
futures first in, first out). It carries only commands that never block
(EVALSHA, SCRIPT LOAD, GET, ZADD): a blocking one would hold every other
call behind it. Replies and errors are exactly what redis-py would give (its
parser's error classes: ``NoScriptError``, ``ReadOnlyError``…), and, as the
client it stands in for (fences/redis_servers.py), it sends a call again only
if it was never written: a connection that could not be made, or lost before
the write, is tried again for up to ``CONNECT_PATIENCE_S``; a call written on
a connection that is then lost, or whose reply takes longer than the socket
timeout, raises (``ConnectionError``, ``TimeoutError``) — it may have run.

Only for a plain TCP or Unix-socket Redis; a Cluster (a slot per call), TLS,
Sentinel (the primary is asked for at every connection) or anything else keeps
redis-py (:meth:`RedisLink.for_client` says None).
"""

from __future__ import annotations

import asyncio
import select
import socket
from collections import deque
from typing import Any

import hiredis
from redis._parsers.base import BaseParser
from redis.asyncio import Redis
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.asyncio.sentinel import SentinelManagedConnection
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from fencemq.fences.redis_servers import CONNECT_PATIENCE_S, SOCKET_TIMEOUT_S, NotSent

LOST = (RedisConnectionError, RedisTimeoutError, OSError)
IDLE_S = 0.1  # a connection idle this long is asked whether Redis closed it before a write goes on it


def _read_failure(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


class _Wire(asyncio.Protocol):
    """The socket's side: writes what it is given, hands each reply to the oldest waiting future."""

    def __init__(self) -> None:
        self.reader = hiredis.Reader(protocolError=InvalidResponse, replyError=BaseParser.parse_error)
        self.waiting: deque[asyncio.Future[Any]] = deque()
        self.transport: asyncio.Transport | None = None
        self.lost: BaseException | None = None
        self.writable = asyncio.Event()
        self.writable.set()
        self._poller: Any = None
        self.progress_at = 0.0  # loop time of the last reply, or of a write when nothing was waiting

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        try:
            self._poller = select.poll()
            self._poller.register(sock.fileno(), select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        except (AttributeError, OSError, ValueError):  # no poll() here, or no descriptor to ask
            self._poller = None

    def hung_up(self) -> bool:
        """Whether the server closed the connection (asked of the kernel: the loop may not know yet)."""
        return bool(self._poller is not None and self._poller.poll(0))

    def data_received(self, data: bytes) -> None:
        reader, waiting = self.reader, self.waiting
        self.progress_at = _now()
        reader.feed(data)
        while (reply := reader.gets()) is not False:
            if not waiting:  # a reply nobody asked for: the stream is out of step, drop it
                self._fail(InvalidResponse("a reply from Redis that no command was waiting for"))
                return
            fut = waiting.popleft()
            if not fut.done():  # (a cancelled caller's reply is read and dropped)
                fut.set_result(reply)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._fail(RedisConnectionError(f"connection to Redis lost: {exc}" if exc else "connection to Redis closed"))

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def _fail(self, exc: BaseException) -> None:
        if self.lost is None:
            self.lost = exc
        while self.waiting:
            fut = self.waiting.popleft()
            if not fut.done():
                fut.set_exception(exc)
        self.writable.set()
        if self.transport is not None:
            self.transport.close()


def _now() -> float:
    return asyncio.get_running_loop().time()


class _Batch:
    """The calls of one send: whether they were written (a lost call that was never written is sent again)."""

    __slots__ = ("written",)

    def __init__(self) -> None:
        self.written = False


class RedisLink:
    """Calls to one Redis, pipelined on one connection (see the module's docstring)."""

    def __init__(self, *, host: str | None = None, port: int = 6379, path: str | None = None, db: int = 0,
                 username: str | None = None, password: str | None = None, retry: Retry | None = None) -> None:
        self.host, self.port, self.path, self.db = host, port, path, db
        self.username, self.password = username, password
        self.retry = retry or Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=8)
        self._wire: _Wire | None = None
        self._connecting: asyncio.Future[_Wire] | None = None
        self._out: list[bytes] = []
        self._out_batches: list[_Batch] = []
        self._flush_scheduled = False
        self._closed = False
        self._watchdog: asyncio.TimerHandle | None = None

    @classmethod
    def for_client(cls, redis: Any) -> RedisLink | None:
        """A link to the server a redis-py asyncio client talks to, or None where it cannot stand in
        (a Cluster, TLS, a client of another kind)."""
        if type(redis) is not Redis:
            return None
        pool = redis.connection_pool
        kw, kind = pool.connection_kwargs, pool.connection_class
        if issubclass(kind, SentinelManagedConnection):
            return None
        if kw.get("credential_provider") is not None or kw.get("protocol") not in (None, 2, "2") \
                or kw.get("decode_responses"):
            return None
        retry = kw.get("retry")
        common = dict(db=int(kw.get("db") or 0), username=kw.get("username"), password=kw.get("password"),
                      retry=retry if isinstance(retry, Retry) else None)
        if issubclass(kind, UnixDomainSocketConnection):
            return cls(path=kw["path"], **common)  # type: ignore[arg-type]
        if issubclass(kind, Connection) and not issubclass(kind, SSLConnection):
            return cls(host=kw.get("host", "localhost"), port=int(kw.get("port", 6379)), **common)  # type: ignore[arg-type]
        return None

    # -- calls ---------------------------------------------------------------------------

    async def execute(self, *args: Any) -> Any:
        """One command's reply; an error reply raised (redis-py's exception classes)."""
        reply = (await self._send_retrying([args]))[0]
        if isinstance(reply, ResponseError):
            raise reply
        return reply

    async def execute_many(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """The replies of ``commands``, in order, sent back to back; an error reply is returned as its
        exception, not raised (redis-py's ``pipeline(transaction=False).execute(raise_on_error=False)``)."""
        return await self._send_retrying(commands)

    async def _send_retrying(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        delay, deadline = 0.05, None
        while True:
            try:
                return await self._send(commands)
            except NotSent:  # nothing was written: sending again cannot run anything twice
                now = _now()
                deadline = deadline if deadline is not None else now + CONNECT_PATIENCE_S
                if now + delay >= deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)

    async def _send(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        wire = self._wire
        try:
            if wire is None or wire.lost is not None:
                wire = await self._connect()
            if not wire.writable.is_set():
                await wire.writable.wait()
                if wire.lost is not None:
                    raise wire.lost
        except LOST as exc:
            raise NotSent(f"could not reach Redis: {exc}") from exc
        loop = asyncio.get_running_loop()
        futures = []
        out = self._out
        batch = _Batch()
        for args in commands:
            out.append(hiredis.pack_command(args))
            fut = loop.create_future()
            wire.waiting.append(fut)
            futures.append(fut)
        self._out_batches.append(batch)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        try:
            replies = [await futures[0]] if len(futures) == 1 else [await f for f in futures]
        except BaseException as exc:
            # The commands after the one that failed fail too (or will, once the loss reaches them): their
            # failure is this call's, raised here. Left unread, each would be logged with its traceback when
            # collected, at any moment: inside a compile() on Python 3.11, that is a SystemError.
            for fut in futures:
                fut.add_done_callback(_read_failure)
            if isinstance(exc, LOST) and not batch.written:
                raise NotSent(f"the connection to Redis was lost before the command went: {exc}") from exc
            raise
        for reply in replies:
            if isinstance(reply, RedisConnectionError):  # LOADING (a restart): Redis ran nothing of it
                if len(replies) == 1:
                    raise NotSent(str(reply)) from reply
                raise reply
        return replies

    def _flush(self) -> None:
        """Everything the calls of this turn of the loop asked for, in one write."""
        self._flush_scheduled = False
        out, self._out = self._out, []
        batches, self._out_batches = self._out_batches, []
        wire = self._wire
        if wire is None or wire.transport is None or wire.lost is not None:
            return  # connection_lost failed their futures (never written: they are sent again)
        if len(wire.waiting) == len(out):  # nothing was waiting before: the reply clock starts now
            now = _now()
            if now - wire.progress_at > IDLE_S and wire.hung_up():
                # Redis closed it while it sat idle (a restart, a failover) and the loop has not
                # heard yet: these calls were never written, so they go on a new connection
                wire._fail(RedisConnectionError("Redis closed the connection while it was idle"))
                return
            wire.progress_at = now
        for batch in batches:
            batch.written = True
        wire.transport.write(b"".join(out) if len(out) > 1 else out[0])
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().call_later(1.0, self._watch)

    def _watch(self) -> None:
        """A reply that takes longer than the socket timeout: the server (or its host) is gone."""
        self._watchdog = None
        wire = self._wire
        if wire is None or wire.lost is not None or not wire.waiting:
            return
        if _now() - wire.progress_at > SOCKET_TIMEOUT_S:
            wire._fail(RedisTimeoutError(f"no reply from Redis within {SOCKET_TIMEOUT_S:.0f} s"))
            return
        self._watchdog = asyncio.get_running_loop().call_later(1.0, self._watch)

    async def _connect(self) -> _Wire:
        if self._closed:
            raise RedisConnectionError("the link to Redis is closed")
        if self._connecting is not None:
            return await asyncio.shield(self._connecting)
        loop = asyncio.get_running_loop()
        self._connecting = loop.create_future()
        try:
            self._out = []  # (anything still unsent belonged to the lost connection's failed calls)
            self._out_batches = []
            try:
                if self.path is not None:
                    _, wire = await loop.create_unix_connection(_Wire, self.path)
                else:
                    _, wire = await loop.create_connection(_Wire, self.host, self.port)
            except OSError as exc:  # as redis-py says it: a ConnectionError, which every door handles
                where = self.path or f"{self.host}:{self.port}"
                raise RedisConnectionError(f"Error {exc.errno} connecting to {where}. {exc.strerror or exc}.") from exc
            if self.path is None:
                sock = wire.transport.get_extra_info("socket") if wire.transport else None
                if sock is not None:  # (asyncio sets it; uvloop may not)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello: list[tuple[Any, ...]] = []
            if self.password is not None:
                hello.append(("AUTH", self.username, self.password) if self.username else ("AUTH", self.password))
            if self.db:
                hello.append(("SELECT", self.db))
            self._wire = wire
            if hello:
                for reply in await self._send(hello):
                    if isinstance(reply, ResponseError):
                        wire._fail(RedisConnectionError(f"Redis refused the link's handshake: {reply}"))
                        raise RedisConnectionError(f"Redis refused the link's handshake: {reply}")
            self._connecting.set_result(wire)
            return wire
        except BaseException as exc:
            self._connecting.set_exception(exc if isinstance(exc, Exception) else RedisConnectionError(str(exc)))
            self._connecting.exception()  # (retrieved: a waiter may not be there to)
            raise
        finally:
            self._connecting = None

    async def aclose(self) -> None:
        self._closed = True
        wire, self._wire = self._wire, None
        if wire is not None and wire.transport is not None:
            wire.transport.close()



def _pairs(flat: list[Any]) -> dict[Any, Any]:
    return dict(zip(flat[::2], flat[1::2]))


# redis-py's shapes of the replies Linked sends on the link (RESP2: a flat list for a hash, a list for a set)
_SHAPES: dict[str, Any] = {"HGETALL": _pairs, "SMEMBERS": set}


class Linked:
    """A worker's redis-py client whose plain commands on one key (HGETALL, HSET, SMEMBERS…) go on
    its :class:`RedisLink` when it has one, the way its fence calls do.

    The connect path of a crowd (a reconnect storm) reads and writes a few keys per session; on
    redis-py each call takes one of the pool's connections and ~50 µs of Python, and thousands at
    once wait for a free connection until they time out. On the link the calls of a loop turn go
    out in one write, and nothing waits for a pool. The replies are redis-py's, shape included (a
    dict for HGETALL, a set for SMEMBERS), and so are the errors' classes and codes: a caller
    cannot tell which way a call went. Without a link (a Cluster, TLS, Sentinel, the fences used
    outside a worker), and for any other method (pipelines, transactions, blocking commands), it
    is the redis-py client itself."""

    def __init__(self, redis: Any, link_of: Any) -> None:
        self._redis = redis
        self._link_of = link_of  # the Fences whose ``link`` a worker sets once it runs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._redis, name)

    async def execute_command(self, *args: Any) -> Any:
        link = self._link_of.link
        if link is None:
            return await self._redis.execute_command(*args)
        reply = await link.execute(*args)
        shape = _SHAPES.get(args[0])
        return reply if shape is None else shape(reply)

    async def many(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """The replies of plain commands sent back to back (one write on the link, else a redis-py
        pipeline); the first error reply raised, as a pipeline raises it."""
        link = self._link_of.link
        if link is None:
            async with self._redis.pipeline(transaction=False) as pipe:
                for command in commands:
                    pipe.execute_command(*command)
                return list(await pipe.execute())
        replies = await link.execute_many(commands)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return [r if (shape := _SHAPES.get(c[0])) is None else shape(r) for c, r in zip(commands, replies)]

    async def hgetall(self, key: str) -> dict[bytes, bytes]:
        return await self.execute_command("HGETALL", key)  # type: ignore[no-any-return]

    async def hget(self, key: str, name: Any) -> Any:
        return await self.execute_command("HGET", key, name)

    async def hset(self, key: str, name: Any = None, value: Any = None, mapping: dict[Any, Any] | None = None) -> int:
        pairs: list[Any] = [] if name is None else [name, value]
        for k, v in (mapping or {}).items():
            pairs += [k, v]
        return await self.execute_command("HSET", key, *pairs)  # type: ignore[no-any-return]

    async def hsetnx(self, key: str, name: Any, value: Any) -> int:
        return await self.execute_command("HSETNX", key, name, value)  # type: ignore[no-any-return]

    async def hdel(self, key: str, *names: Any) -> int:
        return await self.execute_command("HDEL", key, *names)  # type: ignore[no-any-return]

    async def smembers(self, key: str) -> set[bytes]:
        return await self.execute_command("SMEMBERS", key)  # type: ignore[no-any-return]

    async def scard(self, key: str) -> int:
        return await self.execute_command("SCARD", key)  # type: ignore[no-any-return]

    async def zrangebylex(self, key: str, low: Any, high: Any) -> list[bytes]:
        return await self.execute_command("ZRANGEBYLEX", key, low, high)  # type: ignore[no-any-return]
