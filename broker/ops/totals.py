"""The broker's totals: what the fences count as they write (lua/lib/totals.lua), read back.

A total is a read of one hash (a single server) or, on a Cluster, of the hash of
each slot in use (summed): the slots listed in the registry ``totals_slots``, to
which a worker adds a slot before its first fence call that writes the slot's
totals (``Fences.register_totals``) — 10 queues are a read of at most 10 slots,
not of 16,384. Never a scan of the queues and never a sample:
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

import math
from collections import defaultdict
from typing import Any

import anyio
from redis.exceptions import RedisClusterException, RedisError

from fencemq.fences import at_rest
from fencemq.fences.priority import level_counts
from fencemq.model import meta
from fencemq.model.keys import Keyspace, queue_ref
from fencemq.model.records import checkouts_in
from fencemq.model.slots import key_slot
from fencemq.model.values import text
from fencemq.ops import listing
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
    # redis-py's Cluster pipeline, in chunks small enough (~5 ms of redis-py's work each) that the fence
    # calls of the worker's clients go on between them (in chunks of 3,200 a RENEW waited 100-800 ms
    # behind them). ~20 us of redis-py's work per read: what _slot_reads saves.
    out: list[Any] = []
    for start in range(0, len(calls), PIPELINE_CHUNK):
        async with redis.pipeline(transaction=False) as pipe:
            for name, *args in calls[start : start + PIPELINE_CHUNK]:
                pipe.execute_command(name.upper(), *(x for a in args for x in (a if isinstance(a, list) else [a])))
            out += await pipe.execute()
    return out


SLOT_READ_CHUNK = 500  # reads sent to a master at a time by _slot_reads (~2 ms of this process's work)
SLOT_READ_TIMEOUT_S = 10.0  # a chunk not answered in this time: read again through redis-py's pipeline


async def _slot_reads(redis: Any, calls: list[tuple[Any, ...]], *, fast: bool = True) -> list[Any]:
    """One read per Cluster slot (``(command, key, *args)``, each key a slot's totals or backlogs), the
    replies in order, as Redis sends them (a ZRANGE's WITHSCORES flat in RESP2: see :func:`_pairs`). A Cluster's totals are a read of each slot in
    use, made in a worker's own event loop (the health watcher, the metrics sampler): each master's
    reads are encoded here and sent on one of its connections of the client's pool, a chunk at a time
    (the fence calls of the worker's clients go on between chunks), their replies read raw — ~3 us of
    this process's work a read where redis-py's Cluster pipeline takes ~20. Any error (a slot moved, a
    connection lost) and they are all read again through redis-py's pipeline (``fast=False``: only
    that), which follows the Cluster's redirections."""
    if not fast or not calls:
        return await _pipelined(redis, calls)
    try:
        return await _raw_slot_reads(redis, calls)
    except (RedisError, RedisClusterException, OSError, TimeoutError):
        return await _pipelined(redis, calls)


_SLOT_OF: dict[str, int] = {}  # a slot's totals or backlogs key -> the slot (32,768 keys a keyspace)


async def _raw_slot_reads(redis: Any, calls: list[tuple[Any, ...]]) -> list[Any]:
    await primaries(redis)  # (a fresh client knows no node before its first command)
    encoder = redis.get_encoder()
    by_node: dict[str, tuple[Any, list[int]]] = {}
    for i, call in enumerate(calls):
        slot = _SLOT_OF.get(call[1])
        if slot is None:
            slot = _SLOT_OF[call[1]] = key_slot(call[1])
        node = redis.nodes_manager.get_node_from_slot(slot)
        by_node.setdefault(node.name, (node, []))[1].append(i)
    around: dict[tuple[Any, ...], tuple[bytes, bytes]] = {}  # a command's bytes before and after its key

    def packed(i: int) -> bytes:
        name, key, *args = calls[i]
        shape = (name, *(id(a) if isinstance(a, list) else a for a in args))  # (the same lists each call)
        if shape not in around:
            flat = [encoder.encode(x) for a in args for x in (a if isinstance(a, list) else [a])]
            command = name.upper().encode()
            around[shape] = (b"*%d\r\n$%d\r\n%s\r\n" % (len(flat) + 2, len(command), command),
                             b"".join(b"$%d\r\n%s\r\n" % (len(x), x) for x in flat))
        before, after = around[shape]
        k = key.encode() if isinstance(key, str) else encoder.encode(key)
        return b"%s$%d\r\n%s\r\n%s" % (before, len(k), k, after)

    out: list[Any] = [None] * len(calls)
    for node, indices in by_node.values():
        conn = node.acquire_connection()
        try:
            for start in range(0, len(indices), SLOT_READ_CHUNK):
                # a chunk's work (encoding, replies) between two waits for Redis: ~2 ms of this process's
                chunk = indices[start : start + SLOT_READ_CHUNK]
                with anyio.fail_after(SLOT_READ_TIMEOUT_S):  # one deadline a chunk, not one a reply
                    await conn.send_packed_command(b"".join(packed(i) for i in chunk), check_health=False)
                    for i in chunk:
                        out[i] = await conn.read_response(timeout=math.inf)
        except BaseException:
            await conn.disconnect()  # replies may be left unread on it
            raise
        finally:
            node.release(conn)
    return out


async def _yielding(items: list[Any], every: int = SLOT_READ_CHUNK) -> Any:
    """The items, with a pass of the event loop every ``every`` of them (a sum over 16,384 slots'
    replies is ~15 ms of work: the worker's clients are served in between)."""
    for start in range(0, len(items), every):
        if start:
            await anyio.sleep(0)
        for item in items[start : start + every]:
            yield item


async def slots_in_use(redis: Any, keys: Keyspace) -> list[int]:
    """The Cluster slots whose totals a fence may have written (the registry ``totals_slots``), in order.
    A slot listed whose totals are empty costs a read of nothing; a slot written is always listed."""
    return sorted(int(s) for s in await redis.smembers(keys.totals_slots))


async def _slot_keys(redis: Any, keys: Keyspace, name: str, every_slot: bool) -> list[str]:
    return keys.slot_keys(name, None if every_slot else await slots_in_use(redis, keys))


def _pairs(reply: Any) -> list[Any]:
    """A ZRANGE … WITHSCORES reply as (member, score) pairs, whether flat (RESP2) or paired already."""
    if reply and not isinstance(reply[0], (list, tuple)):
        return list(zip(reply[::2], reply[1::2], strict=True))
    return list(reply or [])


async def read_totals(redis: Any, keys: Keyspace, *, every_slot: bool = False, fast: bool = True) -> dict[str, int]:
    """The broker-wide figures, events and counts (and ``retained``). On a Cluster, ``every_slot``: its
    16,384 slots read, not only those in use; ``fast=False``: read through redis-py's pipeline
    (_slot_reads): the slow paths the registry and the fast read are held to, in tests."""
    if is_cluster_client(redis):
        slot_keys = await _slot_keys(redis, keys, "totals", every_slot)
        fields = list(BROKER_FIELDS)
        replies = await _slot_reads(redis, [("hmget", k, fields) for k in slot_keys], fast=fast)
        totals = dict.fromkeys(BROKER_FIELDS, 0)
        async for values in _yielding(replies):
            for name, v in zip(BROKER_FIELDS, values, strict=True):
                if v is not None:
                    totals[name] += _int(v)
    else:
        values = await redis.hmget(keys.totals, list(BROKER_FIELDS))
        totals = {name: _int(v) for name, v in zip(BROKER_FIELDS, values, strict=True)}
    totals["retained"] = _int(await redis.hlen(keys.retained))
    totals["queues"] = totals["queues:t"] + totals["queues:l"] + totals["queues:f"]
    return totals


class SharedReading:
    """One reading of the broker-wide totals and the largest backlogs that a worker's readers share (the
    health watcher's alarms, the metrics sampler): read again only once older than ``max_age_ms``
    (``totals_read_ms``), concurrent readers waiting for the one read under way, so a worker reads them
    at most once per interval however many read them — on a Cluster a reading is a read per slot in
    use. ``fresh=True`` reads them now (the history's points, each the totals at its own time)."""

    def __init__(self, redis: Any, keys: Keyspace, max_age_ms: int, *, largest: int = 20) -> None:
        self.redis, self.keys, self.max_age_s, self.largest = redis, keys, max_age_ms / 1000, largest
        self._lock = anyio.Lock()
        self._at: float | None = None
        self._value: tuple[dict[str, int], list[tuple[str, int]]] = ({}, [])
        self.reads = 0  # readings made (for tests and benchmarks)

    async def read(self, *, fresh: bool = False) -> tuple[dict[str, int], list[tuple[str, int]]]:
        """(read_totals, largest_backlogs) no older than max_age_ms (a copy: the caller may change it)."""
        asked = anyio.current_time()
        async with self._lock:
            # a read that began after this call (another caller's, while this one waited) is fresh enough
            if self._at is None or (self._at < asked if fresh else asked - self._at > self.max_age_s):
                started = anyio.current_time()
                self._value = (await read_totals(self.redis, self.keys),
                               await largest_backlogs(self.redis, self.keys, self.largest))
                self._at = started
                self.reads += 1
            return dict(self._value[0]), list(self._value[1])


async def entry_figures(redis: Any, keys: Keyspace, entries: list[str], *, every_slot: bool = False,
                        fast: bool = True) -> dict[str, dict[str, int]]:
    """Each entry's figures: ready (backlog), out, delayed, dead, published, lmqs."""
    if not entries:
        return {}
    fields = [f"{f}|{e}" for e in entries for f in ENTRY_FIELDS]
    if is_cluster_client(redis):
        calls: list[tuple[Any, ...]] = []
        slots = None if every_slot else await slots_in_use(redis, keys)
        for t, b in zip(keys.slot_keys("totals", slots), keys.slot_keys("backlogs", slots), strict=True):
            calls += [("hmget", t, fields), ("zmscore", b, entries)]
        replies = await _slot_reads(redis, calls, fast=fast)
        held = [0] * len(fields)
        ready = [0] * len(entries)
        async for values, scores in _yielding(list(zip(replies[::2], replies[1::2], strict=True))):
            for i, v in enumerate(values):
                if v is not None:
                    held[i] += _int(v)
            for i, sc in enumerate(scores or ()):
                if sc is not None:
                    ready[i] += _int(sc)
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


async def largest_backlogs(redis: Any, keys: Keyspace, limit: int = 20, *, every_slot: bool = False,
                           fast: bool = True) -> list[tuple[str, int]]:
    """The entries with the most messages ready, the largest first: (entry, ready)."""
    if is_cluster_client(redis):
        sums: dict[str, int] = defaultdict(int)
        slot_keys = await _slot_keys(redis, keys, "backlogs", every_slot)
        async for reply in _yielding(await _slot_reads(redis, [("zrange", k, 0, -1, "WITHSCORES") for k in slot_keys],
                                                       fast=fast)):
            for e, score in _pairs(reply):
                sums[text(e)] += int(float(score))
        return sorted(sums.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]
    return [(text(e), int(s)) for e, s in await redis.zrevrange(keys.backlogs, 0, limit - 1, withscores=True)]


async def full_count(redis: Any, keys: Keyspace) -> dict[str, Any]:
    """The figures the totals stand for, counted from every queue's keys (a SCAN of them all):
    ``{"totals": {...}, "entries": {entry: {...}}}``, events aside (they are not held anywhere else)."""
    totals: dict[str, int] = dict.fromkeys(FIGURES + QUEUES, 0)
    entries: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(FIGURES + ("lmqs",), 0))
    qids: list[str] = []
    for node in await primaries(redis):
        cursor = 0
        while True:
            cursor, batch = await scan_step(redis, node, cursor, keys.queue_pattern(), 1000)
            qids += [Keyspace.qid_from_meta_key(text(k)) for k in batch]
            if cursor == 0:
                break
    async for rested in listing.rested_qids(redis, keys):  # the lmqs at rest, which have no meta key
        qids += rested
    qids = list(dict.fromkeys(qids))  # once each: SCAN may repeat a key, an lmq may have come to rest meanwhile
    for start in range(0, len(qids), PIPELINE_CHUNK):
        chunk = qids[start : start + PIPELINE_CHUNK]
        async with redis.pipeline(transaction=False) as pipe:
            for qid in chunk:
                k = keys.queue_by_id(qid)
                at_rest.pipe_meta(pipe, k)
                pipe.pttl(k.meta)
                pipe.hlen(k.checkouts)
                pipe.zrange(k.deadlines, 0, -1)
                pipe.zrange(k.ready, 0, -1)
                pipe.zcard(k.delayed)
                pipe.llen(k.dead)
                pipe.zcard(k.scheduled)
            replies = await pipe.execute()
        for i, qid in enumerate(chunk):
            raw, packed, ttl, size, leases, ready, delayed, dead, scheduled = replies[9 * i : 9 * i + 9]
            raw = at_rest.queue_meta((raw, packed))
            if not raw:  # gone since the SCAN found it (an lmq reclaimed meanwhile): nothing to count
                continue
            ttl = at_rest.no_key_ttl(ttl, bool(raw))
            out = checkouts_in(int(size), leases)  # each lease batch's count left out
            e = entry_of(qid)
            fields, groups = parse_meta(raw)
            first = _int(fields.get(meta.FIRST) or 1)
            unread = sum(meta.unread(fields, _int(g.get(meta.CURSOR) or first)) for g in groups.values())
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


async def unlisted_slots(redis: Any, keys: Keyspace) -> list[int]:
    """The Cluster slots holding a totals or backlogs key that the registry does not list (a SCAN of
    every master, for tests): always none, or a total would miss them."""
    if not is_cluster_client(redis):
        return []
    found: set[int] = set()
    for name in ("totals", "backlogs"):
        prefix, _, suffix = getattr(keys, name).rpartition(":")
        for node in await primaries(redis):
            cursor = 0
            while True:
                cursor, batch = await redis.scan(cursor, match=f"{prefix}:{{????}}:{suffix}", count=1000,
                                                 target_nodes=node)
                if isinstance(cursor, dict):  # the Cluster client answers {node name: cursor}
                    cursor = next(iter(cursor.values()))
                cursor = int(cursor)
                found |= {key_slot(text(k)) for k in batch}
                if cursor == 0:
                    break
    return sorted(found - set(await slots_in_use(redis, keys)))


async def counted_entries(redis: Any, keys: Keyspace, entries: list[str], *, every_slot: bool = False,
                          fast: bool = True) -> dict[str, dict[str, int]]:
    """:func:`entry_figures` without ``published`` and ``expired`` and zero entries left out: comparable with full_count."""
    got = await entry_figures(redis, keys, entries, every_slot=every_slot, fast=fast)
    out = {}
    for e, f in got.items():
        f = {k: v for k, v in f.items() if k not in ("published", "expired")}  # events, not figures
        if any(f.values()):
            out[e] = f
    return out
