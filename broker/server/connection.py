"""One client connection: read requests, run them, write replies, push notices.

The loop is thin: requests are parsed by fencemq.protocol.resp (no I/O), the verbs live
in fencemq.server.verbs, and the state lives in Redis. Whatever fails inside one
connection closes that connection only.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import anyio
import msgpack
from anyio.abc import SocketStream
from redis.exceptions import RedisError

from fencemq.server import metrics
from fencemq.protocol.commands import Request, parse
from fencemq.errors import BadArgument, FenceMQError, LimitExceeded, NoAuth, NoPermission
from fencemq.model.keys import Handle, check_name
from fencemq.protocol.resp import ErrorReply, Push, RequestError, RequestParser, encode_many
from fencemq.server.verbs import ClientGone, Verbs

if TYPE_CHECKING:
    from fencemq.server.worker import Worker

log = logging.getLogger(__name__)


class ClientConnection(Verbs):
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
