"""The SDK as an application uses it: its surface, handing back what it never handed out, keeping locks while a
handler runs, notices once, a session taken over, deliveries named as on the wire. Against a real worker."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import time
from collections.abc import Iterator
from importlib import resources
from typing import Any

import pytest
import redis

import fencemq
from fencemq import Client, SessionTakenOver, SyncClient
from fencemq.config import Config
from fencemq.model.keys import Keyspace, QueueRef
from fencemq.server.runner import WorkerThread
from tests import helpers

LOCK_MS = 400  # a lease short enough to run out inside a test


def run(coro: Any, timeout: float = 60) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def worker_url(redis_server: Any) -> Iterator[str]:
    # max_failures 1: a NACK that counted a failure would dead-letter at once, so these tests see it
    with WorkerThread(Config(redis_url=redis_server.url, port=0, max_failures=1)) as w:
        yield f"redis://127.0.0.1:{w.port}"


@pytest.fixture
def r(redis_server: Any) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_server.url)
    yield c
    c.close()


def dead_letters(r: redis.Redis, topic: str) -> int:
    return r.llen(Keyspace().queue(QueueRef(topic)).dead)


# -- the surface ---------------------------------------------------------------------------------


def test_the_package_root_exports_both_clients_and_ships_its_type_information() -> None:
    assert fencemq.Client is Client and fencemq.SyncClient is SyncClient
    assert resources.files("fencemq").joinpath("py.typed").is_file()


@pytest.mark.parametrize("name", ["connect", "publish", "mpublish", "unpublish", "subscribe"])
def test_the_blocking_client_spells_out_every_option_of_the_async_one(name: str) -> None:
    blocking = inspect.signature(getattr(SyncClient, name)).parameters
    asynchronous = inspect.signature(getattr(Client, name)).parameters
    assert not [p for p in blocking.values() if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    assert [n for n in asynchronous if n not in ("self", "cls")] == [n for n in blocking if n not in ("self", "cls")]
    for param in blocking.values():
        if param.name not in ("self", "cls"):
            assert param.annotation is not inspect.Parameter.empty, f"{name}({param.name}) has no type"


def test_every_sub_option_is_a_subscribe_argument(worker_url: str, r: redis.Redis) -> None:
    with SyncClient.connect(worker_url, client_id="opts") as c:
        sub = c.subscribe("opts", group="g", strategy="sticky", offline="skip", lock_ms=5000)
        assert sub.mode == "shared"
        meta = {k.decode(): v.decode() for k, v in r.hgetall(Keyspace().queue(QueueRef("opts")).meta).items()}
        assert meta["g|g|strat"] == "sticky"
        assert "g|g|qoff" not in meta  # skipping offline members is the default
        c.subscribe("opts-q", group="g", offline="queue")
        meta = {k.decode(): v.decode() for k, v in r.hgetall(Keyspace().queue(QueueRef("opts-q")).meta).items()}
        assert meta["g|g|qoff"] == "1"
        with pytest.raises(ValueError, match="offline"):
            c.subscribe("opts", group="g", offline="later")  # type: ignore[arg-type]


# -- what was fetched and never handed out goes back -----------------------------------------------


def test_breaking_out_of_a_blocking_iteration_hands_back_the_rest_of_its_batch(worker_url: str,
                                                                               r: redis.Redis) -> None:
    with SyncClient.connect(worker_url, client_id="brk-p") as p, \
            SyncClient.connect(worker_url, client_id="brk-a") as a, \
            SyncClient.connect(worker_url, client_id="brk-b") as b:
        first = a.subscribe("brk", group="g", start="earliest", lock_ms=300_000)
        second = b.subscribe("brk", group="g", start="earliest", lock_ms=300_000)
        for i in range(10):
            p.publish("brk", b"%d" % i)
        for d in first.iter(count=10):
            assert first.ack(d) == 1
            break
        # the other 9 went back at once (their 5-minute leases did not have to run out) ...
        got = second.pull(count=10)
        assert sorted(d.payload for d in got) == [b"%d" % i for i in range(1, 10)]
        # ... counting no failure: with max_failures 1 a counted one would have dead-lettered them
        assert {d.deliveries for d in got} == {2}
        assert dead_letters(r, "brk") == 0


def test_leaving_an_async_for_early_hands_back_the_rest(worker_url: str) -> None:
    async def main() -> None:
        async with Client(worker_url, client_id="abrk-p") as p, Client(worker_url, client_id="abrk-a") as a, \
                Client(worker_url, client_id="abrk-b") as b:
            first = await a.subscribe("abrk", group="g", start="earliest", lock_ms=300_000)
            second = await b.subscribe("abrk", group="g", start="earliest", lock_ms=300_000)
            await p.mpublish("abrk", [b"%d" % i for i in range(6)])
            async for d in first:
                await first.ack(d)
                break
            gc.collect()  # the abandoned iterator is finalized: asyncio closes it in a task
            got: list[Any] = []
            deadline = time.monotonic() + 5
            while len(got) < 5 and time.monotonic() < deadline:
                got += await second.pull(10, block_ms=200)
            assert sorted(d.payload for d in got) == [b"%d" % i for i in range(1, 6)]

    run(main())


def test_closing_the_client_hands_back_what_its_iterators_hold(worker_url: str) -> None:
    async def main() -> None:
        async with Client(worker_url, client_id="cls-p") as p, Client(worker_url, client_id="cls-b") as b:
            a = await Client.connect(worker_url, client_id="cls-a")
            first = await a.subscribe("cls", group="g", start="earliest", lock_ms=300_000)
            second = await b.subscribe("cls", group="g", start="earliest", lock_ms=300_000)
            await p.mpublish("cls", [b"%d" % i for i in range(4)])
            it = first.iter(count=4)
            handed = await it.__anext__()  # in the application's hands: stays leased to it
            await a.close()
            got = await second.pull(10)
            assert sorted(d.payload for d in got) == [b"1", b"2", b"3"]
            assert handed.payload == b"0"

    run(main())


def test_a_nack_counts_a_failure_and_a_release_does_not(worker_url: str, r: redis.Redis) -> None:
    with SyncClient.connect(worker_url, client_id="rel-p") as p, \
            SyncClient.connect(worker_url, client_id="rel-c") as c:
        sub = c.subscribe("rel", group="g", start="earliest")
        p.mpublish("rel", [b"a", b"b"])
        a, b = sub.pull(count=2)
        assert sub.nack(a, release=True) == 1
        assert sub.nack(b) == 1  # max_failures 1: dead-lettered
        assert [d.payload for d in sub.pull(count=2)] == [b"a"]
        assert dead_letters(r, "rel") == 1
        with pytest.raises(Exception, match="DISCARD or RELEASE"):
            c.execute("NACK", sub.handle, "1", "DISCARD", "RELEASE")


# -- locks kept while a handler runs -------------------------------------------------------------


@pytest.mark.parametrize("renew", [True, False])
def test_an_iteration_can_keep_its_locks_while_the_handler_outlasts_them(worker_url: str, renew: bool) -> None:
    with SyncClient.connect(worker_url, client_id=f"rnw-p-{renew}") as p, \
            SyncClient.connect(worker_url, client_id=f"rnw-c-{renew}") as c:
        topic = f"rnw-{renew}"
        sub = c.subscribe(topic, group="g", start="earliest", lock_ms=LOCK_MS)
        p.mpublish(topic, [b"slow", b"next"])
        settled = []
        for d in sub.iter(count=2, renew_locks=renew):
            time.sleep(3 * LOCK_MS / 1000)  # a handler slower than its lease
            settled.append(sub.ack(d))
            if len(settled) == 2:
                break
        # renewed: both acks settle, the second one too (its lock was kept while the first was handled)
        assert settled == ([1, 1] if renew else [0, 0])[: len(settled)]


def test_a_renewing_block_keeps_a_pulled_delivery(worker_url: str) -> None:
    async def main() -> None:
        async with Client(worker_url, client_id="blk-p") as p, Client(worker_url, client_id="blk-c") as c:
            sub = await c.subscribe("blk", group="g", start="earliest", lock_ms=LOCK_MS)
            await p.publish("blk", b"x")
            [d] = await sub.pull()
            async with sub.renewing(d) as renewer:
                await asyncio.sleep(3 * LOCK_MS / 1000)
            assert renewer.renewed >= 2
            assert await sub.ack(d) == 1
            [e] = [x async for x in _one(sub)]
            assert e is None  # nothing came back meanwhile

    async def _one(sub: Any) -> Any:
        got = await sub.pull(block_ms=100)
        yield got[0] if got else None

    run(main())


def test_the_renewer_uses_the_lock_the_worker_announced(worker_url: str) -> None:
    with SyncClient.connect(worker_url, client_id="ann") as c:
        assert c.default_lock_ms == Config().default_lock_ms
        sub = c.subscribe("ann", group="g")
        assert sub.aio.effective_lock_ms == Config().default_lock_ms
        assert c.subscribe("ann2", group="g", lock_ms=1234).aio.effective_lock_ms == 1234


# -- a session taken over ------------------------------------------------------------------------


def test_a_client_whose_session_is_taken_over_is_told_so(worker_url: str) -> None:
    async def main() -> None:
        old = await Client.connect(worker_url, client_id="twin-t")
        sub = await old.subscribe("tko", group="g")
        pending = asyncio.ensure_future(sub.pull(block_ms=10_000))
        await asyncio.sleep(0.1)
        async with Client(worker_url, client_id="twin-t", takeover=True) as new:
            assert await new.ping() == "PONG"
            with pytest.raises(SessionTakenOver, match="taken over by another connection"):
                await asyncio.wait_for(pending, 5)
            with pytest.raises(SessionTakenOver):
                await old.ping()
        await old.close()

    run(main())


def test_takeover_needs_a_client_id() -> None:
    with pytest.raises(ValueError, match="client_id"):
        Client("redis://127.0.0.1:1", takeover=True)


# -- deliveries named as on the wire ---------------------------------------------------------------


@pytest.mark.parametrize("protocol", [2, 3])
def test_a_delivery_carries_its_publish_time_as_ts_and_its_producer(worker_url: str, protocol: int) -> None:
    with SyncClient.connect(worker_url, client_id=f"dlv-p{protocol}", protocol=protocol) as p, \
            SyncClient.connect(worker_url, client_id=f"dlv-c{protocol}", protocol=protocol) as c, \
            contextlib.closing(redis.Redis.from_url(worker_url)) as anonymous:
        topic = f"dlv{protocol}"
        sub = c.subscribe(topic, group="g", start="earliest")
        before = int(time.time() * 1000)
        p.publish(topic, b"named", headers={"k": "v"})
        anonymous.execute_command("PUB", topic, "anonymous")
        named, unnamed = sub.pull(count=2)
        assert named.producer == f"dlv-p{protocol}" and named.headers == {"k": "v"}
        assert unnamed.producer is None
        assert abs(named.ts - before) < 60_000
        assert not hasattr(named, "published_ms")


# -- prefetch: the next PULL rides with the ACK that finishes a full batch -------------------------


def checkouts(r: redis.Redis, topic: str) -> int:
    return len(helpers.checkout_records(r, Keyspace().queue(QueueRef(topic))))


def test_without_prefetch_settling_a_batch_checks_nothing_out_and_with_it_the_next_batch_goes_out(
        worker_url: str, r: redis.Redis) -> None:
    with SyncClient.connect(worker_url, client_id="pf-p") as p, SyncClient.connect(worker_url, client_id="pf-c") as c:
        plain = c.subscribe("pf-off", group="g", start="earliest")
        eager = c.subscribe("pf-on", group="g", start="earliest", prefetch=True)
        for topic in ("pf-off", "pf-on"):
            p.mpublish(topic, [b"%d" % i for i in range(25)])
        for sub, topic in ((plain, "pf-off"), (eager, "pf-on")):
            assert sub.ack(*sub.pull(10)) == 10
        assert checkouts(r, "pf-off") == 0  # the default fetches only when asked
        assert checkouts(r, "pf-on") == 10  # the next ten went out with the ACK
        got = [eager.pull(10), eager.pull(10)]  # the second ACK is not sent yet: no prefetch behind it
        assert [len(b) for b in got] == [10, 5]
        eager.ack(*got[0], *got[1])
        assert [d.payload for d in got[0] + got[1]] == [b"%d" % i for i in range(10, 25)]
        assert {d.deliveries for d in got[0] + got[1]} == {1}


def test_a_prefetched_batch_a_consumer_never_takes_goes_back_at_close_counting_no_failure(
        worker_url: str, r: redis.Redis) -> None:
    async def main() -> None:
        async with Client(worker_url, client_id="pfc-p") as p, Client(worker_url, client_id="pfc-b") as b:
            async with Client(worker_url, client_id="pfc-a") as a:
                first = await a.subscribe("pfc", group="g", start="earliest", prefetch=True, lock_ms=300_000)
                await p.mpublish("pfc", [b"%d" % i for i in range(8)])
                await first.ack(*await first.pull(4))  # ... and 4-7 are prefetched, never taken
            second = await b.subscribe("pfc", group="g", lock_ms=300_000)
            got = await second.pull(10, block_ms=2000)
            assert sorted(d.payload for d in got) == [b"%d" % i for i in range(4, 8)]
            assert {d.deliveries for d in got} == {2} and dead_letters(r, "pfc") == 0

    run(main())


def test_a_prefetched_batch_older_than_a_third_of_its_lock_goes_back_and_is_fetched_again(
        worker_url: str, r: redis.Redis) -> None:
    with SyncClient.connect(worker_url, client_id="pfs-p") as p, SyncClient.connect(worker_url, client_id="pfs-c") as c:
        sub = c.subscribe("pfs", group="g", start="earliest", prefetch=True, lock_ms=LOCK_MS)
        p.mpublish("pfs", [b"%d" % i for i in range(6)])
        sub.ack(*sub.pull(3))
        time.sleep(LOCK_MS / 1000 / 3 + 0.05)  # the prefetched leases are a third gone
        got = sub.pull(3)
        assert [d.payload for d in got] == [b"3", b"4", b"5"]
        assert {d.deliveries for d in got} == {2}, "handed back and checked out afresh, its lease whole"
        assert sub.ack(*got) == 3 and dead_letters(r, "pfs") == 0


def test_a_message_published_for_later_comes_when_due_and_one_cancelled_never(worker_url: str, r: redis.Redis) -> None:
    with SyncClient.connect(worker_url, client_id="later") as c:
        sub = c.subscribe("later", group="g")
        keep = c.publish("later", b"keep", delay_ms=300)
        gone = c.mpublish("later", [b"x", b"y"], delay_ms=300)
        assert keep.startswith("s") and all(i.startswith("s") for i in gone)
        assert c.unpublish("later", gone) == 2
        got = []
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            got = sub.pull(10)
        assert [d.payload for d in got] == [b"keep"]
