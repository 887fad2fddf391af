"""The seams an outside audit found open (issue #13), each closed, tried the way a hostile or unlucky client would.

Every test here failed on the code before the seal; the hole it closes is in its docstring.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import redis

from fencemq.errors import BadArgument
from fencemq.fences.leases import RENEW
from fencemq.model.keys import Keyspace, QueueRef
from fencemq.model.handles import Handle
from tests.helpers import direct, direct_async
from tests.helpers import as_map, client, deliveries, error_code, signer, text, worker

KEYS = Keyspace("fmq")


@pytest.fixture
def w(redis_url):
    with worker(redis_url) as started:
        yield started


@pytest.fixture
def r(redis_url) -> redis.Redis:
    return direct(redis_url)


def sub(c, *args: Any) -> str:
    return as_map(c.execute_command("SUB", *args))["handle"]


def pull(c, handle: str, *opts: Any) -> list[dict[str, Any]]:
    return deliveries(c.execute_command("PULL", handle, *opts))


def take(c, handle: str, *opts: Any) -> Any:
    got = c.execute_command("TAKE", handle, *opts)
    if got is None or text(got) == "EOS":
        return None if got is None else "EOS"
    return as_map(got)


def refused(code: str, c, *command: Any) -> str:
    with pytest.raises(redis.exceptions.ResponseError) as info:
        c.execute_command(*command)
    assert error_code(info.value) == code, str(info.value)
    return str(info.value)


# what the health watcher of a running worker rewrites on its own (server/health_watch.py, ops/history.py)
HEALTH_WATCH = {k.encode() for k in (KEYS.redis_nodes, KEYS.worker_figures, KEYS.health_watcher, KEYS.alarms)}


def dump(r: redis.Redis) -> dict[bytes, Any]:
    """Every key's value, but the ones a worker's timers rewrite on their own."""
    out = {}
    for key in r.scan_iter(count=1000):
        if key in (KEYS.workers.encode(), KEYS.sessions.encode(), KEYS.schedule.encode()) or \
                key in HEALTH_WATCH or key.startswith(b"fmq:history:"):
            continue
        kind = r.type(key)
        out[key] = {b"hash": r.hgetall, b"list": lambda k: r.lrange(k, 0, -1), b"set": r.smembers,
                    b"zset": lambda k: r.zrange(k, 0, -1, withscores=True), b"string": r.get}[kind](key)
    return out


# -- 1. client numbers ----------------------------------------------------------------------


def test_hole_1_a_huge_epoch_is_stored_whole_so_its_checkouts_settle_and_expire(redis_url, r) -> None:
    """SUB … EPOCH 10^14 made Lua write 1e+14: ACK settled nothing, the sweep lost the message."""
    with worker(redis_url, sweep_interval_ms=50) as w:
        a, b = client(w.port, 2, "a"), client(w.port, 2, "b")
        a.execute_command("PUB", "orders", "x")
        ha = sub(a, "orders", "GROUP", "g", "EPOCH", 10**14, "LOCK", 150)
        (d,) = pull(a, ha)
        assert int(d["epoch"]) == 10**14
        record = r.hget(KEYS.queue(QueueRef("orders")).checkouts, d["tag"])
        assert b"\x00100000000000000\x00" in record and b"e+" not in record
        hb = sub(b, "orders", "GROUP", "g")
        deadline = time.monotonic() + 3
        again: list = []
        while not again and time.monotonic() < deadline:
            again = pull(b, hb)
            time.sleep(0.05)
        assert [x["id"] for x in again] == ["1"], "the sweep returned the message to the group"
        assert b.execute_command("ACK", hb, again[0]["tag"]) == 1


@pytest.mark.parametrize("epoch", [2**53, 2**63 - 1, 2**63, -1, "1e5", "+5", "5_000"])
def test_hole_1_an_epoch_out_of_range_is_badarg_and_changes_nothing(w, r, epoch) -> None:
    """EPOCH >= 2^63 - 1 was stored as 9.22e+18 and broke every later SEEK; a SUB failed half-applied."""
    a = client(w.port, 2, "a")
    a.execute_command("PUB", "orders", "x")
    h = sub(a, "orders", "GROUP", "g")
    assert len(pull(a, h)) == 1  # an outstanding checkout, as in the report
    before = dump(r)
    message = refused("BADARG", a, "SUB", "orders", "GROUP", "g", "EPOCH", epoch)
    assert "EPOCH" in message and str(2**53 - 1) in message
    assert dump(r) == before
    assert int(a.execute_command("SEEK", h, "EARLIEST")) == 1


def test_hole_1_a_fence_refuses_a_number_that_is_not_a_decimal_integer_before_writing(redis_url, r) -> None:
    """Lua's tonumber takes 1e3 and 0x10: the fence's own check must be as strict as the wire's."""
    import asyncio

    from fencemq.config import Config
    from fencemq.fences.core import Core

    async def main() -> None:
        async_r = direct_async(redis_url)
        core = Core(async_r, Config())
        await core.publishing.publish("orders", [b"x"])
        h = Handle.decode((await core.subscriptions.subscribe("a", "orders", group="g")).handle)
        (d,) = (await core.leases.pull(h, 1)).deliveries
        k = core.keys.queue(h.queue)
        before = dump(r)
        for bad in ("1e3", "0x10", " 5", "9007199254740992"):
            with pytest.raises(BadArgument):
                await core.fences.run(RENEW, k, group="g", member="a", lock_ms=bad, default_lock_ms=1000,
                                      args_rest=[d.tag])
        assert dump(r) == before
        await async_r.aclose()

    asyncio.run(main())


