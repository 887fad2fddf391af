"""Operator writes and live figures: evict, sweep, seek, purge, dead letters, top.

The other half of the operator CLI's Redis side (broker/operations.py lists,
broker/inspection.py inspects). Every write goes through a fence: ``evict``, ``seek`` and
``sweep`` reuse the broker's own (:class:`~fencemq.fences.core.Core`), ``purge``
and ``replay_dead`` have theirs (``lua/purge.lua``, ``lua/replay_dead.lua``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fencemq.config import Config
from fencemq.errors import BadArgument, NotFound
from fencemq.model import meta
from fencemq.model.keys import Keyspace, QueueRef
from fencemq.model.handles import Handle
from fencemq.model.messages import unpack_delivery
from fencemq.ops.operations import (
    PIPELINE_CHUNK,
    Progress,
    QueueFilter,
    _in_s,
    _meta_or_fail,
    display_name,
    now_ms,
    parse_meta,
    queue_info,
    queue_rows,
    scan_queues,
)
from fencemq.fences import at_rest
from fencemq.fences.core import Core
from fencemq.fences.lite import unsubscribe_notice
from fencemq.fences.operator import PURGE, REPLAY_DEAD
from fencemq.fences.registry import Fences
from fencemq.model.keys import queue_ref
from fencemq.model.records import DeadLetter, journal_events
from fencemq.model.values import integer as _int
from fencemq.model.values import text as _s

DEAD_LETTER_SCAN = 10_000  # dead letters a replay examines at most, from the head
PREVIEW_BYTES = 64

# -- writes: evict, sweep, seek ------------------------------------------------------------


def broker_config(keys: Keyspace) -> Config:
    """The workers' settings as the environment gives them (FENCEMQ_*), else the defaults.

    The operations that run a fence pass what the workers would: the lmq idle
    TTL, the sweep batch; the prefix is always ``keys``'.
    """
    try:
        return Config.from_env(prefix=keys.prefix)
    except ValueError:  # a FENCEMQ_* variable that does not parse: the workers would not start either
        return Config(prefix=keys.prefix)


def _queues(redis: Any, keys: Keyspace) -> Core:
    return Core(redis, broker_config(keys))


async def _redispatch(q: Core, ref: QueueRef) -> None:
    """Returned messages go to the queue's push members now, as the sweeper does."""
    await q.mailboxes.dispatch_all(ref)


async def evict(redis: Any, keys: Keyspace, ref: QueueRef, group: str, client: str,
                by: str = "operator") -> dict[str, Any]:
    """Fence ``client`` off the subscription (eviction marker, ownership dropped, checkouts
    back to the queue) and queue it an ``unsubscribe`` notice (``by`` = operator)."""
    await _meta_or_fail(redis, keys, ref)
    q = _queues(redis, keys)
    handle = Handle(ref, group, client)
    returned = await q.lite.evict(handle, by)
    if returned < 0:
        raise NotFound(f"{client!r} is not a member of group {group!r} of {display_name(ref)}; "
                       f"see `fencemq inspect group`")
    notice = unsubscribe_notice(handle, by)
    await q.sessions.notify(client, notice)
    if returned:
        await _redispatch(q, ref)
    return {**queue_info(ref.qid), "queue": display_name(ref), "group": group, "client": client,
            "returned": returned, "notice": notice}


