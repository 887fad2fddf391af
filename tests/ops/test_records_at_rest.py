"""What the Lua fences store, read back with the model's codecs (fencemq.model.records).

Every record a scripted workload leaves in Redis decodes, and encodes back to
the very bytes the fence wrote: the codecs and the Lua formats cannot drift
apart without this failing.
"""

from __future__ import annotations

from collections import Counter

import redis
from redis.asyncio import Redis

from fencemq.config import Config
from fencemq.fences.core import Core
from fencemq.model import meta
from fencemq.model.keys import Keyspace
from fencemq.model.handles import Handle
from fencemq.model.records import (
    Checkout,
    DeadLetter,
    JournalBatch,
    MailboxEntry,
    OwnedEntry,
    ReadyEntry,
    batch_span,
    decode_journal_entry,
    decode_names,
    decode_push_members,
    encode_names,
    encode_push_members,
    is_batch_key,
    is_end_of_stream,
)
from fencemq.model.values import text
from tests.ops.test_snapshot import run, run_workload


async def _push_to_the_end(url: str) -> None:
    """A push member that ends (MAX 1): its mailbox holds the end-of-stream sentinel."""
    r = Redis.from_url(url)
    q = Core(r, Config(redis_url=url))
    try:
        await q.publishing.publish("ending", [b"one", b"two"])
        await q.subscriptions.subscribe("p2", "ending", group="pushers", capacity=4, max_messages=1)
        await q.subscriptions.subscribe("p3", "ending", group="waiting", capacity=4)
        handle = Handle.decode((await q.subscriptions.subscribe("p4", "ending", group="taken", capacity=4)).handle)
        assert await q.mailboxes.take(handle) is not None
    finally:
        await r.aclose()


def test_every_record_the_fences_store_decodes_and_encodes_back(redis_url: str) -> None:
    run(run_workload(redis_url))
    run(_push_to_the_end(redis_url))
    r = redis.Redis.from_url(redis_url)
    keys = Keyspace()
    seen: Counter[str] = Counter()
    try:
        for meta_key in r.scan_iter(match=keys.queue_pattern(), _type="hash"):
            k = keys.queue_by_id(Keyspace.qid_from_meta_key(meta_key.decode()))
            raw_meta = r.hgetall(k.meta)
            decoded = meta.decode(raw_meta)
            expanded = meta.expand(raw_meta)
            for name in [meta.GROUPS] + [meta.group_field(g, meta.MEMBERS) for g in decoded.groups]:
                if name in expanded:
                    assert encode_names(decode_names(expanded[name])) == expanded[name]
                    seen["name list"] += 1
            if meta.PUSH in expanded:
                assert encode_push_members(decode_push_members(expanded[meta.PUSH])) == expanded[meta.PUSH]
                seen["push members"] += 1
            co = r.hgetall(k.checkouts)
            for tag, raw in co.items():
                if is_batch_key(tag):  # a lease batch's count of its checkouts left
                    first, span = batch_span(tag)
                    held = [t for t in range(first, first + span + 1) if str(t).encode() in co
                            and Checkout.decode(co[str(t).encode()]).lease(str(t)) == tag.decode()]
                    assert int(raw) == len(held) > 0 and r.zscore(k.deadlines, tag) is not None
                    seen["lease batch"] += 1
                    continue
                c = Checkout.decode(raw)
                assert c.encode() == raw
                seen["checkout"] += 1
                if c.batch is not None:
                    assert c.lease(tag) in {text(f) for f in co}, "a checkout of a lease batch whose count is gone"
            for raw in r.zrange(k.owned, 0, -1):
                entry = OwnedEntry.decode(raw)
                assert entry.encode() == raw and r.hexists(k.checkouts, entry.tag)
                seen["owned"] += 1
            for raw in r.zrange(k.ready, 0, -1) + r.zrange(k.delayed, 0, -1):
                assert ReadyEntry.decode(raw).encode() == raw
                seen["ready"] += 1
            for raw in r.lrange(k.journal, 0, -1):
                entry = decode_journal_entry(raw)
                assert entry.encode() == raw
                seen["journal batch" if isinstance(entry, JournalBatch) else "journal"] += 1
            for raw in r.lrange(k.dead, 0, -1):
                assert DeadLetter.decode(raw).encode() == raw
                seen["dead letter"] += 1
            for box in r.scan_iter(match=k.meta + ":mb:*"):
                for raw in r.lrange(box, 0, -1):
                    if is_end_of_stream(raw):
                        seen["end of stream"] += 1
                        continue
                    entry = MailboxEntry.decode(raw)
                    assert entry.encode() == raw and r.hexists(k.checkouts, entry.tag)
                    seen["mailbox entry"] += 1
            for (g, m), fields in decoded.members.items():
                if meta.MARKER in fields:
                    seen["marker"] += 1
    finally:
        r.close()
    assert set(seen) == {"name list", "push members", "checkout", "lease batch", "owned", "ready", "journal",
                         "journal batch", "dead letter",
                         "end of stream", "mailbox entry", "marker"}, seen
