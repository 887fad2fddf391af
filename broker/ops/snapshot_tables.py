"""The snapshot's Parquet tables: their schemas, the manifest, and the rows of one queue.

broker/ops/snapshot.py walks the queues and calls the snapshot fence; this
module turns one fence reply into rows (every record read through
fencemq.model.records, the meta through fencemq.model.meta) and writes them.

Tables (one row per ...):

* ``queues``      queue: id, kind (topic | lmq | filter), topic (a filter
  subscription's filter), lmq, owner (filter subscriptions), log bounds
  (seq = last id, first = first retained id), retained, last tag,
  created/last-write ms, snapshot ms (Redis clock, inside the fence), counts
  (groups, checkouts, ready, delayed, dead letters, owned entries (one per lease: a lease batch is one), push
  members, journal cap / length kept in Redis / rows exported), the state
  digest (what ``--since`` compares), scheduled (published for later, not in
  the log yet), priority (whether it honours PUB … PRIORITY) and, for a
  priority queue, ``held_by_level``: the messages its index holds at each
  level, a list of ten indexed by level (0 first; null for other queues).
* ``groups``      subscription (queue, group): mode, policy, on_preempt,
  cursor (clamped to first), epoch, owner, members, unread = max(0, seq -
  cursor + 1) (a priority queue's: the sum of ``unread_by_level``, what the
  group has not read at each level 0..9 from its level cursors, a list of ten
  indexed by level; null for other queues), ready (returned, waiting for
  redelivery), delayed, checkouts,
  backlog = unread + ready (as ``fencemq status``), the oldest pending
  retained message (id, publish ms); churn, kept in meta whether or not the
  queue keeps a journal (lua/lib/lite.lua ``count_churn``): preemptions,
  evictions, fenced pulls, the clients around them (``churn_clients``: at
  most 8 named; ``churn_clients_capped`` when more may have been), first and
  last churn ms.
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
  (format: records.JournalLine, a batch entry expanded by records.journal_events;
  empty fields are null).
* ``unchanged``   queue an incremental snapshot (``--since``) found in the
  state its base snapshot read: snapshot ms, digest. Its rows are in the
  base (``manifest.base``, itself maybe incremental: a chain).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from fencemq.fences.lite import churn_of
from fencemq.ops.journal_buckets import DEFAULT_BUCKETS, bucket_file, bucket_of
from fencemq.model import meta
from fencemq.model.keys import queue_ref
from fencemq.model.records import ReadyEntry, checkout_items, journal_events
from fencemq.model.values import integer
from fencemq.model.values import text as _s

SCHEMA_VERSION = 3  # 3: queues' scheduled, priority, held_by_level; groups' unread_by_level (a digest now
# covers the scheduled count too: an incremental snapshot builds on a version-3 one only)
# 2: groups' churn columns, queues' digest, the unchanged table, manifest.base
LEVELS = 10  # a priority queue's levels 0..9 (fencemq.fences.priority.LEVELS)

S, I64, I32, B = pa.string(), pa.int64(), pa.int32(), pa.bool_()
BY_LEVEL = pa.list_(I64)  # ten counts, indexed by priority level (0 first)

SCHEMAS: dict[str, pa.Schema] = {
    "queues": pa.schema([
        ("queue", S), ("kind", S), ("topic", S), ("lmq", S), ("owner", S), ("seq", I64), ("first", I64),
        ("retained", I64),
        ("tag", I64), ("created_ms", I64), ("last_write_ms", I64), ("snapshot_ms", I64), ("groups", I32),
        ("checkouts", I64), ("ready", I64), ("delayed", I64), ("dead_letters", I64), ("owned", I64),
        ("push_members", I32), ("journal_cap", I64), ("journal_length", I64), ("journal_rows", I64), ("digest", S),
        ("scheduled", I64), ("priority", B), ("held_by_level", BY_LEVEL),
    ]),
    "groups": pa.schema([
        ("queue", S), ("topic", S), ("lmq", S), ("group", S), ("mode", S), ("policy", S), ("on_preempt", S),
        ("cursor", I64), ("epoch", I64), ("owner", S), ("members", I32), ("unread", I64), ("ready", I64),
        ("delayed", I64), ("checkouts", I64), ("backlog", I64), ("oldest_pending_id", I64),
        ("oldest_pending_ms", I64), ("snapshot_ms", I64), ("preemptions", I64), ("evictions", I64),
        ("fenced_pulls", I64), ("churn_clients", pa.list_(S)), ("churn_clients_capped", B),
        ("first_churn_ms", I64), ("last_churn_ms", I64), ("unread_by_level", BY_LEVEL),
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
    "unchanged": pa.schema([("queue", S), ("snapshot_ms", I64), ("digest", S)]),
}


def _int(value: Any, default: int | None = None) -> int | None:
    return integer(value, default)


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
    base: str | None = None  # an incremental snapshot's base directory (relative to this one when inside ..)
    unchanged: int = 0  # queues found as the base read them (rows in the base)
    # the journal is a directory of this many files bucketed by queue as Spark hashes it
    # (broker/ops/journal_buckets.py); 0: one file (snapshots before the buckets)
    journal_buckets: int = 0

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


class _BucketedTable:
    """A table as a directory of ``buckets`` files, each row in its queue's bucket (the first column)."""

    def __init__(self, path: Path, schema: pa.Schema, buckets: int) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.buckets = buckets
        self.files = [_Table(path / bucket_file(b), schema) for b in range(buckets)]
        self._queue: str | None = None  # a queue's rows come together: its bucket is hashed once
        self._bucket = 0

    @property
    def rows(self) -> int:
        return sum(f.rows for f in self.files)

    def add(self, row: tuple) -> None:
        if row[0] != self._queue:
            self._queue, self._bucket = row[0], bucket_of(row[0], self.buckets)
        self.files[self._bucket].add(row)

    def close(self) -> None:
        for f in self.files:
            f.close()


