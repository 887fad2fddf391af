"""Operator reads: list queues, and the helpers every operator read shares.

The Redis side of the operator CLI (the commands cli/ops.py registers only
present what these return); one queue, group, member or session in depth is
broker/ops/inspection.py. Every function is async, takes a ``redis.asyncio.Redis`` or
``redis.asyncio.RedisCluster`` (bytes replies: no ``decode_responses``) and
a :class:`~fencemq.model.keys.Keyspace`, prints nothing and returns plain data
(dicts and lists of JSON-able values).

Reads are pipelined, not atomic (like ``fencemq status``): on a busy broker
two figures of one queue may be a few milliseconds apart. The writes (evict,
sweep, seek, purge, dead letters) and the live figures of ``top`` are in
broker/ops/maintenance.py. Times are on Redis's clock (``TIME``), like leases.

Listing is SCAN-based (``MATCH`` on the queues' meta hashes, ``TYPE hash``),
one master after another on a Cluster; a page stops at ``limit`` queues and
returns the cursor to continue from (``"<n>"`` on one server,
``"<host:port>/<n>"`` on a Cluster: which master, and its SCAN cursor). SCAN's
own guarantees apply: a queue that exists for the whole walk is listed at
least once (a rehash may list it twice across pages), one created or deleted
meanwhile may or may not be.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


from fencemq.fences.leases import leases_held
from fencemq.fences.priority import level_counts
from fencemq.model import meta
from fencemq.errors import BadArgument, NotFound
from fencemq.model.keys import Keyspace, QueueRef, escape
from fencemq.model.keys import queue_ref
from fencemq.model.records import checkouts_in, lex_range
from fencemq.model.values import integer as _int
from fencemq.model.values import text as _s

Progress = Callable[[int, "int | None"], None]

KINDS = {"plain": "t", "lite": "l", "filter": "f"}
KIND_NAMES = {"t": "plain", "l": "lite", "f": "filter"}
PIPELINE_CHUNK = 200
SCAN_COUNT = 1000


def _in_s(deadline_ms: float | None, now_ms: int) -> float | None:
    return None if deadline_ms is None else round((deadline_ms - now_ms) / 1000, 3)


# -- the server: single or Cluster -------------------------------------------------------


def is_cluster_client(redis: Any) -> bool:
    try:
        from redis.asyncio.cluster import RedisCluster
    except ImportError:  # pragma: no cover
        return False
    return isinstance(redis, RedisCluster)


async def primaries(redis: Any) -> list[Any]:
    """[None] for one server; every master of a Cluster, by name (a stable order for cursors)."""
    if not is_cluster_client(redis):
        return [None]
    await redis.initialize()  # a fresh client knows no node before its first command
    return sorted(redis.get_primaries(), key=lambda n: n.name)


async def now_ms(redis: Any) -> int:
    seconds, micros = await redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


def queue_info(qid: str) -> dict[str, Any]:
    """What a queue id says: kind (plain | lite | filter), topic (the filter of a filter queue), lmq, owner."""
    ref = queue_ref(qid)
    return {"qid": qid, "name": display_name(ref), "kind": KIND_NAMES.get(qid[:1], "?"), "topic": ref.topic,
            "lmq": ref.lmq, "owner": ref.owner}


def display_name(ref: QueueRef) -> str:
    if ref.owner is not None:
        return f"{ref.topic} ({ref.owner})"
    return str(ref)


# -- meta hash ---------------------------------------------------------------------------


def parse_meta(raw: dict[bytes, bytes]) -> tuple[dict[str, str], dict[str, dict[str, Any]]]:
    """Queue fields, and groups in creation order: {group: {field: value, "members": {member: {field: value}}}}.

    Members keep arrival order (the group's member list, single-active
    succession order); a member with fields but not in the list (it is
    leaving) comes last.
    """
    decoded = meta.decode(raw)
    groups: dict[str, dict[str, Any]] = {g: {"members": {}} for g in decoded.group_names}
    for g, fields in decoded.groups.items():
        groups.setdefault(g, {"members": {}}).update(fields)
    for g, group in groups.items():
        for m in decoded.member_names(g):
            group["members"][m] = {}
    for (g, m), fields in decoded.members.items():
        groups.setdefault(g, {"members": {}})["members"].setdefault(m, {}).update(fields)
    return decoded.fields, groups


# -- listing -----------------------------------------------------------------------------


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def _prefilter(glob: str | None) -> str:
    """A Redis MATCH piece matching (at least) every escaped name the fnmatch glob matches."""
    if not glob or any(c in glob for c in "[]\\"):
        return "*"
    pieces = re.split(r"([*?])", glob)
    out = "".join("*" if p in ("*", "?") else _glob_escape(escape(p)) for p in pieces)
    return re.sub(r"\*+", "*", out)


@dataclass
class QueueFilter:
    """Which queues a listing keeps. ``match`` is an fnmatch glob (case-sensitive) over
    the topic (the filter of a filter queue), or over the lmq name when ``match_lmq``."""

    kind: str | None = None  # plain | lite | filter
    topic: str | None = None
    match: str | None = None
    match_lmq: bool = False

    def __post_init__(self) -> None:
        if self.kind is not None and self.kind not in KINDS:
            raise BadArgument(f"kind must be one of {', '.join(KINDS)}, not {self.kind!r}")

    def pattern(self, keys: Keyspace, topic_kind: str | None = None) -> str:
        """The SCAN MATCH pattern: as narrow as the filter allows, never narrower."""
        kind = self.kind or topic_kind
        letter = KINDS[kind] if kind else "[tlf]"
        base = f"{keys.prefix}:{{"
        topic = _glob_escape(escape(self.topic)) if self.topic is not None else None
        lmq_part = _prefilter(self.match) if self.match_lmq else "*"
        topic_part = topic if topic is not None else (_prefilter(self.match) if not self.match_lmq else "*")
        if letter == "t":
            return f"{base}t:{topic_part}}}"
        if letter == "l":
            return f"{base}l:{topic_part}:{lmq_part}}}"
        if letter == "f":
            return f"{base}f:*:{topic_part}}}"
        return keys.queue_pattern()

    def accepts(self, qid: str) -> bool:
        if not qid[:2] in ("t:", "l:", "f:"):
            return False
        if self.kind is not None and qid[0] != KINDS[self.kind]:
            return False
        ref = queue_ref(qid)
        if self.topic is not None and ref.topic != self.topic:
            return False
        if self.match is not None:
            name = ref.lmq if self.match_lmq else ref.topic
            if name is None or not fnmatch.fnmatchcase(name, self.match):
                return False
        return True


@dataclass
class Page:
    qids: list[str]
    cursor: str | None  # where the next page starts; None: the walk is complete
    scanned: int  # keys SCAN returned (before our own filtering)
    nodes: int
    pattern: str
    rows: list[dict[str, Any]] = field(default_factory=list)


def _parse_cursor(text: str | None, nodes: list[Any]) -> tuple[int, int]:
    if text is None or text in ("", "0"):
        return 0, 0
    name, slash, number = text.rpartition("/")
    try:
        cursor = int(number)
        if cursor < 0:
            raise ValueError
    except ValueError:
        raise BadArgument(f"cursor {text!r} is not one a listing printed; start without --cursor") from None
    if nodes == [None]:
        if slash:
            raise BadArgument(f"cursor {text!r} names a Cluster master but this server is not a Cluster")
        return 0, cursor
    if not slash:
        raise BadArgument(f"cursor {text!r} does not name a Cluster master; give the one the listing printed")
    names = [n.name for n in nodes]
    if name not in names:
        raise BadArgument(f"cursor {text!r} names {name}, which is not a master of this Cluster now; "
                          "start again without --cursor")
    return names.index(name), cursor


def _format_cursor(nodes: list[Any], index: int, cursor: int) -> str:
    return str(cursor) if nodes == [None] else f"{nodes[index].name}/{cursor}"


async def scan_step(redis: Any, node: Any, cursor: int, pattern: str, count: int) -> tuple[int, list[bytes]]:
    """One SCAN of queue meta hashes (``TYPE hash``) on one server, or on one master of a Cluster."""
    if node is None:
        nxt, keys = await redis.scan(cursor, match=pattern, count=count, _type="hash")
    else:
        nxt, keys = await redis.scan(cursor, match=pattern, count=count, _type="hash", target_nodes=node)
        if isinstance(nxt, dict):  # the Cluster client answers {node name: cursor}
            nxt = next(iter(nxt.values()))
    return int(nxt), keys


async def topic_kind(redis: Any, keys: Keyspace, topic: str) -> str | None:
    """plain | lite, as the topic was first used; None for a topic never used."""
    kind = await redis.hget(keys.topic(topic), "kind")
    return _s(kind) if kind is not None else None


async def scan_queues(
    redis: Any,
    keys: Keyspace,
    flt: QueueFilter | None = None,
    *,
    limit: int = 100,
    cursor: str | None = None,
    count: int = SCAN_COUNT,
    progress: Progress | None = None,
) -> Page:
    """One page of queue ids (at most ``limit``, see below) and the cursor of the next page.

    SCAN cannot resume in the middle of a batch, so when a batch would overrun
    the page it is asked again from the same cursor with a smaller COUNT, down
    to one hash bucket, which then starts the next page; only a single bucket
    holding more matches than a whole page makes a page longer than ``limit``.
    """
    if limit < 1:
        raise BadArgument("limit must be at least 1")
    flt = flt or QueueFilter()
    kind = None
    if flt.topic is not None and flt.kind is None:
        kind = await topic_kind(redis, keys, flt.topic)
    pattern = flt.pattern(keys, kind)
    nodes = await primaries(redis)
    start, cur = _parse_cursor(cursor, nodes)
    found: list[str] = []
    seen: set[str] = set()
    scanned = 0
    for index in range(start, len(nodes)):
        node = nodes[index]
        cur = cur if index == start else 0
        n = count
        while True:
            room = limit - len(found)
            while True:
                nxt, batch = await scan_step(redis, node, cur, pattern, n)
                fresh = []
                for raw in batch:
                    qid = Keyspace.qid_from_meta_key(_s(raw))
                    if qid not in seen and flt.accepts(qid):
                        fresh.append(qid)
                if len(set(fresh)) <= room:
                    break
                if n == 1:
                    if found:  # this bucket starts the next page
                        return Page(found, _format_cursor(nodes, index, cur), scanned, len(nodes), pattern)
                    break  # one bucket holds more than a page: take it whole
                n = max(1, n // 4)
            n = min(count, n * 4)
            scanned += len(batch)
            for qid in fresh:
                if qid not in seen:
                    seen.add(qid)
                    found.append(qid)
            cur = nxt
            if progress is not None:
                progress(len(found), None)
            if cur == 0:
                break
            if len(found) >= limit:
                return Page(found, _format_cursor(nodes, index, cur), scanned, len(nodes), pattern)
        if len(found) >= limit and index + 1 < len(nodes):
            return Page(found, _format_cursor(nodes, index + 1, 0), scanned, len(nodes), pattern)
    return Page(found, None, scanned, len(nodes), pattern)


async def queue_rows(redis: Any, keys: Keyspace, qids: list[str], now: int | None = None) -> list[dict[str, Any]]:
    """Summary rows of these queues (those that vanished meanwhile are left out)."""
    if now is None:
        now = await now_ms(redis)
    rows: list[dict[str, Any]] = []
    for start in range(0, len(qids), PIPELINE_CHUNK):
        chunk = qids[start : start + PIPELINE_CHUNK]
        async with redis.pipeline(transaction=False) as pipe:
            for qid in chunk:
                k = keys.queue_by_id(qid)
                pipe.hgetall(k.meta)
                pipe.zrange(k.deadlines, 0, -1)
                pipe.hlen(k.checkouts)
                pipe.zcard(k.ready)
                pipe.zcard(k.delayed)
                pipe.llen(k.dead)
                pipe.zcard(k.scheduled)
            replies = await pipe.execute()
        parsed = []
        for i, qid in enumerate(chunk):
            raw_meta, leases, size, ready, delayed, dead, scheduled = replies[7 * i : 7 * i + 7]
            if raw_meta:
                # a lease batch (one PULL's checkouts) is one deadline, and a count beside the records
                leases = [_s(lease) for lease in leases]
                (leased,) = await leases_held(redis, keys.queue_by_id(qid), [leases])
                held = checkouts_in(int(size), leases)
                parsed.append((qid, *parse_meta(raw_meta), leased, held, ready, delayed, dead, scheduled))
        async with redis.pipeline(transaction=False) as pipe:
            for qid, _fields, groups, *_ in parsed:
                k = keys.queue_by_id(qid)
                for g in groups:
                    pipe.zlexcount(k.ready, *lex_range(g))
            counts = iter(await pipe.execute()) if parsed else iter(())
        # a priority queue's cursors are low-water marks: what each group has not read is counted by level
        # (fences/priority.py level_counts, as inspect_queue and the totals count it)
        by_level = {qid: await level_counts(redis, keys.queue_by_id(qid))
                    for qid, fields, *_ in parsed if fields.get(meta.PRIORITY) == "1"}
        for qid, fields, groups, leased, held, ready, delayed, dead, scheduled in parsed:
            seq, first = _int(fields.get(meta.SEQ)), _int(fields.get(meta.FIRST), 1)
            backlogs, owners, members, suspected, marked, unread = [], [], 0, 0, 0, []
            flagged = []  # (group, member, fields) of the members suspected or fenced off
            for g, group in groups.items():
                returned = next(counts)
                cursor = max(_int(group.get(meta.CURSOR), first), first)
                if meta.unread(fields, cursor) > 0:
                    unread.append(meta.past_gap(fields, cursor))
                levels = by_level.get(qid)
                not_read = (sum(levels["unread"].get(g, {}).values()) if levels is not None
                            else meta.unread(fields, cursor))
                backlogs.append(not_read + int(returned))
                if group.get(meta.OWNER):
                    owners.append(group[meta.OWNER])
                members += len(group["members"])
                suspected += sum(1 for m in group["members"].values() if meta.SUSPECTED_SINCE in m)
                marked += sum(1 for m in group["members"].values() if meta.MARKER in m)
                flagged += [(g, m, f) for m, f in group["members"].items()
                            if meta.SUSPECTED_SINCE in f or meta.MARKER in f]
            wt = _int(fields.get(meta.LAST_WRITE), None)
            rows.append({
                **queue_info(qid),
                "seq": seq,
                "first": first,
                "groups": len(groups),
                "members": members,
                "owners": owners,
                "backlog": max(backlogs) if backlogs else None,
                "oldest_unread": min(unread) if unread else None,  # the lowest id some group has yet to read
                "checkouts": int(held),
                "leased": int(leased),
                "ready": int(ready),
                "delayed": int(delayed),
                "dead_letters": int(dead),
                "scheduled": int(scheduled),  # published for later, not in the log yet (fences/schedule.py)
                "priority": fields.get(meta.PRIORITY) == "1",  # honours PUB … PRIORITY (fences/priority.py)
                "suspected": suspected,
                "evicted": marked,
                "flagged": flagged,
                "last_write_ms": wt,
                "idle_s": _in_s(now, wt) if wt is not None else None,
            })
    return rows


async def list_queues(redis: Any, keys: Keyspace, flt: QueueFilter | None = None, *, limit: int = 100,
                      cursor: str | None = None, progress: Progress | None = None) -> Page:
    """A page of queues with their summary rows (``Page.rows``)."""
    page = await scan_queues(redis, keys, flt, limit=limit, cursor=cursor, progress=progress)
    page.rows = await queue_rows(redis, keys, page.qids)
    page.rows.sort(key=lambda r: (r["topic"], r["lmq"] or "", r["owner"] or ""))
    return page


# -- one queue ---------------------------------------------------------------------------


async def _meta_or_fail(redis: Any, keys: Keyspace, ref: QueueRef) -> dict[bytes, bytes]:
    raw = await redis.hgetall(keys.queue(ref).meta)
    if raw:
        return raw
    hint = ""
    if ref.owner is None:
        kind = await topic_kind(redis, keys, ref.topic)
        if kind == "lite" and ref.lmq is None:
            hint = f"; {ref.topic!r} is a lite topic: give --lmq (list them with `fencemq lmqs --topic {ref.topic}`)"
        elif kind == "plain" and ref.lmq is not None:
            hint = f"; {ref.topic!r} is a plain topic: leave out --lmq"
        elif kind is None:
            hint = "; no such topic either (list queues with `fencemq queues`)"
    raise NotFound(f"no queue {display_name(ref)} under prefix {keys.prefix!r}{hint}")
