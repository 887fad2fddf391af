"""The messaging verbs (docs/protocol.md): publishing, subscribing and consuming.

A mixin of :class:`fencemq.server.verbs.Verbs`: PUB/MPUB (and a pipelined run of them),
SUB (and a pipelined run of lmq SUBs), PULL and TAKE with their long poll, ACK, NACK,
RENEW, SEEK and UNSUB. Each handler takes the session it acts for and the keyword
arguments fencemq.protocol.commands parsed, and returns the reply value.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from redis.exceptions import RedisError

from fencemq.config import Config
from fencemq.errors import BadArgument, FenceMQError, LimitExceeded, NoPermission
from fencemq.fences.lite import unsubscribe_notice
from fencemq.fences.shared import is_filter_target
from fencemq.fences.subscribe import Subscription
from fencemq.model.keys import Handle
from fencemq.model.topics import parse_target
from fencemq.protocol.commands import Request
from fencemq.protocol.deliveries import encode_deliveries, encode_delivery
from fencemq.protocol.resp import Prebuilt, SimpleString, encode_bulk_array
from fencemq.server import metrics
from fencemq.server.services import Services
from fencemq.server.session import Session

OK = SimpleString("OK")


def id_array(ids: list[str]) -> Prebuilt:
    """An MPUB reply: message ids (decimal, so a space never occurs in one) encoded in one go."""
    return Prebuilt(encode_bulk_array(" ".join(ids).encode().split()))


class ClientGone(Exception):
    """The client hung up while its command was running."""


class MessagingVerbs:
    services: Services
    config: Config

    def _check_pub_extras(self, args: dict[str, Any]) -> None: ...  # Verbs': dedup id and header limits

    @staticmethod
    def _may(session: Session, action: str, topic: str) -> None:
        """NOPERM naming what is missing, when the session's user lacks ``action`` on ``topic``."""
        user = session.user
        if user is not None and not user.may(action, topic):
            raise NoPermission(user.missing(action, topic))

    # -- publishing ------------------------------------------------------------------

    async def pub(self, session: Session, topic: str, payloads: list[bytes], lmq: str | None = None, qos: int = 1,
                  retain: bool = False, dedup_ids: list[str] | None = None,
                  headers: dict[str, str] | None = None) -> Any:
        self._may(session, "publish", topic)
        ids = await self.services.core.shared.publish(
            topic, payloads, lmq=lmq, qos=qos, dedup_ids=dedup_ids, headers=headers, producer=session.client_id,
            retain=retain,
        )
        metrics.PUBLISHED.inc(len(ids))
        return ids[0]

    async def mpub(self, session: Session, topic: str, payloads: list[bytes], lmq: str | None = None,
                   qos: int = 1, dedup_ids: list[str | None] | None = None) -> Any:
        self._may(session, "publish", topic)
        ids = await self.services.core.shared.publish(topic, payloads, lmq=lmq, qos=qos, dedup_ids=dedup_ids,
                                                      producer=session.client_id)
        metrics.PUBLISHED.inc(len(ids))
        return id_array(ids)

    async def publish_batch(self, session: Session, requests: list[Request]) -> list[Any]:
        """Pipelined PUB/MPUB to one queue: one fence call, ids handed back per command."""
        for r in requests:
            session.note_command(r.verb)
            metrics.COMMANDS.labels(r.verb).inc()
            self._check_pub_extras(r.args)  # a refusal runs them one by one, each with its own reply
        first = requests[0].args
        self._may(session, "publish", first["topic"])
        ids: list[str] = []
        # Fence calls of at most max_batch messages, each command whole in one of them (an MPUB's
        # dedup id covers its whole batch: a run is never split)
        start = 0
        while start < len(requests):
            end, size = start, 0
            while end < len(requests) and (end == start or size + len(requests[end].args["payloads"])
                                           <= self.config.max_batch):
                size += len(requests[end].args["payloads"])
                end += 1
            run = requests[start:end]
            dedup = None
            if any(r.args.get("dedup_ids") for r in run):
                dedup = [d for r in run for d in (r.args.get("dedup_ids") or [""] * len(r.args["payloads"]))]
            ids += await self.services.core.shared.publish(
                first["topic"], [p for r in run for p in r.args["payloads"]], lmq=first.get("lmq"),
                qos=first.get("qos", 1), dedup_ids=dedup, producer=session.client_id,
            )
            start = end
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
        if session.user is not None:
            filt = parse_target(topic).filter if is_filter_target(topic) else topic
            if not session.user.may_subscribe(filt):
                raise NoPermission(session.user.missing("subscribe", filt))
        client = await session.ensure()
        if options.get("lmq") is None:
            await self._check_subscription_count(client)
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
        for r in requests:
            session.note_command(r.verb)
            metrics.COMMANDS.labels(r.verb).inc()
        topic = requests[0].args["topic"]
        if session.user is not None and not session.user.may_subscribe(topic):
            raise NoPermission(session.user.missing("subscribe", topic))
        client = await session.ensure()
        outcomes = await self.services.core.subscriptions.subscribe_lite_many(
            client, topic, [{k: v for k, v in r.args.items() if k != "topic"} for r in requests])
        replies: list[Any] = []
        notices: list[tuple[str, dict[str, Any]]] = []
        for sub in outcomes:
            if isinstance(sub, Exception):
                replies.append(sub)
                continue
            if sub.evicted:
                notices.append((sub.evicted, self._preempted(sub, client)))
            replies.append(self._signed(sub.as_reply()))
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

    async def _check_subscription_count(self, client: str) -> None:
        """LIMIT once the session holds max_subscriptions (lite ones are lite_quota's).

        Checked before the fence, not inside it: connections of one session
        subscribing at the same instant may pass it by a few.
        """
        held = await self.services.redis.scard(self.services.keys.session_handles(client))
        if held >= self.config.max_subscriptions:
            raise LimitExceeded(f"this session holds {held} subscriptions (max_subscriptions "
                                f"{self.config.max_subscriptions}); UNSUB some first")

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

    async def ack_then_pull(self, session: Session, ack: Request, pull: Request) -> list[Any]:
        """``ACK h tags…`` pipelined with ``PULL h …`` (the consume loop): both fence calls in one
        round trip to Redis, in this order. The two outcomes, a refusal as its exception."""
        h = session.own(ack.args["handle"])
        count, block_ms = pull.args.get("count", 1), pull.args.get("block_ms")
        leases = self.services.core.leases
        acked, result = await leases.ack_then_pull(h, ack.args["tags"], count)
        for r in (ack, pull):  # (counted once they ran: a refusal before runs them one by one)
            session.note_command(r.verb)
            metrics.COMMANDS.labels(r.verb).inc()
        if not isinstance(acked, Exception):
            metrics.ACKED.inc(acked)
        if isinstance(result, Exception):
            return [acked, result]
        if not result.deliveries and block_ms is not None:
            try:
                result = await self._long_poll(session, h, block_ms, lambda: leases.pull(h, count),
                                               lambda r: bool(r.deliveries))
            except (FenceMQError, RedisError) as exc:  # the ACK ran: only the PULL's reply is this refusal
                return [acked, exc]
        metrics.DELIVERED.inc(len(result.deliveries))
        return [acked, Prebuilt(encode_deliveries(result.deliveries, session.proto))]

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
            # A worker draining for a deploy ends the wait (not a look): the verb answers what it has
            with anyio.move_on_after(timeout) as waiting, session.interruptible(waiting):
                async with self.services.wakeups.watching(self.services.keys.queue(h.queue).wake) as waiter:
                    while True:
                        # The BLOCK time runs out in the wait, not in a look: a fence call cut
                        # short could check messages out to a reply nobody sends.
                        with anyio.CancelScope(shield=True):
                            result = await attempt()
                        if done(result):
                            break
                        await waiter.wait()
        if session.gone:
            # The client hung up while it waited: what the last look checked out for it goes straight
            # back (no failure counted) instead of waiting out its lease under a consumer that is not
            # there. (A connection closing because its worker drains still answers with it.)
            await self._hand_back(h, result)
            raise ClientGone
        return result if result is not None else await attempt()

    async def _hand_back(self, h: Handle, result: Any) -> None:
        found = getattr(result, "deliveries", None) or ([result] if hasattr(result, "tag") else [])
        tags = [d.tag for d in found if not d.tag.startswith("q")]  # QoS 0 has no lease to return
        if tags:
            with anyio.CancelScope(shield=True):
                try:
                    await self.services.core.leases.nack(h, tags, release=True)
                except (FenceMQError, RedisError):
                    pass  # they come back when their leases run out, as before

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
