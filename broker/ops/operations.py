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

Listing (a page of queue ids and its cursor, the meta keys' SCAN then the lmqs
at rest) is broker/ops/listing.py, re-exported here; the rows of a page are
``queue_rows`` below.
"""

from __future__ import annotations

from typing import Any

from fencemq.errors import NotFound
from fencemq.fences import at_rest
from fencemq.fences.leases import leases_held
from fencemq.fences.priority import level_counts
from fencemq.model import meta
from fencemq.model.keys import Keyspace, QueueRef, queue_ref
from fencemq.model.records import checkouts_in, lex_range
from fencemq.model.values import integer as _int
from fencemq.model.values import text as _s
from fencemq.ops.listing import (  # noqa: F401 (re-exported: what the other ops modules and cli/ import)
    KIND_NAMES,
    KINDS,
    SCAN_COUNT,
    Page,
    Progress,
    QueueFilter,
    is_cluster_client,
    primaries,
    scan_queues,
    scan_step,
    topic_kind,
)

PIPELINE_CHUNK = 200


def _in_s(deadline_ms: float | None, now_ms: int) -> float | None:
    return None if deadline_ms is None else round((deadline_ms - now_ms) / 1000, 3)


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
                at_rest.pipe_meta(pipe, k)  # two replies: the meta key's, the rest field's
                pipe.zrange(k.deadlines, 0, -1)
                pipe.hlen(k.checkouts)
                pipe.zcard(k.ready)
                pipe.zcard(k.delayed)
                pipe.llen(k.dead)
                pipe.zcard(k.scheduled)
            replies = await pipe.execute()
        parsed = []
        for i, qid in enumerate(chunk):
            *rest, leases, size, ready, delayed, dead, scheduled = replies[8 * i : 8 * i + 8]
            raw_meta = at_rest.queue_meta(rest)
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
    raw = await at_rest.meta_hash(redis, keys.queue(ref))
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
