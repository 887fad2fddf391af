"""An lmq at rest: a compact meta hash, and only the messages someone may still get.

Compaction (lua/_compact_meta.lua ``compact_meta``; docs/data-model.md, "Lmqs at
rest") leaves out every meta field that holds its default once an lmq has one
group whose only member is its owner. The property test runs the same random
lite-queue operations twice — through the real fences, and through the same
fences with compaction switched off — and requires the same replies and the
same state at every step, so the compact form can never change behaviour. An
lmq at rest also gives up its meta key (``put_to_rest``: the hash moves into a
field of its slot's rest hash, and the next fence puts it back); the reference
never rests, so the same comparison holds resting to the same replies and state.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from tests.helpers import direct_async
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from fencemq.model import meta as compact_meta
from fencemq.config import Config
from fencemq.errors import FenceMQError
from fencemq.model.keys import Keyspace, QueueRef
from fencemq.model.handles import Handle
from fencemq.fences.core import Core
from fencemq.fences.leases import PullResult, SweepResult
from fencemq.model.messages import Delivery
from fencemq.fences.operator import SNAPSHOT
from fencemq.fences.lua_sources import sources

TOPIC, LMQ = "lt", "q1"
REF = QueueRef(TOPIC, LMQ)
# (client, group): two clients contend for the default group; A also reads in a second group
MEMBERS = (("A", "default"), ("B", "default"), ("A", "g2"))
TIMESTAMPS = {"ct", "wt"}  # written from the clock: differ between two runs


def without_compaction(queues: Core) -> Core:
    """The same fences with compact_meta a no-op: the reference the compact form is held to."""
    marker = "local function compact_meta(meta)\n"
    for name, src in sources().items():
        assert marker in src or "compact_meta(" not in src  # a fence that never compacts has no such helper
        queues.fences.scripts[name] = queues.redis.register_script(src.replace(marker, marker + "  do return end\n"))
    return queues


class TwoBrokers:
    """One event loop; Core with compaction under prefix 'c', without under prefix 'p'."""

    def __init__(self, url: str, on_preempt: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.redis: Redis = self.loop.run_until_complete(self._connect(url))
        self.compact = Core(self.redis, Config(prefix="c", lmq_idle_ttl_ms=3_600_000))
        self.plain = without_compaction(Core(self.redis, Config(prefix="p", lmq_idle_ttl_ms=3_600_000)))
        for core in (self.compact, self.plain):
            # An lmq's ids start at the clock (lib/meta.lua, start_ids), so the two brokers would give
            # different ones; what is compared here is the compact form: both number from 1, as a plain
            # topic does (tests/fences/test_lite.py holds an lmq's ids to the clock).
            core.ctx.clock_ids = lambda ref: 0
        self.on_preempt = on_preempt
        self.tags: dict[tuple[str, str], list[str]] = {m: [] for m in MEMBERS}  # as ordinals ("1", "2", …)
        # Tags come from Redis's clock (lua/lib/leases.lua, next_tags), so the two brokers hand out
        # different ones: each broker's are compared by the order they were handed out in.
        self._ordinal: dict[str, dict[str, str]] = {"c": {}, "p": {}}
        self._real: dict[str, dict[str, str]] = {"c": {}, "p": {}}

    def _prefix(self, q: Core) -> str:
        return q.config.prefix

    def ordinal(self, prefix: str, tag: str) -> str:
        """The n-th tag a broker hands out is "n" ("qn" at QoS 0); each is larger than the one before."""
        q0 = tag.startswith("q")
        number = tag[1:] if q0 else tag
        known = self._ordinal[prefix]
        if number not in known:
            assert all(int(number) > int(t) for t in known), f"tag {number} is not above every earlier one"
            known[number] = str(len(known) + 1)
            self._real[prefix][known[number]] = number
        return ("q" if q0 else "") + known[number]

    def reals(self, q: Core, tags: list[str]) -> list[str]:
        return [self._real[self._prefix(q)].get(t, t) for t in tags]

    @staticmethod
    async def _connect(url: str) -> Redis:
        return direct_async(url)

    def both(self, op: Any) -> tuple[Any, Any]:
        async def one(q: Core) -> Any:
            try:
                return self.normal(self._prefix(q), await op(q))
            except FenceMQError as exc:
                return type(exc).__name__
        return self.loop.run_until_complete(one(self.compact)), self.loop.run_until_complete(one(self.plain))

    def normal(self, prefix: str, result: Any) -> Any:
        """A reply with its tags as ordinals."""
        if isinstance(result, PullResult):
            for d in result.deliveries:
                d.tag = self.ordinal(prefix, d.tag)
        elif isinstance(result, Delivery):  # from TAKE
            result.tag = self.ordinal(prefix, result.tag)
        elif isinstance(result, SweepResult):
            result.timeouts = [(g, m, [self.ordinal(prefix, t) for t in tags], s) for g, m, tags, s in result.timeouts]
        return result

    def state(self, prefix: str) -> dict[str, Any]:
        k = Keyspace(prefix).queue(REF)

        async def read() -> list[Any]:
            async with self.redis.pipeline(transaction=True) as p:
                p.hgetall(k.meta)
                p.hgetall(k.checkouts)
                p.zrange(k.owned, 0, -1)
                p.zrange(k.ready, 0, -1)
                p.pttl(k.meta)
                p.hget(k.rest, k.rest_field)
                return await p.execute()

        meta, co, own, rd, ttl, rested = self.loop.run_until_complete(read())
        if rested is not None:  # at rest without a key (only the compacting broker's lmq rests)
            assert not meta and prefix == "c", "an lmq's meta is its key or its rest field, never both"
            meta, ttl = compact_meta.from_rest(rested), -1
        expanded = {f: ("<since>" if f.endswith("|sus") else churn_counts(v) if f.endswith("|ch") else v)
                    for f, v in compact_meta.expand(meta).items() if f not in TIMESTAMPS}
        def number(t: str) -> str:  # a tag's, or a lease batch's first tag's ('b<first>+<span>')
            return t[1:].split("+")[0] if t.startswith("b") else t.lstrip("q")

        def ordinal(t: str) -> str:
            if t.startswith("b"):
                first, span = t[1:].split("+")
                return f"b{self.ordinal(prefix, first)}+{span}"
            return self.ordinal(prefix, t)

        seen = [number(t.decode()) for t in co] + [number(o.split(b"\0")[2].decode()) for o in own]
        for t in sorted(set(seen), key=int):  # first seen here (a mailbox filled by SUB): in the order handed out
            self.ordinal(prefix, t)
        if "tag" in expanded:
            expanded["tag"] = self.ordinal(prefix, expanded["tag"])
        for f in [f for f in expanded if f.endswith("|to")]:  # a suspected member's timed-out tags
            expanded[f] = " ".join(ordinal(t) for t in expanded[f].split())
        def record(r: bytes) -> bytes:  # a checkout of a lease batch names the batch last
            *fields, last = r.split(b"\0")
            return b"\0".join((*fields, ordinal(last.decode()).encode() if last.startswith(b"b") else last))

        co = {ordinal(t.decode()): record(r) if not t.startswith(b"b") else r for t, r in co.items()}
        own = [b"\0".join((*o.split(b"\0")[:2], ordinal(o.split(b"\0")[2].decode()).encode())) for o in own]
        return {"meta": expanded, "co": co, "own": sorted(own), "rd": rd, "reclaim_set": ttl > 0}

    def close(self) -> None:
        self.loop.run_until_complete(self.redis.aclose())
        self.loop.close()


def handle(member: str | tuple[str, str]) -> Handle:
    client, group = (member, "default") if isinstance(member, str) else member
    return Handle(REF, group, client)


def deliveries(result: Any) -> Any:
    if isinstance(result, str):
        return result
    return result.epoch, result.status, [(d.tag, d.id, d.deliveries, d.payload) for d in result.deliveries]


OWNER = ("A", "default")
FIRST_OWNER = ("sub", OWNER, 1, None)
# most operations come from the first owner, so its lmq comes to rest and leaves it often
MEMBER = st.sampled_from([OWNER, OWNER, OWNER, ("B", "default"), ("A", "g2")])
CORE_OPS = [  # the message cycle, drawn more often than the rest
    st.tuples(st.just("pub"), st.integers(1, 3)),
    st.tuples(st.just("pull"), MEMBER, st.integers(1, 3)),
    st.tuples(st.just("ack"), MEMBER),
]
OPS = st.one_of(
    *CORE_OPS, *CORE_OPS,
    st.tuples(st.just("sub"), MEMBER, st.sampled_from([1, 0]), st.sampled_from([None, 60_000])),
    st.tuples(st.just("pub"), st.integers(1, 3)),
    st.tuples(st.just("pull"), MEMBER, st.integers(1, 3)),
    st.tuples(st.just("ack"), MEMBER),
    st.tuples(st.just("nack"), MEMBER),
    st.tuples(st.just("unsub"), MEMBER),
    st.tuples(st.just("seek"), MEMBER, st.sampled_from(["earliest", "latest"])),
    st.tuples(st.just("evict"), MEMBER),
    st.tuples(st.just("subpush"), MEMBER),
    st.tuples(st.just("take"), MEMBER),
    st.tuples(st.just("max"), MEMBER, st.integers(0, 4)),
    st.tuples(st.just("renew"), MEMBER),
    st.tuples(st.just("expire")),
)


def churn_counts(value: Any) -> str:
    """A group's churn counters without their clock readings (first and last churn ms)."""
    return ",".join((value.decode() if isinstance(value, bytes) else value).split(",")[:3])


