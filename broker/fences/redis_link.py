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
parser's error classes: ``NoScriptError``, ``ReadOnlyError``…), and a call
that meets a lost connection is sent again on a new one with redis-py's own
retry policy (the worker's: 8 retries, exponential backoff up to 1 s), as the
client it stands in for does; then it raises ``ConnectionError``.

Only for a plain TCP or Unix-socket Redis; a Cluster (a slot per call), TLS
or anything else keeps redis-py (:meth:`RedisLink.for_client` says None).
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from typing import Any

import hiredis
from redis._parsers.base import BaseParser
from redis.asyncio import Redis
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

LOST = (RedisConnectionError, RedisTimeoutError, OSError)


class _Wire(asyncio.Protocol):
    """The socket's side: writes what it is given, hands each reply to the oldest waiting future."""

    def __init__(self) -> None:
        self.reader = hiredis.Reader(protocolError=InvalidResponse, replyError=BaseParser.parse_error)
        self.waiting: deque[asyncio.Future[Any]] = deque()
        self.transport: asyncio.Transport | None = None
        self.lost: BaseException | None = None
        self.writable = asyncio.Event()
        self.writable.set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        reader, waiting = self.reader, self.waiting
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
        self._flush_scheduled = False
        self._closed = False

    @classmethod
    def for_client(cls, redis: Any) -> RedisLink | None:
        """A link to the server a redis-py asyncio client talks to, or None where it cannot stand in
        (a Cluster, TLS, a client of another kind)."""
        if type(redis) is not Redis:
            return None
        pool = redis.connection_pool
        kw, kind = pool.connection_kwargs, pool.connection_class
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
        try:
            return await self._send(commands)
        except LOST as first:
            failures, error = 0, first
            while True:  # redis-py's policy: back off, reconnect, send again
                failures += 1
                if self.retry._retries >= 0 and failures > self.retry._retries:
                    raise error
                backoff = self.retry._backoff.compute(failures)
                if backoff > 0:
                    await asyncio.sleep(backoff)
                try:
                    return await self._send(commands)
                except LOST as exc:
                    error = exc

    async def _send(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        wire = self._wire
        if wire is None or wire.lost is not None:
            wire = await self._connect()
        if not wire.writable.is_set():
            await wire.writable.wait()
            if wire.lost is not None:
                raise wire.lost
        loop = asyncio.get_running_loop()
        futures = []
        out = self._out
        for args in commands:
            out.append(hiredis.pack_command(args))
            fut = loop.create_future()
            wire.waiting.append(fut)
            futures.append(fut)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        replies = [await futures[0]] if len(futures) == 1 else [await f for f in futures]
        for reply in replies:
            if isinstance(reply, RedisConnectionError):  # LOADING (a restart): retried, as redis-py does
                raise reply
        return replies

    def _flush(self) -> None:
        """Everything the calls of this turn of the loop asked for, in one write."""
        self._flush_scheduled = False
        out, self._out = self._out, []
        wire = self._wire
        if wire is None or wire.transport is None or wire.lost is not None:
            return  # connection_lost failed their futures
        wire.transport.write(b"".join(out) if len(out) > 1 else out[0])

    async def _connect(self) -> _Wire:
        if self._closed:
            raise RedisConnectionError("the link to Redis is closed")
        if self._connecting is not None:
            return await asyncio.shield(self._connecting)
        loop = asyncio.get_running_loop()
        self._connecting = loop.create_future()
        try:
            self._out = []  # (anything still unsent belonged to the lost connection's failed calls)
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
