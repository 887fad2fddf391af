"""A publish to a queue with a waiting long poll (``PULL … BLOCK``): what the waiter gets.

Every rule of docs/protocol.md holds whether the waiter is woken and looks
again or the publish hands the messages straight to it: returned messages
first, in id order; COUNT and MAX; the fences (suspected, standby, evicted
members get nothing); the epoch after a SEEK; each message to one member of a
group and to every group; QoS 0 without a lease; a BLOCK that runs out as the
publish lands neither loses a message nor holds it under a lease.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tests.helpers import as_map, client, deliveries, wait_for, worker


@pytest.fixture
def w(redis_url):
    with worker(redis_url, sweep_interval_ms=100) as started:
        yield started


def sub(c: Any, *args: Any) -> str:
    return as_map(c.execute_command("SUB", *args))["handle"]


class Waiting:
    """``PULL handle COUNT n BLOCK ms`` in a thread of its own; ``reply()`` joins it."""

    def __init__(self, c: Any, handle: str, count: int = 10, block_ms: int = 3000, settle: float = 0.3) -> None:
        self.result: dict[str, Any] = {}

        def run() -> None:
            self.result["reply"] = c.execute_command("PULL", handle, "COUNT", count, "BLOCK", block_ms)
            self.result["at"] = time.monotonic()

        self.thread = threading.Thread(target=run)
        self.thread.start()
        time.sleep(settle)  # parked in its long poll by now

    def reply(self, timeout: float = 10) -> list[dict[str, Any]]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the long poll never answered"
        return deliveries(self.result["reply"])


def payloads(got: list[dict[str, Any]]) -> list[str]:
    return [d["payload"] for d in got]


def test_a_waiting_pull_gets_what_is_published_in_id_order_and_no_more_than_its_count(w):
    c, p = client(w.port, 2, "c"), client(w.port, 2, "p")
    h = sub(c, "orders", "GROUP", "g")
    waiting = Waiting(c, h, count=3)
    p.execute_command("MPUB", "orders", 5, "a", "b", "c", "d", "e")
    got = waiting.reply()
    assert payloads(got) == ["a", "b", "c"] and [int(d["id"]) for d in got] == [1, 2, 3]
    assert all(d["deliveries"] == 1 for d in got)
    assert payloads(deliveries(c.execute_command("PULL", h, "COUNT", 10))) == ["d", "e"]


def test_a_waiting_pull_gets_a_returned_message_before_the_new_one_published_after_it_came_due(redis_url):
    with worker(redis_url, sweep_interval_ms=60_000) as w:  # no sweep promotes the delayed message first
        c, p = client(w.port, 2, "c"), client(w.port, 2, "p")
        h = sub(c, "orders", "GROUP", "g")
        p.execute_command("PUB", "orders", "old")
        (first,) = deliveries(c.execute_command("PULL", h))
        assert c.execute_command("NACK", h, first["tag"], "DELAY", 200) == 1
        waiting = Waiting(c, h, count=10, block_ms=5000, settle=0.5)  # the delay is over, nothing woke it
        p.execute_command("PUB", "orders", "new")
        got = waiting.reply()
        assert payloads(got) == ["old", "new"]
        assert got[0]["id"] == first["id"] and got[0]["deliveries"] == 2 and got[0]["tag"] != first["tag"]


def test_a_suspected_member_waiting_gets_nothing_a_publish_brings_and_the_others_get_it(w):
    a, b, p = client(w.port, 2, "A"), client(w.port, 2, "B"), client(w.port, 2, "p")
    ha = sub(a, "orders", "GROUP", "g", "LOCK", 200)
    hb = sub(b, "orders", "GROUP", "g")
    p.execute_command("PUB", "orders", "held")
    assert payloads(deliveries(a.execute_command("PULL", ha))) == ["held"]
    wait_for(lambda: payloads(deliveries(b.execute_command("PULL", hb))) == ["held"], what="the lease to expire")
    waiting = Waiting(a, ha, block_ms=1000)  # A is suspected now: its long poll is fenced
    p.execute_command("PUB", "orders", "fresh")
    assert waiting.reply() == []
    assert payloads(deliveries(b.execute_command("PULL", hb))) == ["fresh"]


def test_a_standby_of_a_single_active_group_waiting_gets_nothing_and_the_active_member_gets_it(w):
    a, b, p = client(w.port, 2, "A"), client(w.port, 2, "B"), client(w.port, 2, "p")
    ha = sub(a, "orders", "GROUP", "g", "MODE", "single-active")
    hb = sub(b, "orders", "GROUP", "g", "MODE", "single-active")
    standby = Waiting(b, hb, block_ms=1000)
    active = Waiting(a, ha, block_ms=3000, settle=0.1)
    p.execute_command("PUB", "orders", "job")
    assert payloads(active.reply()) == ["job"]
    assert standby.reply() == []


def test_two_members_of_a_group_waiting_share_a_publish_each_message_once(w):
    a, b, p = client(w.port, 2, "A"), client(w.port, 2, "B"), client(w.port, 2, "p")
    ha, hb = sub(a, "orders", "GROUP", "g"), sub(b, "orders", "GROUP", "g")
    wa, wb = Waiting(a, ha, count=1, settle=0.05), Waiting(b, hb, count=1)
    p.execute_command("MPUB", "orders", 2, "x", "y")
    got = wa.reply() + wb.reply()
    assert sorted(payloads(got)) == ["x", "y"]


def test_waiting_members_of_two_groups_each_get_every_message(w):
    a, b, p = client(w.port, 2, "A"), client(w.port, 2, "B"), client(w.port, 2, "p")
    ha, hb = sub(a, "orders", "GROUP", "billing"), sub(b, "orders", "GROUP", "audit")
    wa, wb = Waiting(a, ha, settle=0.05), Waiting(b, hb)
    p.execute_command("MPUB", "orders", 2, "x", "y")
    assert payloads(wa.reply()) == ["x", "y"] and payloads(wb.reply()) == ["x", "y"]


def test_a_seek_while_a_pull_waits_gives_its_delivery_the_new_epoch(w):
    c, s, p = client(w.port, 2, "c"), client(w.port, 2, "c"), client(w.port, 2, "p")
    h = sub(c, "orders", "GROUP", "g")
    waiting = Waiting(c, h)
    assert s.execute_command("SEEK", h, "LATEST") == 1
    p.execute_command("PUB", "orders", "after the seek")
    (got,) = waiting.reply()
    assert got["payload"] == "after the seek" and got["epoch"] == 1


def test_a_member_with_max_waiting_gets_no_more_than_its_max(w):
    c, p = client(w.port, 2, "c"), client(w.port, 2, "p")
    h = sub(c, "orders", "GROUP", "g", "MAX", 2)
    waiting = Waiting(c, h)
    p.execute_command("MPUB", "orders", 5, "a", "b", "c", "d", "e")
    assert payloads(waiting.reply()) == ["a", "b"]
    assert deliveries(c.execute_command("PULL", h, "COUNT", 10)) == []


def test_a_qos_0_member_waiting_gets_an_unleased_delivery(w, redis_url):
    c, p = client(w.port, 2, "c"), client(w.port, 2, "p")
    h = sub(c, "orders", "GROUP", "g", "QOS", 0)
    waiting = Waiting(c, h)
    p.execute_command("PUB", "orders", "once")
    (got,) = waiting.reply()
    assert got["payload"] == "once" and got["tag"].startswith("q")
    assert c.execute_command("ACK", h, got["tag"]) == 0  # nothing to settle: never leased


def test_the_owner_of_an_lmq_waiting_gets_its_message_with_the_lmq(w):
    c, p = client(w.port, 2, "c"), client(w.port, 2, "p")
    h = sub(c, "chat", "LMQ", "s1")
    waiting = Waiting(c, h)
    p.execute_command("PUB", "chat", "hello", "LMQ", "s1")
    (got,) = waiting.reply()
    assert got["payload"] == "hello" and got["lmq"] == "s1"


def test_a_block_that_runs_out_as_the_publish_lands_loses_nothing_and_holds_nothing(w):
    """Whichever comes first, the message is in the reply or free for the next PULL at once (not
    under a lease nobody will settle)."""
    c, p = client(w.port, 2, "c"), client(w.port, 2, "p")
    h = sub(c, "orders", "GROUP", "g", "LOCK", 30_000)
    for i in range(30):
        waiting = Waiting(c, h, count=1, block_ms=100, settle=0.0)
        time.sleep(0.09 + (i % 5) * 0.005)
        p.execute_command("PUB", "orders", f"m{i}")
        got = waiting.reply()
        if not got:
            got = deliveries(c.execute_command("PULL", h))
        assert payloads(got) == [f"m{i}"], f"round {i}"
        assert c.execute_command("ACK", h, got[0]["tag"]) == 1


def _count_fence_calls(w: Any, monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    fences = w.worker.core.fences
    calls = [0]
    real = fences.call

    async def counted(fence: str, keys: list[str], args: list[Any]) -> Any:
        if fence == name:
            calls[0] += 1
        return await real(fence, keys, args)

    monkeypatch.setattr(fences, "call", counted)
    return calls


def test_a_publish_hands_its_messages_to_a_waiting_long_poll_which_looks_no_more(w, monkeypatch):
    c, p = client(w.port, 2, "c"), client(w.port, 2, "p")
    h = sub(c, "orders", "GROUP", "g")
    pulls = _count_fence_calls(w, monkeypatch, "pull")
    waiting = Waiting(c, h)
    assert pulls[0] == 1, "the long poll's first look"
    p.execute_command("MPUB", "orders", 2, "x", "y")
    got = waiting.reply()
    assert payloads(got) == ["x", "y"]
    assert pulls[0] == 1, "the messages came with the wake-up: no second look"
    assert c.execute_command("ACK", h, *[d["tag"] for d in got]) == 2  # leased as a PULL's checkouts are


def test_a_long_poll_on_the_publishing_worker_is_handed_its_messages_by_the_publish_not_by_pub_sub(w, monkeypatch):
    # the publish's reply says a long poll of this worker was handed to: it gets them then, and the
    # pub/sub copy of the wake-up (lost here) is not waited for
    wakeups = w.worker.services.wakeups
    dispatch = wakeups._dispatch

    def without_hand_offs(msg: dict[str, Any]) -> None:
        if isinstance(msg.get("data"), bytes) and msg["data"][:1] == b"H":
            return  # the hand-off's pub/sub copy never arrives
        dispatch(msg)

    monkeypatch.setattr(wakeups, "_dispatch", without_hand_offs)
    c, p = client(w.port, 2, "c"), client(w.port, 2, "p")
    h = sub(c, "orders", "GROUP", "g")
    pulls = _count_fence_calls(w, monkeypatch, "pull")
    waiting = Waiting(c, h, block_ms=5000)
    sent = time.monotonic()
    p.execute_command("MPUB", "orders", 2, "x", "y")
    got = waiting.reply()
    assert payloads(got) == ["x", "y"]
    assert waiting.result["at"] - sent < 1.5, "waited for its BLOCK to run out, then read it back"
    assert pulls[0] == 1, "handed with the publish's reply: no look after the first"


def test_a_long_poll_on_another_worker_is_handed_the_publishes_after_the_first_that_saw_it_wait(redis_url,
                                                                                               monkeypatch):
    with worker(redis_url) as consuming, worker(redis_url) as publishing:
        c, p = client(consuming.port, 2, "c"), client(publishing.port, 2, "p")
        h = sub(c, "orders", "GROUP", "g")
        pulls = _count_fence_calls(consuming, monkeypatch, "pull")
        first = Waiting(c, h)
        p.execute_command("PUB", "orders", "one")  # the publishing worker learns a long poll waits here
        assert payloads(first.reply()) == ["one"] and pulls[0] == 2, "woken, it looked again"
        second = Waiting(c, h)
        p.execute_command("PUB", "orders", "two")
        assert payloads(second.reply()) == ["two"] and pulls[0] == 3, "handed: one look, none after"


def test_a_long_poll_whose_client_hangs_up_gives_back_unread_what_was_handed_to_it(w, redis_url):
    from tests.helpers import RespConn

    other = client(w.port, 2, "other")
    ho = sub(other, "orders", "GROUP", "g")
    gone = RespConn(w.port)
    gone.hello(2, "gone")
    h = as_map(gone.call("SUB", "orders", "GROUP", "g"))["handle"]
    gone.send("PULL", h, "BLOCK", 5000)
    time.sleep(0.3)
    # the hang-up and a hand-off race: whichever wins, the message is free for another consumer at once
    gone.close()
    client(w.port, 2, "p").execute_command("PUB", "orders", "new")
    (d,) = wait_for(lambda: deliveries(other.execute_command("PULL", ho)), timeout=3, what="the message")
    assert d["payload"] == "new"
