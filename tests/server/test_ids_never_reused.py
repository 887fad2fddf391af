"""An id is never given to two messages, a lagging replica's promotion included (lua/lib/ids.lua).

A replica promoted while it was behind holds an older ``seq`` than the primary that gave
the last ids. Here the replica is cut off (REPLICAOF NO ONE) and the primary publishes
on: what it publishes then is what a real promotion loses. The promoted replica's
first ids on such a queue skip past every id the primary may have given, a gap that
no read, count, seek or trim sees as a message.
"""

from __future__ import annotations

import time

import pytest

from fencemq.model.keys import Keyspace, QueueRef
from fencemq.ops.priority import set_priority
from fencemq.server.embedded import EmbeddedRedis
from tests.helpers import RespConn, as_map, deliveries, direct_async, worker
from tests.ops.test_totals import checkpoint, run_async

pytestmark = pytest.mark.standalone
KEYS = Keyspace()
CHECK_AFTER_S = 1.05  # lua/lib/ids.lua, SERVER_CHECK_MS: ids given this long ago make a fence ask who gave them


def caught_up(primary: EmbeddedRedis) -> None:
    assert primary.client().execute_command("WAIT", 1, 5000) == 1


def promote(replica: EmbeddedRedis) -> None:
    """Cut the replica off and make it a primary: what its primary writes from now on, it never gets."""
    replica.client().execute_command("REPLICAOF", "NO", "ONE")


def meta(server: EmbeddedRedis, topic: str) -> dict[str, str]:
    raw = server.client().hgetall(KEYS.queue(QueueRef(topic)).meta)
    return {k.decode(): v.decode() for k, v in raw.items()}


def test_a_replica_promoted_behind_its_primary_gives_ids_above_every_id_the_primary_gave(pair) -> None:
    primary, replica = pair
    with worker(primary.url) as old, RespConn(old.port) as c:
        c.hello(3, "alice")
        c.call("SUB", "orders", "GROUP", "g", "MODE", "shared")
        kept = [c.call("PUB", "orders", f"kept-{i}") for i in range(5)]
        caught_up(primary)
        promote(replica)
        lost = [c.call("PUB", "orders", f"lost-{i}") for i in range(3)]
    assert [int(i) for i in kept + lost] == list(range(1, 9))
    time.sleep(CHECK_AFTER_S)
    with worker(replica.url) as new, RespConn(new.port) as c:
        c.hello(3, "bob")
        handle = as_map(c.call("SUB", "orders", "GROUP", "g", "MODE", "shared"))["handle"]
        fresh = [int(c.call("PUB", "orders", f"new-{i}")) for i in range(3)]
        # past what the old primary could have given since the replica's last write: 1,000 a ms
        assert fresh[0] > 5 + CHECK_AFTER_S * 1_000_000, "counted on from the replica's older seq"
        assert fresh == list(range(fresh[0], fresh[0] + 3)), "after the gap, ids count up by one again"
        checkpoint(replica.url, replica.client())  # the gap is in no backlog the totals keep
        got = deliveries(c.call("PULL", handle, "COUNT", 20))
        assert [(int(d["id"]), d["payload"]) for d in got] == \
            [(int(k), f"kept-{i}") for i, k in enumerate(kept)] + [(f, f"new-{i}") for i, f in enumerate(fresh)]
        for d in got:
            assert c.call("ACK", handle, d["tag"]) == 1
        checkpoint(replica.url, replica.client())
        assert deliveries(c.call("PULL", handle, "COUNT", 20, "BLOCK", 50)) == []
        # once every group is past it, the log's head passes the gap and it is forgotten
        assert "gaps" not in meta(replica, "orders")


def test_the_same_primary_counts_on_with_no_gap_however_long_a_queue_rested(pair) -> None:
    primary, _ = pair
    with worker(primary.url) as w, RespConn(w.port) as c:
        assert c.call("PUB", "orders", "a") == "1"
        time.sleep(CHECK_AFTER_S)
        assert c.call("PUB", "orders", "b") == "2"
    assert "gaps" not in meta(primary, "orders") and len(meta(primary, "orders")["srv"]) == 8


