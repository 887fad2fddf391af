"""Consumer timeouts against a real worker and real time (issue 3, "Done means").

Leases are short (LOCK 200–400 ms) and the sweeper runs every 100 ms, so an
expired lease must be back within well under a second of its deadline. Every
test starts its own worker (``tests.helpers.worker``) on the flushed private
server of ``redis_url``; deadlines are read from the queue's ``dl`` zset and
compared with Redis's own clock, the one the fences use.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import anyio
import pytest
import redis
from prometheus_client import REGISTRY

from fencemq.sdk.client import Client
from fencemq.model.keys import Keyspace, QueueRef
from fencemq.model.records import Checkout, JournalBatch, journal_events
from tests import helpers
from tests.helpers import (RespConn, as_map, checkout_records, client, deliveries, honour_priority, in_cluster_mode,
                           wait_for, worker)

KEYS = Keyspace()
ORDERS = KEYS.queue(QueueRef("orders"))
SESSIONS = KEYS.sessions


@pytest.fixture
def w(redis_url):
    with worker(redis_url, sweep_interval_ms=100) as started:
        yield started


def join(c, *args) -> str:
    """SUB orders …; the handle."""
    return as_map(c.execute_command("SUB", "orders", *args))["handle"]


def take(c, handle: str, count: int = 10, *opts) -> list[dict]:
    """PULL handle COUNT count …; the deliveries."""
    return deliveries(c.execute_command("PULL", handle, "COUNT", count, *opts))


def payloads(got: list[dict]) -> list[str]:
    return [d["payload"] for d in got]


def redis_ms(direct: redis.Redis) -> float:
    seconds, micros = direct.time()
    return seconds * 1000 + micros / 1000


def notices_of(c) -> list[dict]:
    return [as_map(n) for n in c.execute_command("HEARTBEAT")]


def wait_expired(c, handle: str, tags: list[str], timeout: float = 3.0, *, at_most: list[str] | None = None) -> dict:
    """Wait until HEARTBEAT listed message_timeout notices for exactly these tags (or, given
    ``at_most``, for all of these and maybe some of those); returns the last notice."""
    seen: list[dict] = []
    want, allowed = set(tags), set(at_most or tags)

    def arrived() -> dict | None:
        seen.extend(n for n in notices_of(c) if n["type"] == "message_timeout" and n["handle"] == handle)
        got = [t for n in seen for t in n["tags"]]
        assert len(got) == len(set(got)) and set(got) <= allowed | want, f"unexpected timeouts {got}"
        return seen[-1] if want <= set(got) else None

    return wait_for(arrived, timeout=timeout, what=f"a message_timeout notice for {tags}")


def sample(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


# -- expiry and redelivery -------------------------------------------------------------------------


def test_an_expired_lease_is_redelivered_to_another_consumer_within_a_second_of_its_deadline(w, direct):
    slow, fast = client(w.port, 2, "slow"), client(w.port, 2, "fast")
    hs = join(slow, "GROUP", "g", "LOCK", 300)
    hf = join(fast, "GROUP", "g")
    latencies = []
    for i in range(5):
        slow.execute_command("ACK", hs, "0")  # any settle clears the suspicion of the round before
        slow.execute_command("PUB", "orders", f"m{i}")
        (held,) = take(slow, hs)
        deadline = direct.zscore(ORDERS.deadlines, held["tag"])
        assert deadline is not None
        (back,) = take(fast, hf, 1, "BLOCK", 3000)  # parked until the sweep returns the lease
        latency = redis_ms(direct) - deadline
        latencies.append(latency)
        assert back["id"] == held["id"] and back["deliveries"] == 2 and back["tag"] != held["tag"]
        assert fast.execute_command("ACK", hf, back["tag"]) == 1
    print("deadline -> redelivery (ms): " + ", ".join(f"{x:.0f}" for x in latencies))
    assert min(latencies) >= 0, "a lease came back before its deadline"
    assert max(latencies) < 1000


def test_the_late_ack_of_an_expired_tag_settles_nothing_even_after_the_redelivered_copy_was_acked(w, direct):
    slow, fast = client(w.port, 2, "slow"), client(w.port, 2, "fast")
    slow.execute_command("MPUB", "orders", 2, "x", "y")
    hs = join(slow, "GROUP", "g", "LOCK", 200)
    hf = join(fast, "GROUP", "g", "LOCK", 60_000)
    (late,) = take(slow, hs, 1)
    (y,) = take(fast, hf)
    (back,) = take(fast, hf, 10, "BLOCK", 3000)
    assert (back["id"], back["deliveries"]) == (late["id"], 2)
    assert fast.execute_command("ACK", hf, back["tag"]) == 1
    # the old tag names nothing any more: no verb settles, returns or extends anything through it
    assert slow.execute_command("ACK", hs, late["tag"]) == 0
    assert slow.execute_command("NACK", hs, late["tag"]) == 0
    assert slow.execute_command("RENEW", hs, late["tag"], "LOCK", 5000) == 0
    assert take(slow, hs) == [] and take(fast, hf) == []  # x is settled for good, y still held by fast
    assert list(checkout_records(direct, ORDERS)) == [y["tag"]]


def test_renewing_before_each_deadline_keeps_a_lease_alive_for_many_times_its_lock(w):
    owner, rival = client(w.port, 2, "owner"), client(w.port, 2, "rival")
    owner.execute_command("PUB", "orders", "long job")
    ho = join(owner, "GROUP", "g", "LOCK", 400)
    hr = join(rival, "GROUP", "g")
    (d,) = take(owner, ho)
    started = time.monotonic()
    while time.monotonic() - started < 1.6:  # four locks' worth of work
        time.sleep(0.1)
        assert owner.execute_command("RENEW", ho, d["tag"]) == 1  # the member's own LOCK again
        assert take(rival, hr) == []
    assert notices_of(owner) == []
    assert owner.execute_command("ACK", ho, d["tag"]) == 1
    time.sleep(0.5)
    assert take(rival, hr) == []


# -- lease batches: one PULL's checkouts under one lease --------------------------------------------


def lease_state(direct) -> tuple[list, list, dict]:
    """The orders queue's deadline entries, ownership entries and checkout records."""
    return (direct.zrange(ORDERS.deadlines, 0, -1, withscores=True), direct.zrange(ORDERS.owned, 0, -1),
            checkout_records(direct, ORDERS))


