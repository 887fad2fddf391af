"""What every part of the fences layer shares: Redis, the config, key names, the loaded fences.

The parts (one module per guarantee, plus publish, subscribe and sessions)
each take a :class:`FenceContext` and the parts below them; ``core.Core``
wires them together. None of them imports another's module but to call it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from fencemq.config import Config
from fencemq.errors import BadArgument, LimitExceeded, Stale
from fencemq.fences.durability import Durability
from fencemq.fences.memory import MemoryGuard
from fencemq.fences.redis_errors import REDIS_FAILURES
from fencemq.fences.redis_link import Linked
from fencemq.fences.registry import Fences, fence
from fencemq.fences.retention import Retention
from fencemq.fences.schedule_shards import ScheduleShards
from fencemq.model.handles import Handle
from fencemq.model.keys import Keyspace, QueueRef, check_name, check_topic
from fencemq.model.values import text

log = logging.getLogger(__name__)

LEASE_INTENT = fence("lease_intent", "schedule intents", "qid lock_ms")
INDEX_SCORES = fence("index_scores", "index", "mode", argv_rest="entries")
SCHEDULE_COALESCE_S = 0.001  # how long background schedule writes gather before one ZADD
WAITERS_REMEMBERED_S = 10.0  # a queue seen with long polls waiting: its publishes hand off to them this long


@dataclass
class FenceContext:
    redis: Any  # redis.asyncio.Redis or RedisCluster
    config: Config
    keys: Keyspace = field(init=False)
    fences: Fences = field(init=False)
    # the plain commands of the connect path (session state, held handles): on the fences' link once a
    # worker set one, else redis-py (fences/redis_link.py)
    linked: Linked = field(init=False)
    memory: MemoryGuard = field(init=False)  # the watermark and the eviction policy: every publish asks it
    retention: Retention = field(init=False)  # the topics' retention policies: what a log keeps
    # Set by a worker: runs a background write beside the reply (e.g. the
    # global lease schedule) instead of before it.
    spawn: Callable[..., None] | None = None
    # Set by a worker: its long polls' waiter ids begin with local_wids, and handed_here(wake channel,
    # wake-up message) hands them at once what a publish of this worker handed them (server/wakeups.py)
    local_wids: str = ""
    handed_here: Callable[[str, bytes], None] | None = None
    # Set by a worker: told of each PULL or TAKE that a fence stopped, with the fence ('suspected',
    # 'evicted') and what the member's notice said (the tags whose leases ran out; who took its place):
    # it tells the member again (server/sweeper.py), when the notice never reached it.
    on_fenced_poll: Callable[[Handle, str, list[str]], Awaitable[None]] | None = None
    _topic_kinds: dict[str, str] = field(init=False, default_factory=dict)
    _intents: dict[str, tuple[int, float]] = field(init=False, default_factory=dict)  # qid -> (Redis ms, monotonic)
    _due_soon: dict[str, int] = field(init=False, default_factory=dict)  # schedule writes not flushed yet
    _waiting: dict[str, float] = field(init=False, default_factory=dict)  # qid -> when long polls were seen on it

    def __post_init__(self) -> None:
        self.keys = Keyspace(self.config.prefix)
        self.fences = Fences(self.redis, Durability.parse(self.config.durability, self.config.durability_timeout_ms))
        self.linked = Linked(self.redis, self.fences)
        self.memory = MemoryGuard(self.redis, self.config, self.keys, self.fences)
        self.shards = ScheduleShards(self.redis, self.keys)
        self.retention = Retention(self.redis, self.keys, self.config)

    async def check_topic_kind(self, topic: str, lite: bool) -> None:
        """A topic is lite or plain for good (the first use decides); using it the other way is BADARG."""
        want = "lite" if lite else "plain"
        kind = self._topic_kinds.get(topic)
        if kind is None:
            key = self.keys.topic(topic)
            await self.redis.hsetnx(key, "kind", want)
            kind = text(await self.redis.hget(key, "kind"))
            self._topic_kinds[topic] = kind
        if kind != want:
            how = "with LMQ name" if kind == "lite" else "without LMQ"
            raise BadArgument(f"topic {topic!r} is a {kind} topic; use it {how}")

    def queue(self, topic: str, lmq: str | None) -> QueueRef:
        """A plain topic's queue, or one lmq of a lite topic, with both names checked."""
        check_topic(topic)
        if lmq is not None:
            check_name(lmq, "lmq")
        return QueueRef(topic, lmq)

    def idle_ttl(self, ref: QueueRef) -> int:
        """An lmq's idle TTL: how long an unowned, empty lmq lives; 0 for queues that are never reclaimed."""
        return self.config.lmq_idle_ttl_ms if ref.lite else 0

    @staticmethod
    def clock_ids(ref: QueueRef) -> int:
        """1 when ``ref``'s ids start at the clock: a queue that can be deleted and made again (an lmq,
        reclaimed when idle; a filter queue, dropped with its last member) must never give an id twice
        (docs/data-model.md, "Message ids"); 0: a plain topic, never deleted, starts at 1."""
        return 1 if ref.lite or ref.is_filter else 0

    def journal_cap(self, ref: QueueRef) -> int:
        return self.config.lite_journal_cap if ref.lite else self.config.journal_cap

    def tags(self, tags: list[str]) -> list[str]:
        """Delivery tags of one ACK, NACK or RENEW: at least one, at most a batch."""
        if not tags:
            raise BadArgument("give at least one delivery tag")
        if len(tags) > self.config.max_batch:
            raise LimitExceeded(f"{len(tags)} tags exceed {self.config.max_batch}; settle in smaller batches")
        return tags

    async def lease_intent(self, qid: str, fresh: bool = False) -> int:
        """The lease intent a lease-making fence on ``qid`` runs under (lua/lease_intent.lua).

        One is written per queue at most every half ``lease_intent_ms``: the
        fence holds it to ``lease_intent_ms`` by Redis's clock.
        """
        now = time.monotonic()
        known = None if fresh else self._known_intent(qid, now)
        if known is not None:
            return known
        spec, keys, extra, _, args, _ = self._intent_call(qid)
        at = int(await self.fences.run(spec, keys, extra_keys=extra, **args))
        self._remember_intents({qid: at}, now)
        return at

    def _known_intent(self, qid: str, now: float) -> int | None:
        """The intent written for ``qid`` less than half ``lease_intent_ms`` ago, if any."""
        known = self._intents.get(qid)
        if known is not None and (now - known[1]) * 1000 < self.config.lease_intent_ms / 2:
            return known[0]
        return None

    def _intent_call(self, qid: str) -> tuple:
        schedule, intents = self.schedule_keys(qid)
        return (LEASE_INTENT, None, {"schedule": schedule, "intents": intents}, (),
                {"qid": qid, "lock_ms": self.intent_quiet_ms}, ())

    def _remember_intents(self, written: dict[str, int], now: float) -> None:
        if len(self._intents) + len(written) > 65_536:
            self._intents.clear()
        for qid, at in written.items():
            self._intents[qid] = (at, now)

    async def lease_intents(self, qids: list[str]) -> dict[str, int | Exception]:
        """:meth:`lease_intent` of each queue (each once), those to write in one round trip: the intent,
        or the error its write met (a batch of first PULLs, fences/leases.py)."""
        now = time.monotonic()
        out: dict[str, int | Exception] = {}
        needed: list[str] = []
        for qid in dict.fromkeys(qids):
            known = self._known_intent(qid, now)
            if known is not None:
                out[qid] = known
            else:
                needed.append(qid)
        if not needed:
            return out
        replies = await self.fences.run_each([self._intent_call(qid) for qid in needed])
        written = {}
        for qid, reply in zip(needed, replies, strict=True):
            out[qid] = reply if isinstance(reply, Exception) else int(reply)
            if not isinstance(reply, Exception):
                written[qid] = int(reply)
        self._remember_intents(written, now)
        return out

    @property
    def intent_quiet_ms(self) -> int:
        """How long after its last lease intent a queue stays listed: longer than a fence may run under one.

        An intent lists the queue this far ahead too: if the worker dies after
        the fence, the sweep finds the lease then, and sets the real deadline.
        """
        return 2 * self.config.lease_intent_ms + 1000

    async def under_intent(self, qid: str, call: Callable[[dict[str, int]], Awaitable[Any]]) -> Any:
        """Run a lease-making fence call under a lease intent (``call(intent_args)``); once more on STALE."""
        args = {"intent_at": await self.lease_intent(qid), "intent_ms": self.config.lease_intent_ms}
        try:
            return await call(args)
        except Stale:
            args["intent_at"] = await self.lease_intent(qid, fresh=True)
            return await call(args)

    async def set_scores(self, index: str, scores: dict[str, int], mode: str = "") -> None:
        """ZADD [GT|LT] to one of the broker's index sorted sets (the schedule, the sessions', the workers'
        leases) through an allow-oom fence: this bookkeeping goes on when Redis is at maxmemory."""
        entries: list[Any] = []
        for member, score in scores.items():
            entries += [int(score), member]
        await self.fences.run(INDEX_SCORES, None, extra_keys={"index": index}, mode=mode, args_rest=entries)

    async def handoff_intent(self, qid: str) -> dict[str, int | str]:
        """A publish's lease intent: one when long polls were seen waiting on ``qid`` lately (the publish
        then hands them its messages: lua/lib/waiters.lua), else none ('': no hand-off)."""
        seen = self._waiting.get(qid)
        if seen is None or time.monotonic() - seen > WAITERS_REMEMBERED_S:
            return {"intent_at": "", "intent_ms": self.config.lease_intent_ms}
        return {"intent_at": await self.lease_intent(qid), "intent_ms": self.config.lease_intent_ms}

    async def waiters_seen(self, qid: str, handed: int) -> None:
        """What a publish said of ``qid``'s long polls: none wait (-1), some wait (0), or it handed them
        leases due at ``handed`` (scheduled like a PULL's)."""
        if handed < 0:
            self._waiting.pop(qid, None)
            return
        self.note_waiting(qid)
        if handed > 0:
            await self.schedule_soon(qid, handed)

    def note_waiting(self, qid: str) -> None:
        """A long poll waits on ``qid``: the next publishes to it run under a lease intent, to hand off."""
        if len(self._waiting) > 65_536:
            self._waiting.clear()
        self._waiting[qid] = time.monotonic()


    def schedule_keys(self, qid: str) -> tuple[str, str]:
        """(schedule, intents): where the queue's lease schedule entry is written now (fences/schedule_shards.py)."""
        return self.shards.keys_of(self.shards.shard_of(qid))

    async def schedule(self, qid: str, due_ms: int, shard: int | None = None) -> None:
        """The lease schedule (its shard for the queue, fences/schedule_shards.py): the queue is swept at
        ``due_ms`` at the latest."""
        shard = self.shards.shard_of(qid) if shard is None else shard
        await self.set_scores(self.shards.keys_of(shard)[0], {qid: due_ms}, "LT")

    async def schedule_soon(self, qid: str, due_ms: int) -> None:
        """:meth:`schedule`, in the background when a worker runs us: the writes of one
        millisecond go out together (one ZADD), after the replies that made their leases.

        Late by that millisecond is safe: the lease intent each lease-making fence ran
        under already lists the queue in the schedule (lua/lease_intent.lua)."""
        if self.spawn is None:
            await self.schedule(qid, due_ms)
            return
        flushing = bool(self._due_soon)
        known = self._due_soon.get(qid)
        if known is None or due_ms < known:
            self._due_soon[qid] = due_ms
        if not flushing:
            self.spawn(self._flush_schedule)

    async def _flush_schedule(self) -> None:
        await anyio.sleep(SCHEDULE_COALESCE_S)
        due, self._due_soon = self._due_soon, {}
        by_shard: dict[int, dict[str, int]] = {}
        for qid, due_ms in due.items():
            by_shard.setdefault(self.shards.shard_of(qid), {})[qid] = due_ms
        for shard, scores in by_shard.items():
            try:
                await self.set_scores(self.shards.keys_of(shard)[0], scores, "LT")
            except REDIS_FAILURES as exc:  # the lease intent listed the queue; the session's lease expiry returns them too
                log.warning("could not schedule the sweep of %d queues: %s", len(scores), exc)
            except Exception:  # a bug must not end the worker (this runs in its task group): the intent stands
                log.exception("scheduling the sweep of %d queues failed", len(scores))


def opt(value: object) -> object:
    """An optional fence argument: '' stands for none."""
    return "" if value is None else value
