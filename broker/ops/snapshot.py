"""Snapshots: every queue's whole state, one atomic fence call per queue, as Parquet.

``take_snapshot`` walks the queues (SCAN for their meta hashes, on every
master of a Cluster), runs ``lua/snapshot.lua`` on each (pipelined, ``batch``
queues per round trip) and writes one Parquet file per table plus
``manifest.json`` (written last: a directory without it is not a finished
snapshot).

Consistency is per queue, which is where every invariant lives: all of one
queue's rows come from one fence call. Push mailboxes are the only keys whose
names the fence cannot know in advance (Cluster wants every key in KEYS), so
a queue with push members is read twice: the first call's meta says which
members have a mailbox, the second call passes their mailbox keys and is
kept only if its own meta names exactly the same members (up to
``MAILBOX_ATTEMPTS`` calls; a queue whose push members keep changing is
kept with null mailbox depths and counted in the manifest). Queues without
push members cost one call.

Tables (one row per ...):

* ``queues``      queue: id, kind (topic | lmq | filter), topic (a filter
  subscription's filter), lmq, owner (filter subscriptions), log bounds
  (seq = last id, first = first retained id), retained, last tag,
  created/last-write ms, snapshot ms (Redis clock, inside the fence), counts
  (groups, checkouts, ready, delayed, dead letters, owned entries, push
  members, journal cap / length kept in Redis / rows exported).
* ``groups``      subscription (queue, group): mode, policy, on_preempt,
  cursor (clamped to first), epoch, owner, members, unread = max(0, seq -
  cursor + 1), ready (returned, waiting for redelivery), delayed, checkouts,
  backlog = unread + ready (as ``fencemq status``), the oldest pending
  retained message (id, publish ms).
* ``members``     member: position (arrival order), delivered, max, lock,
  suspected (since ms), marker (who evicted it), capacity, qos, ended,
  mailbox depth (LLEN, the EOS sentinel included; null without a mailbox),
  checkouts held.
* ``checkouts``   delivery tag (a string, as clients see it): group, member,
  id, epoch, acquisitions, failures, deadline ms (null: waiting in a push
  mailbox, lease not started).
* ``ready``       returned or delayed message: group, id, acquisitions,
  failures, due ms (null = ready now).
* ``messages``    log entry (only the first ``log_entries`` of each queue):
  id, publish ms, stored size — never the payload.
* ``journal``     journal event: seq (its position in the queue's journal as
  exported, 0 = oldest: the order events committed in), ms, event, group,
  member, id, tag (string: a QoS 0 delivery's starts with 'q'), epoch, extra
  (format: lua/_common.lua ``journal``; empty fields are null).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from redis.exceptions import NoScriptError, ResponseError

from fencemq.model.keys import Keyspace
from fencemq.ops.operations import is_cluster_client, primaries, scan_step
from fencemq.fences.operator import SNAPSHOT
from fencemq.fences.registry import sources
from fencemq.model.keys import queue_ref
from fencemq.model.values import integer
from fencemq.model.values import text as _s

SCHEMA_VERSION = 1
MAILBOX_ATTEMPTS = 4
MAX_ERRORS_LISTED = 100
SEP = "\x00"

S, I64, I32, B = pa.string(), pa.int64(), pa.int32(), pa.bool_()

SCHEMAS: dict[str, pa.Schema] = {
    "queues": pa.schema([
        ("queue", S), ("kind", S), ("topic", S), ("lmq", S), ("owner", S), ("seq", I64), ("first", I64),
        ("retained", I64),
        ("tag", I64), ("created_ms", I64), ("last_write_ms", I64), ("snapshot_ms", I64), ("groups", I32),
        ("checkouts", I64), ("ready", I64), ("delayed", I64), ("dead_letters", I64), ("owned", I64),
        ("push_members", I32), ("journal_cap", I64), ("journal_length", I64), ("journal_rows", I64),
    ]),
    "groups": pa.schema([
        ("queue", S), ("topic", S), ("lmq", S), ("group", S), ("mode", S), ("policy", S), ("on_preempt", S),
        ("cursor", I64), ("epoch", I64), ("owner", S), ("members", I32), ("unread", I64), ("ready", I64),
        ("delayed", I64), ("checkouts", I64), ("backlog", I64), ("oldest_pending_id", I64),
        ("oldest_pending_ms", I64), ("snapshot_ms", I64),
    ]),
    "members": pa.schema([
        ("queue", S), ("topic", S), ("lmq", S), ("group", S), ("member", S), ("position", I32),
        ("delivered", I64), ("max", I64), ("lock_ms", I64), ("suspected", B), ("suspected_since_ms", I64),
        ("marker", S), ("capacity", I64), ("qos", I32), ("ended", B), ("mailbox_depth", I64), ("checkouts", I64),
    ]),
    "checkouts": pa.schema([
        ("queue", S), ("tag", S), ("group", S), ("member", S), ("id", I64), ("epoch", I64),
        ("acquisitions", I64), ("failures", I64), ("deadline_ms", I64),
    ]),
    "ready": pa.schema([
        ("queue", S), ("group", S), ("id", I64), ("acquisitions", I64), ("failures", I64), ("due_ms", I64),
    ]),
    "messages": pa.schema([("queue", S), ("id", I64), ("publish_ms", I64), ("size", I64)]),
    "journal": pa.schema([
        ("queue", S), ("seq", I64), ("ms", I64), ("event", S), ("group", S), ("member", S), ("id", I64),
        ("tag", S), ("epoch", I64), ("extra", S),
    ]),
}

Progress = Callable[[int, "int | None"], None]


def _int(value: Any, default: int | None = None) -> int | None:
    return integer(value, default)


class SnapshotError(Exception):
    pass


@dataclass
class Manifest:
    """What ``manifest.json`` holds; ``counts`` = rows per table."""

    schema_version: int
    created: str  # ISO 8601, UTC, when the snapshot started (local clock)
    source: str  # where from: a URL without its password
    prefix: str
    nodes: int  # masters visited
    queues: int
    counts: dict[str, int]
    tables: dict[str, str]  # table -> file name
    first_snapshot_ms: int | None  # Redis clock, the earliest queue's fence call
    last_snapshot_ms: int | None
    duration_s: float
    queues_per_s: float
    log_entries: int
    journal_entries: int
    vanished: int = 0  # found by SCAN, gone before their fence call (a reclaimed lmq)
    mailbox_unsettled: int = 0  # queues whose push members kept changing: mailbox depths null
    errors: list[str] = field(default_factory=list)
    error_count: int = 0

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(asdict(self), indent=indent, sort_keys=False)

    @classmethod
    def load(cls, directory: str | Path) -> Manifest:
        data = json.loads((Path(directory) / "manifest.json").read_text())
        return cls(**data)


class _Table:
    """Rows buffered as tuples and flushed as Parquet row groups, so memory stays bounded."""

    def __init__(self, path: Path, schema: pa.Schema, flush_rows: int = 65536) -> None:
        self.path, self.schema, self.flush_rows = path, schema, flush_rows
        self.types = [f.type for f in schema]
        self.buffer: list[tuple] = []
        self.rows = 0
        self.writer = pq.ParquetWriter(path, schema)

    def add(self, row: tuple) -> None:
        self.buffer.append(row)
        if len(self.buffer) >= self.flush_rows:
            self.flush()

    def flush(self) -> None:
        if not self.buffer:
            return
        columns = zip(*self.buffer, strict=True)
        arrays = [pa.array(col, type=typ) for col, typ in zip(columns, self.types, strict=True)]
        self.writer.write_table(pa.Table.from_arrays(arrays, schema=self.schema))
        self.rows += len(self.buffer)
        self.buffer = []

    def close(self) -> None:
        self.flush()
        self.writer.close()


def _pairs(flat: list[Any]) -> list[tuple[Any, Any]]:
    return list(zip(flat[0::2], flat[1::2]))


@dataclass
class _Queue:
    """One queue's decoded fence reply; rows for every table."""

    qid: str
    now: int
    meta: dict[str, str]
    groups: dict[str, dict[str, str]]
    group_order: list[str]
    members: dict[tuple[str, str], dict[str, str]]
    push: list[tuple[str, str]]  # members with a mailbox (a `cap` field), sorted
    raw: list[Any]


