"""The health watcher: every worker runs one; one at a time judges the broker-wide alarms.

The worker that holds the watcher's lease (``health:watcher``, a few samples
long, renewed each sample) reads every Redis node (ops/redis_health.py),
remembers the replicas it saw, the workers' beats, the oldest message some
group has not acknowledged and the dead letters of the last window, and
raises and clears the alarms ops/alarm_rules.py wants, in the one store of
alarms (the memory guard's ``alarms`` hash, through ``alarm.lua``). If it
dies another takes the lease over within a few samples. Every worker also
judges its own limits (connections, a user's connections, a session's
subscriptions near their maximum), and exports every alarm of the store as
``fencemq_alarm`` (the memory guard sets its own kinds at once).

A Redis error skips a sample (logged once per outage); it never ends the worker.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import anyio

from fencemq.errors import FenceMQError
from fencemq.fences.memory import ALARM as ALARM_FENCE
from fencemq.fences.memory import read_alarms
from fencemq.fences.redis_errors import REDIS_FAILURES
from fencemq.fences.schedule_shards import ScheduleShards
from fencemq.model.values import text
from fencemq.ops import alarm_rules, history
from fencemq.ops.dashboard import oldest_pending_ms
from fencemq.ops.operations import queue_rows
from fencemq.ops.redis_health import HealthReader, remembered_nodes
from fencemq.server import metrics

log = logging.getLogger(__name__)

REASSERT_TOTALS_MS = 60_000  # how often a worker lists again the totals slots it listed (fences/registry.py)
REMEMBER_EVERY_MS = 60_000  # a node's record is written again at most this often while it answers
UNACKED_LOOK = 100  # queues looked at for the oldest unacknowledged message: the schedule's first


class HealthWatch:
    def __init__(self, services: Any, url: str | None = None) -> None:
        self.s = services
        self.config = services.config
        self.keys = services.keys
        self.redis = services.redis
        self.reader = HealthReader(self.redis, self.keys, url)
        self.totals = services.totals  # the worker's one reading of the totals, shared with its sampler
        self.health: Any = None  # the last Health this worker read (as watcher)
        self.watching = False
        self._failing = False
        self._reasserted_at = 0.0

    async def run(self) -> None:
        every = self.config.health_sample_ms / 1000
        try:
            while True:
                try:
                    await self.sample()
                    self._failing = False
                except (*REDIS_FAILURES, FenceMQError) as exc:
                    if not self._failing:
                        log.warning("could not judge the broker's health: %s", exc)
                    self._failing = True
                except Exception:  # a bug here must not take the worker down: the alarms go stale
                    log.exception("judging the broker's health failed")
                await anyio.sleep(every)
        finally:
            with anyio.CancelScope(shield=True):
                await self.reader.aclose()

    async def sample(self) -> None:
        self.watching = await self._hold_lease()
        if anyio.current_time() - self._reasserted_at >= REASSERT_TOTALS_MS / 1000:
            # the registry of totals slots is written once per slot per worker: one a failover lost is
            # made whole again by the workers that listed its slots
            await self.s.core.fences.reassert_totals()
            self._reasserted_at = anyio.current_time()
        # this worker's connections, for the overview's count (the watcher forgets those of workers gone)
        await self.redis.hset(self.keys.worker_figures, self.s.worker_id, self.s.gate.connections)
        on = await read_alarms(self.redis, self.keys)
        if self.watching:
            on = await self.judge_broker(on)
        on = await self.judge_own(on)
        metrics.alarms_seen(on)

    async def _hold_lease(self) -> bool:
        me = self.s.worker_id
        ms = 3 * self.config.health_sample_ms
        if await self.redis.set(self.keys.health_watcher, me, nx=True, px=ms):
            return True
        holder = await self.redis.get(self.keys.health_watcher)
        if holder is not None and holder.decode() == me:
            await self.redis.pexpire(self.keys.health_watcher, ms)
            return True
        return False

    async def judge_broker(self, on: list[Any]) -> list[Any]:
        now = await self.s.clock.now_ms()
        await self.record_history(now)
        health = await self.reader.read()
        self.health = health
        metrics.redis_health_read(health)
        await self._remember(health, now)
        wanted = alarm_rules.redis_alarms(health, self.config)
        workers = [(w.decode() if isinstance(w, bytes) else w, int(score))
                   for w, score in await self.redis.zrange(self.keys.workers, 0, -1, withscores=True)]
        stale = [w for w, deadline in workers if deadline < now - self.config.worker_forget_ms]
        if stale:
            await self.redis.zrem(self.keys.workers, *stale)
            log.warning("forgot worker(s) %s: silent for over %d min", ", ".join(stale),
                        self.config.worker_forget_ms // 60_000)
        listed = [w for w in workers if w[0] not in stale]
        wanted += alarm_rules.worker_alarms(listed, now, self.config)
        gone = [w for w in map(text, await self.redis.hkeys(self.keys.worker_figures))
                if w not in {x for x, _ in listed}]
        if gone:
            await self.redis.hdel(self.keys.worker_figures, *gone)
        # a worker's own alarm outlives it when it drains or dies: the watcher clears those of unlisted workers
        for name in sorted(a.name for a in on if a.kind in alarm_rules.OWN and a.node not in {w for w, _ in listed}):
            log.warning("%s alarm cleared: its worker is gone", name)
            await self.s.core.fences.run(ALARM_FENCE, None, extra_keys={"alarms": self.keys.alarms}, name=name,
                                         detail="")
        wanted += alarm_rules.unacked_alarm(await self.oldest_unacked(), now, self.config)
        wanted += alarm_rules.dead_letter_alarm(await self.dead_lettered_lately(now), self.config)
        return await self._apply(wanted, on, alarm_rules.WATCHED)

    async def judge_own(self, on: list[Any]) -> list[Any]:
        gate = self.s.gate
        wanted = alarm_rules.limit_alarms(self.s.worker_id, gate.connections, gate.users_held(),
                                          await gate.crowded_sessions(), self.config)
        return await self._apply(wanted, on, alarm_rules.OWN, subject=self.s.worker_id)

    async def _apply(self, wanted: list[alarm_rules.Wanted], on: list[Any], kinds: tuple[str, ...],
                     subject: str | None = None) -> list[Any]:
        raise_, clear = alarm_rules.differences(wanted, on, kinds, subject)
        fences = self.s.core.fences
        for w in raise_:
            log.error("%s alarm: %s", w.kind, w.detail)
            await fences.run(ALARM_FENCE, None, extra_keys={"alarms": self.keys.alarms}, name=w.name, detail=w.detail)
        for name in clear:
            log.warning("%s alarm cleared", name)
            await fences.run(ALARM_FENCE, None, extra_keys={"alarms": self.keys.alarms}, name=name, detail="")
        return await read_alarms(self.redis, self.keys) if raise_ or clear else on

    async def _remember(self, health: Any, now: int) -> None:
        """Note every node that answered (a node already noted, at most once a minute); forget the
        replicas gone longer than replica_forget_ms."""
        known = await remembered_nodes(self.redis, self.keys)
        up = {n.node for n in health.nodes if n.up}
        seen = {n.node: json.dumps({"role": n.role, "primary": n.primary, "seen_ms": now})
                for n in health.nodes if n.up and not _noted(known.get(n.node), n, now)}
        if seen:
            await self.redis.hset(self.keys.redis_nodes, mapping=seen)
        old = [node for node, rec in known.items()
               if node not in up and int(rec.get("seen_ms") or 0) < now - self.config.replica_forget_ms]
        if old:
            await self.redis.hdel(self.keys.redis_nodes, *old)
            log.warning("forgot Redis node(s) %s: away for over %d min", ", ".join(old),
                        self.config.replica_forget_ms // 60_000)

    async def oldest_unacked(self) -> tuple[str, int] | None:
        """(queue id, publish ms) of the oldest message some group has not acknowledged, among the queues
        whose leases fall due first (the schedule's first UNACKED_LOOK) and the largest backlogs."""
        qids: list[str] = []
        for shard in ScheduleShards(self.redis, self.keys).all():  # (a Cluster's schedule is in 16 shards)
            qids += [q.decode() if isinstance(q, bytes) else q
                     for q in await self.redis.zrange(self.keys.schedule_shard(shard)[0], 0, UNACKED_LOOK - 1)
                     if (q.decode() if isinstance(q, bytes) else q) not in qids]
        qids += [q for q in await self.backlog_queues() if q not in qids]
        if not qids:
            return None
        rows = await queue_rows(self.redis, self.keys, qids)
        firsts = await oldest_pending_ms(self.redis, self.keys, [r for r in rows if r])
        if not firsts:
            return None
        qid = min(firsts, key=lambda q: firsts[q])
        return qid, firsts[qid]

    async def backlog_queues(self) -> list[str]:
        """The queues (not lite topics) with the largest backlogs, from the counters the fences keep."""
        _, largest = await self.totals.read()
        return [e for e, _ in largest if not e.startswith("l:")]

    async def record_history(self, now: int) -> None:
        """A point of the broker's history for each series that is due (ops/history.py)."""
        due = await history.due(self.redis, self.keys, now)
        if not due:
            return
        figures, _ = await self.totals.read(fresh=True)  # a point is the totals at its own time
        figures["sessions"] = int(await self.redis.zcount(self.keys.sessions, now, "+inf"))
        figures["connections"] = sum(int(v) for v in await self.redis.hvals(self.keys.worker_figures))
        await history.record(self.redis, self.keys, due, now, figures)

    async def dead_lettered_lately(self, now: int) -> int | None:
        """Messages dead-lettered within the last alarm_dead_letter_window_ms: the counter now less its
        value in the history's newest point at least that old (None while the history is shorter)."""
        window = self.config.alarm_dead_letter_window_ms
        series = next((s for s in history.SERIES if s.range_ms >= window), history.SERIES[-1])
        then = await history.value_at(self.redis, self.keys, series, "dead_lettered", now - window)
        if then is None:
            return None
        return max(0, (await self.totals.read())[0]["dead_lettered"] - then)


def _noted(rec: dict[str, Any] | None, n: Any, now: int) -> bool:
    """The node's record says what it is now, and was written less than a minute ago."""
    return (rec is not None and rec.get("role") == n.role and rec.get("primary") == n.primary
            and now - int(rec.get("seen_ms") or 0) < REMEMBER_EVERY_MS)