def took(result: Any) -> Any:
    return (result.tag, result.id, result.deliveries, result.payload) if hasattr(result, "tag") else result


def expire_every_lease(b: TwoBrokers) -> tuple[Any, Any]:
    """Time passes for every lease of both queues (their deadlines move to 0), then each is swept."""
    for prefix in ("c", "p"):
        dl = Keyspace(prefix).queue(REF).deadlines
        tags = b.loop.run_until_complete(b.redis.zrange(dl, 0, -1))
        if tags:
            b.loop.run_until_complete(b.redis.zadd(dl, {t: 0 for t in tags}, xx=True))
    swept = b.both(lambda q: q.leases.sweep(REF.qid))
    return tuple(s if isinstance(s, str) else (s.returned, s.timeouts, s.newly_suspected) for s in swept)


def step(b: TwoBrokers, op: tuple[Any, ...]) -> None:
    kind, *args = op
    if kind == "sub":
        (client, group), qos, lock = args
        got = b.both(lambda q: q.subscriptions.subscribe(client, TOPIC, lmq=LMQ, group=group, qos=qos, lock_ms=lock,
                                           on_preempt=b.on_preempt))
        got = tuple(g if isinstance(g, str) else (g.mode, g.epoch, g.owner, g.evicted, g.returned, g.cursor)
                    for g in got)
    elif kind == "pub":
        got = b.both(lambda q: q.publishing.publish(TOPIC, [b"m"] * args[0], lmq=LMQ, producer="p"))
    elif kind == "pull":
        c, n = args
        got = tuple(deliveries(g) for g in b.both(lambda q: q.leases.pull(handle(c), n)))
        if not isinstance(got[0], str):
            b.tags[c] += [t for t, *_ in got[0][2]]
    elif kind in ("ack", "nack"):
        (c,) = args
        tags, b.tags[c] = b.tags[c][:2], b.tags[c][2:]
        if not tags:
            return
        settle = ((lambda q: q.leases.ack(handle(c), b.reals(q, tags))) if kind == "ack"
                  else (lambda q: q.leases.nack(handle(c), b.reals(q, tags))))
        got = b.both(settle)
    elif kind == "unsub":
        got = b.both(lambda q: q.subscriptions.unsubscribe(handle(args[0]), session_over=True))
    elif kind == "seek":
        c, where = args
        got = b.both(lambda q: q.seek.move(handle(c), where))
    elif kind == "evict":
        got = b.both(lambda q: q.lite.evict(handle(args[0])))
    elif kind == "subpush":
        (client, group) = args[0]
        got = b.both(lambda q: q.subscriptions.subscribe(client, TOPIC, lmq=LMQ, group=group, capacity=2,
                                           on_preempt=b.on_preempt))
        got = tuple(g if isinstance(g, str) else (g.epoch, g.owner, g.evicted, g.returned) for g in got)
    elif kind == "take":
        (c,) = args
        got = tuple(took(g) for g in b.both(lambda q: q.mailboxes.take(handle(c))))
        if hasattr(got[0], "__len__") and len(got[0]) == 4 and not isinstance(got[0], str):
            b.tags[c].append(got[0][0])
    elif kind == "max":
        c, n = args
        got = b.both(lambda q: q.mailboxes.end_after(handle(c), n))
    elif kind == "renew":
        (c,) = args
        if not b.tags[c]:
            return
        got = b.both(lambda q: q.leases.renew(handle(c), b.reals(q, b.tags[c][:2])))
    else:
        got = expire_every_lease(b)
    assert got[0] == got[1], f"{op}: {got[0]!r} with compaction, {got[1]!r} without"
    assert b.state("c") == b.state("p"), f"after {op}"


