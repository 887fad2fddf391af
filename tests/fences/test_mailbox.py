"""Push mailboxes, MAX-n and the end-of-stream sentinel (issue 6), against a real server.

The property test drives ``fencemq.fences.core.Core`` directly (one private Redis,
flushed before each example): whatever the capacity, MAX, publish pattern and
take pattern (including no take at all until the end),

* capacity > MAX: the consumer TAKEs exactly MAX messages, in id order, then EOS;
* capacity ≤ MAX: it sees an in-order subsequence of them, then EOS — the
  sentinel is seated by evict-offer, which gives up one buffered entry at most;
* nothing is lost to the subscription: a pull member joining the same group
  after the push member ended gets every message the consumer did not settle;
* the mailbox never holds more than its capacity, and no call ever waits.

The rest go through a worker (``fencemq.server.runner.WorkerThread``): MAX armed at or
below what was delivered, abrupt UNSUB waking a blocked TAKE, a mailbox
surviving a worker restart and a consumer moving to another worker,
back-pressure, leases that start at TAKE, and the SDK's iterators.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from fencemq import Client, EndOfStream, SyncClient
from fencemq.config import Config
from fencemq.errors import NotFound
from fencemq.model.keys import Keyspace, QueueRef
from fencemq.model.handles import Handle
from fencemq.fences.core import Core
from tests import helpers
from tests.helpers import (
    RespConn,
    as_map,
    client,
    deliveries,
    pipeline,
    text,
    wait_for,
    worker,
)

TOPIC = "pushed"
REF = QueueRef(TOPIC)
CONFIG = Config(retention_maxlen=0, retention_maxage_ms=0)  # nothing trimmed: every id stays accounted for
STEP_S = 5.0  # no step may take longer: TAKE never waits in these calls
CONFIG_KEYS = Keyspace(CONFIG.prefix)


def mailbox_key(topic: str, group: str, member: str) -> str:
    """The member's push mailbox (a list): ``<meta>:mb:<group>:<member>``."""
    return CONFIG_KEYS.queue(QueueRef(topic)).mailbox(group, member)