def _pairs(flat: list[Any]) -> list[tuple[Any, Any]]:
    return list(zip(flat[0::2], flat[1::2]))


@dataclass
class QueueReply:
    """One queue's snapshot fence reply, its meta decoded; rows for every table."""

    qid: str
    now: int
    state: meta.Meta
    group_order: list[str]
    push: list[tuple[str, str]]  # members with a mailbox (a capacity field), sorted
    raw: list[Any]

    @property
    def digest(self) -> str:
        return _s(self.raw[11])


def decode_reply(qid: str, raw: list[Any]) -> QueueReply | None:
    """None when the queue vanished before its fence call (an empty meta)."""
    now, raw_meta = int(raw[0]), raw[1]
    if not raw_meta:
        return None
    state = meta.decode(raw_meta)
    order = state.group_names
    order += sorted(g for g in state.groups if g not in order)
    for g in order:
        state.groups.setdefault(g, {})
    for g, _m in state.members:
        if g not in state.groups:
            state.groups[g] = {}
            order.append(g)
    push = sorted(gm for gm, f in state.members.items() if meta.CAPACITY in f)
    return QueueReply(qid, now, state, order, push, raw)


class TableWriter:
    """One Parquet file per table under ``out`` (the journal: a directory of ``journal_buckets`` files);
    ``add`` a queue's rows to all of them."""

    def __init__(self, out: Path, journal_events: int = -1, journal_buckets: int = DEFAULT_BUCKETS) -> None:
        if journal_buckets < 1:
            raise ValueError("journal_buckets must be at least 1")
        self.tables: dict[str, _Table | _BucketedTable] = {
            name: _BucketedTable(out / f"{name}.parquet", schema, journal_buckets) if name == "journal"
            else _Table(out / f"{name}.parquet", schema) for name, schema in SCHEMAS.items()}
        self.journal_events = journal_events  # the newest this many events per queue (-1 = all)
        self.journal_buckets = journal_buckets

    def close(self) -> dict[str, int]:
        for t in self.tables.values():
            t.close()
        return {name: t.rows for name, t in self.tables.items()}

    def unchanged(self, qid: str, now: int, digest: str) -> None:
        self.tables["unchanged"].add((qid, now, digest))

    def add(self, q: QueueReply, mailboxes: dict[tuple[str, str], int] | None) -> None:
        t = self.tables
        ref = queue_ref(q.qid)
        topic, lmq = ref.topic, ref.lmq
        _, _, co, dl, rd, dly, counts, _depths, oldest, entries, journal, digest, levels = q.raw
        f = q.state.fields
        seq, first = _int(f.get(meta.SEQ), 0), _int(f.get(meta.FIRST), 1)

        deadlines = {_s(tag): _int(score) for tag, score in _pairs(dl)}
        per_group_co: Counter[str] = Counter()
        per_member_co: Counter[tuple[str, str]] = Counter()
        checkouts = checkout_items(_pairs(co))  # a lease batch's count left out: its checkouts are the rows
        for tag_s, c in checkouts:
            per_group_co[c.group] += 1
            per_member_co[(c.group, c.member)] += 1
            t["checkouts"].add((q.qid, tag_s, c.group, c.member, c.id, c.epoch, c.acquisitions, c.failures,
                                deadlines.get(c.lease(tag_s))))
        per_group_rd: Counter[str] = Counter()
        per_group_dly: Counter[str] = Counter()
        for entry, due, per_group in [(e, None, per_group_rd) for e in rd] + [
                (e, _int(score), per_group_dly) for e, score in _pairs(dly)]:
            r = ReadyEntry.decode(entry)
            per_group[r.group] += 1
            t["ready"].add((q.qid, r.group, r.id, r.acquisitions, r.failures, due))

        # a priority queue's counts per level (lua/snapshot.lua): held, then each group of meta's list
        levels = [int(n) for n in levels]
        held_by_level = levels[:LEVELS] if levels else None
        unread_by_level = {g: levels[LEVELS * (i + 1) : LEVELS * (i + 2)]
                           for i, g in enumerate(q.state.group_names)} if levels else {}
        oldest_by_group = {_s(oldest[i]): (_int(oldest[i + 1]), _int(oldest[i + 2])) for i in range(0, len(oldest), 3)}
        for g in q.group_order:
            gfields = q.state.groups[g]
            cursor = max(_int(gfields.get(meta.CURSOR), first), first)
            by_level = unread_by_level.get(g)
            # a priority queue's cursor is a low-water mark: its unread is what each level's cursor has ahead
            unread = sum(by_level) if by_level is not None else meta.unread(f, cursor)
            mem = q.state.member_names(g)
            n_members = len(set(mem) | {m for (gg, m) in q.state.members if gg == g})
            ready = per_group_rd[g]
            old_id, old_ms = oldest_by_group.get(g, (None, None))
            ch = churn_of(gfields)
            t["groups"].add((q.qid, topic, lmq, g, gfields.get(meta.MODE), gfields.get(meta.POLICY),
                             gfields.get(meta.ON_PREEMPT), cursor, _int(gfields.get(meta.EPOCH), 0),
                             gfields.get(meta.OWNER) or None, n_members, unread, ready, per_group_dly[g],
                             per_group_co[g], unread + ready, old_id, old_ms, q.now, ch.preemptions,
                             ch.evictions, ch.fenced_pulls, list(ch.clients), ch.clients_capped, ch.first_ms,
                             ch.last_ms, by_level))
            positions = {m: i for i, m in enumerate(mem)}
            for m in mem + sorted(m for (gg, m) in q.state.members if gg == g and m not in positions):
                mf = q.state.members.get((g, m), {})
                depth = None
                if meta.CAPACITY in mf and mailboxes is not None:
                    depth = mailboxes.get((g, m))
                t["members"].add((q.qid, topic, lmq, g, m, positions.get(m), _int(mf.get(meta.DELIVERED), 0),
                                  _int(mf.get(meta.MAX)), _int(mf.get(meta.LOCK)), meta.SUSPECTED_SINCE in mf,
                                  _int(mf.get(meta.SUSPECTED_SINCE)), mf.get(meta.MARKER),
                                  _int(mf.get(meta.CAPACITY)), _int(mf.get(meta.QOS)), meta.ENDED in mf, depth,
                                  per_member_co[(g, m)]))

        for i in range(0, len(entries), 3):
            t["messages"].add((q.qid, _int(entries[i]), _int(entries[i + 1]), _int(entries[i + 2])))

        # A batch entry holds the events of one fence call: the fence returned the newest
        # entries, which hold at least as many events as asked for.
        events = [e for raw in journal for e in journal_events(raw)]
        if self.journal_events >= 0:
            events = events[-self.journal_events:] if self.journal_events else []
        for pos, e in enumerate(events):
            t["journal"].add((q.qid, pos, e.ms, e.event, e.group, e.member, e.id, e.tag, e.epoch, e.extra))

        retained, owned, dead, jlen, scheduled = (int(x) for x in counts)
        kind = "filter" if ref.owner is not None else "lmq" if lmq is not None else "topic"
        t["queues"].add((q.qid, kind, topic, lmq, ref.owner, seq, first, retained, _int(f.get(meta.TAG), 0),
                         _int(f.get(meta.CREATED)), _int(f.get(meta.LAST_WRITE)), q.now, len(q.group_order),
                         len(checkouts), len(rd), len(dly) // 2, dead, owned, len(q.push),
                         _int(f.get(meta.JOURNAL_CAP)), jlen, len(events), _s(digest), scheduled,
                         f.get(meta.PRIORITY) == "1", held_by_level))
