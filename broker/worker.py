"""The worker: a thin anyio TCP server in front of the fences.

It speaks RESP2 and RESP3 (codec in broker.resp, command table in
broker.commands, both free of I/O), keeps no state that matters — everything
lives in Redis — and may die at any instant. Pipelined PUBs to one queue are
run as one fence call. SIGTERM drains: stop accepting, finish the commands in
hand, close connections (sessions stay, to be resumed on another worker).
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import uuid
from typing import Any

import anyio
import msgpack
from anyio.abc import SocketAttribute, SocketStream
from redis.exceptions import RedisError

from broker.redis_client import connect

from broker import __version__, metrics
from broker.commands import Request, parse
from broker.config import Config
from broker.errors import BadArgument, FenceMQError, LimitExceeded, NoAuth, NoPermission, WrongPassword
from broker.keyspace import Handle, check_name
from broker.fanout import FanOut, is_filter_target
from broker.queues import Queues
from broker.resp import ErrorReply, Prebuilt, Push, RequestError, RequestParser, SimpleString, encode_many
from broker.sessions import RedisClock, Sessions, unsubscribe_notice
from broker.sweeper import Sweeper
from broker.wakeups import Wakeups

log = logging.getLogger(__name__)
OK = SimpleString("OK")


class ClientGone(Exception):
    """The client hung up while its command was running."""


class Worker:
    def __init__(self, config: Config) -> None:
        if not config.redis_url:
            raise BadArgument("a worker needs redis_url (fencemq serve starts an embedded Redis when none is given)")
        self.config = config
        self.id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.port: int | None = None
        self.connections: dict[str, "ClientConnection"] = {}  # by connection token
        self._numbers = itertools.count(1)
        self._draining = anyio.Event()

    async def run(self, *, task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        redis = connect(self.config.redis_url)
        try:
            self.redis = redis
            self.queues = Queues(redis, self.config)
            self.fanout = FanOut(self.queues)
            self.keys = self.queues.keys
            self.clock = RedisClock(redis)
            self.sessions = Sessions(redis, self.keys, self.queues, self.clock, self.config.session_lease_ms)
            self.wakeups = Wakeups(redis, f"{self.config.prefix}:worker:{self.id}")
            sweeper = Sweeper(self.queues, self.sessions, self.config.sweep_interval_ms)
            listener = await anyio.create_tcp_listener(local_host=self.config.host, local_port=self.config.port)
            self.port = listener.extra(SocketAttribute.local_port)
            # Schedule writes run beside replies; their group outlives the services
            # and connections, so a drain still completes them.
            async with anyio.create_task_group() as writes:
                self.queues.spawn = writes.start_soon
                async with anyio.create_task_group() as services:
                    services.start_soon(self.wakeups.run)
                    await self.wakeups.follow(self.keys.filters_channel, lambda _: self.fanout.registry.invalidate())
                    services.start_soon(sweeper.run)
                    services.start_soon(self._keep_alive)
                    async with anyio.create_task_group() as conns:
                        accepting = anyio.CancelScope()
                        conns.start_soon(self._accept, listener, conns, accepting)
                        task_status.started(self.port)
                        await self._draining.wait()
                        accepting.cancel()
                        for conn in list(self.connections.values()):
                            conn.closing = True
                            if conn.idle:  # waiting for a request: nothing in hand to finish
                                conn.scope.cancel()
                        conns.start_soon(self._cut_stragglers)
                    services.cancel_scope.cancel()
            with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                await redis.zrem(self.keys.workers, self.id)  # gone: no need to wait for its lease
        finally:
            with anyio.CancelScope(shield=True):
                await redis.aclose()

    async def _accept(self, listener: Any, conns: anyio.abc.TaskGroup, scope: anyio.CancelScope) -> None:
        with scope:
            await listener.serve(self._serve_connection, task_group=conns)

    async def _cut_stragglers(self, grace_s: float = 2.0) -> None:
        """A long-poll in progress is not worth holding a shutdown for."""
        with anyio.move_on_after(grace_s):
            while self.connections:
                await anyio.sleep(0.02)
        for conn in list(self.connections.values()):
            conn.scope.cancel()

    def drain(self) -> None:
        """Stop accepting; connections finish what they hold and close."""
        self._draining.set()

    async def _serve_connection(self, stream: SocketStream) -> None:
        conn = ClientConnection(self, stream, f"{self.id}:{next(self._numbers)}")
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

    async def _keep_alive(self) -> None:
        """Refresh the leases of sessions connected here, and this worker's own."""
        while True:
            clients = [c.client_id for c in self.connections.values() if c.client_id and c.bound]
            try:
                await self.sessions.keep_alive(clients)
                now = await self.clock.now_ms()
                await self.redis.zadd(self.keys.workers, {self.id: now + self.config.session_lease_ms})
            except (OSError, RedisError) as exc:
                log.warning("could not refresh session leases: %s", exc)
            await anyio.sleep(self.config.session_lease_ms / 3000)