def _decode_meta(flat: list[Any]) -> tuple[dict[str, str], dict[str, dict[str, str]], list[str],
                                           dict[tuple[str, str], dict[str, str]]]:
    """Meta hash -> (queue fields, group fields, group order, member fields) per docs/data-model.md."""
    fields: dict[str, str] = {}
    groups: dict[str, dict[str, str]] = {}
    members: dict[tuple[str, str], dict[str, str]] = {}
    text = [x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x) for x in flat]
    for key, value in zip(text[0::2], text[1::2]):
        head = key[:2]
        if head == "g|":
            parts = key.split("|")
            if len(parts) == 3:
                groups.setdefault(parts[1], {})[parts[2]] = value
                continue
        elif head == "m|":
            parts = key.split("|")  # group and member names never hold '|' (keyspace.check_name)
            if len(parts) == 4:
                members.setdefault((parts[1], parts[2]), {})[parts[3]] = value
                continue
        fields[key] = value
    order = [g for g in fields.get("groups", "").split("\n") if g]
    order += sorted(g for g in groups if g not in order)
    for g in order:
        groups.setdefault(g, {})
    for g, _m in members:
        if g not in groups:
            groups[g] = {}
            order.append(g)
    return fields, groups, order, members


def _decode(qid: str, raw: list[Any]) -> _Queue | None:
    now, meta = int(raw[0]), raw[1]
    if not meta:
        return None
    fields, groups, order, members = _decode_meta(meta)
    push = sorted(gm for gm, f in members.items() if "cap" in f)
    return _Queue(qid, now, fields, groups, order, members, push, raw)