def test_a_pulls_checkouts_share_one_deadline_and_one_ownership_entry_and_the_last_settled_takes_them(w, direct):
    c = client(w.port, 2, "batcher")
    h = join(c, "GROUP", "g", "LOCK", 60_000)
    c.execute_command("MPUB", "orders", 100, *[f"m{i}" for i in range(100)])
    got = take(c, h, 100)
    deadlines, owned, records = lease_state(direct)
    assert len(got) == len(records) == 100 and len(deadlines) == len(owned) == 1  # one lease, not a hundred
    ((lease, _),) = deadlines
    assert {Checkout.decode(records[d["tag"]]).lease(d["tag"]) for d in got} == {lease.decode()}
    assert len({d["tag"] for d in got}) == 100  # each its own tag
    for verb in ("ACK", "NACK", "RENEW"):  # the batch's key is no tag: it settles nothing, changes nothing
        assert c.execute_command(verb, h, lease) == 0
    assert lease_state(direct) == (deadlines, owned, records)
    assert c.execute_command("ACK", h, *[d["tag"] for d in got[:60]]) == 60
    deadlines, owned, records = lease_state(direct)
    assert (len(deadlines), len(owned), len(records)) == (1, 1, 40)
    assert int(direct.hget(ORDERS.checkouts, lease)) == 40  # the batch counts what it holds
    assert c.execute_command("NACK", h, *[d["tag"] for d in got[60:]]) == 40
    assert lease_state(direct) == ([], [], {}) and direct.hlen(ORDERS.checkouts) == 0  # the last took the lease


def test_a_lease_batch_expires_as_a_unit_and_a_checkout_renewed_apart_keeps_a_lease_of_its_own(w, direct):
    c, other = client(w.port, 2, "holder"), client(w.port, 2, "other")
    h = join(c, "GROUP", "g", "LOCK", 400)
    ho = join(other, "GROUP", "g", "LOCK", 60_000)
    c.execute_command("MPUB", "orders", 4, "a", "b", "c", "d")
    got = take(c, h, 4)
    assert c.execute_command("ACK", h, got[0]["tag"]) == 1
    assert c.execute_command("RENEW", h, got[1]["tag"], "LOCK", 60_000) == 1  # leaves the batch
    assert len(lease_state(direct)[0]) == 2  # the batch's deadline, and b's own
    notice = wait_expired(c, h, [got[2]["tag"], got[3]["tag"]])  # c and d, at the batch's one deadline
    assert sorted(notice["tags"]) == sorted([got[2]["tag"], got[3]["tag"]])
    # the holding index: b's own entry at its id; the batch's went with it
    assert direct.zrange(ORDERS.held, 0, -1, withscores=True) == [(got[1]["tag"].encode(), float(got[1]["id"]))]
    back = take(other, ho, 10)
    assert payloads(back) == ["c", "d"] and [d["deliveries"] for d in back] == [2, 2]
    assert c.execute_command("ACK", h, got[2]["tag"], got[3]["tag"]) == 0  # late: settles nothing
    assert c.execute_command("ACK", h, got[1]["tag"]) == 1  # the renewed one is still its own
    assert c.execute_command("RENEW", h, *[d["tag"] for d in back]) == 0  # another's batch


def test_renewing_every_checkout_left_in_a_batch_moves_its_one_deadline(w, direct):
    c = client(w.port, 2, "renewer")
    h = join(c, "GROUP", "g", "LOCK", 60_000)
    c.execute_command("MPUB", "orders", 3, "a", "b", "c")
    got = take(c, h, 3)
    assert c.execute_command("ACK", h, got[0]["tag"]) == 1
    ((lease, before),) = lease_state(direct)[0]
    time.sleep(0.05)
    assert c.execute_command("RENEW", h, got[1]["tag"], got[2]["tag"], got[2]["tag"]) == 3  # as one by one
    ((still, after),) = lease_state(direct)[0]
    assert still == lease and after > before  # the batch moved whole: no lease of its own for either


def held_low_and_log(direct) -> tuple[int | None, list[int]]:
    """The lowest score in the orders queue's holding index, and the ids its log holds, in order."""
    low = direct.zrange(ORDERS.held, 0, 0, withscores=True)
    return (int(low[0][1]) if low else None), sorted(int(i) for i in direct.hkeys(ORDERS.log))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("shape", ["plain", "priority", "made by an older worker"])