# 300 examples (make test-stateful); make test runs FENCEMQ_COMPACTION_EXAMPLES of them
@settings(max_examples=int(os.environ.get("FENCEMQ_COMPACTION_EXAMPLES", "300")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OPS, min_size=1, max_size=30), on_preempt=st.sampled_from(["keep", "earliest", "latest"]))
@example(ops=[("pub", 1), ("pull", ("A", "default"), 1), ("expire",)], on_preempt="keep")  # suspicion stamps
@example(ops=[("pub", 1), ("pull", ("A", "default"), 1), ("ack", ("A", "default")), ("pub", 1)],
         on_preempt="keep")  # the cursor's default follows seq
def test_compaction_never_changes_a_reply_or_the_state_it_stands_for(redis_server, ops, on_preempt) -> None:
    b = TwoBrokers(redis_server.url, on_preempt)
    try:
        b.loop.run_until_complete(b.redis.flushall())
        for op in [FIRST_OWNER, *ops]:  # an owner from the start: most sequences reach an lmq at rest
            step(b, op)
    finally:
        b.close()


@pytest.fixture
def lite(redis_url: str):
    b = TwoBrokers(redis_url, "keep")
    yield b
    b.close()


def raw_meta(b: TwoBrokers) -> dict[str, str]:
    """The compacting broker's meta hash as stored: its key, or its field in the rest hash."""
    k = Keyspace("c").queue(REF)
    raw = b.loop.run_until_complete(b.redis.hgetall(k.meta))
    return {k.decode(): v.decode() for k, v in raw.items()} or compact_meta.from_rest(
        b.loop.run_until_complete(b.redis.hget(k.rest, k.rest_field)))


