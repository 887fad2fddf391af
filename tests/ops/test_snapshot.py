"""Snapshots (lua/snapshot.lua + broker/snapshot.py): a scripted workload against a real
server, then a snapshot, then every Parquet table checked against Redis read directly.

``run_workload`` is shared with tests/test_analytics.py (the Spark job runs on
the snapshot of this same workload).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import redis
from redis.asyncio import Redis

from fencemq.model import meta as compact_meta
from fencemq.model.records import Checkout, ReadyEntry, decode_names, journal_events, per_tag_view
from fencemq.config import Config
from fencemq.server.embedded import EmbeddedRedis
from fencemq.model.keys import Keyspace
from fencemq.model.handles import Handle
from fencemq.fences.core import Core
from fencemq.ops.snapshot import SCHEMAS, Manifest, take_snapshot
from fencemq.ops.journal_buckets import DEFAULT_BUCKETS, bucket_file, bucket_of
from fencemq.model.keys import queue_ref
from tests.helpers import publish_then_settle_one

GROUP_FIELDS = (compact_meta.CURSOR, compact_meta.MEMBERS, compact_meta.MODE, compact_meta.POLICY,
                compact_meta.ON_PREEMPT, compact_meta.EPOCH, compact_meta.OWNER)
MEMBER_FIELDS = (compact_meta.DELIVERED, compact_meta.MAX, compact_meta.LOCK, compact_meta.SUSPECTED_SINCE,
                 compact_meta.MARKER, compact_meta.CAPACITY, compact_meta.QOS, compact_meta.ENDED)


def run(coro: Any, timeout: float = 60) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


@dataclass
class Facts:
    """What the workload did, to check the snapshot and the analytics against."""

    timed_out: dict[str, int] = field(default_factory=dict)  # member -> leases expired
    preempted: list[tuple[str, str, str]] = field(default_factory=list)  # (queue, evicted, by)
    evicted: list[tuple[str, str, str]] = field(default_factory=list)  # (queue, member, by)
    seeks: list[tuple[str, str, int]] = field(default_factory=list)  # (queue, group, new epoch)


def _h(sub) -> Handle:
    return Handle.decode(sub.handle)


async def run_workload(url: str) -> Facts:
    """Publish, 2 groups pulling/acking/nacking, a lease expiry + sweep, dead letter, delayed
    redelivery, a lite-topic preemption and an operator eviction, a seek, a push mailbox, QoS 0."""
    facts = Facts()
    r = Redis.from_url(url)
    q = Core(r, Config(redis_url=url, max_failures=2, lite_journal_cap=10_000))
    try:
        await q.publishing.publish("orders", [f"order-{i}".encode() for i in range(12)])
        c1 = _h(await q.subscriptions.subscribe("c1", "orders", group="billing"))
        c2 = _h(await q.subscriptions.subscribe("c2", "orders", group="billing"))
        c3 = _h(await q.subscriptions.subscribe("c3", "orders", group="audit", lock_ms=50))

        got = (await q.leases.pull(c1, 4)).deliveries  # ids 1..4
        tags = {int(d.id): d.tag for d in got}
        assert await q.leases.ack(c1, [tags[1], tags[2]]) == 2
        assert await q.leases.nack(c1, [tags[3]]) == 1  # back to ready, 1 failure
        got = (await q.leases.pull(c2, 2)).deliveries  # id 3 again (2nd delivery), then 5
        assert [(int(d.id), d.deliveries) for d in got] == [(3, 2), (5, 1)]
        assert await q.leases.nack(c2, [got[0].tag]) == 1  # 2nd failure: dead-lettered
        assert await q.leases.ack(c2, [got[1].tag]) == 1
        got = (await q.leases.pull(c2, 1)).deliveries  # id 6
        assert await q.leases.nack(c2, [got[0].tag], delay_ms=300_000) == 1  # delayed redelivery
        # c1 keeps id 4 checked out

        got = (await q.leases.pull(c3, 3)).deliveries  # audit group: ids 1..3, 50 ms leases
        assert len(got) == 3
        await asyncio.sleep(0.15)
        swept = await q.leases.sweep("t:orders")
        assert swept.returned == 3
        facts.timed_out["c3"] = 3
        assert (await q.leases.pull(c3, 1)).status == "suspected"
        got = (await q.leases.pull(c1, 2)).deliveries  # ids 7, 8 for billing
        assert await q.leases.renew(c1, [got[0].tag]) == 1

        # A group that seeks back: acks again after the seek are legitimate
        c4 = _h(await q.subscriptions.subscribe("c4", "orders", group="replay"))
        got = (await q.leases.pull(c4, 3)).deliveries
        assert await q.leases.ack(c4, [d.tag for d in got]) == 3
        epoch, cursor, _ = await q.seek.move(c4, "earliest")
        assert (epoch, cursor) == (1, 1)
        facts.seeks.append(("t:orders", "replay", 1))
        got = (await q.leases.pull(c4, 2)).deliveries
        assert [(int(d.id), d.epoch) for d in got] == [(1, 1), (2, 1)]
        assert await q.leases.ack(c4, [got[0].tag]) == 1

        # Push: a mailbox filled by dispatch; one TAKEn
        p1 = _h(await q.subscriptions.subscribe("p1", "orders", group="pushers", capacity=3))
        taken = await q.mailboxes.take(p1)
        assert taken is not None and taken != "EOS"

        # QoS 0: deliveries without a checkout record (tags 'q…')
        c5 = _h(await q.subscriptions.subscribe("c5", "orders", group="fast", qos=0))
        got = (await q.leases.pull(c5, 2)).deliveries
        assert all(d.tag.startswith("q") for d in got)

        # Lite topic: preemption (exclusive, last subscriber wins) and an operator eviction
        room1 = []  # an lmq's ids start at the clock (lib/meta.lua, start_ids)
        for room in ("room1", "room2", "room3"):
            ids = await q.publishing.publish("chat", [f"{room}-{i}".encode() for i in range(3)], lmq=room)
            room1 = room1 or [int(i) for i in ids]
        a1 = _h(await q.subscriptions.subscribe("alice", "chat", lmq="room1"))
        assert len((await q.leases.pull(a1, 2)).deliveries) == 2
        sub_b = await q.subscriptions.subscribe("bob", "chat", lmq="room1")
        assert sub_b.evicted == "alice"
        facts.preempted.append(("l:chat:room1", "alice", "bob"))
        assert (await q.leases.pull(a1, 1)).status == "evicted"  # fenced pull, journaled
        got = (await q.leases.pull(_h(sub_b), 3)).deliveries
        assert [(int(d.id), d.deliveries) for d in got] == list(zip(room1, (2, 2, 1), strict=True))
        assert await q.leases.ack(_h(sub_b), [got[0].tag]) == 1

        a2 = _h(await q.subscriptions.subscribe("alice", "chat", lmq="room2"))
        got = (await q.leases.pull(a2, 1)).deliveries
        assert await q.leases.ack(a2, [got[0].tag]) == 1
        assert len((await q.leases.pull(a2, 1)).deliveries) == 1
        assert await q.lite.evict(a2, by="ops") == 1
        facts.evicted.append(("l:chat:room2", "alice", "ops"))
        assert (await q.leases.pull(a2, 1)).status == "evicted"
        # room3: published, nobody subscribed

        # room4: ON-PREEMPT earliest: the new owner reads from the start again, under a new epoch,
        # so acking an id alice acked before is legitimate (a rewind), not a double ack
        room4 = int((await q.publishing.publish("chat", [b"r4-1", b"r4-2"], lmq="room4"))[0])
        a4 = _h(await q.subscriptions.subscribe("alice", "chat", lmq="room4", on_preempt="earliest"))
        got = (await q.leases.pull(a4, 2)).deliveries
        assert await q.leases.ack(a4, [d.tag for d in got]) == 2
        sub_b4 = await q.subscriptions.subscribe("bob", "chat", lmq="room4")
        assert sub_b4.evicted == "alice" and sub_b4.epoch == 1
        facts.preempted.append(("l:chat:room4", "alice", "bob"))
        got = (await q.leases.pull(_h(sub_b4), 1)).deliveries
        assert [(int(d.id), d.epoch) for d in got] == [(room4, 1)]
        assert await q.leases.ack(_h(sub_b4), [got[0].tag]) == 1
    finally:
        await r.aclose()
    return facts


async def snapshot_to(url: str, out: Path, **kwargs: Any) -> Manifest:
    r = Redis.from_url(url)
    try:
        return await take_snapshot(r, Keyspace(), out, **kwargs)
    finally:
        await r.aclose()


def read(out: Path, table: str) -> list[dict[str, Any]]:
    return pq.read_table(out / f"{table}.parquet").to_pylist()


def s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _int(v: Any) -> int | None:
    return None if v is None else int(v)


# =====================================================================================


def test_snapshot_matches_redis(redis_url: str, tmp_path: Path) -> None:
    facts = run(run_workload(redis_url))
    out = tmp_path / "snap"
    progress: list[int] = []
    manifest = run(snapshot_to(redis_url, out, progress=lambda done, total: progress.append(done),
                               log_entries=5, batch=2))
    assert progress and progress[-1] == manifest.queues

    r = redis.Redis.from_url(redis_url)
    ks = Keyspace()
    qids = sorted({Keyspace.qid_from_meta_key(s(k)) for k in r.scan_iter(match=ks.queue_pattern(), _type="hash")})
    assert qids == ["l:chat:room1", "l:chat:room2", "l:chat:room3", "l:chat:room4", "t:orders"]

    # manifest
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk["schema_version"] == 3 and on_disk["queues"] == 5 and on_disk["nodes"] == 1
    assert on_disk["source"] == redis_url and on_disk["error_count"] == 0
    for table, schema in SCHEMAS.items():
        t = pq.read_table(out / f"{table}.parquet")
        assert t.schema.equals(schema), table
        assert on_disk["counts"][table] == t.num_rows, table
    assert Manifest.load(out) == manifest
    # the journal in buckets: each queue's events all in the file of the bucket Spark hashes it to
    assert on_disk["journal_buckets"] == DEFAULT_BUCKETS
    in_bucket = {b: {row["queue"] for row in pq.read_table(out / "journal.parquet" / bucket_file(b)).to_pylist()}
                 for b in range(DEFAULT_BUCKETS)}
    assert sum(map(len, in_bucket.values())) == len(set().union(*in_bucket.values())) > 1
    assert all(bucket_of(queue, DEFAULT_BUCKETS) == b for b, queues in in_bucket.items() for queue in queues)

    queues = {row["queue"]: row for row in read(out, "queues")}
    groups = {(row["queue"], row["group"]): row for row in read(out, "groups")}
    members = {(row["queue"], row["group"], row["member"]): row for row in read(out, "members")}
    checkouts = {(row["queue"], row["tag"]): row for row in read(out, "checkouts")}
    ready = sorted((row["queue"], row["group"], row["id"], row["acquisitions"], row["failures"], row["due_ms"])
                   for row in read(out, "ready"))
    journal = defaultdict(list)
    for row in read(out, "journal"):
        journal[row["queue"]].append(row)
    messages = sorted((row["queue"], row["id"], row["publish_ms"], row["size"]) for row in read(out, "messages"))
    assert sorted(queues) == qids

    exp_groups, exp_members, exp_checkouts, exp_ready, exp_messages = {}, {}, {}, [], []
    for qid in qids:
        k = ks.queue_by_id(qid)
        meta = compact_meta.expand(r.hgetall(k.meta))
        # one row per checkout, with its lease's deadline (a lease batch's is each of its checkouts')
        records, dl, _ = per_tag_view(r.hgetall(k.checkouts),
                                      {s(a): int(b) for a, b in r.zrange(k.deadlines, 0, -1, withscores=True)}, [])
        co = {tag: Checkout.decode(rec) for tag, rec in records.items()}
        rd = [ReadyEntry.decode(m) for m in r.zrange(k.ready, 0, -1)]
        dly = [(ReadyEntry.decode(m), int(sc)) for m, sc in r.zrange(k.delayed, 0, -1, withscores=True)]
        seq, first = int(meta.get(compact_meta.SEQ, 0)), int(meta.get(compact_meta.FIRST, 1))
        row = queues[qid]
        ref = queue_ref(qid)
        assert (row["topic"], row["lmq"], row["kind"]) == (ref.topic, ref.lmq, "lmq" if ref.lmq else "topic")
        assert (row["seq"], row["first"], row["tag"]) == (seq, first, int(meta.get(compact_meta.TAG, 0)))
        assert (row["created_ms"], row["last_write_ms"]) == (_int(meta.get(compact_meta.CREATED)), _int(meta.get(compact_meta.LAST_WRITE)))
        assert row["retained"] == r.hlen(k.log)
        assert (row["checkouts"], row["ready"], row["delayed"]) == (len(co), len(rd), len(dly))
        assert (row["dead_letters"], row["owned"]) == (r.llen(k.dead), r.zcard(k.owned))
        # entries kept in Redis; rows exported: their events (a batch entry holds one call's)
        assert row["journal_length"] == r.llen(k.journal)
        assert row["journal_rows"] == sum(len(journal_events(e)) for e in r.lrange(k.journal, 0, -1))
        assert row["journal_cap"] == int(meta[compact_meta.JOURNAL_CAP])
        assert abs(row["snapshot_ms"] - int(r.time()[0]) * 1000) < 60_000
        assert len(row["digest"]) == 40 and int(row["digest"], 16) >= 0
        assert (row["scheduled"], row["priority"], row["held_by_level"]) == (r.zcard(k.scheduled), False, None)

        group_names = decode_names(meta.get(compact_meta.GROUPS))
        assert row["groups"] == len(group_names)
        for g in group_names:
            gf = {name: meta.get(compact_meta.group_field(g, name)) for name in GROUP_FIELDS}
            cursor = max(int(gf[compact_meta.CURSOR] or first), first)
            pending = [c.id for c in co.values() if c.group == g] + [m.id for m in rd if m.group == g] + \
                      [m.id for m, _ in dly if m.group == g] + ([cursor] if cursor <= seq else [])
            pending = [i for i in pending if first <= i <= seq]
            oldest = min(pending) if pending else None
            oldest_ms = int(r.hget(k.log, oldest).split(b":", 1)[0]) if oldest else None
            unread = max(0, seq - cursor + 1)
            n_ready = sum(1 for m in rd if m.group == g)
            mem = decode_names(gf[compact_meta.MEMBERS])
            raw_churn = meta.get(compact_meta.group_field(g, "ch"))
            p, e, fp, c_first, c_last = [int(x) for x in raw_churn.split(",")] if raw_churn else [0, 0, 0, None, None]
            who = [w for w in (meta.get(compact_meta.group_field(g, "chw")) or "").split("\n") if w]
            exp_groups[(qid, g)] = dict(
                queue=qid, topic=ref.topic, lmq=ref.lmq, group=g, mode=gf[compact_meta.MODE],
                policy=gf[compact_meta.POLICY], on_preempt=gf[compact_meta.ON_PREEMPT], cursor=cursor,
                epoch=int(gf[compact_meta.EPOCH]), owner=gf[compact_meta.OWNER], members=len(mem), unread=unread,
                ready=n_ready, delayed=sum(1 for m, _ in dly if m.group == g),
                checkouts=sum(1 for c in co.values() if c.group == g), backlog=unread + n_ready,
                oldest_pending_id=oldest, oldest_pending_ms=oldest_ms, snapshot_ms=row["snapshot_ms"],
                preemptions=p, evictions=e, fenced_pulls=fp, churn_clients=who, churn_clients_capped=len(who) >= 8,
                first_churn_ms=c_first, last_churn_ms=c_last, unread_by_level=None)
            for pos, m in enumerate(mem):
                f = {name: meta.get(compact_meta.member_field(g, m, name)) for name in MEMBER_FIELDS}.get
                exp_members[(qid, g, m)] = dict(
                    queue=qid, topic=ref.topic, lmq=ref.lmq, group=g, member=m, position=pos,
                    delivered=int(f(compact_meta.DELIVERED)), max=_int(f(compact_meta.MAX)),
                    lock_ms=_int(f(compact_meta.LOCK)), suspected=f(compact_meta.SUSPECTED_SINCE) is not None,
                    suspected_since_ms=_int(f(compact_meta.SUSPECTED_SINCE)), marker=f(compact_meta.MARKER),
                    capacity=_int(f(compact_meta.CAPACITY)), qos=_int(f(compact_meta.QOS)),
                    ended=f(compact_meta.ENDED) is not None,
                    mailbox_depth=r.llen(k.mailbox(g, m)) if f(compact_meta.CAPACITY) is not None else None,
                    checkouts=sum(1 for c in co.values() if c.group == g and c.member == m))
        for tag, c in co.items():
            exp_checkouts[(qid, tag)] = dict(queue=qid, tag=tag, group=c.group, member=c.member, id=c.id,
                                             epoch=c.epoch, acquisitions=c.acquisitions, failures=c.failures,
                                             deadline_ms=dl.get(tag))
        exp_ready += [(qid, m.group, m.id, m.acquisitions, m.failures, None) for m in rd]
        exp_ready += [(qid, m.group, m.id, m.acquisitions, m.failures, sc) for m, sc in dly]
        for i in range(first, min(seq, first + 4) + 1):
            body = r.hget(k.log, i)
            ms, rest = body.split(b":", 1)
            exp_messages.append((qid, i, int(ms), len(rest)))

        entries = [e for raw in r.lrange(k.journal, 0, -1) for e in journal_events(raw)]
        assert [(j["seq"], j["ms"], j["event"], j["group"], j["member"], j["id"], j["tag"], j["epoch"], j["extra"])
                for j in journal[qid]] == [
            (pos, e.ms, e.event, e.group, e.member, e.id, e.tag, e.epoch, e.extra) for pos, e in enumerate(entries)]

    assert groups == exp_groups
    assert members == exp_members
    assert checkouts == exp_checkouts
    assert ready == sorted(exp_ready)
    assert messages == sorted(exp_messages)
    r.close()

    # What the workload did is visible in the snapshot
    assert members[("t:orders", "audit", "c3")]["suspected"]
    assert members[("l:chat:room1", "default", "alice")]["marker"] == "bob"
    assert members[("l:chat:room2", "default", "alice")]["marker"] == "ops"
    assert groups[("l:chat:room1", "default")]["owner"] == "bob"
    # churn is in the groups table whether or not the lmq keeps a journal
    churn = {q: (g["preemptions"], g["evictions"], g["fenced_pulls"], g["churn_clients"])
             for (q, _), g in groups.items() if q.startswith("l:")}
    assert churn["l:chat:room1"] == (1, 0, 1, ["alice", "bob"])
    assert churn["l:chat:room2"] == (0, 1, 1, ["alice"])
    assert queues["t:orders"]["dead_letters"] == 1 and queues["t:orders"]["delayed"] == 1
    assert groups[("t:orders", "replay")]["epoch"] == 1
    assert groups[("t:orders", "audit")]["ready"] == 3  # the expired leases came back
    assert 0 < members[("t:orders", "pushers", "p1")]["mailbox_depth"] <= 3
    assert all(c["deadline_ms"] is None for c in checkouts.values() if c["group"] == "pushers"
               and c["id"] != 1)  # still in the mailbox: no lease yet
    assert "l:chat:room3" not in {q for q, _ in groups}
    evs = [(j["event"], j["member"], j["extra"]) for j in journal["l:chat:room1"]]
    assert ("preempt", "bob", "alice") in evs and ("fenced", "alice", "bob") in evs
    assert sum(1 for j in journal["t:orders"] if j["event"] == "timeout") == facts.timed_out["c3"]
    assert any(j["event"] == "out" and j["tag"].startswith("q") for j in journal["t:orders"])


def test_snapshot_limits_and_empty(redis_url: str, tmp_path: Path) -> None:
    manifest = run(snapshot_to(redis_url, tmp_path / "empty"))
    assert manifest.queues == 0 and all(n == 0 for n in manifest.counts.values())
    for table in SCHEMAS:
        assert pq.read_table(tmp_path / "empty" / f"{table}.parquet").num_rows == 0

    run(run_workload(redis_url))
    manifest = run(snapshot_to(redis_url, tmp_path / "lim", journal_entries=3, log_entries=0))
    assert manifest.counts["messages"] == 0
    rows = read(tmp_path / "lim", "journal")
    per_queue = defaultdict(list)
    for row in rows:
        per_queue[row["queue"]].append(row)
    r = redis.Redis.from_url(redis_url)
    for qid, got in per_queue.items():
        newest = [e.event for raw in r.lrange(Keyspace().queue_by_id(qid).journal, -3, -1) for e in journal_events(raw)][-3:]
        assert [j["event"] for j in got] == newest and [j["seq"] for j in got] == [0, 1, 2]
    queues = {row["queue"]: row for row in read(tmp_path / "lim", "queues")}
    assert queues["t:orders"]["journal_rows"] == 3 < queues["t:orders"]["journal_length"]
    r.close()
    none = run(snapshot_to(redis_url, tmp_path / "nojr", journal_entries=0))
    assert none.counts["journal"] == 0


def test_an_incremental_snapshot_reads_again_only_the_queues_written_since(redis_url: str, tmp_path: Path) -> None:
    redis.Redis.from_url(redis_url).flushall()
    run(run_workload(redis_url))
    full = run(snapshot_to(redis_url, tmp_path / "full"))
    assert full.base is None and full.unchanged == 0 and full.queues == 5

    quiet = run(snapshot_to(redis_url, tmp_path / "quiet", since=tmp_path / "full"))
    # p1's push mailbox makes t:orders a queue that is always read in full (its first call cannot name it)
    assert (quiet.queues, quiet.unchanged, quiet.base) == (5, 4, "../full")
    assert {row["queue"] for row in read(tmp_path / "quiet", "queues")} == {"t:orders"}
    assert {row["queue"] for row in read(tmp_path / "quiet", "unchanged")} == {
        "l:chat:room1", "l:chat:room2", "l:chat:room3", "l:chat:room4"}

    # a publish to one lmq, and a pull + ack on another: neither changes the write time of room4
    run(publish_then_settle_one(redis_url, Config(redis_url=redis_url), publish_to="room3", settle_on="room4",
                                client="bob"))
    later = run(snapshot_to(redis_url, tmp_path / "later", since=tmp_path / "quiet"))
    assert {row["queue"] for row in read(tmp_path / "later", "queues")} == {"t:orders", "l:chat:room3", "l:chat:room4"}
    assert {row["queue"] for row in read(tmp_path / "later", "unchanged")} == {"l:chat:room1", "l:chat:room2"}
    assert later.base == "../quiet"


def test_an_incremental_snapshot_needs_a_finished_base(redis_url: str, tmp_path: Path) -> None:
    from fencemq.ops.snapshot import SnapshotError

    with pytest.raises(SnapshotError, match="manifest.json missing"):
        run(snapshot_to(redis_url, tmp_path / "next", since=tmp_path / "nothing"))
    assert not (tmp_path / "next").exists(), "nothing written"


def test_snapshot_is_consistent_per_queue_under_load(redis_url: str, tmp_path: Path) -> None:
    """Writers keep pulling and acking while the snapshot runs: every queue's rows still agree.

    Each queue has one group whose members only pull and ack (no expiries), so at any
    instant: out events - ack events = checkouts, out events = cursor - the first id, and the
    last tag = out events. A snapshot stitched from reads at different moments breaks these.
    """
    n_queues = 40
    first_ids: dict[str, int] = {}  # an lmq's ids start at the clock (lib/meta.lua, start_ids)

    async def main() -> Manifest:
        r = Redis.from_url(redis_url)
        q = Core(r, Config(redis_url=redis_url, lite_journal_cap=10_000))
        handles = []
        for i in range(n_queues):
            first_ids[f"l:load:q{i}"] = int((await q.publishing.publish("load", [b"x"] * 200, lmq=f"q{i}"))[0])
            handles.append(_h(await q.subscriptions.subscribe(f"w{i}", "load", lmq=f"q{i}")))
        stop = asyncio.Event()

        async def churn(h: Handle) -> None:
            rng = random.Random(h.queue.lmq)
            while not stop.is_set():
                got = (await q.leases.pull(h, rng.randint(1, 3))).deliveries
                if got and rng.random() < 0.7:
                    await q.leases.ack(h, [d.tag for d in got[: rng.randint(1, len(got))]])
                await asyncio.sleep(0)

        tasks = [asyncio.create_task(churn(h)) for h in handles]
        await asyncio.sleep(0.05)
        try:
            manifests = [await take_snapshot(r, Keyspace(), tmp_path / f"s{i}", batch=3) for i in range(3)]
        finally:
            stop.set()
            await asyncio.gather(*tasks)
            await r.aclose()
        return manifests[-1]

    run(main())
    for i in range(3):
        out = tmp_path / f"s{i}"
        queues = {row["queue"]: row for row in read(out, "queues")}
        groups = {row["queue"]: row for row in read(out, "groups")}
        co = defaultdict(int)
        for row in read(out, "checkouts"):
            co[row["queue"]] += 1
        outs, acks = defaultdict(int), defaultdict(int)
        for row in read(out, "journal"):
            if row["event"] == "out":
                outs[row["queue"]] += 1
            elif row["event"] == "ack":
                acks[row["queue"]] += 1
        assert len(queues) == n_queues
        moved = 0
        for qid, row in queues.items():
            assert outs[qid] - acks[qid] == co[qid] == row["checkouts"], qid
            # an ownership entry per lease: a checkout's own, or a lease batch's (one PULL's checkouts)
            assert (0 < row["owned"] <= row["checkouts"]) if row["checkouts"] else row["owned"] == 0, qid
            assert outs[qid] == groups[qid]["cursor"] - first_ids[qid], qid
            assert (row["tag"] > 0) == (outs[qid] > 0), qid  # the last tag handed out (they only grow)
            moved += outs[qid]
        assert moved > 0


# -- Redis Cluster: every master is visited -----------------------------------------------------




def test_snapshot_visits_every_cluster_master(cluster: list[EmbeddedRedis], tmp_path: Path) -> None:
    from redis.asyncio import RedisCluster

    url = f"redis://127.0.0.1:{cluster[0].port}/0"

    async def main() -> Manifest:
        rc = RedisCluster.from_url(url)
        try:
            q = Core(rc, Config(redis_url=url, lite_journal_cap=10_000))
            for i in range(30):
                await q.publishing.publish("spread", [b"a", b"b"], lmq=f"lmq-{i}")
                h = _h(await q.subscriptions.subscribe("c", "spread", lmq=f"lmq-{i}"))
                got = (await q.leases.pull(h, 1)).deliveries
                await q.leases.ack(h, [got[0].tag])
            await q.publishing.publish("plain", [b"p"])
            return await take_snapshot(rc, Keyspace(), tmp_path / "c", batch=7)
        finally:
            await rc.aclose()

    manifest = run(main())
    assert manifest.nodes == 3 and manifest.queues == 31 and manifest.error_count == 0
    assert manifest.source.startswith("redis-cluster://")
    queues = read(tmp_path / "c", "queues")
    assert sorted(q["lmq"] or "" for q in queues) == sorted(["", *(f"lmq-{i}" for i in range(30))])
    per_node = defaultdict(int)
    for srv in cluster:
        c = srv.client()
        per_node[srv.port] = sum(1 for _ in c.scan_iter(match=Keyspace().queue_pattern(), _type="hash"))
        c.close()
    assert sum(per_node.values()) == 31 and all(n > 0 for n in per_node.values())
    by_queue = defaultdict(list)
    for row in read(tmp_path / "c", "journal"):
        by_queue[row["queue"]].append(row["event"])
    assert by_queue["l:spread:lmq-7"] == ["pub", "pub", "sub", "out", "ack"]


def test_snapshot_reloads_a_flushed_script_and_reports_unreadable_queues(redis_url: str, tmp_path: Path) -> None:
    r = redis.Redis.from_url(redis_url)
    r.hset("fmq:{t:good}", mapping={"seq": 0, "first": 1})
    r.hset("fmq:{t:bad}", mapping={"seq": 0, "first": 1})
    r.set("fmq:{t:bad}:co", "not a hash")  # the fence's HGETALL fails: WRONGTYPE
    r.script_flush()
    r.close()

    async def main() -> tuple[Manifest, Any]:
        from fencemq.ops.snapshot import _Fence

        a = Redis.from_url(redis_url)
        try:
            fence = _Fence(a)  # never loaded: the first call answers NOSCRIPT, then it loads and retries
            k = Keyspace().queue_by_id("t:good")
            got = await fence.run([([k.meta, k.log, k.checkouts, k.deadlines, k.owned, k.ready, k.delayed, k.dead,
                                     k.journal, k.scheduled, k.priority], [0, -1])])
            return await take_snapshot(a, Keyspace(), tmp_path / "s"), got
        finally:
            await a.aclose()

    manifest, got = run(main())
    assert not isinstance(got[0], Exception) and got[0][1]  # the meta came back
    assert manifest.queues == 1 and manifest.error_count == 1
    assert manifest.errors[0].startswith("t:bad: ") and "WRONGTYPE" in manifest.errors[0]
    assert [q["queue"] for q in read(tmp_path / "s", "queues")] == ["t:good"]


def priority_workload(redis_url: str, c: redis.Redis) -> None:
    """A priority topic ``urgent`` (groups fast and slow) and a plain one, with scheduled messages:

    urgent holds levels 9: a b, 1: c d e, 0: f; fast has read a b c, slow a; 1 message of urgent and 1 of
    plain wait for their time (600 s), plain holds 1."""
    from fencemq.model.keys import QueueRef
    from fencemq.ops.priority import set_priority
    from tests.helpers import pulled, subscribed

    async def honour() -> None:
        a = Redis.from_url(redis_url)
        try:
            await set_priority(a, Keyspace(), QueueRef("urgent"), True)
        finally:
            await a.aclose()

    run(honour())
    fast, slow = subscribed(c, "urgent", "GROUP", "fast"), subscribed(c, "urgent", "GROUP", "slow")
    for body, level in (("a", 9), ("b", 9), ("c", 1), ("d", 1), ("e", 1), ("f", 0)):
        c.execute_command("PUB", "urgent", body, "PRIORITY", level)
    assert [d["payload"] for d in pulled(c, fast, 3)] == ["a", "b", "c"]
    assert [d["payload"] for d in pulled(c, slow, 1)] == ["a"]
    c.execute_command("PUB", "urgent", "later", "PRIORITY", 9, "DELAY", 600_000)
    c.execute_command("PUB", "plain", "now")
    c.execute_command("PUB", "plain", "later", "DELAY", 600_000)


def test_a_snapshot_carries_scheduled_counts_and_a_priority_queues_counts_per_level(redis_url: str,
                                                                                      tmp_path: Path) -> None:
    from fencemq.fences.priority import level_counts
    from fencemq.model.keys import QueueRef
    from tests.helpers import client, worker

    with worker(redis_url) as w:
        c = client(w.port, 2, "p1")
        priority_workload(redis_url, c)
        run(snapshot_to(redis_url, tmp_path / "full"))
        queues = {row["queue"]: row for row in read(tmp_path / "full", "queues")}
        groups = {(row["queue"], row["group"]): row for row in read(tmp_path / "full", "groups")}
        urgent = queues["t:urgent"]
        assert (urgent["priority"], urgent["scheduled"]) == (True, 1)
        assert urgent["held_by_level"] == [1, 3, 0, 0, 0, 0, 0, 0, 0, 2]  # indexed by level, 0 first
        # a priority queue's unread is what each level's cursor has ahead (not seq - its low-water cursor)
        assert groups[("t:urgent", "fast")]["unread_by_level"] == [1, 2, 0, 0, 0, 0, 0, 0, 0, 0]
        assert groups[("t:urgent", "slow")]["unread_by_level"] == [1, 3, 0, 0, 0, 0, 0, 0, 0, 1]
        assert [groups[("t:urgent", g)]["unread"] for g in ("fast", "slow")] == [3, 5]
        assert groups[("t:urgent", "fast")]["backlog"] == 3

        async def as_the_cli_reads_them() -> dict:
            a = Redis.from_url(redis_url)
            try:
                return await level_counts(a, Keyspace().queue(QueueRef("urgent")))
            finally:
                await a.aclose()

        counts = run(as_the_cli_reads_them())  # fencemq inspect queue / priority show: the same figures
        assert {lv: n for lv, n in enumerate(urgent["held_by_level"]) if n} == counts["levels"]
        for g in ("fast", "slow"):
            assert {lv: n for lv, n in enumerate(groups[("t:urgent", g)]["unread_by_level"]) if n} == counts["unread"][g]
        plain = queues["t:plain"]
        assert (plain["priority"], plain["scheduled"], plain["held_by_level"]) == (False, 1, None)

        # a message scheduled since is a change: an incremental snapshot reads the queue again
        c.execute_command("PUB", "plain", "later still", "DELAY", 600_000)
        run(snapshot_to(redis_url, tmp_path / "next", since=tmp_path / "full"))
        again = {row["queue"]: row for row in read(tmp_path / "next", "queues")}
        assert again["t:plain"]["scheduled"] == 2
        assert [row["queue"] for row in read(tmp_path / "next", "unchanged")] == ["t:urgent"]
        c.close()