# -- 2. SEEK is a member's act -------------------------------------------------------------------


def test_hole_2_a_handle_built_for_a_group_never_joined_cannot_seek_it(w) -> None:
    """A handle is readable: any client could build one naming itself in a victim's group and SEEK LATEST."""
    victim, mallory = client(w.port, 2, "victim"), client(w.port, 2, "mallory")
    victim.execute_command("MPUB", "orders", 3, "a", "b", "c")
    hv = sub(victim, "orders", "GROUP", "billing")
    for group, queue in (("billing", QueueRef("orders")), ("~victim", QueueRef("orders"))):
        forged = Handle(queue, group, "mallory").encode()
        refused("NOPERM", mallory, "SEEK", forged, "LATEST")  # a worker issued no such handle
        # and were it signed (a leaked secret), the fence still refuses it: mallory never joined
        refused("NOTFOUND", mallory, "SEEK", signer(direct(w.config.redis_url)).sign(forged), "LATEST")
    assert [d["payload"] for d in pull(victim, hv, "COUNT", 10)] == ["a", "b", "c"]


def test_hole_2_an_evicted_lmq_owner_cannot_move_the_new_owners_cursor(w) -> None:
    a, b = client(w.port, 2, "a"), client(w.port, 2, "b")
    ha = sub(a, "chat", "LMQ", "s1")
    a.execute_command("MPUB", "chat", 2, "m1", "m2", "LMQ", "s1")
    hb = sub(b, "chat", "LMQ", "s1")  # preempts a
    assert "evicted" in refused("STALE", a, "SEEK", ha, "LATEST")
    assert [d["payload"] for d in pull(b, hb, "COUNT", 10)] == ["m1", "m2"]


def test_hole_2_a_standby_of_a_single_active_group_cannot_seek_it(w) -> None:
    a, b = client(w.port, 2, "a"), client(w.port, 2, "b")
    a.execute_command("MPUB", "jobs", 2, "j1", "j2")
    ha = sub(a, "jobs", "GROUP", "sa", "MODE", "single-active")
    hb = sub(b, "jobs", "GROUP", "sa", "MODE", "single-active")
    refused("NOPERM", b, "SEEK", hb, "LATEST")
    assert [d["payload"] for d in pull(a, ha, "COUNT", 10)] == ["j1", "j2"]