def test_a_retained_log_across_a_gap_reads_seeks_and_trims_as_if_the_gap_were_not_there(pair) -> None:
    primary, replica = pair
    primary.client().hset(KEYS.retention, "audit", "6 0 0")  # `fencemq retention set audit --count 6`
    with worker(primary.url) as old, RespConn(old.port) as c:
        c.hello(3, "alice")
        c.call("SUB", "audit", "GROUP", "g", "MODE", "shared")
        before = [int(c.call("PUB", "audit", f"before-{i}")) for i in range(4)]
        caught_up(primary)
        promote(replica)
        c.call("PUB", "audit", "lost")
    time.sleep(CHECK_AFTER_S)
    with worker(replica.url) as new, RespConn(new.port) as c:
        c.hello(3, "bob")
        handle = as_map(c.call("SUB", "audit", "GROUP", "g", "MODE", "shared"))["handle"]
        time.sleep(0.01)
        after_ms = int(replica.client().time()[0]) * 1000 + int(replica.client().time()[1]) // 1000
        time.sleep(0.01)
        after = [int(c.call("PUB", "audit", f"after-{i}")) for i in range(3)]
        ids = [int(k) for k in replica.client().hkeys(KEYS.queue(QueueRef("audit")).log)]
        assert sorted(ids) == before[1:] + after, "the count of 6 keeps six messages, the gap counting for none"
        c.call("SEEK", handle, "TIME", after_ms)
        assert [int(d["id"]) for d in deliveries(c.call("PULL", handle, "COUNT", 10))] == after
        c.call("SEEK", handle, "EARLIEST")
        assert [int(d["id"]) for d in deliveries(c.call("PULL", handle, "COUNT", 10))] == before[1:] + after
        checkpoint(replica.url, replica.client())


def test_a_plain_topic_lost_whole_in_the_promotion_starts_again_above_the_ids_it_gave(pair) -> None:
    primary, replica = pair
    with worker(primary.url) as old, RespConn(old.port) as c:
        assert c.call("PUB", "early", "kept") == "1", "a server that has held everything from the start: from 1"
        caught_up(primary)
        promote(replica)
        lost = [int(c.call("PUB", "late", f"lost-{i}")) for i in range(3)]
    assert lost == [1, 2, 3]
    with worker(replica.url) as new, RespConn(new.port) as c:
        now_ms = int(replica.client().time()[0]) * 1000
        again = int(c.call("PUB", "late", "new"))
        assert again > 3, "a topic the promoted replica never had gave ids 1-3 on the old primary"
        assert now_ms * 100 <= again < 2**48, "the clock in tens of µs: a priority queue's ids stay below 2^48"
        assert int(c.call("PUB", "never-seen", "x")) > 3, "nor can it tell a new topic from one it lost"
        assert int(c.call("PUB", "late", "next")) == again + 1
    # and for good: the old primary, made primary again after a failback, may have lost topics too
    assert replica.client().hget(KEYS.totals, "srv") == b"-"


def test_a_priority_queue_reads_level_by_level_across_a_gap(pair) -> None:
    primary, replica = pair

    async def honour_priority() -> None:
        r = direct_async(primary.url)
        try:
            await set_priority(r, KEYS, QueueRef("jobs"), True)
        finally:
            await r.aclose()

    run_async(honour_priority())
    with worker(primary.url) as old, RespConn(old.port) as c:
        c.hello(3, "alice")
        c.call("SUB", "jobs", "GROUP", "g", "MODE", "shared")
        low = [int(c.call("PUB", "jobs", f"low-{i}", "PRIORITY", 1)) for i in range(2)]
        caught_up(primary)
        promote(replica)
        c.call("PUB", "jobs", "lost", "PRIORITY", 9)
    time.sleep(CHECK_AFTER_S)
    with worker(replica.url) as new, RespConn(new.port) as c:
        c.hello(3, "bob")
        handle = as_map(c.call("SUB", "jobs", "GROUP", "g", "MODE", "shared"))["handle"]
        high = int(c.call("PUB", "jobs", "high", "PRIORITY", 9))
        later_low = int(c.call("PUB", "jobs", "low-later", "PRIORITY", 1))
        assert 3 < high < later_low < 2**48, "past the gap, and below the priority index's bound"
        checkpoint(replica.url, replica.client())
        got = deliveries(c.call("PULL", handle, "COUNT", 10))
        assert [int(d["id"]) for d in got] == [high, *low, later_low], "level 9 first, then level 1 in order"
        checkpoint(replica.url, replica.client())
