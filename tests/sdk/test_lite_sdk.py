"""The SDK's lite subscriptions (broker/lite.py) against a real worker.

One worker for the module, in front of the session's private Redis; each test
uses its own topic and client ids. Redis is read directly to check what the
server holds (membership, markers, quota counts).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from fencemq.sdk.client import Client
from fencemq.config import Config
from fencemq.model import meta
from fencemq.model.keys import Keyspace, QueueRef
from fencemq.model.handles import Handle
from fencemq.sdk.lite import LiteSubscriptions
from fencemq.server.runner import WorkerThread
from tests.helpers import held_handles

KEYS = Keyspace("fmq")


def run(coro: Any, timeout: float = 60) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def served(redis_server: Any) -> Iterator[tuple[str, str]]:
    """(worker url, redis url): one worker for the module; tests use their own names."""
    with WorkerThread(Config(redis_url=redis_server.url, port=0, sweep_interval_ms=50)) as w:
        yield f"redis://127.0.0.1:{w.port}", redis_server.url


@pytest.fixture
def url(served: tuple[str, str]) -> str:
    return served[0]


@pytest.fixture
def r(served: tuple[str, str]) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(served[1], decode_responses=True)
    yield client
    client.close()


def member_fields(r: redis.Redis, topic: str, lmq: str, client: str, group: str) -> dict[str, str]:
    return meta.decode(r.hgetall(KEYS.queue(QueueRef(topic, lmq)).meta)).members.get((group, client), {})


def held(r: redis.Redis, client: str) -> set[str]:
    """lmqs the server holds for the client (its session's handles), as 'topic/lmq'."""
    return {f"{h.queue.topic}/{h.queue.lmq}" for h in map(Handle.decode, held_handles(r, client))}


async def until(predicate: Any, timeout: float = 5.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        await asyncio.sleep(0.02)


# -- the set --------------------------------------------------------------------------------------


def test_add_and_remove_keep_the_local_set_and_the_servers_subscriptions(url, r):
    async def main() -> None:
        async with await Client.connect(url, client_id="sdk-set") as c, \
                LiteSubscriptions(c, "sdk-set", group="g", interval=30) as lite:
            sub = await lite.add("a")
            await lite.add("b")
            await lite.add("a")  # again: no duplicate
            assert lite.lmqs == ["a", "b"] and lite.subscription("a").handle == sub.handle
            assert sub.owner == "sdk-set" and sub.mode == "exclusive"
            assert held(r, "sdk-set") == {"sdk-set/a", "sdk-set/b"}
            await lite.remove("a")
            await lite.remove("nope")  # not held: nothing to do
            assert lite.lmqs == ["b"] and held(r, "sdk-set") == {"sdk-set/b"}

    run(main())


def test_acking_a_delivery_of_an_lmq_no_longer_held_settles_nothing_and_asks_nothing(url, r):
    async def main() -> None:
        async with await Client.connect(url, client_id="sdk-late") as c, \
                await Client.connect(url, client_id="sdk-late-p") as p, \
                LiteSubscriptions(c, "sdk-late", interval=30) as lite:
            await lite.add("a")
            await lite.add("b")
            await p.publish("sdk-late", b"a1", lmq="a")
            await p.publish("sdk-late", b"b1", lmq="b")
            got = await lite.pull(10)
            assert sorted(d.lmq for d in got) == ["a", "b"]
            await lite.remove("a")  # a's checkout went back with the UNSUB
            assert await lite.ack(*got) == 1  # b's settled; a's is not ours to settle (no forged handle sent)

    run(main())


def test_the_heartbeat_task_syncs_the_full_set_every_interval(url, r):
    async def main() -> None:
        async with await Client.connect(url, client_id="sdk-hb") as c, \
                LiteSubscriptions(c, "sdk-hb", interval=0.1) as lite:
            await lite.add("kept")
            await c.subscribe("sdk-hb", lmq="stray")  # held on the server, not in the set
            assert held(r, "sdk-hb") == {"sdk-hb/kept", "sdk-hb/stray"}
            await until(lambda: lite.syncs >= 3, what="three heartbeats")
            assert held(r, "sdk-hb") == {"sdk-hb/kept"}, "the full-set SYNC unsubscribed the stray lmq"
            assert member_fields(r, "sdk-hb", "stray", "sdk-hb", "default") == {}
            assert lite.lmqs == ["kept"]

    run(main())


# -- evictions ------------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", [2, 3])
def test_a_preemption_is_surfaced_once_and_the_lmq_leaves_the_set_and_the_pulls(url, r, protocol):
    topic = f"sdk-evict{protocol}"

    async def main() -> None:
        seen: list[dict] = []
        async with await Client.connect(url, client_id=f"{topic}-a", protocol=protocol) as a, \
                await Client.connect(url, client_id=f"{topic}-b") as b, \
                LiteSubscriptions(a, topic, interval=0.2, on_unsubscribe=seen.append) as lite:
            await lite.add("x")
            await lite.add("y")
            await b.mpublish(topic, [b"x1"], lmq="x")
            await b.mpublish(topic, [b"y1"], lmq="y")
            await b.subscribe(topic, lmq="x")  # preempts a
            events = lite.evictions()
            event = await asyncio.wait_for(events.__anext__(), 5)
            assert (event["type"], event["lmq"], event["by"]) == ("unsubscribe", "x", f"{topic}-b")
            assert seen == [event]
            assert lite.lmqs == ["y"]
            got = await lite.pull(10)
            assert [(d.lmq, d.payload) for d in got] == [("y", b"y1")], "no PULL of the evicted lmq"
            assert await lite.ack(*got) == 1
            # the next SYNC no longer lists x: the server drops the marker and the membership
            await until(lambda: member_fields(r, topic, "x", f"{topic}-a", "default") == {}, what="the marker to go")
            assert held(r, f"{topic}-a") == {f"{topic}/y"}
            syncs = lite.syncs
            await until(lambda: lite.syncs >= syncs + 3, what="more heartbeats")
            assert seen == [event], "surfaced once, though the server re-sent it until the SDK dropped the lmq"

    run(main())


def test_a_resp3_client_learns_of_its_eviction_before_the_next_interval(url):
    async def main() -> None:
        async with await Client.connect(url, client_id="sdk-fast-a", protocol=3) as a, \
                await Client.connect(url, client_id="sdk-fast-b") as b, \
                LiteSubscriptions(a, "sdk-fast", interval=60) as lite:
            await lite.add("x")
            await until(lambda: lite.syncs == 0 and lite.lmqs == ["x"])
            t0 = time.monotonic()
            await b.subscribe("sdk-fast", lmq="x")
            event = await asyncio.wait_for(lite.evictions().__anext__(), 5)
            assert event["lmq"] == "x" and time.monotonic() - t0 < 2
            assert lite.lmqs == [] and lite.syncs >= 1  # the pushed notice made it SYNC at once

    run(main())


def test_a_stale_notice_about_an_lmq_held_again_does_not_drop_it(url, r):
    async def main() -> None:
        events: list[dict] = []
        async with await Client.connect(url, client_id="sdk-stale", protocol=3) as a, \
                await Client.connect(url, client_id="sdk-stale-p") as p, \
                LiteSubscriptions(a, "sdk-stale", interval=60, on_unsubscribe=events.append) as lite:
            sub = await lite.add("x")
            # A notice that arrives late (say, pushed after a re-add committed) names an lmq we own:
            a._on_push(a._link, [b"notice", {b"type": b"unsubscribe", b"reason": b"preempted", b"by": b"someone",
                                    b"topic": b"sdk-stale", b"lmq": b"x", b"handle": sub.handle.encode()}])
            assert await lite.pull() == [], "suspended until a SYNC says whether it is marked"
            await until(lambda: lite.syncs >= 1, what="the verifying SYNC")
            await p.publish("sdk-stale", b"still mine", lmq="x")
            assert [d.payload for d in await lite.pull()] == [b"still mine"]
            assert lite.lmqs == ["x"] and events == []
            assert meta.MARKER not in member_fields(r, "sdk-stale", "x", "sdk-stale", "default")

    run(main())


def test_adding_an_evicted_lmq_again_preempts_back(url, r):
    async def main() -> None:
        async with await Client.connect(url, client_id="sdk-back-a") as a, \
                await Client.connect(url, client_id="sdk-back-b") as b, \
                LiteSubscriptions(a, "sdk-back", interval=0.1) as lite:
            await lite.add("x")
            sb = await b.subscribe("sdk-back", lmq="x")
            await asyncio.wait_for(lite.evictions().__anext__(), 5)
            await lite.add("x")
            assert lite.lmqs == ["x"]
            await b.publish("sdk-back", b"back", lmq="x")
            assert [d.payload for d in await lite.pull()] == [b"back"]
            assert await sb.pull() == []  # b is fenced now
            assert member_fields(r, "sdk-back", "x", "sdk-back-b", "default")[meta.MARKER] == "sdk-back-a"

    run(main())


def test_an_lmq_the_server_no_longer_knows_is_surfaced_as_gone(url):
    async def main() -> None:
        async with await Client.connect(url, client_id="sdk-gone") as a:
            lite = LiteSubscriptions(a, "sdk-gone", interval=60)
            await lite.start()
            await lite.add("x")
            await lite.add("y")
            await a.heartbeat(sync=("sdk-gone", "default", ["y"]))  # someone else's SYNC dropped x
            assert await lite.pull(5) == []
            event = await asyncio.wait_for(lite.evictions().__anext__(), 5)
            assert (event["reason"], event["lmq"]) == ("gone", "x")
            assert lite.lmqs == ["y"]
            await lite.aclose()
            assert [e async for e in lite.evictions()] == []  # closed: the iterator ends

    run(main())


# -- consuming ------------------------------------------------------------------------------------


def test_pull_takes_the_held_lmqs_in_turn(url):
    async def main() -> None:
        async with await Client.connect(url, client_id="sdk-rr") as c, \
                LiteSubscriptions(c, "sdk-rr", interval=60) as lite:
            for lmq in ("a", "b", "c"):
                await lite.add(lmq)
                await c.mpublish("sdk-rr", [f"{lmq}{i}".encode() for i in range(4)], lmq=lmq)
            firsts = []
            for _ in range(3):
                batch = await lite.pull(2)
                assert len(batch) == 2 and len({d.lmq for d in batch}) == 1
                firsts.append(batch[0].lmq)
                assert await lite.ack(*batch) == 2
            assert sorted(firsts) == ["a", "b", "c"], "each lmq goes first in turn"
            big = await lite.pull(100)  # one call fills up across every lmq
            assert sorted(d.payload for d in big) == [b"a2", b"a3", b"b2", b"b3", b"c2", b"c3"]
            assert await lite.ack(*big) == 6

    run(main())


def test_iter_yields_deliveries_of_every_held_lmq(url):
    async def main() -> None:
        async with await Client.connect(url, client_id="sdk-iter") as c, \
                LiteSubscriptions(c, "sdk-iter", interval=60) as lite:
            await lite.add("a")
            await lite.add("b")
            got = []

            async def consume() -> None:
                async for d in lite.iter(count=10, idle_s=0.01):
                    got.append(d.payload)
                    await lite.ack(d)
                    if len(got) == 4:
                        return

            task = asyncio.ensure_future(consume())
            await c.mpublish("sdk-iter", [b"a0", b"a1"], lmq="a")
            await c.mpublish("sdk-iter", [b"b0", b"b1"], lmq="b")
            await asyncio.wait_for(task, 5)
            assert sorted(got) == [b"a0", b"a1", b"b0", b"b1"]

    run(main())


# -- several (topic, group) on one client, other notices, cancel-safety ---------------------------


def test_two_topics_on_one_client_keep_their_own_sets_and_evictions(url, r):
    async def main() -> None:
        async with await Client.connect(url, client_id="sdk-two", protocol=2) as a, \
                await Client.connect(url, client_id="sdk-two-b") as b, \
                LiteSubscriptions(a, "sdk-two-1", interval=0.1) as one, \
                LiteSubscriptions(a, "sdk-two-2", interval=0.1) as two:
            await one.add("x")
            await two.add("x")
            await b.subscribe("sdk-two-2", lmq="x")
            event = await asyncio.wait_for(two.evictions().__anext__(), 5)
            assert event["topic"] == "sdk-two-2"
            await until(lambda: one.syncs >= 3 and two.syncs >= 3)
            assert one.lmqs == ["x"] and two.lmqs == []
            assert held(r, "sdk-two") == {"sdk-two-1/x"}
            with pytest.raises(ValueError):
                await LiteSubscriptions(a, "sdk-two-1", interval=1).start()

    run(main())


def test_other_notices_drained_by_the_heartbeat_reach_on_other_notice(url):
    async def main() -> None:
        others: list[dict] = []
        async with await Client.connect(url, client_id="sdk-other", protocol=2) as a, \
                LiteSubscriptions(a, "sdk-other", interval=0.1, on_other_notice=others.append, lock_ms=100) as lite:
            await lite.add("x")
            await a.publish("sdk-other", b"slow", lmq="x")
            assert len(await lite.pull()) == 1  # never acked: the lease runs out
            await until(lambda: others, what="the message_timeout notice")
            assert others[0]["type"] == "message_timeout" and others[0]["lmq"] == "x"
            assert lite.lmqs == ["x"]

    run(main())


def test_closing_or_cancelling_mid_call_leaves_the_client_usable(url, r):
    async def main() -> None:
        async with await Client.connect(url, client_id="sdk-cancel") as c:
            lite = LiteSubscriptions(c, "sdk-cancel", interval=0.001)  # SYNCs back to back
            await lite.start()
            await lite.add("x")
            for _ in range(20):
                await asyncio.sleep(0.003)
                pulling = asyncio.ensure_future(lite.pull(5))
                await asyncio.sleep(0)
                pulling.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await pulling
            await lite.aclose()  # whatever SYNC was in flight is abandoned
            assert lite.closed and lite._task is None
            assert c.on_notice is None, "the notice hook is removed with the last LiteSubscriptions"
            assert await c.ping() == "PONG"
            await c.publish("sdk-cancel", b"m", lmq="x")
            sub = await c.subscribe("sdk-cancel", lmq="x")
            (d,) = await sub.pull()
            assert await sub.ack(d) == 1
            assert not c._link.pending
            with pytest.raises(RuntimeError):
                await lite.add("y")

    run(main())


def test_aclose_with_unsubscribe_leaves_every_lmq(url, r):
    async def main() -> None:
        async with await Client.connect(url, client_id="sdk-leave") as c:
            lite = await LiteSubscriptions(c, "sdk-leave", interval=60).start()
            await lite.add("x")
            await lite.add("y")
            await lite.aclose(unsubscribe=True)
            assert held(r, "sdk-leave") == set()
            assert r.hget(KEYS.session_lite_counts("sdk-leave"), "sdk-leave") is None  # counted off, to nothing

    run(main())