class _Writer:
    def __init__(self, out: Path) -> None:
        self.tables = {name: _Table(out / f"{name}.parquet", schema) for name, schema in SCHEMAS.items()}

    def close(self) -> dict[str, int]:
        for t in self.tables.values():
            t.close()
        return {name: t.rows for name, t in self.tables.items()}

    def add(self, q: _Queue, mailboxes: dict[tuple[str, str], int] | None) -> None:
        t = self.tables
        ref = queue_ref(q.qid)
        topic, lmq = ref.topic, ref.lmq
        _, _, co, dl, rd, dly, counts, _depths, oldest, entries, journal = q.raw
        f = q.meta
        seq, first = _int(f.get("seq"), 0), _int(f.get("first"), 1)

        deadlines = {_s(tag): _int(score) for tag, score in _pairs(dl)}
        per_group_co: dict[str, int] = {}
        per_member_co: dict[tuple[str, str], int] = {}
        for tag, rec in _pairs(co):
            tag_s = _s(tag)
            p = _s(rec).split(SEP)
            g, m = p[0], p[1]
            per_group_co[g] = per_group_co.get(g, 0) + 1
            per_member_co[(g, m)] = per_member_co.get((g, m), 0) + 1
            t["checkouts"].add((q.qid, tag_s, g, m, _int(p[2]), _int(p[3]), _int(p[4]), _int(p[5]),
                                deadlines.get(tag_s)))
        per_group_rd: dict[str, int] = {}
        per_group_dly: dict[str, int] = {}
        for member in rd:
            p = _s(member).split(SEP)
            per_group_rd[p[0]] = per_group_rd.get(p[0], 0) + 1
            t["ready"].add((q.qid, p[0], _int(p[1]), _int(p[2]), _int(p[3]), None))
        for member, score in _pairs(dly):
            p = _s(member).split(SEP)
            per_group_dly[p[0]] = per_group_dly.get(p[0], 0) + 1
            t["ready"].add((q.qid, p[0], _int(p[1]), _int(p[2]), _int(p[3]), _int(score)))

        oldest_by_group = {_s(oldest[i]): (_int(oldest[i + 1]), _int(oldest[i + 2])) for i in range(0, len(oldest), 3)}
        for g in q.group_order:
            gfields = q.groups[g]
            cursor = max(_int(gfields.get("cur"), first), first)
            unread = max(0, seq - cursor + 1)
            mem = [m for m in gfields.get("mem", "").split("\n") if m]
            n_members = len(set(mem) | {m for (gg, m) in q.members if gg == g})
            ready = per_group_rd.get(g, 0)
            old_id, old_ms = oldest_by_group.get(g, (None, None))
            t["groups"].add((q.qid, topic, lmq, g, gfields.get("mode"), gfields.get("pol"), gfields.get("onpre"),
                             cursor, _int(gfields.get("ep"), 0), gfields.get("own") or None, n_members, unread,
                             ready, per_group_dly.get(g, 0), per_group_co.get(g, 0), unread + ready, old_id,
                             old_ms, q.now))
            positions = {m: i for i, m in enumerate(mem)}
            for m in mem + sorted(m for (gg, m) in q.members if gg == g and m not in positions):
                mf = q.members.get((g, m), {})
                depth = None
                if "cap" in mf and mailboxes is not None:
                    depth = mailboxes.get((g, m))
                t["members"].add((q.qid, topic, lmq, g, m, positions.get(m), _int(mf.get("n"), 0),
                                  _int(mf.get("max")), _int(mf.get("lock")), "sus" in mf, _int(mf.get("sus")),
                                  mf.get("mk"), _int(mf.get("cap")), _int(mf.get("qos")), "end" in mf, depth,
                                  per_member_co.get((g, m), 0)))

        for i in range(0, len(entries), 3):
            t["messages"].add((q.qid, _int(entries[i]), _int(entries[i + 1]), _int(entries[i + 2])))

        for pos, entry in enumerate(journal):
            p = _s(entry).split("\t")
            p += [""] * (8 - len(p))
            t["journal"].add((q.qid, pos, _int(p[0]), p[1], p[2] or None, p[3] or None, _int(p[4]), p[5] or None,
                              _int(p[6]), "\t".join(p[7:]) or None))

        retained, owned, dead, jlen = (int(x) for x in counts)
        kind = "filter" if ref.owner is not None else "lmq" if lmq is not None else "topic"
        t["queues"].add((q.qid, kind, topic, lmq, ref.owner, seq, first, retained, _int(f.get("tag"), 0),
                         _int(f.get("ct")), _int(f.get("wt")), q.now, len(q.group_order), len(co) // 2, len(rd),
                         len(dly) // 2, dead, owned, len(q.push), _int(f.get("jcap")), jlen, len(journal)))


def _source_of(redis: Any) -> str:
    """Where the client points, without any password."""
    if is_cluster_client(redis):
        nodes = ",".join(f"{n.host}:{n.port}" for n in redis.get_primaries())
        return f"redis-cluster://{nodes}"
    kw = getattr(getattr(redis, "connection_pool", None), "connection_kwargs", {}) or {}
    if "path" in kw:
        return f"unix://{kw['path']}?db={kw.get('db', 0)}"
    scheme = "rediss" if kw.get("ssl") else "redis"
    user = f"{kw['username']}@" if kw.get("username") else ""
    return f"{scheme}://{user}{kw.get('host', 'localhost')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"


async def _scan(redis: Any, node: Any, pattern: str, count: int):
    """Yield batches of queue ids from one master (each at most once)."""
    seen: set[bytes] = set()
    cursor = 0
    while True:
        cursor, keys = await scan_step(redis, node, cursor, pattern, count)
        fresh = []
        for k in keys:
            if k not in seen:
                seen.add(k)
                fresh.append(Keyspace.qid_from_meta_key(_s(k)))
        if fresh:
            yield fresh
        if cursor == 0:
            return


class _Fence:
    """The snapshot fence by EVALSHA, (re)loaded on every master when a server does not know it."""

    def __init__(self, redis: Any) -> None:
        self.redis = redis
        self.source = sources()["snapshot"]
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()

    async def load(self) -> None:
        await self.redis.script_load(self.source)  # on a Cluster: every master

    async def run(self, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
        for attempt in range(3):
            pipe = self.redis.pipeline(transaction=False)
            for keys, args in calls:
                # (not pipe.evalsha: redis-py's Cluster pipeline blocks that name, not the command)
                pipe.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)
            results = await pipe.execute(raise_on_error=False)
            if not any(isinstance(r, NoScriptError) or (isinstance(r, ResponseError) and "NOSCRIPT" in str(r))
                       for r in results) or attempt == 2:
                return results
            await self.load()
        return results  # pragma: no cover


async def take_snapshot(
    redis: Any,
    keyspace: Keyspace,
    out_dir: str | Path,
    progress: Progress | None = None,
    *,
    batch: int = 100,
    log_entries: int = 0,
    journal_entries: int = -1,
    source: str | None = None,
) -> Manifest:
    """Snapshot every queue under ``keyspace`` into ``out_dir``; returns the manifest.

    ``redis`` is a ``redis.asyncio.Redis`` or ``redis.asyncio.RedisCluster``
    (bytes replies, i.e. without decode_responses). ``progress(done, total)``
    is called after each pipeline round (total is None: SCAN does not know it).
    ``log_entries``: per queue, list this many log entries (oldest first) in
    ``messages``; ``journal_entries``: the newest this many journal events per
    queue (-1 = all that Redis keeps).
    """
    if batch < 1:
        raise ValueError("batch must be at least 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stale = out / "manifest.json"
    if stale.exists():
        stale.unlink()  # a half-rewritten directory must not look finished
    started_wall, started = datetime.now(UTC), time.perf_counter()
    fence = _Fence(redis)
    await fence.load()
    writer = _Writer(out)
    nodes = await primaries(redis)
    done = vanished = unsettled = 0
    errors: list[str] = []
    error_count = 0
    first_ms: int | None = None
    last_ms: int | None = None
    args = [log_entries, journal_entries]

    def calls_for(qids: list[str], guess: dict[str, list[tuple[str, str]]]) -> list[tuple[list[str], list[Any]]]:
        calls = []
        for qid in qids:
            k = keyspace.queue_by_id(qid)
            boxes = [k.mailbox(g, m) for g, m in guess.get(qid, [])]
            calls.append((SNAPSHOT.key_list(k, {}, boxes), args))
        return calls

    async def finish(qids: list[str], fetching: asyncio.Task) -> None:
        """Decode one batch (and read again the queues whose push members it did not know)."""
        nonlocal done, vanished, unsettled, error_count, first_ms, last_ms
        guess: dict[str, list[tuple[str, str]]] = {}
        todo, results = qids, await fetching
        for attempt in range(MAILBOX_ATTEMPTS):
            redo = []
            for qid, res in zip(todo, results, strict=True):
                if isinstance(res, Exception):
                    error_count += 1
                    if len(errors) < MAX_ERRORS_LISTED:
                        errors.append(f"{qid}: {type(res).__name__}: {res}")
                    continue
                q = _decode(qid, res)
                if q is None:
                    vanished += 1
                    continue
                asked = guess.get(qid, [])
                if q.push != asked and attempt < MAILBOX_ATTEMPTS - 1:
                    guess[qid] = q.push
                    redo.append(qid)
                    continue
                if q.push != asked:
                    unsettled += 1
                    boxes = None
                else:
                    boxes = dict(zip(asked, (int(d) for d in res[7]), strict=True))
                writer.add(q, boxes)
                done += 1
                first_ms = q.now if first_ms is None else min(first_ms, q.now)
                last_ms = q.now if last_ms is None else max(last_ms, q.now)
            if not redo:
                break
            todo = redo
            results = await fence.run(calls_for(todo, guess))
        if progress:
            progress(done, None)

    async def batches():
        for node in nodes:
            pending: list[str] = []
            async for qids in _scan(redis, node, keyspace.queue_pattern(), 1000):
                pending.extend(qids)
                while len(pending) >= batch:
                    yield pending[:batch]
                    pending = pending[batch:]
            if pending:
                yield pending

    # One batch in flight while the previous one is decoded: Redis runs the fences of the next
    # batch while Python turns the last one into rows.
    in_flight: tuple[list[str], asyncio.Task] | None = None
    try:
        async for qids in batches():
            task = asyncio.create_task(fence.run(calls_for(qids, {})))
            await asyncio.sleep(0)  # let it send its pipeline
            if in_flight is not None:
                await finish(*in_flight)
            in_flight = (qids, task)
        if in_flight is not None:
            await finish(*in_flight)
            in_flight = None
    finally:
        if in_flight is not None and not in_flight[1].done():
            in_flight[1].cancel()
        counts = writer.close()

    elapsed = time.perf_counter() - started
    manifest = Manifest(
        schema_version=SCHEMA_VERSION,
        created=started_wall.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        source=source or _source_of(redis),
        prefix=keyspace.prefix,
        nodes=len(nodes),
        queues=done,
        counts=counts,
        tables={name: f"{name}.parquet" for name in SCHEMAS},
        first_snapshot_ms=first_ms,
        last_snapshot_ms=last_ms,
        duration_s=round(elapsed, 3),
        queues_per_s=round(done / elapsed, 1) if elapsed > 0 else 0.0,
        log_entries=log_entries,
        journal_entries=journal_entries,
        vanished=vanished,
        mailbox_unsettled=unsettled,
        errors=errors,
        error_count=error_count,
    )
    tmp = out / "manifest.json.tmp"
    tmp.write_text(manifest.to_json() + "\n")
    tmp.replace(out / "manifest.json")
    return manifest
