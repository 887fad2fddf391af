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

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import ssl
import time
import uuid
from dataclasses import replace
from functools import partial
from typing import Any

import anyio
from anyio.abc import SocketAttribute

from fencemq.config import Config
from fencemq.errors import BadArgument, LimitExceeded
from fencemq.fences.core import Core
from fencemq.fences.durability import Durability
from fencemq.fences.redis_client import limit_connections, servers_of
from fencemq.fences.redis_errors import REDIS_FAILURES
from fencemq.fences.redis_link import RedisLink
from fencemq.server import file_limit, metrics
from fencemq.server.accepting import RESP_REFUSAL, Refusals, SpareDescriptor, serve_sockets, shedding
from fencemq.server.admission import Admission
from fencemq.server.connection import ClientConnection
from fencemq.server.health_watch import HealthWatch
from fencemq.server.mqtt.wills import Wills
from fencemq.server.services import Services
from fencemq.server.startup import ready_services
from fencemq.server.sweeper import Sweeper
from fencemq.server.tls import client_tls
from fencemq.server.verbs import Verbs

log = logging.getLogger(__name__)

KEEP_ALIVE_BATCH = 512  # session leases refreshed per round trip
MOVE_WINDOW_S = 1.0  # how long a draining worker serves a RESP3 client it told to move, at most