def test_the_log_keeps_exactly_from_the_lowest_message_checked_out_whatever_order_its_batches_are_settled_in(
        redis_url, direct, shape, seed):
    # One group, no retention policy: a settled message goes at once, so the log runs from the lowest id still
    # checked out to the last. A lease batch holds its place by one entry at its lowest id, moved up as that goes;
    # a priority queue's batch (ids out of tag order) and one an older worker made keep an entry per checkout.
    if shape == "priority":
        honour_priority(redis_url, "orders")
    rng = random.Random(seed)
    with worker(redis_url) as w:
        c = client(w.port, 2, "settler")
        h = join(c, "GROUP", "g", "LOCK", 60_000)
        for i in range(12):
            c.execute_command("PUB", "orders", f"m{i}", *(("PRIORITY", rng.randrange(10)) if shape == "priority" else ()))
        held = take(c, h, 7) + take(c, h, 10)  # two batches
        assert len(held) == 12
        if shape == "made by an older worker":  # its holding entries: one per checkout, each at its id
            direct.delete(ORDERS.held)
            direct.zadd(ORDERS.held, {d["tag"]: int(d["id"]) for d in held})
        returned: set[int] = set()  # NACKed (each once: no dead letters), back in the ready set
        nacked: set[int] = set()
        while held or returned:
            move = rng.choice(["ack one", "ack some", "renew one apart", "nack one"] if held else ["pull back"])
            if move == "renew one apart":
                d = rng.choice(held)
                assert c.execute_command("RENEW", h, d["tag"], "LOCK", 90_000) == 1
            elif move == "nack one" and any(int(d["id"]) not in nacked for d in held):
                d = rng.choice([d for d in held if int(d["id"]) not in nacked])
                assert c.execute_command("NACK", h, d["tag"]) == 1
                held.remove(d)
                nacked.add(int(d["id"]))
                returned.add(int(d["id"]))
            elif move == "pull back":
                back = take(c, h, 20)  # all of them, however many were returned
                assert {int(d["id"]) for d in back} == returned
                held, returned = back, set()
            elif move != "nack one":
                some = rng.sample(held, 1 if move == "ack one" else min(len(held), rng.randint(2, 4)))
                assert c.execute_command("ACK", h, *[d["tag"] for d in some]) == len(some)
                held = [d for d in held if d not in some]
            low_held = min((int(d["id"]) for d in held), default=None)
            unsettled = {int(d["id"]) for d in held} | returned
            kept = list(range(min(unsettled), 13)) if unsettled else []
            assert held_low_and_log(direct) == (low_held, kept), move
        assert direct.exists(ORDERS.held) == 0


@pytest.mark.parametrize("mix", ["first deliveries", "a redelivery among them", "QoS 0 among them"])
def test_a_pulls_journal_entry_is_the_batch_of_its_deliveries_whichever_way_it_was_written(w, direct, mix):
    # lease_out writes the usual call's entry (all QoS 1, all first deliveries) directly, the rest through
    # journal_batch's lists: both must read as the records' codec writes the pull's deliveries
    c = client(w.port, 2, "journaled")
    h = join(c, "GROUP", "g", "LOCK", 60_000)
    c.execute_command("MPUB", "orders", 3, "a", "b", "c")
    c.execute_command("MPUB", "orders", 2, "d", "e", *(["QOS", 0] if mix == "QoS 0 among them" else []))
    if mix == "a redelivery among them":
        (first,) = take(c, h, 1)
        assert c.execute_command("NACK", h, first["tag"]) == 1
    got = take(c, h, 5)
    assert len(got) == 5
    raw = direct.lrange(ORDERS.journal, -1, -1)[0]
    entry = JournalBatch.decode(raw)
    assert entry.encode() == raw == JournalBatch(
        entry.ms, "out", "g", "journaled", tuple(int(d["id"]) for d in got), tuple(d["tag"] for d in got), 0,
        tuple(str(d["deliveries"]) for d in got)).encode()


def test_a_nack_that_took_effect_is_answered_even_when_the_dispatch_after_it_fails(redis_url, monkeypatch):
    # a NACK of a push group's member dispatches what it returned (fences/leases.py _refill); that second
    # call failing (Redis failing over) must not turn the first one's answer into an error
    from redis.exceptions import ConnectionError as RedisConnectionError

    from fencemq.config import Config
    from fencemq.fences.core import Core
    from fencemq.model.handles import Handle

    async def main() -> None:
        r = helpers.direct_async(redis_url)
        q = Core(r, Config(redis_url=redis_url))
        try:
            a = Handle.decode((await q.subscriptions.subscribe("ca", "jobs", group="g", mode="shared",
                                                                capacity=4)).handle)
            await q.publishing.publish("jobs", [b"x"])
            (d,) = (await q.leases.pull(a, 1)).deliveries

            async def dark(*_args: object) -> None:
                raise RedisConnectionError("the primary is gone")

            monkeypatch.setattr(q.mailboxes, "dispatch", dark)
            assert await q.leases.nack(a, [d.tag], release=True) == 1
            assert await r.zcard(q.keys.queue(a.queue).ready) == 1  # back with the group, for the next dispatch
        finally:
            await r.aclose()

    asyncio.run(main())


def test_a_nack_learns_the_queues_push_members_from_its_own_call_and_reads_them_in_no_round_trip_after(
        redis_url, monkeypatch):
    # a push group's members take only from their mailboxes, so a NACK's returned message is dispatched
    # to them at once; the members come back with the NACK (nack.lua), for a pull group as none at all
    from fencemq.config import Config
    from fencemq.fences.core import Core
    from fencemq.model.handles import Handle

    async def main() -> None:
        r = helpers.direct_async(redis_url)
        q = Core(r, Config(redis_url=redis_url))
        reads: list[object] = []
        push_members = q.mailboxes.push_members

        async def counted(ref):
            reads.append(ref)
            return await push_members(ref)

        try:
            pushed = Handle.decode((await q.subscriptions.subscribe("ca", "jobs", group="g", mode="shared",
                                                                     capacity=4)).handle)
            pulled = Handle.decode((await q.subscriptions.subscribe("cb", "work", group="p")).handle)
            await q.publishing.publish("jobs", [b"x"])
            await q.publishing.publish("work", [b"y"])
            (d,) = (await q.leases.pull(pushed, 1)).deliveries
            (e,) = (await q.leases.pull(pulled, 1)).deliveries
            monkeypatch.setattr(q.mailboxes, "push_members", counted)
            assert await q.leases.nack(pushed, [d.tag]) == 1
            mailbox = q.keys.queue(pushed.queue).mailbox(pushed.group, pushed.member)
            assert await r.llen(mailbox) == 1, "dispatched to the push member at once"
            assert await q.leases.nack(pulled, [e.tag]) == 1
            assert await r.zcard(q.keys.queue(pulled.queue).ready) == 1, "back with the pull group"
            assert reads == [], "the push members were read again after the NACK"
        finally:
            await r.aclose()

    asyncio.run(main())


