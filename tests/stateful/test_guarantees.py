"""All five guarantees at once, driven by a model through hostile and unlucky moves.

A hypothesis rule-based machine plays three consumers and a producer against
two real workers (one in this process, one a process of its own that a move
may kill with SIGKILL) in front of one real Redis. Besides the ordinary moves
(publish, subscribe to a durable group, a `$share` filter group or an lmq,
pull, ack, nack, seek, unsubscribe) it makes the moves the audit of the seal
issue made: out-of-range numbers, handles forged to name the caller in
subscriptions it never joined, a `$share` queue dropped and re-created, a
connection dropped between a PULL and its ACK, a session expiring, Redis
pausing past a lease, a worker dying between two calls, a queue whose ids
another server gave (a failover's: its next ids jump above the clock).

After every step the invariants are read off the real server:

* nothing acknowledged to a producer is lost: every message published to the
  durable group since its last SEEK and not yet settled there is still in the
  log and on its way to a member (ahead of the cursor, returned, delayed,
  checked out or dead-lettered);
* nothing is delivered to a member after its eviction, nor under an epoch
  older than a SEEK that returned;
* no tag is handed out twice under one handle (re-created queues included);
* epochs only grow;
* a message is settled at most once per group (between two SEEKs);
* no membership, marker, ownership or checkout names a client whose session
  is gone;
* the broker's totals the fences keep equal a full count of every queue.

`make test` runs a few dozen sequences; `make test-stateful` (run by CI after
`make test`) runs FENCEMQ_STATEFUL_EXAMPLES of them, split into FENCEMQ_STATEFUL_SHARDS
tests that run side by side (each shard its own random sequences, server and workers).
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from fencemq.model import meta as fields
from fencemq.model.keys import Keyspace, QueueRef
from fencemq.model.handles import Handle
from fencemq.model.messages import EXPIRES
from fencemq.model.records import is_batch_key
from fencemq.ops.priority import set_priority
from tests.ops.test_totals import checkpoint, run_async
from tests.helpers import (
    as_map, checkout_records, client, deliveries, direct_async, error_code, free_port, in_cluster_mode, subprocess_worker,
    text, wait_for, worker,
)

KEYS = Keyspace("fmq")
EXAMPLES = int(os.environ.get("FENCEMQ_STATEFUL_EXAMPLES", "30"))
# The sequences are split into SHARDS tests of their own, so pytest-xdist runs them side by side (each on its
# own server and workers): a sequence mostly waits (past TTLs, due times, session leases), not for the CPU.
SHARDS = max(1, int(os.environ.get("FENCEMQ_STATEFUL_SHARDS", "1")))
LOCK_MS = 400  # short enough that pauses and slow steps let leases lapse, long enough to ack most
WORKER_SETTINGS = {"session_lease_ms": 1500, "sweep_interval_ms": 50}
RUNS = itertools.count(1)
# Every sequence names queues of its own; after this many the workers start again on a flushed Redis
SEQUENCES_PER_FLUSH = 10
TARGETS = ("group", "share", "lmq")


def refusal(exc: BaseException) -> str:
    return error_code(exc)


@dataclass
class Consumer:
    cid: str
    worker: int  # 0: the in-process worker, 1: the process a move may kill
    conn: redis.Redis | None = None
    handles: dict[str, str] = field(default_factory=dict)  # target -> handle it holds now
    fetched: dict[str, list[tuple[str, int, int]]] = field(default_factory=dict)  # target -> [(tag, id, epoch)]


class Workers:
    """The two workers every sequence shares: one in this process, one killable."""

    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url
        self.start()

    def start(self) -> None:
        self.inside = worker(self.redis_url, **WORKER_SETTINGS).start()
        self.outside_port = free_port()
        self.outside = subprocess_worker(self.redis_url, self.outside_port, **WORKER_SETTINGS)
        self.sequences = 0  # run since Redis was last flushed

    def port(self, which: int) -> int:
        return self.inside.port if which == 0 else self.outside_port

    def kill_outside(self) -> None:
        """SIGKILL: no session ends, no lease is given back; the other worker's sweeper must clean up."""
        self.outside.send_signal(signal.SIGKILL)
        self.outside.wait()
        self.outside_port = free_port()
        self.outside = subprocess_worker(self.redis_url, self.outside_port, **WORKER_SETTINGS)

    def stop(self) -> None:
        self.outside.send_signal(signal.SIGKILL)
        self.outside.wait()
        self.inside.stop()

    def start_afresh(self, direct: redis.Redis) -> None:
        """Both workers stopped, Redis flushed, both started again: no sequence leaves queues behind for the
        next ones' totals check to count (a count of every queue after every step: the keys of a shard's
        250 sequences made that quadratic, half an hour of a shard's time)."""
        self.stop()
        direct.flushall()
        self.start()


