"""Seek fenced by epochs, through the SDK against a real worker (issue 5, "Done means").

The race test is the heart of it: a consumer task pulls continuously into a
local buffer that an "application" task drains, while a seeker task on the
same client (SEEK must come from the handle's own client id) seeks back and
forth across a log of a few thousand messages. Whatever the interleaving, once
a SEEK has returned nothing read before it may reach the application.

The topics these tests rewind over keep their messages (a retention policy,
set before the worker starts): without one, what every group has settled
leaves the log, and SEEK rewinds only to what some group has not
(docs/operations.md, "Retention"; the last test here).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest

from fencemq.sdk.client import Client, Subscription
from fencemq.config import Config
from fencemq.errors import NoPermission
from fencemq.model.keys import Keyspace, QueueRef
from fencemq.model.handles import Handle
from fencemq.model.messages import Delivery
from fencemq.fences.core import Core
from tests import helpers
from tests.helpers import worker

KEYS = Keyspace()


def run(coro: Any, timeout: float = 60) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def url(w) -> str:
    return f"redis://127.0.0.1:{w.port}"


KEPT = ("log", "race", "iter")  # the topics the tests rewind over keep what was consumed


@pytest.fixture
def w(redis_url):
    direct = helpers.direct(redis_url)
    direct.hset(KEYS.retention, mapping={t: "1000000 0 0" for t in KEPT})
    direct.close()
    with worker(redis_url) as started:
        yield started


async def publish(c: Client, topic: str, n: int, start: int = 0) -> list[int]:
    """n messages with payloads start..start+n-1, in MPUB batches of 1000; their ids."""
    ids: list[int] = []
    for first in range(start, start + n, 1000):
        batch = [b"%d" % i for i in range(first, min(first + 1000, start + n))]
        ids += [int(i) for i in await c.mpublish(topic, batch)]
    return ids


def ids_of(batch: list[Delivery]) -> list[int]:
    return [int(d.id) for d in batch]


@contextlib.asynccontextmanager
async def subscribed(u: str, name: str, topic: str, n: int,
                     **options: Any) -> AsyncIterator[tuple[Client, Subscription]]:
    """A client `name` subscribed to `topic` from the earliest, after n messages were published."""
    async with await Client.connect(u, client_id=name) as c:
        await publish(c, topic, n)
        yield c, await c.subscribe(topic, start="earliest", **options)


@contextlib.asynccontextmanager
async def members(url_a: str, url_b: str, names: tuple[str, str], n: int,
                  **group: Any) -> AsyncIterator[tuple[Client, Subscription, Subscription]]:
    """Two clients in one group of topic `log` (n messages, read from the earliest): (b, a's sub, b's sub)."""
    async with await Client.connect(url_a, client_id=names[0]) as a, \
            await Client.connect(url_b, client_id=names[1]) as b:
        await publish(a, "log", n)
        sa = await a.subscribe("log", start="earliest", **group)
        sb = await b.subscribe("log", **group)
        yield b, sa, sb


async def drain(sub: Subscription, limit: int = 100) -> list[Delivery]:
    """Everything the subscription can pull right now."""
    got: list[Delivery] = []
    while batch := await sub.pull(limit):
        got += batch
    return got


# -- the race ------------------------------------------------------------------------------------------


class Race:
    """Bookkeeping of one race run; every check that can be made on the spot is."""

    def __init__(self, sub: Subscription) -> None:
        self.sub = sub
        self.targets = {sub.epoch: 1}  # epoch -> where the seek that made it put the cursor
        self.returned = [sub.epoch]  # epochs in the order their SEEKs returned to the seeker
        self.known = [sub.epoch]  # epochs in the order their SEEK replies reached the SDK's reader
        self.replies: list[list[Delivery]] = []  # every PULL reply, as the SDK's reader decoded it
        self.accepted: list[tuple[int, int]] = []  # (epoch, id) in the order the application took them
        self.stale: list[str] = []  # tags of every batch dropped, by the SDK or from the buffer
        self.stats: Counter[str] = Counter()
        read_batch, read_seek = sub._read_batch, sub._read_seek

        def recording(raw: Any) -> list[Delivery]:
            batch = read_batch(raw)
            self.replies.append(batch)
            return batch

        def seek_reply(raw: Any) -> int:
            epoch = read_seek(raw)
            self.known.append(epoch)
            return epoch

        # Both run in the SDK's reader, in wire order: the moment a reply "returned to the SDK".
        sub._read_batch = recording  # type: ignore[method-assign]
        sub._read_seek = seek_reply  # type: ignore[method-assign]

    async def consume(self, buffer: asyncio.Queue, stop: asyncio.Event) -> None:
        """Pull continuously (COUNT 10, BLOCK 50) into the local buffer."""
        sub = self.sub
        while not stop.is_set():
            replies, dropped = len(self.replies), sub.dropped
            got = await sub.pull(10, block_ms=50)
            assert len(self.replies) == replies + 1
            reply = self.replies[-1]
            assert len({d.epoch for d in reply}) <= 1, "one PULL reply, one epoch"
            if got:  # kept whole, and not older than any SEEK reply the SDK has read
                assert got == reply and sub.dropped == dropped
                assert got[0].epoch >= self.known[-1]
                self.stats["batches kept by the SDK"] += 1
                await buffer.put(got)
            elif reply:  # dropped whole
                assert sub.dropped == dropped + len(reply)
                assert reply[0].epoch < sub.epoch
                self.stats["batches dropped by the SDK"] += 1
                self.stale += [d.tag for d in reply]

    async def apply(self, buffer: asyncio.Queue, rng: random.Random) -> None:
        """The application: reads the buffer, a little slower than the consumer fills it.

        The SDK fences what PULL hands over; this buffer is the application's, so a batch in it
        older than the SDK's current epoch (``sub.epoch``, raised as soon as a SEEK reply is read)
        is dropped here, whole."""
        sub = self.sub
        while (batch := await buffer.get()) is not None:
            if batch[0].epoch < sub.epoch:  # buffered before a seek committed: dropped whole
                self.stats["buffered batches dropped"] += 1
                self.stale += [d.tag for d in batch]
                continue
            assert batch[0].epoch >= self.known[-1] >= self.returned[-1]
            self.accepted += [(d.epoch, int(d.id)) for d in batch]
            self.stats["batches accepted"] += 1
            settled = await sub.ack(*batch)  # may race a seek: then it settles nothing
            assert 0 <= settled <= len(batch)
            if rng.random() < 0.5:
                await asyncio.sleep(rng.uniform(0, 0.01))

    async def seek_back_and_forth(self, seeks: int, low: range, high: range, rng: random.Random) -> None:
        sub = self.sub
        for k in range(seeks):
            target = rng.choice(low if k % 2 == 0 else high)
            epoch = await sub.seek(id=target)
            assert epoch > self.returned[-1], "epochs only grow"
            assert epoch == self.known[-1]
            self.targets[epoch] = target
            self.returned.append(epoch)
            if self.stale:  # tags of older epochs settle nothing, whoever dropped them
                tags, self.stale = self.stale[:1000], self.stale[1000:]
                assert await sub.ack(*tags) == 0
                self.stats["stale tags acked"] += len(tags)
            await asyncio.sleep(rng.uniform(0, 0.03))

    def check_reads(self) -> None:
        """Per epoch, the application saw target, target+1, ... in order; epochs never went back."""
        epochs = [e for e, _ in self.accepted]
        assert epochs == sorted(epochs)
        by_epoch: dict[int, list[int]] = {}
        for e, i in self.accepted:
            by_epoch.setdefault(e, []).append(i)
        for e, ids in by_epoch.items():
            start = self.targets[e]
            assert ids == list(range(start, start + len(ids))), f"epoch {e} (seek to {start}) read {ids[:20]}"


def test_no_delivery_read_before_a_seek_reaches_the_application_after_the_seek_returned(w):
    rng = random.Random(20240605)

    async def main() -> None:
        async with subscribed(url(w), "racer", "race", 3000) as (_, sub):
            race = Race(sub)
            buffer: asyncio.Queue = asyncio.Queue()
            stop = asyncio.Event()
            consumer = asyncio.create_task(race.consume(buffer, stop))
            application = asyncio.create_task(race.apply(buffer, rng))
            await race.seek_back_and_forth(150, range(1, 1000), range(1800, 2950), rng)
            stop.set()
            await consumer
            await buffer.put(None)
            await application
            race.check_reads()
            assert race.returned == sorted(set(race.returned)) == race.known and len(race.returned) == 151
            if race.stale:
                assert await sub.ack(*race.stale[:1000]) == 0
            print(f"\n150 seeks; {len(race.accepted)} deliveries accepted; {dict(race.stats)}")
            dropped = race.stats["batches dropped by the SDK"] + race.stats["buffered batches dropped"]
            assert dropped > 0, "the race never happened: nothing was in flight or buffered across a seek"
            assert race.stats["batches accepted"] > 150

    run(main(), timeout=90)


def test_the_sdk_iterator_yields_nothing_read_before_a_seek_that_returned_mid_batch(w):
    async def main() -> None:
        async with subscribed(url(w), "iterating", "iter", 20) as (_, sub):
            seen: list[Delivery] = []
            epoch = None
            async for d in sub.iter(count=5, block_ms=50):
                assert epoch is None or d.epoch >= epoch, f"delivery {d.id} of epoch {d.epoch} after seek {epoch}"
                seen.append(d)
                if len(seen) == 2:
                    epoch = await sub.seek(id=15)  # three of the five of this batch are still buffered
                if len(seen) == 6:
                    break
            assert [int(d.id) for d in seen] == [1, 2, 15, 16, 17, 18]

    run(main())


def test_a_take_right_after_a_seek_on_a_full_push_mailbox_gets_the_seek_target(w):
    async def main() -> None:
        async with subscribed(url(w), "pushed", "log", 10, push=True, capacity=3) as (_, sub):
            assert int((await sub.take()).id) == 1  # the mailbox is full again: 2, 3, 4
            epoch = await sub.seek(id=7)
            d = await sub.take()
            assert d is not None and (int(d.id), d.epoch) == (7, epoch)

    run(main())


# -- each target ---------------------------------------------------------------------------------------


def _targets(ids: list[int], ts: dict[int, int]) -> dict[str, tuple[dict, list[int]]]:
    """seek kwargs -> the ids a pull reads after it (ids 1..9 published in three bursts)."""
    return {
        "earliest": ({"where": "earliest"}, ids),
        "latest": ({"where": "latest"}, []),
        "id 5": ({"id": 5}, ids[4:]),
        "id past the end": ({"id": 1000}, []),
        "time of a message": ({"time_ms": ts[4]}, ids[3:]),  # at or after: that message itself
        "time between bursts": ({"time_ms": ts[6] + 1}, ids[6:]),
        "time 0": ({"time_ms": 0}, ids),
        "time in the future": ({"time_ms": ts[9] + 60_000}, []),
    }


@pytest.mark.parametrize("target", list(_targets(list(range(1, 10)), dict.fromkeys(range(1, 10), 0))))
def test_seek_moves_the_cursor_to_its_target_under_a_higher_epoch(w, target):
    async def main() -> None:
        async with await Client.connect(url(w), client_id="seeker") as c:
            for burst in range(3):  # three bursts with distinct publish times
                await publish(c, "log", 3, start=3 * burst)
                await asyncio.sleep(0.02)
            sub = await c.subscribe("log", start="earliest")
            first = await drain(sub)
            ts = {int(d.id): d.ts for d in first}
            assert ts[4] > ts[3] and ts[7] > ts[6]
            kwargs, expected = _targets(ids_of(first), ts)[target]
            assert await sub.ack(*first[:2]) == 2
            before = sub.epoch
            epoch = await sub.seek(**kwargs)
            assert epoch == before + 1 and sub.epoch == epoch
            assert await sub.ack(*first[2:]) == 0  # released by the seek: stale
            after = await drain(sub)
            assert ids_of(after) == expected and {d.epoch for d in after} <= {epoch}
            new = await c.publish("log", b"new")
            assert ids_of(await sub.pull(10)) == [int(new)]  # and on from there
            assert sub.dropped == 0

    run(main())


def test_seek_below_retention_lands_on_the_oldest_retained_message(redis_url):
    with worker(redis_url, retention_maxlen=50) as w:
        async def main() -> None:
            async with subscribed(url(w), "late", "short", 200) as (_, sub):
                for kwargs in ({"id": 1}, {"time_ms": 0}, {"where": "earliest"}):
                    await sub.seek(**kwargs)
                    assert ids_of(await drain(sub)) == list(range(151, 201))
                await sub.seek(id=160)  # inside the retained range: exactly there
                assert ids_of(await sub.pull(1)) == [160]
            # the core API says when it clamped (the SEEK reply carries only the epoch)
            r = helpers.direct_async(redis_url)
            try:
                queues = Core(r, Config(redis_url=redis_url))
                h = Handle(QueueRef("short"), "~late", "late")
                _, cursor, clamped = await queues.seek.move(h, "id", 1)
                assert (cursor, clamped) == (151, True)
                assert (await queues.seek.move(h, "id", 170))[1:] == (170, False)
                assert (await queues.seek.move(h, "time", 0))[1:] == (151, True)
            finally:
                await r.aclose()

        run(main())


# -- concurrent seeks ----------------------------------------------------------------------------------


def test_two_seeks_in_flight_on_one_client_get_consecutive_epochs_and_the_later_one_wins(w):
    async def main() -> None:
        async with subscribed(url(w), "twice", "log", 100) as (_, sub):
            await sub.pull(5)
            for _ in range(10):
                low, high = await asyncio.gather(sub.seek(id=10), sub.seek(id=60))
                assert high == low + 1 and sub.epoch == high
                got = await sub.pull(3)
                assert ids_of(got) == [60, 61, 62] and {d.epoch for d in got} == {high}
                high, low = await asyncio.gather(sub.seek(id=60), sub.seek(id=10))
                assert low == high + 1
                assert ids_of(await sub.pull(1)) == [10]
            assert sub.dropped == 0

    run(main())


def test_concurrent_seeks_from_two_clients_on_two_workers_yield_distinct_epochs_and_the_last_commit_wins(redis_url):
    rng = random.Random(7)
    with worker(redis_url) as w1, worker(redis_url) as w2:
        async def main() -> None:
            async with members(url(w1), url(w2), ("left", "right"), 500, group="g") as (_, sa, sb):
                epochs: list[int] = []
                for _ in range(30):
                    ta, tb = rng.randrange(1, 500), rng.randrange(1, 500)
                    ea, eb = await asyncio.gather(sa.seek(id=ta), sb.seek(id=tb))
                    assert ea != eb and abs(ea - eb) == 1
                    assert min(ea, eb) > max(epochs, default=0)
                    epochs += sorted((ea, eb))
                    winner = ta if ea > eb else tb
                    (d,) = await (sa if rng.random() < 0.5 else sb).pull(1)
                    assert (int(d.id), d.epoch) == (winner, max(ea, eb))
                assert epochs == sorted(set(epochs)) and epochs[-1] == epochs[0] + 59

        run(main())


# -- reconnecting with an epoch --------------------------------------------------------------------------


async def _held_at_epoch(u: str, name: str, seeks: int) -> tuple[list[Delivery], int]:
    """A client that seeks `seeks` times, pulls three and goes away; its checkouts and epoch."""
    async with await Client.connect(u, client_id=name) as c:
        await publish(c, "log", 10)
        sub = await c.subscribe("log", start="earliest")
        for _ in range(seeks):
            await sub.seek("earliest")
        held = await sub.pull(3)
        assert {d.epoch for d in held} == {seeks}
        return held, sub.epoch


def test_subscribing_again_with_a_higher_epoch_raises_the_servers_and_makes_old_checkouts_stale(w):
    async def main() -> None:
        held, server_epoch = await _held_at_epoch(url(w), "ahead", 2)
        async with await Client.connect(url(w), client_id="ahead") as c:
            sub = await c.subscribe("log", epoch=7)
            assert sub.epoch == 7 > server_epoch
            assert await sub.ack(*held) == 0 and await sub.renew(*held) == 0
            again = await sub.pull(3)
            assert ids_of(again) == ids_of(held)  # requeued in order, under the adopted epoch
            assert {d.epoch for d in again} == {7} and {d.deliveries for d in again} == {2}
            assert await sub.ack(*again) == 3 and sub.dropped == 0

    run(main())


def test_subscribing_again_with_a_lower_epoch_keeps_the_servers_which_the_client_adopts(w):
    async def main() -> None:
        held, server_epoch = await _held_at_epoch(url(w), "behind", 3)
        async with await Client.connect(url(w), client_id="behind") as c:
            sub = await c.subscribe("log", epoch=1)
            assert sub.epoch == server_epoch == 3
            assert await sub.ack(*held) == 3  # not released: they are of the current epoch
            got = await sub.pull(10)
            assert ids_of(got) == list(range(4, 11)) and {d.epoch for d in got} == {3}
            assert sub.dropped == 0

    run(main())


def test_a_client_that_knows_a_higher_epoch_than_a_restored_server_is_not_filtered_out(w, redis_url):
    direct = helpers.direct(redis_url)

    async def main() -> None:
        async with subscribed(url(w), "survivor", "log", 10) as (c, sub):
            meta = KEYS.queue(QueueRef("log")).meta
            before = direct.dump(meta)
            for _ in range(3):
                await sub.seek("earliest")
            direct.restore(meta, 0, before, replace=True)  # the server comes back from an older copy
            again = await c.subscribe("log")
            got = await again.pull(10)
            assert len(got) == 10 and again.dropped == 0

    try:
        run(main())
    finally:
        direct.close()


# -- group kinds ------------------------------------------------------------------------------------------


def test_seek_on_a_single_active_group_is_the_active_members_and_releases_its_checkouts(w):
    async def main() -> None:
        async with members(url(w), url(w), ("active", "standby"), 10, group="sa", mode="single-active") as (_, sa, sb):
            held = await sa.pull(5)
            assert await sb.pull(5) == []
            epoch = await sa.seek(id=2)
            assert await sa.ack(*held) == 0
            assert ids_of(await sa.pull(3)) == [2, 3, 4] and await sb.pull(5) == []
            # a standby may not move the group's cursor under the active member
            held = await sa.pull(2)
            with pytest.raises(NoPermission):
                await sb.seek("earliest")
            assert await sa.ack(*held) == 2
            later = await sa.seek("earliest")
            assert later == epoch + 1
            got = await sa.pull(10)
            assert ids_of(got) == list(range(1, 11)) and {d.epoch for d in got} == {later}
            assert await sb.pull(5) == [] and sa.dropped == 0

    run(main())


def test_seek_on_a_shared_group_releases_every_members_checkouts_and_leaves_other_groups_alone(w, redis_url):
    direct = helpers.direct(redis_url)
    log = KEYS.queue(QueueRef("log"))

    async def main() -> None:
        async with members(url(w), url(w), ("m1", "m2"), 12, group="g") as (b, sa, sb):
            other = await b.subscribe("log", group="audit", start="earliest")
            ha, hb, ho = await sa.pull(4), await sb.pull(4), await other.pull(6)
            assert len(helpers.checkout_records(direct, log)) == 14
            epoch = await sa.seek("earliest")
            assert len(helpers.checkout_records(direct, log)) == 6  # only the other group's remain
            assert await sb.ack(*hb) == 0 and await sa.ack(*ha) == 0
            got_b = await sb.pull(5)  # b learns the new epoch from the reply itself
            got_a = await sa.pull(20)
            assert sorted(ids_of(got_a + got_b)) == list(range(1, 13))
            assert {d.epoch for d in got_a + got_b} == {epoch} and sb.epoch == epoch
            assert sa.dropped == sb.dropped == 0
            assert await other.ack(*ho) == 6 and ids_of(await other.pull(10)) == list(range(7, 13))

    try:
        run(main())
    finally:
        direct.close()


def test_a_seek_on_a_topic_without_retention_rewinds_to_the_oldest_message_a_group_has_not_settled(redis_url):
    with worker(redis_url) as w:
        async def main() -> None:
            async with subscribed(url(w), "plain", "plain", 10) as (c, sub):
                got = await sub.pull(10)
                assert await sub.ack(*got[:4]) == 4  # 1-4 settled by the only group: gone from the log
                await sub.seek(where="earliest")
                assert ids_of(await drain(sub)) == list(range(5, 11))
                other = await c.subscribe("plain", group="late", start="earliest")
                assert ids_of(await other.pull(10)) == list(range(5, 11))  # a new group: what is still kept

        run(main())