# -- suspicion -------------------------------------------------------------------------------------


@pytest.mark.parametrize("verb", ["ACK", "NACK", "RENEW"])
def test_a_suspected_consumer_gets_nothing_until_it_settles_or_renews_even_only_an_expired_tag(w, verb):
    c = client(w.port, 2, "sleepy")
    c.execute_command("MPUB", "orders", 3, "a", "b", "c")
    h = join(c, "GROUP", "g", "LOCK", 200)
    (d,) = take(c, h, 1)
    wait_expired(c, h, [d["tag"]])
    assert take(c, h) == []  # three messages are ready, none for a suspected member
    t0 = time.monotonic()
    assert take(c, h, 10, "BLOCK", 300) == []  # fenced: it waits like any long poll instead of spinning
    assert time.monotonic() - t0 >= 0.25
    assert c.execute_command(verb, h, d["tag"]) == 0  # settles nothing, but proves it alive
    got = take(c, h)
    assert payloads(got) == ["a", "b", "c"]
    assert got[0]["deliveries"] == 2


def test_a_timed_out_consumer_gets_a_notice_listing_exactly_its_own_expired_tags(w):
    a, b = client(w.port, 2, "a"), client(w.port, 2, "b")
    a.execute_command("MPUB", "orders", 5, *"12345")
    ha = join(a, "GROUP", "g", "LOCK", 300)
    hb = join(b, "GROUP", "g", "LOCK", 300)
    mine = take(a, ha, 3)
    theirs = take(b, hb, 2)
    assert a.execute_command("ACK", ha, mine[1]["tag"]) == 1  # settled in time: not in the notice
    expired_a = [mine[0]["tag"], mine[2]["tag"]]
    assert b.execute_command("RENEW", hb, theirs[0]["tag"], "LOCK", 10_000) == 1
    notice = wait_expired(a, ha, expired_a)
    assert notice["topic"] == "orders" and "replaced_by" not in notice
    notice_b = wait_expired(b, hb, [theirs[1]["tag"]])
    assert notice_b["tags"] == [theirs[1]["tag"]]
    time.sleep(0.3)
    assert notices_of(a) == [] and notices_of(b) == []  # drained, and nothing more expired


def test_the_sdk_gets_the_message_timeout_notice_pushed_over_resp3(w):
    async def main() -> None:
        async with await Client.connect(f"redis://127.0.0.1:{w.port}", client_id="pushed", protocol=3) as c:
            await c.mpublish("orders", [b"a", b"b"])
            sub = await c.subscribe("orders", group="g", lock_ms=200)
            got = await sub.pull(2)
            notices = c.notices()
            notice = await asyncio.wait_for(anext(notices), 3)
            assert notice["type"] == "message_timeout" and notice["handle"] == sub.handle
            assert sorted(notice["tags"]) == sorted(d.tag for d in got) and notice["topic"] == "orders"
            # suspected: told, the SDK renews the expired tags by itself (settling nothing) to show life
            assert [d.deliveries for d in await sub.pull(2, block_ms=2000)] == [2, 2]
            assert await sub.renew(*got) == 0

    asyncio.run(asyncio.wait_for(main(), 20))


# -- disconnects and cancellation --------------------------------------------------------------------


def test_a_dropped_connection_returns_its_leases_at_their_deadline_and_a_quit_one_at_once(redis_url, direct):
    with worker(redis_url, sweep_interval_ms=100, session_lease_ms=5000) as w:
        fresh = client(w.port, 2, "fresh")
        fresh.execute_command("MPUB", "orders", 2, "dropped", "quitted")
        hf = join(fresh, "GROUP", "g")
        with RespConn(w.port) as dropper, RespConn(w.port) as quitter:
            dropper.hello(2, "dropper")
            quitter.hello(2, "quitter")
            hd = as_map(dropper.call("SUB", "orders", "GROUP", "g", "LOCK", 900))["handle"]
            hq = as_map(quitter.call("SUB", "orders", "GROUP", "g", "LOCK", 60_000))["handle"]
            (dd,) = deliveries(dropper.call("PULL", hd))
            (dq,) = deliveries(quitter.call("PULL", hq))
            deadline = direct.zscore(ORDERS.deadlines, dd["tag"])
            dropper.close()  # no QUIT: the named session lives on for 5 s
            assert quitter.call("QUIT") == "OK"
            (first,) = wait_for(lambda: take(fresh, hf), timeout=1, what="the quitting session's lease")
            assert first["id"] == dq["id"] and redis_ms(direct) < deadline  # long before the dropper's
            (second,) = take(fresh, hf, 10, "BLOCK", 3000)
            late = redis_ms(direct) - deadline
            print(f"a dropped connection's lease came back {late:.0f} ms after its deadline")
            assert second["id"] == dd["id"] and 0 <= late < 1000
            assert direct.zscore(SESSIONS, "dropper") is not None  # its session did not end: the lease did
            assert direct.zscore(SESSIONS, "quitter") is None


def test_unsub_with_pending_checkouts_returns_all_of_them_in_id_order_and_removes_the_member(w, direct):
    leaving, staying = client(w.port, 2, "leaving"), client(w.port, 2, "staying")
    leaving.execute_command("MPUB", "orders", 6, *"abcdef")
    hl = join(leaving, "GROUP", "g", "LOCK", 60_000)
    hs = join(staying, "GROUP", "g")
    held = take(leaving, hl, 5)
    assert leaving.execute_command("ACK", hl, held[1]["tag"], held[3]["tag"]) == 2
    assert leaving.execute_command("UNSUB", hl) == b"OK"
    assert len(checkout_records(direct, ORDERS)) == 0
    got = take(staying, hs)
    assert payloads(got) == ["a", "c", "e", "f"]
    assert [d["deliveries"] for d in got] == [2, 2, 2, 1]
    assert leaving.execute_command("ACK", hl, *[d["tag"] for d in held]) == 0
    with pytest.raises(redis.ResponseError) as info:
        leaving.execute_command("PULL", hl)
    assert helpers.error_code(info.value) == "NOTFOUND"


