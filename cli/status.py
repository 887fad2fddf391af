"""`fencemq status`: what the broker's state in Redis says, read directly from Redis.

Read-only and script-free: it never writes, so it is safe against a live
broker. Reads are pipelined, not atomic: on a busy broker the numbers of one
queue may be a few milliseconds apart (e.g. a member's pending count against
the queue's checkouts). Times are relative to Redis's clock (TIME), like the
leases themselves.

Per queue (a plain topic, or one lmq of a lite topic, ``topic[lmq]``):

* ``last_id``/``first_id``: the meta hash's ``seq`` and ``first``.
* per group: ``unread`` = last id - cursor + 1 (never read by the group),
  ``returned`` = messages of the group waiting for redelivery (lease expired,
  NACKed, or given back by a preempted/leaving member), ``backlog`` = unread +
  returned, ``checkouts`` = checkouts held by its members.
* ``checkouts`` = the checkouts under a lease deadline (a lease batch, one
  PULL's checkouts, counts them all); ``oldest_deadline_in_s`` = the
  first deadline, in seconds from now (negative: overdue, the sweeper is about
  to return it).
* ``backlog`` of the queue = the largest group backlog (null with no group).

And the broker's alarms (memory above its watermark, a Redis that may evict:
the records the workers keep, fences/memory.py), with the memory and eviction
policy of the Redis it reads (``redis``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from itertools import chain
from typing import Any

import redis
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from fencemq.fences import at_rest, session_index
from fencemq.fences.memory import decode_alarms, node_memory
from fencemq.model import meta
from fencemq.model.keys import Keyspace
from fencemq.ops import listing
from fencemq.ops.operations import parse_meta
from fencemq.model.keys import queue_ref
from fencemq.model.records import OwnedEntry, held_under, is_batch_key, lex_range
from fencemq.cli.common import safe_url, text

PIPELINE_CHUNK = 200


def _int(value: object, default: int = 0) -> int:
    if value is None:
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _in_s(deadline_ms: float, now_ms: int) -> float:
    return round((deadline_ms - now_ms) / 1000, 3)


def collect(client: redis.Redis, prefix: str = "fmq", limit: int = 1000) -> dict[str, Any]:
    """The status snapshot as plain data (what ``--json`` prints)."""
    keys = Keyspace(prefix)
    seconds, micros = client.time()
    now = seconds * 1000 + micros // 1000

    workers = [
        {"id": text(member), "deadline_ms": int(score), "expires_in_s": _in_s(score, now), "alive": score > now}
        for member, score in client.zrange(keys.workers, 0, -1, withscores=True)
    ]
    workers.sort(key=lambda w: w["id"])

    session_total = client.zcard(keys.sessions)
    raw_sessions = client.zrange(keys.sessions, 0, limit - 1, withscores=True) if limit > 0 else []
    sessions: list[dict[str, Any]] = []
    for start in range(0, len(raw_sessions), PIPELINE_CHUNK):
        chunk = raw_sessions[start : start + PIPELINE_CHUNK]
        counting = [session_index.count_commands(keys, text(member)) for member, _ in chunk]
        with client.pipeline(transaction=False) as pipe:
            for (member, _), commands in zip(chunk, counting):
                pipe.hmget(keys.session(text(member)), "worker", "since")
                for cmd in commands:
                    pipe.execute_command(*cmd)
            replies = iter(pipe.execute())
        for (member, score), commands in zip(chunk, counting):
            worker, since = next(replies)
            counts = [next(replies) for _ in commands]
            sessions.append({
                "client": text(member),
                "deadline_ms": int(score),
                "expires_in_s": _in_s(score, now),
                "alive": score > now,
                "worker": text(worker) if worker is not None else None,
                "since_ms": _int(since, 0) or None,
                "subscriptions": sum(int(n) for n in counts),
            })
    sessions.sort(key=lambda s: s["client"])

    qids: set[str] = set()
    truncated_queues = False
    # the queues' meta keys, then the lmqs at rest, which have none (ops/listing.py)
    found = (Keyspace.qid_from_meta_key(text(key))
             for key in client.scan_iter(match=keys.queue_pattern(), count=1000, _type="HASH"))
    for qid in chain(found, listing.rested_qids_sync(client, keys)):
        if qid in qids:
            continue  # SCAN may return a key twice; an lmq may come to rest meanwhile
        if len(qids) >= limit:
            truncated_queues = True
            break
        qids.add(qid)
    queues: list[dict[str, Any]] = []
    ordered = sorted(qids)
    for start in range(0, len(ordered), PIPELINE_CHUNK):
        queues.extend(_queues(client, keys, ordered[start : start + PIPELINE_CHUNK], now))
    queues.sort(key=lambda q: (q["topic"], q["lmq"] or ""))

    memory = node_memory("", client.info("memory"))
    return {
        "prefix": prefix,
        "now_ms": now,
        "alarms": [{"alarm": a.kind, "node": a.node, "since_ms": a.since_ms, "detail": a.detail}
                   for a in decode_alarms(client.hgetall(keys.alarms))],
        "redis": {"used_memory": memory.used, "maxmemory": memory.maxmemory, "maxmemory_policy": memory.policy},
        "workers": workers,
        "sessions": sessions,
        "queues": queues,
        "truncated": {
            "sessions": session_total > len(sessions),
            "queues": truncated_queues,
        },
    }


def _queues(client: redis.Redis, keys: Keyspace, qids: list[str], now: int) -> Iterable[dict[str, Any]]:
    with client.pipeline(transaction=False) as pipe:
        for qid in qids:
            k = keys.queue_by_id(qid)
            at_rest.pipe_meta(pipe, k)
            pipe.zrange(k.deadlines, 0, -1, withscores=True)
            pipe.zcard(k.ready)
            pipe.zcard(k.delayed)
            pipe.llen(k.dead)
        replies = pipe.execute()

    parsed = []
    for i, qid in enumerate(qids):
        *rest, leases, ready, delayed, dead = replies[6 * i : 6 * i + 6]
        raw_meta = at_rest.queue_meta(rest)
        if not raw_meta:
            continue  # reclaimed between SCAN and now
        parsed.append((qid, parse_meta(raw_meta), [text(lease) for lease, _ in leases], leases[:1], ready, delayed,
                       dead))

    # Per group: returned (a lex count) and its members' leases (an ownership entry each: a tag, or a lease batch
    # holding one PULL's checkouts, whose count the checkouts hash keeps beside the records)
    with client.pipeline(transaction=False) as pipe:
        for qid, (fields, groups), *_ in parsed:
            k = keys.queue_by_id(qid)
            for g in sorted(groups):  # the same order as the loop that reads the counts below
                pipe.zlexcount(k.ready, *lex_range(g))
                pipe.zrangebylex(k.owned, *lex_range(g))
        counts = iter(pipe.execute())
    owned: dict[tuple[str, str], list[OwnedEntry]] = {}
    returned_of: dict[tuple[str, str], int] = {}
    for qid, (fields, groups), *_ in parsed:
        for g in sorted(groups):
            returned_of[(qid, g)] = next(counts)
            owned[(qid, g)] = [OwnedEntry.decode(o) for o in next(counts)]
    batches = {qid: sorted({lease for lease in leases if is_batch_key(lease)}
                           | {o.tag for g in groups for o in owned[(qid, g)] if is_batch_key(o.tag)})
               for qid, (_fields, groups), leases, *_ in parsed}
    with client.pipeline(transaction=False) as pipe:
        for qid, keys_of in batches.items():
            if keys_of:
                pipe.hmget(keys.queue_by_id(qid).checkouts, keys_of)
        found = iter(pipe.execute())
    counts_of = {qid: dict(zip(keys_of, (int(n or 0) for n in next(found)), strict=True)) if keys_of else {}
                 for qid, keys_of in batches.items()}

    def held(qid: str, leases: Iterable[str]) -> int:
        return held_under(leases, counts_of[qid])

    for qid, (fields, groups), leases, oldest, ready, delayed, dead in parsed:
        checkouts = held(qid, leases)
        ref = queue_ref(qid)
        seq = _int(fields.get(meta.SEQ))
        first = _int(fields.get(meta.FIRST), 1)
        out_groups = []
        for g in sorted(groups):
            group = groups[g]
            returned = returned_of[(qid, g)]
            group_owned = owned[(qid, g)]
            cursor = max(_int(group.get(meta.CURSOR), first), first)
            unread = meta.unread(fields, cursor)
            members = []
            for m, mfields in group["members"].items():
                pending = held(qid, (o.tag for o in group_owned if o.member == m))
                members.append({
                    "id": m,
                    "delivered": _int(mfields.get(meta.DELIVERED)),
                    "pending": pending,
                    "suspected": meta.SUSPECTED_SINCE in mfields,
                    "suspected_since_ms": (_int(mfields.get(meta.SUSPECTED_SINCE))
                                           if meta.SUSPECTED_SINCE in mfields else None),
                    "evicted_by": mfields.get(meta.MARKER),
                    "lock_ms": _int(mfields.get(meta.LOCK)) if meta.LOCK in mfields else None,
                })
            out_groups.append({
                "name": g,
                "mode": group.get(meta.MODE),
                "policy": group.get(meta.POLICY),
                "epoch": _int(group.get(meta.EPOCH)),
                "cursor": cursor,
                "owner": group.get(meta.OWNER),
                "unread": unread,
                "returned": returned,
                "backlog": unread + returned,
                "checkouts": held(qid, (o.tag for o in group_owned)),
                "members": members,
                "suspected": [m["id"] for m in members if m["suspected"]],
                "evicted": [m["id"] for m in members if m["evicted_by"] is not None],
            })
        oldest_ms = int(oldest[0][1]) if oldest else None
        yield {
            "name": str(ref),
            "topic": ref.topic,
            "lmq": ref.lmq,
            "qid": qid,
            "first_id": first,
            "last_id": seq,
            "retained": meta.ids_between(fields, first, seq),
            "backlog": max((g["backlog"] for g in out_groups), default=None),
            "checkouts": int(checkouts),
            "oldest_deadline_ms": oldest_ms,
            "oldest_deadline_in_s": _in_s(oldest_ms, now) if oldest_ms is not None else None,
            "returned": int(ready),
            "delayed": int(delayed),
            "dead_lettered": int(dead),
            "groups": out_groups,
        }


# -- rendering -------------------------------------------------------------------------


def _ago(seconds: float | None) -> Text:
    if seconds is None:
        return Text("–", style="dim")
    if seconds >= 0:
        return Text(f"in {seconds:.1f}s")
    return Text(f"{-seconds:.1f}s overdue", style="yellow")


def _table(title: str) -> Table:
    return Table(title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, pad_edge=False,
                 collapse_padding=True)


def render(console: Console, snap: dict[str, Any], redis_url: str) -> None:
    console.print(Text.assemble(
        ("FenceMQ status", "bold"), f"  redis {safe_url(redis_url)}  prefix {snap['prefix']}",
    ))
    render_memory(console, snap)
    render_workers(console, snap)
    render_sessions(console, snap)
    render_queues(console, snap)
    render_groups(console, snap)


def render_memory(console: Console, snap: dict[str, Any]) -> None:
    """The Redis's memory and policy on one line; the alarms, in red, when there are any."""
    r = snap["redis"]
    used, limit = r["used_memory"] / (1 << 20), r["maxmemory"] / (1 << 20)
    of = f" of {limit:,.1f} MiB ({100 * r['used_memory'] / r['maxmemory']:.0f}%)" if r["maxmemory"] else \
        " (no maxmemory)"
    policy = Text(r["maxmemory_policy"], style="green" if r["maxmemory_policy"] == "noeviction" else "bold red")
    console.print(Text.assemble(f"memory {used:,.1f} MiB{of}, maxmemory-policy ", policy))
    if not snap["alarms"]:
        return
    alarms = _table("Alarms")
    alarms.add_column("alarm", style="bold red")
    alarms.add_column("node", overflow="fold")
    alarms.add_column("since", justify="right")
    alarms.add_column("what", overflow="fold")
    for a in snap["alarms"]:
        alarms.add_row(a["alarm"], a["node"], f"{max(0, snap['now_ms'] - a['since_ms']) / 1000:.0f}s ago", a["detail"])
    console.print(alarms)