# -- 3. tags ---------------------------------------------------------------------------------------


def test_hole_3_a_tag_is_never_handed_out_twice_under_one_handle_when_its_queue_comes_back(w) -> None:
    """A dropped and re-created filter queue started its tags at 1 again: a late ACK settled a new message."""
    a, p = client(w.port, 2, "a"), client(w.port, 2, "p")
    h = sub(a, "$share/g/news/#")
    p.execute_command("PUB", "news/1", "old")
    old = take(a, h, "BLOCK", 2000)
    assert a.execute_command("UNSUB", h) == b"OK" and take(a, h) == "EOS"  # the last member left: queue dropped
    again = sub(a, "$share/g/news/#")
    assert again == h, "the same handle comes back"
    p.execute_command("PUB", "news/1", "new")
    new = take(a, h, "BLOCK", 2000)
    assert new["payload"] == "new" and new["tag"] != old["tag"]
    assert a.execute_command("ACK", h, old["tag"]) == 0, "the late ACK of the old tag settles nothing"
    assert a.execute_command("ACK", h, new["tag"]) == 1


# -- 4. QoS 0 is fenced by the server too ----------------------------------------------------------


def test_hole_4_an_evicted_lmq_owner_takes_no_qos0_entry_left_in_its_mailbox(w) -> None:
    a, b = client(w.port, 2, "a"), client(w.port, 2, "b")
    ha = sub(a, "chat", "LMQ", "s1", "PUSH", "CAPACITY", 8, "QOS", 0)
    a.execute_command("MPUB", "chat", 3, "m1", "m2", "m3", "LMQ", "s1", "QOS", 0)
    sub(b, "chat", "LMQ", "s1")  # preempts a
    assert take(a, ha) is None


def test_hole_4_after_a_seek_returns_a_raw_client_takes_nothing_read_before_it(w) -> None:
    c = client(w.port, 2, "c")
    h = sub(c, "feed", "PUSH", "CAPACITY", 8, "QOS", 0)
    c.execute_command("MPUB", "feed", 3, "before1", "before2", "before3", "QOS", 0)
    c.execute_command("SEEK", h, "LATEST")
    assert take(c, h) is None
    c.execute_command("PUB", "feed", "after", "QOS", 0)
    assert take(c, h, "BLOCK", 2000)["payload"] == "after"


# -- 8. deadlines --------------------------------------------------------------------------------


def test_hole_8_an_ack_or_renew_after_the_deadline_settles_nothing_even_before_the_sweep(redis_url) -> None:
    with worker(redis_url, sweep_interval_ms=60_000) as w:  # no sweep in this test's lifetime
        c = client(w.port, 2, "c")
        c.execute_command("MPUB", "orders", 2, "a", "b")
        h = sub(c, "orders", "GROUP", "g", "LOCK", 100)
        first, second = pull(c, h, "COUNT", 2)
        time.sleep(0.25)
        assert c.execute_command("RENEW", h, first["tag"]) == 0
        assert c.execute_command("ACK", h, first["tag"], second["tag"]) == 0
        assert c.execute_command("NACK", h, second["tag"]) == 0


# -- 9. dedup reaches the copies ------------------------------------------------------------------


def test_hole_9_a_duplicate_publish_delivers_nothing_new_to_filters_or_shared_groups(w) -> None:
    s, f, p = client(w.port, 2, "s"), client(w.port, 2, "f"), client(w.port, 2, "p")
    hs = sub(s, "$share/g/metrics/+")
    hf = sub(f, "metrics/#")
    first = p.execute_command("PUB", "metrics/cpu", "42", "ID", "k1")
    assert p.execute_command("PUB", "metrics/cpu", "42", "ID", "k1") == first
    for c, h in ((s, hs), (f, hf)):
        assert take(c, h, "BLOCK", 2000)["payload"] == "42"
        assert take(c, h, "BLOCK", 300) is None, "the duplicate was copied again"


# -- 10. fenced long polls -------------------------------------------------------------------------