class Direct:
    """The async API on one event loop; every call bounded by anyio.fail_after."""

    def __init__(self, url: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.redis: Redis = self.loop.run_until_complete(self._connect(url))
        self.queues = Core(self.redis, CONFIG)

    @staticmethod
    async def _connect(url: str) -> Redis:
        return helpers.direct_async(url)

    def run(self, coro: Any, timeout: float = STEP_S) -> Any:
        async def bounded() -> Any:
            with anyio.fail_after(timeout):
                return await coro

        return self.loop.run_until_complete(bounded())

    def reset(self) -> None:
        self.run(self.redis.flushall())
        self.queues = Core(self.redis, CONFIG)

    def mailbox_len(self, group: str, member: str, ref: QueueRef = REF) -> int:
        return self.run(self.redis.llen(self.queues.keys.queue(ref).mailbox(group, member)))

    def close(self) -> None:
        self.run(self.redis.aclose())
        self.loop.close()


@pytest.fixture(scope="module")
def direct(redis_server) -> Any:
    d = Direct(redis_server.url)
    yield d
    d.close()


def payloads(start: int, n: int) -> list[bytes]:
    return [b"m%d" % i for i in range(start, start + n)]


# -- the invariant, as a property ------------------------------------------------------------


@st.composite
def scenarios(draw) -> dict[str, Any]:
    steps = draw(st.lists(
        st.one_of(
            st.tuples(st.just("pub"), st.integers(1, 6)),
            st.tuples(st.just("take"), st.integers(1, 3), st.booleans()),  # how many, ACK each or not
        ),
        max_size=10,
    ))
    if draw(st.booleans()):
        steps = [s for s in steps if s[0] == "pub"]  # no consumption at all until the end
    return {
        "capacity": draw(st.integers(1, 8)),
        "max": draw(st.integers(0, 10)),
        "mode": draw(st.sampled_from(["shared", "exclusive"])),
        "before": draw(st.integers(0, 4)),  # published before SUB (the group starts at the earliest)
        "steps": steps,
        "drain_acks": draw(st.booleans()),
    }


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_a_push_consumer_sees_exactly_max_in_order_when_capacity_exceeds_max_else_an_in_order_subsequence_and_loses_nothing(
    direct: Direct, sc: dict[str, Any]
) -> None:
    direct.reset()
    q, cap, mx = direct.queues, sc["capacity"], sc["max"]
    ids: list[int] = []

    def publish(n: int) -> None:
        ids.extend(int(i) for i in direct.run(q.publishing.publish(TOPIC, payloads(len(ids), n))))

    if sc["before"]:
        publish(sc["before"])
    h = Handle.decode(direct.run(q.subscriptions.subscribe(
        "c", TOPIC, group="g", mode=sc["mode"], capacity=cap, max_messages=mx)).handle)
    seen: list[int] = []
    unsettled: set[int] = set()
    tags: dict[int, str] = {}
    ended = False

    def take(ack: bool) -> bool:
        """One TAKE; False when the mailbox was empty or the stream ended."""
        nonlocal ended
        got = direct.run(q.mailboxes.take(h))
        if got == "EOS":
            ended = True
            return False
        if got is None:
            return False
        assert got.payload == b"m%d" % (int(got.id) - 1)
        seen.append(int(got.id))
        if ack:
            assert direct.run(q.leases.ack(h, [got.tag])) == 1
        else:
            unsettled.add(int(got.id))
            tags[int(got.id)] = got.tag
        return True

    def bounded_mailbox() -> None:
        length = direct.mailbox_len("g", "c")
        assert length <= cap, f"{length} entries in a mailbox of capacity {cap}"

    bounded_mailbox()
    for step in sc["steps"]:
        if step[0] == "pub":
            publish(step[1])
        else:
            for _ in range(step[1]):
                if ended or not take(step[2]):
                    break
        bounded_mailbox()
    for _ in range(len(ids) + 2):  # the end: consume whatever is left
        if ended or not take(sc["drain_acks"]):
            break
        bounded_mailbox()

    assert seen == sorted(seen) and len(set(seen)) == len(seen), f"out of order or twice: {seen}"
    event(f"capacity {'>' if cap > mx else '<='} MAX, " + ("ended by MAX" if ended else "not ended"))
    if ended and cap <= mx and len(seen) < mx:
        event("an entry gave way to the sentinel")
    if not ended:
        # The stream cannot end before MAX is reached; then everything was delivered.
        assert len(ids) < mx, f"{len(ids)} published, MAX {mx}, yet no end of stream"
        assert seen == ids
        direct.run(q.subscriptions.unsubscribe(h))  # abrupt: everything back, EOS seated
        assert direct.run(q.mailboxes.take(h)) == "EOS"
        with pytest.raises(NotFound):
            direct.run(q.mailboxes.take(h))  # the handle is closed after the EOS of an UNSUB
    elif cap > mx:
        assert seen == ids[:mx], f"capacity {cap} > MAX {mx}: expected exactly the first {mx}"
    else:
        assert len(ids) >= mx
        first = ids[:mx]
        assert set(seen) <= set(first), "beyond MAX"
        assert len(first) - len(seen) <= 1, f"evict-offer gives up one entry at most, {first} vs {seen}"
    if ended:
        # The handle outlives the end of a MAX: it settles what it took (every TAKE answers EOS).
        assert direct.run(q.mailboxes.take(h)) == "EOS"
        if unsettled:
            last = max(unsettled)
            assert direct.run(q.leases.ack(h, [tags[last]])) == 1, "a message taken before EOS settles after it"
            unsettled.discard(last)
        # What it took and never settled goes back to the group when its session ends.
        direct.run(q.subscriptions.unsubscribe(h, session_over=True))

    # Nothing lost to the subscription: the rest goes to the next member of the group.
    p = Handle.decode(direct.run(q.subscriptions.subscribe("p", TOPIC, group="g", mode=sc["mode"])).handle)
    pulled = [int(d.id) for d in direct.run(q.leases.pull(p, 1000)).deliveries]
    settled = set(seen) - unsettled
    assert pulled == sorted(set(ids) - settled), f"seen {seen}, unsettled {unsettled}, pulled {pulled}"


# -- direct examples ---------------------------------------------------------------------------


def test_max_0_ends_a_push_subscription_before_anything_is_delivered(direct: Direct) -> None:
    direct.reset()
    q = direct.queues
    direct.run(q.publishing.publish(TOPIC, payloads(0, 3)))
    h = Handle.decode(direct.run(q.subscriptions.subscribe("c", TOPIC, group="g", mode="shared", capacity=4, max_messages=0)).handle)
    assert direct.run(q.mailboxes.take(h)) == "EOS"
    p = Handle.decode(direct.run(q.subscriptions.subscribe("p", TOPIC, group="g", mode="shared")).handle)
    assert [d.id for d in direct.run(q.leases.pull(p, 10)).deliveries] == ["1", "2", "3"]


def test_the_sentinel_evicts_the_oldest_entry_of_a_full_mailbox_and_that_message_goes_back_to_the_group(
    direct: Direct,
) -> None:
    direct.reset()
    q = direct.queues
    h = Handle.decode(direct.run(q.subscriptions.subscribe("c", TOPIC, group="g", mode="shared", capacity=3)).handle)
    direct.run(q.publishing.publish(TOPIC, payloads(0, 10)))
    assert direct.mailbox_len("g", "c") == 3  # 1 2 3, delivered 3
    assert direct.run(q.mailboxes.end_after(h, 3)) is True  # MAX = delivered: ends at once, the mailbox is full
    took = [direct.run(q.mailboxes.take(h)) for _ in range(3)]
    assert [d if d == "EOS" else d.id for d in took] == ["2", "3", "EOS"]
    p = Handle.decode(direct.run(q.subscriptions.subscribe("p", TOPIC, group="g", mode="shared")).handle)
    # 1 gave way to the sentinel; 2 and 3 stay the ended member's, to settle
    assert [d.id for d in direct.run(q.leases.pull(p, 100)).deliveries] == ["1"] + [str(i) for i in range(4, 11)]
    assert direct.run(q.leases.ack(h, [d.tag for d in took[:2]])) == 2


def test_with_capacity_at_most_max_nothing_gives_way_when_max_is_reached_with_room_in_the_mailbox(
    direct: Direct,
) -> None:
    direct.reset()
    q = direct.queues
    h = Handle.decode(direct.run(q.subscriptions.subscribe("c", TOPIC, group="g", mode="shared", capacity=2, max_messages=3)).handle)
    seen = []
    for i in range(3):  # the consumer keeps up: the mailbox is never full
        direct.run(q.publishing.publish(TOPIC, payloads(i, 1)))
        seen.append(direct.run(q.mailboxes.take(h)).id)
    assert seen == ["1", "2", "3"] and direct.run(q.mailboxes.take(h)) == "EOS"


def test_with_capacity_at_most_max_a_full_mailbox_gives_up_its_oldest_entry_to_the_sentinel(direct: Direct) -> None:
    direct.reset()
    q = direct.queues
    h = Handle.decode(direct.run(q.subscriptions.subscribe("c", TOPIC, group="g", mode="shared", capacity=2, max_messages=3)).handle)
    direct.run(q.publishing.publish(TOPIC, payloads(0, 5)))  # 1 2 in the mailbox
    got = [direct.run(q.mailboxes.take(h)) for _ in range(3)]  # taking 1 tops up 3 = MAX: full, so 2 gives way
    assert [g if g == "EOS" else g.id for g in got] == ["1", "3", "EOS"]


def test_subscribing_again_after_an_abrupt_unsubscribe_gives_a_live_subscription_not_the_old_end_of_stream(
    direct: Direct,
) -> None:
    direct.reset()
    q = direct.queues
    h = Handle.decode(direct.run(q.subscriptions.subscribe("c", TOPIC, group="g", mode="shared", capacity=4)).handle)
    direct.run(q.subscriptions.unsubscribe(h))  # EOS seated; the member stays until it TAKEs it
    direct.run(q.subscriptions.subscribe("c", TOPIC, group="g", mode="shared", capacity=4))
    direct.run(q.publishing.publish(TOPIC, [b"x"]))
    got = direct.run(q.mailboxes.take(h))
    assert got != "EOS" and got is not None and got.payload == b"x"


def test_a_push_member_that_reached_its_end_no_longer_owns_its_exclusive_group(direct: Direct) -> None:
    direct.reset()
    q = direct.queues
    direct.run(q.publishing.publish(TOPIC, payloads(0, 2)))
    h = Handle.decode(direct.run(q.subscriptions.subscribe("c", TOPIC, capacity=4, max_messages=1)).handle)
    assert direct.run(q.mailboxes.take(h)).id == "1"
    assert direct.run(q.mailboxes.take(h)) == "EOS"
    nxt = direct.run(q.subscriptions.subscribe("d", TOPIC, group="~c"))
    assert nxt.evicted is None, f"{nxt.evicted} was preempted after it had left"


# -- through a worker --------------------------------------------------------------------------


def take(c, handle: str, *opts: Any) -> Any:
    """TAKE: a delivery dict, None, or "EOS"."""
    got = c.execute_command("TAKE", handle, *opts)
    if got is None:
        return None
    if text(got) == "EOS":
        return "EOS"
    return as_map(got)


def sub(c, *args: Any) -> str:
    return as_map(c.execute_command("SUB", *args))["handle"]


def test_unsub_max_at_or_below_what_was_delivered_ends_the_stream_at_once_and_stops_dispatch(redis_url) -> None:
    r = helpers.direct(redis_url)
    with worker(redis_url) as w:
        c, p = client(w.port, 2, "c"), client(w.port, 2, "p")
        h = sub(c, "t", "GROUP", "g", "PUSH", "CAPACITY", 3)
        p.execute_command("MPUB", "t", 10, *payloads(0, 10))
        first = take(c, h)
        assert first["id"] == "1" and c.execute_command("ACK", h, first["tag"]) == 1
        assert r.llen(mailbox_key("t", "g", "c")) == 3  # 2 3 4: delivered 4
        assert text(c.execute_command("UNSUB", h, "MAX", 2)) == "OK"  # 2 < 4 delivered
        p.execute_command("MPUB", "t", 5, *payloads(10, 5))  # nothing more is dispatched to it
        got = [take(c, h), take(c, h), take(c, h, "BLOCK", 5000)]
        assert [g if g == "EOS" else g["id"] for g in got] == ["3", "4", "EOS"]  # 2 gave way to the sentinel
        hp = sub(p, "t", "GROUP", "g")
        rest = deliveries(p.execute_command("PULL", hp, "COUNT", 100))
        assert [d["id"] for d in rest] == ["2"] + [str(i) for i in range(5, 16)]  # 3, 4: still c's to settle
        assert c.execute_command("ACK", h, got[0]["tag"], got[1]["tag"]) == 2


def test_unsub_max_equal_to_what_was_taken_ends_an_empty_mailbox_at_once(redis_url) -> None:
    with worker(redis_url) as w:
        c, p = client(w.port, 2, "c"), client(w.port, 2, "p")
        h = sub(c, "t", "GROUP", "g", "PUSH", "CAPACITY", 8)
        p.execute_command("MPUB", "t", 2, b"a", b"b")
        assert [take(c, h)["payload"] for _ in range(2)] == ["a", "b"]
        c.execute_command("UNSUB", h, "MAX", 2)
        p.execute_command("PUB", "t", "c")
        t0 = time.monotonic()
        assert take(c, h, "BLOCK", 5000) == "EOS"
        assert time.monotonic() - t0 < 1.0


def test_after_the_eos_of_a_max_a_member_whose_lease_ran_out_still_takes_eos_not_nil(redis_url) -> None:
    """Suspicion withholds messages until the member settles or renews; past its end there are none to
    withhold, so every TAKE after the EOS answers EOS again (docs/protocol.md), suspected or not."""
    r = helpers.direct(redis_url)
    with worker(redis_url, sweep_interval_ms=50) as w:
        c, p = client(w.port, 2, "c"), client(w.port, 2, "p")
        h = sub(c, "t", "GROUP", "g", "PUSH", "MAX", 1, "LOCK", 100)
        p.execute_command("PUB", "t", "a")
        assert take(c, h)["payload"] == "a"  # taken, never settled: its lease runs out
        assert take(c, h) == "EOS"
        meta = CONFIG_KEYS.queue(QueueRef("t")).meta
        wait_for(lambda: r.hexists(meta, "m|g|c|sus"), timeout=5, what="c to be suspected")
        assert take(c, h) == "EOS"


def test_an_abrupt_unsub_wakes_a_blocked_take_with_eos_within_milliseconds(redis_url, direct: Direct) -> None:
    # A worker runs a connection's commands one at a time, so the consumer's
    # own UNSUB would wait behind its TAKE; here it comes from outside, as it
    # does when an operator or another worker unsubscribes the member.
    with worker(redis_url) as w:
        c = client(w.port, 2, "c", timeout=10)
        h = sub(c, "t", "GROUP", "g", "PUSH")
        result: dict[str, Any] = {}

        def blocked() -> None:
            result["reply"] = take(c, h, "BLOCK", 5000)
            result["at"] = time.monotonic()

        t = threading.Thread(target=blocked)
        t.start()
        helpers.long_polls_parked(w)
        assert "reply" not in result, "TAKE BLOCK returned before anything happened"
        t0 = time.monotonic()
        direct.run(direct.queues.subscriptions.unsubscribe(Handle.decode(h)))
        t.join(6)
        assert result["reply"] == "EOS"
        assert result["at"] - t0 < 0.5, f"woke after {result['at'] - t0:.3f} s"


def test_an_abrupt_unsub_clears_the_mailbox_and_returns_its_messages_to_the_group(redis_url) -> None:
    r = helpers.direct(redis_url)
    with worker(redis_url) as w:
        c, p = client(w.port, 2, "c"), client(w.port, 2, "p")
        h = sub(c, "t", "GROUP", "g", "PUSH", "CAPACITY", 4)
        p.execute_command("MPUB", "t", 6, *payloads(0, 6))
        assert r.llen(mailbox_key("t", "g", "c")) == 4
        assert text(c.execute_command("UNSUB", h)) == "OK"
        assert text(r.lrange(mailbox_key("t", "g", "c"), 0, -1)) == ["EOS"]
        assert take(c, h) == "EOS"
        hp = sub(p, "t", "GROUP", "g")
        assert [d["id"] for d in deliveries(p.execute_command("PULL", hp, "COUNT", 10))] == [str(i) for i in range(1, 7)]


def test_the_mailbox_survives_a_worker_restart_and_take_continues_in_order(redis_url) -> None:
    r = helpers.direct(redis_url)
    first = worker(redis_url).start()
    try:
        c, p = client(first.port, 2, "c"), client(first.port, 2, "p")
        h = sub(c, "t", "GROUP", "g", "PUSH", "CAPACITY", 8)
        p.execute_command("MPUB", "t", 6, *payloads(0, 6))
        for _ in range(2):
            d = take(c, h)
            c.execute_command("ACK", h, d["tag"])
    finally:
        first.stop()
    assert r.llen(mailbox_key("t", "g", "c")) == 4
    with worker(redis_url) as second:
        c2 = client(second.port, 2, "c")  # the same session, within its lease
        got = [take(c2, h) for _ in range(4)]
        assert [d["id"] for d in got] == ["3", "4", "5", "6"] and {d["deliveries"] for d in got} == {1}
        client(second.port, 2, "p").execute_command("PUB", "t", "after")
        assert take(c2, h, "BLOCK", 2000)["payload"] == "after"


def test_the_consumer_moving_to_another_worker_takes_on_from_its_mailbox_in_order(redis_url) -> None:
    with worker(redis_url) as w1, worker(redis_url) as w2:
        c1, p = client(w1.port, 2, "c"), client(w1.port, 2, "p")
        h = sub(c1, "t", "GROUP", "g", "PUSH", "CAPACITY", 4)
        p.execute_command("MPUB", "t", 10, *payloads(0, 10))
        for _ in range(3):
            d = take(c1, h)
            c1.execute_command("ACK", h, d["tag"])
        c2 = client(w2.port, 2, "c")  # same client id on the other worker: takes the session over
        got = []
        while (d := take(c2, h)) is not None:
            got.append(d["id"])
            assert c2.execute_command("ACK", h, d["tag"]) == 1
        assert got == [str(i) for i in range(4, 11)]

        result: dict[str, Any] = {}

        t = threading.Thread(target=lambda: result.setdefault("d", take(c2, h, "BLOCK", 5000)))
        t.start()
        helpers.long_polls_parked(w2)
        p.execute_command("PUB", "t", "via-w1")  # published through the first worker
        t.join(6)
        assert result["d"]["payload"] == "via-w1"


def test_back_pressure_the_mailbox_never_holds_more_than_its_capacity_whatever_is_published(redis_url) -> None:


    r = helpers.direct(redis_url)
    key = mailbox_key("t", "g", "c")
    with worker(redis_url) as w:
        c = client(w.port, 2, "c")
        h = sub(c, "t", "GROUP", "g", "PUSH", "CAPACITY", 4)
        with RespConn(w.port) as p:
            p.hello(2, "p")
            p.send_raw(pipeline(*(["PUB", "t", f"m{i}"] for i in range(150))))  # one fence call per batch
            p.replies(150)
            p.call("MPUB", "t", 50, *payloads(150, 50))
        assert r.llen(key) == 4
        assert int(r.hget(CONFIG_KEYS.queue(QueueRef("t")).meta, "m|g|c|n")) == 4  # checked out: only those
        got = []
        while (d := take(c, h)) is not None:
            got.append(int(d["id"]))
            assert r.llen(key) <= 4
            c.execute_command("ACK", h, d["tag"])
        assert got == list(range(1, 201))


def test_a_mailbox_message_s_lease_starts_when_it_is_taken_not_when_it_is_dispatched(redis_url) -> None:
    with worker(redis_url, sweep_interval_ms=50) as w:
        c, p = client(w.port, 2, "c"), client(w.port, 2, "p")
        h = sub(c, "t", "GROUP", "g", "PUSH", "CAPACITY", 2, "LOCK", 200)
        p.execute_command("MPUB", "t", 3, b"a", b"b", b"c")
        time.sleep(1.0)  # five lock lengths in the mailbox, untaken
        got = [take(c, h), take(c, h)]
        assert [(d["id"], d["deliveries"]) for d in got] == [("1", 1), ("2", 1)]
        assert c.execute_command("HEARTBEAT") == [], "a message timed out while it sat in the mailbox"
        # Taken, its lease runs: 200 ms later it is back in the group (and the member suspected).
        notices = wait_for(lambda: [as_map(n) for n in c.execute_command("HEARTBEAT")], timeout=3,
                           what="the message_timeout notice of the taken messages")
        assert notices[0]["type"] == "message_timeout" and set(notices[0]["tags"]) >= {got[0]["tag"]}
        assert c.execute_command("ACK", h, got[0]["tag"], got[1]["tag"]) == 0


def test_a_message_taken_from_a_mailbox_comes_out_field_for_field_as_a_pull_gives_it(redis_url) -> None:
    """A mailbox entry is the stored body behind its tag, id, acquisitions and epoch, and TAKE and
    a push member's PULL read the body back from where those end (lib/mailbox.lua): each message
    must come out of the mailbox as a pull group's PULL gives it, ts, headers and producer too."""
    with worker(redis_url) as w:
        pusher, puller, producer = (client(w.port, 2, name) for name in ("pusher", "puller", "producer"))
        hp = sub(pusher, "fields", "GROUP", "push", "PUSH", "CAPACITY", 10)
        hq = sub(puller, "fields", "GROUP", "pull")
        producer.execute_command("PUB", "fields", b"plain")
        producer.execute_command("PUB", "fields", b"a\x00nul:and:colons", "HDR", "k", "v", "HDR", "k2", "")
        producer.execute_command("MPUB", "fields", 2, b"", b"x" * 300)
        fields = ("id", "ts", "topic", "payload", "headers", "producer")
        pulled = [{f: d.get(f) for f in fields} for d in deliveries(puller.execute_command("PULL", hq, "COUNT", 10))]
        taken = [{f: d.get(f) for f in fields} for d in (take(pusher, hp), take(pusher, hp))]
        taken += [{f: d.get(f) for f in fields} for d in deliveries(pusher.execute_command("PULL", hp, "COUNT", 10))]
        assert len(pulled) == 4 and taken == pulled
        assert pulled[1]["payload"] == "a\x00nul:and:colons" and pulled[1]["headers"] == ["k", "v", "k2", ""]


# -- the SDK -----------------------------------------------------------------------------------


def test_the_sdk_push_iterator_ends_cleanly_when_the_subscription_is_ended_from_elsewhere(redis_url) -> None:
    async def main(url: str) -> list[bytes]:
        operator = Core(helpers.direct_async(redis_url), Config())
        async with await Client.connect(url, client_id="sdk") as c:
            sub = await c.subscribe("t", group="g", push=True, capacity=4)
            await c.mpublish("t", [b"a", b"b"])

            async def end_soon() -> None:  # while the iterator waits in TAKE BLOCK 5000
                await asyncio.sleep(0.3)
                await operator.subscriptions.unsubscribe(Handle.decode(sub.handle))

            got: list[bytes] = []
            enders = []
            async for d in sub.iter(block_ms=5000):
                got.append(d.payload)
                await sub.ack(d)
                if len(got) == 2:
                    enders.append(asyncio.ensure_future(end_soon()))
            await asyncio.gather(*enders)
            assert sub.ended
            with pytest.raises(EndOfStream):
                await sub.take()
        await operator.redis.aclose()
        return got

    with worker(redis_url) as w:
        t0 = time.monotonic()
        assert asyncio.run(asyncio.wait_for(main(f"redis://127.0.0.1:{w.port}"), 20)) == [b"a", b"b"]
        assert time.monotonic() - t0 < 3, "the iterator waited out its TAKE BLOCK instead of waking at EOS"


def test_unsubscribing_a_push_subscription_inside_its_iterator_lets_the_server_forget_the_member(redis_url) -> None:
    r = helpers.direct(redis_url)

    async def main(url: str) -> None:
        async with await Client.connect(url, client_id="sdk") as c:
            sub = await c.subscribe("t", group="g", push=True)
            await c.mpublish("t", [b"a", b"b"])
            async for d in sub.iter(block_ms=1000):
                await sub.ack(d)
                await sub.unsubscribe()
            assert not r.hexists(CONFIG_KEYS.queue(QueueRef("t")).meta, "m|g|sdk|n"), "the member lingers"
            assert not r.exists(mailbox_key("t", "g", "sdk")), "its mailbox (holding EOS) lingers"

    with worker(redis_url) as w:
        asyncio.run(asyncio.wait_for(main(f"redis://127.0.0.1:{w.port}"), 20))


def test_the_sync_facade_iterates_a_push_subscription_to_its_end_of_stream(redis_url) -> None:
    with worker(redis_url) as w, SyncClient.connect(f"redis://127.0.0.1:{w.port}", client_id="sync") as c:
        c.mpublish("t", [b"%d" % i for i in range(6)])
        sub = c.subscribe("t", group="g", push=True, capacity=8, max=4, start="earliest")
        got = []
        for d in sub.iter(block_ms=2000):
            got.append(d.payload)
            assert sub.ack(d) == 1
        assert got == [b"0", b"1", b"2", b"3"]
        assert sub.aio.ended
        with pytest.raises(EndOfStream):
            sub.take(block_ms=100)