def render_workers(console: Console, snap: dict[str, Any]) -> None:
    workers = _table("Workers")
    workers.add_column("worker", overflow="fold")
    workers.add_column("state", min_width=5)
    workers.add_column("lease", min_width=10)
    for w in snap["workers"]:
        state = Text("alive", style="green") if w["alive"] else Text("gone", style="red")
        lease = Text(f"expires in {w['expires_in_s']:.1f}s") if w["alive"] else Text(
            f"expired {-w['expires_in_s']:.1f}s ago", style="dim")
        workers.add_row(Text(w["id"]), state, lease)
    if snap["workers"]:
        console.print(workers)
    else:
        console.print(Text("No workers have registered under this prefix.", style="yellow"))


def render_sessions(console: Console, snap: dict[str, Any]) -> None:
    if snap["sessions"]:
        sessions = _table("Sessions")
        sessions.add_column("client", overflow="fold")
        sessions.add_column("worker", overflow="fold")
        sessions.add_column("subs", justify="right", min_width=4)
        sessions.add_column("lease", min_width=10)
        for s in snap["sessions"]:
            lease = _ago(s["expires_in_s"]) if s["alive"] else Text("expired (being cleaned up)", style="yellow")
            sessions.add_row(Text(s["client"]), Text(s["worker"] or "–"), str(s["subscriptions"]), lease)
        console.print(sessions)
        if snap["truncated"]["sessions"]:
            console.print(Text(f"(first {len(snap['sessions'])} sessions shown; raise --limit)", style="dim"))
    else:
        console.print(Text("No sessions.", style="dim"))


