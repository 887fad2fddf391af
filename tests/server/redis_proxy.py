"""A TCP proxy in front of Redis that stops a worker at a chosen command, so a test can kill it there.

A worker started with the proxy's URL talks to Redis through it. ``hold(matches)`` arms it: the
first command that ``matches`` (its arguments, as bytes) is not forwarded, nor is anything after it
on that connection, and the returned event is set. The worker is then waiting on that command —
everything before it done in Redis, nothing after it — and the test kills the worker (SIGKILL, as
``kill -9``): a crash at exactly that step of its work.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

Matcher = Callable[[list[bytes]], bool]


def _command(buf: bytearray, start: int) -> tuple[list[bytes], int] | None:
    """The RESP request array at ``start`` and where it ends, or None if it is not all there yet."""
    end = buf.find(b"\r\n", start)
    if end < 0:
        return None
    if buf[start:start + 1] != b"*":
        raise ValueError(f"not a RESP array: {bytes(buf[start:start + 20])!r}")
    n, at, args = int(buf[start + 1:end]), end + 2, []
    for _ in range(n):
        end = buf.find(b"\r\n", at)
        if end < 0:
            return None
        size = int(buf[at + 1:end])
        if len(buf) < end + 2 + size + 2:
            return None
        args.append(bytes(buf[end + 2:end + 2 + size]))
        at = end + 2 + size + 2
    return args, at


class RedisProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self._armed: tuple[Matcher, threading.Event] | None = None
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._main, name="redis-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisProxy:
        self._thread.start()
        assert self._ready.wait(10), "the proxy did not start"
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def hold(self, matches: Matcher) -> threading.Event:
        held = threading.Event()
        with self._lock:
            self._armed = (matches, held)
        return held

    def disarm(self) -> None:
        with self._lock:
            self._armed = None

    def _take(self, args: list[bytes]) -> threading.Event | None:
        with self._lock:
            if self._armed is not None and self._armed[0](args):
                held = self._armed[1]
                self._armed = None
                return held
        return None

    def _main(self) -> None:
        self._loop = asyncio.new_event_loop()
        server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.close()
            return
        replies = asyncio.ensure_future(self._pipe(up_reader, writer))
        buf, held = bytearray(), False
        try:
            while data := await reader.read(65536):
                if held:
                    continue  # the worker waits on a held command: nothing of it reaches Redis
                buf += data
                at, out = 0, bytearray()
                while (found := _command(buf, at)) is not None:
                    args, end = found
                    event = self._take(args)
                    if event is not None:
                        held = True
                        event.set()
                        break
                    out += buf[at:end]
                    at = end
                del buf[:at]
                if out:
                    up_writer.write(out)
                    await up_writer.drain()
        except (ConnectionError, ValueError):
            pass
        finally:
            replies.cancel()
            for w in (writer, up_writer):
                w.close()

    @staticmethod
    async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(65536):
                sink.write(data)
                await sink.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
