"""Operator reads for the web UI's overview and sessions pages (broker/ui/).

Built on the same reads as ``fencemq top`` and ``fencemq status``
(:func:`~fencemq.ops.maintenance.top_sample`), so the CLI and the UI never
disagree; like the rest of broker/ops/: async, plain JSON-able data back,
pipelined reads (not atomic), times on Redis's clock.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

from fencemq.errors import NotFound
from fencemq.fences import session_index
from fencemq.model.keys import Keyspace
from fencemq.model.values import integer as _int
from fencemq.model.values import text as _s
from fencemq.ops.maintenance import TopState, top_sample
from fencemq.ops.operations import PIPELINE_CHUNK, _in_s, now_ms

# The audit counters: fence outcomes an operator wants to see move (journal events, summed over samples).
AUDIT_EVENTS = ("nack", "timeout", "dead")


@dataclass
class OverviewState:
    """What the overview remembers between samples: ``top``'s counters and the audit sums."""

    top: TopState = field(default_factory=TopState)
    audit: dict[str, float] = field(default_factory=lambda: dict.fromkeys(AUDIT_EVENTS, 0.0))
    samples: int = 0


async def workers(redis: Any, keys: Keyspace, now: int | None = None, lease_ms: int | None = None) -> list[dict[str, Any]]:
    """Every worker in the workers zset with its lease; ``last_beat_s`` (seconds ago) when ``lease_ms``
    (the workers' session lease, which each heartbeat renews) is known."""
    if now is None:
        now = await now_ms(redis)
    out = []
    for member, score in await redis.zrange(keys.workers, 0, -1, withscores=True):
        deadline = int(score)
        row = {"id": _s(member), "deadline_ms": deadline, "expires_in_s": _in_s(deadline, now), "alive": deadline > now}
        row["last_beat_s"] = round((now - (deadline - lease_ms)) / 1000, 1) if lease_ms else None
        out.append(row)
    out.sort(key=lambda w: w["id"])
    return out


async def oldest_checkouts(redis: Any, keys: Keyspace, qids: list[str], limit: int = 5) -> list[dict[str, Any]]:
    """The checkouts of these queues whose lease runs out first (the longest-unacked, for a common lease)."""
    if not qids:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        for qid in qids:
            pipe.zrange(keys.queue_by_id(qid).deadlines, 0, 0, withscores=True)
        replies = await pipe.execute()
    found = [(int(first[0][1]), qid) for qid, first in zip(qids, replies, strict=True) if first]
    found.sort()
    return [{"qid": qid, "deadline_ms": dl} for dl, qid in found[:limit]]


async def overview_sample(redis: Any, keys: Keyspace, state: OverviewState, *, scan_limit: int = 2000,
                          limit: int = 20, lease_ms: int | None = None) -> dict[str, Any]:
    """One sample of the overview page: rates, backlog, oldest unacked, sessions, workers, suspects, audit.

    Rates and backlog cover the queues ``top`` samples (the busiest ``limit`` of the first
    ``scan_limit`` found); ``queues_truncated`` says when there were more. The acknowledgement rate
    and the audit counters come from the queues' journals: queues whose journal is off add nothing.
    """
    top = await top_sample(redis, keys, state.top, limit=limit, scan_limit=scan_limit)
    now = top["now_ms"]
    rows = top["queues"]
    elapsed = top["interval_s"] or 0

    def total(name: str) -> float | None:
        known = [x for r in rows if (x := r["rates"].get(name)) is not None]
        return sum(known) if known else None  # None: no sampled queue keeps a journal

    for ev in AUDIT_EVENTS:
        rate = total(f"journal_{ev}")
        if rate:
            state.audit[ev] += rate * elapsed
    state.samples += 1
    oldest = await oldest_checkouts(redis, keys, [r["qid"] for r in rows])
    for o in oldest:
        o["expires_in_s"] = _in_s(o["deadline_ms"], now)
        o["name"] = next(r["name"] for r in rows if r["qid"] == o["qid"])
    backlogs = [r["backlog"] for r in rows if r["backlog"] is not None]
    return {
        "now_ms": now,
        "interval_s": top["interval_s"],
        "rates": {"publish": top["totals"]["publish"], "deliver": top["totals"]["deliver"],
                  "ack": total("journal_ack")},
        "backlog": sum(backlogs),
        "checkouts": sum(r["checkouts"] for r in rows),
        "dead_letters": sum(r["dead_letters"] for r in rows),
        "queues_seen": top["queues_seen"],
        "queues_truncated": top["queues_truncated"],
        "busiest": [{k: r[k] for k in ("qid", "name", "kind", "backlog", "checkouts", "dead_letters", "rates")}
                    for r in rows],
        "oldest_unacked": oldest,
        "sessions_alive": top["sessions_alive"],
        "sessions": top["sessions"],
        "workers": await workers(redis, keys, now, lease_ms),
        "suspects": top["suspected"],
        "audit": {
            **{ev: round(n) for ev, n in state.audit.items()},
            "suspected_now": sum(1 for s in top["suspected"] if s["suspected_for_s"] is not None),
            "evicted_now": sum(1 for s in top["suspected"] if s["marker"] is not None),
        },
    }


