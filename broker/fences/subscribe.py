"""Subscriptions: joining and leaving a queue as a member of a group.

A subscription is a *group* on a queue with a mode — exclusive (lite queues,
a client's own), shared (competing consumers, ``$share``) or single-active —
and its members. lua/subscribe.lua joins (creating the group on first use,
preempting an exclusive owner), lua/unsubscribe.lua leaves (every checkout
back at once), lua/presence.lua marks a member online or offline, and
lua/drop_if_empty.lua deletes a filter subscription's queue when its last
member has left. Protocol: docs/protocol.md, "Subscriptions".
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fencemq.errors import BadArgument, FenceMQError
from fencemq.fences import session_index
from fencemq.fences.context import FenceContext, opt
from fencemq.fences.lite import Lite
from fencemq.fences.mailbox import Mailboxes
from fencemq.fences.registry import fence
from fencemq.model import meta
from fencemq.model.keys import QueueRef, check_name
from fencemq.model.handles import Handle
from fencemq.model.values import text

SUBSCRIBE = fence(
    "subscribe", "meta log checkouts deadlines owned held ready wake delayed dedup dedup_ids dead journal totals backlogs "
    "priority rest",
    "group member mode default_mode policy from_kind from_arg lock_ms epoch max capacity qos on_preempt journal_cap"
    " strategy offline lite",
)
UNSUBSCRIBE = fence("unsubscribe",
                    "meta log checkouts deadlines owned held ready delayed wake dedup dedup_ids dead journal mailbox totals backlogs priority rest",
                    "group member how idle_ttl_ms")
PRESENCE = fence("presence", "meta journal rest", "group member online")
DROP_IF_EMPTY = fence("drop_if_empty", "meta totals backlogs rest", "", keys_rest="others")

MODES = ("exclusive", "shared", "single-active")
POLICIES = ("preempt", "reject")
FROM_KINDS = ("earliest", "latest", "id", "time")
STRATEGIES = ("round-robin", "sticky", "hash")


@dataclass(frozen=True, slots=True)
class SubscribePlan:
    """A SUB checked and ready for its fence call."""

    ref: QueueRef
    held: Handle
    fence_args: dict[str, Any]
    capacity: int | None
    qos: int

    def subscription(self, res: list[Any]) -> Subscription:
        return Subscription(
            self.held.encode(), text(res[0]), int(res[1]), text(res[2]), text(res[3]) or None, int(res[4]),
            int(res[5]), self.qos, new_member=bool(int(res[6])),
        )


@dataclass(slots=True)
class Subscription:
    handle: str
    mode: str
    epoch: int
    owner: str
    evicted: str | None
    returned: int
    cursor: int
    qos: int = 1
    new_member: bool = False

    def as_reply(self) -> dict[str, object]:
        reply: dict[str, object] = {"handle": self.handle, "mode": self.mode, "epoch": self.epoch, "qos": self.qos}
        if self.owner:
            reply["owner"] = self.owner
        return reply


class Subscriptions:
    def __init__(self, ctx: FenceContext, mailboxes: Mailboxes, lite: Lite) -> None:
        self.ctx = ctx
        self.mailboxes = mailboxes
        self.lite = lite
        # Set by the shared subscriptions: a filter queue was deleted with its last member.
        self.on_queue_dropped: Callable[[QueueRef], Awaitable[None]] | None = None
        mailboxes.on_member_gone = self.forget

    async def subscribe(
        self,
        client: str,
        topic: str,
        *,
        queue: QueueRef | None = None,
        **options: Any,
    ) -> Subscription:
        """Join a subscription. ``queue`` names a filter subscription's own queue.

        Options as SUB's (docs/protocol.md): lmq, group, mode, policy, start, lock_ms,
        epoch, max_messages, capacity, qos, on_preempt, strategy, offline."""
        plan = self._plan(client, topic, queue, **options)
        if queue is None:
            await self.ctx.check_topic_kind(topic, plan.ref.lite)
        held = plan.held
        # The session learns of the handle before the fence makes the
        # membership: whatever fails next, its end will leave it (idempotently).
        # A lite one within the client's quota, in one call (lua/lite_hold.lua).
        added = await (self.lite.hold(held) if plan.ref.lite else session_index.add(self.ctx.linked, self.ctx.keys, held))
        try:
            res = await self.ctx.fences.run(SUBSCRIBE, self.ctx.keys.queue(plan.ref), **plan.fence_args)
        except FenceMQError:
            if added:  # refused (BADARG, BUSY): nothing to leave
                await self._let_go(held)
            raise
        if plan.capacity is not None:
            await self.mailboxes.dispatch_all(plan.ref)
        return plan.subscription(res)

    async def subscribe_lite_many(self, client: str, topic: str,
                                  requests: list[dict[str, Any]]) -> list[Subscription | Exception]:
        """Pipelined ``SUB topic LMQ …`` of one client (pull mode), in two round trips in all.

        The client's holds (one call in its slot: lua/lite_hold.lua), then the subscribe
        fences (one per lmq, pipelined), then a refused one's hold let go: the outcomes
        of running them one by one, in order, a refusal as its exception.
        """
        outcomes: list[Subscription | Exception | None] = [None] * len(requests)
        plans: list[tuple[int, SubscribePlan]] = []
        for i, options in enumerate(requests):
            try:
                plan = self._plan(client, topic, None, **options)
            except FenceMQError as exc:
                outcomes[i] = exc
                continue
            if not plan.ref.lite or plan.capacity is not None:
                raise ValueError("subscribe_lite_many takes pull subscriptions of lmqs")
            plans.append((i, plan))
        if plans:
            await self.ctx.check_topic_kind(topic, True)
        holds = await self.lite.hold_many([plan.held for _, plan in plans])
        subscribing, over_quota = [], []
        for (i, plan), added in zip(plans, holds, strict=True):
            if isinstance(added, Exception):
                outcomes[i] = added
                over_quota.append(i)
            else:
                subscribing.append((i, plan, added))
        replies = await self.ctx.fences.run_many(
            SUBSCRIBE, [(self.ctx.keys.queue(plan.ref), {}, (), plan.fence_args) for _, plan, _ in subscribing])
        let_go = False
        for (i, plan, added), res in zip(subscribing, replies, strict=True):
            if isinstance(res, Exception):
                outcomes[i] = res
                if added:
                    await self._let_go(plan.held)
                    let_go = True
            else:
                outcomes[i] = plan.subscription(res)
        if let_go:
            # One by one, a refused SUB's quota slot was free again for the SUBs after it:
            # those refused for the quota (nothing written) run again, in order.
            for i in over_quota:
                try:
                    outcomes[i] = await self.subscribe(client, topic, **requests[i])
                except FenceMQError as exc:
                    outcomes[i] = exc
        return outcomes  # type: ignore[return-value]

    def _plan(
        self,
        client: str,
        topic: str,
        queue: QueueRef | None,
        *,
        lmq: str | None = None,
        group: str | None = None,
        mode: str | None = None,
        policy: str | None = None,
        start: tuple[str, int | None] = ("earliest", None),
        lock_ms: int | None = None,
        epoch: int | None = None,
        max_messages: int | None = None,
        capacity: int | None = None,
        qos: int = 1,
        on_preempt: str | None = None,
        strategy: str | None = None,
        offline: str | None = None,
    ) -> SubscribePlan:
        """Every option checked (BADARG, nothing written) and the subscribe fence's arguments."""
        config = self.ctx.config
        ref = queue or self.ctx.queue(topic, lmq)
        check_name(client, "client")
        if group is not None:
            check_name(group, "group")
        else:
            # Lite queues are held per group; without GROUP a plain topic
            # subscription is the client's own.
            group = meta.LITE_GROUP if lmq is not None else "~" + client
        if mode is not None and mode not in MODES:
            raise BadArgument(f"MODE must be one of {', '.join(MODES)}")
        if policy is not None and policy not in POLICIES:
            raise BadArgument("POLICY must be preempt or reject")
        if start[0] not in FROM_KINDS:
            raise BadArgument("FROM takes earliest, latest, ID id or TIME ms")
        if lock_ms is not None and not 0 < lock_ms <= config.max_lock_ms:
            raise BadArgument(f"LOCK must be between 1 and {config.max_lock_ms} ms")
        if max_messages is not None and max_messages < 0:
            raise BadArgument("MAX must be 0 or more")
        if capacity is not None and not 0 < capacity <= 1_000_000:
            raise BadArgument("CAPACITY must be between 1 and 1000000")
        if qos not in (0, 1):
            raise BadArgument("QOS must be 0 or 1")
        if on_preempt is not None and on_preempt not in ("keep", "earliest", "latest"):
            raise BadArgument("ON-PREEMPT must be keep, earliest or latest")
        if offline is not None and offline not in ("queue", "skip"):
            raise BadArgument("a shared group's offline members are queued for (QUEUE-OFFLINE) or skipped (SKIP-OFFLINE)")
        if strategy is not None and strategy not in STRATEGIES:
            raise BadArgument(f"STRATEGY must be one of {', '.join(STRATEGIES)}")
        # Without GROUP the subscription is the client's own: exclusive to it.
        default_mode = "exclusive" if (lmq is not None or group.startswith("~")) else "shared"
        fence_args = dict(
            group=group, member=client, mode=opt(mode), default_mode=default_mode,
            policy=opt(policy), from_kind=start[0], from_arg=opt(start[1]), lock_ms=opt(lock_ms),
            epoch=opt(epoch), max=opt(max_messages), capacity=opt(capacity), qos=qos,
            on_preempt=opt(on_preempt), journal_cap=self.ctx.journal_cap(ref), strategy=opt(strategy),
            offline=opt(offline), lite=int(ref.lite),
        )
        return SubscribePlan(ref, Handle(ref, group, client), fence_args, capacity, qos)

    async def unsubscribe(self, handle: Handle, *, session_over: bool = False) -> int:
        """Leave the subscription; all checkouts go back at once. Idempotent.

        A push member that cancels keeps its handle until it TAKEs the
        end-of-stream sentinel seated here; when its session is over it goes
        at once.
        """
        k = self.ctx.keys.queue(handle.queue)
        res = await self.ctx.fences.run(
            UNSUBSCRIBE, k, extra_keys={"mailbox": k.mailbox(handle.group, handle.member)}, group=handle.group,
            member=handle.member, how="leave" if session_over else "cancel", idle_ttl_ms=self.ctx.idle_ttl(handle.queue),
        )
        removed, awaiting_eos = bool(int(res[2])), bool(int(res[3]))
        if not awaiting_eos:
            # A member that stays until it TAKEs its sentinel stays in the session's index too,
            # so the session's end still finds it (forget() lets go once it is taken).
            await self._let_go(handle)
        if int(res[0]):
            # The returned messages go to another member now, not at the next publish.
            await self.mailboxes.dispatch_all(handle.queue)
        if removed and handle.queue.is_filter:
            await self.drop_if_empty(handle.queue)
        return int(res[0])

    async def forget(self, handle: Handle) -> None:
        """A member the fence removed (it cancelled and took its sentinel): the session forgets it too."""
        await self._let_go(handle)
        if handle.queue.is_filter:
            await self.drop_if_empty(handle.queue)

    async def _let_go(self, handle: Handle) -> None:
        """Out of the session's index (a lite one also off its quota count)."""
        if handle.queue.lite:
            await self.lite.release(handle)
        else:
            await session_index.remove(self.ctx.redis, self.ctx.keys, handle)

    async def drop_if_empty(self, ref: QueueRef) -> bool:
        """Delete a filter subscription's queue once no member is left (MQTT groups)."""
        k = self.ctx.keys.queue(ref)
        dropped = bool(await self.ctx.fences.run(DROP_IF_EMPTY, k, keys_rest=k.all_keys()[1:]))
        if dropped and self.on_queue_dropped is not None:
            await self.on_queue_dropped(ref)
        return dropped

    async def set_presence(self, handles: list[Handle], online: bool) -> None:
        await self.set_presence_many([(h, online) for h in handles])

    async def set_presence_many(self, marks: list[tuple[Handle, bool]]) -> None:
        """Mark members online or offline, one PRESENCE call each, all in one pipeline."""
        replies = await self.ctx.fences.run_many(PRESENCE, [
            (self.ctx.keys.queue(h.queue), {}, (), {"group": h.group, "member": h.member, "online": int(online)})
            for h, online in marks])
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