# -- single-active groups ------------------------------------------------------------------------------

ARRIVALS = ["zed", "amy", "max"]  # arrival order is not name order


def single_active(port: int, lock_ms: int = 300) -> list[tuple[redis.Redis, str]]:
    members = []
    for name in ARRIVALS:
        c = client(port, 2, name)
        members.append((c, join(c, "GROUP", "sa", "MODE", "single-active", "LOCK", lock_ms)))
    return members


def test_only_the_first_single_active_member_in_arrival_order_gets_messages(w):
    (zed, hz), (amy, ha), (mx, hm) = single_active(w.port)
    zed.execute_command("MPUB", "orders", 3, *"abc")
    assert take(amy, ha) == [] and take(mx, hm) == []
    assert payloads(take(zed, hz, 2)) == ["a", "b"]
    assert take(amy, ha) == [] and take(mx, hm) == []
    assert payloads(take(zed, hz)) == ["c"]


def test_a_timed_out_active_member_hands_all_its_pending_to_the_next_member_in_arrival_order(w, direct):
    (zed, hz), (amy, ha), (mx, hm) = single_active(w.port, lock_ms=600)
    zed.execute_command("MPUB", "orders", 5, *"abcde")
    early = take(zed, hz, 2)
    time.sleep(0.25)
    later = take(zed, hz, 2)  # not expired when the first batch is: returned all the same
    notice = wait_expired(zed, hz, [d["tag"] for d in early], at_most=[d["tag"] for d in early + later])
    assert notice["replaced_by"] == "amy"
    assert len(checkout_records(direct, ORDERS)) == 0
    assert take(mx, hm) == [] and take(zed, hz) == []
    got = take(amy, ha, 10)
    assert payloads(got) == ["a", "b", "c", "d", "e"]
    assert [d["deliveries"] for d in got] == [2, 2, 2, 2, 1]
    # amy times out in turn: max is next; zed, still suspected, is skipped
    assert wait_expired(amy, ha, [d["tag"] for d in got])["replaced_by"] == "max"
    assert payloads(take(mx, hm)) == ["a", "b", "c", "d", "e"]
    assert take(amy, ha) == []
    # zed proves it is alive with its stale tags: no longer suspected, but max stays active
    assert zed.execute_command("ACK", hz, *[d["tag"] for d in early + later]) == 0
    zed.execute_command("PUB", "orders", "f")
    assert take(zed, hz) == []
    assert payloads(take(mx, hm)) == ["f"]


def test_when_the_active_member_unsubscribes_the_next_takes_over_its_pending(w):
    (zed, hz), (amy, ha), (mx, hm) = single_active(w.port, lock_ms=60_000)
    zed.execute_command("MPUB", "orders", 3, *"abc")
    held = take(zed, hz, 2)
    zed.execute_command("UNSUB", hz)
    assert take(mx, hm) == []
    got = take(amy, ha)
    assert payloads(got) == ["a", "b", "c"] and [d["deliveries"] for d in got] == [2, 2, 1]
    assert zed.execute_command("ACK", hz, *[d["tag"] for d in held]) == 0


# One server only, for now: on a 3-master Cluster the member is marked offline ~0.5 s after its
# connection closes (the worker's unfollow of the session's sharded channel and the session's leave
# fence took ~100 and ~220 ms there, measured 2026-11-27), so the takeover waits for the session lease.
@pytest.mark.standalone
def test_when_the_active_member_disconnects_a_connected_member_takes_over_with_its_pending_in_order(redis_url):
    with worker(redis_url, sweep_interval_ms=100, session_lease_ms=600) as w:
        active = RespConn(w.port)
        active.hello(2, "zed")
        hz = as_map(active.call("SUB", "orders", "GROUP", "sa", "MODE", "single-active", "LOCK", 60_000))["handle"]
        amy = client(w.port, 2, "amy")
        ha = join(amy, "GROUP", "sa", "MODE", "single-active")
        amy.execute_command("MPUB", "orders", 3, *"abc")
        assert len(deliveries(active.call("PULL", hz, "COUNT", 2))) == 2
        active.close()
        gone = time.monotonic()
        # No stall behind a dropped connection, though zed's session still lives:
        # amy takes over at once, zed's pending first, in order.
        got = wait_for(lambda: take(amy, ha), timeout=3, what="amy to take over")
        waited = time.monotonic() - gone
        print(f"single-active takeover after a disconnect: {waited * 1000:.0f} ms (session lease 600 ms)")
        assert payloads(got) == ["a", "b", "c"] and [d["deliveries"] for d in got] == [2, 2, 1]
        assert waited < 0.6


# One server only, for now: on a 3-master Cluster the member is marked offline ~0.5 s after its
# connection closes (the worker's unfollow of the session's sharded channel and the session's leave
# fence took ~100 and ~220 ms there, measured 2026-11-27), so the takeover waits for the session lease.
@pytest.mark.standalone
def test_a_timed_out_active_member_hands_over_to_a_connected_member_not_to_one_whose_connection_dropped(redis_url):
    with worker(redis_url, sweep_interval_ms=100, session_lease_ms=4000) as w:
        zed, mx = client(w.port, 2, "zed"), client(w.port, 2, "max")
        hz = join(zed, "GROUP", "sa", "MODE", "single-active", "LOCK", 300)
        with RespConn(w.port) as amy:
            amy.hello(2, "amy")
            amy.call("SUB", "orders", "GROUP", "sa", "MODE", "single-active")
        hm = join(mx, "GROUP", "sa", "MODE", "single-active")  # amy is gone (her session lives on)
        zed.execute_command("MPUB", "orders", 2, "a", "b")
        (d,) = take(zed, hz, 1)
        notice = wait_expired(zed, hz, [d["tag"]])
        assert notice.get("replaced_by") == "max"
        assert payloads(wait_for(lambda: take(mx, hm), timeout=1.5, what="max to take over")) == ["a", "b"]


