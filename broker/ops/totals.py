"""The broker's totals: what the fences count as they write (lua/lib/totals.lua), read back.

A total is a read of one hash (a single server) or of each Cluster slot's
(16,384 of them, summed), never a scan of the queues and never a sample:
broker-wide messages ready, checked out, delayed and dead-lettered, the
events since the broker's Redis was new (published, delivered, redelivered,
acknowledged, NACKed, dead-lettered, lease timeouts), how many queues of each
kind and consumers there are; and the same per *entry* (a plain topic, a lite
topic with all its lmqs, a filter subscription's queue), the entries ranked
by their backlog in one sorted set. Retained messages are the length of
their hash.

:func:`full_count` is the definition the counters are held to: the same
figures counted from every queue's keys (a SCAN of them all, for tests and
for ``fencemq totals --check``), never what a page reads.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from fencemq.fences.priority import level_counts
from fencemq.model import meta
from fencemq.model.keys import Keyspace, queue_ref
from fencemq.model.values import text
from fencemq.ops.operations import PIPELINE_CHUNK, is_cluster_client, parse_meta, primaries, scan_step

FIGURES = ("ready", "out", "delayed", "dead", "scheduled")  # held: they go up and down
EVENTS = ("published", "delivered", "redelivered", "acked", "nacked", "dead_lettered", "timeouts", "expired")
QUEUES = ("queues:t", "queues:l", "queues:f", "consumers", "suspected", "fenced")
BROKER_FIELDS = FIGURES + EVENTS + QUEUES
ENTRY_FIELDS = ("out", "delayed", "dead", "scheduled", "published", "expired", "lmqs")  # '<field>|<entry>' in the hash


def entry_of(qid: str) -> str:
    """The entry a queue counts under: its id, or ``l:<topic>`` for an lmq."""
    if qid.startswith("l:"):
        return "l:" + qid[2:].split(":", 1)[0]
    return qid


def entry_name(entry: str) -> tuple[str, str]:
    """(what the overview calls it, its kind): ``orders`` plain, ``chat`` lite, ``sensors/+ ($share/g1)`` filter."""
    kind = {"t": "plain", "l": "lite", "f": "filter"}.get(entry[:1], "?")
    if kind == "lite":
        return queue_ref(f"{entry}:x").topic, kind
    ref = queue_ref(entry)
    return (f"{ref.topic} ({ref.owner})" if ref.owner else ref.topic), kind


def _int(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


async def _pipelined(redis: Any, calls: list[tuple[Any, ...]]) -> list[Any]:
    # A Cluster's totals are 16,384 reads, made in a worker's own event loop (the health watcher, the
    # metrics sampler): in chunks small enough (~5 ms of redis-py's work each) that the fence calls of
    # the worker's clients go on between them. In chunks of 3,200 a RENEW waited 100-800 ms behind them.
    out: list[Any] = []
    for start in range(0, len(calls), PIPELINE_CHUNK):
        async with redis.pipeline(transaction=False) as pipe:
            for name, *args in calls[start : start + PIPELINE_CHUNK]:
                getattr(pipe, name)(*args)
            out += await pipe.execute()
    return out


async def read_totals(redis: Any, keys: Keyspace) -> dict[str, int]:
    """The broker-wide figures, events and counts (and ``retained``)."""
    if is_cluster_client(redis):
        replies = await _pipelined(redis, [("hmget", k, list(BROKER_FIELDS)) for k in keys.slot_keys("totals")])
        totals = dict.fromkeys(BROKER_FIELDS, 0)
        for values in replies:
            for name, v in zip(BROKER_FIELDS, values, strict=True):
                totals[name] += _int(v)
    else:
        values = await redis.hmget(keys.totals, list(BROKER_FIELDS))
        totals = {name: _int(v) for name, v in zip(BROKER_FIELDS, values, strict=True)}
    totals["retained"] = _int(await redis.hlen(keys.retained))
    totals["queues"] = totals["queues:t"] + totals["queues:l"] + totals["queues:f"]
    return totals


async def entry_figures(redis: Any, keys: Keyspace, entries: list[str]) -> dict[str, dict[str, int]]:
    """Each entry's figures: ready (backlog), out, delayed, dead, published, lmqs."""
    if not entries:
        return {}
    fields = [f"{f}|{e}" for e in entries for f in ENTRY_FIELDS]
    if is_cluster_client(redis):
        calls: list[tuple[Any, ...]] = []
        for t, b in zip(keys.slot_keys("totals"), keys.slot_keys("backlogs"), strict=True):
            calls += [("hmget", t, fields), ("zmscore", b, entries)]
        replies = await _pipelined(redis, calls)
        held = [0] * len(fields)
        ready = [0] * len(entries)
        for values, scores in zip(replies[::2], replies[1::2], strict=True):
            held = [a + _int(v) for a, v in zip(held, values, strict=True)]
            ready = [a + _int(s) for a, s in zip(ready, scores or [None] * len(entries), strict=True)]
    else:
        async with redis.pipeline(transaction=False) as pipe:
            pipe.hmget(keys.totals, fields)
            pipe.zmscore(keys.backlogs, entries)
            values, scores = await pipe.execute()
        held = [_int(v) for v in values]
        ready = [_int(s) for s in scores]
    out = {}
    n = len(ENTRY_FIELDS)
    for i, e in enumerate(entries):
        out[e] = {"ready": ready[i], **{f: held[i * n + j] for j, f in enumerate(ENTRY_FIELDS)}}
    return out