def test_hole_10_a_fenced_long_poll_waits_instead_of_answering_at_once(w) -> None:
    a, b = client(w.port, 2, "a"), client(w.port, 2, "b")
    ha = sub(a, "chat", "LMQ", "s1")
    sub(b, "chat", "LMQ", "s1")  # a is evicted
    started = time.monotonic()
    assert pull(a, ha, "BLOCK", 400) == []
    assert time.monotonic() - started >= 0.35


def test_hole_10_a_waiting_standby_is_woken_when_it_may_receive(w) -> None:
    a, b = client(w.port, 2, "a"), client(w.port, 2, "b")
    a.execute_command("MPUB", "jobs", 2, "j1", "j2")
    ha = sub(a, "jobs", "GROUP", "sa", "MODE", "single-active")
    hb = sub(b, "jobs", "GROUP", "sa", "MODE", "single-active")
    got: dict[str, Any] = {}

    def standby() -> None:
        started = time.monotonic()
        got["reply"] = pull(b, hb, "COUNT", 10, "BLOCK", 10_000)
        got["took"] = time.monotonic() - started

    t = threading.Thread(target=standby)
    t.start()
    time.sleep(0.3)
    assert a.execute_command("UNSUB", ha) == b"OK"  # the active member leaves: b is next
    t.join(12)
    assert [d["payload"] for d in got["reply"]] == ["j1", "j2"] and got["took"] < 5


# -- 11. the graceful end keeps what it took ------------------------------------------------------


def test_hole_11_after_eos_the_handle_still_settles_and_nothing_taken_goes_to_another_member(w) -> None:
    c, o, p = client(w.port, 2, "c"), client(w.port, 2, "o"), client(w.port, 2, "p")
    h = sub(c, "t", "GROUP", "g", "PUSH", "CAPACITY", 8, "MAX", 3)
    p.execute_command("MPUB", "t", 6, *[f"m{i}" for i in range(1, 7)])
    taken = [take(c, h) for _ in range(3)]
    assert [d["payload"] for d in taken] == ["m1", "m2", "m3"] and take(c, h) == "EOS"
    assert c.execute_command("ACK", h, *(d["tag"] for d in taken)) == 3
    ho = sub(o, "t", "GROUP", "g")
    assert [d["payload"] for d in pull(o, ho, "COUNT", 10)] == ["m4", "m5", "m6"]


# -- 12. PULL on push subscriptions ------------------------------------------------------------------


def test_hole_12_a_share_member_pulls_its_mailbox_in_batches(w) -> None:
    c, p = client(w.port, 2, "c"), client(w.port, 2, "p")
    h = sub(c, "$share/g/batch/+")
    p.execute_command("MPUB", "batch/x", 5, *[f"b{i}" for i in range(5)])
    got: list[dict[str, Any]] = []
    deadline = time.monotonic() + 3
    while len(got) < 5 and time.monotonic() < deadline:
        got += pull(c, h, "COUNT", 5, "BLOCK", 500)
    assert [d["payload"] for d in got] == [f"b{i}" for i in range(5)]
    assert c.execute_command("ACK", h, *(d["tag"] for d in got)) == 5


# -- 13. the colon form of $share ----------------------------------------------------------------------


def test_hole_13_the_colon_form_of_share_is_badarg_naming_the_slash_form(w, r) -> None:
    c = client(w.port, 2, "c")
    before = dump(r)
    message = refused("BADARG", c, "SUB", "$share:g:sensors/#")
    assert "$share/g/sensors/#" in message
    assert dump(r) == before


# -- 5. a hung member's share ------------------------------------------------------------------------