def at_rest(b: TwoBrokers) -> bool:
    """Whether the compacting broker's lmq is at rest without a key of its own."""
    k = Keyspace("c").queue(REF)
    exists, rested = b.loop.run_until_complete(_key_and_field(b.redis, k))
    assert not (exists and rested), "an lmq's meta is its key or its rest field, never both"
    return bool(rested)


async def _key_and_field(redis: Redis, k: Any) -> tuple[int, int]:
    return await redis.exists(k.meta), await redis.hexists(k.rest, k.rest_field)


def test_a_freshly_subscribed_lmq_keeps_only_its_group_owner_and_creation_second(lite) -> None:
    lite.both(lambda q: q.subscriptions.subscribe("A", TOPIC, lmq=LMQ))
    meta = raw_meta(lite)
    assert set(meta) == {"C", "z"} and meta["z"] == "A", "the lite default group goes without saying"
    assert at_rest(lite), "nothing to deliver, one owner: no key of its own"
    assert abs(int(meta["C"]) - lite.loop.run_until_complete(lite.redis.time())[0]) <= 2


def test_an_lmq_comes_back_to_rest_compact_after_its_last_ack(lite) -> None:
    lite.both(lambda q: q.subscriptions.subscribe("A", TOPIC, lmq=LMQ))
    lite.both(lambda q: q.publishing.publish(TOPIC, [b"x"], lmq=LMQ))
    pulled, _ = lite.both(lambda q: q.leases.pull(handle("A"), 5))
    assert "z" not in raw_meta(lite), "a checkout spells the hash out"
    assert not at_rest(lite)
    lite.both(lambda q: q.leases.ack(handle("A"), lite.reals(q, [d.tag for d in pulled.deliveries])))
    assert at_rest(lite)
    meta = raw_meta(lite)
    assert meta["z"] == "A"
    assert {f: meta[f] for f in ("S", "N")} == {"S": "1", "N": "1"}, "seq, delivered"
    assert lite.ordinal("c", meta["T"]) == pulled.deliveries[0].tag, "the last tag handed out"