# -- every member suspected: no deadlock ---------------------------------------------------------------


def all_suspected(port: int, mode: str) -> list[tuple[redis.Redis, str, list[str]]]:
    """Two members of group g, both suspected; a, b, c ready again in the queue."""
    first, second = client(port, 2, "first"), client(port, 2, "second")
    h1 = join(first, "GROUP", "g", "MODE", mode, "LOCK", 200)
    h2 = join(second, "GROUP", "g", "MODE", mode, "LOCK", 200)
    first.execute_command("MPUB", "orders", 3, *"abc")
    if mode == "shared":
        tags1 = [d["tag"] for d in take(first, h1, 1)]
        tags2 = [d["tag"] for d in take(second, h2, 1)]
        wait_expired(first, h1, tags1)
        wait_expired(second, h2, tags2)
    else:  # the active one times out, its successor takes over and times out too
        tags1 = [d["tag"] for d in take(first, h1, 1)]
        assert wait_expired(first, h1, tags1)["replaced_by"] == "second"
        tags2 = [d["tag"] for d in take(second, h2, 1)]
        assert wait_expired(second, h2, tags2).get("replaced_by") is None  # nobody left to take over
    assert take(first, h1) == [] and take(second, h2) == []
    return [(first, h1, tags1), (second, h2, tags2)]


@pytest.mark.parametrize("mode", ["shared", "single-active"])
@pytest.mark.parametrize("recovery", ["RENEW", "ACK", "NACK", "SUB again", "new member"])
def test_a_group_whose_members_are_all_suspected_resumes_when_one_shows_it_is_alive(w, mode, recovery):
    (first, h1, tags1), (second, h2, _) = all_suspected(w.port, mode)
    if recovery == "new member":
        c = client(w.port, 2, "third")
        h = join(c, "GROUP", "g", "MODE", mode)
    elif recovery == "SUB again":
        c, h = first, join(first, "GROUP", "g", "MODE", mode, "LOCK", 200)
    else:
        c, h = first, h1
        assert first.execute_command(recovery, h1, *tags1) == 0
    got = take(c, h)
    assert payloads(got) == ["a", "b", "c"]
    assert got[0]["deliveries"] >= 2 and got[2]["deliveries"] == 1
    assert take(second, h2) == []  # still suspected (and in single-active, standing by)


# -- limits and accounting -----------------------------------------------------------------------------


def test_a_lock_longer_than_max_lock_ms_is_badarg_on_sub_and_on_renew(redis_url):
    with worker(redis_url, max_lock_ms=1000) as w:
        c = client(w.port, 2, "c")
        with pytest.raises(redis.ResponseError) as info:
            c.execute_command("SUB", "orders", "GROUP", "g", "LOCK", 1001)
        assert helpers.error_code(info.value) == "BADARG" and "1000" in str(info.value)
        h = join(c, "GROUP", "g", "LOCK", 1000)  # at the maximum is fine
        c.execute_command("PUB", "orders", "x")
        (d,) = take(c, h)
        with pytest.raises(redis.ResponseError) as info:
            c.execute_command("RENEW", h, d["tag"], "LOCK", 1001)
        assert helpers.error_code(info.value) == "BADARG"
        assert c.execute_command("RENEW", h, d["tag"], "LOCK", 1000) == 1


def test_timeouts_never_push_a_message_toward_the_dead_letter_limit(redis_url, direct):
    with worker(redis_url, sweep_interval_ms=100, max_failures=2) as w:
        c = client(w.port, 2, "flaky")
        c.execute_command("PUB", "orders", "x")
        h = join(c, "GROUP", "g", "LOCK", 200)
        for n in range(1, 4):
            (d,) = take(c, h)
            assert d["deliveries"] == n
            wait_expired(c, h, [d["tag"]])
            assert c.execute_command("RENEW", h, d["tag"]) == 0  # clears the suspicion
        (d,) = take(c, h)
        assert d["deliveries"] == 4 and direct.llen(ORDERS.dead) == 0
        # the limit itself is in force: two NACKs dead-letter it
        assert c.execute_command("NACK", h, d["tag"]) == 1
        (d,) = take(c, h)
        assert d["deliveries"] == 5
        assert c.execute_command("NACK", h, d["tag"]) == 1
        assert take(c, h) == [] and direct.llen(ORDERS.dead) == 1


def test_an_expired_message_comes_back_in_its_place_ahead_of_newer_messages(w):
    slow, steady = client(w.port, 2, "slow"), client(w.port, 2, "steady")
    steady.execute_command("MPUB", "orders", 5, *"12345")
    hs = join(slow, "GROUP", "g", "LOCK", 200)
    ht = join(steady, "GROUP", "g", "LOCK", 60_000)
    assert payloads(take(steady, ht, 1)) == ["1"]
    (two,) = take(slow, hs, 1)
    assert two["payload"] == "2"
    wait_expired(slow, hs, [two["tag"]])
    steady.execute_command("MPUB", "orders", 2, "6", "7")
    got = take(steady, ht)
    assert payloads(got) == ["2", "3", "4", "5", "6", "7"]
    assert [int(d["id"]) for d in got] == sorted(int(d["id"]) for d in got)