async def sweep(redis: Any, keys: Keyspace, qids: list[str] | None = None, *, max_queues: int = 10_000,
                progress: Progress | None = None) -> dict[str, Any]:
    """Return expired leases now: of these queues, or (``qids`` None) of every queue that is due.

    Does what a worker's sweeper does for each queue: the sweep fence,
    redispatch to push members, a ``message_timeout`` notice to each member
    that lost a lease.
    """
    q = _queues(redis, keys)
    sessions = q.sessions
    results: list[dict[str, Any]] = []
    if qids is not None:
        for qid in qids:
            if not await at_rest.exists(redis, keys.queue_by_id(qid)):
                raise NotFound(f"no queue {qid!r} under prefix {keys.prefix!r} (ids as `fencemq queues` prints them)")
    due_mode = qids is None
    todo = list(qids or [])
    done = 0
    while True:
        if due_mode and not todo:
            if done >= max_queues:
                break
            todo = await q.leases.due_entries(await now_ms(redis), min(100, max_queues - done))
            if not todo:
                break
        if not todo:
            break
        qid, shard = todo.pop(0) if due_mode else (todo.pop(0), None)
        ref = queue_ref(qid)
        res = await q.leases.sweep(qid, shard)
        if res.returned:
            await _redispatch(q, ref)
        await sessions.tell_timeouts(ref, res.timeouts)
        notices = [{"group": group, "member": member, "tags": tags, "replaced_by": successor or None}
                   for group, member, tags, successor in res.timeouts]
        results.append({**queue_info(qid), "returned": res.returned, "next_due_ms": res.next_due if res.next_due >= 0
                        else None, "timeouts": notices})
        done += 1
        if progress is not None:
            progress(done, len(qids) if qids is not None else None)
    return {"queues": results, "swept": len(results), "returned": sum(r["returned"] for r in results),
            "now_ms": await now_ms(redis)}


SEEK_KINDS = ("id", "time", "earliest", "latest")


async def seek(redis: Any, keys: Keyspace, ref: QueueRef, group: str, kind: str, arg: int | None = None) -> dict[str, Any]:
    """Operator seek of a whole subscription group (the fence acts on the group, not a member)."""
    if kind not in SEEK_KINDS:
        raise BadArgument("seek takes id, time, earliest or latest")
    raw = await _meta_or_fail(redis, keys, ref)
    _fields, groups = parse_meta(raw)
    if group not in groups or meta.MODE not in groups[group]:
        raise NotFound(f"queue {display_name(ref)} has no group {group!r} (groups: {', '.join(groups) or 'none'})")
    g = groups[group]
    before = {"epoch": _int(g.get(meta.EPOCH)), "cursor": _int(g.get(meta.CURSOR), None)}
    member = g.get(meta.OWNER) or next(iter(g["members"]), None) or "operator"
    q = _queues(redis, keys)
    epoch, cursor, clamped = await q.seek.move(Handle(ref, group, member), kind, arg, operator=True)
    return {**queue_info(ref.qid), "queue": display_name(ref), "group": group, "target": kind, "arg": arg,
            "epoch": epoch, "cursor": cursor, "clamped": clamped, "before": before}


# -- purge ---------------------------------------------------------------------------------


async def purge(redis: Any, keys: Keyspace, ref: QueueRef, idle_ttl_ms: int | None = None) -> dict[str, Any]:
    """Drop every message a group has not been given yet, and every returned or delayed one
    (each group's cursor moves past the last message); checkouts are left alone."""
    await _meta_or_fail(redis, keys, ref)
    k = keys.queue(ref)
    ttl = (broker_config(keys).lmq_idle_ttl_ms if ref.lite else 0) if idle_ttl_ms is None else idle_ttl_ms
    res = await Fences(redis).run(PURGE, k, idle_ttl_ms=ttl)
    seq, flat = int(res[0]), res[1]
    groups = []
    for i in range(0, len(flat), 6):
        g, cursor_before, unread, returned, delayed, held = flat[i : i + 6]
        groups.append({"group": _s(g), "cursor_before": int(cursor_before), "cursor": seq + 1,
                       "unread": int(unread), "returned": int(returned), "delayed": int(delayed),
                       "checkouts_left": int(held)})
    return {**queue_info(ref.qid), "queue": display_name(ref), "seq": seq, "groups": groups,
            "dropped": sum(g["unread"] + g["returned"] + g["delayed"] for g in groups),
            "checkouts_left": sum(g["checkouts_left"] for g in groups)}


# -- dead letters -----------------------------------------------------------------------------


