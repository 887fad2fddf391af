"""Running a worker: in the foreground (``fencemq serve``) or in a thread (tests, demo, bench).

A worker runs on uvloop when it is installed (``pip install 'fencemq[fast]'``):
the same anyio code on a libuv event loop, whose socket reads, writes and
callbacks cost less per call than asyncio's own loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import anyio

from fencemq.config import Config
from fencemq.server.embedded import EmbeddedRedis
from fencemq.server.worker import Worker

log = logging.getLogger(__name__)


LOOPS = ("auto", "uvloop", "asyncio")


def event_loop(choice: str = "auto") -> tuple[str, dict[str, Any]]:
    """The event loop to run a worker on, as (its name, anyio's asyncio backend options).

    ``auto`` is uvloop when it is installed, else asyncio's own loop.
    """
    if choice not in LOOPS:
        raise ValueError(f"unknown event loop {choice!r}; choose one of {', '.join(LOOPS)}")
    if choice != "asyncio":
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise RuntimeError("uvloop is not installed; pip install 'fencemq[fast]' or use the asyncio loop")
        else:
            return "uvloop", {"loop_factory": uvloop.new_event_loop}
    return "asyncio", {}


def run(func: Any, *args: Any, loop: str = "auto") -> Any:
    """``anyio.run(func, *args)`` on the chosen event loop."""
    return anyio.run(func, *args, backend="asyncio", backend_options=event_loop(loop)[1])


@contextlib.contextmanager
def redis_for(config: Config, password: str | None = None) -> Iterator[Config]:
    """The config with a Redis URL: the given one, or a private embedded server's (with ``password``)."""
    if config.redis_url:
        yield config
        return
    # Configured as docs/operations.md asks of any Redis: a maxmemory (half the machine's memory), so the
    # memory watermark has a limit to measure against and the worker need not warn of none.
    limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    with EmbeddedRedis(password=password, extra_args=["--maxmemory", str(limit)]) as server:
        yield replace(config, redis_url=server.url)


# The collector's thresholds once serving (CPython's default is 700, 10, 10). A worker holds a few hundred
# objects per connection, and a crowd of connections coming and going promotes them by the thousand: at
# the default a full collection ran every few seconds of a reconnect storm, each walking every connection's
# objects (10,000 devices on 2 workers: 17 full collections, 31 s of the 50 s the storm took on a busy
# machine). At these, one ran, and each worker spent 4 s of CPU on the storm instead of 8-10. Young cycles
# are still collected as they pile up (every 10,000 allocations); what lives long is walked 10x less often.
GC_THRESHOLDS = (10_000, 10, 100)


async def serve(config: Config, on_ready=None) -> None:
    """Run until SIGTERM/SIGINT, then drain."""
    worker = Worker(config)
    async with anyio.create_task_group() as tg:
        port = await tg.start(worker.run)
        # What startup made lives as long as the worker: out of the collector's sight, a full
        # collection walks only what serving allocates (a pause of milliseconds otherwise).
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)
        if on_ready is not None:
            on_ready(worker, port)
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                worker.drain()
                break


class WorkerThread:
    """A worker on its own event loop in a background thread; ``port`` once started."""

    def __init__(self, config: Config, loop: str = "auto") -> None:
        self.config = config
        self.loop = loop
        self.worker = Worker(config)
        self.port: int | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._main, name="fencemq-worker", daemon=True)

    def _main(self) -> None:
        async def body() -> None:
            self._loop = asyncio.get_running_loop()
            async with anyio.create_task_group() as tg:
                self.port = await tg.start(self.worker.run)
                self._ready.set()

        try:
            run(body, loop=self.loop)
        except BaseException as exc:  # surfaced to the starting thread
            self._error = exc
            if self._ready.is_set():  # after the start, nobody waits for it: say so where it is seen
                log.error("the worker's thread ended on an error", exc_info=exc)
            self._ready.set()

    @property
    def error(self) -> BaseException | None:
        """What ended the worker's thread, if an error did (logged when it happened)."""
        return self._error

    def start(self) -> "WorkerThread":
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise RuntimeError(f"worker failed to start: {self._error!r}") from self._error
        return self

    def drain(self) -> None:
        """What SIGTERM does (from any thread): the worker drains, then its thread ends."""
        if self._loop is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: drained already
                self._loop.call_soon_threadsafe(self.worker.drain)

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive():
            self.drain()
            self._thread.join(timeout)

    def __enter__(self) -> "WorkerThread":
        return self.start()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.stop()
        if exc_type is None and self._error is not None:
            # a worker that ended on an error while in use (logged when it happened) fails its user
            raise RuntimeError(f"the worker ended on an error: {self._error!r}") from self._error
