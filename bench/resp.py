"""A minimal pipelining RESP2 client on asyncio + hiredis, shared by every bench variant.

It is deliberately thinner than redis-py (no pool, no callbacks, no RESP3): one
write per pipeline, hiredis parses, replies resolve futures in order. FenceMQ and
the raw-Redis baseline go through the same code, so the client costs the same.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, Iterable, Sequence

import hiredis


class ReplyError(Exception):
    """An error reply (-ERR ...) from the server."""


class RespConn(asyncio.Protocol):
    def __init__(self) -> None:
        self.reader = hiredis.Reader(replyError=ReplyError)
        self.waiting: deque[asyncio.Future] = deque()
        self.transport: asyncio.Transport | None = None
        self.closed: asyncio.Future | None = None

    @classmethod
    async def open(cls, host: str, port: int) -> "RespConn":
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(cls, host, port)
        conn.closed = loop.create_future()
        return conn

    # -- asyncio.Protocol ---------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        reader, waiting = self.reader, self.waiting
        reader.feed(data)
        while (reply := reader.gets()) is not False:
            fut = waiting.popleft()
            if fut.done():
                continue
            if isinstance(reply, ReplyError):
                fut.set_exception(reply)
            else:
                fut.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        err = exc or ConnectionError("connection closed")
        while self.waiting:
            fut = self.waiting.popleft()
            if not fut.done():
                fut.set_exception(err)
        if self.closed is not None and not self.closed.done():
            self.closed.set_result(None)

    # -- API ------------------------------------------------------------------------

    def send(self, commands: Iterable[Sequence[Any]]) -> list[asyncio.Future]:
        """Write several commands in one go; a future per reply, in order."""
        loop = asyncio.get_running_loop()
        pack = hiredis.pack_command
        data, futs = [], []
        for cmd in commands:
            data.append(pack(tuple(cmd)))
            fut = loop.create_future()
            futs.append(fut)
            self.waiting.append(fut)
        assert self.transport is not None
        self.transport.write(b"".join(data))
        return futs

    async def call(self, *args: Any) -> Any:
        return await self.send([args])[0]

    async def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
            if self.closed is not None:
                await self.closed
