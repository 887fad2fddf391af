"""The real fences, driven through fencemq.fences.core.Core, against tests/reference.py.

``Harness`` runs every operation on both the real broker (one private Redis,
the ``redis_server`` session fixture, flushed before each example) and the
reference model, and asserts that the replies agree; ``Harness.check`` then
compares the whole Redis state of the queue with the model: the meta hash
(cursors, epochs, owners, members, delivery counters, suspicion, markers),
checkouts, lease deadlines, ownership index, ready and delayed sets, dead
letters and the global sweep schedule, plus invariants read from Redis alone
(no id checked out twice at once in a group; ready, delayed and checked-out
ids disjoint and behind the cursor).

Time is moved by the test, never mocked: a lease expires when the test
rewrites its score in the deadlines zset (``<meta>:dl``) to 0, a delayed
redelivery becomes due when its score in ``<meta>:dly`` is set to 0; the
fences then see them as past due against the real Redis clock. Leases are
long (60 s and more), so nothing ever expires by itself during a test.

The bugs the model found are kept as focused regression tests at the end.
"""

from __future__ import annotations

import asyncio
import os
from collections import defaultdict
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)
from redis.asyncio import Redis

from fencemq.config import Config
from fencemq.errors import FenceMQError
from fencemq.model.keys import QueueRef
from fencemq.model.handles import Handle
from fencemq.model.messages import unpack_delivery
from fencemq.fences.core import Core
from fencemq.fences.leases import tags_of_leases
from fencemq.model.records import Checkout, per_tag_view
from fencemq.ops import totals
from tests.helpers import direct_async, in_cluster_mode
from tests.reference import (
    SEP,
    ModelError,
    PullReply,
    QueueModel,
    SeekReply,
    SubReply,
    SweepReply,
)

TOPIC = "mt"
QREF = QueueRef(TOPIC)
GROUPS = ("g1", "g2")
MEMBERS = ("a", "b", "c")
LONG_LOCK = 150_000  # longer than any other lease used here
CONFIG = Config(
    prefix="fmq",
    max_failures=3,
    default_lock_ms=60_000,
    retention_maxlen=0,  # no trimming: every published id stays accounted for
    retention_maxage_ms=0,
)


class Err:
    """An error reply, compared by its code word only."""

    def __init__(self, code: str) -> None:
        self.code = code

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Err) and other.code == self.code

    def __repr__(self) -> str:
        return f"Err({self.code})"


