"""Consumer timeouts with suspicion (guarantee 5): checkouts, their leases, the sweep.

Every checkout has its own delivery tag and a lease: a deadline in the
queue's sorted set, shared by the checkouts of one PULL (a lease batch: one
deadline and one ownership entry for the batch, each checkout still settled
by its own tag); ACK, NACK and RENEW settle or extend it (lua/ack.lua,
nack.lua, renew.lua); a sweep returns the expired ones and marks their
holders suspected (lua/sweep.lua). The queues to sweep are found through a
global schedule (another slot than the queues', so written beside the fence:
``ZADD LT``, an entry that is too early only costs an empty sweep).
Lua side: lua/lib/leases.lua, lua/lib/checkouts.lua. Protocol: docs/protocol.md, "Leases".
"""

from __future__ import annotations

import asyncio
import logging

from dataclasses import dataclass, field
from typing import Any

from fencemq.errors import BadArgument, FenceMQError, Stale
from fencemq.fences.context import FenceContext
from fencemq.fences.gathering import Gathering
from fencemq.fences.mailbox import Mailboxes, parse_push_members
from fencemq.fences.redis_errors import REDIS_FAILURES
from fencemq.fences.registry import Fences, fence
from fencemq.model.handles import Handle
from fencemq.model.keys import QueueKeys
from fencemq.model.messages import Delivery, unpack_delivery
from fencemq.model.records import Checkout, batch_span, checkouts_in, held_under, is_batch_key
from fencemq.model.values import text

log = logging.getLogger(__name__)

_LEASE_KEYS = "meta log checkouts deadlines owned held ready delayed"


async def leases_held(redis: Any, k: QueueKeys, leases: list[list[str]]) -> list[int]:
    """For each list of leases (ownership entries' last fields, or deadline members) of queue ``k``,
    how many checkouts they hold: a tag one, a lease batch what its count says. One round trip."""
    batches = sorted({lease for group in leases for lease in group if is_batch_key(lease)})
    counts: dict[str, int] = {}
    if batches:
        counts = {key: int(n or 0) for key, n in zip(batches, await redis.hmget(k.checkouts, batches), strict=True)}
    return [held_under(group, counts) for group in leases]


