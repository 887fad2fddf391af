"""The overview's reads (broker/ui/): true totals, the entries with the largest backlogs, ages, suspects.

Nothing here scans the queues: the broker-wide figures and each entry's are
the counters the fences keep (ops/totals.py); the busiest table is the
entries ranked by backlog (the ``backlogs`` sorted set) with those that
published the most since the previous sample; ages and suspects are read
from the few queues shown and from the front of the lease schedule (the
queues whose leases fall due first). The cost is bounded by what the page
shows, whatever the number of queues. Rates are differences between two
samples (``OverviewState`` keeps the previous one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fencemq.fences import at_rest
from fencemq.model import meta
from fencemq.model.keys import Keyspace
from fencemq.model.values import integer as _int
from fencemq.model.values import text as _s
from fencemq.ops import totals as counted
from fencemq.ops.operations import _in_s, now_ms, parse_meta, queue_info
from fencemq.ops.overview import workers

# card/chart name -> the event counter it is the rate of
RATES = {"publish": "published", "deliver": "delivered", "ack": "acked", "redeliver": "redelivered",
         "nack": "nacked", "timeout": "timeouts", "dead": "dead_lettered"}
SORTS = ("backlog", "age", "rate", "out", "dead")
SCHEDULE_LOOK = 20  # queues at the front of the lease schedule read for ages and suspects
RISERS = 10  # entries that published the most since the previous sample, shown beside the largest backlogs


@dataclass
class OverviewState:
    """The previous sample: its time, its totals and each entry's published count."""

    at_ms: int | None = None
    totals: dict[str, int] = field(default_factory=dict)
    published: dict[str, tuple[int, int]] = field(default_factory=dict)  # entry -> (ms, published)


async def queue_looks(redis: Any, keys: Keyspace, qids: list[str]) -> dict[str, dict[str, Any]]:
    """What the overview needs of a few queues, in one round trip: their name, the lowest id some group has
    yet to read (``oldest_unread``, for :func:`oldest_pending_ms`) and their members suspected or fenced
    off (``flagged``); a queue that is gone is left out. (The figures come from the counters.)"""
    async with redis.pipeline(transaction=False) as pipe:
        for qid in qids:
            at_rest.pipe_meta(pipe, keys.queue_by_id(qid))
        replies = await pipe.execute() if qids else []
    out = {}
    for i, qid in enumerate(qids):
        raw = at_rest.queue_meta(replies[2 * i : 2 * i + 2])
        if not raw:
            continue
        fields, groups = parse_meta(raw)
        first = _int(fields.get(meta.FIRST), 1)
        cursors = [max(_int(g.get(meta.CURSOR), first), first) for g in groups.values()]
        unread = [meta.past_gap(fields, c) for c in cursors if meta.unread(fields, c) > 0]
        out[qid] = {"qid": qid, "name": queue_info(qid)["name"], "oldest_unread": min(unread) if unread else None,
                    "flagged": [(g, m, f) for g, group in groups.items() for m, f in group["members"].items()
                                if meta.SUSPECTED_SINCE in f or meta.MARKER in f]}
    return out


async def oldest_pending_ms(redis: Any, keys: Keyspace, rows: list[dict[str, Any]]) -> dict[str, int]:
    """Publish time of each queue's oldest message not yet acknowledged by every group.

    That message is the lowest of: each group's cursor (its next unread id), the
    first returned message waiting in ``rd`` (its first group's oldest: one lookup,
    not a scan), and the lowest id checked out (the holding index, by id).
    """
    firsts: dict[str, int] = {}
    async with redis.pipeline(transaction=False) as pipe:
        for row in rows:
            k = keys.queue_by_id(row["qid"])
            pipe.zrange(k.ready, 0, 0)
            pipe.zrange(k.held, 0, 0, withscores=True)
        replies = await pipe.execute() if rows else []
    async with redis.pipeline(transaction=False) as pipe:
        looked = []
        for i, row in enumerate(rows):
            ready, held = replies[2 * i : 2 * i + 2]
            candidates = [row["oldest_unread"]] if row.get("oldest_unread") is not None else []
            if ready:
                candidates.append(int(ready[0].split(b"\0")[1]))
            if held:
                candidates.append(int(held[0][1]))
            if candidates:
                pipe.hget(keys.queue_by_id(row["qid"]).log, min(candidates))
                looked.append(row["qid"])
        entries = await pipe.execute() if looked else []
    for qid, entry in zip(looked, entries, strict=True):
        if entry:
            firsts[qid] = int(entry.split(b":", 1)[0])  # the publish ms the fence stamped
    return firsts