def test_an_empty_poll_of_an_lmq_at_rest_writes_nothing(lite) -> None:
    lite.both(lambda q: q.subscriptions.subscribe("A", TOPIC, lmq=LMQ))
    before = raw_meta(lite)
    for _ in range(3):
        result, _ = lite.both(lambda q: q.leases.pull(handle("A"), 10))
        assert result.status == "ok" and result.deliveries == []
    assert raw_meta(lite) == before
    assert at_rest(lite), "woken to be read, and put back"


def test_a_publish_wakes_an_lmq_at_rest_and_its_last_ack_puts_it_back(lite) -> None:
    lite.both(lambda q: q.subscriptions.subscribe("A", TOPIC, lmq=LMQ))
    lite.both(lambda q: q.publishing.publish(TOPIC, [b"x", b"y"], lmq=LMQ))
    assert not at_rest(lite), "a message to deliver: the lmq has its key"
    pulled, _ = lite.both(lambda q: q.leases.pull(handle("A"), 1))
    lite.both(lambda q: q.leases.ack(handle("A"), lite.reals(q, [d.tag for d in pulled.deliveries])))
    assert not at_rest(lite), "one message still unread"
    pulled, _ = lite.both(lambda q: q.leases.pull(handle("A"), 5))
    assert [d.payload for d in pulled.deliveries] == [b"y"]
    lite.both(lambda q: q.leases.ack(handle("A"), lite.reals(q, [d.tag for d in pulled.deliveries])))
    assert at_rest(lite) and raw_meta(lite)["S"] == raw_meta(lite)["T"][:0] + "2"


def test_the_sweep_after_an_lmqs_traffic_leaves_it_at_rest_as_its_ack_did(lite) -> None:
    lite.both(lambda q: q.subscriptions.subscribe("A", TOPIC, lmq=LMQ))
    lite.both(lambda q: q.publishing.publish(TOPIC, [b"x"], lmq=LMQ))
    pulled, _ = lite.both(lambda q: q.leases.pull(handle("A"), 5))
    lite.both(lambda q: q.leases.ack(handle("A"), lite.reals(q, [d.tag for d in pulled.deliveries])))
    settled = raw_meta(lite)
    lite.both(lambda q: q.leases.sweep(REF.qid))  # the sweeper, at the settled lease's deadline
    assert at_rest(lite) and raw_meta(lite) == settled, "woken to be swept, then compact and at rest again"
    assert lite.state("c") == lite.state("p")


def test_a_swept_lmq_whose_lease_expired_keeps_its_key_until_the_message_is_settled(lite) -> None:
    lite.both(lambda q: q.subscriptions.subscribe("A", TOPIC, lmq=LMQ))
    lite.both(lambda q: q.publishing.publish(TOPIC, [b"x"], lmq=LMQ))
    lite.both(lambda q: q.leases.pull(handle("A"), 5))
    swept = expire_every_lease(lite)
    assert swept[0] == swept[1] and swept[0][0] == 1, "one message back to the queue"
    assert not at_rest(lite), "a message to deliver again"
    assert lite.state("c") == lite.state("p")


