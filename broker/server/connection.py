"""One client connection: read requests, run them, write replies, push notices.

The loop is thin: requests are read by fencemq.protocol.request_reader (no I/O), the
verbs live in fencemq.server.verbs and act for the connection's session
(fencemq.server.session), and the state lives in Redis. The connection alone
reads and writes the socket: while a verb waits, it keeps reading on the
verb's behalf to notice a hang-up. Whatever fails inside one connection
closes that connection only.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import anyio
from anyio.abc import SocketAttribute, SocketStream
from anyio.streams.memory import MemoryObjectReceiveStream
from redis.exceptions import RedisError

from fencemq.errors import FenceMQError, LimitExceeded
from fencemq.fences.redis_errors import redis_failure
from fencemq.protocol.commands import Request, parse
from fencemq.protocol.request_reader import RequestReader
from fencemq.protocol.resp import ErrorReply, Push, RequestError, RequestTooLarge, encode_many
from fencemq.server import metrics
from fencemq.server.gate import Pass
from fencemq.server.services import Services
from fencemq.server.session import Session
from fencemq.server.messaging_verbs import ClientGone
from fencemq.server.verbs import Verbs

log = logging.getLogger(__name__)

RECEIVE_SIZE = 65536
# Commands parsed and run in one go: the replies of one batch are one write, so
# this bounds what a pipelining client makes the worker hold for it at once.
MAX_PIPELINE = 256
STREAM_GONE = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError)


def _addresses(stream: SocketStream) -> tuple[str, str]:
    """host:port of the client and of the worker (CLIENT INFO), as far as the socket tells."""
    try:
        return tuple(":".join(map(str, stream.extra(a)[:2]))  # type: ignore[return-value]
                     for a in (SocketAttribute.remote_address, SocketAttribute.local_address))
    except (anyio.TypedAttributeLookupError, TypeError):  # a Unix socket, a wrapper without the attribute
        return ("", "")


def _transport_of(stream: Any) -> Any:
    """The event loop transport under an anyio stream (TLS or not), or None.

    anyio pauses a transport's reading only after a receive had to wait: a
    client that keeps the socket busy from the first byte is read without
    end into anyio's own queue, whatever the connection stops asking for.
    The connection pauses it itself after each receive (anyio resumes it when
    a receive next has to wait), so only what is asked for is read.
    """
    inner = getattr(stream, "transport_stream", stream)
    transport = getattr(inner, "_transport", None)
    return transport if hasattr(transport, "pause_reading") and hasattr(transport, "is_reading") else None


class ClientConnection:
    def __init__(self, services: Services, verbs: Verbs, stream: SocketStream, token: str,
                 gate_pass: Pass | None = None) -> None:
        self.config = services.config
        self.gate = services.gate
        self.verbs = verbs
        self.stream = stream
        self.idle = True  # waiting for a request: nothing in hand to finish
        self.scope = anyio.CancelScope()
        # Uncontended (no push being written), taking it does not yield: a reply's send yields once itself.
        self.send_lock = anyio.Lock(fast_acquire=True)
        self.session = Session(services, token, watch_for_hangup=self._watch_for_hangup,
                               end_connection=self.scope.cancel, addresses=_addresses(stream), gate_pass=gate_pass)
        # The parser's limits only guard memory (the connection is closed past
        # them); payload and batch limits are checked per command, so a client
        # that sends one oversize payload gets LIMIT and keeps its connection.
        self.parser = RequestReader(max_bulk=self.config.frame_bulk_limit, max_args=self.config.frame_args_limit)
        self._preauth = False
        self._set_frame_limits()
        self._idle_s = self.gate.idle_timeout_s
        self._transport = _transport_of(stream)
        self._request_s = self.gate.request_timeout_s
        self._request_began: float | None = None
        self._tasks: anyio.abc.TaskGroup | None = None

    def _read_wait_s(self) -> float:
        """How long to wait for more bytes: a begun request has request_timeout_ms from its first byte."""
        if not self.parser.mid_request:
            self._request_began = None
            return self._idle_s
        if self._request_began is None:
            self._request_began = time.monotonic()
        return max(0.0, self._request_began + self._request_s - time.monotonic())

    async def _receive(self) -> bytes:
        data = await self.stream.receive(RECEIVE_SIZE)
        transport = self._transport
        if transport is not None and transport.is_reading():
            transport.pause_reading()
        return data

    def _set_frame_limits(self) -> None:
        """Tiny frames until the connection authenticates (again, after a RESET)."""
        preauth = not self.session.authed
        if preauth != self._preauth:
            self._preauth = preauth
            config = self.config
            if preauth:
                self.parser.set_limits(max_bulk=config.preauth_max_bulk, max_args=config.preauth_max_args)
            else:
                self.parser.set_limits(max_bulk=config.frame_bulk_limit, max_args=config.frame_args_limit)

    @property
    def token(self) -> str:
        return self.session.token

    def drain(self, notice: dict[str, Any] | None = None, move_s: float = 0.0) -> None:
        """The worker is shutting down: long polls answer now; finish the commands in hand, then close.

        A RESP3 client is told first (``notice``, a ``draining`` push) and served on for ``move_s``, so
        a client that moves (the SDK) opens its next connection and collects its replies here before
        this one closes; a RESP2 client, which cannot be told, is closed once idle.
        """
        self.session.drain()
        if notice is not None and self.session.proto == 3 and move_s > 0 and self._tasks is not None:
            try:
                self.session.tell(notice)
            except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError):
                pass  # a full outbox: the close tells it instead
            self._tasks.start_soon(self._close_after, move_s)
            return
        self._close_when_idle()

    async def _close_after(self, seconds: float) -> None:
        await anyio.sleep(seconds)
        self._close_when_idle()

    def _close_when_idle(self) -> None:
        self.session.closing = True
        if self.idle:
            self.scope.cancel()

    def cut(self) -> None:
        """Close now, whatever is in hand."""
        self.scope.cancel()

    # -- I/O loop ----------------------------------------------------------------

    async def run(self) -> None:
        with self.scope:
            async with anyio.create_task_group() as tg:
                self._tasks = tg
                tg.start_soon(self._send_pushes, self.session.outbox)
                if not self.session.authed and self.gate.auth_timeout_s is not None:
                    tg.start_soon(self._close_unless_authenticated)
                await self._serve_requests()
                tg.cancel_scope.cancel()

    async def _close_unless_authenticated(self) -> None:
        """A connection that never authenticates holds nothing for long (slowloris)."""
        await anyio.sleep(self.gate.auth_timeout_s or 0)
        if not self.session.authed:
            log.info("closing %s: not authenticated within %d ms", self.session.peer, self.config.auth_timeout_ms)
            self.cut()

    async def _send_pushes(self, pushes: MemoryObjectReceiveStream[Push]) -> None:
        async with pushes:
            async for push in pushes:
                await self.send(encode_many([push], 3))

    def _parsed(self) -> tuple[list[list[bytes]], RequestError | None]:
        # Before authentication one command at a time: what follows an AUTH is
        # read with the limits that AUTH's outcome sets.
        most = 1 if self._preauth else MAX_PIPELINE
        commands: list[list[bytes]] = []
        try:
            while len(commands) < most and (cmd := self.parser.gets()) is not None:
                commands.append(cmd)
        except RequestError as exc:
            if self._preauth and isinstance(exc, RequestTooLarge):
                exc = RequestError(f"NOAUTH before authentication a frame holds at most "
                                   f"{self.config.preauth_max_args} arguments of at most "
                                   f"{self.config.preauth_max_bulk} bytes; authenticate first")
            return commands, exc
        return commands, None

    async def _serve_requests(self) -> None:
        session = self.session
        while not session.closing:
            # Bytes read while a blocking command ran are already buffered.
            commands, fatal = self._parsed()
            if not commands and fatal is None:
                try:
                    data = None
                    wait = self._read_wait_s()
                    if wait == float("inf"):  # between requests, with no idle timeout: no deadline to keep
                        data = await self._receive()
                    else:
                        with anyio.move_on_after(wait):
                            data = await self._receive()
                except STREAM_GONE:
                    return
                if data is None:
                    log.info("closing %s: %s", session.peer, "a request unfinished for "
                             f"{self.config.request_timeout_ms} ms" if self.parser.mid_request
                             else f"idle for {self.config.idle_timeout_ms} ms")
                    return
                self.parser.feed(data)
                continue
            self.idle = False
            self._request_began = None  # what remains is a request of its own, timed from now
            try:
                replies = await self.execute(commands) if commands else []
            except ClientGone:
                return
            if fatal is not None:
                replies.append(ErrorReply(fatal.message))
                session.closing = True
            self._set_frame_limits()
            if replies:
                await self.send(encode_many(replies, session.proto))  # (a send yields to the loop)
            else:
                # A batch of commands that never waited (PINGs, say) must not keep the event loop
                # from every other connection while this client's buffer lasts.
                await anyio.lowlevel.checkpoint()
            self.idle = True

    async def _watch_for_hangup(self, scope: anyio.CancelScope) -> None:
        """While a verb waits, keep reading: buffer what comes (up to max_read_ahead), notice a hang-up.

        Past the budget it stops reading: the socket's own back-pressure holds
        the client back, and a hang-up is noticed once the verb is done.
        """
        while self.parser.buffered < self.config.max_read_ahead:
            try:
                data = await self._receive()
            except STREAM_GONE:
                self.session.closing = self.session.gone = True
                scope.cancel()
                return
            self.parser.feed(data)

    async def send(self, data: bytes) -> None:
        async with self.send_lock:
            try:
                with anyio.move_on_after(self.gate.output_timeout_s) as waited:
                    await self.stream.send(data)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                self.session.closing = self.session.gone = True
                return
            if waited.cancelled_caught:
                # The client has not read its earlier replies for output_timeout_ms: as
                # Redis' client-output-buffer-limit, close it rather than hold more for it.
                log.info("closing %s: it has not read its replies for %d ms", self.session.peer,
                         self.config.output_timeout_ms)
                self.session.closing = self.session.gone = True
                self.cut()

    async def close(self) -> None:
        try:
            await self.session.release()
        except (OSError, RedisError, FenceMQError) as exc:  # out of open files, Redis gone, the worker stopping
            log.warning("cleanup of %s failed, its lease will expire: %s", self.session.client_id, exc)
        farewell = self.session.farewell
        if farewell is not None and self.session.proto == 3:
            # Say why before hanging up (a session taken over), if the client still reads.
            with anyio.move_on_after(1), contextlib.suppress(*STREAM_GONE):
                await self.stream.send(encode_many([farewell], 3))
        await self.stream.aclose()

    # -- running a pipeline ----------------------------------------------------------

    async def execute(self, commands: list[list[bytes]]) -> list[Any]:
        """The replies to pipelined commands, in order; PUBs back to back to one queue run as one."""
        requests: list[Request | FenceMQError] = []
        for args in commands:
            try:
                if len(args) > self.config.max_args:
                    raise LimitExceeded(
                        f"{len(args)} arguments exceed the limit of {self.config.max_args}; split the command"
                    )
                self._check_arg_sizes(args)
                requests.append(parse(args))
            except FenceMQError as exc:
                requests.append(exc)
        replies: list[Any] = []
        i = 0
        while i < len(requests):
            req = requests[i]
            if isinstance(req, FenceMQError):
                self.session.refused(req)
                replies.append(self._error(req))
                i += 1
                continue
            batching = self.session.authed and self.session.transaction is None
            if batching and self._ack_then_pull(requests, i):
                ack, pull = requests[i], requests[i + 1]
                try:
                    outcomes = await self.verbs.ack_then_pull(self.session, ack, pull)  # type: ignore[arg-type]
                except RedisError as exc:
                    outcomes = [exc, exc]
                replies.extend(self._outcome(r, out) for r, out in zip((ack, pull), outcomes))  # type: ignore
                i += 2
                if self.session.quit:
                    break
                continue
            key = req.batch_key() if batching else None
            j = i + 1
            if key is not None:
                while j < len(requests) and isinstance(requests[j], Request) and requests[j].batch_key() == key:
                    j += 1
            if j - i > 1:
                if key[0] == "PUB":  # type: ignore[index]
                    # each command checked as alone; a refusal is its own reply, never its neighbours'
                    outcomes = await self.verbs.publish_batch(self.session, requests[i:j])  # type: ignore[arg-type]
                else:
                    try:
                        outcomes = await self.verbs.sub_lmq_batch(self.session, requests[i:j])  # type: ignore
                    except (FenceMQError, RedisError):
                        # refused before any SUB ran, or cut short by Redis (a SUB may run twice: the
                        # same member again): one by one
                        outcomes = [await self._run_one(one) for one in requests[i:j]]  # type: ignore[arg-type]
                replies.extend(self._outcome(req, out) for req, out in zip(requests[i:j], outcomes))  # type: ignore
            else:
                replies.append(await self._run_one(req))
            i = j
            if self.session.quit:
                break
        return replies

    @staticmethod
    def _ack_then_pull(requests: list[Request | FenceMQError], i: int) -> bool:
        """``ACK h …`` followed by ``PULL h …`` of the same handle: one round trip to Redis for both."""
        if i + 1 >= len(requests):
            return False
        a, b = requests[i], requests[i + 1]
        return (isinstance(a, Request) and isinstance(b, Request) and a.verb == "ACK" and b.verb == "PULL"
                and a.args.get("handle") == b.args.get("handle"))

    def _check_arg_sizes(self, args: list[bytes]) -> None:
        """Every argument but a payload is small: names, tags, handles, options."""
        limit = self.config.max_arg_bytes
        if max(map(len, args)) <= limit:  # the common case, without a Python step per argument
            return
        verb = args[0][:8].upper()
        # PUB topic payload …, MPUB topic n payload… …: the payloads have max_payload
        payloads = (range(2, 3) if verb == b"PUB" else
                    range(3, len(args)) if verb == b"MPUB" else range(0))
        for i, arg in enumerate(args):
            if len(arg) > limit and i not in payloads:
                raise LimitExceeded(f"an argument of {len(arg)} bytes exceeds max_arg_bytes ({limit}); "
                                    f"only payloads may be larger")

    async def _run_one(self, req: Request) -> Any:
        try:
            return await self.verbs.run(self.session, req)
        except FenceMQError as exc:
            return self._error(exc)
        except RedisError as exc:
            return self._error(redis_failure(exc, req.verb, self.session.services.core.fences))

    def _outcome(self, req: Request, outcome: Any) -> Any:
        """A batched command's reply: its value, or its refusal as an error reply."""
        if isinstance(outcome, FenceMQError):
            return self._error(outcome)
        if isinstance(outcome, RedisError):
            return self._error(redis_failure(outcome, req.verb, self.session.services.core.fences))
        return outcome

    def _error(self, exc: FenceMQError) -> ErrorReply:
        metrics.ERRORS.labels(exc.code).inc()
        return ErrorReply(exc.resp())
