"""Lite queues (lmqs) against a real worker: the preemption race, and every path a marker takes.

The race test audits the queue journal (each lmq's ``<meta>:jr`` list, one
line per event in commit order: ``ms TAB event TAB group TAB member TAB id TAB
tag TAB epoch TAB extra``) against what each client saw on its own
connection. The other tests pin down the marker lifecycle (resubscribe,
HEARTBEAT SYNC, session end), POLICY reject, the per-client quota, idle
reclaim, the offset policies on preemption, the operator's force-evict and
the lite/plain topic split. Basic preemption (notice, pull fence, returned
checkouts, BUSY) is covered in tests/test_worker.py and not repeated here.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
import redis.asyncio

from fencemq.model import meta as compact_meta
from fencemq.fences import session_index
from fencemq.config import Config
from fencemq.model.keys import Keyspace, QueueRef
from fencemq.model.handles import Handle
from fencemq.model.records import journal_events
from fencemq.fences.core import Core
from tests import helpers
from tests.helpers import Err, RespConn, as_map, deliveries, held_handles, pipeline, signer, wait_for


def worker(redis_url: str, **settings: Any) -> helpers.WorkerThread:
    """A worker with the lite journal on (off by default): these tests read what the fences journal."""
    return helpers.worker(redis_url, **{"lite_journal_cap": 1_000_000, **settings})

KEYS = Keyspace("fmq")
GROUP = "default"  # the group of a lite SUB without GROUP


# -- helpers --------------------------------------------------------------------------------------


def subscribe(c: RespConn, topic: str, lmq: str, *opts: Any) -> str:
    """SUB topic LMQ lmq …; returns the handle (fails on an error reply)."""
    reply = c.call("SUB", topic, "LMQ", lmq, *opts)
    assert not isinstance(reply, Err), f"SUB {topic} {lmq} failed: {reply}"
    return as_map(reply)["handle"]


def pull(c: RespConn, handle: str, count: int = 10) -> list[dict[str, Any]]:
    reply = c.call("PULL", handle, "COUNT", count)
    assert not isinstance(reply, Err), f"PULL failed: {reply}"
    return deliveries(reply)


def connect(port: int, name: str, proto: int = 3) -> RespConn:
    c = RespConn(port)
    c.hello(proto, name)
    return c


def heartbeat(c: RespConn, *sync: str) -> list[dict[str, Any]]:
    reply = c.call("HEARTBEAT", *(("SYNC", *sync) if sync else ()))
    assert isinstance(reply, list), f"HEARTBEAT failed: {reply}"
    return [as_map(n) for n in reply]


def meta(r: redis.Redis, topic: str, lmq: str) -> dict[str, str]:
    """The lmq's meta fields as the fences see them (a compact hash spelled out)."""
    return compact_meta.expand(r.hgetall(KEYS.queue(QueueRef(topic, lmq)).meta))


def member_fields(m: dict[str, str], client: str, group: str = GROUP) -> dict[str, str]:
    prefix = f"m|{group}|{client}|"
    return {k[len(prefix):]: v for k, v in m.items() if k.startswith(prefix)}


def lmq_keys(r: redis.Redis, topic: str, lmq: str) -> dict[str, int]:
    """Every existing key of the lmq -> its PTTL (-1: none)."""
    base = KEYS.queue(QueueRef(topic, lmq)).meta
    found = [base] if r.exists(base) else []
    found += list(r.scan_iter(match=base.replace("{", "[{]").replace("}", "[}]") + ":*"))
    return {k: r.pttl(k) for k in found}


def session_keys(r: redis.Redis, client: str) -> list[str]:
    """The client's session keys that exist, and its entry in the sessions zset."""
    names = [KEYS.session(client), KEYS.session_handles(client), KEYS.session_notices(client),
             KEYS.session_lite_counts(client), *session_index.bucket_keys(KEYS, client)]
    left = [k for k in names if r.exists(k)]
    if r.zscore(KEYS.sessions, client) is not None:
        left.append(f"{KEYS.sessions}[{client}]")
    return left


@dataclass(frozen=True)
class Event:
    index: int
    ms: int
    ev: str
    group: str
    member: str
    id: str
    tag: str
    epoch: str
    extra: str


def journal(r: redis.Redis, topic: str, lmq: str) -> list[Event]:
    rows = r.lrange(KEYS.queue(QueueRef(topic, lmq)).journal, 0, -1)
    events = [e for row in rows for e in journal_events(row)]
    return [Event(i, e.ms, e.event, e.group or "", e.member or "", "" if e.id is None else str(e.id), e.tag or "",
                  "" if e.epoch is None else str(e.epoch), e.extra or "") for i, e in enumerate(events)]


def unsubscribe_notices(pushes: list[Any]) -> list[dict[str, Any]]:
    return [p[1] for p in pushes if p[0] == "notice" and p[1]["type"] == "unsubscribe"]