def test_an_lmq_set_to_be_reclaimed_expires_as_a_key_and_never_rests(lite) -> None:
    lite.both(lambda q: q.subscriptions.subscribe("A", TOPIC, lmq=LMQ))
    lite.both(lambda q: q.subscriptions.unsubscribe(handle("A"), session_over=True))
    k = Keyspace("c").queue(REF)
    assert not at_rest(lite)
    assert lite.loop.run_until_complete(lite.redis.pttl(k.meta)) > 0, "no owner: it waits out its idle TTL"


def test_a_preemption_of_an_lmq_at_rest_marks_the_old_owner_and_leaves_the_hash_spelled_out(lite) -> None:
    lite.both(lambda q: q.subscriptions.subscribe("A", TOPIC, lmq=LMQ))
    sub, _ = lite.both(lambda q: q.subscriptions.subscribe("B", TOPIC, lmq=LMQ))
    assert sub.evicted == "A" and sub.owner == "B"
    meta = raw_meta(lite)
    assert "z" not in meta, "two members: not compact"
    assert meta["m|default|A|mk"] == "B" and meta["g|default|mem"] == "A\nB"
    lite.both(lambda q: q.subscriptions.unsubscribe(handle("A"), session_over=True))
    at_rest = raw_meta(lite)
    assert set(at_rest) == {"C", "z", "g|default|ch", "g|default|chw"}, \
        "the old owner gone: back at rest, with the churn it had (what the analytics report)"
    assert at_rest["g|default|ch"].split(",")[:3] == ["1", "0", "0"], "one preemption, no eviction, no fenced pull"
    assert at_rest["g|default|chw"] == "A\nB"


def test_a_plain_topic_is_never_compacted(lite) -> None:
    lite.both(lambda q: q.subscriptions.subscribe("A", "plain", group="g", mode="exclusive"))
    raw = lite.loop.run_until_complete(lite.redis.hgetall(Keyspace("c").queue(QueueRef("plain")).meta))
    assert b"z" not in raw and b"g|g|mode" in raw


def test_python_and_lua_expand_a_compact_hash_alike(lite) -> None:
    lite.both(lambda q: q.subscriptions.subscribe("A", TOPIC, lmq=LMQ))
    lite.both(lambda q: q.publishing.publish(TOPIC, [b"x", b"y"], lmq=LMQ))
    pulled, _ = lite.both(lambda q: q.leases.pull(handle("A"), 5))
    lite.both(lambda q: q.leases.ack(handle("A"), lite.reals(q, [d.tag for d in pulled.deliveries])))
    assert "z" in raw_meta(lite)
    k = Keyspace("c").queue(REF)
    lua_view = lite.loop.run_until_complete(
        lite.compact.fences.run(SNAPSHOT, k, max_log=0, max_journal=0, digest=""))[1]
    lua_fields = {lua_view[i].decode(): lua_view[i + 1].decode() for i in range(0, len(lua_view), 2)}
    assert lua_fields == compact_meta.expand(raw_meta(lite))
    # and expanding for real (a publish) gives the same fields
    lite.both(lambda q: q.publishing.publish(TOPIC, [b"z"], lmq=LMQ))
    spelled = raw_meta(lite)
    assert "z" not in spelled
    changed = ("seq", "wt", "ct", "first")  # the publish, and times to the second at rest
    assert {f: v for f, v in spelled.items() if f not in changed} == {
        f: v for f, v in lua_fields.items() if f not in changed}


def log_ids(b: TwoBrokers) -> list[int]:
    return sorted(int(i) for i in b.loop.run_until_complete(b.redis.hkeys(Keyspace("c").queue(REF).log)))


