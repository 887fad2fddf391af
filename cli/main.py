"""`fencemq`: the operator CLI (console script ``cli.main:app``).

    fencemq serve    run a worker (an embedded Redis when no URL is given)
    fencemq demo     a short scripted tour of the guarantees
    fencemq status   workers, sessions and queues, read straight from Redis

Exit codes: 0 success; 1 failure (or a demo check that did not hold);
2 no Redis URL, or the Redis at it does not answer (and usage errors);
4 refused: once the broker has an administrator, the operator (FENCEMQ_USER)
lacks the permission (status needs inspect, as every read command does).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import secrets
import ssl
import sys
from typing import Annotated, Any, Optional

import redis
import typer
from rich.console import Console

from fencemq import __version__
from fencemq.errors import BadArgument
from fencemq.model.keys import Keyspace
from fencemq.cli import analytics, dashboard_cmd, ops
from fencemq.cli.helptext import HelpGroup
from fencemq.cli.opskit import RedisUrl as OperatorRedisUrl
from fencemq.cli.local_broker import recorded, runtime_dir
from fencemq.cli.common import (
    ENV_REDIS_URL,
    CliError,
    connect,
    fail,
    redis_url_given,
    safe_url,
)

app = typer.Typer(
    name="fencemq",
    help="FenceMQ: a message broker whose state lives in Redis and whose guarantees are atomic Lua fences.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=HelpGroup,  # help as written: no <bool>/<str>, no markup read into it (cli/helptext.py)
)

RedisUrlOption = Annotated[
    Optional[str],
    typer.Option("--redis-url", metavar="URL", show_default=False,
                 help=f"Redis/Valkey URL, e.g. redis://host:6379/0 (default: ${ENV_REDIS_URL})"),
]


def _check_prefix(value: Optional[str]) -> Optional[str]:
    if value is not None:
        try:
            Keyspace(value)
        except BadArgument as exc:
            raise typer.BadParameter(str(exc)) from None
    return value


PrefixOption = Annotated[
    Optional[str],
    typer.Option("--prefix", callback=_check_prefix, show_default=False,
                 help="Key prefix of the broker's state in Redis (default: $FENCEMQ_PREFIX or fmq)"),
]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"fencemq {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """FenceMQ operator CLI."""


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


# -- serve -------------------------------------------------------------------------------


@app.command()
def serve(
    host: Annotated[Optional[str], typer.Option(help="Address to listen on (default: $FENCEMQ_HOST or 127.0.0.1)",
                                                show_default=False)] = None,
    port: Annotated[Optional[int], typer.Option(help="Port to listen on; 0 picks a free one "
                                                "(default: $FENCEMQ_PORT or 7379)", show_default=False,
                                                min=0, max=65535)] = None,
    redis_url: RedisUrlOption = None,
    metrics_port: Annotated[Optional[int], typer.Option(
        "--metrics-port", metavar="N", min=1, max=65535, show_default=False,
        help="Serve Prometheus metrics on this port (same address as --host; default: $FENCEMQ_METRICS_PORT, "
             "else off)")] = None,
    prefix: PrefixOption = None,
    password: Annotated[Optional[str], typer.Option(
        help="Clients must AUTH with this password (default: $FENCEMQ_PASSWORD, else none)",
        show_default=False)] = None,
    mqtt_port: Annotated[Optional[int], typer.Option(
        "--mqtt-port", metavar="N", min=0, max=65535, show_default=False,
        help="Also accept MQTT 3.1.1/5.0 clients on this port (TLS with --tls-cert; default: $FENCEMQ_MQTT_PORT, "
             "else off)")] = None,
    mqtt_ws_port: Annotated[Optional[int], typer.Option(
        "--mqtt-ws-port", metavar="N", min=0, max=65535, show_default=False,
        help="Also accept MQTT clients over WebSocket (subprotocol mqtt; TLS with --tls-cert) on this port "
             "(default: $FENCEMQ_MQTT_WS_PORT, else off)")] = None,
    users: Annotated[bool, typer.Option(
        "--users", help="Clients must AUTH as a user of `fencemq user` and may do what it was granted "
                        "(the --password, if any, stays the `default` user's) (default: $FENCEMQ_USERS)")] = False,
    tls_cert: Annotated[Optional[str], typer.Option(
        "--tls-cert", metavar="PEM", show_default=False,
        help="Accept clients over TLS only, with this certificate chain (default: $FENCEMQ_TLS_CERT_FILE)")] = None,
    tls_key: Annotated[Optional[str], typer.Option(
        "--tls-key", metavar="PEM", show_default=False,
        help="The key of --tls-cert (default: $FENCEMQ_TLS_KEY_FILE)")] = None,
    loop: Annotated[str, typer.Option(
        help="Event loop: auto (uvloop when installed: pip install 'fencemq[fast]'), uvloop or asyncio")] = "auto",
    tls_ca: Annotated[Optional[str], typer.Option(
        "--tls-ca", metavar="PEM", show_default=False,
        help="Require client certificates signed by this CA (default: $FENCEMQ_TLS_CA_FILE)")] = None,
    http_port: Annotated[Optional[int], typer.Option(
        "--http-port", metavar="N", min=0, max=65535, show_default=False,
        help="Also serve the web UI (`fencemq dashboard`) on this port, same address as --host (default: off)")]
    = None,
    drain_timeout_ms: Annotated[Optional[int], typer.Option(
        "--drain-timeout-ms", metavar="MS", min=0, show_default=False,
        help="On SIGTERM, tell clients to move and finish what is in hand within this; the rest is cut "
             "(default: $FENCEMQ_DRAIN_TIMEOUT_MS, else 5000)")] = None,
    server_reference: Annotated[Optional[str], typer.Option(
        "--server-reference", metavar="HOST:PORT", show_default=False,
        help="Where clients should go when this worker drains: MQTT 5's DISCONNECT Server Reference and the "
             "RESP3 draining notice (default: $FENCEMQ_SERVER_REFERENCE, else none)")] = None,
) -> None:
    """Run a worker until SIGTERM/SIGINT, then drain and exit 0.

    Without --redis-url (or $FENCEMQ_REDIS_URL) it starts a private embedded
    Redis whose data is discarded on exit: for trying things out, not production.
    """
    import anyio
    from prometheus_client import start_http_server

    from fencemq.config import Config
    from fencemq.server.runner import event_loop, redis_for
    from fencemq.server.runner import serve as run_worker
    from fencemq.server.worker import client_tls

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = Config.from_env(host=host, port=port, redis_url=redis_url, metrics_port=metrics_port,
                                 prefix=prefix, password=password, users=users or None, mqtt_port=mqtt_port, mqtt_ws_port=mqtt_ws_port, tls_cert_file=tls_cert, tls_key_file=tls_key,
                                 tls_ca_file=tls_ca, drain_timeout_ms=drain_timeout_ms,
                                 server_reference=server_reference)
        Keyspace(config.prefix)
        client_tls(config)  # incomplete TLS settings, or a certificate that does not load
    except (OSError, ssl.SSLError) as exc:
        fail("serve", CliError(f"cannot load the TLS certificate or key: {exc}"))
        raise typer.Exit(1) from None
    except (ValueError, BadArgument) as exc:  # a FENCEMQ_* variable that does not parse
        fail("serve", CliError(f"bad configuration: {exc}; fix the options or the FENCEMQ_* environment variables"))
        raise typer.Exit(1) from None
    try:
        loop_name, loop_options = event_loop(loop)
    except (ValueError, RuntimeError) as exc:
        fail("serve", CliError(str(exc)))
        raise typer.Exit(1) from None

    embedded = not config.redis_url
    try:
        if not embedded:
            connect(config.redis_url).close()  # fail fast, with a message that says what to check
        with contextlib.ExitStack() as stack:
            # A private Redis gets a password of its own: the record below is how the CLI gets in.
            config = stack.enter_context(redis_for(config, secrets.token_urlsafe(18) if embedded else None))
            if embedded:
                print(f"no --redis-url or {ENV_REDIS_URL}: started a private Redis at {safe_url(config.redis_url)} "
                      "(its data is discarded on exit)", flush=True)
            if config.metrics_port:
                start_http_server(config.metrics_port, addr=config.host)
                print(f"metrics on http://{config.host}:{config.metrics_port}/metrics", flush=True)
            shown_url = safe_url(config.redis_url)

            def on_ready(worker, bound_port: int) -> None:
                # Printed on the next loop turn: by then the SIGTERM/SIGINT handlers are in
                # place, so whoever waits for this line may signal at once.
                tls = ", TLS" if config.tls_cert_file else ""
                line = (f"fencemq worker {worker.id} listening on {config.host}:{bound_port}{tls} "
                        f"(redis: {shown_url}), event loop: {loop_name}")
                if worker.mqtt_port is not None:
                    line += f"; MQTT on {config.host}:{worker.mqtt_port}{tls}"
                if worker.mqtt_ws_port is not None:
                    line += f"; MQTT over WebSocket on {config.host}:{worker.mqtt_ws_port}{tls}"
                if embedded:  # the CLI on this machine finds the private Redis without a URL (cli/local_broker.py)
                    record = stack.enter_context(recorded(config.redis_url, config.prefix,
                                                          f"{config.host}:{bound_port}"))
                    line += (f"; `fencemq` commands of this user here use its Redis (recorded in {record})"
                             if record else f"; no private directory to record its Redis in ({runtime_dir()}): give the CLI "
                                     f"--redis-url {config.redis_url}")
                asyncio.get_running_loop().call_soon(lambda: print(line, flush=True))

            if http_port is None:
                anyio.run(run_worker, config, on_ready, backend_options=loop_options)
            else:  # the UI in the worker's own event loop, stopped when the worker drains
                from fencemq.ui.serving import worker_with_ui

                def on_ui(address: str) -> None:
                    print(f"web UI on {address}", flush=True)

                anyio.run(worker_with_ui, config, on_ready, http_port, run_worker, on_ui,
                          backend_options=loop_options)
    except CliError as exc:
        fail("serve", exc)
        raise typer.Exit(exc.code) from None
    except KeyboardInterrupt:
        print("fencemq serve: interrupted", file=sys.stderr)
        raise typer.Exit(130) from None
    except (OSError, RuntimeError) as exc:  # port in use, no Redis binary for the embedded server...
        fail("serve", CliError(_why_serve_stopped(exc, config)))
        raise typer.Exit(1) from None
    except BaseExceptionGroup as group:
        errors = [e for e in _leaves(group) if not isinstance(e, KeyboardInterrupt)]
        if not errors:
            raise typer.Exit(130) from None
        busy = next((e for e in errors if isinstance(e, OSError) and e.errno == errno.EADDRINUSE), None)
        if busy is not None:
            fail("serve", CliError(_why_serve_stopped(busy, config)))
            raise typer.Exit(1) from None
        unique = dict.fromkeys(f"{type(e).__name__}: {e}" for e in errors)
        fail("serve", CliError("the worker stopped: " + "; ".join(unique)))
        raise typer.Exit(1) from None
    print("fencemq worker drained; bye", flush=True)


def _why_serve_stopped(exc: BaseException, config: Any) -> str:
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return (f"port {config.port} on {config.host} is already in use (another worker, or a Redis?); "
                f"choose another with --port (0 picks a free one)")
    return f"{type(exc).__name__}: {exc}"


# -- demo --------------------------------------------------------------------------------


@app.command()
def demo(redis_url: RedisUrlOption = None) -> None:
    """A short scripted tour (~2 s): shared group, lease expiry and redelivery, lite-queue preemption.

    Starts a private embedded Redis unless --redis-url (or $FENCEMQ_REDIS_URL)
    is given, and a worker; both are stopped on exit.
    """
    from fencemq.config import Config
    from fencemq.server.runner import redis_for
    from fencemq.cli import demo as tour

    console = Console(highlight=False)
    url = redis_url_given(redis_url)
    try:
        if url:
            connect(url).close()
            source = f"{safe_url(url)} (from {'--redis-url' if redis_url else ENV_REDIS_URL})"
        with redis_for(Config(redis_url=url)) as config:
            if not url:
                source = f"a private embedded server at {config.redis_url}, removed on exit"
            ok = tour.run(console, config.redis_url, source)
    except CliError as exc:
        fail("demo", exc)
        raise typer.Exit(exc.code) from None
    except (OSError, RuntimeError, redis.RedisError) as exc:  # no Redis binary, a worker error reply...
        fail("demo", CliError(f"{type(exc).__name__}: {exc}"))
        raise typer.Exit(1) from None
    except KeyboardInterrupt:  # the worker and the embedded Redis are stopped on the way out
        print("fencemq demo: interrupted", file=sys.stderr)
        raise typer.Exit(130) from None
    if not url:
        console.print("[dim]Stopped the embedded Redis.[/dim]")
    if not ok:
        raise typer.Exit(1)


# -- status ------------------------------------------------------------------------------


@app.command()
def status(
    redis_url: OperatorRedisUrl = None,
    prefix: PrefixOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object {alarms, redis, workers, sessions, queues}.")] = False,
    limit: Annotated[int, typer.Option(min=0, help="Show at most this many queues and sessions.")] = 1000,
) -> None:
    """Workers, sessions and queues (backlog, checkouts, groups, owners, suspects), read from Redis.

    Read-only. Needs the broker's Redis: --redis-url, $FENCEMQ_REDIS_URL, or the
    private one of a `fencemq serve` running here (status never starts one).
    Once the broker has an administrator, the operator needs the inspect permission
    on every topic, as for queues, inspect and top (FENCEMQ_USER, docs/security.md).
    """
    from fencemq.cli import status as report
    from fencemq.cli.opskit import Ctx

    ctx = Ctx("status", redis_url, prefix, cluster=False)

    def collect() -> dict[str, Any]:
        client = connect(ctx.url)
        try:
            return report.collect(client, ctx.prefix, limit)
        finally:
            client.close()

    # Through the operator commands' context: the same URL, the same gate, the same errors.
    snap = ctx.run(lambda _r, _k: asyncio.to_thread(collect))
    if as_json:
        typer.echo(report.to_json(snap))
    else:
        report.render(Console(highlight=False), snap, ctx.url)


# The operator and analytics commands live in their own modules; they add themselves here.
ops.register(app)
analytics.register(app)
dashboard_cmd.register(app)


if __name__ == "__main__":
    app()