class Guarantees(RuleBasedStateMachine):
    workers: Workers
    redis: redis.Redis

    def __init__(self) -> None:
        super().__init__()
        self.run = next(RUNS)
        if self.workers.sequences == SEQUENCES_PER_FLUSH:
            self.workers.start_afresh(self.redis)
        self.workers.sequences += 1
        base = f"st{self.run}"
        self.topic, self.lite_topic, self.filter_topic = f"{base}/t", f"{base}/lt", f"{base}/f/a"
        self.share_filter = f"$share/s/{base}/f/#"
        self.queues = {"group": QueueRef(self.topic), "share": QueueRef(f"{base}/f/#", None, "$share/s"),
                       "lmq": QueueRef(self.lite_topic, "l0")}
        self.consumers = [Consumer(f"x{self.run}c{i}q", worker=i % 2) for i in range(3)]
        self.producer = client(self.workers.port(0), 2, f"x{self.run}pq")
        # the model
        self.published: dict[str, list[int]] = {"group": [], "share": [], "lmq": []}
        # A filter queue numbers its own copies: the ids MPUB answers are the topic's, and the topic also
        # holds what was published before the filter SUB (never copied). What reaches 'share' is checked
        # by payload, each publish's unique.
        self.shared_payloads: set[str] = set()
        self.sent = 0
        self.loss_checked_from = 0  # ids of the durable group below this were published before its last SEEK
        self.settled: set[tuple[str, int]] = set()  # (target, id) settled since that target's last SEEK
        self.seek_epoch: dict[str, int] = {}  # target -> epoch its last SEEK returned
        self.epochs: dict[tuple[str, str], int] = {}  # (queue key, group field) -> highest epoch seen
        self.tags_seen: dict[str, set[str]] = {}  # handle -> every tag delivered under it
        self.evicted: dict[str, str] = {}  # lmq handle -> who preempted it (its PULLs must stay empty)
        self.lmq_owner: str | None = None
        self.killed = False
        # published for later and/or with a TTL (issue 34): payload -> its due time (Redis ms; 0: at once).
        # Not in `published`: one that expires is settled unsent, and a scheduled one has no message id yet.
        self.timed: dict[str, int] = {}
        # the durable group's topic honours PUB … PRIORITY (issue 34): its publishes take a level, and every
        # guarantee below holds of a queue read level by level
        run_async(self.honour_priority())

    async def honour_priority(self) -> None:
        r = direct_async(self.workers.redis_url)
        try:
            await set_priority(r, KEYS, self.queues["group"], True)
        finally:
            await r.aclose()

    # -- plumbing -----------------------------------------------------------------------------

    def conn(self, c: Consumer) -> redis.Redis:
        if c.conn is None:
            c.conn = client(self.workers.port(c.worker), 2, c.cid, timeout=15)
        return c.conn

    def subscribe_args(self, target: str) -> list[Any]:
        if target == "group":
            return [self.topic, "GROUP", "g", "MODE", "shared", "FROM", "EARLIEST", "LOCK", LOCK_MS]
        if target == "share":
            return [self.share_filter, "LOCK", LOCK_MS]
        return [self.lite_topic, "LMQ", "l0", "LOCK", LOCK_MS]

    def group_state(self, target: str) -> dict[str, str]:
        return fields.expand(self.redis.hgetall(KEYS.queue(self.queues[target]).meta))

    def expired_total(self, target: str) -> int:
        """How many messages the broker settled unsent because they expired (read from the totals of the
        queue's slot: the ones a fence on it counts in)."""
        k = KEYS.queue(self.queues[target])
        return int(self.redis.hget(k.slot_totals if in_cluster_mode() else k.totals, "expired") or 0)

    def dispatched_meanwhile(self, target: str, before: dict[str, str], after: dict[str, str],
                             expired_before: int) -> set[str]:
        """The group fields a dispatch moved between two reads of a queue's meta (``before`` read after
        ``expired_before``), or nothing when none ran. A push group's mailboxes are filled by the sweepers
        too (a lease that ran out, a scheduled message released), whatever the test is doing: each such
        dispatch moves the group's cursor and round-robin pointer (or sticky member) only as it hands a
        message out, which raises a member's delivered count in the same script, or as it settles an
        expired one, which the totals count. So those fields of a push group may change only where one of
        those is seen; a refused command that wrote them with nothing delivered or expired is still caught,
        and a pull group's cursor (no sweeper moves it) is never excused."""
        push = {line.split("\t")[0] for meta in (before, after) for line in meta.get(fields.PUSH, "").split("\n") if line}
        delivered = {k.split("|")[1] for k in before.keys() | after.keys()
                     if k.startswith("m|") and k.endswith("|" + fields.DELIVERED) and before.get(k) != after.get(k)}
        expired = self.expired_total(target) != expired_before
        groups = push if expired else push & delivered
        return {fields.group_field(g, name) for g in groups for name in (fields.CURSOR, fields.ROUND_ROBIN, fields.STICKY)}

    @staticmethod
    def started_meanwhile(before: dict[str, str], after: dict[str, str]) -> set[str]:
        """The fields that moved when a queue that never had a message got its first between two reads of
        its meta (a sweeper releasing a message published for later): a filter queue's ids start at the
        clock (lib/meta.lua, start_ids), and its `first` and every cursor, all at the start, move with
        them. Nothing, when the queue already had messages before."""
        if int(before.get(fields.SEQ) or 0) > 0 or int(after.get(fields.SEQ) or 0) == 0:
            return set()
        start = after.get(fields.FIRST)
        return {k for k in after if (k == fields.FIRST or k.endswith("|" + fields.CURSOR)) and after[k] == start
                and int(before.get(k) or 1) == 1}

    def connections_on_live_workers(self, cid: str) -> list[str]:
        """The connections a session is held by (their tokens: '<worker id>:<n>'), those of a worker killed
        with SIGKILL aside: they never leave, and that worker's lease in the workers index has run out."""
        now = self.redis_ms()
        live = {text(w) for w, lease in self.redis.zrange(KEYS.workers, 0, -1, withscores=True) if lease > now}
        return [t for t in map(text, self.redis.smembers(KEYS.session_conns(cid))) if t.rsplit(":", 1)[0] in live]

    def forget_fetched(self, c: Consumer, target: str) -> None:
        c.fetched.pop(target, None)

    # -- ordinary moves ---------------------------------------------------------------------

    @initialize(subscriptions=st.lists(st.tuples(st.integers(0, 2), st.sampled_from(TARGETS)), min_size=1, max_size=4),
                backlog=st.lists(st.tuples(st.sampled_from(TARGETS), st.integers(1, 4)), max_size=3))
    def start_with_some_members_and_messages(self, subscriptions: list[tuple[int, str]],
                                             backlog: list[tuple[str, int]]) -> None:
        for queue, n in backlog:
            self.publish(queue, n)
        for who, queue in subscriptions:
            self.subscribe(who, queue)

    @rule(queue=st.sampled_from(TARGETS), n=st.integers(1, 4), level=st.sampled_from([None, 0, 4, 9]))
    def publish(self, queue: str, n: int, level: int | None = None) -> None:
        payloads = [f"m{self.run}-{self.sent + i}" for i in range(n)]
        self.sent += n
        if queue == "group":
            ids = self.producer.execute_command("MPUB", self.topic, n, *payloads,
                                                *(["PRIORITY", level] if level is not None else []))
        elif queue == "share":
            ids = self.producer.execute_command("MPUB", self.filter_topic, n, *payloads)
            self.shared_payloads.update(payloads)
        else:
            ids = self.producer.execute_command("MPUB", self.lite_topic, n, *payloads, "LMQ", "l0")
        self.published[queue].extend(int(i) for i in ids)

    def redis_ms(self) -> int:
        s, us = self.redis.time()
        return s * 1000 + us // 1000

    @rule(queue=st.sampled_from(TARGETS), n=st.integers(1, 3), delay=st.sampled_from([0, 0, 300]),
          ttl=st.sampled_from([None, 150, 60_000]), then_wait=st.booleans(), level=st.sampled_from([None, 7]))
    def publish_for_later_or_expiring(self, queue: str, n: int, delay: int, ttl: int | None, then_wait: bool,
                                      level: int | None) -> None:
        """MPUB … AT t and/or TTL ms: checked at delivery (pull) to come no sooner than t and never after
        its deadline (then_wait: a 150 ms TTL runs out, then a member pulls)."""
        due = self.redis_ms() + delay if delay else 0
        payloads = [f"e{self.run}-{len(self.timed) + i}" for i in range(n)]
        args = [n, *payloads, *(["AT", due] if due else []), *(["TTL", ttl] if ttl else [])]
        if queue == "group":
            self.producer.execute_command("MPUB", self.topic, *args, *(["PRIORITY", level] if level is not None else []))
        elif queue == "share":
            self.producer.execute_command("MPUB", self.filter_topic, *args)
        else:
            self.producer.execute_command("MPUB", self.lite_topic, *args, "LMQ", "l0")
        self.timed.update(dict.fromkeys(payloads, due))
        if then_wait:  # … and a member reads the queue then, so a read past the deadline is checked
            time.sleep(0.2)
            who = next((i for i, c in enumerate(self.consumers) if queue in c.handles), None)
            if who is not None:
                self.pull(who, queue, 100)

    @rule(who=st.integers(0, 2), queue=st.sampled_from(TARGETS))
    def subscribe(self, who: int, queue: str) -> None:
        c = self.consumers[who]
        reply = as_map(self.conn(c).execute_command("SUB", *self.subscribe_args(queue)))
        handle = reply["handle"]
        c.handles[queue] = handle
        if queue == "lmq":
            if self.lmq_owner is not None and self.lmq_owner != c.cid:
                previous = next(x for x in self.consumers if x.cid == self.lmq_owner)
                if "lmq" in previous.handles:
                    self.evicted[previous.handles["lmq"]] = c.cid
            self.evicted.pop(handle, None)
            self.lmq_owner = c.cid

    @rule(who=st.integers(0, 2), queue=st.sampled_from(TARGETS), count=st.integers(1, 5))
    def pull(self, who: int, queue: str, count: int) -> None:
        c = self.consumers[who]
        handle = c.handles.get(queue)
        if handle is None:
            return
        before = self.redis_ms()
        try:
            got = deliveries(self.conn(c).execute_command("PULL", handle, "COUNT", count))
        except redis.ResponseError as e:
            assert refusal(e) in ("NOTFOUND", "STALE", "NOPERM"), str(e)
            return
        after = self.redis_ms()
        if handle in self.evicted:
            assert got == [], f"{c.cid} was evicted by {self.evicted[handle]} yet received {got}"
        seen = self.tags_seen.setdefault(handle, set())
        for d in got:
            tag, mid, epoch = d["tag"], int(d["id"]), int(d["epoch"])
            assert tag not in seen, f"tag {tag} handed out twice under {handle}"
            seen.add(tag)
            assert epoch >= self.seek_epoch.get(queue, 0), f"delivered under epoch {epoch} after a SEEK to " \
                                                            f"{self.seek_epoch[queue]}"
            if d["payload"] in self.timed:
                assert after >= self.timed[d["payload"]], f"{d['payload']} delivered before its time"
                expires = as_map(d["headers"]).get(EXPIRES) if d.get("headers") else None
                assert expires is None or int(expires) > before, \
                    f"{d['payload']} delivered after its expiry {expires} (the pull began at {before})"
            elif queue == "share":
                assert d["payload"] in self.shared_payloads, f"delivered {d['payload']} (id {mid}), which was never published"
            else:
                assert mid in self.published[queue], f"delivered {mid}, which was never published"
            c.fetched.setdefault(queue, []).append((tag, mid, epoch))

    @rule(who=st.integers(0, 2), queue=st.sampled_from(TARGETS), data=st.data())
    def ack(self, who: int, queue: str, data: st.DataObject) -> None:
        c = self.consumers[who]
        handle, fetched = c.handles.get(queue), c.fetched.get(queue)
        if not handle or not fetched:
            return
        tag, mid, _ = fetched.pop(data.draw(st.integers(0, len(fetched) - 1), label="which"))
        try:
            settled = int(self.conn(c).execute_command("ACK", handle, tag))
        except redis.ResponseError as e:
            assert refusal(e) in ("NOTFOUND", "STALE", "NOPERM"), str(e)
            return
        if settled:
            assert (queue, mid) not in self.settled, f"message {mid} settled twice in {queue}"
            self.settled.add((queue, mid))

    @rule(who=st.integers(0, 2), queue=st.sampled_from(TARGETS), delay=st.sampled_from([0, 50]))
    def nack(self, who: int, queue: str, delay: int) -> None:
        c = self.consumers[who]
        handle, fetched = c.handles.get(queue), c.fetched.get(queue)
        if not handle or not fetched:
            return
        tag, _, _ = fetched.pop()
        try:
            self.conn(c).execute_command("NACK", handle, tag, "DELAY", delay)
        except redis.ResponseError as e:
            assert refusal(e) in ("NOTFOUND", "STALE", "NOPERM"), str(e)

    @rule(who=st.integers(0, 2), queue=st.sampled_from(TARGETS), where=st.sampled_from(["EARLIEST", "LATEST"]))
    def seek(self, who: int, queue: str, where: str) -> None:
        c = self.consumers[who]
        handle = c.handles.get(queue)
        if handle is None:
            return
        published_before = max(self.published[queue], default=0)
        try:
            epoch = int(self.conn(c).execute_command("SEEK", handle, where))
        except redis.ResponseError as e:
            assert refusal(e) in ("NOTFOUND", "STALE", "NOPERM"), str(e)
            assert handle not in self.evicted or refusal(e) == "STALE", "an evicted owner must be told STALE"
            return
        assert handle not in self.evicted, "an evicted lmq owner moved the new owner's cursor"
        assert epoch > self.seek_epoch.get(queue, 0), "a SEEK did not raise the epoch"
        self.seek_epoch[queue] = epoch
        self.settled = {(t, m) for t, m in self.settled if t != queue}
        if queue == "group":
            self.loss_checked_from = published_before + 1
        for x in self.consumers:
            self.forget_fetched(x, queue)  # every checkout of the group went stale

    @rule(who=st.integers(0, 2), queue=st.sampled_from(TARGETS))
    def unsubscribe(self, who: int, queue: str) -> None:
        c = self.consumers[who]
        handle = c.handles.pop(queue, None)
        if handle is None:
            return
        self.conn(c).execute_command("UNSUB", handle)
        if queue == "share":  # a push member leaves once it takes its end-of-stream sentinel, as the SDK does
            assert text(self.conn(c).execute_command("TAKE", handle)) == "EOS"
        self.forget_fetched(c, queue)
        if queue == "lmq" and self.lmq_owner == c.cid:
            self.lmq_owner = None

    # -- hostile moves -----------------------------------------------------------------------

    @rule(who=st.integers(0, 2), queue=st.sampled_from(TARGETS),
          verb=st.sampled_from(["SEEK", "PULL", "ACK", "UNSUB"]))
    def forge_a_handle_for_a_subscription_never_joined(self, who: int, queue: str, verb: str) -> None:
        c = self.consumers[who]
        victim = next((x for x in self.consumers if x is not c and queue in x.handles), None)
        if victim is None or queue in c.handles:
            return
        real = Handle.decode(victim.handles[queue])
        forged = Handle(real.queue, real.group, c.cid).encode()
        expired_before = self.expired_total(queue)
        before = self.group_state(queue)
        args = {"SEEK": ["LATEST"], "PULL": ["COUNT", 5], "ACK": ["1"], "UNSUB": []}[verb]
        try:
            reply = self.conn(c).execute_command(verb, forged, *args)
        except redis.ResponseError as e:
            assert refusal(e) in ("NOTFOUND", "NOPERM", "STALE"), str(e)
        else:
            assert verb != "SEEK", f"a forged handle moved {queue}'s cursor (epoch {reply})"
            if verb == "PULL":
                assert text(reply) == [], f"a forged handle received {reply}"
            if verb == "ACK":
                assert int(reply) == 0, "a forged handle settled a checkout"
        after = self.group_state(queue)
        dispatched = self.dispatched_meanwhile(queue, before, after, expired_before)
        for name in (fields.CURSOR, fields.EPOCH, fields.MEMBERS, fields.OWNER):
            key = fields.group_field(real.group, name)
            if key in dispatched:
                continue
            assert after.get(key) == before.get(key), f"a forged {verb} changed {key}"
        mine = {k for k in after if k.startswith("m|") and f"|{c.cid}|" in k} - set(before)
        assert not mine, f"a forged handle made a member: {mine}"

    @rule(who=st.integers(0, 2), queue=st.sampled_from(TARGETS), data=st.data())
    def send_a_number_out_of_range(self, who: int, queue: str, data: st.DataObject) -> None:
        c = self.consumers[who]
        handle = c.handles.get(queue) or Handle(self.queues[queue], "g", c.cid).encode()
        huge = data.draw(st.sampled_from([2**53, 2**63 - 1, 2**63, 10**20, -1]), label="number")
        command = data.draw(st.sampled_from([
            ["SUB", *self.subscribe_args(queue), "EPOCH", huge],
            ["SUB", *self.subscribe_args(queue), "MAX", huge],
            ["PULL", handle, "COUNT", huge],
            ["PULL", handle, "COUNT", 0],
            ["SEEK", handle, "ID", huge],
            ["SEEK", handle, "TIME", huge],
            ["NACK", handle, "1", "DELAY", huge],
            ["RENEW", handle, "1", "LOCK", huge],
        ]), label="command")
        expired_before = self.expired_total(queue)
        before = self.group_state(queue)
        with pytest.raises(redis.ResponseError) as info:
            self.conn(c).execute_command(*command)
        # the range is checked first where the verb can (BADARG); a handle of someone else's may be refused first
        assert refusal(info.value) in ("BADARG", "LIMIT", "NOPERM", "NOTFOUND", "STALE"), str(info.value)
        after = self.group_state(queue)
        dispatched = self.dispatched_meanwhile(queue, before, after, expired_before)
        changed = {k for k in before.keys() | after.keys()
                   if before.get(k) != after.get(k) and not k.endswith(("|sus", "|n", "|on")) and k not in
                   (fields.TAG, fields.LAST_WRITE, fields.SEQ, fields.SERVER, fields.GAPS) and k not in dispatched
                   and k not in self.started_meanwhile(before, after)}
        assert not changed, f"{command[0]} with {huge} was refused but changed {changed}"

    @rule(who=st.integers(0, 2), queue=st.sampled_from(TARGETS))
    def drop_the_connection_between_pull_and_ack(self, who: int, queue: str) -> None:
        c = self.consumers[who]
        if c.conn is None:
            return
        handle = c.handles.get(queue)
        if handle is not None:
            try:
                got = deliveries(c.conn.execute_command("PULL", handle, "COUNT", 2))
            except redis.ResponseError:
                got = []
            seen = self.tags_seen.setdefault(handle, set())
            for d in got:
                assert d["tag"] not in seen, f"tag {d['tag']} handed out twice under {handle}"
                seen.add(d["tag"])
                assert handle not in self.evicted, "an evicted member received a message"
        c.conn.close()  # no QUIT: the socket just goes; the session outlives it for its lease
        c.conn = None
        self.conn(c)  # and the client comes back within it, as the SDK does

    @rule(who=st.integers(0, 2))
    def let_a_session_expire(self, who: int) -> None:
        c = self.consumers[who]
        if c.conn is not None:
            c.conn.close()
            c.conn = None
        session = KEYS.session(c.cid)
        if not self.redis.exists(session):
            return
        # A worker starts a session's lease afresh when the session's last connection leaves: that must be
        # over before the lease is cut short here, or the session lives a whole lease more (1.5 s a time)
        wait_for(lambda: not self.connections_on_live_workers(c.cid), timeout=10,
                 what=f"{c.cid}'s connections to leave its session")
        # as if its lease ran out: what the sweeper reads is the lease in the session hash and in the index
        self.redis.hset(session, "lease", 1)
        self.redis.zadd(KEYS.sessions, {c.cid: 1})
        wait_for(lambda: not self.redis.exists(session), timeout=10, what=f"{c.cid}'s session to end")
        for target in list(c.handles):
            self.forget_fetched(c, target)
        if self.lmq_owner == c.cid:
            self.lmq_owner = None
        c.handles.clear()

    @precondition(lambda self: not in_cluster_mode())
    @rule(queue=st.sampled_from(TARGETS))
    def hand_the_queue_to_another_server(self, queue: str) -> None:
        """What a promoted replica (or a restarted server) sees: the queue's ids were given by another
        server, a while ago, so the next id it gives starts above the clock and leaves a gap
        (lua/lib/ids.lua) that every read, count, seek and trim must step over."""
        # in one call, as a fence would: at rest an lmq keeps its last write in seconds, as W
        # (lua/lib/meta.lua, compact_meta); a queue that never gave an id has no srv
        self.redis.eval("""
            if redis.call('HEXISTS', KEYS[1], 'srv') == 0 then return 0 end
            if redis.call('HEXISTS', KEYS[1], 'z') == 1 then
              redis.call('HSET', KEYS[1], 'W', tonumber(redis.call('HGET', KEYS[1], 'W') or '0') - 2)
            else
              redis.call('HSET', KEYS[1], 'wt', tonumber(redis.call('HGET', KEYS[1], 'wt') or '0') - 2000)
            end
            return redis.call('HSET', KEYS[1], 'srv', '00000000')""", 1, KEYS.queue(self.queues[queue]).meta)

    @rule(ms=st.sampled_from([LOCK_MS + 100, 2 * LOCK_MS]))
    def pause_redis_past_a_lease(self, ms: int) -> None:
        self.redis.execute_command("CLIENT", "PAUSE", ms, "WRITE")
        time.sleep(ms / 1000)

    @rule(roll=st.integers(0, 9))
    def kill_a_worker_between_two_calls(self, roll: int) -> None:
        if roll != 7 or self.killed:  # a new worker process costs ~1 s: about one sequence in ten, once
            return
        self.killed = True
        orphaned = [c for c in self.consumers if c.worker == 1 and c.conn is not None]
        for c in orphaned:
            c.conn.close()
            c.conn = None
        self.workers.kill_outside()
        for c in orphaned:  # its clients come back through the new worker before their leases lapse
            self.conn(c)

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def nothing_names_a_client_whose_session_is_gone(self) -> None:
        live = {c.cid for c in self.consumers if self.redis.exists(KEYS.session(c.cid))}  # read first: see below
        for target, ref in self.queues.items():
            k = KEYS.queue(ref)
            # sessions are read before the queue: a checkout seen after its session was seen gone is a leak
            meta = fields.expand(self.redis.hgetall(k.meta))
            records = [text(v) for v in checkout_records(self.redis, k).values()]
            for c in self.consumers:
                if c.cid in live:
                    continue
                # the eviction marker names the evictor, and the churn history (`chw`: the owners an lmq
                # has seen, for the analytics) names past owners: neither makes a client a member
                named = [f for f, v in meta.items()
                         if c.cid in f or (c.cid in v and not f.endswith(("|mk", "|chw")))]
                assert not named, f"{target}: {named} name {c.cid}, whose session is gone"
                assert not [r for r in records if f"\0{c.cid}\0" in r], f"{target}: a checkout of ended {c.cid}"

    @invariant()
    def epochs_only_grow(self) -> None:
        for target, ref in self.queues.items():
            meta = fields.expand(self.redis.hgetall(KEYS.queue(ref).meta))
            if not meta:
                # a `$share` queue is deleted with its last member; a new one starts its own epochs
                self.epochs = {k: v for k, v in self.epochs.items() if k[0] != target}
                self.seek_epoch.pop(target, None)
                continue
            for f, v in meta.items():
                if f.startswith("g|") and f.endswith("|" + fields.EPOCH):
                    key = (target, f)
                    assert int(v) >= self.epochs.get(key, 0), f"{target} {f} went back from {self.epochs[key]} to {v}"
                    self.epochs[key] = int(v)

    @invariant()
    def nothing_acknowledged_to_the_producer_is_lost(self) -> None:
        due = [m for m in self.published["group"] if m >= self.loss_checked_from and ("group", m) not in self.settled]
        if not due:
            return
        k = KEYS.queue(self.queues["group"])
        with self.redis.pipeline(transaction=True) as p:  # one slot: an atomic view of the queue
            p.hgetall(k.meta)
            p.hgetall(k.checkouts)
            p.zrange(k.ready, 0, -1)
            p.zrange(k.delayed, 0, -1)
            p.lrange(k.dead, 0, -1)
            p.hmget(k.log, due)
            meta, records, ready, delayed, dead, bodies = p.execute()
        meta = fields.expand(meta)
        cursor = int(meta.get(fields.group_field("g", fields.CURSOR), 0))
        if fields.group_field("g", fields.MODE) not in meta:
            return  # the group was never made: nothing was promised to it yet
        waiting = set()
        for t, r in records.items():
            if is_batch_key(t):
                continue  # a lease batch's count
            group, _member, mid, *_ = text(r).split("\0")
            if group == "g":
                waiting.add(int(mid))
        for r in (*ready, *delayed):
            group, mid, *_ = text(r).split("\0")
            if group == "g":
                waiting.add(int(mid))
        dead_ids = {msgpack.unpackb(entry)[0] for entry in dead}
        for mid, body in zip(due, bodies, strict=True):
            assert body is not None, f"message {mid} left the log before group g settled it"
            assert mid >= cursor or mid in waiting or mid in dead_ids, \
                f"message {mid} is neither ahead of g's cursor {cursor}, returned, delayed, checked out nor dead"

    @invariant()
    def the_totals_equal_a_full_count(self) -> None:
        """The counters the fences keep (lua/lib/totals.lua) equal a count of every queue's keys, read with
        Redis's writes paused (a pause is per node: on a Cluster, tests/ops/test_totals.py checks them)."""
        if not in_cluster_mode():
            checkpoint(self.workers.redis_url, self.redis)

    def teardown(self) -> None:
        for c in self.consumers:
            if c.conn is not None:
                c.conn.close()
        self.producer.close()


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("shard", range(SHARDS), ids=lambda n: f"shard-{n + 1}-of-{SHARDS}")
def test_the_five_guarantees_hold_through_hostile_and_unlucky_moves(redis_url, shard: int) -> None:
    url = redis_url  # flushed: the totals start from nothing (the_totals_equal_a_full_count)
    workers = Workers(url)
    direct = redis.RedisCluster.from_url(url) if in_cluster_mode() else redis.Redis.from_url(url)
    try:
        machine = type("GuaranteesMachine", (Guarantees,), {"workers": workers, "redis": direct})
        run_state_machine_as_test(machine, settings=settings(
            max_examples=-(-EXAMPLES // SHARDS), stateful_step_count=20, deadline=None, derandomize=False,
            suppress_health_check=list(HealthCheck), print_blob=True))
    finally:
        workers.stop()
        direct.close()
