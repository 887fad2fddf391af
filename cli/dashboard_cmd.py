"""`fencemq dashboard`: the web UI (broker/ui/) over a broker's Redis, until SIGTERM/SIGINT.

The same app a worker serves with ``fencemq serve --http-port N``. It reads
and writes through broker/ops/, like the operator commands, so the two agree.
Exit codes: 0 stopped by a signal; 1 the port is taken or the UI failed;
2 no Redis URL, or the Redis at it does not answer.
"""

from __future__ import annotations

import errno
import os
from typing import Annotated, Optional

import typer

from fencemq.cli.common import ENV_REDIS_URL, CliError, broker_redis, connect, fail, safe_url

DEFAULT_PORT = 7380


def dashboard(
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port to serve the UI on (0 picks a free one)")]
    = DEFAULT_PORT,
    host: Annotated[str, typer.Option(help="Address to listen on")] = "127.0.0.1",
    redis_url: Annotated[Optional[str], typer.Option(
        "--redis-url", metavar="URL", show_default=False,
        help=f"The broker's Redis/Valkey URL (default: ${ENV_REDIS_URL}, else the private Redis of the one "
             "`fencemq serve` running here)")] = None,
    prefix: Annotated[Optional[str], typer.Option(
        show_default=False, help="Key prefix of the broker's state (default: $FENCEMQ_PREFIX or fmq)")] = None,
    password: Annotated[Optional[str], typer.Option(
        show_default=False, help="The broker's legacy password: the `default` user's for logging in "
                                 "(default: $FENCEMQ_PASSWORD)")] = None,
    interval: Annotated[float, typer.Option(min=0.2, max=60.0, help="Seconds between live updates")] = 2.0,
) -> None:
    """Serve the web management UI: overview, queues, lmq search, sessions, dead letters, operator actions.

    Reads need nothing; evict, seek, purge and replay need a login as a FenceMQ
    user with the permission (docs/ui.md). Never starts an embedded Redis.
    """
    import anyio

    from fencemq.ui.pages import UI
    from fencemq.ui.serving import serve_dashboard

    url, key_prefix = broker_redis("dashboard", redis_url, prefix)
    try:
        connect(url).close()
    except CliError as exc:
        fail("dashboard", exc)
        raise typer.Exit(exc.code) from None
    secret = password if password is not None else os.environ.get("FENCEMQ_PASSWORD") or None
    ui = UI(url, prefix=key_prefix, password=secret, interval=interval)

    def ready(address: str) -> None:
        print(f"fencemq dashboard on {address} (redis: {safe_url(url)}, prefix {key_prefix})", flush=True)

    try:
        anyio.run(serve_dashboard, ui, host, port, ready)
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        why = (f"port {port} on {host} is already in use; choose another with --port (0 picks a free one)"
               if exc.errno == errno.EADDRINUSE else f"{type(exc).__name__}: {exc}")
        fail("dashboard", CliError(why))
        raise typer.Exit(1) from None
    print("fencemq dashboard stopped", flush=True)


def register(app: typer.Typer) -> None:
    """Add `dashboard` to the operator CLI."""
    app.command("dashboard")(dashboard)