def test_hole_5_a_member_that_never_takes_loses_its_share_to_the_group_and_is_suspected_and_told(redis_url) -> None:
    with worker(redis_url, sweep_interval_ms=50) as w:
        hung, busy, p = client(w.port, 2, "hung"), client(w.port, 2, "busy"), client(w.port, 2, "p")
        hh = sub(hung, "$share/g/work/+", "LOCK", 200)
        hb = sub(busy, "$share/g/work/+", "LOCK", 60_000)
        p.execute_command("MPUB", "work/x", 6, *[f"w{i}" for i in range(6)])
        got: list[dict[str, Any]] = []
        deadline = time.monotonic() + 5
        while len(got) < 6 and time.monotonic() < deadline:
            d = take(busy, hb, "BLOCK", 300)
            if d:
                got.append(d)
                busy.execute_command("ACK", hb, d["tag"])
        assert sorted(d["payload"] for d in got) == [f"w{i}" for i in range(6)], "the hung member's share came back"
        notices = [text(n) for n in hung.execute_command("HEARTBEAT")]
        assert any(n[1] == "message_timeout" for n in notices), notices  # flat map: type first
        assert take(hung, hh) is None, "suspected: nothing new until it settles or renews"


def test_hole_5_a_member_alone_keeps_its_unread_mailbox_past_its_lock(redis_url) -> None:
    with worker(redis_url, sweep_interval_ms=50) as w:
        c, p = client(w.port, 2, "c"), client(w.port, 2, "p")
        h = sub(c, "$share/solo/t/+", "LOCK", 100, "PUSH", "CAPACITY", 8, "MAX", 3)
        p.execute_command("MPUB", "t/x", 5, *[f"m{i}" for i in range(5)])
        time.sleep(0.5)  # five LOCKs: nobody else could take its share, so nothing is leased yet
        assert [take(c, h)["payload"] for _ in range(3)] == ["m0", "m1", "m2"] and take(c, h) == "EOS"


def test_hole_5_a_disconnected_member_gets_no_new_share_by_default(w, r) -> None:
    a, b, p = client(w.port, 2, "off-a"), client(w.port, 2, "off-b"), client(w.port, 2, "p")
    sub(a, "$share/d/o/+")
    hb = sub(b, "$share/d/o/+")
    meta = KEYS.queue(QueueRef("o/+", None, "$share/d")).meta
    a.close()
    deadline = time.monotonic() + 5
    while r.hget(meta, "m|d|off-a|on") != b"0":
        assert time.monotonic() < deadline, "off-a was not marked offline"
        time.sleep(0.02)
    p.execute_command("MPUB", "o/x", 4, *[f"m{i}" for i in range(4)])
    assert [take(b, hb, "BLOCK", 500)["payload"] for _ in range(4)] == [f"m{i}" for i in range(4)]


# -- 6. sessions and their leases ----------------------------------------------------------------------


def test_hole_6_a_redis_pause_longer_than_the_lease_ends_no_connected_session(redis_url, r) -> None:
    with worker(redis_url, session_lease_ms=800, sweep_interval_ms=50) as w:
        a, p = client(w.port, 2, "a"), client(w.port, 2, "p")
        h = sub(a, "chat", "LMQ", "s1")
        r.execute_command("CLIENT", "PAUSE", 1300, "ALL")  # longer than the lease, shorter than two
        time.sleep(1.6)
        p.execute_command("PUB", "chat", "after", "LMQ", "s1")
        assert [d["payload"] for d in pull(a, h, "BLOCK", 2000)] == ["after"], "the session and its lmq survived"
        assert r.zscore(KEYS.sessions, "a") > time.time() * 1000 - 5_000


def test_hole_6_a_connected_session_is_never_left_without_a_lease(redis_url, r) -> None:
    with worker(redis_url, session_lease_ms=600) as w:
        a = client(w.port, 2, "a")
        sub(a, "chat", "LMQ", "s1")
        r.zrem(KEYS.sessions, "a")  # as an outage or a cleaner's unlisting might leave it
        deadline = time.monotonic() + 2
        while r.zscore(KEYS.sessions, "a") is None:
            assert time.monotonic() < deadline, "the keep-alive did not list the session again"
            time.sleep(0.05)
        a.close()  # and now, disconnected, it ends by its lease: nothing of it is left behind
        deadline = time.monotonic() + 5
        while r.exists(KEYS.session("a")) or r.zscore(KEYS.sessions, "a") is not None:
            assert time.monotonic() < deadline, "the disconnected session did not end"
            time.sleep(0.05)
        left = [f for f in r.hgetall(KEYS.queue(QueueRef("chat", "s1")).meta) if b"|a" in f or f == b"z"]
        assert left == [], f"the ended session left {left}"  # no membership, ownership or marker