class Driver:
    """A synchronous face on the async API: one event loop and one client for a whole test."""

    def __init__(self, url: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.redis: Redis = self.loop.run_until_complete(self._connect(url))
        self.queues = Core(self.redis, CONFIG)

    @staticmethod
    async def _connect(url: str) -> Redis:
        return direct_async(url)

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def reset(self, config: Config = CONFIG) -> None:
        self.run(self.redis.flushall())
        self.queues = Core(self.redis, config)  # fresh topic-kind cache

    def now_ms(self) -> int:
        sec, usec = self.run(self.redis.time())
        return int(sec) * 1000 + int(usec) // 1000

    def close(self) -> None:
        self.run(self.redis.aclose())
        self.loop.close()


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class Harness:
    """One queue, operated on the real broker and on the model in lockstep."""

    def __init__(self, driver: Driver) -> None:
        driver.reset()
        self.d = driver
        self.q = driver.queues
        self.keys = self.q.keys.queue(QREF)
        self.model = QueueModel(max_failures=CONFIG.max_failures, default_lock_ms=CONFIG.default_lock_ms)
        self.received: dict[tuple[str, str], list[str]] = defaultdict(list)  # every tag ever delivered
        self.published = 0
        self.auto_check = False  # example tests: compare the whole state after every operation
        # Real tags are opaque and only grow (lua/lib/leases.lua, next_tags); the model numbers them 1, 2, …
        self._model_tag: dict[str, int] = {}
        self._real_tag: dict[int, str] = {}

    def model_tag(self, real: str) -> int:
        """The model's number for a real tag: the n-th tag ever handed out is n; each is larger than the last."""
        if real not in self._model_tag:
            if self._real_tag:
                last = self._real_tag[len(self._real_tag)]
                assert (len(real), real) > (len(last), last), f"tag {real} handed out after {last}"
            n = len(self._model_tag) + 1
            self._model_tag[real], self._real_tag[n] = n, real
        return self._model_tag[real]

    def real_tags(self, tags: list[str]) -> list[str]:
        """Model tags as the broker knows them; one never handed out stays one (it settles nothing)."""
        return [self._real_tag.get(int(t), f"9{t}") if t.isdigit() else t for t in tags]

    def _after(self, result: Any) -> Any:
        if self.auto_check:
            self.check()
        return result

    # -- plumbing ------------------------------------------------------------------------

    def _real(self, coro: Any) -> Any:
        try:
            return self.d.run(coro)
        except FenceMQError as exc:
            return Err(exc.code)

    @staticmethod
    def _predict(fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ModelError as exc:
            return Err(exc.code)

    @staticmethod
    def handle(group: str, member: str) -> Handle:
        return Handle(QREF, group, member)

    # -- operations ------------------------------------------------------------------------

    def publish(self, dedups: list[str | None]) -> list[int]:
        payloads = []
        for _ in dedups:
            self.published += 1
            payloads.append(b"p%d" % self.published)
        before = self.model.seq
        ids = self.d.run(self.q.publishing.publish(TOPIC, payloads, dedup_ids=list(dedups)))
        stamp = 0
        # read the fence's clock off a new entry (a repeated run longer than the first answers ids
        # past it that were never stored: the same dedup id must name the same batch)
        for new in sorted({int(i) for i in ids if int(i) > before}, reverse=True):
            stored = self.d.run(self.d.redis.hget(self.keys.log, new))
            if stored is not None:
                stamp = int(stored.partition(b":")[0])
                break
        expected = self.model.publish(list(zip(payloads, dedups)), stamp)
        assert [int(i) for i in ids] == expected
        return self._after(expected)

    def subscribe(self, group: str, member: str, **kw: Any) -> SubReply | Err:
        start = kw.pop("start", ("earliest", None))
        real = self._real(self.q.subscriptions.subscribe(
            member, TOPIC, group=group, mode=kw.get("mode"), policy=kw.get("policy"), start=start,
            lock_ms=kw.get("lock_ms"), epoch=kw.get("epoch"), max_messages=kw.get("max_messages"),
            on_preempt=kw.get("onpre"),
        ))
        if not isinstance(real, Err):
            real = SubReply(real.mode, real.epoch, real.owner, real.evicted or "", real.returned, real.cursor)
        expected = self._predict(self.model.subscribe, group, member, start=start, **kw)
        assert real == expected
        return self._after(expected)

    def pull(self, group: str, member: str, count: int) -> PullReply | Err:
        t0 = self.d.now_ms()
        res = self._real(self.q.leases.pull(self.handle(group, member), count))
        t1 = self.d.now_ms()
        expected = self._predict(self.model.pull, group, member, count, now=(t0, t1))
        if not isinstance(res, Err):
            for dv in res.deliveries:
                assert dv.epoch == res.epoch
                assert dv.payload == self.model.payloads[int(dv.id)], "payload does not match its id"
            res = PullReply(res.epoch, res.status,
                            [(self.model_tag(dv.tag), int(dv.id), dv.deliveries) for dv in res.deliveries])
            self.received[(group, member)].extend(str(t) for t, _, _ in res.deliveries)
        assert res == expected
        return self._after(expected)

    def ack(self, group: str, member: str, tags: list[str]) -> int:
        real = self.d.run(self.q.leases.ack(self.handle(group, member), self.real_tags(tags)))
        expected = self.model.ack(group, member, tags)
        assert real == expected
        return self._after(expected)

    def nack(self, group: str, member: str, tags: list[str], *, delay_ms: int = 0, discard: bool = False) -> int:
        t0 = self.d.now_ms()
        real = self.d.run(self.q.leases.nack(self.handle(group, member), self.real_tags(tags), delay_ms=delay_ms,
                                             discard=discard))
        t1 = self.d.now_ms()
        expected = self.model.nack(group, member, tags, delay_ms=delay_ms, discard=discard, now=(t0, t1))
        assert real == expected
        return self._after(expected)

    def renew(self, group: str, member: str, tags: list[str], *, lock_ms: int | None = None) -> int:
        t0 = self.d.now_ms()
        real = self.d.run(self.q.leases.renew(self.handle(group, member), self.real_tags(tags), lock_ms=lock_ms))
        t1 = self.d.now_ms()
        expected = self.model.renew(group, member, tags, lock_ms=lock_ms, now=(t0, t1))
        assert real == expected
        return self._after(expected)

    def expire(self, tags: list[int]) -> None:
        """Time passes for these leases: their deadlines move into the past. A lease batch (one PULL's
        checkouts) expires whole: the model is told of every checkout under the leases that did."""
        if tags:
            leases, expired = self._leases_of([self._real_tag[t] for t in tags])
            self.d.run(self.d.redis.zadd(self.keys.deadlines, {lease: 0 for lease in leases}, xx=True))
            tags = sorted({self.model_tag(t) for t in expired})
        self.model.expire(tags)
        self._after(None)

    def _leases_of(self, real_tags: list[str]) -> tuple[set[str], list[str]]:
        """The leases these checkouts are under, and every checkout under them (real tags)."""
        k = self.keys
        records = self.d.run(self.d.redis.hmget(k.checkouts, real_tags))
        leases = {Checkout.decode(r).lease(t) if r is not None else t for t, r in zip(real_tags, records, strict=True)}
        return leases, self.d.run(tags_of_leases(self.d.redis, k, sorted(leases)))

    def make_due(self, group: str) -> None:
        """Time passes for the group's delayed redeliveries."""
        g = self.model.groups.get(group)
        ids = sorted(g.delayed) if g else []
        members = {SEP.join((group, f"{i:016d}", str(g.delayed[i].acq), str(g.delayed[i].fail))): 0 for i in ids}
        if members:
            self.d.run(self.d.redis.zadd(self.keys.delayed, members, xx=True))
            self.model.make_due(group, ids)
        self._after(None)

    def sweep(self) -> SweepReply:
        res = self.d.run(self.q.leases.sweep(QREF.qid))
        expected = self.model.sweep()
        notices = [(g, m, [str(self.model_tag(x)) for x in t], s) for g, m, t, s in res.timeouts]
        assert SweepReply(res.returned, notices) == expected
        # right after a sweep the queue is scheduled exactly at its earliest deadline or due time, or not at
        # all — or, while a lease intent is recent, kept listed until it is quiet (fences/leases.py)
        k = self.keys

        async def firsts() -> list[Any]:
            async with self.d.redis.pipeline(transaction=not in_cluster_mode()) as p:
                p.zrange(k.deadlines, 0, 0, withscores=True)
                p.zrange(k.delayed, 0, 0, withscores=True)
                p.zscore(self.q.ctx.schedule_keys(QREF.qid)[0], QREF.qid)
                return await p.execute()

        dl, dly, scheduled = self.d.run(firsts())
        dues = [int(x[0][1]) for x in (dl, dly) if x]
        if dues:
            assert scheduled == min(dues), "sweep left the queue's schedule wrong"
        elif scheduled is not None:
            intent = self.d.run(self.d.redis.zscore(self.q.ctx.schedule_keys(QREF.qid)[1], QREF.qid))
            quiet = self.q.ctx.intent_quiet_ms
            assert intent is not None and scheduled == intent + quiet, "sweep left the queue's schedule wrong"
        return self._after(expected)

    def seek(self, group: str, member: str, kind: str, arg: int | None = None) -> SeekReply | Err:
        real = self._real(self.q.seek.move(self.handle(group, member), kind, arg))
        if not isinstance(real, Err):
            real = SeekReply(*real)
        expected = self._predict(self.model.seek, group, kind, arg, member)
        assert real == expected
        return self._after(expected)

    def unsubscribe(self, group: str, member: str) -> int:
        real = self.d.run(self.q.subscriptions.unsubscribe(self.handle(group, member)))
        expected = self.model.unsubscribe(group, member)
        assert real == expected
        return self._after(expected)

    # -- state ---------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        k = self.keys

        async def read() -> list[Any]:
            # A Cluster keeps the schedule in a slot of its own: no transaction can span both.
            async with self.d.redis.pipeline(transaction=not in_cluster_mode()) as p:
                p.hgetall(k.meta)
                p.hgetall(k.checkouts)
                p.zrange(k.deadlines, 0, -1, withscores=True)
                p.zrange(k.owned, 0, -1)
                p.zrange(k.ready, 0, -1)
                p.zrange(k.delayed, 0, -1, withscores=True)
                p.lrange(k.dead, 0, -1)
                p.zscore(self.q.ctx.schedule_keys(QREF.qid)[0], QREF.qid)
                p.hlen(k.log)
                return await p.execute()

        meta, co, dl, own, rd, dly, dead, sched, loglen = self.d.run(read())
        # one lease per checkout, as the model keeps them: a lease batch's deadline is each of its checkouts'
        co, dl_by_tag, own = per_tag_view(co, {_s(t): int(score) for t, score in dl}, own)
        dl = list(dl_by_tag.items())
        tag = self.model_tag
        meta = {_s(f): _s(v) for f, v in meta.items()}
        if "tag" in meta:
            meta["tag"] = str(tag(meta["tag"]))
        return {
            "meta": meta,
            "co": {str(tag(_s(t))): _s(r) for t, r in co.items()},
            "dl": {str(tag(_s(t))): int(s) for t, s in dl},
            "own": {SEP.join((*_s(x).split(SEP)[:2], str(tag(_s(x).split(SEP)[2])))) for x in own},
            "rd": {_s(x) for x in rd},
            "dly": {_s(x): int(s) for x, s in dly},
            "dead": dead,
            "schedule": None if sched is None else int(sched),
            "loglen": loglen,
        }

    def check(self) -> None:
        m = self.model
        m.check()
        s = self.snapshot()

        # Invariants read from Redis alone, whatever the model says.
        cursors = {g: int(s["meta"].get(f"g|{g}|cur", "1")) for g in m.groups}
        held: dict[str, list[int]] = defaultdict(list)
        for rec in s["co"].values():
            g, _member, i, *_ = rec.split(SEP)
            held[g].append(int(i))
        for g, ids in held.items():
            assert len(ids) == len(set(ids)), f"group {g}: an id is checked out twice at once: {sorted(ids)}"
        for g in m.groups:
            ready = [int(x.split(SEP)[1]) for x in s["rd"] if x.split(SEP)[0] == g]
            later = [int(x.split(SEP)[1]) for x in s["dly"] if x.split(SEP)[0] == g]
            every = held[g] + ready + later
            assert len(every) == len(set(every)), f"group {g}: an id is in two of checked out/ready/delayed"
            assert all(i < cursors[g] for i in every), f"group {g}: a returned or held id is not behind the cursor"

        # Everything against the model.
        meta = {f: ("*" if f.endswith("|sus") else v) for f, v in s["meta"].items() if QueueModel.owns_field(f)}
        assert meta == m.expected_meta()
        assert s["co"] == {str(t): c.record() for t, c in m.checkouts.items()}
        assert set(s["dl"]) == {str(t) for t in m.checkouts}, "deadlines must hold exactly the checked-out tags"
        for t, c in m.checkouts.items():
            score = s["dl"][str(t)]
            if c.expired:
                assert score == 0
            elif c.window:
                assert c.window[0] <= score <= c.window[1], f"tag {t}: deadline {score} outside {c.window}"
        assert s["own"] == m.expected_owned()
        assert s["rd"] == m.expected_ready()
        delayed = m.expected_delayed()
        assert set(s["dly"]) == set(delayed)
        for member, r in delayed.items():
            score = s["dly"][member]
            if r.due:
                assert score == 0
            elif r.window:
                assert r.window[0] <= score <= r.window[1]
        dead = []
        for entry in s["dead"]:
            i, g, mem, acq, fail, _ms, body = msgpack.unpackb(entry, raw=True)
            payload = unpack_delivery(TOPIC, None, 0, b"0", i, acq, body).payload
            dead.append((i, g.decode(), mem.decode(), acq, fail, payload))
        assert dead == m.dead
        assert s["loglen"] == len(m.payloads)  # what some group may still be given (ids first … seq)

        # The sweep schedule is never later than a live deadline or due time (late = a lease
        # comes back late); an early entry only costs an empty sweep. Deadlines the test moved
        # into the past are "time passing", not schedule entries the broker was told about.
        dues = [v for t, v in s["dl"].items() if not m.checkouts[int(t)].expired]
        dues += [v for x, v in s["dly"].items() if not delayed[x].due]
        if dues:
            assert s["schedule"] is not None and s["schedule"] <= min(dues), "the queue's sweep is scheduled too late"

        self.check_totals()

    def check_totals(self) -> None:
        # The broker's totals the fences keep (lua/lib/totals.lua) equal a full count of the queue (on a
        # Cluster too: a total reads only the slots in use, here the queue's).
        counted = self.d.run(totals.full_count(self.d.redis, self.q.keys))
        kept = self.d.run(totals.read_totals(self.d.redis, self.q.keys))
        assert {k: kept[k] for k in counted["totals"]} == counted["totals"], "the totals drifted from a full count"
        assert self.d.run(totals.counted_entries(self.d.redis, self.q.keys, [QREF.qid])) == counted["entries"]


# -- the state machine -----------------------------------------------------------------------

GROUP = st.sampled_from(GROUPS)


class FenceMachine(RuleBasedStateMachine):
    """Random sequences of operations by 3 members in 2 groups of one queue.

    Group g1 has the machine's ``primary`` mode; g2's mode is drawn at the
    start. ``start`` publishes a few messages and creates both groups with
    1-3 members each; a group's first SUB draws FROM (and, for exclusive
    groups, POLICY and ON-PREEMPT). Members and tags are drawn mostly from
    those that exist (current members, live tags) and sometimes from all
    (non-members, stale tags, tags of other members or groups, never-issued
    tags), so both the happy paths and the fences get exercised.
    """

    driver: Driver
    primary: str

    def __init__(self) -> None:
        super().__init__()
        self.h = Harness(self.driver)
        self.m = self.h.model
        self.modes = {"g1": self.primary, "g2": "shared"}

    # -- drawing helpers --------------------------------------------------------------

    def _member(self, data: st.DataObject, group: str) -> str:
        g = self.m.groups.get(group)
        current = list(g.members) if g else []
        if current and data.draw(st.integers(0, 5), label="any member?") > 0:
            return data.draw(st.sampled_from(current), label="member")
        return data.draw(st.sampled_from(MEMBERS), label="member")

    def _tags(self, data: st.DataObject, group: str, member: str) -> list[str]:
        live = [str(t) for t in self.m.member_tags(group, member)]
        ever = sorted(set(self.h.received[(group, member)]), key=int)
        anyone = [str(t) for t in range(self.m.tag + 2)]  # others', stale and never-issued tags
        pools = [st.sampled_from(p) for p in (live, live, ever, anyone) if p]
        return data.draw(st.lists(st.one_of(pools), min_size=1, max_size=4), label="tags")

    def _time_arg(self, data: st.DataObject) -> int:
        """0, far future, or a message's publish stamp -1/0/+1 (draws never depend on the clock)."""
        if self.m.seq == 0 or data.draw(st.integers(0, 4), label="special ms") == 0:
            return data.draw(st.sampled_from([0, 2**50]), label="ms")
        i = data.draw(st.integers(1, self.m.seq), label="stamp of id")
        return self.m.stamps[i] + data.draw(st.sampled_from([-1, 0, 1]), label="offset")

    def _subscribe(self, data: st.DataObject, group: str, member: str) -> None:
        g = self.m.groups.get(group)
        kw: dict[str, Any] = {}
        if g is None:
            kw["mode"] = self.modes[group]
            kind = data.draw(st.sampled_from(["earliest", "earliest", "earliest", "latest", "id", "time"]), label="from")
            if kind == "id":
                kw["start"] = ("id", data.draw(st.integers(0, self.m.seq + 3), label="from id"))
            elif kind == "time":
                kw["start"] = ("time", self._time_arg(data))
            else:
                kw["start"] = (kind, None)
            if kw["mode"] == "exclusive":
                kw["policy"] = data.draw(st.sampled_from([None, None, "preempt", "reject"]), label="policy")
                kw["onpre"] = data.draw(st.sampled_from([None, "keep", "earliest", "latest"]), label="onpre")
        elif data.draw(st.integers(0, 7), label="conflict?") == 0:
            # a conflicting MODE or POLICY is BADARG and changes nothing
            if data.draw(st.booleans(), label="mode conflict"):
                kw["mode"] = data.draw(st.sampled_from([x for x in ("shared", "single-active", "exclusive")
                                                        if x != g.mode]), label="mode")
            else:
                kw["policy"] = "reject" if g.policy == "preempt" else "preempt"
            assert self.h.subscribe(group, member, **kw) == Err("BADARG")
            event("subscribe: conflicting mode or policy")
            return
        else:
            kw["mode"] = data.draw(st.sampled_from([None, g.mode]), label="mode")
        current = g.epoch if g else 0
        epoch = data.draw(st.sampled_from([None, None, None, max(current - 1, 0), current, current + 1]),
                          label="epoch")
        kw["epoch"] = epoch
        kw["lock_ms"] = data.draw(st.sampled_from([None, None, 90_000, 120_000]), label="lock")
        kw["max_messages"] = data.draw(st.sampled_from([None] * 12 + [0, 4]), label="max")
        res = self.h.subscribe(group, member, **kw)
        if isinstance(res, Err):
            event(f"subscribe: {res.code}")
        elif res.evicted:
            event("subscribe: preempted the owner" + (" (returned checkouts)" if res.returned else ""))

    def _settle(self, data: st.DataObject, group: str, member: str, tags: list[str]) -> None:
        how = data.draw(st.sampled_from(["ack", "ack", "nack", "nack", "nack", "renew"]), label="settle")
        if how == "ack":
            event(f"ack: settled {min(self.h.ack(group, member, tags), 2)}")
            return
        if how == "renew":
            lock = data.draw(st.sampled_from([None, LONG_LOCK]), label="lock")
            if self.h.renew(group, member, tags, lock_ms=lock):
                event("renew: renewed something")
            return
        discard = data.draw(st.sampled_from([False, False, False, True]), label="discard")
        delay = data.draw(st.sampled_from([0, 0, 0, 100_000]), label="delay")
        dead = len(self.m.dead)
        if self.h.nack(group, member, tags, delay_ms=delay, discard=discard):
            event("nack: " + ("discard" if discard else "delayed" if delay else "requeue"))
        if len(self.m.dead) > dead:
            event("nack: dead-lettered")

    def _pull(self, group: str, member: str, count: int) -> PullReply | Err:
        res = self.h.pull(group, member, count)
        if isinstance(res, Err):
            event(f"pull: {res.code}")
        else:
            event(f"pull: {res.status}" + (" with deliveries" if res.deliveries else ""))
            if any(acq > 1 for _, _, acq in res.deliveries):
                event("pull: a redelivery")
        return res

    def _sweep(self) -> None:
        res = self.h.sweep()
        for _g, _m, _tags, successor in res.notices:
            event("sweep: timeout" + (", active member replaced" if successor else ""))

    # -- rules ------------------------------------------------------------------------------

    @initialize(second=st.sampled_from(("shared", "single-active", "exclusive")), published=st.integers(0, 4),
                data=st.data())
    def start(self, second: str, published: int, data: st.DataObject) -> None:
        self.modes["g2"] = second
        if published:
            self.h.publish([""] * published)
        for group in GROUPS:
            n = data.draw(st.integers(2, 3), label="members")
            for member in MEMBERS[:n]:
                self._subscribe(data, group, member)

    # None: covered by the dedup id before it, as the messages of an MPUB … ID are
    @rule(dedups=st.lists(st.sampled_from(["", "", "", "d1", "d2", None]), min_size=1, max_size=4))
    def publish(self, dedups: list[str | None]) -> None:
        self.h.publish(dedups)

    @rule(group=GROUP, data=st.data())
    def subscribe(self, group: str, data: st.DataObject) -> None:
        self._subscribe(data, group, data.draw(st.sampled_from(MEMBERS), label="member"))

    @rule(group=GROUP, count=st.integers(1, 4), data=st.data())
    def pull(self, group: str, count: int, data: st.DataObject) -> None:
        self._pull(group, self._member(data, group), count)

    @rule(group=GROUP, count=st.integers(1, 4), data=st.data())
    def pull_then_settle_some(self, group: str, count: int, data: st.DataObject) -> None:
        member = self._member(data, group)
        res = self._pull(group, member, count)
        if not isinstance(res, Err) and res.deliveries:
            tags = [str(t) for t, _, _ in res.deliveries]
            some = data.draw(st.lists(st.sampled_from(tags), min_size=1, max_size=len(tags), unique=True),
                             label="settle")
            self._settle(data, group, member, some)

    # the client's usual loop, drawn twice as often as the other rules
    pull_then_settle_again = pull_then_settle_some

    @rule(group=GROUP, data=st.data())
    def settle(self, group: str, data: st.DataObject) -> None:
        member = self._member(data, group)
        self._settle(data, group, member, self._tags(data, group, member))

    @rule(group=GROUP, times=st.integers(1, 3), data=st.data())
    def a_poison_message_keeps_failing(self, group: str, times: int, data: st.DataObject) -> None:
        """PULL one, NACK it, again: the returned message comes back first, until it is dead-lettered."""
        member = self._member(data, group)
        for _ in range(times):
            res = self._pull(group, member, 1)
            if isinstance(res, Err) or not res.deliveries:
                return
            dead = len(self.m.dead)
            self.h.nack(group, member, [str(res.deliveries[0][0])])
            if len(self.m.dead) > dead:
                event("nack: dead-lettered")

    @rule(group=GROUP, count=st.integers(1, 4), data=st.data())
    def a_lease_times_out_then_the_member_recovers(self, group: str, count: int, data: st.DataObject) -> None:
        """One lease of a member expires and is swept (suspected; single-active: replaced), then the
        member settles or renews one of its remaining tags, or subscribes again, and pulls."""
        member = self._member(data, group)
        live = self.m.member_tags(group, member)
        if not live:
            self._pull(group, member, count)
            live = self.m.member_tags(group, member)
            if not live:
                return
        self.h.expire([data.draw(st.sampled_from(live), label="expiring tag")])
        self._sweep()
        rest = [str(t) for t in self.m.member_tags(group, member)]
        if rest and data.draw(st.integers(0, 3), label="resubscribe?") > 0:
            self._settle(data, group, member, data.draw(st.lists(st.sampled_from(rest), min_size=1, max_size=2)))
        elif data.draw(st.booleans(), label="resubscribe"):
            self._subscribe(data, group, member)
        self._pull(group, member, count)

    @rule(which=st.sampled_from(["all", "member", "one", "delayed"]), group=GROUP, then_sweep=st.booleans(),
          data=st.data())
    def time_passes(self, which: str, group: str, then_sweep: bool, data: st.DataObject) -> None:
        """Leases expire (all, one member's, or one) or the group's delayed redeliveries fall due."""
        if which == "delayed":
            self.h.make_due(group)
        else:
            live = sorted(t for t, c in self.m.checkouts.items() if not c.expired)
            if which == "member":
                member = self._member(data, group)
                live = [t for t in live if (self.m.checkouts[t].group, self.m.checkouts[t].member) == (group, member)]
            elif which == "one" and live:
                live = [data.draw(st.sampled_from(live), label="tag")]
            self.h.expire(live)
        if then_sweep:
            self._sweep()

    @rule()
    def sweep(self) -> None:
        self._sweep()

    @rule(group=GROUP, kind=st.sampled_from(["earliest", "latest", "id", "time"]), data=st.data())
    def seek(self, group: str, kind: str, data: st.DataObject) -> None:
        arg = None
        if kind == "id":
            arg = data.draw(st.integers(-1, self.m.seq + 3), label="id")
        elif kind == "time":
            arg = self._time_arg(data)
        res = self.h.seek(group, self._member(data, group), kind, arg)
        event(f"seek: {res.code if isinstance(res, Err) else kind}")

    @rule(group=GROUP, data=st.data())
    def unsubscribe(self, group: str, data: st.DataObject) -> None:
        if self.h.unsubscribe(group, self._member(data, group)):
            event("unsubscribe: returned checkouts")

    @invariant()
    def redis_state_matches_the_model(self) -> None:
        self.h.check()


# `make test` runs FENCEMQ_MODEL_EXAMPLES sequences per primary (30), `make test-cluster` 10 on a Cluster;
# `make test-stateful` (after them in .ci/run) runs the full 300.
EXAMPLES = int(os.environ.get("FENCEMQ_MODEL_EXAMPLES", "300"))
MACHINE_SETTINGS = settings(
    max_examples=EXAMPLES,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@pytest.fixture(scope="module")
def driver(redis_server) -> Any:
    d = Driver(redis_server.url)
    yield d
    d.close()


@pytest.fixture
def h(driver: Driver) -> Harness:
    harness = Harness(driver)
    harness.auto_check = True
    return harness


@pytest.mark.timeout(900)  # hundreds of generated sequences; slower on a loaded machine
@pytest.mark.parametrize("primary", ["shared", "single-active"])
def test_the_fences_behave_like_the_reference_model(driver: Driver, primary: str) -> None:
    machine = type(f"FenceMachine_{primary.replace('-', '_')}", (FenceMachine,), {"driver": driver, "primary": primary})
    run_state_machine_as_test(machine, settings=MACHINE_SETTINGS)


# -- the trickiest paths, as examples (every step is also compared with the model) -------------


def _tags_of(res: PullReply) -> list[str]:
    return [str(t) for t, _, _ in res.deliveries]


def _ids_of(res: PullReply) -> list[int]:
    return [i for _, i, _ in res.deliveries]


def test_a_late_ack_of_an_expired_checkout_settles_nothing_and_leaves_the_redelivered_copy_alone(h: Harness) -> None:
    h.publish([""])
    h.subscribe("g", "a", mode="shared")
    h.subscribe("g", "b", mode="shared")
    first = h.pull("g", "a", 1)
    h.expire([first.deliveries[0][0]])
    assert h.sweep().notices == [("g", "a", _tags_of(first), "")]
    again = h.pull("g", "b", 1)
    assert again.deliveries[0][1:] == (1, 2)  # same id, second delivery, new tag
    assert h.ack("g", "a", _tags_of(first)) == 0
    assert h.ack("g", "b", _tags_of(first)) == 0  # b cannot settle a's old tag either
    assert h.ack("g", "b", _tags_of(again)) == 1


def test_a_suspected_member_gets_nothing_until_it_acks_nacks_or_renews_even_an_expired_tag(h: Harness) -> None:
    h.publish(["", "", ""])
    h.subscribe("g", "a", mode="shared")
    # two PULLs, two leases (one PULL's checkouts share one lease, which expires whole)
    (expired,), (kept,) = _tags_of(h.pull("g", "a", 1)), _tags_of(h.pull("g", "a", 1))
    h.expire([int(expired)])
    h.sweep()
    assert h.pull("g", "a", 1).status == "suspected"
    assert h.ack("g", "a", [expired]) == 0  # settles nothing, but proves the member alive
    res = h.pull("g", "a", 2)
    assert res.status == "ok" and _ids_of(res) == [1, 3]  # the returned id first, then the cursor
    h.expire([res.deliveries[0][0], res.deliveries[1][0], int(kept)])
    h.sweep()
    assert h.pull("g", "a", 1).status == "suspected"
    assert h.renew("g", "a", [kept]) == 0
    assert h.pull("g", "a", 1).status == "ok"


def test_a_timeout_returns_the_message_in_id_order_and_counts_a_delivery_but_no_failure(h: Harness) -> None:
    h.publish(["", "", ""])
    h.subscribe("g", "a", mode="shared")
    h.subscribe("g", "b", mode="shared")
    one = h.pull("g", "a", 1)
    h.nack("g", "a", _tags_of(one))  # one failure
    one = h.pull("g", "a", 1)
    assert one.deliveries[0][1:] == (1, 2)
    h.expire([one.deliveries[0][0]])
    h.sweep()
    res = h.pull("g", "b", 2)
    assert [(i, acq) for _, i, acq in res.deliveries] == [(1, 3), (2, 1)]
    assert h.model.checkouts[res.deliveries[0][0]].fail == 1  # the timeout added no failure


def test_the_third_nack_dead_letters_a_message_and_discard_drops_one_without_a_dead_letter(h: Harness) -> None:
    h.publish(["", ""])
    h.subscribe("g", "a", mode="shared")
    for attempt in (1, 2, 3):
        res = h.pull("g", "a", 1)
        assert res.deliveries[0][1:] == (1, attempt)
        h.nack("g", "a", _tags_of(res))
    assert [(i, acq, fail) for i, _g, _m, acq, fail, _p in h.model.dead] == [(1, 3, 3)]
    res = h.pull("g", "a", 1)
    assert _ids_of(res) == [2]
    assert h.nack("g", "a", _tags_of(res), discard=True) == 1
    assert h.pull("g", "a", 4).deliveries == [] and len(h.model.dead) == 1


def test_a_delayed_nack_comes_back_only_when_due_and_before_newer_messages(h: Harness) -> None:
    h.publish(["", ""])
    h.subscribe("g", "a", mode="shared")
    res = h.pull("g", "a", 1)
    h.nack("g", "a", _tags_of(res), delay_ms=100_000)
    assert _ids_of(h.pull("g", "a", 1)) == [2]
    assert h.pull("g", "a", 1).deliveries == []
    h.make_due("g")
    assert [(i, acq) for _, i, acq in h.pull("g", "a", 2).deliveries] == [(1, 2)]


def test_standby_members_of_a_single_active_group_get_nothing(h: Harness) -> None:
    h.publish(["", ""])
    assert h.subscribe("g", "a", mode="single-active").owner == "a"
    assert h.subscribe("g", "b", mode="single-active").owner == "a"
    assert h.pull("g", "b", 2).status == "standby"
    assert _ids_of(h.pull("g", "a", 2)) == [1, 2]


def test_a_single_active_member_that_times_out_hands_over_to_the_next_member_not_suspected(h: Harness) -> None:
    h.publish(["", "", ""])
    for m in ("a", "b", "c"):
        h.subscribe("g", m, mode="single-active")
    got = h.pull("g", "a", 1)
    h.pull("g", "a", 1)  # a second PULL: a second lease
    h.expire([got.deliveries[0][0]])  # one lease expires: all of a's pending come back
    assert h.sweep().notices == [("g", "a", _tags_of(got), "b")]
    assert not h.model.checkouts
    res = h.pull("g", "b", 3)
    assert [(i, acq) for _, i, acq in res.deliveries] == [(1, 2), (2, 2), (3, 1)]
    h.expire([res.deliveries[0][0]])
    assert h.sweep().notices[0][3] == "c"  # a is suspected: skipped
    assert h.pull("g", "a", 1).status == "suspected"
    assert h.pull("g", "b", 1).status == "suspected"
    assert _ids_of(h.pull("g", "c", 3)) == [1, 2, 3]


def test_a_single_active_group_whose_members_all_timed_out_resumes_when_one_subscribes_again(h: Harness) -> None:
    h.publish([""])
    h.subscribe("g", "a", mode="single-active")
    h.subscribe("g", "b", mode="single-active")
    h.expire([h.pull("g", "a", 1).deliveries[0][0]])
    h.sweep()
    h.expire([h.pull("g", "b", 1).deliveries[0][0]])
    assert h.sweep().notices[0][3] == ""  # nobody left to take over
    assert h.model.groups["g"].owner is None
    assert h.pull("g", "a", 1).status == "suspected"
    assert h.subscribe("g", "a").owner == "a"  # subscribing again clears suspicion and takes over
    assert [(i, acq) for _, i, acq in h.pull("g", "a", 1).deliveries] == [(1, 3)]


def test_seek_raises_the_epoch_and_releases_the_groups_checkouts_so_their_tags_go_stale(h: Harness) -> None:
    h.publish(["", "", ""])
    h.subscribe("g", "a", mode="shared")
    h.subscribe("other", "a", mode="shared")
    old = h.pull("g", "a", 2)
    kept = h.pull("other", "a", 1)
    h.nack("g", "a", _tags_of(old)[:1], delay_ms=100_000)
    assert h.seek("g", "a", "id", 2) == SeekReply(1, 2, False)
    assert h.ack("g", "a", _tags_of(old)) == 0
    assert h.renew("g", "a", _tags_of(old)) == 0
    h.make_due("g")  # the delayed redelivery was dropped by the seek
    res = h.pull("g", "a", 4)
    assert res.epoch == 1 and [(i, acq) for _, i, acq in res.deliveries] == [(2, 1), (3, 1)]
    assert h.ack("other", "a", _tags_of(kept)) == 1  # another group's checkouts are untouched
    assert h.seek("g", "a", "id", 99).cursor == 4  # clamped to the end
    assert h.seek("g", "a", "id", 0) == Err("BADARG")


def test_unsubscribe_returns_every_checkout_at_once_and_the_next_member_becomes_active(h: Harness) -> None:
    h.publish(["", ""])
    h.subscribe("g", "a", mode="single-active")
    h.subscribe("g", "b", mode="single-active")
    h.pull("g", "a", 2)
    assert h.unsubscribe("g", "a") == 2
    assert h.unsubscribe("g", "a") == 0  # idempotent
    assert h.model.groups["g"].owner == "b"
    assert [(i, acq) for _, i, acq in h.pull("g", "b", 2).deliveries] == [(1, 2), (2, 2)]
    assert h.pull("g", "a", 1) == Err("NOTFOUND")


def test_an_exclusive_subscriber_preempts_the_owner_whose_pulls_then_say_evicted(h: Harness) -> None:
    h.publish(["", ""])
    h.subscribe("g", "a", mode="exclusive", onpre="earliest")
    first = h.pull("g", "a", 1)
    h.ack("g", "a", _tags_of(first))
    h.pull("g", "a", 1)
    sub = h.subscribe("g", "b", mode="exclusive")
    assert (sub.evicted, sub.returned, sub.cursor) == ("a", 1, 1)  # ON-PREEMPT earliest rewinds
    assert h.pull("g", "a", 1).status == "evicted"
    assert _ids_of(h.pull("g", "b", 2)) == [1, 2]
    assert h.subscribe("g", "c", mode="exclusive", policy="reject") == Err("BADARG")


# -- bugs found by the model, fixed; kept as regression tests ---------------------------------


def test_a_delayed_redelivery_is_not_delivered_twice_after_a_preemption_moves_the_cursor(driver: Driver) -> None:
    driver.reset()
    q, keys = driver.queues, driver.queues.keys.queue(QREF)
    driver.run(q.publishing.publish(TOPIC, [b"a", b"b"]))
    a = Handle.decode(driver.run(q.subscriptions.subscribe("a", TOPIC, group="g", mode="exclusive", on_preempt="earliest")).handle)
    tag = driver.run(q.leases.pull(a, 1)).deliveries[0].tag
    driver.run(q.leases.nack(a, [tag], delay_ms=100_000))
    b = Handle.decode(driver.run(q.subscriptions.subscribe("b", TOPIC, group="g", mode="exclusive")).handle)
    for member in driver.run(driver.redis.zrange(keys.delayed, 0, -1)):
        driver.run(driver.redis.zadd(keys.delayed, {member: 0}))  # the delay runs out
    ids = [d.id for d in driver.run(q.leases.pull(b, 3)).deliveries]
    assert len(ids) == len(set(ids)), f"id checked out twice at once: {ids}"


def test_ack_and_renew_of_a_checkout_taken_before_sub_epoch_raised_the_epoch_settle_nothing(driver: Driver) -> None:
    driver.reset()
    q = driver.queues
    driver.run(q.publishing.publish(TOPIC, [b"a"]))
    h = Handle.decode(driver.run(q.subscriptions.subscribe("a", TOPIC, group="g", mode="shared")).handle)
    d = driver.run(q.leases.pull(h, 1)).deliveries[0]
    assert d.epoch == 0
    assert driver.run(q.subscriptions.subscribe("a", TOPIC, group="g", mode="shared", epoch=5)).epoch == 5
    assert driver.run(q.leases.renew(h, [d.tag])) == 0
    assert driver.run(q.leases.ack(h, [d.tag])) == 0


def test_renew_with_a_shorter_lock_moves_the_queues_sweep_schedule_earlier(driver: Driver) -> None:
    driver.reset()
    q, keys = driver.queues, driver.queues.keys.queue(QREF)
    driver.run(q.publishing.publish(TOPIC, [b"a"]))
    h = Handle.decode(driver.run(q.subscriptions.subscribe("a", TOPIC, group="g", mode="shared")).handle)
    d = driver.run(q.leases.pull(h, 1)).deliveries[0]  # 60 s lease
    assert driver.run(q.leases.renew(h, [d.tag], lock_ms=1_000)) == 1  # now 1 s
    deadline = driver.run(driver.redis.zscore(keys.deadlines, d.tag))
    scheduled = driver.run(driver.redis.zscore(q.ctx.schedule_keys(QREF.qid)[0], QREF.qid))
    assert scheduled <= deadline, f"sweep scheduled at {scheduled:.0f}, lease ends at {deadline:.0f}"
