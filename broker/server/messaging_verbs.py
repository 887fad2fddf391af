"""The messaging verbs (docs/protocol.md): publishing, subscribing and consuming.

A mixin of :class:`fencemq.server.verbs.Verbs`: PUB/MPUB (and a pipelined run of them),
SUB (and a pipelined run of lmq SUBs), PULL and TAKE with their long poll, ACK, NACK,
RENEW, SEEK and UNSUB. Each handler takes the session it acts for and the keyword
arguments fencemq.protocol.commands parsed, and returns the reply value.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fencemq.config import Config
from fencemq.errors import BadArgument, FenceMQError, NoPermission
from fencemq.fences.leases import Look, PullResult
from fencemq.fences.lite import unsubscribe_notice
from fencemq.fences.redis_errors import REDIS_FAILURES
from fencemq.fences.shared import is_filter_target
from fencemq.fences.subscribe import Subscription
from fencemq.model.handles import Handle
from fencemq.model.keys import QueueRef
from fencemq.model.meta import LITE_GROUP
from fencemq.model.topics import SHARE_PREFIX, FilterTarget, parse_target
from fencemq.protocol.commands import Request
from fencemq.protocol.deliveries import encode_deliveries, encode_delivery
from fencemq.protocol.resp import Prebuilt, SimpleString, encode_bulk_array
from fencemq.server import long_poll, metrics
from fencemq.server.lost_pulls import MAY_HAVE_RUN, PullLedger
from fencemq.server.services import Services
from fencemq.server.session import Session

OK = SimpleString("OK")


def id_array(ids: list[str]) -> Prebuilt:
    """An MPUB reply: message ids (decimal, so a space never occurs in one) encoded in one go."""
    return Prebuilt(encode_bulk_array(" ".join(ids).encode().split()))


def _count_published(ids: list[str]) -> None:
    metrics.PUBLISHED.inc(len(ids))
    scheduled = sum(1 for i in ids if i[:1] == "s")
    if scheduled:
        metrics.SCHEDULED.inc(scheduled)


class MessagingVerbs:
    services: Services
    config: Config
    admit: Callable[[Session, Request], None]  # Verbs.admit: what every command meets first
    handlers: dict[str, Callable[..., Awaitable[Any]]]

    def _may(self, session: Session, action: str, target: str) -> None:
        """NOPERM naming what is missing, when the session's user lacks ``action`` on ``target`` (the gate's)."""
        self.services.gate.check(session.user, action, target)

    # -- publishing ------------------------------------------------------------------

    async def pub(self, session: Session, topic: str, payloads: list[bytes], lmq: str | None = None, qos: int = 1,
                  retain: bool = False, dedup_ids: list[str] | None = None,
                  headers: dict[str, str] | None = None, delay_ms: int | None = None,
                  at_ms: int | None = None, ttl_ms: int | None = None, priority: int | None = None) -> Any:
        self._may(session, "publish", topic)
        ids = await self.services.core.shared.publish(
            topic, payloads, lmq=lmq, qos=qos, dedup_ids=dedup_ids, headers=headers, producer=session.client_id,
            retain=retain, delay_ms=delay_ms, at_ms=at_ms, ttl_ms=ttl_ms, priority=priority,
        )
        _count_published(ids)
        return ids[0]

    async def mpub(self, session: Session, topic: str, payloads: list[bytes], lmq: str | None = None,
                   qos: int = 1, dedup_ids: list[str | None] | None = None, delay_ms: int | None = None,
                   at_ms: int | None = None, ttl_ms: int | None = None, priority: int | None = None) -> Any:
        self._may(session, "publish", topic)
        ids = await self.services.core.shared.publish(topic, payloads, lmq=lmq, qos=qos, dedup_ids=dedup_ids,
                                                      producer=session.client_id, delay_ms=delay_ms, at_ms=at_ms,
                                                      ttl_ms=ttl_ms, priority=priority)
        _count_published(ids)
        return id_array(ids)

    async def unpub(self, session: Session, topic: str, ids: list[str], lmq: str | None = None) -> Any:
        """Cancel scheduled messages (a publisher's right: the publish permission on the topic)."""
        self._may(session, "publish", topic)
        ref = self.services.core.ctx.queue(topic, lmq)
        cancelled = await self.services.core.scheduling.cancel(ref, ids)
        metrics.SCHEDULED_CANCELLED.inc(cancelled)
        return cancelled

    async def publish_batch(self, session: Session, requests: list[Request]) -> list[Any]:
        """Pipelined PUB/MPUB to one queue: each command admitted and checked as it would be
        alone, those that pass published together (Shared.publish_many). Each command's reply
        in order, a refusal as its exception."""
        outcomes: list[Any] = [None] * len(requests)
        admitted: list[int] = []
        for i, r in enumerate(requests):
            try:
                self.admit(session, r)
                self._may(session, "publish", r.args["topic"])
            except FenceMQError as exc:
                outcomes[i] = exc
                continue
            admitted.append(i)
        first = requests[0].args
        published = await self.services.core.shared.publish_many(
            first["topic"], [requests[i].args["payloads"] for i in admitted], lmq=first.get("lmq"),
            qos=first.get("qos", 1), dedup_ids=[requests[i].args.get("dedup_ids") for i in admitted],
            producer=session.client_id)
        for i, out in zip(admitted, published, strict=True):
            if isinstance(out, list):
                metrics.PUBLISHED.inc(len(out))
                out = id_array(out) if requests[i].verb == "MPUB" else out[0]
            outcomes[i] = out
        return outcomes

    # -- subscribing and consuming ---------------------------------------------------

    async def sub(self, session: Session, topic: str, push: bool = False, **options: Any) -> Any:
        if is_filter_target(topic):
            try:
                filt = parse_target(topic).filter
            except FenceMQError:
                filt = None  # refused below, by the gate, in its words
            if filt is not None:
                # publishes this worker reads from now on wait for this filter (fences/shared.py)
                async with self.services.core.shared.registry.announcing([filt]):
                    return await self._sub(session, topic, push, **options)
        return await self._sub(session, topic, push, **options)

    async def _sub(self, session: Session, topic: str, push: bool = False, **options: Any) -> Any:
        if push:
            options["capacity"] = options.get("capacity") or self.config.mailbox_capacity
        gate = self.services.gate
        gate.check_target(topic, options.get("group"))
        target = parse_target(topic) if is_filter_target(topic) else None
        gate.check(session.user, "subscribe", target.filter if target is not None else topic)
        client = await session.ensure()
        if options.get("lmq") is None:
            await gate.check_subscriptions(client)
        if options.get("epoch") is not None:  # raising the group's epoch fences every member's checkouts
            await self._check_group_wide(session, client, topic, target, options)
        if is_filter_target(topic):
            if options.get("lmq") is not None or options.get("group") is not None or options.get("mode"):
                raise BadArgument("a topic filter takes no LMQ, GROUP or MODE; share it as $share/<group>/<filter>")
            allowed = {"qos", "capacity", "max_messages", "lock_ms", "strategy", "offline", "epoch"}
            extra = set(options) - allowed
            if extra:
                raise BadArgument(f"a topic filter subscription does not take {', '.join(sorted(extra)).upper()}")
            return self._signed((await self.services.core.shared.subscribe(client, topic, **options)).as_reply())
        sub = await self.services.core.subscriptions.subscribe(client, topic, **options)
        if sub.evicted:
            await self.services.sessions.notify(sub.evicted, self._preempted(sub, client))
        return self._signed(sub.as_reply())

    async def sub_lmq_batch(self, session: Session, requests: list[Request]) -> list[Any]:
        """Pipelined ``SUB topic LMQ …`` (pull mode) of one topic: the holds, the subscribe
        fences and the preempted owners' notices each in one round trip for the whole run.
        Each reply in order; a refused SUB's as its exception."""
        replies: list[Any] = [None] * len(requests)
        admitted: list[int] = []
        for i, r in enumerate(requests):
            try:
                self.admit(session, r)
            except FenceMQError as exc:
                replies[i] = exc
                continue
            admitted.append(i)
        topic = requests[0].args["topic"]
        gate = self.services.gate
        try:
            gate.check(session.user, "subscribe", topic)
        except NoPermission as refusal:
            return [refusal if i in admitted else reply for i, reply in enumerate(replies)]
        client = await session.ensure()
        for i in list(admitted):  # each one's own names and options, refused on its own
            try:
                gate.check_target(topic, requests[i].args.get("group"))
                if requests[i].args.get("epoch") is not None:
                    await self._check_group_wide(session, client, topic, None, requests[i].args)
            except FenceMQError as exc:
                replies[i] = exc
                admitted.remove(i)
        outcomes = await self.services.core.subscriptions.subscribe_lite_many(
            client, topic, [{k: v for k, v in requests[i].args.items() if k != "topic"} for i in admitted])
        notices: list[tuple[str, dict[str, Any]]] = []
        for i, sub in zip(admitted, outcomes, strict=True):
            if isinstance(sub, Exception):
                replies[i] = sub
                continue
            if sub.evicted:
                notices.append((sub.evicted, self._preempted(sub, client)))
            replies[i] = self._signed(sub.as_reply())
        if notices:
            await self.services.sessions.notify_all(notices)
        return replies

    @staticmethod
    def _preempted(sub: Subscription, by: str) -> dict[str, Any]:
        """Counted, and the notice its evicted owner is sent."""
        metrics.PREEMPTIONS.inc()
        metrics.EVICTIONS.labels("preempted").inc()
        mine = Handle.decode(sub.handle)
        return unsubscribe_notice(Handle(mine.queue, mine.group, sub.evicted), by)

    def _signed(self, reply: dict[str, Any]) -> dict[str, Any]:
        reply["handle"] = self.services.handles.sign(reply["handle"])
        return reply

    async def _check_group_wide(self, session: Session, client: str, topic: str, target: FilterTarget | None,
                                options: dict[str, Any]) -> None:
        """``SUB … EPOCH e`` raises the epoch of the group it joins: group-wide, like SEEK."""
        if target is not None:
            if target.share is None:
                return  # a private filter subscription: the client's own group
            queue, group = QueueRef(target.filter, None, SHARE_PREFIX + target.share), target.share
        else:
            lmq, group = options.get("lmq"), options.get("group")
            if group is None:
                if lmq is None:
                    return  # the client's own group
                group = LITE_GROUP
            queue = QueueRef(topic, lmq)
        await self.services.gate.check_group_wide(session.user, queue, group, client)

    async def pull(self, session: Session, handle: str, count: int = 1, block_ms: int | None = None) -> Any:
        h = session.own(handle)
        ledger = session.pulls or self._ledger(session)
        leases = self.services.core.leases
        result = await ledger.recover(leases, handle, h, count) if ledger.in_doubt else None
        if result is None:
            try:
                if block_ms is None:
                    result = await leases.pull(h, count)
                else:
                    # A fenced member (evicted, suspected, standby, ended) waits like any long
                    # poll: woken when it may receive again, not answered at once to spin.
                    result = await long_poll.pull(self.services, session, h, count, block_ms)
            except MAY_HAVE_RUN as exc:
                ledger.doubt(handle, exc)  # its checkouts, if it made any, answer the next PULL (lost_pulls.py)
                raise
        ledger.delivered(handle, result.deliveries)
        metrics.DELIVERED.inc(len(result.deliveries))
        return Prebuilt(encode_deliveries(result.deliveries, session.delivery_proto))

    @staticmethod
    def _ledger(session: Session) -> PullLedger:
        session.pulls = PullLedger()
        return session.pulls

    async def ack_then_pull(self, session: Session, ack: Request, pull: Request) -> list[Any]:
        """``ACK h tags…`` pipelined with ``PULL h …`` (the consume loop): both fence calls in one
        round trip to Redis, in this order. The two outcomes, a refusal as its exception: those
        of running them one by one."""
        refusals: list[FenceMQError | None] = []
        for r in (ack, pull):
            try:
                self.admit(session, r)
                refusals.append(None)
            except FenceMQError as exc:
                refusals.append(exc)
        if any(refusals):
            return [exc if exc is not None else await self._outcome_alone(session, r)
                    for r, exc in zip((ack, pull), refusals, strict=True)]
        try:
            h = session.own(ack.args["handle"])
        except FenceMQError as exc:
            return [exc, exc]  # the same handle: alone, each is refused the same way
        count, block_ms = pull.args.get("count", 1), pull.args.get("block_ms")
        handle = pull.args["handle"]
        ledger = session.pulls or self._ledger(session)
        if ledger.in_doubt.get(handle) is not None:  # a PULL cut off before: answered first, one by one
            return [await self._outcome_alone(session, r) for r in (ack, pull)]
        leases = self.services.core.leases
        acks: list[int | Exception] = []  # the ACK's outcome, once the pair ran

        async def pair(look: Look | None = None) -> PullResult:
            acked, pulled = await leases.ack_then_pull(h, ack.args["tags"], count, look)
            acks.append(acked)
            if not isinstance(acked, Exception):
                metrics.ACKED.inc(acked)
            if isinstance(pulled, Exception):
                raise pulled
            return pulled

        try:
            # With BLOCK the pair is the long poll's first look: its PULL registers the waiter
            # (subscribed to the queue's wake channel before), where a look of its own would follow
            result = await (pair() if block_ms is None else long_poll.pull(self.services, session, h, count,
                                                                            block_ms, first=pair))
        except FenceMQError as exc:
            if not acks:  # refused before anything ran (a bad tag, COUNT): one by one
                return [await self._outcome_alone(session, r) for r in (ack, pull)]
            ledger.doubt(handle, exc)  # the ACK ran: only the PULL's reply is this refusal
            return [acks[0], exc]
        except REDIS_FAILURES as exc:
            if isinstance(exc, MAY_HAVE_RUN) or acks:
                ledger.doubt(handle, exc)
            if not acks:
                raise
            return [acks[0], exc]
        ledger.delivered(handle, result.deliveries)
        metrics.DELIVERED.inc(len(result.deliveries))
        return [acks[0], Prebuilt(encode_deliveries(result.deliveries, session.delivery_proto))]

    async def _outcome_alone(self, session: Session, request: Request) -> Any:
        """An admitted command's handler run on its own: its reply, or its refusal as the exception."""
        try:
            return await self.handlers[request.verb](session, **request.args)
        except (FenceMQError, *REDIS_FAILURES) as exc:
            return exc

    async def take(self, session: Session, handle: str, block_ms: int | None = None) -> Any:
        h = session.own(handle)
        mailboxes = self.services.core.mailboxes
        result = await mailboxes.take(h)
        if result is None and block_ms is not None:
            result = await long_poll.wait(self.services, session, h, block_ms, lambda: mailboxes.take(h), lambda r: r is not None)
        if result == "EOS":
            return SimpleString("EOS")
        if result is None:
            return None
        metrics.DELIVERED.inc()
        return Prebuilt(encode_delivery(result, session.delivery_proto))

    async def ack(self, session: Session, handle: str, tags: list[str]) -> Any:
        n = await self.services.core.leases.ack(session.own(handle), tags)
        metrics.ACKED.inc(n)
        return n

    async def nack(self, session: Session, handle: str, tags: list[str], delay_ms: int = 0,
                   discard: bool = False, release: bool = False) -> Any:
        returned, dead = await self.services.core.leases.nack_counted(session.own(handle), tags, delay_ms=delay_ms,
                                                                      discard=discard, release=release)
        metrics.NACKED.inc(returned)
        metrics.DEAD_LETTERED.inc(dead)
        return returned

    async def renew(self, session: Session, handle: str, tags: list[str], lock_ms: int | None = None) -> Any:
        n = await self.services.core.leases.renew(session.own(handle), tags, lock_ms=lock_ms)
        metrics.RENEWALS.inc(n)
        return n

    async def seek(self, session: Session, handle: str, kind: str, arg: int | None) -> Any:
        h = session.own(handle)
        await self.services.gate.check_group_wide(session.user, h.queue, h.group, h.member)
        epoch, cursor, clamped = await self.services.core.seek.move(h, kind, arg)
        if clamped:
            # The reply stays the epoch (the contract); the client is told apart.
            notice = {"type": "seek_clamped", "handle": h.encode(), "topic": h.queue.topic, "epoch": epoch,
                      "cursor": str(cursor), "reason": "the target is older than the oldest retained message"}
            await self.services.sessions.notify(h.member, notice)
        return epoch

    async def unsub(self, session: Session, handle: str, max_messages: int | None = None) -> Any:
        if max_messages is not None:
            await self.services.core.mailboxes.end_after(session.own(handle), max_messages)
            return OK
        await self.services.core.subscriptions.unsubscribe(session.own(handle))
        return OK
