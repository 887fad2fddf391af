"""Operator reads: list and inspect queues, groups, members, sessions.

The Redis side of the operator CLI (``cli/ops.py`` only presents what these
return). Every function is async, takes a ``redis.asyncio.Redis`` or
``redis.asyncio.RedisCluster`` (bytes replies: no ``decode_responses``) and
a :class:`~broker.keyspace.Keyspace`, prints nothing and returns plain data
(dicts and lists of JSON-able values).

Reads are pipelined, not atomic (like ``fencemq status``): on a busy broker
two figures of one queue may be a few milliseconds apart. The writes (evict,
sweep, seek, purge, dead letters) and the live figures of ``top`` are in
broker/maintenance.py. Times are on Redis's clock (``TIME``), like leases.

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

import msgpack

from broker import compact_meta
from broker import session_index
from broker.errors import BadArgument, NotFound
from broker.keyspace import Handle, Keyspace, QueueKeys, QueueRef, escape
from broker.sweeper import queue_ref
from broker.values import integer as _int
from broker.values import text as _s

Progress = Callable[[int, "int | None"], None]

KINDS = {"plain": "t", "lite": "l", "filter": "f"}
KIND_NAMES = {"t": "plain", "l": "lite", "f": "filter"}
SEP = b"\x00"
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

    Members keep arrival order (the group's ``mem`` list, single-active
    succession order); a member with fields but not in the list (it is
    leaving) comes last.
    """
    fields: dict[str, str] = {}
    groups: dict[str, dict[str, Any]] = {}
    member_fields: list[tuple[str, str, str, str]] = []
    group_fields: list[tuple[str, str, str]] = []
    for key, value in compact_meta.expand(raw).items():
        parts = key.split("|")
        if len(parts) == 3 and parts[0] == "g":
            group_fields.append((parts[1], parts[2], value))
        elif len(parts) == 4 and parts[0] == "m":
            member_fields.append((parts[1], parts[2], parts[3], value))
        else:
            fields[key] = value
    for g in filter(None, fields.get("groups", "").split("\n")):
        groups.setdefault(g, {"members": {}})
    for g, f, value in group_fields:
        groups.setdefault(g, {"members": {}})[f] = value
    for g, group in groups.items():
        for m in filter(None, group.get("mem", "").split("\n")):
            group["members"][m] = {}
    for g, m, f, value in member_fields:
        groups.setdefault(g, {"members": {}})["members"].setdefault(m, {})[f] = value
    return fields, groups


def _lex_range(*parts: str) -> tuple[bytes, bytes]:
    """ZRANGEBYLEX bounds of every member starting with parts joined by NUL, then NUL."""
    prefix = SEP.join(p.encode() for p in parts)
    return b"[" + prefix + SEP, b"(" + prefix + b"\x01"


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