class Worker:
    def __init__(self, config: Config) -> None:
        if not config.redis_url:
            raise BadArgument("a worker needs redis_url (fencemq serve starts an embedded Redis when none is given)")
        self.config = config
        self.tls = client_tls(config)  # a bad TLS setting fails here, before anything starts
        Durability.parse(config.durability, config.durability_timeout_ms)  # as does a bad durability
        self.id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.port: int | None = None
        self.mqtt_port: int | None = None  # where MQTT clients connect, when config.mqtt_port asks for it
        self.mqtt_ws_port: int | None = None  # MQTT over WebSocket, when config.mqtt_ws_port asks for it
        self.connections: dict[str, ClientConnection] = {}  # by connection token
        self._numbers = itertools.count(1)
        self._draining = anyio.Event()
        self.mqtt_admission: Admission | None = None  # MQTT connections in their connect phase (admission.py)
        self.refusals = Refusals()  # connections past max_connections being told so
        self.spare: SpareDescriptor | None = None  # what accept sheds a connection with when no descriptor is left
        self.files: file_limit.FileBudget | None = None  # how the open files are shared out, once started

    async def run(self, *, task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        files = self._fit_open_files()

        async def check_memory(services: Services) -> None:
            services.core.ctx.memory.on_sample = metrics.memory_sampled
            await services.core.ctx.memory.start()  # a Redis that may evict keys: EVICTING, before anything listens

        # waits for Redis (down, loading, failing over, NOREPLICAS), saying so
        redis, services = await ready_services(self.config, self.id, max_connections=files.redis_pool,
                                               prepare=check_memory)
        link = RedisLink.for_client(redis)  # the fences' calls, pipelined on one connection (not on a Cluster)
        spare = SpareDescriptor()
        try:
            self.spare = spare
            servers = servers_of(redis)
            if servers > 1:  # a Cluster has a pool per master: within the same share of the open files
                limit_connections(redis, max(file_limit.MIN_REDIS_POOL, files.redis_pool // servers))
            self.services: Services = services
            services.core.fences.link = link
            memory = services.core.ctx.memory
            self.verbs = Verbs(services)
            sweeper = Sweeper(services.core, self.config.sweep_interval_ms, self.id, self.attached_clients,
                              Wills(services))
            services.core.ctx.on_fenced_poll = sweeper.remind
            listener: Any = await anyio.create_tcp_listener(local_host=self.config.host, local_port=self.config.port)
            self.port = listener.extra(SocketAttribute.local_port)
            listener = shedding(listener, spare, b"" if self.tls is not None else RESP_REFUSAL)
            # Schedule writes run beside replies; their group outlives the background tasks
            # and connections, so a drain still completes them.
            async with anyio.create_task_group() as writes:
                services.core.ctx.spawn = writes.start_soon
                services.core.ctx.local_wids = services.wakeups.wid_prefix
                services.core.ctx.handed_here = services.wakeups.handed_here
                async with anyio.create_task_group() as background:
                    background.start_soon(services.wakeups.run)
                    await services.wakeups.follow(
                        services.keys.filters_channel, lambda _: services.core.shared.registry.invalidate())
                    # a user whose record changed: the gate updates or ends its connections here
                    services.gate.spawn = background.start_soon
                    await services.wakeups.follow(
                        services.keys.users_channel,
                        lambda name: services.gate.user_changed(name.decode("utf-8", "replace")))
                    background.start_soon(sweeper.run)
                    background.start_soon(self._keep_alive)
                    background.start_soon(self._heartbeat)
                    background.start_soon(memory.run)
                    background.start_soon(HealthWatch(services, self.config.redis_url).run)
                    if self.config.metrics_port is not None:
                        services.core.fences.observe = metrics.observe_fence
                        background.start_soon(partial(
                            metrics.run_sampler, redis, services.keys, every_ms=self.config.metrics_sample_ms,
                            scan_limit=self.config.metrics_scan_limit, max_topics=self.config.metrics_max_topics,
                            top_lmqs=self.config.metrics_top_lmqs, url=self.config.redis_url,
                            totals=services.totals))
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
                try:
                    await redis.zrem(services.keys.workers, self.id)  # gone: no need to wait for its lease
                    await redis.hdel(services.keys.worker_figures, self.id)
                except REDIS_FAILURES as exc:  # a demoted or unreachable Redis: its lease runs out instead
                    log.warning("could not sign the worker off (its lease will run out): %s", exc)
        finally:
            with anyio.CancelScope(shield=True):
                if link is not None:
                    await link.aclose()
                await redis.aclose()
            spare.close()

    def _fit_open_files(self) -> file_limit.FileBudget:
        """Raise the open-file limit, and cap max_connections to what fits beside Redis and the reserve
        (before anything is built on the configuration: the gate counts against it)."""
        self.files = files = file_limit.budget()
        configured = self.config.max_connections
        (log.warning if configured > files.clients else log.info)("%s", files.describe(configured))
        if configured > files.clients:
            self.config = replace(self.config, max_connections=files.clients)
        return files

    async def _accept(self, listener: Any, conns: anyio.abc.TaskGroup, scope: anyio.CancelScope) -> None:
        with scope:
            try:
                await serve_sockets(listener, partial(self._serve_connection, conns))
            finally:
                with anyio.CancelScope(shield=True):
                    await listener.aclose()

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

    async def _serve_connection(self, conns: anyio.abc.TaskGroup, sock: socket.socket, address: Any) -> None:
        """A RESP client: refused past max_connections before anything is allocated for it, else a
        ClientConnection on a transport of its own (after the TLS handshake, with certificates)."""
        gate = self.services.gate
        host, port = (address[0], address[1]) if isinstance(address, tuple) else ("", "")
        try:
            gate_pass = gate.enter("resp", host)
        except LimitExceeded:  # past max_connections, every door counted
            with self.refusals.told() as telling, contextlib.suppress(OSError):
                if telling and self.tls is None:
                    sock.send(RESP_REFUSAL)  # as Redis: say why, then close (a fresh socket's buffer has room)
            sock.close()
            return
        try:
            local = ":".join(map(str, sock.getsockname()[:2]))
        except OSError:
            local = ""
        conn = ClientConnection(self.services, self.verbs, f"{self.id}:{next(self._numbers)}", gate_pass,
                                addresses=(f"{host}:{port}" if host else "", local), spawn=conns.start_soon,
                                on_closed=self._connection_closed)
        self.connections[conn.token] = conn
        metrics.CONNECTIONS.inc()
        if self.tls is None:
            await self._attach(conn, sock)
        else:  # the handshake runs in a task of its own: a client that fails it holds nobody up
            conns.start_soon(self._attach, conn, sock)

    async def _attach(self, conn: ClientConnection, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            if self.tls is None:
                await loop.connect_accepted_socket(lambda: conn, sock)
            else:
                await loop.connect_accepted_socket(lambda: conn, sock, ssl=self.tls,
                                                   ssl_handshake_timeout=self.services.gate.handshake_timeout_s)
        except (OSError, asyncio.TimeoutError, ssl.SSLError) as exc:
            # a failed or stalled handshake (or a client gone already) is one line, never a traceback
            why = "no handshake within the timeout" if isinstance(exc, TimeoutError) else \
                (str(exc).splitlines() or [type(exc).__name__])[0][:200]
            log.info("TLS handshake with %s failed: %s" if self.tls else "connection from %s failed: %s",
                     conn.session.peer or "a client", why)
            sock.close()
            conn.cut()

    def _connection_closed(self, conn: ClientConnection) -> None:
        self.connections.pop(conn.token, None)
        metrics.CONNECTIONS.dec()
        self.services.gate.leave(conn.session.gate_pass)

    @property
    def core(self) -> Core:
        """The worker's fences (tests reach in to inject Redis failures)."""
        return self.services.core

    def attached_clients(self) -> set[str]:
        """Client ids whose session a connection of this worker holds."""
        return {c.session.client_id for c in self.connections.values() if c.session.client_id and c.session.bound}

    async def _still_here(self) -> None:
        """This worker's own lease in the workers index: another worker's sweeper leaves its sessions alone."""
        now = await self.services.clock.now_ms()
        await self.services.core.ctx.set_scores(self.services.keys.workers, {self.id: now + self.config.session_lease_ms})

    async def _heartbeat(self) -> None:
        """The worker's own lease, every third of a lease, in a task of its own: a keep-alive round
        of many sessions that runs late (a connect storm) never makes the worker look dead to the
        others, whose sweepers would then end its sessions."""
        while True:
            try:
                await self._still_here()
            except REDIS_FAILURES as exc:
                log.warning("could not refresh the worker's lease: %s", exc)
            except Exception:  # a bug (or a client library's surprise) must not end the worker: the next round
                log.exception("refreshing the worker's lease failed")
            await anyio.sleep(self.config.session_lease_ms / 3000)

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
                started = time.monotonic()
                await self._still_here()
                clients = list(self.attached_clients())
                gone: set[str] = set()
                for start in range(0, len(clients), KEEP_ALIVE_BATCH):  # a slice at a time: others are served between
                    if start and time.monotonic() - started > pause:
                        # a round running late (a connect storm): the worker's own lease again, so
                        # that no other worker's sweeper takes it for dead while it works through
                        await self._still_here()
                    gone.update(await services.sessions.keep_alive(clients[start:start + KEEP_ALIVE_BATCH]))
                took = time.monotonic() - started
                if took > pause:
                    log.warning("refreshing %d session leases took %.1f s (they run %d ms): the worker is behind",
                                len(clients), took, self.config.session_lease_ms)
                for conn in list(self.connections.values()) if gone else ():
                    if conn.session.client_id in gone and conn.session.bound:
                        # its session was ended (say, after an outage longer than the lease): the
                        # client reconnects to a fresh one rather than act for a session that is gone
                        log.info("closing %s: its session %r was ended", conn.session.peer, conn.session.client_id)
                        conn.session.bound = False
                        conn.cut()
            except REDIS_FAILURES as exc:
                log.warning("could not refresh session leases: %s", exc)
                pause = 0.2
            except Exception:  # a bug (or a client library's surprise) must not end the worker: the next round
                log.exception("refreshing session leases failed")
                pause = 0.2
            await anyio.sleep(pause)