async def queue_leases(redis: Any, k: QueueKeys) -> tuple[int, int]:
    """A queue's checkouts and how many of them are leased (have a deadline; the others wait in a push
    mailbox): the checkouts hash holds each lease batch's count beside the records. O(its leases)."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hlen(k.checkouts)
        pipe.zrange(k.deadlines, 0, -1)
        size, leases = await pipe.execute()
    leases = [text(lease) for lease in leases]
    (leased,) = await leases_held(redis, k, [leases])
    return checkouts_in(int(size), leases), leased


async def tags_of_leases(redis: Any, k: QueueKeys, leases: list[str]) -> list[str]:
    """The delivery tags under these leases (as the ownership index names them: a tag, or a lease
    batch's key, whose checkouts are its records in its range that still name it; lua/lib/checkouts.lua
    tags_of_leases)."""
    batches = [lease for lease in leases if is_batch_key(lease)]
    if not batches:
        return leases
    ranges = {key: [str(first + i) for i in range(span + 1)] for key in batches for first, span in [batch_span(key)]}
    async with redis.pipeline(transaction=False) as pipe:
        for key in batches:
            pipe.hmget(k.checkouts, ranges[key])
        found = dict(zip(batches, await pipe.execute(), strict=True))
    tags: list[str] = []
    for lease in leases:
        if not is_batch_key(lease):
            tags.append(lease)
            continue
        for tag, rec in zip(ranges[lease], found[lease], strict=True):
            if rec is not None and Checkout.decode(rec).lease(tag) == lease:
                tags.append(tag)
    return tags


PULL = fence("pull", f"{_LEASE_KEYS} journal mailbox waiters wake totals backlogs priority rest",
             "group member count default_lock_ms intent_at intent_ms look wid since wait_ms")
ACK = fence("ack", "meta checkouts deadlines owned held ready delayed log dedup dedup_ids dead journal wake totals backlogs priority rest",
            "group member idle_ttl_ms keep maxlen maxage_ms maxbytes", argv_rest="tags")
NACK = fence("nack", f"{_LEASE_KEYS} dead wake journal totals backlogs priority rest",
             "group member delay_ms discard max_failures release keep maxlen maxage_ms maxbytes",
             argv_rest="tags")
RENEW = fence("renew", "meta checkouts deadlines owned held wake totals backlogs rest", "group member lock_ms default_lock_ms", argv_rest="tags")
SWEEP = fence("sweep", f"{_LEASE_KEYS} wake journal scheduled totals backlogs rest", "limit")
UNSCHEDULE = fence("unschedule", "schedule intents", "qid quiet_ms")


# A PULL's reply (lua/pull.lua, Returns): epoch, deadline, status, refill, since, then 4 per delivery
# (a fenced status: what the member's notice said instead, lib/members.lua fenced_news).
PULL_REPLY_HEAD = 5
FENCED_WITH_NEWS = frozenset({"suspected", "evicted"})


@dataclass(slots=True)
class PullResult:
    epoch: int
    status: str  # ok | evicted | suspected | standby | ended; a long poll's look: handed | left | released
    deliveries: list[Delivery] = field(default_factory=list)
    since: str = ""  # a long poll's first look registered it (lua/lib/waiters.lua): the queue's last tag then
    timed_out: list[str] = field(default_factory=list)  # status suspected: the tags whose leases ran out


@dataclass(frozen=True, slots=True)
class Look:
    """One look of a ``PULL … BLOCK`` at its queue (lua/pull.lua, ARGV look): ``first`` registers the
    waiter, ``again`` and ``last`` see whether a publish handed it messages, ``recover`` fetches them,
    ``leave`` gives them back."""

    kind: str
    wid: str
    since: str = ""
    wait_ms: int = 0


@dataclass(slots=True)
class SweepResult:
    next_due: int
    returned: int
    timeouts: list[tuple[str, str, list[str], str]]  # group, member, tags, new active member
    newly_suspected: list[tuple[str, str]] = field(default_factory=list)  # (group, member)
    scheduled_due: int = -1  # when the queue's first scheduled message is due (-1: none): then it is released


class Leases:
    def __init__(self, ctx: FenceContext, mailboxes: Mailboxes) -> None:
        self.ctx = ctx
        self.mailboxes = mailboxes
        # The looks of many subscriptions at once (an MQTT reconnect storm resumes thousands, each
        # looking at its queue as soon as it is back, then again at the same backoff): gathered into
        # one round trip of lease intents and one of PULLs, as :meth:`pull` one by one would make them.
        self._looks: Gathering[tuple[Handle, int], PullResult] = Gathering(self._pull_batch, lambda: ctx.spawn)

    async def pull_gathered(self, handle: Handle, count: int = 1) -> PullResult:
        """:meth:`pull` (no long poll's look), gathered with the concurrent calls of other subscriptions."""
        return await self._looks((handle, count))

    async def _pull_batch(self, calls: list[tuple[Handle, int]]) -> list[PullResult | Exception]:
        """Each call's :meth:`pull`: the lease intents its queues need in one round trip, then every PULL
        in one; a PULL met STALE runs again alone under a fresh intent, as :meth:`FenceContext.under_intent`
        runs it. A call's error (a bad count, its queue gone) is its own."""
        config = self.ctx.config
        results: list[PullResult | Exception | None] = [None] * len(calls)
        valid = []
        for i, (_, count) in enumerate(calls):
            if 0 < count <= config.max_batch:
                valid.append(i)
            else:
                results[i] = BadArgument(f"COUNT must be between 1 and {config.max_batch}")
        intents = await self.ctx.lease_intents([calls[i][0].queue.qid for i in valid])
        sent, pulls = [], []
        for i in valid:
            handle, count = calls[i]
            intent = intents[handle.queue.qid]
            if isinstance(intent, Exception):
                results[i] = intent
                continue
            args = self._pull_args(handle, count, {"intent_at": intent, "intent_ms": config.lease_intent_ms})
            sent.append(i)
            pulls.append((PULL, self.ctx.keys.queue(handle.queue), args.pop("extra_keys"), (), args, ()))
        replies = await self.ctx.fences.run_each(pulls) if pulls else []
        for i, reply in zip(sent, replies, strict=True):
            handle, count = calls[i]
            try:
                if isinstance(reply, Stale):
                    results[i] = await self._pull_fresh(handle, count)
                else:
                    results[i] = await self._pulled(handle, Fences.check(reply))
                if results[i].since:  # type: ignore[union-attr]  # (as pull: only a long poll's look says it)
                    self.ctx.note_waiting(handle.queue.qid)
            except (FenceMQError, *REDIS_FAILURES) as exc:
                results[i] = exc
        return results  # type: ignore[return-value]

    async def _pull_fresh(self, handle: Handle, count: int) -> PullResult:
        """A PULL that met STALE, again under a fresh lease intent (STALE again is raised)."""
        k = self.ctx.keys.queue(handle.queue)
        intent = {"intent_at": await self.ctx.lease_intent(handle.queue.qid, fresh=True),
                  "intent_ms": self.ctx.config.lease_intent_ms}
        return await self._pulled(handle, await self.ctx.fences.run(PULL, k, **self._pull_args(handle, count, intent)))

    async def pull(self, handle: Handle, count: int = 1, look: Look | None = None) -> PullResult:
        config = self.ctx.config
        if not 0 < count <= config.max_batch:
            raise BadArgument(f"COUNT must be between 1 and {config.max_batch}")
        k = self.ctx.keys.queue(handle.queue)
        res = await self.ctx.under_intent(handle.queue.qid, lambda intent: self.ctx.fences.run(
            PULL, k, **self._pull_args(handle, count, intent, look)))
        result = await self._pulled(handle, res)
        if result.since:
            self.ctx.note_waiting(handle.queue.qid)  # this worker's next publishes to it hand off
        return result

    def _pull_args(self, handle: Handle, count: int, intent: dict[str, int],
                   look: Look | None = None) -> dict[str, Any]:
        k = self.ctx.keys.queue(handle.queue)
        return {"extra_keys": {"mailbox": k.mailbox(handle.group, handle.member)}, "group": handle.group,
                "member": handle.member, "count": count, "default_lock_ms": self.ctx.config.default_lock_ms,
                "look": look.kind if look else "", "wid": look.wid if look else "",
                "since": look.since if look else "", "wait_ms": look.wait_ms if look else 0, **intent}

    async def _pulled(self, handle: Handle, res: list[Any]) -> PullResult:
        """A PULL's reply (or a publish's hand-off to a long poll: the same layout) as a PullResult."""
        epoch, deadline, status, refill, since = int(res[0]), int(res[1]), text(res[2]), int(res[3]), text(res[4])
        if status in FENCED_WITH_NEWS:
            news = [text(item) for item in res[PULL_REPLY_HEAD:]]
            if news and self.ctx.on_fenced_poll is not None:
                await self.ctx.on_fenced_poll(handle, status, news)
            return PullResult(epoch, status, [], since, news if status == "suspected" else [])
        topic, lmq = handle.queue.topic, handle.queue.lmq
        deliveries = [
            unpack_delivery(topic, lmq, epoch, res[i], int(res[i + 1]), int(res[i + 2]), res[i + 3])
            for i in range(PULL_REPLY_HEAD, len(res), 4)
        ]
        if deadline >= 0:
            await self.ctx.schedule_soon(handle.queue.qid, deadline)
        if refill and deliveries:
            await self._refill(handle)  # a shared group's strategy refills its members
        return PullResult(epoch, status, deliveries, since)

    async def _refill(self, handle: Handle, members: list[tuple[str, str]] | None = None) -> None:
        """Dispatch to the queue's push members (``members``, when the call that took effect said
        them; else read) after a call that already took effect: a failure here (Redis failing over,
        a stale intent) is logged, not raised, or the caller would be told its PULL or NACK failed
        when it did not; the next publish, TAKE or sweep dispatches instead."""
        try:
            if members is None:
                await self.mailboxes.dispatch_all(handle.queue)
            else:
                await self.mailboxes.dispatch(handle.queue, members)
        except (FenceMQError, *REDIS_FAILURES) as exc:
            log.info("dispatch to the push members of %s put off (the next publish or sweep does it): %s",
                     handle.queue.qid, exc)

    async def handed(self, handle: Handle, reply: list[Any]) -> PullResult:
        """What a publish handed to a long poll of ``handle`` (lua/lib/waiters.lua): as its PULL's reply."""
        return await self._pulled(handle, reply)

    async def ack(self, handle: Handle, tags: list[str]) -> int:
        k = self.ctx.keys.queue(handle.queue)
        tags = self.ctx.tags(tags)
        return int(await self.ctx.fences.run(ACK, k, group=handle.group, member=handle.member,
                                             idle_ttl_ms=self.ctx.idle_ttl(handle.queue),
                                             **await self.ctx.retention.args(handle.queue.topic),
                                             args_rest=tags))

    async def ack_then_pull(self, handle: Handle, tags: list[str], count: int,
                            look: Look | None = None) -> tuple[int | Exception, PullResult | Exception]:
        """ACK, then PULL, of one member in one round trip (a client that pipelines them: the
        consume loop). Once anything ran, each outcome comes back, a refusal as its exception
        (bad arguments are raised before: then nothing ran). In Redis they run in this order,
        as one after the other would. ``look``: the PULL is a long poll's first look."""
        config = self.ctx.config
        if not 0 < count <= config.max_batch:
            raise BadArgument(f"COUNT must be between 1 and {config.max_batch}")
        k = self.ctx.keys.queue(handle.queue)
        tags = self.ctx.tags(tags)
        intent = {"intent_at": await self.ctx.lease_intent(handle.queue.qid),
                  "intent_ms": config.lease_intent_ms}
        pull_args = self._pull_args(handle, count, intent, look)
        acked, pulled = await self.ctx.fences.run_each([
            (ACK, k, {}, (), {"group": handle.group, "member": handle.member,
                              "idle_ttl_ms": self.ctx.idle_ttl(handle.queue),
                              **await self.ctx.retention.args(handle.queue.topic)}, tags),
            (PULL, k, pull_args.pop("extra_keys"), (), pull_args, ()),
        ])
        ack_outcome = acked if isinstance(acked, Exception) else int(acked)
        try:
            if isinstance(pulled, Stale):  # an old intent: the PULL alone again, under a fresh one
                return ack_outcome, await self.pull(handle, count, look)
            result = await self._pulled(handle, Fences.check(pulled))
            if result.since:
                self.ctx.note_waiting(handle.queue.qid)  # (as pull: a long poll's look registered it)
            return ack_outcome, result
        except (FenceMQError, *REDIS_FAILURES) as exc:
            return ack_outcome, exc

    async def nack(self, handle: Handle, tags: list[str], *, delay_ms: int = 0, discard: bool = False,
                   release: bool = False) -> int:
        """Checkouts returned (or discarded)."""
        return (await self.nack_counted(handle, tags, delay_ms=delay_ms, discard=discard, release=release))[0]

    async def nack_counted(self, handle: Handle, tags: list[str], *, delay_ms: int = 0, discard: bool = False,
                           release: bool = False) -> tuple[int, int]:
        """Checkouts returned (or discarded), and how many of them went to the dead-letter list.

        ``release``: handed back unprocessed, no failure counted (never dead-letters)."""
        if discard and release:
            raise BadArgument("NACK takes DISCARD or RELEASE, not both")
        config = self.ctx.config
        if not 0 <= delay_ms <= config.max_lock_ms:
            raise BadArgument(f"DELAY must be between 0 and {config.max_lock_ms} ms")
        k = self.ctx.keys.queue(handle.queue)
        tags = self.ctx.tags(tags)
        res = await self.ctx.fences.run(NACK, k, group=handle.group, member=handle.member, delay_ms=delay_ms,
                                        discard=int(discard), max_failures=config.max_failures,
                                        release=int(release), **await self.ctx.retention.args(handle.queue.topic),
                                        args_rest=tags)
        if int(res[2]) >= 0:
            await self.ctx.schedule(handle.queue.qid, int(res[2]))
        if res[3]:
            # returned to the group now: a push group's members take only from their mailboxes, so
            # the group's strategy gives it to one of them (else it waits for the next publish)
            await self._refill(handle, parse_push_members(res[3]))
        return int(res[0]), int(res[1])

    async def member_tags(self, handle: Handle) -> list[str]:
        """The tags of every checkout the member holds (leased, or waiting in its push mailbox):
        O(its own), read from the queue's ownership index."""
        k = self.ctx.keys.queue(handle.queue)
        prefix = f"{handle.group}\0{handle.member}\0".encode()
        owned = await self.ctx.linked.zrangebylex(k.owned, b"[" + prefix,
                                                 b"(" + f"{handle.group}\0{handle.member}\1".encode())
        return await tags_of_leases(self.ctx.linked, k, [m[len(prefix):].decode() for m in owned])

    async def alive(self, handle: Handle, tags: list[str] | None = None) -> int:
        """The member proves alive (a connection delivering to it): its suspicion is cleared and
        ``tags`` handed back unprocessed (NACK … RELEASE, no failure counted). Checkouts returned."""
        k = self.ctx.keys.queue(handle.queue)
        returned = 0
        tags = tags or []
        retention = await self.ctx.retention.args(handle.queue.topic)
        for start in range(0, max(len(tags), 1), self.ctx.config.max_batch):
            res = await self.ctx.fences.run(NACK, k, group=handle.group, member=handle.member, delay_ms=0,
                                            discard=0, max_failures=self.ctx.config.max_failures, release=1,
                                            **retention, args_rest=tags[start:start + self.ctx.config.max_batch])
            returned += int(res[0])
        return returned

    async def renew(self, handle: Handle, tags: list[str], *, lock_ms: int | None = None) -> int:
        config = self.ctx.config
        if lock_ms is not None and not 0 < lock_ms <= config.max_lock_ms:
            raise BadArgument(f"LOCK must be between 1 and {config.max_lock_ms} ms")
        k = self.ctx.keys.queue(handle.queue)
        res = await self.ctx.fences.run(RENEW, k, group=handle.group, member=handle.member, lock_ms=lock_ms or 0,
                                        default_lock_ms=config.default_lock_ms, args_rest=self.ctx.tags(tags))
        if int(res[0]):
            # A shorter LOCK can move a deadline before the queue's schedule entry.
            await self.ctx.schedule_soon(handle.queue.qid, int(res[1]))
        return int(res[0])

    async def sweep(self, qid: str, shard: int | None = None) -> SweepResult:
        """Return one queue's expired leases and reschedule it (in the schedule shard its entry was
        found in, fences/schedule_shards.py; by default the one it is written to now)."""
        redis, keys = self.ctx.redis, self.ctx.keys
        k = keys.queue_by_id(qid)
        shard = self.ctx.shards.shard_of(qid) if shard is None else shard
        schedule, intents = self.ctx.shards.keys_of(shard)
        res = await self.ctx.fences.run(SWEEP, k, limit=self.ctx.config.sweep_batch)
        next_due = int(res[0])
        if next_due < 0:
            # unlisted only once no lease intent is recent enough for a fence to still run under it
            await self.ctx.fences.run(UNSCHEDULE, None, extra_keys={"schedule": schedule, "intents": intents},
                                      qid=qid, quiet_ms=self.ctx.intent_quiet_ms)
        else:
            await self.ctx.set_scores(schedule, {qid: next_due})
        # A checkout made between the sweep and the line above was scheduled
        # with LT against the old (due) entry, which we just overwrote: look again.
        async with redis.pipeline(transaction=False) as pipe:
            pipe.zrange(k.deadlines, 0, 0, withscores=True)
            pipe.zrange(k.delayed, 0, 0, withscores=True)
            pipe.zrange(k.scheduled, 0, 0, withscores=True)
            firsts = await pipe.execute()
        dues = [int(f[0][1]) for f in firsts if f]
        if dues:
            await self.ctx.schedule(qid, min(dues), shard)
        timeouts = [(text(g), text(m), [text(t) for t in tags], text(s)) for g, m, tags, s, _ in res[2]]
        newly = [(text(g), text(m)) for g, m, _, _, fresh in res[2] if int(fresh)]
        return SweepResult(next_due, int(res[1]), timeouts, newly, int(res[3]))

    async def due_queues(self, now_ms: int, limit: int = 100) -> list[str]:
        return [qid for qid, _ in await self.due_entries(now_ms, limit)]

    async def due_entries(self, now_ms: int, limit: int = 100) -> list[tuple[str, int]]:
        """(queue id, schedule shard) of queues due by ``now_ms``, at most ``limit`` per shard; a shard
        whose master does not answer (failing over) is left to the next round."""
        shards = self.ctx.shards.all()
        redis = self.ctx.redis
        if len(shards) == 1:
            replies = [await redis.zrangebyscore(self.ctx.shards.keys_of(0)[0], "-inf", now_ms, 0, limit)]
        else:
            # one command per shard, side by side: a Cluster pipeline that meets a dead master closes
            # every connection of the client (redis-py), every other master's included
            replies = await asyncio.gather(*(redis.zrangebyscore(self.ctx.shards.keys_of(shard)[0], "-inf", now_ms,
                                                                 0, limit) for shard in shards),
                                           return_exceptions=True)
        return [(text(q), shard) for shard, reply in zip(shards, replies) if not isinstance(reply, BaseException)
                for q in reply]
