"""Serving the UI: alone (``fencemq dashboard``) or inside a worker (``serve --http-port``).

Both run uvicorn's ``Server.serve()`` on the caller's event loop. In a worker
it runs in the same task group as the worker, and the worker's own signal
handling decides when to stop (uvicorn's is switched off: two owners of
SIGTERM would race), so a drained worker also closes its UI.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import uvicorn

from fencemq.ui.app import create_app
from fencemq.ui.pages import UI


class QuietServer(uvicorn.Server):
    """uvicorn without its signal handlers: whoever runs it stops it (``should_exit``)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def server(ui: UI, host: str, port: int, *, sock: socket.socket | None = None) -> QuietServer:
    config = uvicorn.Config(create_app(ui), host=host, port=port, log_level="warning", access_log=False,
                            lifespan="on", timeout_graceful_shutdown=1, ws="none")
    return QuietServer(config)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0 picks a free one), so the caller knows the port before serving."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.setblocking(False)
    return sock


def url_of(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/"


async def serve_dashboard(ui: UI, host: str, port: int, on_ready: Callable[[str], None] | None = None) -> None:
    """``fencemq dashboard``: serve until SIGTERM/SIGINT."""
    import signal

    sock = bind(host, port)
    srv = server(ui, host, sock.getsockname()[1])
    async with anyio.create_task_group() as tg:
        tg.start_soon(srv.serve, [sock])
        while not srv.started:
            await anyio.sleep(0.02)
        if on_ready is not None:
            on_ready(url_of(host, sock.getsockname()[1]))
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                srv.should_exit = True
                break


async def worker_with_ui(config: Any, on_ready: Any, http_port: int, run_worker: Callable[..., Any],
                         on_ui: Callable[[str], None] | None = None) -> None:
    """A worker (``run_worker(config, on_ready)``, until it drains) and the UI on ``http_port`` beside it."""
    ui = UI(config.redis_url, prefix=config.prefix, password=config.password,
            lease_ms=config.session_lease_ms, title="FenceMQ")
    try:  # before the worker starts: a taken port fails the start, not later
        sock = bind(config.host, http_port)
    except OSError as exc:
        raise RuntimeError(f"cannot serve the web UI on {config.host}:{http_port} (--http-port): {exc.strerror}") \
            from None
    srv = server(ui, config.host, sock.getsockname()[1])
    async with anyio.create_task_group() as tg:

        def ready(worker: Any, port: int) -> None:
            ui.gate = worker.services.gate  # one gate for the worker's doors: the UI's logins, limits, counts
            if on_ready is not None:
                on_ready(worker, port)
            tg.start_soon(srv.serve, [sock])  # once the worker is up: the first sample sees it
            if on_ui is not None:
                on_ui(url_of(config.host, sock.getsockname()[1]))

        try:
            await run_worker(config, ready)
        finally:
            srv.should_exit = True


class DashboardThread:
    """The UI on its own event loop in a background thread (tests, ``fencemq demo``); ``url`` once started."""

    def __init__(self, ui: UI, host: str = "127.0.0.1", port: int = 0) -> None:
        import threading

        self.ui, self.host, self.port = ui, host, port
        self.url: str | None = None
        self._server: QuietServer | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="fencemq-ui", daemon=True)

    def _main(self) -> None:
        async def body() -> None:
            sock = bind(self.host, self.port)
            self.port = sock.getsockname()[1]
            self._server = server(self.ui, self.host, self.port)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._server.serve, [sock])
                while not self._server.started and not self._server.should_exit:
                    await anyio.sleep(0.02)
                self.url = url_of(self.host, self.port)
                self._ready.set()

        try:
            anyio.run(body)
        except BaseException as exc:  # surfaced to the starting thread
            self._error = exc
        finally:
            self._ready.set()

    def start(self) -> "DashboardThread":
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None or self.url is None:
            raise RuntimeError(f"the dashboard failed to start: {self._error!r}") from self._error
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> "DashboardThread":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
