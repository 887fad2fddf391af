"""The broker's totals (lua/lib/totals.lua, ops/totals.py) against a full count of every queue's keys.

A random workload runs through a real worker and real RESP clients — plain topics with shared,
exclusive and single-active groups, lmqs that preempt each other and are reclaimed when idle, a
`$share` filter group whose last member leaves, push mailboxes with MAX, NACKs to the dead-letter
list and with a delay, SEEKs, leases that expire, retention trimming the log, sessions that end, and
the operator's evict, purge, replay and discard — and the counters the fences keep must equal what
a SCAN of every queue counts, at checkpoints taken with Redis's writes paused and at the end.
The stateful tests hold them to the same count after their moves (tests/fences/test_reference_model.py,
tests/stateful/test_guarantees.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
from typing import Any

import pytest
import redis

from fencemq.errors import FenceMQError
from fencemq.fences.retention import Policy, set_policy
from fencemq.fences.registry import Fences
from fencemq.fences.subscribe import DROP_IF_EMPTY
from fencemq.model.keys import Keyspace, QueueRef
from fencemq.model.slots import key_slot
from fencemq.ops import maintenance, overview, totals
from tests.helpers import as_map, client, deliveries, direct, direct_async, in_cluster_mode, wait_for, worker

KEYS = Keyspace("fmq")


def run_async(coro: Any) -> Any:
    """asyncio.run on a thread of its own (a caller may have a loop running: Playwright's sync API)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()
SETTINGS = {"max_failures": 2, "retention_maxlen": 12, "lmq_idle_ttl_ms": 400, "sweep_interval_ms": 30,
            "session_lease_ms": 1000, "default_lock_ms": 60_000}


async def compare(url: str) -> None:
    """The counters equal the full count (the caller makes sure nothing writes meanwhile)."""
    r = direct_async(url)
    try:
        counted = await totals.full_count(r, KEYS)
        kept = await totals.read_totals(r, KEYS)
        mine = {k: kept[k] for k in counted["totals"]}
        assert mine == counted["totals"], f"totals kept {mine} != counted {counted['totals']}"
        entries = set(counted["entries"]) | {e for e, _ in await totals.largest_backlogs(r, KEYS, 10_000)}
        assert await totals.counted_entries(r, KEYS, sorted(entries)) == counted["entries"]
        if in_cluster_mode():
            # the slots read (those listed) hold every slot's totals: all 16,384 read, through redis-py's
            # pipeline rather than the fast read, agree
            assert await totals.unlisted_slots(r, KEYS) == []
            assert kept == await totals.read_totals(r, KEYS, every_slot=True, fast=False)
            assert (await totals.largest_backlogs(r, KEYS, 10_000)
                    == await totals.largest_backlogs(r, KEYS, 10_000, every_slot=True, fast=False))
            assert await totals.counted_entries(r, KEYS, sorted(entries), every_slot=True,
                                                fast=False) == counted["entries"]
    finally:
        await r.aclose()


def checkpoint(url: str, direct: redis.Redis) -> None:
    """Compare with every write paused (the sweeper and other workers' fences wait meanwhile)."""
    if in_cluster_mode():  # a pause is per node: compare at the end only
        return
    direct.execute_command("CLIENT", "PAUSE", 30_000, "WRITE")
    try:
        run_async(compare(url))
    finally:
        direct.execute_command("CLIENT", "UNPAUSE")


class Workload:
    def __init__(self, url: str, port: int, rng: random.Random) -> None:
        self.url, self.rng = url, rng
        self.direct = direct(url)
        self.producer = client(port, 2, "producer")
        self.port = port
        self.clients = {c: client(port, 2, c) for c in ("c0", "c1", "c2", "c3")}
        self.handles: dict[tuple[str, str], bytes | str] = {}  # (client, target) -> handle
        self.held: dict[tuple[str, str], list[str]] = {}  # tags delivered, not settled yet (as far as we know)

    def sub_args(self, target: str) -> list[Any]:
        mode = {"orders": ["GROUP", "g", "MODE", "shared"], "audit": ["GROUP", "a", "MODE", "single-active"],
                "jobs": ["GROUP", "w", "MODE", "exclusive"]}
        if target in mode:
            return [target.split("#")[0], *mode[target], "LOCK", 60_000]
        if target.startswith("lmq"):
            return ["chat", "LMQ", target[3:]]
        if target == "push":
            return ["feed", "GROUP", "p", "PUSH", "CAPACITY", 3, "MAX", self.rng.choice([2, 5, 50])]
        return ["$share/s/sensors/+"]

    TARGETS = ("orders", "audit", "jobs", "lmq1", "lmq2", "push", "share")

    def publish(self) -> None:
        target = self.rng.choice(("orders", "audit", "jobs", "chat1", "chat2", "feed", "sensors", "later"))
        n = self.rng.randint(1, 4)
        if target == "later":  # scheduled: due soon (the sweeper releases it) or cancelled first
            topic = self.rng.choice(("orders", "jobs"))
            ids = [self.producer.execute_command("PUB", topic, b"s", "DELAY", self.rng.choice((50, 60_000)))
                   for _ in range(n)]
            if self.rng.random() < 0.5:
                self.producer.execute_command("UNPUB", topic, *ids[: self.rng.randint(1, n)])
            return
        if target.startswith("chat"):
            self.producer.execute_command("MPUB", "chat", n, *[b"m"] * n, "LMQ", target[4:])
        elif target == "sensors":
            for _ in range(n):
                self.producer.execute_command("PUB", f"sensors/{self.rng.randint(1, 2)}", b"s")
        else:
            self.producer.execute_command("MPUB", "orders" if target == "audit" else target, n, *[b"x"] * n)

    def sub(self, c: str, target: str) -> None:
        try:
            reply = as_map(self.clients[c].execute_command("SUB", *self.sub_args(target)))
            self.handles[(c, target)] = reply["handle"]
        except redis.ResponseError:
            pass

    def pull(self, c: str, target: str) -> None:
        h = self.handles.get((c, target))
        if h is None:
            return
        try:
            if target == "push":
                got = []
                reply = self.clients[c].execute_command("TAKE", h)
                if isinstance(reply, list) and reply and not isinstance(reply[0], list):
                    got = deliveries([reply])
            else:
                got = deliveries(self.clients[c].execute_command("PULL", h, "COUNT", self.rng.randint(1, 4)))
        except redis.ResponseError:
            return
        self.held.setdefault((c, target), []).extend(d["tag"] for d in got)

    def settle(self, c: str, target: str) -> None:
        h, tags = self.handles.get((c, target)), self.held.get((c, target), [])
        if h is None or not tags:
            return
        some = tags[: self.rng.randint(1, len(tags))]
        del tags[: len(some)]
        how = self.rng.choice(("ACK", "ACK", "NACK", "NACK", "NACK", "NACK DELAY", "NACK DISCARD", "RENEW"))
        args = {"ACK": ["ACK", h, *some], "NACK": ["NACK", h, *some], "NACK DELAY": ["NACK", h, *some, "DELAY", 50],
                "NACK DISCARD": ["NACK", h, *some, "DISCARD"], "RENEW": ["RENEW", h, *some]}[how]
        try:
            self.clients[c].execute_command(*args)
        except redis.ResponseError:
            pass

    def seek(self, c: str, target: str) -> None:
        h = self.handles.get((c, target))
        if h is not None and target != "share":
            try:
                self.clients[c].execute_command("SEEK", h, self.rng.choice(("EARLIEST", "LATEST")))
            except redis.ResponseError:
                pass

    def unsub(self, c: str, target: str) -> None:
        h = self.handles.pop((c, target), None)
        if h is not None:
            try:
                self.clients[c].execute_command("UNSUB", h)
            except redis.ResponseError:
                pass

    def expire_leases(self) -> None:
        """Time passes for a few leases: their deadlines, and the queue's entry in the sweep schedule,
        move into the past; the worker's sweeper returns them."""
        for ref in (QueueRef("orders"), QueueRef("jobs"), QueueRef("chat", "1"), QueueRef("feed"),
                    QueueRef("sensors/+", None, "$share/s")):
            k = KEYS.queue(ref)
            due = self.direct.zrange(k.deadlines, 0, 1)
            if due:
                self.direct.zadd(k.deadlines, {t: 1 for t in due}, xx=True)
                self.direct.zadd(KEYS.schedule, {ref.qid: 1})

    def end_session(self, c: str) -> None:
        self.clients[c].execute_command("QUIT")
        self.clients[c].close()
        for key in [k for k in self.handles if k[0] == c]:
            del self.handles[key]
        for key in [k for k in self.held if k[0] == c]:
            del self.held[key]
        wait_for(lambda: not self.direct.exists(KEYS.session(c)), timeout=10, what=f"{c}'s session to end")
        self.clients[c] = client(self.port, 2, c)

    def operate(self) -> None:
        ref = self.rng.choice((QueueRef("orders"), QueueRef("jobs"), QueueRef("chat", "1")))
        what = self.rng.choice(("evict", "purge", "replay", "replay", "discard", "discard"))

        async def act() -> None:
            r = direct_async(self.url)
            try:
                if what == "evict":
                    owner = next(iter(self.clients))
                    await maintenance.evict(r, KEYS, ref, "w" if ref.topic == "jobs" else "default", owner)
                elif what == "purge":
                    await maintenance.purge(r, KEYS, ref)
                elif what == "replay":
                    await maintenance.replay_dead(r, KEYS, ref, count=2)
                else:
                    raw = await r.lindex(KEYS.queue(ref).dead, 0)
                    if raw is not None:
                        await overview.discard_dead(r, KEYS, ref, 0, overview.dead_letter_digest(raw))
            except FenceMQError:  # a queue or member that is not there: nothing done
                pass
            finally:
                await r.aclose()

        run_async(act())

    def step(self) -> None:
        move = self.rng.choices(
            ("publish", "sub", "pull", "settle", "seek", "unsub", "expire", "end", "operate"),
            weights=(5, 3, 9, 9, 1, 2, 2, 1, 2))[0]
        c, target = self.rng.choice(list(self.clients)), self.rng.choice(self.TARGETS)
        holding = sorted(k for k, tags in self.held.items() if tags and k in self.handles)
        if move == "settle" and holding:
            c, target = self.rng.choice(holding)
        elif move in ("pull", "seek", "unsub") and self.handles:
            c, target = self.rng.choice(sorted(self.handles))
        if move == "publish":
            self.publish()
        elif move == "sub":
            self.sub(c, target)
        elif move == "pull":
            self.pull(c, target)
        elif move == "settle":
            self.settle(c, target)
        elif move == "seek":
            self.seek(c, target)
        elif move == "unsub":
            self.unsub(c, target)
        elif move == "expire":
            self.expire_leases()
        elif move == "end":
            self.end_session(c)
        else:
            self.operate()

    def close(self) -> None:
        for conn in (self.producer, *self.clients.values()):
            conn.close()
        self.direct.close()


async def keep_twelve(url: str) -> None:
    """orders gets a retention policy: its log is cut past 12 messages, read or not (retention.py)."""
    r = direct_async(url)
    try:
        await set_policy(r, KEYS, "orders", Policy(count=12))
    finally:
        await r.aclose()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_totals_equal_a_full_count_after_a_random_workload(redis_url: str, seed: int) -> None:
    rng = random.Random(seed)
    run_async(keep_twelve(redis_url))
    with worker(redis_url, **SETTINGS) as w:
        load = Workload(redis_url, w.port, rng)
        try:
            for i in range(1, 401):
                load.step()
                if i % 80 == 0:
                    checkpoint(redis_url, load.direct)
        finally:
            load.close()
    asyncio.run(compare(redis_url))
    kept = asyncio.run(_read(redis_url))
    assert kept["published"] > 0 and kept["delivered"] > 0 and kept["queues"] > 0


async def _read(url: str) -> dict[str, int]:
    r = direct_async(url)
    try:
        return await totals.read_totals(r, KEYS)
    finally:
        await r.aclose()


def test_a_fence_call_is_not_sent_until_the_slot_of_its_totals_is_listed(redis_url: str) -> None:
    """On a Cluster a total is read from the slots the registry lists: a fence whose slot could not be
    listed (here the registry is not a set) writes nothing, and once listed it runs."""
    if not in_cluster_mode():
        pytest.skip("one server keeps one totals hash: there is no registry of slots")
    plain = direct(redis_url)
    orders = KEYS.queue(QueueRef("orders"))
    plain.set(KEYS.totals_slots, "not a set")
    with worker(redis_url) as w:
        producer = client(w.port, 2, "producer")
        try:
            with pytest.raises(redis.ResponseError):
                producer.execute_command("PUB", "orders", b"x")
            assert not plain.exists(orders.meta) and not plain.exists(orders.slot_totals)
            plain.delete(KEYS.totals_slots)
            producer.execute_command("PUB", "orders", b"x")
        finally:
            producer.close()
    assert plain.exists(orders.slot_totals)
    assert run_async(_listed(redis_url)) == [key_slot(orders.meta)]
    assert run_async(_read(redis_url))["published"] == 1
    plain.close()


async def _listed(url: str) -> list[int]:
    r = direct_async(url)
    try:
        return await totals.slots_in_use(r, KEYS)
    finally:
        await r.aclose()


def test_a_lost_registry_of_totals_slots_is_listed_again_by_the_clients_that_wrote_there(redis_url: str) -> None:
    if not in_cluster_mode():
        pytest.skip("one server keeps one totals hash: there is no registry of slots")

    async def go() -> tuple[list[int], list[int], list[int]]:
        r = direct_async(redis_url)
        try:
            fences = Fences(r)
            await fences.run(DROP_IF_EMPTY, KEYS.queue(QueueRef("orders")))
            listed = await totals.slots_in_use(r, KEYS)
            await r.delete(KEYS.totals_slots)  # as a failover that lost the SADD would
            lost = await totals.slots_in_use(r, KEYS)
            await fences.reassert_totals()
            return listed, lost, await totals.slots_in_use(r, KEYS)
        finally:
            await r.aclose()

    slot = key_slot(KEYS.queue(QueueRef("orders")).meta)
    assert run_async(go()) == ([slot], [], [slot])


def test_a_totals_read_whose_connections_were_closed_under_it_still_answers(redis_url: str) -> None:
    """The fast read of a Cluster's slots falls back to redis-py's pipeline (which reconnects) when a
    connection fails under it."""
    if not in_cluster_mode():
        pytest.skip("one server's totals are one HMGET")

    async def go() -> tuple[dict[str, int], dict[str, int]]:
        r = direct_async(redis_url)
        try:
            await Fences(r).run(DROP_IF_EMPTY, KEYS.queue(QueueRef("orders")))
            await r.hincrby(KEYS.queue(QueueRef("orders")).slot_totals, "published", 5)
            before = await totals.read_totals(r, KEYS)
            for node in r.get_primaries():
                await r.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "no", target_nodes=node)
            return before, await totals.read_totals(r, KEYS)
        finally:
            await r.aclose()

    before, after = run_async(go())
    assert before["published"] == after["published"] == 5


def test_a_workers_readers_share_one_reading_of_the_totals_per_interval(redis_url: str) -> None:
    """Readers within totals_read_ms of a reading get it (concurrent ones wait for the one under way);
    a fresh read (a history point) reads the totals now."""
    orders = KEYS.queue(QueueRef("orders"))
    key = orders.slot_totals if in_cluster_mode() else KEYS.totals

    async def go() -> tuple[list[int], int, int, int]:
        r = direct_async(redis_url)
        try:
            await Fences(r).run(DROP_IF_EMPTY, orders)  # (lists the slot on a Cluster)
            await r.hincrby(key, "published", 1)
            shared = totals.SharedReading(r, KEYS, 60_000)
            seen = [t["published"] for t, _ in await asyncio.gather(*(shared.read() for _ in range(5)))]
            await r.hincrby(key, "published", 1)
            kept = (await shared.read())[0]["published"]
            fresh = (await shared.read(fresh=True))[0]["published"]
            return seen, kept, fresh, shared.reads
        finally:
            await r.aclose()

    assert run_async(go()) == ([1] * 5, 1, 2, 2)
