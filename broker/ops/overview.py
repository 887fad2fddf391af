"""Operator reads for the web UI: the workers, the sessions page, a dead letter's discard.

The overview itself is ops/dashboard.py. Like the rest of broker/ops/:
async, plain JSON-able data back, pipelined reads (not atomic), times on
Redis's clock.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from fencemq.errors import NotFound
from fencemq.fences import session_index
from fencemq.fences.operator import DISCARD_DEAD
from fencemq.fences.registry import Fences
from fencemq.model.keys import Keyspace
from fencemq.model.values import integer as _int
from fencemq.model.values import text as _s
from fencemq.ops.operations import PIPELINE_CHUNK, _in_s, now_ms

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

    One fence (lua/discard_dead.lua) drops the exact entry if it is still at that position, and
    counts it out of the broker's totals: a letter replayed or discarded meanwhile is not mistaken
    for its neighbour (the digest no longer matches, or the fence finds another entry there).
    """
    k = keys.queue(ref)
    raw = await redis.lindex(k.dead, position)
    removed = 0
    if raw is not None and dead_letter_digest(raw) == expect:
        removed = int(await Fences(redis).run(DISCARD_DEAD, k, position=position, entry=raw))
    if not removed:
        raise NotFound("that dead letter is no longer where it was shown (replayed or discarded meanwhile); "
                       "reload the list")
    return {"qid": ref.qid, "position": position, "discarded": removed, "dead_letters_left": int(await redis.llen(k.dead))}


def dead_letter_digest(raw: bytes) -> str:
    """A short name of one dead letter's exact bytes: what a discard must still find."""
    return hashlib.sha256(raw).hexdigest()[:16]
