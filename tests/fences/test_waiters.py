"""A publish's hand-off to waiting long polls, at the fences (lua/lib/waiters.lua, lua/pull.lua's looks).

The worker's side is tests/server/test_handoff.py; here the calls a worker
makes are made one at a time, so each outcome of a look is reached on purpose:
the registration a first look leaves, a publish that hands off only under a
fresh lease intent, a look that finds its record gone, the read-back of what
was handed when its wake-up was lost, and giving it back when the client left.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fencemq.config import Config
from fencemq.fences.core import Core
from fencemq.fences.leases import Look
from fencemq.model.keys import QueueRef
from fencemq.model.handles import Handle
from tests import helpers


def run(redis_url: str, body: Any) -> None:
    async def main() -> None:
        r = helpers.direct_async(redis_url)
        try:
            core = Core(r, Config(redis_url=redis_url))
            sub = await core.subscriptions.subscribe("c", "orders", group="g")
            await body(core, r, Handle.decode(sub.handle))
        finally:
            await r.aclose()

    asyncio.run(main())


async def _publish(core: Core, *payloads: bytes, intent: bool = True) -> None:
    if intent:
        core.ctx.note_waiting(QueueRef("orders").qid)
    else:
        core.ctx._waiting.clear()
    await core.publishing.publish("orders", list(payloads))


def test_a_first_look_that_finds_nothing_registers_and_one_that_finds_something_does_not(redis_url):
    async def body(core: Core, r: Any, h: Handle) -> None:
        waiters = core.keys.queue(h.queue).waiters
        empty = await core.leases.pull(h, 10, Look("first", "w1", wait_ms=5000))
        assert empty.deliveries == [] and empty.since != ""
        assert [m.split(b"\0")[:3] for m in await r.zrange(waiters, 0, -1)] == [[b"w1", b"g", b"c"]]
        assert 0 < await r.pttl(waiters) <= 5000, "the key goes with its last record"
        await _publish(core, b"a", intent=False)  # no intent: woken, not handed
        found = await core.leases.pull(h, 10, Look("first", "w2", wait_ms=5000))
        assert [d.payload for d in found.deliveries] == [b"a"] and found.since == ""
        assert await r.zcard(waiters) == 1, "w2 found something: not registered"

    run(redis_url, body)


def test_a_look_whose_record_a_publish_took_is_told_handed_and_can_read_back_what_it_got(redis_url):
    async def body(core: Core, r: Any, h: Handle) -> None:
        first = await core.leases.pull(h, 10, Look("first", "w1", wait_ms=5000))
        await _publish(core, b"a", b"b")
        again = await core.leases.pull(h, 10, Look("again", "w1", first.since))
        assert again.status == "handed" and again.deliveries == []
        back = await core.leases.pull(h, 10, Look("recover", "w1", first.since))
        assert [d.payload for d in back.deliveries] == [b"a", b"b"]
        assert await core.leases.ack(h, [d.raw_tag.decode() for d in back.deliveries]) == 2

    run(redis_url, body)


def test_a_waiter_that_leaves_after_a_hand_off_gives_its_messages_back_unread(redis_url):
    async def body(core: Core, r: Any, h: Handle) -> None:
        first = await core.leases.pull(h, 10, Look("first", "w1", wait_ms=5000))
        await _publish(core, b"a")
        left = await core.leases.pull(h, 10, Look("leave", "w1", first.since))
        assert left.status == "released"
        (d,) = (await core.leases.pull(h, 10)).deliveries
        assert d.payload == b"a" and d.deliveries == 2  # one acquisition went to the one that left

        other = await core.leases.pull(h, 10, Look("first", "w2", wait_ms=5000))
        assert (await core.leases.pull(h, 10, Look("leave", "w2", other.since))).status == "left"

    run(redis_url, body)


def test_a_last_look_unregisters_and_pulls_as_any_pull(redis_url):
    async def body(core: Core, r: Any, h: Handle) -> None:
        first = await core.leases.pull(h, 10, Look("first", "w1", wait_ms=5000))
        await _publish(core, b"a", intent=False)
        last = await core.leases.pull(h, 10, Look("last", "w1", first.since))
        assert [d.payload for d in last.deliveries] == [b"a"]
        assert await r.exists(core.keys.queue(h.queue).waiters) == 0

    run(redis_url, body)


def test_a_hand_off_past_its_byte_budget_leaves_the_rest_ready_in_order(redis_url):
    async def body(core: Core, r: Any, h: Handle) -> None:
        await core.leases.pull(h, 10, Look("first", "w1", wait_ms=5000))
        big = [bytes([65 + i]) * 100_000 for i in range(4)]  # 400 kB: more than one wake-up carries
        await _publish(core, *big)
        rest = await core.leases.pull(h, 10)
        assert [d.payload[:1] for d in rest.deliveries] == [b"C", b"D"]
        assert all(d.deliveries == 1 for d in rest.deliveries)

    run(redis_url, body)
