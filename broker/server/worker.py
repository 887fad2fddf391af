"""The worker: a thin anyio TCP server in front of the fences.

It speaks RESP2 and RESP3 (codec in fencemq.protocol.resp, command table in
fencemq.protocol.commands, both free of I/O) over TCP or TLS (the ``tls_*`` settings),
to a single Redis or a Cluster (fencemq.fences.redis_client.open_redis), keeps no
state that matters — everything lives in Redis — and may die at any instant.
Pipelined PUBs to one queue are run as one fence call. SIGTERM drains: stop
accepting, tell the clients to move (RESP3: a ``draining`` push; MQTT 5:
DISCONNECT 0x8B Server shutting down, with a Server Reference when
configured), answer long polls at once, finish the commands in hand and
close, all within ``drain_timeout_ms``; sessions stay, to be resumed on
another worker (docs/operations.md, "Deploying").
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import ssl
import uuid
from functools import partial
from typing import Any

import anyio
from anyio.abc import SocketAttribute, SocketStream
from anyio.streams.tls import TLSListener
from redis.exceptions import RedisError

from fencemq.config import Config
from fencemq.errors import BadArgument
from fencemq.fences.core import Core
from fencemq.fences.redis_client import open_redis
from fencemq.server import metrics
from fencemq.server.connection import ClientConnection
from fencemq.server.services import Services
from fencemq.server.sweeper import Sweeper
from fencemq.server.verbs import Verbs

log = logging.getLogger(__name__)

MOVE_WINDOW_S = 1.0  # how long a draining worker serves a RESP3 client it told to move, at most


def client_tls(config: Config) -> ssl.SSLContext | None:
    """The TLS context clients connect with, or None for plain TCP."""
    if not config.tls_cert_file and not config.tls_key_file:
        if config.tls_ca_file:
            raise BadArgument("tls_ca_file needs tls_cert_file and tls_key_file (the worker's own certificate)")
        return None
    if not (config.tls_cert_file and config.tls_key_file):
        raise BadArgument("TLS needs both tls_cert_file and tls_key_file")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(config.tls_cert_file, config.tls_key_file)
    if config.tls_ca_file:
        context.load_verify_locations(config.tls_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class QuietTLSListener(TLSListener):
    """A failed or stalled handshake is one log line (who, why), never a traceback."""

    @staticmethod
    async def handle_handshake_error(exc: BaseException, stream: Any) -> None:
        peer = ""
        try:
            peer = ":".join(map(str, stream.extra(SocketAttribute.remote_address)[:2]))
        except Exception:  # noqa: BLE001 - only for the log line: a socket already gone has no address
            pass
        with anyio.CancelScope(shield=True):
            await anyio.aclose_forcefully(stream)
        if isinstance(exc, anyio.get_cancelled_exc_class()) or not isinstance(exc, Exception):
            raise exc
        why = "no handshake within the timeout" if isinstance(exc, TimeoutError) else \
            (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        log.info("TLS handshake with %s failed: %s", peer or "a client", why)


class Worker:
    def __init__(self, config: Config) -> None:
        if not config.redis_url:
            raise BadArgument("a worker needs redis_url (fencemq serve starts an embedded Redis when none is given)")
        self.config = config
        self.tls = client_tls(config)  # a bad TLS setting fails here, before anything starts
        self.id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.port: int | None = None
        self.mqtt_port: int | None = None  # where MQTT clients connect, when config.mqtt_port asks for it
        self.mqtt_ws_port: int | None = None  # MQTT over WebSocket, when config.mqtt_ws_port asks for it
        self.connections: dict[str, ClientConnection] = {}  # by connection token
        self._numbers = itertools.count(1)
        self._draining = anyio.Event()

    async def run(self, *, task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        redis = await open_redis(self.config.redis_url)
        try:
            self.services = services = Services.over(redis, self.config, self.id)
            await services.handles.load(redis, services.keys.handle_secret)
            self.verbs = Verbs(services)
            sweeper = Sweeper(services.core, self.config.sweep_interval_ms, self.id, self.attached_clients)
            listener: Any = await anyio.create_tcp_listener(local_host=self.config.host, local_port=self.config.port)
            self.port = listener.extra(SocketAttribute.local_port)
            if self.tls is not None:
                # the handshake runs in the connection's own task: a client that
                # fails it is logged and dropped, nobody else waits on it
                listener = QuietTLSListener(listener, self.tls, standard_compatible=False,
                                            handshake_timeout=self.config.tls_handshake_timeout_ms / 1000)
            # Schedule writes run beside replies; their group outlives the background tasks
            # and connections, so a drain still completes them.
            async with anyio.create_task_group() as writes:
                services.core.ctx.spawn = writes.start_soon
                async with anyio.create_task_group() as background:
                    background.start_soon(services.wakeups.run)
                    await services.wakeups.follow(
                        services.keys.filters_channel, lambda _: services.core.shared.registry.invalidate())
                    background.start_soon(sweeper.run)
                    background.start_soon(self._keep_alive)
                    if self.config.metrics_port is not None:
                        services.core.fences.observe = metrics.observe_fence
                        background.start_soon(partial(
                            metrics.run_sampler, redis, services.keys, every_ms=self.config.metrics_sample_ms,
                            scan_limit=self.config.metrics_scan_limit, max_topics=self.config.metrics_max_topics,
                            top_lmqs=self.config.metrics_top_lmqs))
                    async with anyio.create_task_group() as conns:
                        accepting = anyio.CancelScope()
                        conns.start_soon(self._accept, listener, conns, accepting)
                        accepting_mqtt = anyio.CancelScope()
                        if self.config.mqtt_port is not None or self.config.mqtt_ws_port is not None:
                            self.mqtt_port = await conns.start(self._accept_mqtt, accepting_mqtt, conns)
                        task_status.started(self.port)
                        await self._draining.wait()
                        accepting.cancel()
                        accepting_mqtt.cancel()
                        self._drain_connections()
                        conns.start_soon(self._cut_stragglers, self.config.drain_timeout_ms / 1000, conns)
                    background.cancel_scope.cancel()
            with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                await redis.zrem(services.keys.workers, self.id)  # gone: no need to wait for its lease
        finally:
            with anyio.CancelScope(shield=True):
                await redis.aclose()

    async def _accept(self, listener: Any, conns: anyio.abc.TaskGroup, scope: anyio.CancelScope) -> None:
        # closed when accepting stops: a draining worker refuses new connections rather than leave
        # them in the kernel's backlog until it exits
        async with listener:
            with scope:
                await listener.serve(self._serve_connection, task_group=conns)

    async def _accept_mqtt(self, scope: anyio.CancelScope, conns: anyio.abc.TaskGroup, *,
                           task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        from fencemq.server.mqtt.serving import serve_mqtt

        with scope:
            await serve_mqtt(self, self.config.mqtt_port, self.tls, ws_port=self.config.mqtt_ws_port,
                             connections=conns, task_status=task_status)

    def _drain_connections(self) -> None:
        """Tell every client to move (RESP3: a ``draining`` push; MQTT 5: DISCONNECT 0x8B, with the
        Server Reference when configured) and let each finish what it has in hand."""
        bound_ms = self.config.drain_timeout_ms
        notice: dict[str, Any] = {"type": "draining", "worker": self.id, "within_ms": bound_ms}
        if self.config.server_reference:
            notice["server_reference"] = self.config.server_reference
        # A RESP3 client is served on for a moment after the push: the SDK connects elsewhere and
        # collects its replies here meanwhile; the bound cuts whatever is left.
        move_s = min(MOVE_WINDOW_S, bound_ms / 2000)
        for conn in list(self.connections.values()):
            conn.drain(notice, move_s)

    async def _cut_stragglers(self, bound_s: float, conns: anyio.abc.TaskGroup) -> None:
        """Nothing holds a shutdown longer than ``drain_timeout_ms``; what the connections left
        behind (an MQTT will waiting out its delay: it goes now) ends with them."""
        with anyio.move_on_after(bound_s):
            while self.connections:
                await anyio.sleep(0.02)
        for conn in list(self.connections.values()):
            conn.cut()
        conns.cancel_scope.cancel()

    def drain(self) -> None:
        """Stop accepting; tell clients to move; connections finish what they hold and close."""
        self._draining.set()

    async def _serve_connection(self, stream: SocketStream) -> None:
        if len(self.connections) >= self.config.max_connections:
            # as Redis: say why, then close, before anything is allocated for it
            with anyio.move_on_after(1):
                try:
                    await stream.send(b"-ERR max number of clients reached\r\n")
                except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
                    pass
            await anyio.aclose_forcefully(stream)
            return
        conn = ClientConnection(self.services, self.verbs, stream, f"{self.id}:{next(self._numbers)}")
        self.connections[conn.token] = conn
        metrics.CONNECTIONS.inc()
        try:
            await conn.run()
        except Exception:  # one connection's failure must never take the worker down
            log.exception("connection %s failed; closing it", conn.token)
        finally:
            del self.connections[conn.token]
            metrics.CONNECTIONS.dec()
            with anyio.CancelScope(shield=True):
                await conn.close()

    @property
    def core(self) -> Core:
        """The worker's fences (tests reach in to inject Redis failures)."""
        return self.services.core

    def attached_clients(self) -> set[str]:
        """Client ids whose session a connection of this worker holds."""
        return {c.session.client_id for c in self.connections.values() if c.session.client_id and c.session.bound}

    async def _keep_alive(self) -> None:
        """Refresh this worker's lease, then those of the sessions connected here.

        The worker's own lease first: another worker's sweeper leaves a live
        worker's sessions alone. After a failure (a Redis outage) it tries
        again at once, not a third of a lease later.
        """
        while True:
            services = self.services
            pause = self.config.session_lease_ms / 3000
            try:
                now = await services.clock.now_ms()
                await services.redis.zadd(services.keys.workers, {self.id: now + self.config.session_lease_ms})
                gone = set(await services.sessions.keep_alive(sorted(self.attached_clients())))
                for conn in list(self.connections.values()):
                    if conn.session.client_id in gone and conn.session.bound:
                        # its session was ended (say, after an outage longer than the lease): the
                        # client reconnects to a fresh one rather than act for a session that is gone
                        conn.session.bound = False
                        conn.cut()
            except (OSError, RedisError) as exc:
                log.warning("could not refresh session leases: %s", exc)
                pause = 0.2
            await anyio.sleep(pause)