def render_queues(console: Console, snap: dict[str, Any]) -> None:
    if not snap["queues"]:
        console.print(Text("No queues.", style="dim"))
        return
    queues = _table("Queues")
    queues.add_column("queue", overflow="fold", ratio=1, min_width=12)
    queues.add_column("last\nid", justify="right", min_width=4)
    queues.add_column("backlog", justify="right", min_width=7)
    queues.add_column("checked\nout", justify="right", min_width=7)
    queues.add_column("oldest\ndeadline", min_width=8)
    queues.add_column("returned", justify="right", min_width=8)
    queues.add_column("dead", justify="right", min_width=4)
    for q in snap["queues"]:
        queues.add_row(
            Text(q["name"], style="bold"),
            str(q["last_id"]),
            "–" if q["backlog"] is None else str(q["backlog"]),
            str(q["checkouts"]),
            _ago(q["oldest_deadline_in_s"]),
            str(q["returned"]),
            str(q["dead_lettered"]),
        )
    console.print(queues)
    if snap["truncated"]["queues"]:
        console.print(Text(f"(first {len(snap['queues'])} queues found shown; raise --limit)", style="dim"))


def _members(group: dict[str, Any]) -> Text:
    out = Text()
    for i, m in enumerate(group["members"]):
        if i:
            out.append(", ")
        out.append(m["id"], style="cyan" if m["id"] == group["owner"] else "")
        if m["evicted_by"] is not None:
            out.append(f" (evicted by {m['evicted_by']})", style="red")
        elif m["suspected"]:
            out.append(" (suspected)", style="yellow")
    return out if group["members"] else Text("–", style="dim")


def render_groups(console: Console, snap: dict[str, Any]) -> None:
    groups = _table("Subscription groups")
    groups.add_column("queue", overflow="fold", ratio=2, min_width=10)
    groups.add_column("group", overflow="fold", ratio=1, min_width=7)
    groups.add_column("mode", overflow="fold", min_width=9)
    groups.add_column("epoch", justify="right", min_width=5)
    groups.add_column("owner", overflow="fold", ratio=1, min_width=5)
    groups.add_column("backlog", justify="right", min_width=7)
    groups.add_column("checked\nout", justify="right", min_width=7)
    groups.add_column("members", overflow="fold", ratio=3, min_width=12)
    for q in snap["queues"]:
        for g in q["groups"]:
            groups.add_row(
                Text(q["name"]), Text(g["name"]), Text(g["mode"] or "?"), str(g["epoch"]),
                Text(g["owner"] or "–", style="cyan" if g["owner"] else "dim"),
                str(g["backlog"]), str(g["checkouts"]), _members(g),
            )
    if groups.row_count:
        console.print(groups)


def to_json(snap: dict[str, Any]) -> str:
    return json.dumps(snap, indent=2, sort_keys=False)