def test_hole_6_ending_is_atomic_against_a_reconnect(redis_url, r) -> None:
    with worker(redis_url) as w:
        a = client(w.port, 2, "a")
        sub(a, "chat", "LMQ", "s1")
        r.set(KEYS.session_ending("a"), "a-cleaner", px=5_000)  # a cleaner is ending the session right now
        result: dict[str, Any] = {}

        def reconnect() -> None:
            c = client(w.port, 2)
            started = time.monotonic()
            c.execute_command("HELLO", 2, "SETNAME", "a")
            result["took"] = time.monotonic() - started

        t = threading.Thread(target=reconnect)
        t.start()
        time.sleep(0.4)
        assert "took" not in result, "the reconnect did not wait for the end in progress"
        r.delete(KEYS.session_ending("a"))  # the end is over
        t.join(5)
        assert 0.3 <= result["took"] < 3


# -- 7. a worker dying between the fence and the schedule ------------------------------------------------


@pytest.mark.parametrize("mode", ["pull", "take"])
def test_hole_7_a_lease_is_found_by_the_sweeper_when_its_worker_dies_right_after_the_fence(redis_url, mode) -> None:
    with worker(redis_url, sweep_interval_ms=50) as w:
        async def died(*_: Any) -> None:  # the write after the fence never happens: the worker is gone
            return None

        w.worker.core.ctx.schedule_soon = died
        w.worker.core.ctx.schedule = died
        a, b, p = client(w.port, 2, "a"), client(w.port, 2, "b"), client(w.port, 2, "p")
        push = ["PUSH"] if mode == "take" else []
        ha = sub(a, "orders", "GROUP", "g", "LOCK", 200, *push)
        p.execute_command("PUB", "orders", "x")
        got = take(a, ha, "BLOCK", 2000) if mode == "take" else pull(a, ha, "BLOCK", 2000)[0]
        assert got["payload"] == "x"
        hb = sub(b, "orders", "GROUP", "g", *push)
        deadline = time.monotonic() + 15  # a liveness bound, generous for a loaded machine
        again = None
        while again is None and time.monotonic() < deadline:
            again = take(b, hb, "BLOCK", 200) if mode == "take" else (pull(b, hb, "BLOCK", 200) or [None])[0]
        assert again is not None and again["id"] == got["id"], "the lease was never swept"


@pytest.mark.parametrize("protocol", [3, 2])
def test_hole_10_an_sdk_client_whose_pull_reply_was_lost_shows_life_by_itself(redis_url, protocol) -> None:
    """A lost PULL reply leaves the member suspected: told of the timeout, the SDK renews to clear it."""
    import asyncio

    from fencemq import Client
    from fencemq.sdk import subscription

    with worker(redis_url, sweep_interval_ms=50) as w:
        async def main() -> None:
            async with await Client.connect(f"redis://127.0.0.1:{w.port}", client_id="lossy",
                                            protocol=protocol) as c:
                await c.publish("orders", b"x")
                sub = await c.subscribe("orders", group="g", lock_ms=150)
                await c.execute("PULL", sub.handle)  # the reply is "lost": nobody settles that checkout
                got = []
                async for d in sub.iter(count=1, block_ms=300):
                    got.append(d)
                    break
                assert [d.payload for d in got] == [b"x"] and got[0].deliveries == 2

        subscription.HEARTBEAT_EVERY_S, before = 0.2, subscription.HEARTBEAT_EVERY_S
        try:
            asyncio.run(asyncio.wait_for(main(), 15))
        finally:
            subscription.HEARTBEAT_EVERY_S = before
