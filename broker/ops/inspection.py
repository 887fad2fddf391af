"""Operator reads of one thing in depth: a queue, a group, a member, a session.

What ``fencemq inspect`` shows (cli/inspect_cmd.py presents it). Like the
listings in broker/operations.py: async, a ``redis.asyncio`` client or
cluster, plain JSON-able data back, pipelined reads (not atomic), times on
Redis's clock. Meta hashes are read whole and spelled out
(``fencemq.model.meta.expand``), so an lmq at rest reads like any other queue.
"""

from __future__ import annotations

from typing import Any

import msgpack

from fencemq.fences import at_rest
from fencemq.fences.priority import level_counts
from fencemq.model import meta
from fencemq.fences import session_index
from fencemq.fences.retention import Policy
from fencemq.errors import NotFound
from fencemq.model.keys import Keyspace, QueueKeys, QueueRef
from fencemq.model.handles import Handle
from fencemq.ops.totals import entry_figures, entry_of
from fencemq.ops.operations import (
    _in_s,
    _meta_or_fail,
    display_name,
    now_ms,
    parse_meta,
    queue_info,
)
from fencemq.fences.leases import leases_held, queue_leases, tags_of_leases
from fencemq.model.records import Checkout, OwnedEntry, ReadyEntry, decode_push_members, is_batch_key, lex_range
from fencemq.model.values import integer as _int
from fencemq.model.values import text as _s


async def _checkouts(redis: Any, k: QueueKeys, now: int, limit: int, group: str | None = None,
                     member: str | None = None, epochs: dict[str, int] | None = None) -> tuple[list[dict[str, Any]], int]:
    """Up to ``limit`` checkouts (soonest deadline first; those waiting in a push
    mailbox, with no deadline yet, last) and how many there are in all."""
    tags: list[str] = []
    if group is None:
        total, leased = await queue_leases(redis, k)
        first = await redis.zrange(k.deadlines, 0, max(limit - 1, 0)) if limit > 0 else []
        tags = (await tags_of_leases(redis, k, [_s(lease) for lease in first]))[:limit]
        if len(tags) < limit and total > leased:
            # Checkouts without a deadline (in a push mailbox): walk the records.
            seen = set(tags)
            scan_cursor = 0
            while len(tags) < limit:
                scan_cursor, batch = await redis.hscan(k.checkouts, scan_cursor, count=500)
                fresh = [(_s(t), rec) for t, rec in batch.items() if not is_batch_key(t) and _s(t) not in seen]
                fresh = [t for t, rec in fresh if Checkout.decode(rec).batch is None]  # a lease batch's are leased
                if fresh:
                    for tag, score in zip(fresh, await redis.zmscore(k.deadlines, fresh), strict=True):
                        if score is None and len(tags) < limit:
                            tags.append(tag)
                            seen.add(tag)
                if int(scan_cursor) == 0:
                    break
    else:
        lo, hi = lex_range(group, member) if member is not None else lex_range(group)
        leases = [OwnedEntry.decode(o).tag for o in await redis.zrangebylex(k.owned, lo, hi)]
        (total,) = await leases_held(redis, k, [leases])
        tags = (await tags_of_leases(redis, k, leases[:limit]))[:limit] if limit > 0 else []
    if not tags:
        return [], total
    records = await redis.hmget(k.checkouts, tags)
    decoded = {tag: Checkout.decode(rec) for tag, rec in zip(tags, records, strict=True) if rec is not None}
    leases_of = {tag: c.lease(tag) for tag, c in decoded.items()}
    unique = sorted(set(leases_of.values()))
    due = dict(zip(unique, await redis.zmscore(k.deadlines, unique), strict=True)) if unique else {}
    deadlines = [due.get(leases_of[tag]) if tag in decoded else None for tag in tags]
    out = []
    for tag, rec, deadline in zip(tags, records, deadlines, strict=True):
        if rec is None:
            continue  # settled between the two reads
        c = decoded[tag]
        dl = int(deadline) if deadline is not None else None
        row = {
            "tag": _s(tag), "group": c.group, "member": c.member, "id": c.id, "epoch": c.epoch,
            "acquisitions": c.acquisitions, "failures": c.failures, "deadline_ms": dl, "expires_in_s": _in_s(dl, now),
        }
        if epochs is not None:
            row["stale"] = c.epoch < epochs.get(c.group, 0)
        out.append(row)
    out.sort(key=lambda r: (r["deadline_ms"] is None, r["deadline_ms"] or 0, r["group"], r["member"]))
    return out, total


def _member_row(group: str, m: str, f: dict[str, str], owner: str | None, now: int) -> dict[str, Any]:
    sus = _int(f.get(meta.SUSPECTED_SINCE), None)
    return {
        "member": m,
        "owner": m == owner,
        "delivered": _int(f.get(meta.DELIVERED)),
        "max": _int(f.get(meta.MAX), None),
        "lock_ms": _int(f.get(meta.LOCK), None),
        "suspected": sus is not None,
        "suspected_since_ms": sus,
        "suspected_for_s": _in_s(now, sus) if sus is not None else None,
        "marker": f.get(meta.MARKER),
        "capacity": _int(f.get(meta.CAPACITY), None),
        "push": meta.CAPACITY in f,
        "qos": _int(f.get(meta.QOS), 1),
        "ended": meta.ENDED in f,
        "online": f.get(meta.ONLINE, "1") != "0",
    }