def test_prometheus_counts_lease_timeouts_suspicions_and_renewals(w):
    names = ["fencemq_lease_timeouts_total", "fencemq_suspicions_total", "fencemq_renewals_total"]
    before = {n: sample(n) for n in names}
    a, b = client(w.port, 2, "a"), client(w.port, 2, "b")
    a.execute_command("MPUB", "orders", 4, *"wxyz")
    ha = join(a, "GROUP", "g", "LOCK", 200)
    hb = join(b, "GROUP", "g", "LOCK", 200)
    got_a, got_b = take(a, ha, 2), take(b, hb, 2)
    assert b.execute_command("RENEW", hb, *[d["tag"] for d in got_b], "LOCK", 10_000) == 2
    wait_expired(a, ha, [d["tag"] for d in got_a])
    after = {n: sample(n) for n in names}
    assert after["fencemq_lease_timeouts_total"] - before["fencemq_lease_timeouts_total"] == 2
    assert after["fencemq_suspicions_total"] - before["fencemq_suspicions_total"] == 1
    assert after["fencemq_renewals_total"] - before["fencemq_renewals_total"] == 2


def test_ids_and_tags_stay_whole_and_in_order_across_thousands_and_the_journal_names_each_once(w, direct):
    """The fences make an id's and a tag's text once per thousand (lua/lib/base.lua, int_strs): every
    id published across 999 → 1000 → 1999 → 2000 comes back whole, and one journal entry per call
    names each message once."""
    with client(w.port, name="ids") as c:
        h = join(c, "GROUP", "g")
        ids = []
        for start in range(0, 2100, 700):
            reply = c.execute_command("MPUB", "orders", 700, *[f"m{i}" for i in range(start, start + 700)])
            ids += [i.decode() for i in reply]
        assert ids == [str(i) for i in range(1, 2101)]
        got = []
        while len(got) < 2100:
            batch = take(c, h, 1000)
            assert batch
            got += batch
            assert c.execute_command("ACK", h, *[d["tag"] for d in batch]) == len(batch)
        assert [d["id"] for d in got] == ids and payloads(got) == [f"m{i}" for i in range(2100)]
        tags = [int(d["tag"]) for d in got]
        assert tags == sorted(tags) and len(set(tags)) == len(tags)
    events = [e for raw in direct.lrange(ORDERS.journal, 0, -1) for e in journal_events(raw)]
    for kind in ("pub", "out", "ack"):
        assert sorted(e.id for e in events if e.event == kind) == list(range(1, 2101)), kind
    for kind in ("out", "ack"):
        assert sorted(int(e.tag) for e in events if e.event == kind) == tags, kind
    assert direct.llen(ORDERS.journal) < 20, "one entry per call, not one per message"


# -- ACK pipelined with PULL (the consume loop): one round trip to Redis for both ------------------


def _ack_then_pull(c, handle: str, tags: list[str], *pull_opts) -> list:
    pipe = c.pipeline(transaction=False)
    pipe.execute_command("ACK", handle, *tags)
    pipe.execute_command("PULL", handle, *pull_opts)
    return pipe.execute(raise_on_error=False)


def test_an_ack_pipelined_with_a_pull_settles_first_and_the_pull_gets_the_next_batch(w, direct, monkeypatch):
    leases, paired = w.worker.core.leases, []
    ack_then_pull = leases.ack_then_pull

    async def counted(*args, **kwargs):
        paired.append(args[0])
        return await ack_then_pull(*args, **kwargs)

    monkeypatch.setattr(leases, "ack_then_pull", counted)
    c = client(w.port, 2, "c")
    h = join(c, "GROUP", "g")
    c.execute_command("MPUB", "orders", 6, *[f"m{i}" for i in range(6)])
    first = take(c, h, 3)
    acked, reply = _ack_then_pull(c, h, [d["tag"] for d in first], "COUNT", 3)
    assert acked == 3 and payloads(deliveries(reply)) == ["m3", "m4", "m5"]
    assert len(checkout_records(direct, KEYS.queue(QueueRef("orders")))) == 3, "the acked three are gone, three held"
    acked, reply = _ack_then_pull(c, h, [d["tag"] for d in deliveries(reply)], "COUNT", 3)
    assert acked == 3 and deliveries(reply) == []
    assert len(paired) == 2, "each pair ran as one round trip"


def test_a_refused_ack_in_the_pair_still_lets_the_pull_run_as_one_after_the_other_would(w):
    c = client(w.port, 2, "c")
    h = join(c, "GROUP", "g")
    c.execute_command("MPUB", "orders", 2, "a", "b")
    (d,) = take(c, h, 1)
    stale, reply = _ack_then_pull(c, h, ["123456"], "COUNT", 5)  # a tag never handed out: settles nothing
    assert stale == 0 and payloads(deliveries(reply)) == ["b"]
    too_many, reply = _ack_then_pull(c, h, [str(i) for i in range(1001)], "COUNT", 5)
    assert isinstance(too_many, redis.ResponseError) and "LIMIT" in str(too_many) and deliveries(reply) == []
    acked, bad_count = _ack_then_pull(c, h, [d["tag"]], "COUNT", 0)  # refused before anything ran
    assert acked == 1 and isinstance(bad_count, redis.ResponseError) and "BADARG" in str(bad_count)


def test_a_pipelined_blocking_pull_waits_after_its_ack_and_wakes_on_publish(w):
    c, p = client(w.port, 2, "c"), client(w.port, 2, "p")
    h = join(c, "GROUP", "g")
    p.execute_command("PUB", "orders", "one")
    (d,) = take(c, h, 1)
    threading.Timer(0.3, lambda: p.execute_command("PUB", "orders", "two")).start()
    started = time.monotonic()
    acked, reply = _ack_then_pull(c, h, [d["tag"]], "COUNT", 10, "BLOCK", 5000)
    assert acked == 1 and payloads(deliveries(reply)) == ["two"]
    assert 0.2 < time.monotonic() - started < 4


