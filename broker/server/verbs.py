"""The verbs of the wire protocol (docs/protocol.md), one handler each.

``Verbs.run(session, request)`` looks the request's verb up in a table and
calls its handler with the session it acts for and the keyword arguments that
fencemq.protocol.commands parsed; the handler returns the reply value. Errors
are raised as FenceMQError and turned into RESP errors by the connection. A
handler never reads the socket: a verb that waits asks its session to watch
for a hang-up meanwhile.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from fencemq import __version__
from fencemq.errors import BadArgument, FenceMQError, LimitExceeded, NoAuth, WrongPassword
from fencemq.fences.lite import unsubscribe_notice
from fencemq.fences.shared import is_filter_target
from fencemq.model.keys import Handle
from fencemq.protocol.commands import TABLE, Request
from fencemq.protocol.deliveries import encode_deliveries, encode_delivery
from fencemq.protocol.resp import Prebuilt, SimpleString, encode_bulk_array
from fencemq.server import metrics
from fencemq.server.services import Services
from fencemq.server.session import Session

OK = SimpleString("OK")
BEFORE_AUTH = frozenset({"HELLO", "AUTH", "PING", "QUIT"})

Handler = Callable[..., Awaitable[Any]]


def id_array(ids: list[str]) -> Prebuilt:
    """An MPUB reply: message ids (decimal, so a space never occurs in one) encoded in one go."""
    return Prebuilt(encode_bulk_array(" ".join(ids).encode().split()))


class ClientGone(Exception):
    """The client hung up while its command was running."""


class Verbs:
    def __init__(self, services: Services) -> None:
        self.services = services
        self.config = services.config
        # One handler per verb of the command table, named after it; a verb
        # without one fails here, when the worker starts, not on first use.
        self.handlers: dict[str, Handler] = {verb: getattr(self, verb.lower()) for verb in TABLE}

    async def run(self, session: Session, request: Request) -> Any:
        args = request.args
        if len(args.get("payloads", ())) > self.config.max_batch or len(args.get("tags", ())) > self.config.max_batch:
            raise LimitExceeded(f"more than {self.config.max_batch} items in one command; split it")
        metrics.COMMANDS.labels(request.verb).inc()
        if not session.authed and request.verb not in BEFORE_AUTH:
            raise NoAuth("authentication required; send AUTH password or HELLO 3 AUTH user password")
        return await self.handlers[request.verb](session, **args)

    # -- connection and session ------------------------------------------------------

    async def hello(self, session: Session, proto: int | None = None, username: str | None = None,
                    password: str | None = None, client_id: str | None = None) -> Any:
        if password is not None:
            await self.auth(session, argv=[password.encode()])
        if not session.authed:
            raise NoAuth("HELLO must carry AUTH user password on this server")
        if proto is not None:
            session.proto = proto
        if client_id is not None and client_id != session.client_id:
            await session.bind(client_id, anonymous=False)
        return {
            "server": "fencemq", "version": __version__, "proto": session.proto,
            "id": session.client_id or session.anonymous_id, "worker": self.services.worker_id,
            "mode": "standalone", "role": "master", "modules": [],
        }

    async def auth(self, session: Session, argv: list[bytes]) -> Any:
        expected = self.config.password
        if expected is None:
            raise FenceMQError("AUTH called without any password configured for this worker")
        if not hmac.compare_digest(argv[-1], expected.encode()):  # no timing hint
            raise WrongPassword("invalid username-password pair or user is disabled.")
        session.authed = True
        return OK

    async def ping(self, session: Session, argv: list[bytes]) -> Any:
        return argv[0] if argv else SimpleString("PONG")

    async def quit(self, session: Session, argv: list[bytes]) -> Any:
        session.quit = True
        session.closing = True
        return OK

    async def select(self, session: Session, argv: list[bytes]) -> Any:
        if argv[0] != b"0":
            raise BadArgument("FenceMQ has a single database; SELECT 0")
        return OK

    async def command(self, session: Session, argv: list[bytes]) -> Any:
        return []  # redis-cli asks for COMMAND DOCS; an empty table keeps it happy

    async def client(self, session: Session, argv: list[bytes]) -> Any:
        sub = argv[0].decode("utf-8", "replace").upper()
        if sub == "SETNAME" and len(argv) == 2:
            await session.bind(argv[1].decode("utf-8", "replace"), anonymous=False)
            return OK
        if sub == "GETNAME":
            return session.client_id
        if sub == "ID":
            return int(session.token.rsplit(":", 1)[1])
        if sub == "SETINFO":
            return OK
        raise BadArgument("CLIENT takes SETNAME id, GETNAME, ID or SETINFO")

    async def heartbeat(self, session: Session, sync: tuple[str, str, list[str]] | None = None) -> Any:
        client = await session.ensure()
        if sync is not None:
            topic, group, lmqs = sync
            await self.services.sessions.resync(client, topic, group, lmqs)
        return await self.services.sessions.drain_notices(client)

    # -- publishing ------------------------------------------------------------------

    async def pub(self, session: Session, topic: str, payloads: list[bytes], lmq: str | None = None, qos: int = 1,
                  retain: bool = False, dedup_ids: list[str] | None = None,
                  headers: dict[str, str] | None = None) -> Any:
        ids = await self.services.core.shared.publish(
            topic, payloads, lmq=lmq, qos=qos, dedup_ids=dedup_ids, headers=headers, producer=session.client_id,
            retain=retain,
        )
        metrics.PUBLISHED.inc(len(ids))
        return ids[0]

    async def mpub(self, session: Session, topic: str, payloads: list[bytes], lmq: str | None = None,
                   qos: int = 1) -> Any:
        ids = await self.services.core.shared.publish(topic, payloads, lmq=lmq, qos=qos, producer=session.client_id)
        metrics.PUBLISHED.inc(len(ids))
        return id_array(ids)

    async def publish_batch(self, session: Session, requests: list[Request]) -> list[Any]:
        """Pipelined PUB/MPUB to one queue: one fence call, ids handed back per command."""
        first = requests[0].args
        payloads = [p for r in requests for p in r.args["payloads"]]
        ids: list[str] = []
        for start in range(0, len(payloads), self.config.max_batch):
            ids += await self.services.core.shared.publish(
                first["topic"], payloads[start : start + self.config.max_batch], lmq=first.get("lmq"),
                qos=first.get("qos", 1), producer=session.client_id,
            )
        metrics.PUBLISHED.inc(len(ids))
        replies: list[Any] = []
        at = 0
        for r in requests:
            n = len(r.args["payloads"])
            replies.append(id_array(ids[at : at + n]) if r.verb == "MPUB" else ids[at])
            at += n
        return replies

    # -- subscribing and consuming ---------------------------------------------------

    async def sub(self, session: Session, topic: str, push: bool = False, **options: Any) -> Any:
        if push:
            options["capacity"] = options.get("capacity") or self.config.mailbox_capacity
        client = await session.ensure()
        if is_filter_target(topic):
            if options.get("lmq") is not None or options.get("group") is not None or options.get("mode"):
                raise BadArgument("a topic filter takes no LMQ, GROUP or MODE; share it as $share/<group>/<filter>")
            allowed = {"qos", "capacity", "max_messages", "lock_ms", "strategy", "offline", "epoch"}
            extra = set(options) - allowed
            if extra:
                raise BadArgument(f"a topic filter subscription does not take {', '.join(sorted(extra)).upper()}")
            return (await self.services.core.shared.subscribe(client, topic, **options)).as_reply()
        sub = await self.services.core.subscriptions.subscribe(client, topic, **options)
        if sub.evicted:
            mine = Handle.decode(sub.handle)
            evicted = Handle(mine.queue, mine.group, sub.evicted)
            await self.services.sessions.notify(sub.evicted, unsubscribe_notice(evicted, client))
        return sub.as_reply()

    async def pull(self, session: Session, handle: str, count: int = 1, block_ms: int | None = None) -> Any:
        h = session.own(handle)
        leases = self.services.core.leases
        result = await leases.pull(h, count)
        if not result.deliveries and block_ms is not None:
            # A fenced member (evicted, suspected, standby, ended) waits like any long
            # poll: woken when it may receive again, not answered at once to spin.
            result = await self._long_poll(session, h, block_ms, lambda: leases.pull(h, count),
                                           lambda r: bool(r.deliveries))
        metrics.DELIVERED.inc(len(result.deliveries))
        return Prebuilt(encode_deliveries(result.deliveries, session.proto))

    async def take(self, session: Session, handle: str, block_ms: int | None = None) -> Any:
        h = session.own(handle)
        mailboxes = self.services.core.mailboxes
        result = await mailboxes.take(h)
        if result is None and block_ms is not None:
            result = await self._long_poll(session, h, block_ms, lambda: mailboxes.take(h), lambda r: r is not None)
        if result == "EOS":
            return SimpleString("EOS")
        if result is None:
            return None
        metrics.DELIVERED.inc()
        return Prebuilt(encode_delivery(result, session.proto))

    async def _long_poll(self, session: Session, h: Handle, block_ms: int, attempt: Callable[[], Awaitable[Any]],
                         done: Callable[[Any], bool]) -> Any:
        """Wait on the queue's wake channel, looking again after each wake-up.

        The subscription is confirmed before the first look, so a publish
        between a look and the wait is never missed; BLOCK 0 waits up to
        max_block_ms.
        """
        timeout = min(block_ms or self.config.max_block_ms, self.config.max_block_ms) / 1000
        result = None
        async with session.until_hangup():
            with anyio.move_on_after(timeout):
                async with self.services.wakeups.watching(self.services.keys.queue(h.queue).wake) as waiter:
                    while True:
                        result = await attempt()
                        if done(result):
                            break
                        await waiter.wait()
        if session.closing:
            # The client hung up while it waited: nothing more is checked out to it.
            raise ClientGone
        return result if result is not None else await attempt()

    async def ack(self, session: Session, handle: str, tags: list[str]) -> Any:
        n = await self.services.core.leases.ack(session.own(handle), tags)
        metrics.ACKED.inc(n)
        return n

    async def nack(self, session: Session, handle: str, tags: list[str], delay_ms: int = 0,
                   discard: bool = False) -> Any:
        return await self.services.core.leases.nack(session.own(handle), tags, delay_ms=delay_ms, discard=discard)

    async def renew(self, session: Session, handle: str, tags: list[str], lock_ms: int | None = None) -> Any:
        n = await self.services.core.leases.renew(session.own(handle), tags, lock_ms=lock_ms)
        metrics.RENEWALS.inc(n)
        return n

    async def seek(self, session: Session, handle: str, kind: str, arg: int | None) -> Any:
        h = session.own(handle)
        epoch, cursor, clamped = await self.services.core.seek.move(h, kind, arg)
        if clamped:
            # The reply stays the epoch (the contract); the client is told apart.
            notice = {"type": "seek_clamped", "handle": handle, "topic": h.queue.topic, "epoch": epoch,
                      "cursor": str(cursor), "reason": "the target is older than the oldest retained message"}
            await self.services.sessions.notify(h.member, notice)
        return epoch

    async def unsub(self, session: Session, handle: str, max_messages: int | None = None) -> Any:
        if max_messages is not None:
            await self.services.core.mailboxes.end_after(session.own(handle), max_messages)
            return OK
        await self.services.core.subscriptions.unsubscribe(session.own(handle))
        return OK