def rates_since(t: dict[str, int], state: OverviewState, now: int) -> dict[str, float | None]:
    """Each event's rate per second since the previous sample (None on the first)."""
    elapsed = (now - state.at_ms) / 1000 if state.at_ms is not None and now > state.at_ms else None
    return {name: (max(0, t[c] - state.totals[c]) / elapsed if elapsed and c in state.totals else None)
            for name, c in RATES.items()}


async def overview_sample(redis: Any, keys: Keyspace, state: OverviewState, *, lease_ms: int | None = None,
                          limit: int = 20) -> dict[str, Any]:
    """One sample of the overview: totals and their rates, counts, the busiest entries, the oldest
    unacknowledged messages, suspects, sessions and workers."""
    now = await now_ms(redis)
    t = await counted.read_totals(redis, keys)
    rates = rates_since(t, state, now)
    largest = await counted.largest_backlogs(redis, keys, limit)
    entries = [e for e, _ in largest]
    published = await counted.published_entries(redis, keys)
    if published is not None and state.published:
        rising = sorted((p - state.published[e][1], e) for e, p in published.items()
                        if e in state.published and p > state.published[e][1])
        entries += [e for _, e in reversed(rising[-RISERS:]) if e not in entries]
    figures = await counted.entry_figures(redis, keys, entries)
    plain = [e for e in entries if not e.startswith("l:")]  # a queue of its own: its ages and members are read
    front = [_s(q) for q in await redis.zrange(keys.schedule, 0, SCHEDULE_LOOK - 1)]
    looked = list(dict.fromkeys(plain + front))
    rows = await queue_looks(redis, keys, looked)
    firsts = await oldest_pending_ms(redis, keys, list(rows.values()))
    busiest = []
    for e in entries:
        f = figures[e]
        name, kind = counted.entry_name(e)
        before = state.published.get(e)
        rate = (max(0, f["published"] - before[1]) / ((now - before[0]) / 1000)
                if before is not None and now > before[0] else None)
        age = round((now - firsts[e]) / 1000, 1) if e in firsts else None
        busiest.append({"entry": e, "name": name, "kind": kind, "backlog": f["ready"], "out": f["out"],
                        "delayed": f["delayed"], "dead": f["dead"], "scheduled": f["scheduled"], "lmqs": f["lmqs"], "rate": rate, "age_s": age,
                        "link": f"/lmqs?topic={name}" if kind == "lite" else None})
    oldest = sorted(((now - ms) / 1000, qid) for qid, ms in firsts.items())[::-1][:5]
    suspects = []
    for qid, row in rows.items():
        for g, m, f in row["flagged"]:
            since = _int(f.get(meta.SUSPECTED_SINCE), None) if meta.SUSPECTED_SINCE in f else None
            suspects.append({"queue": row["name"], "qid": qid, "group": g, "member": m,
                             "suspected_for_s": _in_s(now, since) if since is not None else None,
                             "marker": f.get(meta.MARKER)})
    async with redis.pipeline(transaction=False) as pipe:
        pipe.zcount(keys.sessions, now, "+inf")
        pipe.zcard(keys.sessions)
        pipe.hgetall(keys.worker_figures)
        sessions_alive, sessions, figures_raw = await pipe.execute()
    ws = await workers(redis, keys, now, lease_ms)
    connections = 0
    for w in ws:  # each worker notes its connections at every health sample (server/health_watch.py)
        w["connections"] = _int(figures_raw.get(w["id"].encode()), None)
        if w["alive"] and w["connections"] is not None:
            connections += w["connections"]
    state.at_ms, state.totals = now, t
    if published is not None:
        state.published = {e: (now, p) for e, p in published.items()}
    else:
        state.published = {e: (now, figures[e]["published"]) for e in entries}
    return {
        "now_ms": now,
        "totals": t,
        "rates": rates,
        "busiest": busiest,
        "risers_known": published is not None,
        "oldest_unacked": [{"qid": q, "name": rows[q]["name"], "age_s": round(age, 1)} for age, q in oldest],
        "suspects": suspects,
        "sessions_alive": int(sessions_alive),
        "sessions": int(sessions),
        "connections": connections,
        "workers": ws,
    }


def sort_rows(rows: list[dict[str, Any]], by: str, desc: bool = True) -> list[dict[str, Any]]:
    """The busiest table sorted by backlog, age, rate, checkouts or dead letters (unknown values last)."""
    key = {"backlog": "backlog", "age": "age_s", "rate": "rate", "out": "out", "dead": "dead"}[by]
    known = [r for r in rows if r[key] is not None]
    unknown = [r for r in rows if r[key] is None]
    return sorted(known, key=lambda r: (r[key], r["backlog"]), reverse=desc) + unknown
