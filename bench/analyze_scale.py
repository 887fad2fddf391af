"""Benchmark of the analytics job (and, optionally, of snapshot export). Not part of `make test`.

    .venv/bin/python -m spark.bench_analyze [--lmqs 1000000] [--events 10000000] [--master local[2]]
                                            [--snapshot-lmqs 20000] [--keep DIR]

1. Generates a synthetic snapshot directly with pyarrow (no Redis): ``--lmqs``
   lite queues (one exclusive group each, 10% with a second, shared group),
   ``--events`` journal events (10 per lmq by default: publishes, a subscribe,
   checkouts, acks, and per lmq one of preempt / seek / lock expiry / nack /
   fenced pull), plus members, checkouts and ready rows; every fence audit
   check must come out zero.
2. Times ``spark.analytics.analyze`` on it (fresh SparkSession, ``--master``),
   report and plots included; the goal is ≤ 120 s on local[2] for 1,000,000
   lmqs and 10,000,000 events; ≤ 60 s for 1,000,000 / 10,000,000 and ≤ 600 s for
   10,000,000 / 100,000,000 since issue #19. The peak resident memory of the
   driver JVM (local mode: the executors are in it) is sampled.
3. With ``--snapshot-lmqs N`` (> 0): fills a private Redis with N lmqs through
   the real fences (publish, subscribe, pull, ack) and times ``take_snapshot``
   (queues/s), then an incremental snapshot (``since``) of the same idle state.

Writes ``bench/results/analyze.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
import pyarrow.parquet as pq

from fencemq.ops.journal_buckets import DEFAULT_BUCKETS, bucket_file, buckets_of
from fencemq.ops.snapshot import SCHEMA_VERSION, SCHEMAS

PER_LMQ = 10  # journal events per lmq in the template below
ROW_GROUP = 1 << 20
JOURNAL_CHUNK = 1_000_000  # lmqs per journal batch in generate


def _strings(prefix: str, values: np.ndarray) -> pa.Array:
    """prefix + zero-padded number, built in Arrow (fast for 10M rows: a dictionary, then decoded)."""
    uniq, inverse = np.unique(values, return_inverse=True)
    dictionary = pa.array([f"{prefix}{v:07d}" for v in uniq.tolist()], pa.string())
    return pa.DictionaryArray.from_arrays(pa.array(inverse.astype(np.int32)), dictionary).cast(pa.string())


def _const(value, n: int, typ: pa.DataType) -> pa.Array:
    return pa.array(np.full(n, value)) if value is not None and typ != pa.string() else (
        pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), pa.array([value], typ)).cast(typ)
        if value is not None else pa.nulls(n, typ))


def _table(name: str, columns: dict[str, pa.Array]) -> pa.Table:
    schema = SCHEMAS[name]
    n = len(next(iter(columns.values())))
    arrays = [columns[f.name].cast(f.type) if f.name in columns else pa.nulls(n, f.type) for f in schema]
    return pa.Table.from_arrays(arrays, schema=schema)


def _write(out: Path, name: str, columns: dict[str, pa.Array]) -> int:
    schema = SCHEMAS[name]
    arrays = [columns[f.name].cast(f.type) if f.name in columns else pa.nulls(len(next(iter(columns.values()))),
                                                                                 f.type) for f in schema]
    table = pa.Table.from_arrays(arrays, schema=schema)
    pq.write_table(table, out / f"{name}.parquet", row_group_size=ROW_GROUP)
    return table.num_rows


def _churn(gq: np.ndarray, lmqs: int, kind: np.ndarray, base_ms: int) -> dict[str, pa.Array]:
    ng = len(gq)
    default = np.arange(ng) < lmqs
    k = np.where(default, kind[gq], -1)
    pre, fen = k == 0, k == 4
    churned = pre | fen
    per = np.where(pre, 2, np.where(fen, 1, 0)).astype(np.int32)
    offsets = np.zeros(ng + 1, np.int32)
    np.cumsum(per, out=offsets[1:])
    # values: c<q> for every churned group, then d<q> after it where preempted
    owners = gq[churned]
    pos = offsets[:-1][churned]
    names = np.empty(offsets[-1], np.int64)
    names[pos] = owners
    second = pre[churned]
    names[pos[second] + 1] = owners[second] + 10**9  # d<q>
    strings = pa.array(np.where(names >= 10**9, names - 10**9, names)).cast(pa.string())
    prefix = pa.array(np.where(names >= 10**9, "d", "c"))
    padded = pa.compute.utf8_lpad(strings, 7, "0")
    values = pa.compute.binary_join_element_wise(prefix, padded, "")
    # the preempt / fenced event is the template's last (position 9: ms = base + q + 90)
    ms = base_ms + gq + 90
    zeros = np.zeros(ng, np.int64)
    return {
        "preemptions": pa.array(pre.astype(np.int64)), "evictions": pa.array(zeros),
        "fenced_pulls": pa.array(fen.astype(np.int64)),
        "churn_clients": pa.ListArray.from_arrays(pa.array(offsets), values),
        "churn_clients_capped": pa.array(np.zeros(ng, bool)),
        "first_churn_ms": pa.array(ms, mask=~churned), "last_churn_ms": pa.array(ms, mask=~churned),
    }


def _journal_chunk(q: np.ndarray, kind: np.ndarray, per: int, base_ms: int) -> pa.Table:
    """The journal rows of the lmqs ``q`` (consecutive numbers; ``kind``: their variants)."""
    lmqs = len(q)
    # journal: per lmq, PER_LMQ template events (then padding 'pub' events if --events asks for more)
    #   0-2 pub 1..3 | 3 sub c | 4 out 1 | 5 out 2 | 6 ack 1 | 7 ack 2 | 8 out 3 | 9 variant:
    #   kind 0 preempt (new owner d, extra c) | 1 seek earliest (epoch 1) | 2 timeout 3 | 3 nack 3 | 4 fenced
    #   else ack 3
    ev_names = ["pub", "sub", "out", "ack", "preempt", "seek", "timeout", "nack", "fenced"]
    template = np.array([0, 0, 0, 1, 2, 2, 3, 3, 2, 3], np.int8)
    variant = np.select([kind == 0, kind == 1, kind == 2, kind == 3, kind == 4], [4, 5, 6, 7, 8], 3).astype(np.int8)
    ev = np.tile(template, lmqs).reshape(lmqs, PER_LMQ)
    ev[:, 9] = variant
    ids = np.tile(np.array([1, 2, 3, 1, 1, 2, 1, 2, 3, 3], np.int64), (lmqs, 1))
    ids[variant == 5, 9] = 1  # seek: the new cursor
    has_id = np.ones((lmqs, PER_LMQ), bool)
    has_id[:, 9] = np.isin(variant, [5, 6, 7, 3])
    tags = np.tile(np.array([0, 0, 0, 0, 1, 2, 1, 2, 3, 3], np.int8), (lmqs, 1))
    tags[~np.isin(variant, [6, 7, 3]), 9] = 0
    epoch = np.zeros((lmqs, PER_LMQ), np.int64)
    epoch[variant == 5, 9] = 1
    extra_code = np.zeros((lmqs, PER_LMQ), np.int8)  # 0 null, 1 acquisitions, 2 mode, 3 evicted / marker, 4 kind
    extra_code[:, [4, 5, 8]] = 1
    extra_code[:, 3] = 2
    extra_code[variant == 4, 9] = 3
    extra_code[variant == 5, 9] = 4
    extra_code[variant == 8, 9] = 3
    pad = per - PER_LMQ
    if pad:
        ev = np.hstack([ev, np.zeros((lmqs, pad), np.int8)])
        ids = np.hstack([ids, np.tile(np.arange(4, 4 + pad, dtype=np.int64), (lmqs, 1))])
        has_id = np.hstack([has_id, np.ones((lmqs, pad), bool)])
        tags = np.hstack([tags, np.zeros((lmqs, pad), np.int8)])
        epoch = np.hstack([epoch, np.zeros((lmqs, pad), np.int64)])
        extra_code = np.hstack([extra_code, np.zeros((lmqs, pad), np.int8)])
    n = lmqs * per
    ev, ids, has_id, tags, epoch, extra_code = (a.reshape(n) for a in (ev, ids, has_id, tags, epoch, extra_code))
    owner_q = np.repeat(q, per)
    pos = np.tile(np.arange(per, dtype=np.int64), lmqs)
    is_pub = ev == 0
    preempt = ev == 4
    # client names: dictionary c0000000.., d0000000.. (the preempting owner of lmq q is d<q>)
    q0 = int(q[0])
    clients = pa.array([f"{p}{i:07d}" for p in "cd" for i in range(q0, q0 + lmqs)], pa.string())
    local_q = owner_q - q0
    member_idx = np.where(preempt, lmqs + local_q, local_q).astype(np.int32)
    members = pa.DictionaryArray.from_arrays(pa.array(member_idx, mask=is_pub), clients).cast(pa.string())
    # extra: 1 '1' (acquisitions) | 2 'exclusive' | 3 the evicted client c<q> (preempt) or 'ops' (fenced) | 4 'earliest'
    fixed = ["1", "exclusive", "earliest", "ops"]
    extra_idx = np.select([extra_code == 1, extra_code == 2, extra_code == 4, (extra_code == 3) & preempt,
                           extra_code == 3], [0, 1, 2, 4 + local_q, 3], 0).astype(np.int32)
    extra = pa.DictionaryArray.from_arrays(
        pa.array(extra_idx, mask=extra_code == 0),
        pa.concat_arrays([pa.array(fixed, pa.string()), clients.slice(0, lmqs)])).cast(pa.string())
    tag_dict = pa.array(["1", "2", "3"], pa.string())
    return _table("journal", {
        "queue": _strings("l:bench:lmq-", owner_q), "seq": pa.array(pos),
        "ms": pa.array(base_ms + owner_q + pos * 10),
        "event": pa.DictionaryArray.from_arrays(pa.array(ev.astype(np.int32)), pa.array(ev_names)).cast(pa.string()),
        "group": pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32), mask=is_pub),
                                       pa.array(["default"])).cast(pa.string()),
        "member": members, "id": pa.array(ids, mask=~has_id),
        "tag": pa.DictionaryArray.from_arrays(pa.array((tags - 1).astype(np.int32), mask=tags == 0),
                                              tag_dict).cast(pa.string()),
        "epoch": pa.array(epoch, mask=is_pub), "extra": extra,
    })


def generate(out: Path, lmqs: int, events: int, seed: int = 7, buckets: int = DEFAULT_BUCKETS) -> dict[str, int]:
    """A consistent synthetic snapshot; returns rows per table."""
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    per = max(1, events // lmqs)
    if per < PER_LMQ:
        raise SystemExit(f"--events must be at least {PER_LMQ} per lmq")
    base_ms = 1_790_000_000_000
    snap_ms = base_ms + 3_600_000
    q = np.arange(lmqs, dtype=np.int64)
    topics = q % 10
    kind = q % 20  # which variant of the template each lmq gets
    queue_ids = _strings("l:bench:lmq-", q)
    topic_names = pa.DictionaryArray.from_arrays(pa.array(topics.astype(np.int32)),
                                                 pa.array([f"bench-{t}" for t in range(10)])).cast(pa.string())
    lmq_names = _strings("lmq-", q)
    seq_last = np.full(lmqs, 6, np.int64)
    # half the lmqs hold id 3 checked out; not those that sought after taking it (kind 1: a seek returns
    # every checkout of the group)
    has_co = (kind < 10) & (kind != 1)
    counts = {}

    counts["queues"] = _write(out, "queues", {
        "queue": queue_ids, "kind": _const("lmq", lmqs, pa.string()), "topic": topic_names, "lmq": lmq_names,
        "seq": pa.array(seq_last), "first": pa.array(np.ones(lmqs, np.int64)), "retained": pa.array(seq_last),
        "tag": pa.array(np.full(lmqs, 4, np.int64)), "created_ms": pa.array(base_ms + q),
        "last_write_ms": pa.array(base_ms + q + 1000), "snapshot_ms": pa.array(np.full(lmqs, snap_ms)),
        "groups": pa.array(np.where(q % 10 == 0, 2, 1).astype(np.int32)),
        "checkouts": pa.array(has_co.astype(np.int64)), "ready": pa.array(np.zeros(lmqs, np.int64)),
        "delayed": pa.array(np.zeros(lmqs, np.int64)), "dead_letters": pa.array(np.zeros(lmqs, np.int64)),
        "owned": pa.array(has_co.astype(np.int64)), "push_members": pa.array(np.zeros(lmqs, np.int32)),
        "journal_cap": pa.array(np.full(lmqs, 10_000)), "journal_length": pa.array(np.full(lmqs, per)),
        "journal_rows": pa.array(np.full(lmqs, per)),
    })

    # groups: 'default' (exclusive) for every lmq, 'audit' (shared) for every 10th
    extra = q[q % 10 == 0]
    gq = np.concatenate([q, extra])
    ng = len(gq)
    gname = pa.DictionaryArray.from_arrays(pa.array(np.r_[np.zeros(lmqs, np.int32), np.ones(len(extra), np.int32)]),
                                           pa.array(["default", "audit"])).cast(pa.string())
    cursor = rng.integers(1, 8, ng)
    unread = np.maximum(0, 6 - cursor + 1)
    oldest = np.where(unread > 0, cursor, 0)
    counts["groups"] = _write(out, "groups", {
        "queue": _strings("l:bench:lmq-", gq), "topic": topic_names.take(pa.array(gq)),
        "lmq": _strings("lmq-", gq), "group": gname,
        "mode": pa.DictionaryArray.from_arrays(
            pa.array(np.r_[np.zeros(lmqs, np.int32), np.ones(len(extra), np.int32)]),
            pa.array(["exclusive", "shared"])).cast(pa.string()),
        "policy": _const("preempt", ng, pa.string()), "on_preempt": _const("keep", ng, pa.string()),
        "cursor": pa.array(cursor), "epoch": pa.array(np.where(gq % 20 == 1, 1, 0)),
        "owner": _strings("c", gq), "members": pa.array(np.ones(ng, np.int32)), "unread": pa.array(unread),
        "ready": pa.array(np.zeros(ng, np.int64)), "delayed": pa.array(np.zeros(ng, np.int64)),
        "checkouts": pa.array(np.zeros(ng, np.int64)), "backlog": pa.array(unread),
        "oldest_pending_id": pa.array(oldest, mask=oldest == 0),
        "oldest_pending_ms": pa.array(base_ms + gq + rng.integers(0, 3_600_000, ng), mask=oldest == 0),
        "snapshot_ms": pa.array(np.full(ng, snap_ms)),
        # churn counters in meta (lua/lib/lite.lua count_churn), as the journal tells it: the preempted
        # lmqs' default group (kind 0) one preemption, c<q> then d<q>; a fenced pull on kind 4
        **_churn(gq, lmqs, kind, base_ms),
    })
    counts["members"] = _write(out, "members", {
        "queue": queue_ids, "topic": topic_names, "lmq": lmq_names, "group": _const("default", lmqs, pa.string()),
        "member": _strings("c", q), "position": pa.array(np.zeros(lmqs, np.int32)),
        "delivered": pa.array(np.full(lmqs, 3, np.int64)), "suspected": pa.array(kind == 2),
        "suspected_since_ms": pa.array(np.full(lmqs, snap_ms - 1000), mask=kind != 2),
        "qos": pa.array(np.ones(lmqs, np.int32)), "ended": pa.array(np.zeros(lmqs, bool)),
        "checkouts": pa.array(has_co.astype(np.int64)),
    })
    co = q[has_co]
    counts["checkouts"] = _write(out, "checkouts", {
        "queue": _strings("l:bench:lmq-", co), "tag": _const("4", len(co), pa.string()),
        "group": _const("default", len(co), pa.string()), "member": _strings("c", co),
        "id": pa.array(np.full(len(co), 3, np.int64)), "epoch": pa.array(np.zeros(len(co), np.int64)),
        "acquisitions": pa.array(np.ones(len(co), np.int64)), "failures": pa.array(np.zeros(len(co), np.int64)),
        "deadline_ms": pa.array(np.full(len(co), snap_ms + 30_000)),
    })
    counts["ready"] = _write(out, "ready", {"queue": pa.array([], pa.string())})
    counts["messages"] = _write(out, "messages", {"queue": pa.array([], pa.string())})

    # the journal, a million lmqs at a time (100,000,000 events do not fit in memory at once), in
    # the buckets a snapshot writes (fencemq.ops.journal_buckets: each queue where Spark hashes it);
    # buckets=0: one file, as snapshots were written before
    if buckets:
        journal_dir = out / "journal.parquet"
        journal_dir.mkdir()
        writers = [pq.ParquetWriter(journal_dir / bucket_file(b), SCHEMAS["journal"]) for b in range(buckets)]
    else:
        writers = [pq.ParquetWriter(out / "journal.parquet", SCHEMAS["journal"])]
    counts["journal"] = 0
    for lo in range(0, lmqs, JOURNAL_CHUNK):
        chunk_q = q[lo:lo + JOURNAL_CHUNK]
        chunk = _journal_chunk(chunk_q, kind[lo:lo + JOURNAL_CHUNK], per, base_ms)
        row_bucket = (np.repeat(buckets_of(_strings("l:bench:lmq-", chunk_q), buckets), per) if buckets
                      else np.zeros(chunk.num_rows, np.int32))  # hashed once per lmq: its rows are together
        for b, writer in enumerate(writers):
            writer.write_table(chunk.filter(pa.array(row_bucket == b)), row_group_size=ROW_GROUP)
        counts["journal"] += chunk.num_rows
    for writer in writers:
        writer.close()
    manifest = {
        "schema_version": SCHEMA_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": "synthetic (spark/bench_analyze.py)", "prefix": "fmq", "nodes": 1, "queues": lmqs,
        "counts": counts, "tables": {name: f"{name}.parquet" for name in SCHEMAS},
        "first_snapshot_ms": snap_ms, "last_snapshot_ms": snap_ms, "duration_s": 0, "queues_per_s": 0,
        "log_entries": 0, "journal_entries": -1, "vanished": 0, "mailbox_unsettled": 0, "errors": [],
        "error_count": 0, "journal_buckets": buckets,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return counts


def bench_snapshot(lmqs: int, workdir: Path) -> dict[str, float]:
    """Fill a private Redis with `lmqs` lite queues through the fences, then time take_snapshot."""
    from redis.asyncio import Redis

    from fencemq.config import Config
    from fencemq.server.embedded import EmbeddedRedis
    from fencemq.model.keys import Keyspace
    from fencemq.model.handles import Handle
    from fencemq.fences.core import Core
    from fencemq.ops.snapshot import take_snapshot

    async def fill(url: str) -> None:
        r = Redis.from_url(url, max_connections=64)
        q = Core(r, Config(redis_url=url))
        sem = asyncio.Semaphore(64)

        async def one(i: int) -> None:
            async with sem:
                await q.publishing.publish("snap", [b"m1", b"m2", b"m3"], lmq=f"l{i}")
                h = Handle.decode((await q.subscriptions.subscribe(f"c{i}", "snap", lmq=f"l{i}")).handle)
                got = (await q.leases.pull(h, 2)).deliveries
                await q.leases.ack(h, [got[0].tag])

        await asyncio.gather(*(one(i) for i in range(lmqs)))
        await r.aclose()

    async def snap(url: str) -> dict[str, float]:
        r = Redis.from_url(url)
        try:
            m = await take_snapshot(r, Keyspace(), workdir / "redis-snapshot", batch=100)
            # then an incremental one on the same, idle, state: every queue answers with its digest
            inc = await take_snapshot(r, Keyspace(), workdir / "redis-snapshot-2", batch=100,
                                      since=workdir / "redis-snapshot")
        finally:
            await r.aclose()
        return {"queues": m.queues, "seconds": m.duration_s, "queues_per_s": m.queues_per_s,
                "journal_events": m.counts["journal"],
                "incremental_unchanged": {"queues": inc.queues, "unchanged": inc.unchanged,
                                          "seconds": inc.duration_s, "queues_per_s": inc.queues_per_s}}

    with EmbeddedRedis() as server:
        t = time.perf_counter()
        asyncio.run(fill(server.url))
        filled = time.perf_counter() - t
        result = asyncio.run(snap(server.url))
        result["fill_seconds"] = round(filled, 1)
        result["server"] = f"{Path(server.binary).name} {server.version}"
    return result


class PeakMemory:
    """Samples, twice a second, the resident memory of the Spark driver JVM (in local mode the executors
    run in it) and of this Python process; keeps the peaks."""

    def __init__(self) -> None:
        import threading

        self.jvm = self.python = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            import psutil
        except ImportError:
            return
        me = psutil.Process()
        while not self._stop.is_set():
            try:
                self.python = max(self.python, me.memory_info().rss)
                jvm = sum(c.memory_info().rss for c in me.children(recursive=True) if "java" in c.name())
                self.jvm = max(self.jvm, jvm)
            except psutil.Error:
                pass
            self._stop.wait(0.5)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _jvm_cpu_seconds() -> float:
    """CPU time (user + system) of this process's child processes that are Java (the Spark driver JVM)."""
    try:
        import psutil
    except ImportError:
        return float("nan")
    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            if "java" in child.name():
                times = child.cpu_times()
                total += times.user + times.system
        except psutil.Error:
            pass
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lmqs", type=int, default=1_000_000)
    parser.add_argument("--events", type=int, default=10_000_000)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--shuffle-partitions", type=int, default=8)
    parser.add_argument("--driver-memory", default="6g")
    parser.add_argument("--journal-buckets", type=int, default=DEFAULT_BUCKETS,
                        help="the journal's buckets, as `fencemq snapshot` writes them (0: one file, as before)")
    parser.add_argument("--reuse", action="store_true",
                        help="with --keep: analyse the snapshot an earlier run generated there, if any")
    parser.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                        help="extra Spark configuration (repeatable), e.g. spark.driver.extraJavaOptions=...")
    parser.add_argument("--snapshot-lmqs", type=int, default=0, help="also time take_snapshot on N real lmqs")
    parser.add_argument("--keep", type=Path, help="keep the synthetic snapshot and results here")
    parser.add_argument("--results", type=Path, default=Path("bench/results/analyze.json"))
    args = parser.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

    work = args.keep or Path(tempfile.mkdtemp(prefix="fencemq-bench-analyze-"))
    snap, out = work / "snapshot", work / "analysis"
    try:
        t = time.perf_counter()
        if args.reuse and (snap / "manifest.json").is_file():
            counts = json.loads((snap / "manifest.json").read_text())["counts"]
        else:
            counts = generate(snap, args.lmqs, args.events, buckets=args.journal_buckets)
        generated = time.perf_counter() - t
        print(f"generated {counts['queues']:,} lmqs, {counts['journal']:,} journal events in {generated:.1f} s",
              flush=True)

        from pyspark import __version__ as spark_version

        from fencemq.spark.analytics import analyze, build_session

        t = time.perf_counter()
        spark = build_session(args.master, shuffle_partitions=args.shuffle_partitions,
                              driver_memory=args.driver_memory, conf={"spark.ui.showConsoleProgress": "false",
                                                                      **dict(c.split("=", 1) for c in args.conf)})
        started = time.perf_counter() - t
        load_before = os.getloadavg()
        t = time.perf_counter()
        jvm_cpu_before = _jvm_cpu_seconds()
        with PeakMemory() as peak:
            summary = analyze(spark, snap, out)
        analyzed = time.perf_counter() - t
        jvm_cpu = _jvm_cpu_seconds() - jvm_cpu_before
        load_after = os.getloadavg()
        spark.stop()
        print(f"analyze: {analyzed:.1f} s on {args.master} (session start {started:.1f} s; Spark JVM CPU "
              f"{jvm_cpu:.0f} s; load average {load_before[0]:.1f} -> {load_after[0]:.1f}; peak driver RSS "
              f"{peak.jvm / 2**20:,.0f} MiB); audit {summary['audit']['verdict']}", flush=True)
        goal = 60 if counts["queues"] <= 1_000_000 else 600  # issue #19: 1M/10M in 60 s, 10M/100M in 10 min

        result = {
            "benchmark": "analyze",
            "lmqs": counts["queues"], "journal_events": counts["journal"], "rows": counts,
            "master": args.master, "shuffle_partitions": args.shuffle_partitions,
            "journal_buckets": json.loads((snap / "manifest.json").read_text()).get("journal_buckets", 0),
            "driver_memory": args.driver_memory, "spark": spark_version, "conf": args.conf,
            "generate_seconds": round(generated, 1), "session_start_seconds": round(started, 1),
            "analyze_seconds": round(analyzed, 1), "goal_seconds": goal, "within_goal": analyzed <= goal,
            "peak_driver_jvm_rss_mib": round(peak.jvm / 2**20), "peak_python_rss_mib": round(peak.python / 2**20),
            # the machine may be shared: CPU seconds the Spark JVM spent, and the load around the run
            "jvm_cpu_seconds": round(jvm_cpu, 1), "load_average_before": load_before[0],
            "load_average_after": load_after[0],
            "audit": {k: v for k, v in summary["audit"].items() if k not in ("checks", "scope")},
            "timings": summary.get("timings"),
            "result_tables": summary["tables"], "totals": summary["totals"],
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        if args.snapshot_lmqs > 0:
            result["snapshot_export"] = bench_snapshot(args.snapshot_lmqs, work)
            print(f"snapshot export: {result['snapshot_export']['queues_per_s']:,.0f} queues/s "
                  f"({result['snapshot_export']['queues']:,} lmqs)", flush=True)
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.results}")
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
