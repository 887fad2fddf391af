"""Graceful max-N end with a bounded buffer (guarantee 3): push mailboxes.

A push member has a bounded mailbox (a list in Redis) that the broker fills
(lua/dispatch.lua) and the member TAKEs from (lua/take.lua). ``MAX n``
stops delivery at n on the server and seats the end-of-stream sentinel by
evict-offer (lua/end_after.lua): never blocks, never hangs.
Lua side: lua/lib/mailbox.lua. Protocol: docs/protocol.md, "Push subscriptions".
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fencemq.fences import at_rest
from fencemq.fences.context import FenceContext
from fencemq.fences.registry import fence
from fencemq.model import meta
from fencemq.model.keys import QueueRef
from fencemq.model.handles import Handle
from fencemq.model.messages import Delivery, unpack_delivery
from fencemq.model.values import text

_LEASE_KEYS = "meta log checkouts deadlines owned held ready delayed"

TAKE = fence("take", f"{_LEASE_KEYS} wake journal mailbox totals backlogs priority rest", "group member default_lock_ms intent_at intent_ms")
DISPATCH = fence("dispatch", f"{_LEASE_KEYS} wake journal totals backlogs priority rest", "default_lock_ms intent_at intent_ms", keys_rest="mailboxes",
                 argv_rest="members")
END_AFTER = fence("end_after", f"{_LEASE_KEYS} wake journal mailbox totals backlogs priority rest", "group member max")

EOS = "EOS"


class Mailboxes:
    def __init__(self, ctx: FenceContext) -> None:
        self.ctx = ctx
        # Set by the subscriptions: a member that cancelled left at its end-of-stream sentinel.
        self.on_member_gone: Callable[[Handle], Awaitable[None]] | None = None

    async def push_members(self, ref: QueueRef) -> list[tuple[str, str]]:
        (raw,) = await at_rest.meta_fields(self.ctx.redis, self.ctx.keys.queue(ref), [meta.PUSH])
        return parse_push_members(raw)

    async def dispatch(self, ref: QueueRef, members: list[tuple[str, str]]) -> list[int]:
        """Fill these members' push mailboxes; returns how many each got."""
        k = self.ctx.keys.queue(ref)
        counts, deadline = await self.ctx.under_intent(ref.qid, lambda intent: self.ctx.fences.run(
            DISPATCH, k, keys_rest=[k.mailbox(g, m) for g, m in members], args_rest=[x for pair in members for x in pair],
            default_lock_ms=self.ctx.config.default_lock_ms, **intent))
        if int(deadline) >= 0:  # a shared group's mailbox entries are leased
            await self.ctx.schedule_soon(ref.qid, int(deadline))
        return counts

    async def dispatch_all(self, ref: QueueRef) -> None:
        """Fill every push member's mailbox: a shared group's strategy sees its whole group."""
        members = await self.push_members(ref)
        if members:
            await self.dispatch(ref, members)

    async def end_after(self, handle: Handle, max_messages: int) -> bool:
        """Arm MAX: end after that many deliveries in total; True if already ended."""
        k = self.ctx.keys.queue(handle.queue)
        res = await self.ctx.fences.run(END_AFTER, k, extra_keys={"mailbox": k.mailbox(handle.group, handle.member)},
                                        group=handle.group, member=handle.member, max=max_messages)
        return bool(res)

    async def take(self, handle: Handle) -> Delivery | None | str:
        """Next delivery from the member's push mailbox, None when empty, "EOS" at the end."""
        k = self.ctx.keys.queue(handle.queue)
        res = await self.ctx.under_intent(handle.queue.qid, lambda intent: self.ctx.fences.run(
            TAKE, k, extra_keys={"mailbox": k.mailbox(handle.group, handle.member)}, group=handle.group,
            member=handle.member, default_lock_ms=self.ctx.config.default_lock_ms, **intent))
        kind = text(res[0])
        if kind == "eos":
            if int(res[1]) and self.on_member_gone is not None:
                await self.on_member_gone(handle)
            return EOS
        if int(res[1] if kind == "none" else res[7]):
            # A shared group's member took one: the group's strategy refills.
            await self.dispatch_all(handle.queue)
        if kind == "none":
            if len(res) > 3 and self.ctx.on_fenced_poll is not None:  # fenced: what its notice said, to say again
                await self.ctx.on_fenced_poll(handle, text(res[2]), [text(item) for item in res[3:]])
            return None
        epoch, deadline, tag, msg_id, acq, body, _refill = res[1:]
        if int(deadline) >= 0:
            await self.ctx.schedule_soon(handle.queue.qid, int(deadline))
        return unpack_delivery(handle.queue.topic, handle.queue.lmq, int(epoch), tag, int(msg_id), int(acq), body)


def parse_push_members(raw: bytes | str | None) -> list[tuple[str, str]]:
    """The meta field ``push``: one ``group TAB member`` line per push member."""
    if not raw:
        return []
    return [tuple(line.split("\t", 1)) for line in text(raw).split("\n")]  # type: ignore[misc]