def _group_row(name: str, group: dict[str, Any], fields: dict[str, str]) -> dict[str, Any]:
    first = _int(fields.get(meta.FIRST), 1)
    cursor = max(_int(group.get(meta.CURSOR), first), first)
    return {
        "group": name,
        "mode": group.get(meta.MODE),
        "policy": group.get(meta.POLICY),
        "on_preempt": group.get(meta.ON_PREEMPT),
        "strategy": group.get(meta.STRATEGY),
        "epoch": _int(group.get(meta.EPOCH)),
        "cursor": cursor,
        "owner": group.get(meta.OWNER),
        "unread": meta.unread(fields, cursor),
    }


async def _delayed_by_group(redis: Any, k: QueueKeys, cap: int = 10_000) -> dict[str, int] | None:
    """Delayed redeliveries per group (None when there are more than ``cap``: not counted)."""
    if await redis.zcard(k.delayed) > cap:
        return None
    out: dict[str, int] = {}
    for member in await redis.zrange(k.delayed, 0, -1):
        g = ReadyEntry.group_of(member)
        out[g] = out.get(g, 0) + 1
    return out


async def _group_counts(redis: Any, k: QueueKeys, groups: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per group: returned, checkouts; per member: checkouts held and mailbox depth."""
    async with redis.pipeline(transaction=False) as pipe:
        for g, group in groups.items():
            pipe.zlexcount(k.ready, *lex_range(g))
            pipe.zrangebylex(k.owned, *lex_range(g))
            for m in group["members"]:
                pipe.llen(k.mailbox(g, m))
        replies = iter(await pipe.execute()) if groups else iter(())
    read: dict[str, tuple[int, dict[str, list[str]], list[int]]] = {}
    for g, group in groups.items():
        returned, owned = int(next(replies)), [OwnedEntry.decode(o) for o in next(replies)]
        by_member: dict[str, list[str]] = {m: [] for m in group["members"]}
        for o in owned:
            by_member.setdefault(o.member, []).append(o.tag)
        read[g] = (returned, by_member, [int(next(replies)) for _ in group["members"]])
    out: dict[str, Any] = {}
    for g, group in groups.items():
        returned, by_member, depths = read[g]
        held = dict(zip(by_member, await leases_held(redis, k, list(by_member.values())), strict=True))
        entry = {"returned": returned, "checkouts": sum(held.values()), "members": {}}
        for (m, f), depth in zip(group["members"].items(), depths, strict=True):
            entry["members"][m] = {"checkouts": held[m], "mailbox_depth": depth if meta.CAPACITY in f else None}
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
        pipe.pttl(k.meta)
        pipe.hget(keys.retention, ref.topic)
        pipe.zcard(k.scheduled)
        log_len, ready, delayed, dead, journal, ttl, policy, scheduled = await pipe.execute()
    ttl = at_rest.no_key_ttl(ttl, True)  # found: an lmq at rest has no meta key, nor a TTL
    _, leased = await queue_leases(redis, k)
    seq, first = _int(fields.get(meta.SEQ)), _int(fields.get(meta.FIRST), 1)
    entry = entry_of(ref.qid)
    figures = (await entry_figures(redis, keys, [entry]))[entry]
    counts = await _group_counts(redis, k, groups)
    delayed_by = await _delayed_by_group(redis, k)
    epochs = {g: _int(group.get(meta.EPOCH)) for g, group in groups.items()}
    checkouts, total = await _checkouts(redis, k, now, limit, epochs=epochs)
    levels = await level_counts(redis, k)  # a priority queue's: per level (fences/priority.py); None otherwise
    out_groups = []
    for g, group in groups.items():
        row = _group_row(g, group, fields)
        if levels is not None:  # its cursor is a low-water mark: what it has not read is counted by level
            row["unread"] = sum(levels["unread"].get(g, {}).values())
            row["unread_by_level"] = levels["unread"].get(g, {})
        c = counts[g]
        row.update({
            "returned": c["returned"],
            "delayed": delayed_by.get(g, 0) if delayed_by is not None else None,
            "backlog": row["unread"] + c["returned"],
            "checkouts": c["checkouts"],
            "members": [
                {**_member_row(g, m, f, group.get(meta.OWNER), now), **c["members"][m]}
                for m, f in group["members"].items()
            ],
        })
        out_groups.append(row)
    ct, wt = _int(fields.get(meta.CREATED), None), _int(fields.get(meta.LAST_WRITE), None)
    return {
        **queue_info(ref.qid),
        "now_ms": now,
        "seq": seq,
        "first": first,
        "retained": int(log_len),
        # the topic's retention policy (fences/retention.py); None: only what some group has yet to settle is kept
        "retention": Policy.decode(policy).as_dict() if policy else None,
        "last_tag": _int(fields.get(meta.TAG)),
        "created_ms": ct,
        "last_write_ms": wt,
        "expires_in_s": round(int(ttl) / 1000, 3) if int(ttl) >= 0 else None,
        "journal_cap": _int(fields.get(meta.JOURNAL_CAP), None),
        "journal_length": int(journal),
        "priority": levels,  # None: the queue does not honour PUB … PRIORITY; else {levels, unread} by level
        "backlog": max((g["backlog"] for g in out_groups), default=None),
        "checkouts_total": total,
        "leased": int(leased),
        "ready": int(ready),
        "delayed": int(delayed),
        "scheduled": int(scheduled),  # published for later, not in the log yet (fences/schedule.py)
        # settled unsent because they had expired (PUB … TTL, MQTT Message Expiry), once per group that met
        # them; the entry's (a lite topic's: all its lmqs'), from the totals (lua/lib/expiry.lua)
        "expired": figures["expired"],
        "dead_letters": int(dead),
        "push_members": [f"{g}/{m}" for g, m in decode_push_members(fields.get(meta.PUSH))],
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
    if group not in groups or meta.MODE not in groups[group]:
        known = ", ".join(groups) or "none"
        raise NotFound(f"queue {display_name(ref)} has no group {group!r} (groups: {known})")
    g = groups[group]
    seq, first = _int(fields.get(meta.SEQ)), _int(fields.get(meta.FIRST), 1)
    counts = (await _group_counts(redis, k, {group: g}))[group]
    delayed_by = await _delayed_by_group(redis, k)
    checkouts, total = await _checkouts(redis, k, now, limit, group=group, epochs={group: _int(g.get(meta.EPOCH))})
    row = _group_row(group, g, fields)
    levels = await level_counts(redis, k)  # a priority queue's: what the group has not read, by level
    if levels is not None:
        row["unread"] = sum(levels["unread"].get(group, {}).values())
        row["unread_by_level"] = levels["unread"].get(group, {})
    row.update({
        **queue_info(ref.qid),
        "queue": display_name(ref),
        "now_ms": now,
        "seq": seq,
        "first": first,
        "queue_offline": g.get(meta.QUEUE_OFFLINE) == "1",
        "returned": counts["returned"],
        "delayed": delayed_by.get(group, 0) if delayed_by is not None else None,
        "backlog": row["unread"] + counts["returned"],
        "checkouts_total": total,
        "members": [
            {**_member_row(group, m, f, g.get(meta.OWNER), now), **counts["members"][m]}
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
    if group not in groups or meta.MODE not in groups[group]:
        raise NotFound(f"queue {display_name(ref)} has no group {group!r} (groups: {', '.join(groups) or 'none'})")
    g = groups[group]
    if member not in g["members"] or meta.DELIVERED not in g["members"][member]:
        known = ", ".join(g["members"]) or "none"
        raise NotFound(f"{member!r} is not a member of group {group!r} of {display_name(ref)} (members: {known})")
    f = g["members"][member]
    epoch = _int(g.get(meta.EPOCH))
    checkouts, total = await _checkouts(redis, k, now, limit, group=group, member=member, epochs={group: epoch})
    depth = await redis.llen(k.mailbox(group, member)) if meta.CAPACITY in f else None
    return {
        **queue_info(ref.qid),
        "queue": display_name(ref),
        "group": group,
        "mode": g.get(meta.MODE),
        "epoch": epoch,
        "group_owner": g.get(meta.OWNER),
        "position": list(g["members"]).index(member) + 1,
        "now_ms": now,
        **_member_row(group, member, f, g.get(meta.OWNER), now),
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
            at_rest.pipe_meta(pipe, keys.queue(h.queue))  # whole: an lmq at rest is compact (fencemq.model.meta)
            pipe.zrangebylex(keys.queue(h.queue).owned, *lex_range(h.group, h.member))
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
        state = meta.decode(at_rest.queue_meta((next(states), next(states))))
        g, f = state.groups.get(h.group, {}), state.members.get((h.group, h.member), {})
        n, mk, own = f.get(meta.DELIVERED), f.get(meta.MARKER), g.get(meta.OWNER)
        (held,) = await leases_held(redis, keys.queue(h.queue), [[OwnedEntry.decode(o).tag for o in next(states)]])
        subs.append({
            "handle": h.encode(), **queue_info(h.queue.qid), "queue": display_name(h.queue), "group": h.group,
            "mode": g.get(meta.MODE), "epoch": _int(g.get(meta.EPOCH)), "member": n is not None,
            "owner": own == client, "delivered": _int(n), "max": _int(f.get(meta.MAX), None),
            "suspected": meta.SUSPECTED_SINCE in f, "marker": mk, "push": meta.CAPACITY in f,
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