async def _scan(redis: Any, node: Any, cursor: int, pattern: str, count: int) -> tuple[int, list[bytes]]:
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
                nxt, batch = await _scan(redis, node, cur, pattern, n)
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
                pipe.zcard(k.deadlines)
                pipe.hlen(k.checkouts)
                pipe.zcard(k.ready)
                pipe.zcard(k.delayed)
                pipe.llen(k.dead)
            replies = await pipe.execute()
        parsed = []
        for i, qid in enumerate(chunk):
            meta, leased, held, ready, delayed, dead = replies[6 * i : 6 * i + 6]
            if meta:
                parsed.append((qid, *parse_meta(meta), leased, held, ready, delayed, dead))
        async with redis.pipeline(transaction=False) as pipe:
            for qid, _fields, groups, *_ in parsed:
                k = keys.queue_by_id(qid)
                for g in groups:
                    pipe.zlexcount(k.ready, *_lex_range(g))
            counts = iter(await pipe.execute()) if parsed else iter(())
        for qid, fields, groups, leased, held, ready, delayed, dead in parsed:
            seq, first = _int(fields.get("seq")), _int(fields.get("first"), 1)
            backlogs, owners, members, suspected, marked = [], [], 0, 0, 0
            for g, group in groups.items():
                returned = next(counts)
                cursor = max(_int(group.get("cur"), first), first)
                backlogs.append(max(0, seq - cursor + 1) + int(returned))
                if group.get("own"):
                    owners.append(group["own"])
                members += len(group["members"])
                suspected += sum(1 for m in group["members"].values() if "sus" in m)
                marked += sum(1 for m in group["members"].values() if "mk" in m)
            wt = _int(fields.get("wt"), None)
            rows.append({
                **queue_info(qid),
                "seq": seq,
                "first": first,
                "groups": len(groups),
                "members": members,
                "owners": owners,
                "backlog": max(backlogs) if backlogs else None,
                "checkouts": int(held),
                "leased": int(leased),
                "ready": int(ready),
                "delayed": int(delayed),
                "dead_letters": int(dead),
                "suspected": suspected,
                "evicted": marked,
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


# -- inspect -----------------------------------------------------------------------------


def _ref(topic: str, lmq: str | None) -> QueueRef:
    return QueueRef(topic, lmq)


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


async def _checkouts(redis: Any, k: QueueKeys, now: int, limit: int, group: str | None = None,
                     member: str | None = None, epochs: dict[str, int] | None = None) -> tuple[list[dict[str, Any]], int]:
    """Up to ``limit`` checkouts (soonest deadline first; those waiting in a push
    mailbox, with no deadline yet, last) and how many there are in all."""
    tags: list[bytes] = []
    if group is None:
        async with redis.pipeline(transaction=False) as pipe:
            pipe.hlen(k.checkouts)
            pipe.zcard(k.deadlines)
            pipe.zrange(k.deadlines, 0, max(limit - 1, 0), withscores=True)
            total, leased, first = await pipe.execute()
        total = int(total)
        tags = [t for t, _ in first] if limit > 0 else []
        if len(tags) < limit and total > int(leased):
            # Checkouts without a deadline (in a push mailbox): walk the records.
            seen = set(tags)
            scan_cursor = 0
            while len(tags) < limit:
                scan_cursor, batch = await redis.hscan(k.checkouts, scan_cursor, count=500)
                fresh = [t for t in batch if t not in seen]
                if fresh:
                    for tag, score in zip(fresh, await redis.zmscore(k.deadlines, fresh), strict=True):
                        if score is None and len(tags) < limit:
                            tags.append(tag)
                            seen.add(tag)
                if int(scan_cursor) == 0:
                    break
    else:
        lo, hi = _lex_range(group, member) if member is not None else _lex_range(group)
        async with redis.pipeline(transaction=False) as pipe:
            pipe.zlexcount(k.owned, lo, hi)
            pipe.zrangebylex(k.owned, lo, hi, 0, limit)
            total, owned = await pipe.execute()
        total = int(total)
        tags = [o.rsplit(SEP, 1)[1] for o in owned] if limit > 0 else []
    if not tags:
        return [], total
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hmget(k.checkouts, tags)
        pipe.zmscore(k.deadlines, tags)
        records, deadlines = await pipe.execute()
    out = []
    for tag, rec, deadline in zip(tags, records, deadlines, strict=True):
        if rec is None:
            continue  # settled between the two reads
        g, m, msg_id, epoch, acq, fail = _s(rec).split("\x00")
        dl = int(deadline) if deadline is not None else None
        row = {
            "tag": _s(tag), "group": g, "member": m, "id": int(msg_id), "epoch": int(epoch),
            "acquisitions": int(acq), "failures": int(fail), "deadline_ms": dl, "expires_in_s": _in_s(dl, now),
        }
        if epochs is not None:
            row["stale"] = int(epoch) < epochs.get(g, 0)
        out.append(row)
    out.sort(key=lambda r: (r["deadline_ms"] is None, r["deadline_ms"] or 0, r["group"], r["member"]))
    return out, total


def _member_row(group: str, m: str, f: dict[str, str], owner: str | None, now: int) -> dict[str, Any]:
    sus = _int(f.get("sus"), None)
    return {
        "member": m,
        "owner": m == owner,
        "delivered": _int(f.get("n")),
        "max": _int(f.get("max"), None),
        "lock_ms": _int(f.get("lock"), None),
        "suspected": sus is not None,
        "suspected_since_ms": sus,
        "suspected_for_s": _in_s(now, sus) if sus is not None else None,
        "marker": f.get("mk"),
        "capacity": _int(f.get("cap"), None),
        "push": "cap" in f,
        "qos": _int(f.get("qos"), 1),
        "ended": "end" in f,
        "online": f.get("on", "1") != "0",
    }


def _group_row(name: str, group: dict[str, Any], seq: int, first: int) -> dict[str, Any]:
    cursor = max(_int(group.get("cur"), first), first)
    return {
        "group": name,
        "mode": group.get("mode"),
        "policy": group.get("pol"),
        "on_preempt": group.get("onpre"),
        "strategy": group.get("strat"),
        "epoch": _int(group.get("ep")),
        "cursor": cursor,
        "owner": group.get("own"),
        "unread": max(0, seq - cursor + 1),
    }


async def _delayed_by_group(redis: Any, k: QueueKeys, cap: int = 10_000) -> dict[str, int] | None:
    """Delayed redeliveries per group (None when there are more than ``cap``: not counted)."""
    if await redis.zcard(k.delayed) > cap:
        return None
    out: dict[str, int] = {}
    for member in await redis.zrange(k.delayed, 0, -1):
        g = _s(member.split(SEP, 1)[0])
        out[g] = out.get(g, 0) + 1
    return out


async def _group_counts(redis: Any, k: QueueKeys, groups: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per group: returned, checkouts; per member: checkouts held and mailbox depth."""
    async with redis.pipeline(transaction=False) as pipe:
        for g, group in groups.items():
            pipe.zlexcount(k.ready, *_lex_range(g))
            pipe.zlexcount(k.owned, *_lex_range(g))
            for m, f in group["members"].items():
                pipe.zlexcount(k.owned, *_lex_range(g, m))
                pipe.llen(k.mailbox(g, m))
        replies = iter(await pipe.execute()) if groups else iter(())
    out: dict[str, Any] = {}
    for g, group in groups.items():
        entry = {"returned": int(next(replies)), "checkouts": int(next(replies)), "members": {}}
        for m, f in group["members"].items():
            held, depth = int(next(replies)), int(next(replies))
            entry["members"][m] = {"checkouts": held, "mailbox_depth": depth if "cap" in f else None}
        out[g] = entry
    return out


async def inspect_queue(redis: Any, keys: Keyspace, ref: QueueRef, *, limit: int = 20) -> dict[str, Any]:
    """A queue: log bounds, counters, groups (cursor, epoch, owner, backlog), members, checkouts."""
    raw = await _meta_or_fail(redis, keys, ref)
    k = keys.queue(ref)
    now = await now_ms(redis)
    fields, groups = parse_meta(raw)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hlen(k.log)
        pipe.zcard(k.ready)
        pipe.zcard(k.delayed)
        pipe.llen(k.dead)
        pipe.llen(k.journal)
        pipe.zcard(k.deadlines)
        pipe.pttl(k.meta)
        log_len, ready, delayed, dead, journal, leased, ttl = await pipe.execute()
    seq, first = _int(fields.get("seq")), _int(fields.get("first"), 1)
    counts = await _group_counts(redis, k, groups)
    delayed_by = await _delayed_by_group(redis, k)
    epochs = {g: _int(group.get("ep")) for g, group in groups.items()}
    checkouts, total = await _checkouts(redis, k, now, limit, epochs=epochs)
    out_groups = []
    for g, group in groups.items():
        row = _group_row(g, group, seq, first)
        c = counts[g]
        row.update({
            "returned": c["returned"],
            "delayed": delayed_by.get(g, 0) if delayed_by is not None else None,
            "backlog": row["unread"] + c["returned"],
            "checkouts": c["checkouts"],
            "members": [
                {**_member_row(g, m, f, group.get("own"), now), **c["members"][m]}
                for m, f in group["members"].items()
            ],
        })
        out_groups.append(row)
    ct, wt = _int(fields.get("ct"), None), _int(fields.get("wt"), None)
    return {
        **queue_info(ref.qid),
        "now_ms": now,
        "seq": seq,
        "first": first,
        "retained": int(log_len),
        "last_tag": _int(fields.get("tag")),
        "created_ms": ct,
        "last_write_ms": wt,
        "expires_in_s": round(int(ttl) / 1000, 3) if int(ttl) >= 0 else None,
        "journal_cap": _int(fields.get("jcap"), None),
        "journal_length": int(journal),
        "backlog": max((g["backlog"] for g in out_groups), default=None),
        "checkouts_total": total,
        "leased": int(leased),
        "ready": int(ready),
        "delayed": int(delayed),
        "dead_letters": int(dead),
        "push_members": [line.replace("\t", "/") for line in fields.get("push", "").split("\n") if line],
        "groups": out_groups,
        "checkouts": checkouts,
        "checkouts_shown": len(checkouts),
    }


async def inspect_group(redis: Any, keys: Keyspace, ref: QueueRef, group: str, *, limit: int = 20) -> dict[str, Any]:
    """One subscription group: cursor, epoch, owner, members (markers, suspicion, mailboxes), checkouts."""
    raw = await _meta_or_fail(redis, keys, ref)
    k = keys.queue(ref)
    now = await now_ms(redis)
    fields, groups = parse_meta(raw)
    if group not in groups or "mode" not in groups[group]:
        known = ", ".join(groups) or "none"
        raise NotFound(f"queue {display_name(ref)} has no group {group!r} (groups: {known})")
    g = groups[group]
    seq, first = _int(fields.get("seq")), _int(fields.get("first"), 1)
    counts = (await _group_counts(redis, k, {group: g}))[group]
    delayed_by = await _delayed_by_group(redis, k)
    checkouts, total = await _checkouts(redis, k, now, limit, group=group, epochs={group: _int(g.get("ep"))})
    row = _group_row(group, g, seq, first)
    row.update({
        **queue_info(ref.qid),
        "queue": display_name(ref),
        "now_ms": now,
        "seq": seq,
        "first": first,
        "skip_offline": g.get("skip") == "1",
        "returned": counts["returned"],
        "delayed": delayed_by.get(group, 0) if delayed_by is not None else None,
        "backlog": row["unread"] + counts["returned"],
        "checkouts_total": total,
        "members": [
            {**_member_row(group, m, f, g.get("own"), now), **counts["members"][m]}
            for m, f in g["members"].items()
        ],
        "checkouts": checkouts,
        "checkouts_shown": len(checkouts),
    })
    return row


async def session_info(redis: Any, keys: Keyspace, client: str, now: int) -> dict[str, Any] | None:
    """A client's session: worker, connection, since, lease; None when it has none."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hgetall(keys.session(client))
        pipe.zscore(keys.sessions, client)
        pipe.llen(keys.session_notices(client))
        for cmd in session_index.count_commands(keys, client):
            pipe.execute_command(*cmd)
        raw, lease, notices, *counts = await pipe.execute()
    handles = sum(int(n) for n in counts)
    if not raw and lease is None and not handles:
        return None
    f = {_s(a): _s(b) for a, b in raw.items()}
    lease_ms = int(lease) if lease is not None else None
    return {
        "client": client,
        "worker": f.get("worker"),
        "connection": f.get("conn"),
        "since_ms": _int(f.get("since"), None),
        "lease_deadline_ms": lease_ms,
        "lease_in_s": _in_s(lease_ms, now),
        "alive": lease_ms is not None and lease_ms > now,
        "subscriptions": handles,
        "notices_queued": int(notices),
    }


async def inspect_member(redis: Any, keys: Keyspace, ref: QueueRef, group: str, member: str, *,
                         limit: int = 20) -> dict[str, Any]:
    """One member: delivered/max, lock, suspicion, marker, mailbox, its checkouts, its session."""
    raw = await _meta_or_fail(redis, keys, ref)
    k = keys.queue(ref)
    now = await now_ms(redis)
    _fields, groups = parse_meta(raw)
    if group not in groups or "mode" not in groups[group]:
        raise NotFound(f"queue {display_name(ref)} has no group {group!r} (groups: {', '.join(groups) or 'none'})")
    g = groups[group]
    if member not in g["members"] or "n" not in g["members"][member]:
        known = ", ".join(g["members"]) or "none"
        raise NotFound(f"{member!r} is not a member of group {group!r} of {display_name(ref)} (members: {known})")
    f = g["members"][member]
    epoch = _int(g.get("ep"))
    checkouts, total = await _checkouts(redis, k, now, limit, group=group, member=member, epochs={group: epoch})
    depth = await redis.llen(k.mailbox(group, member)) if "cap" in f else None
    return {
        **queue_info(ref.qid),
        "queue": display_name(ref),
        "group": group,
        "mode": g.get("mode"),
        "epoch": epoch,
        "group_owner": g.get("own"),
        "position": list(g["members"]).index(member) + 1,
        "now_ms": now,
        **_member_row(group, member, f, g.get("own"), now),
        "handle": Handle(ref, group, member).encode(),
        "mailbox_depth": int(depth) if depth is not None else None,
        "checkouts_total": total,
        "checkouts": checkouts,
        "checkouts_shown": len(checkouts),
        "session": await session_info(redis, keys, member, now),
    }


def _entry_order(entry: Handle | str) -> str:
    """Handles listed in the order of their text, as the client sees them."""
    return entry.encode() if isinstance(entry, Handle) else entry


async def inspect_session(redis: Any, keys: Keyspace, client: str, *, limit: int = 20) -> dict[str, Any]:
    """A client's session: lease, worker, every subscription handle it holds (with its state), notices."""
    now = await now_ms(redis)
    info = await session_info(redis, keys, client, now)
    if info is None:
        raise NotFound(f"no session {client!r} under prefix {keys.prefix!r} (connected clients: `fencemq status`)")
    handles = sorted(await session_index.all_entries(redis, keys, client), key=_entry_order)
    shown = handles[:limit]
    decoded = [h for h in shown if isinstance(h, Handle)]
    async with redis.pipeline(transaction=False) as pipe:
        for h in decoded:
            pipe.hgetall(keys.queue(h.queue).meta)  # whole: an lmq at rest is compact (broker/compact_meta.py)
            pipe.zlexcount(keys.queue(h.queue).owned, *_lex_range(h.group, h.member))
        pipe.hgetall(keys.session_lite_counts(client))
        pipe.lrange(keys.session_notices(client), 0, max(limit - 1, 0))
        replies = await pipe.execute()
    states = iter(replies[:-2])
    lite, notices = replies[-2], replies[-1]
    subs = []
    for h in shown:
        if not isinstance(h, Handle):
            subs.append({"handle": h, "error": "not a handle"})
            continue
        fields = compact_meta.expand(next(states))
        g, m = f"g|{h.group}|", f"m|{h.group}|{h.member}|"
        n, mx, sus, mk, cap = (fields.get(m + f) for f in ("n", "max", "sus", "mk", "cap"))
        own, mode, ep = (fields.get(g + f) for f in ("own", "mode", "ep"))
        held = int(next(states))
        subs.append({
            "handle": h.encode(), **queue_info(h.queue.qid), "queue": display_name(h.queue), "group": h.group,
            "mode": _s(mode) if mode is not None else None, "epoch": _int(ep), "member": n is not None,
            "owner": own is not None and _s(own) == client, "delivered": _int(n), "max": _int(mx, None),
            "suspected": sus is not None, "marker": _s(mk) if mk is not None else None, "push": cap is not None,
            "checkouts": held,
        })
    decoded_notices = []
    for raw in notices if limit > 0 else []:
        try:
            decoded_notices.append(_plain(msgpack.unpackb(raw, raw=False)))
        except Exception:  # noqa: BLE001 - not ours to judge: show what is there
            decoded_notices.append({"raw": _s(raw)})
    return {
        **info,
        "now_ms": now,
        "handles": subs,
        "handles_total": len(handles),
        "lite_counts": {_s(a): _int(b) for a, b in lite.items()},
        "notices": decoded_notices,
    }


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return _s(value)
    if isinstance(value, dict):
        return {_s(a): _plain(b) for a, b in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
