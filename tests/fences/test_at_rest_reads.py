"""Reading an lmq's meta wherever it lies (fences/at_rest.py): the same answer from its key and
from its slot's rest hash, and nothing for a queue that does not exist.

Each read is held to itself across a rest by hand (tests/resting.py, as lua/lib/meta.lua's
``put_to_rest`` does it), as are the fence modules' own reads of a meta field: the eviction
marker (fences/lite.py), the push members (fences/mailbox.py), a priority queue's levels.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fencemq.config import Config
from fencemq.fences import at_rest
from fencemq.fences.core import Core
from fencemq.fences.lite import marker_field
from fencemq.fences.priority import level_counts
from fencemq.model import meta
from fencemq.model.handles import Handle
from fencemq.model.keys import Keyspace, QueueRef
from fencemq.model.values import text
from tests.helpers import direct, direct_async
from tests.resting import rest_by_hand, wake_by_hand

REF = QueueRef("chat", "s-1")
NAMES = [meta.COMPACT_MARK, meta.AT_REST[meta.SEQ], meta.PUSH, "absent"]


async def _reads(url: str) -> dict[str, Any]:
    r = direct_async(url)
    q = Core(r, Config(redis_url=url))
    k, gone = q.keys.queue(REF), q.keys.queue(QueueRef("chat", "never"))
    handle = Handle(REF, meta.LITE_GROUP, "c1")
    try:
        return {
            "hash": meta.expand(await at_rest.meta_hash(r, k)),
            "exists": await at_rest.exists(r, k),
            "pttl": await at_rest.pttl(r, k),
            "fields": [None if v is None else text(v) for v in await at_rest.meta_fields(r, k, NAMES)],
            "marker": await q.lite.marked([handle]),
            "push": await q.mailboxes.push_members(REF),
            "levels": await level_counts(r, k),
            "gone": (await at_rest.meta_hash(r, gone), await at_rest.exists(r, gone), await at_rest.pttl(r, gone),
                     await at_rest.meta_fields(r, gone, NAMES)),
        }
    finally:
        await r.aclose()


async def _subscribe(url: str) -> None:
    r = direct_async(url)
    q = Core(r, Config(redis_url=url))
    try:
        await q.subscriptions.subscribe("c1", "chat", lmq="s-1")
        await q.publishing.publish("chat", [b"one"], lmq="s-1")
        handle = Handle.decode((await q.subscriptions.subscribe("c1", "chat", lmq="s-1")).handle)
        pulled = await q.leases.pull(handle, 1)
        await q.leases.ack(handle, [d.tag for d in pulled.deliveries])
    finally:
        await r.aclose()


def test_an_lmq_reads_the_same_from_its_key_and_from_its_rest(redis_url: str) -> None:
    asyncio.run(_subscribe(redis_url))
    r = direct(redis_url)
    k = Keyspace().queue(REF)
    wake_by_hand(r, k)  # the fence may have rested it
    # a marker and a push member, so that those reads have something to find in either place
    r.hset(k.meta, mapping={marker_field(Handle(REF, meta.LITE_GROUP, "c1")): "c2", meta.PUSH: "g\tc3"})
    from_key = asyncio.run(_reads(redis_url))
    assert rest_by_hand(r, k) and not r.exists(k.meta)
    from_rest = asyncio.run(_reads(redis_url))
    assert from_rest == from_key
    assert from_key["exists"] and from_key["pttl"] == -1 and from_key["fields"][0] == "c1"
    assert from_key["marker"] == ["c2"] and from_key["push"] == [("g", "c3")]
    assert from_key["gone"] == ({}, False, -2, [None] * len(NAMES))


def test_resting_by_hand_packs_exactly_what_the_fence_packs(redis_url: str) -> None:
    asyncio.run(_subscribe(redis_url))  # its ACK rests the lmq, 16-digit ids and tag included
    r = direct(redis_url)
    k = Keyspace().queue(REF)
    by_fence = r.hget(k.rest, k.rest_field)
    assert by_fence is not None and not r.exists(k.meta), "the fence rested it"
    assert wake_by_hand(r, k) and rest_by_hand(r, k)
    assert r.hget(k.rest, k.rest_field) == by_fence