def _preview(payload: bytes, size: int = PREVIEW_BYTES) -> str:
    try:
        text = payload.decode("utf-8")
        if all(c.isprintable() or c in "\t" for c in text):
            return text if len(text) <= size else text[:size] + "…"
    except UnicodeDecodeError:
        pass
    hexed = payload[:size // 2].hex()
    return "0x" + hexed + ("…" if len(payload) > size // 2 else "")


def decode_dead_letter(ref: QueueRef, raw: bytes) -> dict[str, Any]:
    """A dead letter (records.DeadLetter) as a row: id, group, member, acquisitions, failures, ms, the message."""
    try:
        letter = DeadLetter.decode(raw)
    except Exception as exc:  # noqa: BLE001 - one bad entry must not hide the others
        return {"error": f"undecodable dead letter ({type(exc).__name__})", "raw_size": len(raw)}
    row: dict[str, Any] = {"id": letter.id, "group": letter.group, "member": letter.member,
                           "acquisitions": letter.acquisitions, "failures": letter.failures, "dead_ms": letter.ms}
    try:
        d = unpack_delivery(ref.topic, ref.lmq, 0, b"", letter.id, letter.acquisitions, letter.body)
    except Exception as exc:  # noqa: BLE001 - one bad entry must not hide the others
        row.update({"error": f"undecodable body ({type(exc).__name__})", "size": len(letter.body)})
        return row
    row.update({
        "published_ms": d.ts, "size": len(d.payload), "qos": d.qos, "producer": d.producer,
        "headers": d.headers or None, "topic": d.topic, "preview": _preview(d.payload),
    })
    try:
        row["payload"] = d.payload.decode("utf-8")
    except UnicodeDecodeError:
        import base64

        row["payload_b64"] = base64.b64encode(d.payload).decode()
    return row


async def dead_letters(redis: Any, keys: Keyspace, ref: QueueRef, *, limit: int = 20,
                       start: int = 0) -> dict[str, Any]:
    """The queue's dead letters, oldest first (``limit`` from position ``start``)."""
    await _meta_or_fail_or_dlq(redis, keys, ref)
    k = keys.queue(ref)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.llen(k.dead)
        pipe.lrange(k.dead, start, start + max(limit, 1) - 1)
        total, raw = await pipe.execute()
    entries = [decode_dead_letter(ref, r) for r in raw[:limit]]
    for i, e in enumerate(entries):
        e["position"] = start + i
    return {**queue_info(ref.qid), "queue": display_name(ref), "total": int(total), "dead_letters": entries,
            "now_ms": await now_ms(redis)}


async def _meta_or_fail_or_dlq(redis: Any, keys: Keyspace, ref: QueueRef) -> None:
    """A queue's dead letters outlive a reclaimed lmq's meta: either one makes it known."""
    if not await redis.exists(keys.queue(ref).dead):
        await _meta_or_fail(redis, keys, ref)


async def replay_dead(redis: Any, keys: Keyspace, ref: QueueRef, *, count: int = 1,
                      scan: int = DEAD_LETTER_SCAN, idle_ttl_ms: int | None = None) -> dict[str, Any]:
    """Put up to ``count`` dead letters back into their group's ready set (one atomic fence);
    those whose body retention already trimmed, or whose group is gone, stay dead letters."""
    if count < 1:
        raise BadArgument("count must be at least 1")
    await _meta_or_fail_or_dlq(redis, keys, ref)
    k = keys.queue(ref)
    q = _queues(redis, keys)
    ttl = (q.config.lmq_idle_ttl_ms if ref.lite else 0) if idle_ttl_ms is None else idle_ttl_ms
    res = await q.fences.run(REPLAY_DEAD, k, count=count, scan_limit=max(scan, count), idle_ttl_ms=ttl)
    replayed_flat, skipped_flat, left, examined = res[0], res[1], int(res[2]), int(res[3])
    replayed = [{"id": int(replayed_flat[i]), "group": _s(replayed_flat[i + 1]), "member": _s(replayed_flat[i + 2]),
                 "acquisitions": int(replayed_flat[i + 3]), "via": _s(replayed_flat[i + 4])}
                for i in range(0, len(replayed_flat), 5)]
    skipped = [{"position": int(skipped_flat[i]), "id": _int(skipped_flat[i + 1], None),
                "group": _s(skipped_flat[i + 2]), "reason": _s(skipped_flat[i + 3])}
               for i in range(0, len(skipped_flat), 4)]
    if replayed and await at_rest.exists(redis, k):
        await _redispatch(q, ref)
    return {**queue_info(ref.qid), "queue": display_name(ref), "replayed": replayed, "skipped": skipped,
            "examined": examined, "dead_letters_left": left}


# -- live figures (top) ----------------------------------------------------------------------


@dataclass
class TopState:
    """What ``top`` remembers between refreshes to turn counters into rates."""

    at_ms: int | None = None
    counters: dict[str, tuple[int, int]] = field(default_factory=dict)  # qid -> (seq, tag)
    journal_marks: dict[str, int] = field(default_factory=dict)  # qid -> ms of the newest event seen
    delivered: dict[str, tuple[int, int]] = field(default_factory=dict)  # qid -> (ms, members' delivered, summed)


JOURNAL_TAIL = 2000
RATE_EVENTS = ("pub", "out", "ack", "nack", "timeout", "dead")
COUNTERS = [meta.SEQ, meta.TAG, meta.AT_REST[meta.SEQ], meta.AT_REST[meta.TAG]]


async def top_sample(redis: Any, keys: Keyspace, state: TopState, *, limit: int = 20, scan_limit: int = 10_000,
                     flt: QueueFilter | None = None) -> dict[str, Any]:
    """One refresh of ``top``: the busiest ``limit`` queues (of the first ``scan_limit`` found)
    with rates since the previous refresh (publish from ``seq``, deliveries from the growth of
    the members' ``delivered`` counters, acks/nacks/timeouts from the journal), consumers and
    suspects. The delivery tag counter only says *whether* a queue delivered: a tag follows
    Redis's clock in microseconds (lua/lib/leases.lua), so its growth is not a count."""
    now = await now_ms(redis)
    page = await scan_queues(redis, keys, flt, limit=scan_limit)
    qids = page.qids
    counters: dict[str, tuple[int, int]] = {}
    for start in range(0, len(qids), PIPELINE_CHUNK * 5):
        chunk = qids[start : start + PIPELINE_CHUNK * 5]
        async with redis.pipeline(transaction=False) as pipe:
            for qid in chunk:
                # seq and tag, or the names an lmq at rest keeps them under (in its key or its slot's rest hash)
                at_rest.pipe_fields(pipe, keys.queue_by_id(qid), COUNTERS)
            replies = await pipe.execute()
            for i, qid in enumerate(chunk):
                seq, tag, rest_seq, rest_tag = at_rest.queue_fields(replies[2 * i : 2 * i + 2], COUNTERS)
                seq, tag = seq if seq is not None else rest_seq, tag if tag is not None else rest_tag
                if seq is not None or tag is not None:
                    counters[qid] = (_int(seq), _int(tag))
    elapsed = (now - state.at_ms) / 1000 if state.at_ms is not None else None

    def rate(qid: str, i: int) -> float | None:
        if not elapsed or qid not in state.counters:
            return None
        return max(0.0, (counters[qid][i] - state.counters[qid][i]) / elapsed)

    def activity(qid: str) -> tuple[float, bool, int]:
        delivered = qid in state.counters and counters[qid][1] != state.counters[qid][1]
        return rate(qid, 0) or 0, delivered, counters[qid][0]

    chosen = sorted(counters, key=activity, reverse=True)[:limit]
    rows = {r["qid"]: r for r in await queue_rows(redis, keys, chosen, now)}
    async with redis.pipeline(transaction=False) as pipe:
        for qid in chosen:
            pipe.lrange(keys.queue_by_id(qid).journal, -JOURNAL_TAIL, -1)
            at_rest.pipe_meta(pipe, keys.queue_by_id(qid))
        replies = await pipe.execute() if chosen else []
    out_rows = []
    suspects = []
    for i, qid in enumerate(chosen):
        if qid not in rows:
            continue
        tail, raw_meta = replies[3 * i], at_rest.queue_meta(replies[3 * i + 1 : 3 * i + 3])
        row = rows[qid]
        since = state.journal_marks.get(qid)
        events: dict[str, int] = dict.fromkeys(RATE_EVENTS, 0)
        newest = since
        lines = [line for entry in tail for line in journal_events(entry)]
        oldest_ms = lines[0].ms if lines else None
        for line in lines:
            newest = line.ms if newest is None or line.ms > newest else newest
            if since is not None and line.ms > since and line.event in events:
                events[line.event] += 1
        if newest is not None:
            state.journal_marks[qid] = newest
        window = (now - since) / 1000 if since is not None else None
        _fields, groups = parse_meta(raw_meta)
        delivered = sum(_int(m.get(meta.DELIVERED)) for g in groups.values() for m in g["members"].values())
        before = state.delivered.get(qid)
        # a member that left takes its count along: a sum that fell counts as none delivered
        deliver = (max(0, delivered - before[1]) / ((now - before[0]) / 1000)
                   if before is not None and now > before[0] else None)
        state.delivered[qid] = (now, delivered)
        row["rates"] = {
            "publish": rate(qid, 0),
            "deliver": deliver,
            **{f"journal_{ev}": (events[ev] / elapsed if elapsed and since is not None else None)
               for ev in ("ack", "nack", "timeout", "dead")},
        }
        # More events than the tail read since the last refresh: the journal rates are lower bounds.
        row["journal_rates_partial"] = bool(since is not None and len(tail) >= JOURNAL_TAIL and oldest_ms is not None
                                            and oldest_ms > since)
        row["journal_window_s"] = round(window, 3) if window is not None else None
        consumers = []
        for g, group in groups.items():
            for m, f in group["members"].items():
                consumers.append(m)
                since = _int(f.get(meta.SUSPECTED_SINCE), None) if meta.SUSPECTED_SINCE in f else None
                if meta.SUSPECTED_SINCE in f or meta.MARKER in f:
                    suspects.append({"queue": row["name"], "qid": qid, "group": g, "member": m,
                                     "suspected_for_s": _in_s(now, since) if since is not None else None,
                                     "marker": f.get(meta.MARKER)})
        row["consumers"] = sorted(set(consumers))
        out_rows.append(row)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.zcount(keys.workers, now, "+inf")
        pipe.zcount(keys.sessions, now, "+inf")
        pipe.zcard(keys.sessions)
        workers, sessions_alive, sessions_total = await pipe.execute()
    # the totals are rates against the previous refresh: taken before this one becomes the previous
    totals = {
        "publish": sum(r for q in counters if (r := rate(q, 0)) is not None) if elapsed else None,
        # of the queues shown: a count per queue needs its members, read only for those
        "deliver": sum(r["rates"]["deliver"] or 0 for r in out_rows) if elapsed else None,
    }
    if len(state.delivered) > 10 * max(limit, 1_000):  # queues long out of the busiest: forget them
        state.delivered = {r["qid"]: state.delivered[r["qid"]] for r in out_rows}
    state.at_ms = now
    state.counters = counters
    return {
        "now_ms": now,
        "interval_s": elapsed,
        "queues_seen": len(counters),
        "queues_truncated": page.cursor is not None,
        "workers_alive": int(workers),
        "sessions_alive": int(sessions_alive),
        "sessions": int(sessions_total),
        "totals": totals,
        "queues": out_rows,
        "suspected": suspects,
    }