@pytest.fixture
def r(redis_url: str):
    client = helpers.direct(redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def w(redis_url: str):
    with worker(redis_url) as started:
        yield started


# =====================================================================================
# The race: four clients preempting three lmqs while all pull, a producer publishing


TOPIC, RACE_GROUP, LMQS = "race", "g", ["q0", "q1", "q2"]
CLIENTS = 4
BATCHES, BATCH = 40, 50  # per lmq: 3 x 40 x 50 = 6000 messages


@dataclass
class Racer:
    name: str
    conn: RespConn
    rng: random.Random
    handles: dict[str, str] = field(default_factory=dict)
    subs: Counter = field(default_factory=Counter)  # SUB replies received per lmq
    # (lmq, subs done on that lmq when the PULL was sent, [(tag, id)]) per PULL reply
    pulls: list[tuple[str, int, list[tuple[str, str]]]] = field(default_factory=list)
    acked: int = 0
    error: BaseException | None = None
    sign: Any = None  # the broker's handle signer: a worker only takes the handles it signed

    def run(self, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                self.step()
        except BaseException as exc:  # noqa: BLE001 - surfaced by the test
            self.error = exc

    def step(self) -> None:
        """One tight-loop round in one write: maybe SUB (preempt) one lmq, PULL every lmq ever held, ACK."""
        plan: list[tuple[str, str]] = []
        if not self.handles or self.rng.random() < 0.35:
            plan.append(("sub", self.rng.choice(LMQS)))
        wanted = set(self.handles) | {lmq for _, lmq in plan}
        # Keep pulling after being preempted: the fence must hold the evicted client off.
        plan += [("pull", lmq) for lmq in self.rng.sample(LMQS, len(LMQS)) if lmq in wanted]
        commands = [
            ["SUB", TOPIC, "LMQ", lmq, "GROUP", RACE_GROUP, "LOCK", 300_000] if kind == "sub"
            else ["PULL", self.handle(lmq), "COUNT", 10]
            for kind, lmq in plan
        ]
        self.conn.send_raw(pipeline(*commands))
        acks = []
        for (kind, lmq), reply in zip(plan, self.conn.replies(len(plan), timeout=30), strict=True):
            assert not isinstance(reply, Err), f"{self.name} {kind} {lmq}: {reply}"
            if kind == "sub":
                assert as_map(reply)["handle"] == self.handle(lmq)
                self.handles[lmq] = self.handle(lmq)
                self.subs[lmq] += 1
                continue
            got = deliveries(reply)
            self.pulls.append((lmq, self.subs[lmq], [(d["tag"], d["id"]) for d in got]))
            if got:
                acks.append(["ACK", self.handle(lmq), *(d["tag"] for d in got)])
        if acks:
            self.conn.send_raw(pipeline(*acks))
            self.acked += sum(self.conn.replies(len(acks), timeout=30))

    def handle(self, lmq: str) -> str:
        return self.sign(Handle(QueueRef(TOPIC, lmq), RACE_GROUP, self.name).encode())


def test_racing_preemptions_deliver_only_to_the_owner_and_every_message_is_acked_exactly_once(redis_url, r):
    with worker(redis_url) as w:
        racers = [Racer(f"c{i}", connect(w.port, f"c{i}", 3), random.Random(1000 + i), sign=signer(r).sign)
                  for i in range(CLIENTS)]
        producer = connect(w.port, "producer", 2)
        published: dict[str, list[str]] = defaultdict(list)
        stop = threading.Event()
        threads = [threading.Thread(target=x.run, args=(stop,), name=x.name) for x in racers]
        for t in threads:
            t.start()
        try:
            for b in range(BATCHES):
                for lmq in LMQS:
                    payloads = [f"{lmq}:{b * BATCH + k}" for k in range(BATCH)]
                    ids = producer.call("MPUB", TOPIC, BATCH, *payloads, "LMQ", lmq)
                    assert isinstance(ids, list) and len(ids) == BATCH, ids
                    published[lmq] += ids
                time.sleep(0.01)  # spread the publishes over the race
            # Race on until the racers have consumed nearly everything (the drain takes the rest).
            deadline = time.monotonic() + 30
            while sum(x.acked for x in racers) < 0.95 * len(LMQS) * BATCHES * BATCH and time.monotonic() < deadline:
                if any(x.error for x in racers):
                    break
                time.sleep(0.05)
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        for x in racers:
            assert x.error is None, f"{x.name} failed: {x.error!r}"

        # Drain with one final owner: everything not yet acked is still there for it.
        drainer = connect(w.port, "drainer", 2)
        drained = 0
        for lmq in LMQS:
            h = subscribe(drainer, TOPIC, lmq, "GROUP", RACE_GROUP)
            while got := pull(drainer, h, 100):
                drained += drainer.call("ACK", h, *(d["tag"] for d in got))
        queued_notices = {x.name: heartbeat(x.conn) for x in racers}
        for x in [*racers]:
            x.conn.close()
        producer.close()
        drainer.close()

    total = sum(len(v) for v in published.values())
    assert total == len(LMQS) * BATCHES * BATCH
    assert sum(x.acked for x in racers) + drained == total, "client-side ACK counts must add up to what was published"

    preempts_of: Counter = Counter()
    stats: Counter = Counter()
    for lmq in LMQS:
        events = journal(r, TOPIC, lmq)
        # -- replay the owner and the markers in commit order
        owner: str | None = None
        marked: set[str] = set()
        subs_done: Counter = Counter()
        evicted_at: dict[tuple[str, int], int] = {}  # (client, its k-th sub) -> index of the preempt
        out: dict[str, tuple[Event, int]] = {}  # tag -> (event, subs done by its member then)
        acks: Counter = Counter()
        acked_at: dict[str, int] = {}
        for e in events:
            stats[e.ev] += 1
            if e.ev == "sub":
                owner = e.member
                marked.discard(e.member)
                subs_done[e.member] += 1
            elif e.ev == "preempt":
                assert e.extra == owner, f"{lmq} #{e.index}: preempted {e.extra}, but the owner was {owner}"
                marked.add(e.extra)
                evicted_at[(e.extra, subs_done[e.extra])] = e.index
                preempts_of[e.extra] += 1
                owner = e.member
            elif e.ev == "out":
                assert e.member == owner, f"{lmq} #{e.index}: {e.id} checked out to {e.member}, owner was {owner}"
                assert e.member not in marked, f"{lmq} #{e.index}: checkout to evicted {e.member}"
                assert e.id not in acked_at, f"{lmq} #{e.index}: {e.id} delivered again after its ack"
                assert e.tag not in out, f"{lmq}: tag {e.tag} reused"
                out[e.tag] = (e, subs_done[e.member])
            elif e.ev == "ack":
                o = out.get(e.tag)
                assert o is not None and o[0].member == e.member and o[0].id == e.id, f"{lmq} #{e.index}: bad ack"
                acks[e.id] += 1
                acked_at[e.id] = e.index
            elif e.ev == "fenced":
                assert e.member in marked, f"{lmq} #{e.index}: {e.member} fenced without a marker"
            else:
                assert e.ev in ("pub", "leave"), f"unexpected journal event {e}"

        # -- every published message acknowledged exactly once (none lost, none consumed twice)
        pubs = [e.id for e in events if e.ev == "pub"]
        assert pubs == published[lmq]
        assert set(acks) == set(published[lmq]), f"{lmq}: lost {sorted(set(published[lmq]) - set(acks))[:10]}"
        assert [i for i, n in acks.items() if n != 1] == [], f"{lmq}: acked more than once"

        # -- client side: each PULL reply holds checkouts made for this client's current SUB,
        #    before its eviction committed (journal order), and nothing else
        seen: set[str] = set()
        for x in racers:
            for plmq, k, got in x.pulls:
                if plmq != lmq:
                    continue
                for tag, msg_id in got:
                    assert tag in out, f"{x.name} got tag {tag} of {lmq} that the journal never checked out"
                    e, k_then = out[tag]
                    assert (e.member, e.id) == (x.name, msg_id)
                    assert k_then == k, f"{x.name} got {tag} of {lmq} made under its SUB #{k_then}, not #{k}"
                    ev = evicted_at.get((x.name, k))
                    assert ev is None or e.index < ev, (
                        f"{x.name} received {msg_id} of {lmq} checked out at #{e.index}, after its eviction at #{ev}")
                    seen.add(tag)
        drained_tags = {t for t, (e, _) in out.items() if e.member == "drainer"}
        assert set(out) == seen | drained_tags, f"{lmq}: checkouts no client received"

    # The race really raced: preemptions, fenced pulls, and redeliveries of returned checkouts.
    assert stats["preempt"] >= 50 and stats["fenced"] >= 20, stats
    assert stats["out"] > total, "some checkouts must have been returned by a preemption and redelivered"
    # Every eviction left exactly one unsubscribe notice, queued for HEARTBEAT (and pushed: RESP3); a
    # client that polled on while fenced, not reading its notices, was told again (marked resent).
    for x in racers:
        notices = queued_notices[x.name]
        assert {n["type"] for n in notices} <= {"unsubscribe"}
        assert len([n for n in notices if not n.get("resent")]) == min(1000, preempts_of[x.name])
        assert len([n for n in unsubscribe_notices(x.conn.pushes) if not n.get("resent")]) <= preempts_of[x.name]


# =====================================================================================
# (a) resubscribing clears the caller's marker and marks the other


def test_an_evicted_client_resubscribing_clears_its_own_marker_and_marks_the_new_owner(w, r):
    with connect(w.port, "A") as a, connect(w.port, "B") as b:
        ha = subscribe(a, "chat", "x")
        hb = subscribe(b, "chat", "x")
        m = meta(r, "chat", "x")
        assert member_fields(m, "A")["mk"] == "B" and "mk" not in member_fields(m, "B")
        assert m[f"g|{GROUP}|own"] == "B"

        assert subscribe(a, "chat", "x") == ha  # preempts back
        m = meta(r, "chat", "x")
        assert "mk" not in member_fields(m, "A"), "the resubscriber's own marker is cleared"
        assert member_fields(m, "B")["mk"] == "A", "the client it took the lmq from is marked"
        assert m[f"g|{GROUP}|own"] == "A"
        (notice,) = unsubscribe_notices([b.next_push(3)])
        assert notice["handle"] == hb and notice["by"] == "A" and notice["lmq"] == "x"
        events = [(e.ev, e.member, e.extra) for e in journal(r, "chat", "x") if e.ev in ("sub", "preempt")]
        assert events == [("sub", "A", "exclusive"), ("preempt", "B", "A"), ("sub", "B", "exclusive"),
                          ("preempt", "A", "B"), ("sub", "A", "exclusive")]
        # B resubscribing in turn: the same switch, the other way
        assert subscribe(b, "chat", "x") == hb
        m = meta(r, "chat", "x")
        assert "mk" not in member_fields(m, "B") and member_fields(m, "A")["mk"] == "B"


def test_a_client_preempted_while_disconnected_finds_its_marker_and_notice_when_it_returns(w, r):
    a = connect(w.port, "A")
    ha = subscribe(a, "chat", "x")
    a.close()  # dropped; the session lives on for its lease (10 s)
    with connect(w.port, "B") as b:
        subscribe(b, "chat", "x")
        b.call("PUB", "chat", "for B", "LMQ", "x")
        assert member_fields(meta(r, "chat", "x"), "A")["mk"] == "B"
        with connect(w.port, "A") as back:  # the same id resumes the session
            assert pull(back, ha) == []
            (notice,) = heartbeat(back)
            assert (notice["type"], notice["handle"], notice["by"]) == ("unsubscribe", ha, "B")
            assert [d["payload"] for d in pull(b, subscribe(b, "chat", "x"))] == ["for B"]


# =====================================================================================
# (b) HEARTBEAT SYNC: the client's full set


def test_heartbeat_sync_drops_the_markers_of_lmqs_it_does_not_list(w, r):
    with connect(w.port, "A", 2) as a, connect(w.port, "B", 2) as b:
        hx, hy = subscribe(a, "chat", "x"), subscribe(a, "chat", "y")
        subscribe(b, "chat", "x")
        subscribe(b, "chat", "y")
        assert member_fields(meta(r, "chat", "x"), "A")["mk"] == "B"
        heartbeat(a)  # drain the two original notices

        notices = heartbeat(a, "chat", GROUP, "y")
        assert [(n["handle"], n.get("resent")) for n in notices] == [(hy, 1)]
        assert member_fields(meta(r, "chat", "x"), "A") == {}, "x not listed: marker and membership gone"
        assert member_fields(meta(r, "chat", "y"), "A")["mk"] == "B", "y listed: its marker stays"
        assert r.hget(KEYS.session_lite_counts("A"), "chat") == "1"
        assert held_handles(r, "A") == {hy}
        assert isinstance(a.call("PULL", hx), Err) and a.call("PULL", hx).code == "NOTFOUND"
        assert a.call("PULL", hy) == []  # still fenced
        # B, the owner, is untouched
        assert meta(r, "chat", "x")[f"g|{GROUP}|own"] == "B"


def test_heartbeat_sync_resends_the_unsubscribe_notice_of_a_listed_marked_lmq_on_every_heartbeat(w, r):
    with connect(w.port, "A", 3) as a, connect(w.port, "B", 3) as b:
        hx = subscribe(a, "chat", "x")
        subscribe(a, "chat", "y")
        subscribe(b, "chat", "x")
        a.next_push(3)  # the original notice
        assert [n.get("resent") for n in heartbeat(a)] == [None]
        for _ in range(3):
            notices = heartbeat(a, "chat", GROUP, "x", "y")  # y is held and unmarked: no notice for it
            assert [(n["type"], n["handle"], n["by"], n["lmq"], n["resent"]) for n in notices] == [
                ("unsubscribe", hx, "B", "x", 1)]
            push = a.next_push(3)  # a RESP3 client also gets each re-sent notice pushed
            assert push[1]["handle"] == hx and push[1]["resent"] in (1, True)
        assert member_fields(meta(r, "chat", "x"), "A")["mk"] == "B"
        # A plain HEARTBEAT (no SYNC) re-sends nothing
        assert heartbeat(a) == []


def test_heartbeat_sync_unsubscribes_lmqs_held_but_not_listed(w, r):
    with connect(w.port, "A", 2) as a, connect(w.port, "P", 2) as p, connect(w.port, "B", 2) as b:
        p.call("PUB", "chat", "m1", "LMQ", "x")
        hx, hy = subscribe(a, "chat", "x"), subscribe(a, "chat", "y")
        (held,) = pull(a, hx)
        assert heartbeat(a, "chat", GROUP, "y") == []
        m = meta(r, "chat", "x")
        assert member_fields(m, "A") == {} and f"g|{GROUP}|own" not in m
        assert a.call("PULL", hx).code == "NOTFOUND"
        assert a.call("ACK", hx, held["tag"]) == 0
        assert held_handles(r, "A") == {hy}
        assert meta(r, "chat", "y")[f"g|{GROUP}|own"] == "A"
        # the checkout went back at once: the next owner gets it
        (again,) = pull(b, subscribe(b, "chat", "x"))
        assert again["id"] == held["id"] and again["deliveries"] == 2
        # an empty list unsubscribes everything of (topic, group), and nothing of other topics
        hz = subscribe(a, "other", "z")
        assert heartbeat(a, "chat", GROUP) == []
        assert held_handles(r, "A") == {hz}
        assert r.hget(KEYS.session_lite_counts("A"), "chat") is None  # counted off, to nothing
        assert member_fields(meta(r, "chat", "y"), "A") == {}


# =====================================================================================
# (c) a session that ends drops all its markers and ownerships


def test_quit_removes_every_marker_and_ownership_of_the_session(w, r):
    with connect(w.port, "A") as a, connect(w.port, "B") as b:
        subscribe(a, "chat", "x")
        subscribe(a, "chat", "y")
        subscribe(b, "chat", "y")  # A is marked on y, owns x
        assert member_fields(meta(r, "chat", "y"), "A")["mk"] == "B"
        assert a.call("QUIT") == "OK"
        wait_for(lambda: not session_keys(r, "A"), what="A's session keys to go")
        for lmq in ("x", "y"):
            m = meta(r, "chat", lmq)
            assert [k for k in m if k.startswith(f"m|{GROUP}|A|")] == [], f"{lmq}: {m}"
            assert "A" not in m.get(f"g|{GROUP}|mem", "").split("\n")
        assert f"g|{GROUP}|own" not in meta(r, "chat", "x")
        assert meta(r, "chat", "y")[f"g|{GROUP}|own"] == "B"
        assert member_fields(meta(r, "chat", "y"), "B")["n"] == "0"


def test_lease_expiry_of_a_client_whose_only_lmq_was_taken_leaves_nothing_behind(redis_url, r):
    with worker(redis_url, session_lease_ms=500) as w:
        a = connect(w.port, "A")
        with connect(w.port, "B") as b:
            subscribe(a, "chat", "only")
            subscribe(b, "chat", "only")
            assert member_fields(meta(r, "chat", "only"), "A")["mk"] == "B"
            a.close()  # dropped, not QUIT: the session outlives the connection for its lease
            time.sleep(0.2)
            assert r.zscore(KEYS.sessions, "A") is not None, "the session must outlive its connection a while"
            wait_for(lambda: not session_keys(r, "A"), timeout=10, what="A's session to expire")
            m = meta(r, "chat", "only")
            assert [k for k in m if k.startswith(f"m|{GROUP}|A|")] == [], m
            assert m[f"g|{GROUP}|mem"] == "B" and m[f"g|{GROUP}|own"] == "B"
            assert ("leave", "A") in [(e.ev, e.member) for e in journal(r, "chat", "only")]
            b.call("PUB", "chat", "still B's", "LMQ", "only")
            assert [d["payload"] for d in pull(b, subscribe(b, "chat", "only"))] == ["still B's"]


class _FailOnce:
    """Wraps an async method: the first call matching ``when`` raises a Redis error, as a blip would."""

    def __init__(self, method: Any, when: Any) -> None:
        self.method, self.when, self.failed = method, when, 0

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.failed and self.when(*args, **kwargs):
            self.failed += 1
            raise redis.exceptions.ConnectionError("injected: Redis went away for a moment")
        return await self.method(*args, **kwargs)


def test_a_subscription_whose_session_write_failed_is_still_left_when_the_session_ends(w, r, monkeypatch):
    # the session's write (lua/lite_hold.lua: its index bucket is a key of the call) fails; the fences call
    # through the worker's link to Redis (redis-py's client on a Cluster)
    core = w.worker.core
    target, name = (core.fences.link, "execute") if core.fences.link else (core.redis, "execute_command")
    monkeypatch.setattr(target, name, _FailOnce(
        getattr(target, name), lambda *cmd, **_: cmd[0] == "EVALSHA" and any(":lmqs:" in str(a) for a in cmd[3:5])))
    with connect(w.port, "A", 2) as a:
        reply = a.call("SUB", "chat", "LMQ", "x", "POLICY", "reject")
        assert isinstance(reply, Err), "the injected failure reaches the client"
        a.call("QUIT")
    wait_for(lambda: not session_keys(r, "A"), what="A's session to end")
    assert member_fields(meta(r, "chat", "x"), "A") == {}
    assert f"g|{GROUP}|own" not in meta(r, "chat", "x")


def test_a_session_whose_cleanup_failed_once_is_cleaned_up_later(redis_url, r):
    with worker(redis_url, session_lease_ms=500) as w:
        subscriptions = w.worker.core.subscriptions
        subscriptions.unsubscribe = _FailOnce(subscriptions.unsubscribe, lambda h, session_over=False: session_over)
        a = connect(w.port, "A", 2)
        subscribe(a, "chat", "x")
        subscribe(a, "chat", "y")
        a.close()
        wait_for(lambda: r.zscore(KEYS.sessions, "A") is None, timeout=10, what="the session to be claimed")
        assert subscriptions.unsubscribe.failed == 1

        def cleaned() -> bool:  # by a later sweep round: waited for, not guessed at with a sleep
            left = {lmq: member_fields(meta(r, "chat", lmq), "A") for lmq in ("x", "y")}
            return left == {"x": {}, "y": {}} and session_keys(r, "A") == []

        wait_for(cleaned, timeout=10, what="A's lmq memberships and session keys cleaned up by a later sweep")


# =====================================================================================
# POLICY reject


def test_a_rejected_subscriber_changes_nothing_and_gets_the_lmq_once_the_holder_quits(redis_url, r):
    with worker(redis_url, lite_quota=1) as w, connect(w.port, "A") as a, connect(w.port, "B") as b:
        subscribe(a, "chat", "x", "POLICY", "reject")
        before = meta(r, "chat", "x")
        reply = b.call("SUB", "chat", "LMQ", "x", "POLICY", "reject")
        assert isinstance(reply, Err) and reply.code == "BUSY" and "A" in reply
        assert meta(r, "chat", "x") == before, "BUSY changes nothing: no marker, no member, no owner switch"
        assert held_handles(r, "B") == set() and r.hget(KEYS.session_lite_counts("B"), "chat") is None
        assert a.call("HEARTBEAT") == [] and a.pushes == []
        # B's quota of 1 was not used by the refusal
        a.call("QUIT")
        wait_for(lambda: not session_keys(r, "A"), what="A's session to end")
        hb = subscribe(b, "chat", "x", "POLICY", "reject")
        assert meta(r, "chat", "x")[f"g|{GROUP}|own"] == "B"
        b.call("PUB", "chat", "for B", "LMQ", "x")
        assert [d["payload"] for d in pull(b, hb)] == ["for B"]


# =====================================================================================
# The per-client quota


def test_a_client_over_its_lite_quota_gets_limit_until_it_unsubscribes_one(redis_url, r):
    with worker(redis_url, lite_quota=3) as w, connect(w.port, "A", 2) as a:
        h1 = subscribe(a, "chat", "q1")
        subscribe(a, "chat", "q2")
        subscribe(a, "chat", "q3")
        reply = a.call("SUB", "chat", "LMQ", "q4")
        assert isinstance(reply, Err) and reply.code == "LIMIT"
        assert meta(r, "chat", "q4") == {}, "a refused SUB creates nothing"
        subscribe(a, "chat", "q2")  # resubscribing one it holds is fine
        subscribe(a, "other", "q1")  # the quota is per topic
        assert a.call("UNSUB", h1) == "OK"
        subscribe(a, "chat", "q4")
        assert a.call("SUB", "chat", "LMQ", "q5").code == "LIMIT"
        assert r.hget(KEYS.session_lite_counts("A"), "chat") == "3"


def test_a_preempted_lmq_counts_against_the_quota_until_heartbeat_sync_drops_it(redis_url, r):
    with worker(redis_url, lite_quota=2) as w, connect(w.port, "A", 2) as a, connect(w.port, "B", 2) as b:
        subscribe(a, "chat", "q1")
        subscribe(a, "chat", "q2")
        subscribe(b, "chat", "q1")  # A is marked on q1: still a member, still counted
        assert a.call("SUB", "chat", "LMQ", "q3").code == "LIMIT"
        heartbeat(a, "chat", GROUP, "q2")
        subscribe(a, "chat", "q3")
        assert r.hget(KEYS.session_lite_counts("A"), "chat") == "2"


def test_a_lite_push_subscription_ended_by_unsub_frees_its_quota(redis_url, r):
    with worker(redis_url, lite_quota=1) as w, connect(w.port, "A", 2) as a:
        h = subscribe(a, "chat", "q1", "PUSH")
        assert a.call("UNSUB", h) == "OK"
        assert a.call("TAKE", h) == "EOS"
        assert held_handles(r, "A") == set()
        reply = a.call("SUB", "chat", "LMQ", "q2")
        assert not isinstance(reply, Err), f"the ended subscription still counts: {reply}"


# =====================================================================================
# Idle reclaim


def test_an_lmq_emptied_and_unowned_gets_the_idle_ttl_and_vanishes(redis_url, r):
    with worker(redis_url, lmq_idle_ttl_ms=300) as w, connect(w.port, "A", 2) as a:
        a.call("MPUB", "chat", 2, "m1", "m2", "LMQ", "x")
        h = subscribe(a, "chat", "x")
        got = pull(a, h)
        assert a.call("ACK", h, *(d["tag"] for d in got)) == 2
        keys = lmq_keys(r, "chat", "x")
        assert keys and all(ttl == -1 for ttl in keys.values()), f"owned: no TTL {keys}"
        assert a.call("UNSUB", h) == "OK"
        keys = lmq_keys(r, "chat", "x")
        assert keys and all(0 < ttl <= 300 for ttl in keys.values()), keys
        wait_for(lambda: not lmq_keys(r, "chat", "x"), timeout=3, what="the idle lmq to vanish")
        # an lmq made by a SUB alone and left at once goes too
        subscribe(a, "chat", "y")
        a.call("UNSUB", subscribe(a, "chat", "y"))
        wait_for(lambda: not lmq_keys(r, "chat", "y"), timeout=3, what="the never-used lmq to vanish")


def test_an_owned_or_non_empty_lmq_keeps_no_ttl(redis_url, r):
    with worker(redis_url, lmq_idle_ttl_ms=300) as w, connect(w.port, "A", 2) as a, connect(w.port, "B", 2) as b:
        subscribe(a, "chat", "owned")  # owned, empty
        a.call("PUB", "chat", "m1", "LMQ", "full")  # unowned, one unread message
        a.call("UNSUB", subscribe(a, "chat", "full"))
        subscribe(a, "chat", "marked")  # owner leaves, but a marked member remains
        hb = subscribe(b, "chat", "marked")
        b.call("UNSUB", hb)
        for lmq in ("owned", "full", "marked"):
            keys = lmq_keys(r, "chat", lmq)
            assert keys and all(ttl == -1 for ttl in keys.values()), f"{lmq}: {keys}"
        time.sleep(0.6)
        for lmq in ("owned", "full", "marked"):
            assert meta(r, "chat", lmq), f"{lmq} was reclaimed"
        # ...until the marked member's session ends: then nobody is left and it goes
        a.call("QUIT")
        wait_for(lambda: not lmq_keys(r, "chat", "marked"), timeout=3, what="the lmq to be reclaimed")
        assert meta(r, "chat", "full")


def test_an_lmq_that_comes_back_to_life_keeps_no_ttl_on_any_key(redis_url, r):
    def ttls() -> dict[str, int]:
        return {k.rsplit("}", 1)[1] or "meta": t for k, t in lmq_keys(r, "chat", "x").items()}

    with worker(redis_url, lmq_idle_ttl_ms=400) as w, connect(w.port, "A", 2) as a, connect(w.port, "B", 2) as b:
        a.call("PUB", "chat", "m1", "LMQ", "x", "ID", "d1")  # every kind of key: meta, log, dedup, journal
        h = subscribe(a, "chat", "x")
        a.call("ACK", h, *(d["tag"] for d in pull(a, h)))
        a.call("UNSUB", h)  # idle: every key gets the TTL (the log went with its one consumed message)
        assert set(ttls()) == {"meta", ":dd", ":ddm", ":jr"} and all(t > 0 for t in ttls().values())
        hb = subscribe(b, "chat", "x")  # an owner revives it
        assert {k: t for k, t in ttls().items() if t != -1} == {}
        b.call("UNSUB", hb)
        assert all(t > 0 for t in ttls().values())
        b.call("PUB", "chat", "m2", "LMQ", "x")  # so does a message to read
        assert {k: t for k, t in ttls().items() if t != -1} == {}
        time.sleep(0.6)
        assert set(ttls()) == {"meta", ":log", ":dd", ":ddm", ":jr"}


def test_an_idle_lmq_that_had_dedup_ids_vanishes_whole(redis_url, r):
    with worker(redis_url, lmq_idle_ttl_ms=300) as w, connect(w.port, "A", 2) as a:
        a.call("PUB", "chat", "m1", "LMQ", "x", "ID", "d1")
        h = subscribe(a, "chat", "x")
        (d,) = pull(a, h)
        a.call("ACK", h, d["tag"])
        a.call("UNSUB", h)
        wait_for(lambda: lmq_keys(r, "chat", "x") == {}, timeout=2, what="every key of the idle lmq to expire (TTL 300 ms)")


def test_an_lmq_reclaimed_and_made_again_never_gives_an_id_it_gave_before(redis_url, r):
    with worker(redis_url, lmq_idle_ttl_ms=300) as w, connect(w.port, "A", 2) as a:
        before = [int(i) for i in a.call("MPUB", "chat", 2, "m1", "m2", "LMQ", "x")]
        h = subscribe(a, "chat", "x")
        assert a.call("ACK", h, *(d["tag"] for d in pull(a, h))) == 2
        a.call("UNSUB", h)
        wait_for(lambda: not lmq_keys(r, "chat", "x"), timeout=3, what="the idle lmq to vanish")
        after = [int(i) for i in a.call("MPUB", "chat", 2, "m3", "m4", "LMQ", "x")]
        assert after[1] == after[0] + 1 and after[0] > before[1], (before, after)
        h = subscribe(a, "chat", "x")
        got = pull(a, h)
        assert [(int(d["id"]), d["payload"]) for d in got] == [(after[0], "m3"), (after[1], "m4")]


# =====================================================================================
# Offset policy on preemption


@pytest.mark.parametrize("policy", ["keep", "earliest", "latest"])
def test_the_offset_policy_decides_the_new_owners_first_pull(w, r, policy):
    with connect(w.port, "A", 2) as a, connect(w.port, "B", 2) as b:
        sa = as_map(a.call("SUB", "chat", "LMQ", "x", "ON-PREEMPT", policy))
        epoch0 = int(sa["epoch"])
        a.call("MPUB", "chat", 3, "m1", "m2", "m3", "LMQ", "x")
        m1, m2 = pull(a, sa["handle"], 2)
        assert a.call("ACK", sa["handle"], m1["tag"]) == 1  # m2 stays checked out to A
        sb = as_map(b.call("SUB", "chat", "LMQ", "x"))
        first = pull(b, sb["handle"], 10)
        got = [(d["payload"], d["deliveries"]) for d in first]
        if policy == "keep":
            assert got == [("m2", 2), ("m3", 1)], "cursor kept; A's checkout comes back first"
            assert int(sb["epoch"]) == epoch0 and all(d["epoch"] == epoch0 for d in first)
        elif policy == "earliest":
            assert got == [("m1", 1), ("m2", 1), ("m3", 1)], "rewound to the first retained message"
            assert int(sb["epoch"]) == epoch0 + 1 and all(d["epoch"] == epoch0 + 1 for d in first)
        else:
            assert got == [], "moved past everything published"
            assert int(sb["epoch"]) == epoch0 + 1
            a.call("PUB", "chat", "m4", "LMQ", "x")
            assert [d["payload"] for d in pull(b, sb["handle"])] == ["m4"]
        assert a.call("ACK", sa["handle"], m2["tag"]) == 0, "the evicted owner's checkout settles nothing"
        # a second preemption applies the policy again
        again = as_map(a.call("SUB", "chat", "LMQ", "x"))
        assert int(again["epoch"]) == (epoch0 if policy == "keep" else epoch0 + 2)
        assert meta(r, "chat", "x")[f"g|{GROUP}|onpre"] == policy


# =====================================================================================
# Operator force-evict


def test_an_operator_force_evict_fences_the_client_until_it_subscribes_again(w, r, redis_url):
    async def evict(client: str, lmq: str) -> int:
        conn = helpers.direct_async(redis_url)
        try:
            return await Core(conn, Config(redis_url=redis_url)).lite.evict(Handle(QueueRef("chat", lmq), GROUP, client))
        finally:
            await conn.aclose()

    with connect(w.port, "A", 2) as a:
        h = subscribe(a, "chat", "x")
        a.call("MPUB", "chat", 2, "m1", "m2", "LMQ", "x")
        (held,) = pull(a, h, 1)
        assert asyncio.run(evict("A", "x")) == 1  # its checkout went back
        m = meta(r, "chat", "x")
        assert member_fields(m, "A")["mk"] == "operator" and f"g|{GROUP}|own" not in m
        for _ in range(3):
            assert pull(a, h) == []
        assert a.call("ACK", h, held["tag"]) == 0
        # (this eviction sent no notice) polling on, it is told once a second; a SYNC tells it too
        told = [(n["type"], n["by"], n.get("resent")) for n in heartbeat(a)]
        assert told == [("unsubscribe", "operator", 1)]
        assert [(n["type"], n["by"], n.get("resent")) for n in heartbeat(a, "chat", GROUP, "x")] == told
        evs = [e.ev for e in journal(r, "chat", "x")]
        assert "evict" in evs and evs.count("fenced") == 1, "a fenced client's pulls are journaled once per eviction"
        assert subscribe(a, "chat", "x") == h
        assert "mk" not in member_fields(meta(r, "chat", "x"), "A")
        assert [(d["payload"], d["deliveries"]) for d in pull(a, h)] == [("m1", 2), ("m2", 1)]
        assert asyncio.run(evict("nobody", "x")) == -1


# =====================================================================================
# A topic is lite or plain for good


def test_the_first_use_of_a_topic_decides_its_kind_for_every_verb_and_worker(redis_url, r):
    with worker(redis_url) as w1, connect(w1.port, "A", 2) as a:
        subscribe(a, "lite", "x")  # a SUB, not a PUB, made it lite
        a.call("PUB", "plain", "m")
        refused = [
            a.call("PUB", "lite", "m"),
            a.call("MPUB", "lite", 2, "m1", "m2"),
            a.call("SUB", "lite", "GROUP", "g"),
            a.call("MPUB", "plain", 1, "m", "LMQ", "x"),
            a.call("SUB", "plain", "LMQ", "x", "GROUP", "g"),
        ]
        assert [x.code if isinstance(x, Err) else x for x in refused] == ["BADARG"] * 5
        assert "lite" in refused[0] and "plain" in refused[3]
        assert not r.exists(KEYS.queue(QueueRef("lite")).meta), "a refused call creates nothing"
        assert not r.exists(KEYS.queue(QueueRef("plain", "x")).meta)
        with worker(redis_url) as w2, connect(w2.port, "B", 2) as b:  # another worker, nothing cached
            assert b.call("PUB", "lite", "m").code == "BADARG"
            assert b.call("SUB", "plain", "LMQ", "x").code == "BADARG"


# =====================================================================================
# The session index: where a session keeps its lite subscriptions


def bucket_fields(r: redis.Redis, client: str) -> dict[str, set[str]]:
    """The client's non-empty lite buckets: key -> fields."""
    found = {k: set(r.hkeys(k)) for k in session_index.bucket_keys(KEYS, client)}
    return {k: f for k, f in found.items() if f}


def test_a_lite_field_names_group_lmq_and_topic_and_a_topic_may_contain_the_separator():
    h = Handle(QueueRef("a|b|c", "x"), "g", "A")
    assert session_index.field(h) == "g|x|a|b|c"
    assert session_index.handle_of("A", session_index.field(h)) == h
    assert session_index.add_command(KEYS, h) == [
        "HSETNX", KEYS.session_lmqs("A", session_index.bucket("x")), "g|x|a|b|c", ""]


def test_the_default_group_is_written_empty_in_a_lite_field_and_both_forms_read_as_one_handle():
    h = Handle(QueueRef("a|b", "x"), GROUP, "A")
    assert session_index.field(h) == "|x|a|b"
    assert session_index.legacy_field(h) == f"{GROUP}|x|a|b"
    assert session_index.handle_of("A", "|x|a|b") == session_index.handle_of("A", f"{GROUP}|x|a|b") == h
    other = Handle(QueueRef("t", "x"), "g", "A")
    assert session_index.entry_args(other) == ["g|x|t", "g|x|t"]
    assert session_index.remove_command(KEYS, h) == ["HDEL", KEYS.session_lmqs("A", session_index.bucket("x")),
                                                     "|x|a|b", f"{GROUP}|x|a|b"]


def legacy_index(r: redis.Redis, client: str) -> None:
    """Rewrite the client's lite index as it was written before the default group went empty."""
    for key, fields in bucket_fields(r, client).items():
        for f in fields:
            if f.startswith("|"):
                r.hdel(key, f)
                r.hset(key, GROUP + f, "")


def test_an_index_entry_written_in_the_older_form_is_still_held_read_and_let_go(w, r):
    with connect(w.port, "A", 2) as a:
        handles = {lmq: subscribe(a, "chat", lmq) for lmq in ("x", "y", "z")}
        g = subscribe(a, "chat", "x", "GROUP", "g")
        legacy_index(r, "A")
        assert {f for fs in bucket_fields(r, "A").values() for f in fs} == {
            f"{GROUP}|x|chat", f"{GROUP}|y|chat", f"{GROUP}|z|chat", "g|x|chat"}
        assert held_handles(r, "A") == set(handles.values()) | {g}
        # subscribing again finds it held: no second entry, no second count, the older entry stays
        assert subscribe(a, "chat", "x") == handles["x"]
        assert r.hget(KEYS.session_lite_counts("A"), "chat") == "4"
        assert sum(map(len, bucket_fields(r, "A").values())) == 4
        # a sync that no longer lists y lets go of its older entry; an UNSUB lets go of z's
        assert heartbeat(a, "chat", GROUP, "x", "z") == []
        assert a.call("UNSUB", handles["z"]) == "OK"
        assert held_handles(r, "A") == {handles["x"], g}
        assert r.hget(KEYS.session_lite_counts("A"), "chat") == "2"
        # held again after letting go: now in the new form
        assert subscribe(a, "chat", "y") == handles["y"]
        assert "|y|chat" in bucket_fields(r, "A")[KEYS.session_lmqs("A", session_index.bucket("y"))]
        a.call("QUIT")
    wait_for(lambda: not session_keys(r, "A"), what="A's session to end")
    assert bucket_fields(r, "A") == {}
    assert all(member_fields(meta(r, "chat", lmq), "A") == {} for lmq in ("x", "y", "z"))


def test_lite_subscriptions_of_one_client_land_in_bucket_hashes_that_stay_listpack_encoded_at_1000_lmqs(w, r):
    lmqs = [f"q{i}" for i in range(1000)]
    with connect(w.port, "A", 2) as a:
        a.send_raw(pipeline(*(("SUB", "many", "LMQ", lmq) for lmq in lmqs)))
        handles = {as_map(reply)["handle"] for reply in a.replies(len(lmqs), timeout=30)}
        buckets = bucket_fields(r, "A")
        assert len(buckets) == session_index.BUCKETS
        assert {r.object("encoding", k) for k in buckets} == {"listpack"}
        assert sum(map(len, buckets.values())) == 1000
        for key, fields in buckets.items():
            assert all(key == KEYS.session_lmqs("A", session_index.bucket(f.split("|")[1])) for f in fields)
        assert {r.hget(k, f) for k, fields in buckets.items() for f in fields} == {""}
        assert not r.exists(KEYS.session_handles("A")), "no lite handle goes to the :subs set"
        assert held_handles(r, "A") == handles
        assert r.hget(KEYS.session_lite_counts("A"), "many") == "1000"


def test_session_end_leaves_no_bucket_key_behind(w, r):
    with connect(w.port, "A", 2) as a:
        for i in range(40):
            subscribe(a, "chat", f"e{i}")
        a.call("SUB", "plain", "GROUP", "g")
        assert len(bucket_fields(r, "A")) == session_index.BUCKETS
        a.call("QUIT")
    wait_for(lambda: not session_keys(r, "A"), what="A's session to end")
    assert list(r.scan_iter(match=KEYS.session("A").replace("{", "[{]").replace("}", "[}]") + "*")) == []
    assert all(member_fields(meta(r, "chat", f"e{i}"), "A") == {} for i in range(40))


def test_heartbeat_sync_still_unsubscribes_held_but_unlisted_lmqs_across_buckets(w, r):
    lmqs = [f"s{i}" for i in range(40)]
    kept = lmqs[::3]
    with connect(w.port, "A", 2) as a:
        handles = {lmq: subscribe(a, "chat", lmq) for lmq in lmqs}
        other = subscribe(a, "chat", "s0", "GROUP", "g2")  # same lmq, another group: not in this sync
        assert len({session_index.bucket(lmq) for lmq in lmqs}) == session_index.BUCKETS
        assert heartbeat(a, "chat", GROUP, *kept) == []
        assert held_handles(r, "A") == {handles[lmq] for lmq in kept} | {other}
        assert r.hget(KEYS.session_lite_counts("A"), "chat") == str(len(kept) + 1)
        for lmq in lmqs:
            assert (f"g|{GROUP}|own" in meta(r, "chat", lmq)) == (lmq in kept), lmq


def test_a_non_lite_handle_still_lives_in_the_subs_set(w, r):
    with connect(w.port, "A", 2) as a:
        h = as_map(a.call("SUB", "plain", "GROUP", "g"))["handle"]
        hl = subscribe(a, "chat", "x")
        assert {signer(r).sign(x) for x in r.smembers(KEYS.session_handles("A"))} == {h}
        assert bucket_fields(r, "A") == {KEYS.session_lmqs("A", session_index.bucket("x")): {"|x|chat"}}
        assert held_handles(r, "A") == {h, hl}
        assert a.call("UNSUB", h) == "OK"
        assert not r.exists(KEYS.session_handles("A"))


# =====================================================================================
# Pipelined SUBs of many lmqs (run together: the holds, the fences, the notices)


def _pipelined(c: RespConn, *commands: tuple[Any, ...]) -> list[Any]:
    c.send_raw(pipeline(*commands))
    return [c.reply() for _ in commands]


def test_pipelined_subs_preempting_many_lmqs_each_switch_the_owner_and_notify_the_old_one_once(redis_url, r):
    with worker(redis_url) as w, connect(w.port, "A", 3) as a, connect(w.port, "B", 2) as b:
        for i in range(50):
            a.call("PUB", "chat", f"m{i}", "LMQ", f"q{i}")
        assert all(not isinstance(x, Err) for x in _pipelined(a, *(("SUB", "chat", "LMQ", f"q{i}") for i in range(50))))
        replies = _pipelined(b, *(("SUB", "chat", "LMQ", f"q{i}") for i in range(50)))
        assert [as_map(x)["owner"] for x in replies] == ["B"] * 50
        pushed = [a.next_push()[1] for _ in range(50)]  # told at once, each in a push of its own (RESP3)
        assert sorted(n["lmq"] for n in pushed) == sorted(f"q{i}" for i in range(50))
        notices = heartbeat(a)
        assert sorted(n["lmq"] for n in notices) == sorted(f"q{i}" for i in range(50))
        assert {n["by"] for n in notices} == {"B"} and len({n["nid"] for n in notices}) == 50
        assert r.hget(KEYS.session_lite_counts("B"), "chat") == "50"
        for i in (0, 49):
            assert meta(r, "chat", f"q{i}")[f"g|{GROUP}|own"] == "B"
            assert [d["payload"] for d in pull(b, as_map(replies[i])["handle"])] == [f"m{i}"]


def test_in_a_pipelined_run_of_subs_each_refusal_is_its_own_and_holds_no_quota(redis_url, r):
    with worker(redis_url, lite_quota=3) as w, connect(w.port, "A", 2) as a, connect(w.port, "B", 2) as b:
        subscribe(a, "chat", "held", "POLICY", "reject")
        replies = _pipelined(
            b,
            ("SUB", "chat", "LMQ", "q1"),
            ("SUB", "chat", "LMQ", "q2", "LOCK", 0),  # BADARG: nothing written
            ("SUB", "chat", "LMQ", "held", "POLICY", "reject"),  # BUSY: its hold let go
            ("SUB", "chat", "LMQ", "q3"),
            ("SUB", "chat", "LMQ", "q1"),  # held already: fine
            ("SUB", "chat", "LMQ", "q4"),
            ("SUB", "chat", "LMQ", "q5"),  # the fourth: over the quota of 3
        )
        codes = [x.code if isinstance(x, Err) else "OK" for x in replies]
        assert codes == ["OK", "BADARG", "BUSY", "OK", "OK", "OK", "LIMIT"]
        assert r.hget(KEYS.session_lite_counts("B"), "chat") == "3"
        assert {h.queue.lmq for h in (Handle.decode(x) for x in held_handles(r, "B"))} == {"q1", "q3", "q4"}
        assert meta(r, "chat", "q2") == {} and meta(r, "chat", "q5") == {}, "a refused SUB creates nothing"
        assert meta(r, "chat", "held")[f"g|{GROUP}|own"] == "A"
