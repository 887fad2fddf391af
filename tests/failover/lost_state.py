"""After a failover run: the state, on the masters now, of each acknowledged message never delivered.

For every lost (topic, id): whether the log still holds it, the group's cursor,
whether it is checked out (``co``, ``dl``, ``held``, ``own``), returned (``rd``,
``dly``), in a mailbox; whether the queue is in the lease schedule (every
shard) and its intents; the members and their suspicion. A diagnostic: it
answers *where* a message the broker never delivered is stuck.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from typing import Any

import redis

from fencemq.model.keys import Keyspace, QueueRef
from fencemq.model.records import per_tag_view
from fencemq.fences.schedule_shards import SHARDS

KEYS = Keyspace()


def _t(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def lost_state(port: int, lost: list[tuple[str, str]]) -> dict[str, Any]:
    """``lost``: (topic, message id) pairs. One summary per topic."""
    r = redis.RedisCluster(host="127.0.0.1", port=port, socket_timeout=2)
    now = int(time.time() * 1000)
    by_topic: dict[str, list[int]] = defaultdict(list)
    for topic, mid in lost:
        by_topic[topic].append(int(mid))
    out: dict[str, Any] = {"now_ms": now}
    for topic, ids in by_topic.items():
        ref = QueueRef(topic)
        k = KEYS.queue(ref)
        meta = {_t(a): _t(b) for a, b in r.hgetall(k.meta).items()}
        # one lease per checkout (a lease batch's deadline is each of its checkouts')
        records, dl, _ = per_tag_view(r.hgetall(k.checkouts),
                                      {_t(a): int(b) for a, b in r.zrange(k.deadlines, 0, -1, withscores=True)}, [])
        co = {tag: _t(rec).split("\0") for tag, rec in records.items()}
        co_by_id = {int(v[2]): (tag, v) for tag, v in co.items() if len(v) > 2}
        rd = [_t(m).split("\0") for m in r.zrange(k.ready, 0, -1)]
        rd_ids = {int(m[1]) for m in rd if len(m) > 1}
        dly = [_t(m).split("\0") for m in r.zrange(k.delayed, 0, -1)]
        dly_ids = {int(m[1]) for m in dly if len(m) > 1}
        in_log = r.hmget(k.log, [str(i) for i in ids])
        states: Counter[str] = Counter()
        samples: list[dict[str, Any]] = []
        cur = {f: v for f, v in meta.items() if f.endswith("|cur")}
        for mid, body in zip(ids, in_log):
            state = []
            state.append("in-log" if body is not None else "not-in-log")
            if mid in co_by_id:
                tag, rec = co_by_id[mid]
                d = dl.get(tag)
                state.append(f"checked-out({'dl' if d is not None else 'no-dl'}"
                             f"{',expired' if d is not None and d < now else ''})")
            if mid in rd_ids:
                state.append("rd")
            if mid in dly_ids:
                state.append("dly")
            for f, c in cur.items():
                state.append(f"{'below' if mid < int(c) else 'at/above'}-{f}")
            states[" ".join(state)] += 1
            if len(samples) < 3:
                samples.append({"id": mid, "state": state, "co": co_by_id.get(mid)})
        schedule = {}
        for shard in range(SHARDS):
            sk, ik = KEYS.schedule_shard(shard)
            s, i = r.zscore(sk, ref.qid), r.zscore(ik, ref.qid)
            if s is not None or i is not None:
                schedule[shard] = {"due": s, "intent": i}
        mailboxes = {}
        for key in r.scan_iter(match=f"{k.meta}:mb:*", target_nodes=redis.RedisCluster.PRIMARIES):
            mailboxes[_t(key)] = r.llen(key)
        out[topic] = {
            "lost": len(ids), "lost_min": min(ids), "lost_max": max(ids), "states": dict(states),
            "samples": samples,
            "meta": meta,
            "checkouts": len(co), "deadlines": len(dl), "expired_deadlines": sum(1 for d in dl.values() if d < now),
            "held": r.zcard(k.held), "owned": r.zcard(k.owned), "rd": len(rd), "dly": len(dly),
            "waiters": [_t(w) for w in r.zrange(k.waiters, 0, -1)],
            "schedule": schedule, "mailboxes": mailboxes,
            "journal_tail": [_t(j) for j in r.lrange(k.journal, -12, -1)],
        }
    r.close()
    return out
