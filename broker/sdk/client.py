"""The asyncio ``Client``: one FenceMQ session and its session-level verbs.

The connection it is built on (HELLO, the pipelined write FIFO, the reader,
push frames) is :mod:`fencemq.sdk.connection`; a subscription's verbs and its
epoch fence are in :mod:`fencemq.sdk.subscription`, reply decoding in
:mod:`fencemq.sdk.replies`, the blocking facade in :mod:`fencemq.sdk.sync`.
Everything a client needs can be imported from here. How it works, and where
head-of-line blocking bites: docs/sdk.md.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
import weakref
from typing import Any, Literal

from fencemq.errors import FenceMQError
from fencemq.model.handles import Handle
from fencemq.model.messages import Delivery
from fencemq.sdk.connection import DEFAULT_URL, PipelinedConnection
from fencemq.sdk.replies import ConnectionLost, EndOfStream, _map, _notice, _str, _strs
from fencemq.sdk.subscription import RELEASE_TIMEOUT_S, Subscription, _Epoch

__all__ = [
    "DEFAULT_URL",
    "Client",
    "ConnectionLost",
    "Delivery",
    "EndOfStream",
    "Subscription",
]


def _when(delay_ms: int | None, at_ms: int | None, ttl_ms: int | None = None, priority: int | None = None) -> list[Any]:
    """A publish for later: ``DELAY ms`` or ``AT unix-ms`` (the broker refuses both); ``TTL ms``; ``PRIORITY p``."""
    return ((["DELAY", delay_ms] if delay_ms is not None else []) + (["AT", at_ms] if at_ms is not None else [])
            + (["TTL", ttl_ms] if ttl_ms is not None else []) + (["PRIORITY", priority] if priority is not None else []))


class Client(PipelinedConnection):
    """One FenceMQ session: PUB, MPUB, SUB and HEARTBEAT over one pipelined connection (docs/sdk.md)."""

    def _init_state(self) -> None:
        self._epochs: dict[str, _Epoch] = {}  # per subscription handle, shared by its Subscription objects
        self._subscriptions: weakref.WeakSet[Subscription] = weakref.WeakSet()
        # Every publish carries a dedup id (the application's, else one of these), so one whose
        # reply was lost with a connection is sent again and stored once (docs/sdk.md, "Reconnecting")
        self._dedup_prefix = uuid.uuid4().hex[:16] + ":"
        self._dedup_numbers = itertools.count(1)

    def _next_dedup_id(self) -> str:
        return self._dedup_prefix + str(next(self._dedup_numbers))

    @property
    def default_lock_ms(self) -> int | None:
        """The lease a checkout gets without LOCK, as the worker's HELLO said."""
        value = self.hello.get("lock_ms")
        return int(value) if value is not None else None

    async def close(self) -> None:
        """Hand back what iterators fetched (or prefetched) and never handed out, then close the connection."""
        if not self.closed:
            held = [sub for sub in self._subscriptions if sub._held or sub._prefetched is not None]
            if held:
                await asyncio.wait([asyncio.ensure_future(sub.release_held()) for sub in held],
                                   timeout=RELEASE_TIMEOUT_S)
        await super().close()

    async def ping(self, message: str | bytes | None = None) -> str:
        args = ("PING",) if message is None else ("PING", message)
        return _str(await self._call(args))

    async def publish(
        self,
        topic: str,
        payload: bytes | str,
        lmq: str | None = None,
        qos: int = 1,
        retain: bool = False,
        dedup_id: str | None = None,
        headers: dict[str, str] | None = None,
        delay_ms: int | None = None,
        at_ms: int | None = None,
        ttl_ms: int | None = None,
        priority: int | None = None,
    ) -> str:
        """PUB; the message id, or a schedule id (``s…``) when ``delay_ms`` or ``at_ms`` publishes it for later
        (cancel it with :meth:`unpublish`). ``ttl_ms``: it expires that long after it becomes deliverable
        (settled unsent, counted as expired). ``priority`` (0–9): its level on a priority queue (NOPRIORITY,
        :class:`~fencemq.errors.PriorityOff`, elsewhere)."""
        args: list[Any] = ["PUB", topic, payload]
        if lmq is not None:
            args += ["LMQ", lmq]
        if qos != 1:
            args += ["QOS", qos]
        if retain:
            args.append("RETAIN")
        if dedup_id is None and self.reconnect is not None:
            dedup_id = self._next_dedup_id()
        if dedup_id is not None:
            args += ["ID", dedup_id]
        for k, v in (headers or {}).items():
            args += ["HDR", k, v]
        return await self._call(args + _when(delay_ms, at_ms, ttl_ms, priority), _str, resend=dedup_id is not None)

    async def mpublish(self, topic: str, payloads: list[bytes], lmq: str | None = None, qos: int = 1,
                       dedup_id: str | None = None, delay_ms: int | None = None,
                       at_ms: int | None = None, ttl_ms: int | None = None, priority: int | None = None) -> list[str]:
        """MPUB: the batch's ids, in order (schedule ids when ``delay_ms`` or ``at_ms`` publishes them for later).
        ``dedup_id`` covers the whole batch: the same batch sent again within the broker's dedup window gets
        the same ids and is stored once (a reconnecting client gives every batch one)."""
        args: list[Any] = ["MPUB", topic, len(payloads), *payloads]
        if lmq is not None:
            args += ["LMQ", lmq]
        if qos != 1:
            args += ["QOS", qos]
        if dedup_id is None and self.reconnect is not None:
            dedup_id = self._next_dedup_id()
        if dedup_id is not None:
            args += ["ID", dedup_id]
        return await self._call(args + _when(delay_ms, at_ms, ttl_ms, priority), _strs,
                                resend=dedup_id is not None)

    async def unpublish(self, topic: str, ids: list[str], lmq: str | None = None) -> int:
        """UNPUB: cancel scheduled messages by the schedule ids their publish answered; how many still waited."""
        args: list[Any] = ["UNPUB", topic, *ids]
        if lmq is not None:
            args += ["LMQ", lmq]
        return await self._call(args, int)

    async def subscribe(
        self,
        topic: str,
        lmq: str | None = None,
        group: str | None = None,
        mode: str | None = None,
        policy: str | None = None,
        start: str | tuple[str, int] | None = None,
        qos: int | None = None,
        lock_ms: int | None = None,
        push: bool = False,
        capacity: int | None = None,
        max: int | None = None,
        epoch: int | None = None,
        on_preempt: Literal["keep", "earliest", "latest"] | None = None,
        strategy: Literal["round-robin", "sticky", "hash"] | None = None,
        offline: Literal["queue", "skip"] | None = None,
        prefetch: bool = False,
    ) -> Subscription:
        """SUB: join a topic (``lmq``: one of its lite queues; a ``+``/``#`` filter or ``$share/g/filter``).

        ``mode`` exclusive | shared | single-active, ``policy`` preempt | reject, ``start`` 'earliest',
        'latest', ('id', n) or ('time', ms), ``lock_ms`` the lease of each checkout, ``push`` a bounded
        mailbox of ``capacity``, ``max`` end after n deliveries, ``on_preempt`` where a preempting owner
        starts, ``strategy`` how a shared group spreads messages, ``offline`` whether a member whose
        session has no connection keeps receiving ('queue') or is passed over ('skip'). docs/protocol.md.
        ``prefetch`` (pull subscriptions): once the caller settles the whole of a full batch, the next
        PULL goes out with that ACK, in one round trip (docs/sdk.md, "Prefetch").
        """
        args: list[Any] = ["SUB", topic]
        for word, value in (("LMQ", lmq), ("GROUP", group), ("MODE", mode), ("POLICY", policy)):
            if value is not None:
                args += [word, value]
        if start is not None:
            if isinstance(start, str):
                if start.lower() not in ("earliest", "latest"):
                    raise ValueError("start must be 'earliest', 'latest', ('id', n) or ('time', ms)")
                args += ["FROM", start.upper()]
            else:
                kind, value = start
                if kind.lower() not in ("id", "time"):
                    raise ValueError("start must be 'earliest', 'latest', ('id', n) or ('time', ms)")
                args += ["FROM", kind.upper(), value]
        if qos is not None:
            args += ["QOS", qos]
        if lock_ms is not None:
            args += ["LOCK", lock_ms]
        if push:
            args.append("PUSH")
            if capacity is not None:
                args += ["CAPACITY", capacity]
        elif capacity is not None:
            raise ValueError("capacity goes with push=True")
        if max is not None:
            args += ["MAX", max]
        if epoch is not None:
            args += ["EPOCH", epoch]
        if on_preempt is not None:
            args += ["ON-PREEMPT", on_preempt]
        if strategy is not None:
            args += ["STRATEGY", strategy]
        if offline is not None:
            if offline not in ("queue", "skip"):
                raise ValueError("offline must be 'queue' or 'skip'")
            args.append("QUEUE-OFFLINE" if offline == "queue" else "SKIP-OFFLINE")
        reply = await self._call(args, _map)
        handle = _str(reply["handle"])
        known = self._epochs.get(handle)
        if epoch is None and known is not None and known.value > int(reply.get("epoch", 0)):
            # The server is behind what this client saw (restored from an older
            # copy): state our epoch, or every delivery would be filtered out.
            reply = await self._call([*args, "EPOCH", known.value], _map)
        if self._id is None:
            try:
                self._id = Handle.decode(handle).member
            except FenceMQError:
                pass
        box = self._epochs.setdefault(handle, _Epoch(0))
        box.observe(int(reply.get("epoch", 0)))
        owner = reply.get("owner")
        sub = Subscription(
            self, handle, box, self._generation,
            mode=_str(reply.get("mode", mode or "")),
            owner=None if owner is None else _str(owner),
            qos=int(reply.get("qos", 1 if qos is None else qos)),
            topic=topic, lmq=lmq, group=group, push=push, lock_ms=lock_ms, prefetch=prefetch and not push,
        )
        self._subscriptions.add(sub)
        return sub

    async def heartbeat(self, sync: tuple[str, str, list[str]] | None = None) -> list[dict[str, Any]]:
        """HEARTBEAT [SYNC topic group lmq...]: the session's queued notices not already pushed (RESP3):
        each notice is acted on, and handed out, once."""
        return [notice for notice, fresh in await self._drain_notices(sync) if fresh]

    async def _drain_notices(self, sync: tuple[str, str, list[str]] | None) -> list[tuple[dict[str, Any], bool]]:
        """HEARTBEAT: every queued notice, and whether it is new to this client (not pushed before).

        A SYNC's re-sent notices are proof for the lite SDK even when their push arrived first."""
        args: list[Any] = ["HEARTBEAT"]
        if sync is not None:
            topic, group, lmqs = sync
            args += ["SYNC", topic, group, *lmqs]
        notices = await self._call(args, lambda raw: [_notice(n) for n in raw or ()])
        drained = [(notice, self._first_time(notice)) for notice in notices]
        for notice, fresh in drained:
            if fresh:
                self._notice_received(notice)
        return drained

    def _notice_received(self, notice: dict[str, Any]) -> None:
        """A lease of ours timed out: show life at once, so the member is not left suspected.

        The server suspects a member whose lease expired and gives it nothing
        until it settles or renews; a client whose PULL reply was lost would
        poll on, suspected, for ever. RENEW of the expired tags settles nothing
        but clears the suspicion.
        """
        if notice.get("type") != "message_timeout" or self.closed:
            return
        handle, tags = notice.get("handle"), [str(t) for t in notice.get("tags") or ()]
        if not handle or not tags:
            return
        try:
            task = asyncio.get_running_loop().create_task(self._call(["RENEW", handle, *tags[:1000]]))
        except RuntimeError:  # no running loop (a notice decoded outside one): nothing to do
            return
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # nothing to report either way