async def published_entries(redis: Any, keys: Keyspace, most: int = 50_000) -> dict[str, int] | None:
    """Every entry's messages published (``published|<entry>``), read by HSCAN of at most ``most`` fields of
    the totals (None past that, and on a Cluster: only the entries shown then have a rate)."""
    if is_cluster_client(redis):
        return None
    out: dict[str, int] = {}
    cursor, seen = 0, 0
    while True:
        cursor, found = await redis.hscan(keys.totals, cursor, match="published|*", count=1000)
        seen += 1000
        for k, v in found.items():
            out[text(k).partition("|")[2]] = _int(v)
        if int(cursor) == 0:
            return out
        if seen >= most:
            return None


async def largest_backlogs(redis: Any, keys: Keyspace, limit: int = 20) -> list[tuple[str, int]]:
    """The entries with the most messages ready, the largest first: (entry, ready)."""
    if is_cluster_client(redis):
        sums: dict[str, int] = defaultdict(int)
        for pairs in await _pipelined(redis, [("zrange", k, 0, -1, False, True) for k in keys.slot_keys("backlogs")]):
            for e, score in pairs:
                sums[text(e)] += int(score)
        return sorted(sums.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]
    return [(text(e), int(s)) for e, s in await redis.zrevrange(keys.backlogs, 0, limit - 1, withscores=True)]


async def full_count(redis: Any, keys: Keyspace) -> dict[str, Any]:
    """The figures the totals stand for, counted from every queue's keys (a SCAN of them all):
    ``{"totals": {...}, "entries": {entry: {...}}}``, events aside (they are not held anywhere else)."""
    totals: dict[str, int] = dict.fromkeys(FIGURES + QUEUES, 0)
    entries: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(FIGURES + ("lmqs",), 0))
    metas: list[str] = []
    for node in await primaries(redis):
        cursor = 0
        while True:
            cursor, batch = await scan_step(redis, node, cursor, keys.queue_pattern(), 1000)
            metas += [text(k) for k in batch]
            if cursor == 0:
                break
    for start in range(0, len(metas), PIPELINE_CHUNK):
        chunk = metas[start : start + PIPELINE_CHUNK]
        async with redis.pipeline(transaction=False) as pipe:
            for key in chunk:
                k = keys.queue_by_id(Keyspace.qid_from_meta_key(key))
                pipe.hgetall(k.meta)
                pipe.pttl(k.meta)
                pipe.hlen(k.checkouts)
                pipe.zrange(k.ready, 0, -1)
                pipe.zcard(k.delayed)
                pipe.llen(k.dead)
                pipe.zcard(k.scheduled)
            replies = await pipe.execute()
        for i, key in enumerate(chunk):
            raw, ttl, out, ready, delayed, dead, scheduled = replies[7 * i : 7 * i + 7]
            qid = Keyspace.qid_from_meta_key(key)
            e = entry_of(qid)
            fields, groups = parse_meta(raw)
            seq, first = _int(fields.get(meta.SEQ)), _int(fields.get(meta.FIRST) or 1)
            unread = sum(seq + 1 - max(_int(g.get(meta.CURSOR) or first), first) for g in groups.values())
            if fields.get(meta.PRIORITY) in ("1", b"1"):  # a priority queue: what each group has not read by level
                counts = await level_counts(redis, keys.queue_by_id(qid))
                unread = sum(sum(by_level.values()) for by_level in (counts or {}).get("unread", {}).values())
            figures = {"ready": unread + len(ready), "out": int(out), "delayed": int(delayed), "dead": int(dead),
                       "scheduled": int(scheduled)}
            for name, n in figures.items():
                totals[name] += n
                entries[e][name] += n
            members = [m for g in groups.values() for m in g["members"].values() if meta.DELIVERED in m]
            totals["consumers"] += len(members)
            totals["suspected"] += sum(1 for m in members if meta.SUSPECTED_SINCE in m)
            totals["fenced"] += sum(1 for m in members if meta.MARKER in m)
            if int(ttl) < 0:  # an lmq set to be reclaimed counts as gone
                totals[f"queues:{qid[0]}"] += 1
                if qid.startswith("l:"):
                    entries[e]["lmqs"] += 1
    totals["retained"] = _int(await redis.hlen(keys.retained))
    totals["queues"] = totals["queues:t"] + totals["queues:l"] + totals["queues:f"]
    return {"totals": totals, "entries": {e: f for e, f in entries.items() if any(f.values())}}


async def counted_entries(redis: Any, keys: Keyspace, entries: list[str]) -> dict[str, dict[str, int]]:
    """:func:`entry_figures` without ``published`` and ``expired`` and zero entries left out: comparable with full_count."""
    got = await entry_figures(redis, keys, entries)
    out = {}
    for e, f in got.items():
        f = {k: v for k, v in f.items() if k not in ("published", "expired")}  # events, not figures
        if any(f.values()):
            out[e] = f
    return out
