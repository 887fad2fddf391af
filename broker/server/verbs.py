"""The verbs of the wire protocol (docs/protocol.md), one method each.

A mixin of ClientConnection: each ``cmd_<verb>`` gets the keyword arguments
that fencemq.protocol.commands parsed and returns the reply value; errors are raised as
FenceMQError and turned into RESP errors by the connection.
"""

from __future__ import annotations

import hmac
from typing import Any

import anyio

from fencemq import __version__
from fencemq.server import metrics
from fencemq.protocol.commands import Request
from fencemq.errors import BadArgument, FenceMQError, NoAuth, WrongPassword
from fencemq.fences.shared import is_filter_target
from fencemq.model.keys import Handle
from fencemq.protocol.deliveries import encode_deliveries, encode_delivery
from fencemq.protocol.resp import Prebuilt, SimpleString
from fencemq.fences.lite import unsubscribe_notice

OK = SimpleString("OK")


class ClientGone(Exception):
    """The client hung up while its command was running."""


class Verbs:

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
        if not hmac.compare_digest(argv[-1], expected.encode()):  # no timing hint
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
        ids = await self.worker.core.shared.publish(
            topic, payloads, lmq=lmq, qos=qos, dedup_ids=dedup_ids, headers=headers, producer=self.client_id,
            retain=retain,
        )
        metrics.PUBLISHED.inc(len(ids))
        return ids[0]

    async def cmd_mpub(self, topic: str, payloads: list[bytes], lmq: str | None = None, qos: int = 1) -> Any:
        ids = await self.worker.core.shared.publish(topic, payloads, lmq=lmq, qos=qos, producer=self.client_id)
        metrics.PUBLISHED.inc(len(ids))
        return ids

    async def _publish_batch(self, reqs: list[Request]) -> list[Any]:
        """Pipelined PUB/MPUB to one queue: one fence call, ids handed back per command."""
        first = reqs[0].args
        payloads = [p for r in reqs for p in r.args["payloads"]]
        ids: list[str] = []
        for start in range(0, len(payloads), self.config.max_batch):
            ids += await self.worker.core.shared.publish(
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
            return (await self.worker.core.shared.subscribe(client, topic, **options)).as_reply()
        sub = await self.worker.core.subscriptions.subscribe(client, topic, **options)
        if sub.evicted:
            mine = Handle.decode(sub.handle)
            evicted = Handle(mine.queue, mine.group, sub.evicted)
            await self.worker.sessions.notify(sub.evicted, unsubscribe_notice(evicted, client))
        return sub.as_reply()

    async def cmd_pull(self, handle: str, count: int = 1, block_ms: int | None = None) -> Any:
        h = self._handle(handle)
        leases = self.worker.core.leases
        result = await leases.pull(h, count)
        if not result.deliveries and result.status == "ok" and block_ms is not None:
            result = await self._long_poll(h, block_ms, lambda: leases.pull(h, count), lambda r: bool(
                r.deliveries or r.status != "ok"))
        metrics.DELIVERED.inc(len(result.deliveries))
        return Prebuilt(encode_deliveries(result.deliveries, self.proto))

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
        mailboxes = self.worker.core.mailboxes
        result = await mailboxes.take(h)
        if result is None and block_ms is not None:
            result = await self._long_poll(h, block_ms, lambda: mailboxes.take(h), lambda r: r is not None)
        if result == "EOS":
            return SimpleString("EOS")
        if result is None:
            return None
        metrics.DELIVERED.inc()
        return Prebuilt(encode_delivery(result, self.proto))

    async def cmd_ack(self, handle: str, tags: list[str]) -> Any:
        n = await self.worker.core.leases.ack(self._handle(handle), tags)
        metrics.ACKED.inc(n)
        return n

    async def cmd_nack(self, handle: str, tags: list[str], delay_ms: int = 0, discard: bool = False) -> Any:
        return await self.worker.core.leases.nack(self._handle(handle), tags, delay_ms=delay_ms, discard=discard)

    async def cmd_renew(self, handle: str, tags: list[str], lock_ms: int | None = None) -> Any:
        n = await self.worker.core.leases.renew(self._handle(handle), tags, lock_ms=lock_ms)
        metrics.RENEWALS.inc(n)
        return n

    async def cmd_seek(self, handle: str, kind: str, arg: int | None) -> Any:
        h = self._handle(handle)
        epoch, cursor, clamped = await self.worker.core.seek.move(h, kind, arg)
        if clamped:
            # The reply stays the epoch (the contract); the client is told apart.
            notice = {"type": "seek_clamped", "handle": handle, "topic": h.queue.topic, "epoch": epoch,
                      "cursor": str(cursor), "reason": "the target is older than the oldest retained message"}
            await self.worker.sessions.notify(h.member, notice)
        return epoch

    async def cmd_unsub(self, handle: str, max_messages: int | None = None) -> Any:
        if max_messages is not None:
            await self.worker.core.mailboxes.end_after(self._handle(handle), max_messages)
            return OK
        await self.worker.core.subscriptions.unsubscribe(self._handle(handle))
        return OK

    async def cmd_heartbeat(self, sync: tuple[str, str, list[str]] | None = None) -> Any:
        client = await self._ensure_session()
        if sync is not None:
            topic, group, lmqs = sync
            await self.worker.sessions.resync(client, topic, group, lmqs)
        return await self.worker.sessions.drain_notices(client)