def test_a_pipelined_blocking_pull_registers_its_waiter_with_the_ack_and_is_handed_the_next_publish(w, monkeypatch):
    leases, looks, handed = w.worker.core.leases, [], []
    pull, hand = leases.pull, leases.handed

    async def counted_pull(handle, count=1, look=None):
        looks.append(look.kind if look else "")
        return await pull(handle, count, look)

    async def counted_hand(handle, reply):
        handed.append(handle)
        return await hand(handle, reply)

    monkeypatch.setattr(leases, "pull", counted_pull)
    monkeypatch.setattr(leases, "handed", counted_hand)
    c, p = client(w.port, 2, "c"), client(w.port, 2, "p")
    h = join(c, "GROUP", "g")
    p.execute_command("PUB", "orders", "one")
    (d,) = take(c, h, 1)
    looks.clear()
    threading.Timer(0.3, lambda: p.execute_command("PUB", "orders", "two")).start()
    acked, reply = _ack_then_pull(c, h, [d["tag"]], "COUNT", 10, "BLOCK", 5000)
    assert acked == 1 and payloads(deliveries(reply)) == ["two"]
    assert looks == [], "the pair's PULL was the first look: no look of its own before the wait"
    assert len(handed) == 1, "the publish handed its message to the waiter the pair registered"


def test_the_pair_runs_each_fence_once_when_the_script_cache_was_flushed(w, direct):
    c = client(w.port, 2, "c")
    h = join(c, "GROUP", "g")
    c.execute_command("MPUB", "orders", 4, "a", "b", "c", "d")
    got = take(c, h, 2)
    direct.script_flush()
    acked, reply = _ack_then_pull(c, h, [d["tag"] for d in got], "COUNT", 2)
    assert acked == 2 and payloads(deliveries(reply)) == ["c", "d"], "NOSCRIPT: the ACK not run twice"


def test_the_lease_schedule_writes_of_a_burst_of_pulls_go_out_together_and_list_every_queue(w, direct, monkeypatch):
    ctx = w.worker.core.ctx
    writes = []
    set_scores = ctx.set_scores

    schedules = {ctx.shards.keys_of(shard)[0] for shard in ctx.shards.all()}  # (one; a Cluster's 16 shards)

    async def counted(index, scores, mode=""):
        if index in schedules:
            writes.append(dict(scores))
        return await set_scores(index, scores, mode)

    monkeypatch.setattr(ctx, "set_scores", counted)
    c = client(w.port, 2, "c")
    topics = [f"burst{i}" for i in range(20)]
    handles = []
    for t in topics:
        c.execute_command("PUB", t, "m")
        handles.append(as_map(c.execute_command("SUB", t, "GROUP", "g", "LOCK", 60_000))["handle"])
    writes.clear()
    pipe = c.pipeline(transaction=False)
    for h in handles:
        pipe.execute_command("PULL", h)
    assert all(len(deliveries(r)) == 1 for r in pipe.execute())
    wait_for(lambda: sum(len(x) for x in writes) >= 20, what="the schedule writes")
    if not in_cluster_mode():  # (a Cluster's schedule is split by master: one ZADD per shard at least)
        assert len(writes) < 20, "one ZADD per pull: nothing gathered"
    written = {qid: due for batch in writes for qid, due in batch.items()}
    schedule = {k.decode(): v for key in schedules for k, v in direct.zrange(key, 0, -1, withscores=True)}
    now = redis_ms(direct)
    for t in topics:
        qid = QueueRef(t).qid
        assert now + 50_000 < written[qid] <= now + 60_000, "each lease's deadline was written"
        assert schedule[qid] <= written[qid], "swept no later than its lease is due"


def test_a_long_poll_whose_block_time_ends_during_a_look_still_hands_out_what_the_look_checked_out(w, monkeypatch):
    leases = w.worker.core.leases
    pull = leases.pull

    async def slow_after_checkout(handle, count=1, look=None):
        result = await pull(handle, count, look)
        if result.deliveries:
            await anyio.sleep(0.4)  # Redis answered; the reply is slow to come back (a loaded worker)
        return result

    monkeypatch.setattr(leases, "pull", slow_after_checkout)
    # the publish wakes the long poll, which looks (no hand-off: the worker never learns a poll waits)
    monkeypatch.setattr(w.worker.core.ctx, "note_waiting", lambda qid: None)
    c, p = client(w.port, 2, "c"), client(w.port, 2, "p")
    h = join(c, "GROUP", "g")
    threading.Timer(0.1, lambda: p.execute_command("PUB", "orders", "late")).start()
    got = take(c, h, 10, "BLOCK", 300)  # its BLOCK time ends while the look that took "late" returns
    assert payloads(got) == ["late"], "checked out to a reply that was never sent"


def test_a_pull_refused_while_its_pipelined_ack_waited_in_the_long_poll_leaves_the_acks_reply_alone(w):
    c, other, p = client(w.port, 2, "c"), client(w.port, 2, "c"), client(w.port, 2, "p")
    h = join(c, "GROUP", "g")
    p.execute_command("PUB", "orders", "one")
    (d,) = take(c, h, 1)
    threading.Timer(0.3, lambda: other.execute_command("UNSUB", h)).start()  # the same session leaves meanwhile
    acked, refused = _ack_then_pull(c, h, [d["tag"]], "COUNT", 10, "BLOCK", 3000)
    assert acked == 1, "the ACK ran once: its reply is its own"
    assert isinstance(refused, redis.ResponseError) and "NOTFOUND" in str(refused)


def test_a_blocking_pull_whose_member_leaves_meanwhile_is_told_notfound_and_keeps_its_connection(w):
    c, other = client(w.port, 2, "c"), client(w.port, 2, "c")
    h = join(c, "GROUP", "g")
    threading.Timer(0.3, lambda: other.execute_command("UNSUB", h)).start()
    with pytest.raises(redis.ResponseError, match="NOTFOUND"):
        c.execute_command("PULL", h, "BLOCK", 3000)
    assert c.execute_command("PING") in (b"PONG", "PONG", True), "the connection was closed"