class ClientConnection:
    def __init__(self, worker: Worker, stream: SocketStream, token: str) -> None:
        self.worker = worker
        self.config = worker.config
        self.stream = stream
        self.token = token
        self.proto = 2
        self.client_id: str | None = None
        self.bound = False  # this connection holds its session
        self.anonymous = True
        self.authed = worker.config.password is None
        self.closing = False
        self.quit = False
        self.idle = True
        self.scope = anyio.CancelScope()
        self.send_lock = anyio.Lock()
        # The parser's limits only guard memory (the connection is closed past
        # them); payload and batch limits are checked per command, so a client
        # that sends one oversize payload gets LIMIT and keeps its connection.
        self.parser = RequestParser(max_bulk=max(64 << 20, 2 * self.config.max_payload), max_args=1_000_000)

    # -- I/O loop ----------------------------------------------------------------

    async def run(self) -> None:
        push_in, push_out = anyio.create_memory_object_stream[Push](64)
        self._pushes = push_in
        with self.scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._send_pushes, push_out)
                await self._serve_requests()
                tg.cancel_scope.cancel()

    async def _send_pushes(self, pushes: Any) -> None:
        async with pushes:
            async for push in pushes:
                await self.send(encode_many([push], 3))

    def _parsed(self) -> tuple[list[list[bytes]], RequestError | None]:
        commands: list[list[bytes]] = []
        try:
            while (cmd := self.parser.gets()) is not None:
                commands.append(cmd)
        except RequestError as exc:
            return commands, exc
        return commands, None

    async def _serve_requests(self) -> None:
        while not self.closing:
            # Bytes read while a blocking command ran are already buffered.
            commands, fatal = self._parsed()
            if not commands and fatal is None:
                try:
                    self.parser.feed(await self.stream.receive(65536))
                except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                    return
                continue
            self.idle = False
            try:
                replies = await self.execute(commands) if commands else []
            except ClientGone:
                return
            if fatal is not None:
                replies.append(ErrorReply(fatal.message))
                self.closing = True
            if replies:
                await self.send(encode_many(replies, self.proto))
            self.idle = True

    async def send(self, data: bytes) -> None:
        async with self.send_lock:
            try:
                await self.stream.send(data)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                self.closing = True

    async def close(self) -> None:
        if self.client_id is not None:
            channel = self.worker.keys.session_channel(self.client_id)
            try:
                await self.worker.wakeups.unfollow(channel, self._on_session_message)
                # A named session outlives its connection until its lease runs
                # out (the worker stops refreshing it now); an anonymous one ends.
                if self.bound and (self.anonymous or self.quit):
                    await self.worker.sessions.end(self.client_id)
                elif self.bound:
                    await self.worker.sessions.set_presence(self.client_id, online=False)
            except (OSError, RedisError) as exc:
                log.warning("cleanup of %s failed, its lease will expire: %s", self.client_id, exc)
        await self.stream.aclose()

    # -- dispatch ------------------------------------------------------------------

    async def execute(self, commands: list[list[bytes]]) -> list[Any]:
        requests: list[Request | FenceMQError] = []
        for args in commands:
            try:
                if len(args) > self.config.max_args:
                    raise LimitExceeded(
                        f"{len(args)} arguments exceed the limit of {self.config.max_args}; split the command"
                    )
                requests.append(parse(args))
            except FenceMQError as exc:
                requests.append(exc)
        replies: list[Any] = []
        i = 0
        while i < len(requests):
            req = requests[i]
            if isinstance(req, FenceMQError):
                replies.append(self._error(req))
                i += 1
                continue
            key = req.batch_key() if self.authed else None
            j = i + 1
            if key is not None:
                while j < len(requests) and isinstance(requests[j], Request) and requests[j].batch_key() == key:
                    j += 1
            if j - i > 1:
                try:
                    replies.extend(await self._publish_batch(requests[i:j]))  # type: ignore[arg-type]
                except FenceMQError:
                    # One bad command must not fail its neighbours: run them one by one.
                    for one in requests[i:j]:
                        replies.append(await self._run_one(one))  # type: ignore[arg-type]
            else:
                replies.append(await self._run_one(req))
            i = j
            if self.quit:
                break
        return replies

    async def _run_one(self, req: Request) -> Any:
        try:
            return await self.dispatch(req)
        except FenceMQError as exc:
            return self._error(exc)
        except RedisError as exc:
            log.warning("%s failed against Redis: %s", req.verb, exc)
            return self._error(FenceMQError(f"the broker's Redis did not answer ({exc}); retry"))

    def _error(self, exc: FenceMQError) -> ErrorReply:
        metrics.ERRORS.labels(exc.code).inc()
        return ErrorReply(exc.resp())

    async def dispatch(self, req: Request) -> Any:
        if len(req.args.get("payloads", ())) > self.config.max_batch or len(req.args.get("tags", ())) > self.config.max_batch:
            raise LimitExceeded(f"more than {self.config.max_batch} items in one command; split it")
        metrics.COMMANDS.labels(req.verb).inc()
        if not self.authed and req.verb not in ("HELLO", "AUTH", "PING", "QUIT"):
            raise NoAuth("authentication required; send AUTH password or HELLO 3 AUTH user password")
        handler = getattr(self, "cmd_" + req.verb.lower())
        return await handler(**req.args)

    def _handle(self, text: str) -> Handle:
        handle = Handle.decode(text)
        if handle.member != self.client_id:
            raise NoPermission("this handle belongs to another client; use the handle your own SUB returned")
        return handle

    async def _ensure_session(self) -> str:
        """The session of an unnamed connection is made on first use."""
        if not self.bound:
            await self._bind(self.client_id or self.anonymous_id, anonymous=self.client_id is None)
        assert self.client_id is not None
        return self.client_id

    @property
    def anonymous_id(self) -> str:
        return "anon-" + self.token.replace(":", "-")

    async def _bind(self, client_id: str, anonymous: bool) -> None:
        check_name(client_id, "client")
        if self.bound and self.client_id != client_id:
            raise BadArgument("this connection already has a client id; open a new connection for another")
        self.client_id, self.anonymous = client_id, anonymous
        await self.worker.wakeups.follow(self.worker.keys.session_channel(client_id), self._on_session_message)
        await self.worker.sessions.bind(client_id, self.token, self.worker.id)
        self.bound = True
        if not anonymous:
            await self.worker.sessions.set_presence(client_id, online=True)

    def _on_session_message(self, data: bytes) -> None:
        notice = msgpack.unpackb(data)
        if notice.get("type") == "takeover":
            if notice.get("conn") != self.token:
                # The same client id connected elsewhere: that connection owns the session now.
                self.bound = False
                self.closing = True
                self.scope.cancel()
            return
        if self.proto == 3 and not self.closing:
            try:
                self._pushes.send_nowait(Push(["notice", notice]))
            except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError):
                pass  # never block the pub/sub reader; the notice stays queued for HEARTBEAT

    # -- verbs ---------------------------------------------------------------------

    async def cmd_hello(self, proto: int | None = None, username: str | None = None,
                        password: str | None = None, client_id: str | None = None) -> Any:
        if password is not None:
            await self.cmd_auth(argv=[password.encode()])
        if not self.authed:
            raise NoAuth("HELLO must carry AUTH user password on this server")
        if proto is not None:
            self.proto = proto
        if client_id is not None and client_id != self.client_id:
            await self._bind(client_id, anonymous=False)
        return {
            "server": "fencemq", "version": __version__, "proto": self.proto,
            "id": self.client_id or self.anonymous_id, "worker": self.worker.id, "mode": "standalone", "role": "master",
            "modules": [],
        }

    async def cmd_auth(self, argv: list[bytes]) -> Any:
        expected = self.config.password
        if expected is None:
            raise FenceMQError("AUTH called without any password configured for this worker")
        if argv[-1].decode("utf-8", "replace") != expected:
            raise WrongPassword("invalid username-password pair or user is disabled.")
        self.authed = True
        return OK

    async def cmd_ping(self, argv: list[bytes]) -> Any:
        return argv[0] if argv else SimpleString("PONG")

    async def cmd_quit(self, argv: list[bytes]) -> Any:
        self.quit = True
        self.closing = True
        return OK

    async def cmd_select(self, argv: list[bytes]) -> Any:
        if argv[0] != b"0":
            raise BadArgument("FenceMQ has a single database; SELECT 0")
        return OK

    async def cmd_command(self, argv: list[bytes]) -> Any:
        return []  # redis-cli asks for COMMAND DOCS; an empty table keeps it happy

    async def cmd_client(self, argv: list[bytes]) -> Any:
        sub = argv[0].decode("utf-8", "replace").upper()
        if sub == "SETNAME" and len(argv) == 2:
            await self._bind(argv[1].decode("utf-8", "replace"), anonymous=False)
            return OK
        if sub == "GETNAME":
            return self.client_id
        if sub == "ID":
            return int(self.token.rsplit(":", 1)[1])
        if sub == "SETINFO":
            return OK
        raise BadArgument("CLIENT takes SETNAME id, GETNAME, ID or SETINFO")

    async def cmd_pub(self, topic: str, payloads: list[bytes], lmq: str | None = None, qos: int = 1,
                      retain: bool = False, dedup_ids: list[str] | None = None,
                      headers: dict[str, str] | None = None) -> Any:
        ids = await self.worker.fanout.publish(
            topic, payloads, lmq=lmq, qos=qos, dedup_ids=dedup_ids, headers=headers, producer=self.client_id,
            retain=retain,
        )
        metrics.PUBLISHED.inc(len(ids))
        return ids[0]

    async def cmd_mpub(self, topic: str, payloads: list[bytes], lmq: str | None = None, qos: int = 1) -> Any:
        ids = await self.worker.fanout.publish(topic, payloads, lmq=lmq, qos=qos, producer=self.client_id)
        metrics.PUBLISHED.inc(len(ids))
        return ids

    async def _publish_batch(self, reqs: list[Request]) -> list[Any]:
        """Pipelined PUB/MPUB to one queue: one fence call, ids handed back per command."""
        first = reqs[0].args
        payloads = [p for r in reqs for p in r.args["payloads"]]
        ids: list[str] = []
        for start in range(0, len(payloads), self.config.max_batch):
            ids += await self.worker.fanout.publish(
                first["topic"], payloads[start : start + self.config.max_batch], lmq=first.get("lmq"),
                qos=first.get("qos", 1), producer=self.client_id,
            )
        metrics.PUBLISHED.inc(len(ids))
        replies: list[Any] = []
        for r in reqs:
            n = len(r.args["payloads"])
            replies.append(ids[:n] if r.verb == "MPUB" else ids[0])
            ids = ids[n:]
        return replies

    async def cmd_sub(self, topic: str, push: bool = False, **options: Any) -> Any:
        if push:
            options["capacity"] = options.get("capacity") or self.config.mailbox_capacity
        client = await self._ensure_session()
        if is_filter_target(topic):
            if options.get("lmq") is not None or options.get("group") is not None or options.get("mode"):
                raise BadArgument("a topic filter takes no LMQ, GROUP or MODE; share it as $share/<group>/<filter>")
            allowed = {"qos", "capacity", "max_messages", "lock_ms", "strategy", "skip_offline", "epoch"}
            extra = set(options) - allowed
            if extra:
                raise BadArgument(f"a topic filter subscription does not take {', '.join(sorted(extra)).upper()}")
            return (await self.worker.fanout.subscribe(client, topic, **options)).as_reply()
        sub = await self.worker.queues.subscribe(client, topic, **options)
        if sub.evicted:
            mine = Handle.decode(sub.handle)
            evicted = Handle(mine.queue, mine.group, sub.evicted)
            await self.worker.sessions.notify(sub.evicted, unsubscribe_notice(evicted, client))
        return sub.as_reply()

    async def cmd_pull(self, handle: str, count: int = 1, block_ms: int | None = None) -> Any:
        h = self._handle(handle)
        queues = self.worker.queues
        result = await queues.pull(h, count)
        if not result.deliveries and result.status == "ok" and block_ms is not None:
            result = await self._long_poll(h, block_ms, lambda: queues.pull(h, count), lambda r: bool(
                r.deliveries or r.status != "ok"))
        metrics.DELIVERED.inc(len(result.deliveries))
        header = b"*%d\r\n" % len(result.deliveries)
        return Prebuilt(header + b"".join(d.encode(self.proto) for d in result.deliveries))

    async def _long_poll(self, h: Handle, block_ms: int, attempt: Any, done: Any) -> Any:
        """Wait on the queue's wake channel, looking again after each wake-up.

        The subscription is confirmed before the first look, so a publish
        between a look and the wait is never missed; BLOCK 0 waits up to
        max_block_ms.
        """
        timeout = min(block_ms or self.config.max_block_ms, self.config.max_block_ms) / 1000
        result = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch_for_hangup, tg.cancel_scope)
            with anyio.move_on_after(timeout):
                async with self.worker.wakeups.watching(self.worker.keys.queue(h.queue).wake) as waiter:
                    while True:
                        result = await attempt()
                        if done(result):
                            break
                        await waiter.wait()
            tg.cancel_scope.cancel()
        if self.closing:
            # The client hung up while it waited: nothing more is checked out to it.
            raise ClientGone
        return result if result is not None else await attempt()

    async def _watch_for_hangup(self, scope: anyio.CancelScope) -> None:
        """While a command blocks, keep reading: buffer what comes, notice a hang-up."""
        while True:
            try:
                data = await self.stream.receive(65536)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                self.closing = True
                scope.cancel()
                return
            self.parser.feed(data)

    async def cmd_take(self, handle: str, block_ms: int | None = None) -> Any:
        h = self._handle(handle)
        queues = self.worker.queues
        result = await queues.take(h)
        if result is None and block_ms is not None:
            result = await self._long_poll(h, block_ms, lambda: queues.take(h), lambda r: r is not None)
        if result == "EOS":
            return SimpleString("EOS")
        if result is None:
            return None
        metrics.DELIVERED.inc()
        return Prebuilt(result.encode(self.proto))

    async def cmd_ack(self, handle: str, tags: list[str]) -> Any:
        n = await self.worker.queues.ack(self._handle(handle), tags)
        metrics.ACKED.inc(n)
        return n

    async def cmd_nack(self, handle: str, tags: list[str], delay_ms: int = 0, discard: bool = False) -> Any:
        return await self.worker.queues.nack(self._handle(handle), tags, delay_ms=delay_ms, discard=discard)

    async def cmd_renew(self, handle: str, tags: list[str], lock_ms: int | None = None) -> Any:
        n = await self.worker.queues.renew(self._handle(handle), tags, lock_ms=lock_ms)
        metrics.RENEWALS.inc(n)
        return n

    async def cmd_seek(self, handle: str, kind: str, arg: int | None) -> Any:
        epoch, _, _ = await self.worker.queues.seek(self._handle(handle), kind, arg)
        return epoch

    async def cmd_unsub(self, handle: str, max_messages: int | None = None) -> Any:
        if max_messages is not None:
            await self.worker.queues.end_after(self._handle(handle), max_messages)
            return OK
        await self.worker.queues.unsubscribe(self._handle(handle))
        return OK

    async def cmd_heartbeat(self, sync: tuple[str, str, list[str]] | None = None) -> Any:
        client = await self._ensure_session()
        if sync is not None:
            topic, group, lmqs = sync
            await self.worker.sessions.resync(client, topic, group, lmqs)
        return await self.worker.sessions.drain_notices(client)