async def sessions_page(redis: Any, keys: Keyspace, *, start: int = 0, limit: int = 50,
                        match: str | None = None, cursor: int = 0) -> dict[str, Any]:
    """A page of sessions with worker, connection, lease and subscriptions.

    Without ``match``: ``limit`` from rank ``start`` of the sessions zset (soonest
    lease first), ``next`` the rank of the next page. With ``match``: the clients
    whose id contains it, found by ZSCAN from ``cursor`` (``next`` the cursor to go
    on from; None at the end), so a search among millions reads a page at a time.
    ``user`` is the user that owns the client id (``client-owners``: the first user that
    named it; None for a session named without users).
    """
    now = await now_ms(redis)
    total = int(await redis.zcard(keys.sessions))
    nxt: int | None
    if match:
        pattern = "*" + re.sub(r"([*?\[\]\\])", r"\\\1", match) + "*"
        raw: list[tuple[Any, float]] = []
        while True:
            cursor, batch = await redis.zscan(keys.sessions, cursor, match=pattern, count=1000)
            raw.extend(batch)
            if int(cursor) == 0 or len(raw) >= limit:
                break
        nxt = int(cursor) or None
    else:
        raw = await redis.zrange(keys.sessions, start, start + limit - 1, withscores=True) if limit > 0 else []
        nxt = start + limit if start + limit < total else None
    out: list[dict[str, Any]] = []
    for begin in range(0, len(raw), PIPELINE_CHUNK):
        chunk = raw[begin : begin + PIPELINE_CHUNK]
        counting = [session_index.count_commands(keys, _s(member)) for member, _ in chunk]
        async with redis.pipeline(transaction=False) as pipe:
            for (member, _), commands in zip(chunk, counting, strict=True):
                pipe.hmget(keys.session(_s(member)), "worker", "conn", "since")
                pipe.hget(keys.client_owners, _s(member))
                for cmd in commands:
                    pipe.execute_command(*cmd)
            replies = iter(await pipe.execute())
        for (member, score), commands in zip(chunk, counting, strict=True):
            worker, conn, since = next(replies)
            user = next(replies)
            subs = sum(int(next(replies)) for _ in commands)
            deadline = int(score)
            out.append({"client": _s(member), "user": _s(user) if user is not None else None, "worker": _s(worker) if worker is not None else None,
                        "connection": _s(conn) if conn is not None else None, "since_ms": _int(since, None),
                        "lease_deadline_ms": deadline, "lease_in_s": _in_s(deadline, now), "alive": deadline > now,
                        "subscriptions": subs})
    return {"now_ms": now, "total": total, "start": start, "next": nxt, "match": match, "sessions": out}


async def discard_dead(redis: Any, keys: Keyspace, ref: Any, position: int, expect: str) -> dict[str, Any]:
    """Drop the dead letter at ``position`` if it is still the one shown (``expect``: its digest).

    One LREM of the exact entry: atomic on its own, so a letter replayed or
    discarded meanwhile is not mistaken for its neighbour (the digest no longer matches).
    """
    k = keys.queue(ref)
    raw = await redis.lindex(k.dead, position)
    if raw is None or dead_letter_digest(raw) != expect:
        raise NotFound("that dead letter is no longer where it was shown (replayed or discarded meanwhile); "
                       "reload the list")
    removed = int(await redis.lrem(k.dead, 1, raw))
    return {"qid": ref.qid, "position": position, "discarded": removed, "dead_letters_left": int(await redis.llen(k.dead))}


def dead_letter_digest(raw: bytes) -> str:
    """A short name of one dead letter's exact bytes: what a discard must still find."""
    return hashlib.sha256(raw).hexdigest()[:16]