def test_an_lmq_with_nothing_checked_out_forgets_what_its_owner_consumed(lite) -> None:
    lite.both(lambda q: q.subscriptions.subscribe("A", TOPIC, lmq=LMQ))
    lite.both(lambda q: q.publishing.publish(TOPIC, [b"1", b"2", b"3"], lmq=LMQ))
    pulled, _ = lite.both(lambda q: q.leases.pull(handle("A"), 2))
    lite.both(lambda q: q.leases.ack(handle("A"), lite.reals(q, [d.tag for d in pulled.deliveries])))
    assert log_ids(lite) == [3], "the third is still to be read"
    pulled, _ = lite.both(lambda q: q.leases.pull(handle("A"), 2))
    lite.both(lambda q: q.leases.ack(handle("A"), lite.reals(q, [d.tag for d in pulled.deliveries])))
    assert log_ids(lite) == []
    # (srv: the server that gave its ids, lua/lib/ids.lua, kept at rest: a promoted replica's older
    # copy of a resting lmq must still tell that another server gave its last ids)
    assert set(raw_meta(lite)) == {"C", "W", "S", "T", "N", "z", "srv"}
    # a seek back finds nothing left to re-read: SEEK ID 1 is clamped to the next id
    (_, cursor, clamped), _ = lite.both(lambda q: q.seek.move(handle("A"), "id", 1))
    assert (cursor, clamped) == (4, True)
    lite.both(lambda q: q.seek.move(handle("A"), "earliest"))
    again, _ = lite.both(lambda q: q.leases.pull(handle("A"), 10))
    assert again.status == "ok" and again.deliveries == []


def test_a_nacked_message_keeps_the_log_until_it_is_settled(lite) -> None:
    lite.both(lambda q: q.subscriptions.subscribe("A", TOPIC, lmq=LMQ))
    lite.both(lambda q: q.publishing.publish(TOPIC, [b"1", b"2"], lmq=LMQ))
    pulled, _ = lite.both(lambda q: q.leases.pull(handle("A"), 2))
    first, second = pulled.deliveries
    lite.both(lambda q: q.leases.nack(handle("A"), lite.reals(q, [first.tag])))
    lite.both(lambda q: q.leases.ack(handle("A"), lite.reals(q, [second.tag])))
    assert log_ids(lite) == [1, 2], "1 is back in line to be redelivered"
    redelivered, _ = lite.both(lambda q: q.leases.pull(handle("A"), 2))
    assert [d.id for d in redelivered.deliveries] == ["1"]
    lite.both(lambda q: q.leases.ack(handle("A"), lite.reals(q, [redelivered.deliveries[0].tag])))
    assert log_ids(lite) == []


def test_an_lmq_nobody_subscribed_to_keeps_its_messages_for_the_first_subscriber(lite) -> None:
    lite.both(lambda q: q.publishing.publish(TOPIC, [b"1", b"2"], lmq=LMQ))
    lite.both(lambda q: q.subscriptions.subscribe("A", TOPIC, lmq=LMQ))
    pulled, _ = lite.both(lambda q: q.leases.pull(handle("A"), 1))
    lite.both(lambda q: q.leases.ack(handle("A"), lite.reals(q, [pulled.deliveries[0].tag])))
    assert log_ids(lite) == [2], "2 is still to be read"


def test_an_lmq_whose_group_rewinds_on_preemption_keeps_what_was_consumed(lite) -> None:
    lite.both(lambda q: q.subscriptions.subscribe("A", TOPIC, lmq=LMQ, on_preempt="earliest"))
    lite.both(lambda q: q.publishing.publish(TOPIC, [b"1", b"2"], lmq=LMQ))
    pulled, _ = lite.both(lambda q: q.leases.pull(handle("A"), 2))
    lite.both(lambda q: q.leases.ack(handle("A"), lite.reals(q, [d.tag for d in pulled.deliveries])))
    assert log_ids(lite) == [1, 2]
    lite.both(lambda q: q.subscriptions.subscribe("B", TOPIC, lmq=LMQ))
    again, _ = lite.both(lambda q: q.leases.pull(handle("B"), 5))
    assert [d.id for d in again.deliveries] == ["1", "2"], "the new owner starts from the earliest"
