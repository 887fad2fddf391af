"""A pure-Python reference model of ONE FenceMQ queue (no Redis, no I/O).

It mirrors, operation by operation, what the fences in ``lua/`` document:
publish, subscribe, pull, ack, nack, renew, sweep, seek and unsubscribe, for
shared, single-active and exclusive subscriptions (groups) of one queue. The
property-based tests in ``tests/test_model.py`` drive the real fences through
``fencemq.fences.core.Core`` and compare every reply and the whole Redis state of
the queue with this model after every step.

Time is not modelled as a clock. The test controls it instead:

* a lease "expires" when the test moves its deadline into the past
  (:meth:`QueueModel.expire`), and comes back at the next :meth:`sweep`;
* a delayed NACK becomes due when the test says so (:meth:`make_due`), and is
  promoted to the ready set by the next PULL or sweep (as ``promote_delayed``);
* where the fences read Redis ``TIME`` (publish stamps, lease deadlines), the
  caller passes the time window it observed, ``now=(lo, hi)``, so the model
  can bound the scores the fences must have written.

Vocabulary (as in docs/data-model.md): a *checkout* is one delivery under a
delivery tag (``tag`` is a per-queue counter shared by all groups); a group's
*ready* set holds returned messages, which are read before new ones, in id
order; ``cursor`` is the next id to read from the log; ``acq`` (acquisitions,
the ``deliveries`` count of a delivery) and ``fail`` (NACK failures) travel with
a message while it is returned and redelivered.

For the "every id is in exactly one state" invariant each group also keeps a
``done`` set: ids settled for good (acked, dead-lettered, discarded) or skipped
(before the cursor the group was created at, or before the cursor a seek or an
exclusive ON-PREEMPT move set).

Retention (lua/lib/retention.lua): without a policy (``keep`` False) a message
every group has settled leaves the log — the publish, ACK or NACK after it
trims the log's head up to the lowest id some group may still be given, at most
a budget per call. With one (``keep``), nothing is trimmed here: the model runs
without the count and age limits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SEP = "\0"
MODES = ("shared", "single-active", "exclusive")


class ModelError(Exception):
    """Base of the errors the model predicts; ``code`` is FenceMQ's error word."""

    code = "ERR"


class NotFound(ModelError):
    code = "NOTFOUND"


class BadArg(ModelError):
    code = "BADARG"


class Busy(ModelError):
    code = "BUSY"


class Stale(ModelError):
    code = "STALE"


class NoPerm(ModelError):
    code = "NOPERM"


@dataclass
class Checkout:
    tag: int
    group: str
    member: str
    id: int
    epoch: int
    acq: int
    fail: int
    lock_ms: int  # lease length the last PULL/RENEW gave it
    window: tuple[int, int] | None = None  # (lo, hi) bound on its deadline score, when known
    expired: bool = False  # the test moved its deadline into the past (score 0)

    def record(self) -> str:
        return SEP.join(map(str, (self.group, self.member, self.id, self.epoch, self.acq, self.fail)))


@dataclass
class Returned:
    """A message in a group's ready set or delayed set."""

    acq: int
    fail: int
    due: bool = False  # delayed only: the test made it due (score 0)
    window: tuple[int, int] | None = None  # delayed only: bound on its due score


@dataclass
class Member:
    delivered: int = 0  # m|g|m|n: every checkout ever made for it
    suspected: bool = False
    marker: str | None = None  # exclusive: who preempted it
    lock_ms: int | None = None
    max: int | None = None


@dataclass
class Group:
    name: str
    mode: str
    policy: str
    onpre: str
    cursor: int
    epoch: int = 0
    owner: str | None = None
    members: dict[str, Member] = field(default_factory=dict)  # arrival order
    ready: dict[int, Returned] = field(default_factory=dict)
    delayed: dict[int, Returned] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)


@dataclass
class SubReply:
    mode: str
    epoch: int
    owner: str
    evicted: str
    returned: int
    cursor: int


@dataclass
class PullReply:
    epoch: int
    status: str
    deliveries: list[tuple[int, int, int]]  # (tag, id, acquisitions)


@dataclass
class SeekReply:
    epoch: int
    cursor: int
    clamped: bool


@dataclass
class SweepReply:
    returned: int
    notices: list[tuple[str, str, list[str], str]]  # group, member, tags, successor ('' = none)


class QueueModel:
    def __init__(self, *, max_failures: int, default_lock_ms: int, keep: bool = False) -> None:
        self.max_failures = max_failures
        self.default_lock_ms = default_lock_ms
        self.keep = keep  # the topic has a retention policy: settled messages stay
        self.seq = 0
        self.first = 1  # the oldest id the log still holds
        self.tag = 0
        self.payloads: dict[int, bytes] = {}
        self.stamps: dict[int, int] = {}
        self.dedup: dict[str, int] = {}
        self.groups: dict[str, Group] = {}
        self.checkouts: dict[int, Checkout] = {}
        self.dead: list[tuple[int, str, str, int, int, bytes]] = []  # id, group, member, acq, fail, payload
        self.touched_meta = False  # publish or subscribe created the meta hash

    # -- helpers ---------------------------------------------------------------------

    def group_checkouts(self, g: str) -> list[Checkout]:
        return [c for c in self.checkouts.values() if c.group == g]

    def member_tags(self, g: str, m: str) -> list[int]:
        """Tags a member holds, in the order the `own` zset lists them (lex)."""
        return sorted((t for t, c in self.checkouts.items() if c.group == g and c.member == m), key=str)

    def _return_member_checkouts(self, g: Group, m: str) -> int:
        tags = self.member_tags(g.name, m)
        for t in tags:
            c = self.checkouts.pop(t)
            g.ready[c.id] = Returned(c.acq, c.fail)
        return len(tags)

    def _promote_due(self) -> int:
        moved = 0
        for g in self.groups.values():
            for i in [i for i, r in g.delayed.items() if r.due]:
                r = g.delayed.pop(i)
                g.ready[i] = Returned(r.acq, r.fail)
                moved += 1
        return moved

    def _lowest_unsettled(self) -> int | None:
        """The lowest id some group may still be given; None: keep everything (no group yet, a group
        that rewinds to the earliest message on preemption, more delayed messages than a call looks at)."""
        if not self.groups or any(g.onpre == "earliest" for g in self.groups.values()):
            return None
        if sum(len(g.delayed) for g in self.groups.values()) > 1000:
            return None
        low = self.seq + 1
        for g in self.groups.values():
            low = min([low, g.cursor, *g.ready, *g.delayed])
        return min([low, *(c.id for c in self.checkouts.values())])

    def _trim(self, budget: int) -> None:
        """What trim_log does without limits: the settled head, at most ``budget`` ids."""
        if self.keep or self.first > self.seq:
            return
        low = self._lowest_unsettled()
        if low is None:
            return
        upto = min(low - 1, self.first + budget - 1, self.seq)
        for i in range(self.first, upto + 1):
            self.payloads.pop(i, None)
        self.first = max(self.first, upto + 1)

    def first_at_or_after(self, ms: int) -> int:
        for i in range(self.first, self.seq + 1):
            if self.stamps[i] >= ms:
                return i
        return self.seq + 1

    def _alive(self, group: str, m: str) -> None:
        """Any ACK, NACK or RENEW shows the member alive: it is no longer suspected, even when
        every tag it sent had expired and settles nothing (else it could never recover)."""
        g = self.groups.get(group)
        if g is not None and m in g.members:
            g.members[m].suspected = False

    def _skip_before(self, g: Group, cursor: int) -> None:
        """After a cursor move: every id before it that is nowhere else counts as consumed."""
        held = set(g.ready) | set(g.delayed) | {c.id for c in self.group_checkouts(g.name)}
        g.done = {i for i in range(self.first, min(cursor, self.seq + 1)) if i not in held}

    # -- operations --------------------------------------------------------------------

    def publish(self, items: list[tuple[bytes, str | None]], stamp: int) -> list[int]:
        """items: (payload, dedup id, '' or None). Returns the ids (a repeated dedup id: the first's).

        None: covered by the dedup id before it (a run, MPUB … ID): a repeated run's members get the
        ids that follow its first, and store nothing; a new run's are stored as they come."""
        ids = []
        before = self.seq
        repeated_run: int | None = None  # the first id of the repeated run being walked, else None
        for payload, dedup in items:
            if dedup is None and repeated_run is not None:
                repeated_run += 1
                ids.append(repeated_run)
                continue
            repeated_run = None
            if dedup and dedup in self.dedup:
                ids.append(self.dedup[dedup])
                repeated_run = self.dedup[dedup]
                continue
            self.seq += 1
            self.payloads[self.seq] = payload
            self.stamps[self.seq] = stamp
            if dedup:
                self.dedup[dedup] = self.seq
            ids.append(self.seq)
            for g in self.groups.values():
                if self.seq < g.cursor:  # a group created FROM ID beyond the end skips it
                    g.done.add(self.seq)
        if self.seq > before:
            self.touched_meta = True
            self._trim(len(items) + 100)
        return ids

    def subscribe(
        self,
        group: str,
        member: str,
        *,
        mode: str | None = None,
        default_mode: str = "shared",
        policy: str | None = None,
        start: tuple[str, int | None] = ("earliest", None),
        onpre: str | None = None,
        lock_ms: int | None = None,
        epoch: int | None = None,
        max_messages: int | None = None,
    ) -> SubReply:
        g = self.groups.get(group)
        mode = mode or (g.mode if g else None) or default_mode
        policy = policy or (g.policy if g else None) or "preempt"
        if g and mode != g.mode:
            raise BadArg(f"group {group} is {g.mode}")
        if g and policy != g.policy:
            raise BadArg(f"group {group} has POLICY {g.policy}")
        owner = g.owner if g else None
        if mode == "exclusive" and owner and owner != member and policy == "reject":
            raise Busy(f"group {group} is held by client {owner}")
        self.touched_meta = True
        if g is None:
            kind, arg = start
            if kind == "latest":
                cur = self.seq + 1
            elif kind == "id":
                assert arg is not None
                cur = min(max(arg, self.first), self.seq + 1)  # clamped, as SEEK ID is
            elif kind == "time":
                assert arg is not None
                cur = self.first_at_or_after(arg)
            else:
                cur = self.first
            g = Group(group, mode, policy, onpre or "keep", cur)
            g.done = set(range(self.first, min(cur, self.seq + 1)))
            self.groups[group] = g
        cur = g.cursor
        if member not in g.members:
            g.members[member] = Member()
        me = g.members[member]
        me.marker = None
        me.suspected = False
        me.lock_ms = lock_ms
        me.max = max_messages
        returned = 0
        if epoch is not None and epoch > g.epoch:
            # the client knows a later epoch: adopt it; the group's checkouts go stale, back to ready
            g.epoch = epoch
            for holder in list(g.members):
                returned += self._return_member_checkouts(g, holder)
        evicted = ""
        if mode == "exclusive" and owner and owner != member:
            evicted = owner
            returned += self._return_member_checkouts(g, owner)
            g.members[owner].marker = member
            if g.onpre == "earliest":
                cur = self.first
            elif g.onpre == "latest":
                cur = self.seq + 1
            if g.onpre != "keep":
                # a cursor move is a seek: new epoch, backlog (ready and delayed) dropped
                g.cursor = cur
                g.ready.clear()
                g.delayed.clear()
                g.epoch += 1
                self._skip_before(g, cur)
            owner = member
        elif mode in ("exclusive", "single-active") and not owner:
            owner = member
        g.owner = owner
        return SubReply(mode, g.epoch, owner or "", evicted, returned, cur)

    def pull(self, group: str, member: str, count: int, *, now: tuple[int, int] | None = None) -> PullReply:
        if count < 1:
            raise BadArg("COUNT must be at least 1")
        g = self.groups.get(group)
        if g is None or member not in g.members:
            raise NotFound("not subscribed")
        me = g.members[member]
        if me.marker:
            self._return_member_checkouts(g, member)
            return PullReply(g.epoch, "evicted", [])
        if me.suspected:
            return PullReply(g.epoch, "suspected", [])
        if g.mode == "exclusive" and g.owner != member:
            return PullReply(g.epoch, "standby", [])
        if g.mode == "single-active" and g.owner != member:
            o = g.owner
            if o and o in g.members and not g.members[o].suspected:
                return PullReply(g.epoch, "standby", [])
            g.owner = member  # takeover: the active member is gone or suspected
        if me.max is not None:
            left = me.max - me.delivered
            if left <= 0:
                return PullReply(g.epoch, "ended", [])
            count = min(count, left)
        self._promote_due()
        taken: list[tuple[int, int, int]] = []  # id, acq, fail
        for i in sorted(g.ready)[:count]:
            r = g.ready.pop(i)
            taken.append((i, r.acq + 1, r.fail))
        while len(taken) < count and g.cursor <= self.seq:
            taken.append((g.cursor, 1, 0))
            g.done.discard(g.cursor)
            g.cursor += 1
        if not taken:
            return PullReply(g.epoch, "ok", [])
        lock = me.lock_ms or self.default_lock_ms
        window = (now[0] + lock, now[1] + lock) if now else None
        out = []
        for i, acq, fail in taken:
            self.tag += 1
            self.checkouts[self.tag] = Checkout(self.tag, group, member, i, g.epoch, acq, fail, lock, window)
            out.append((self.tag, i, acq))
        me.delivered += len(taken)
        return PullReply(g.epoch, "ok", out)

    def _own(self, group: str, member: str, tag: str) -> Checkout | None:
        try:
            c = self.checkouts.get(int(tag))
        except ValueError:
            return None
        if c is None or str(c.tag) != tag or c.group != group or c.member != member:
            return None
        if c.epoch < self.groups[group].epoch:  # taken under an older epoch: stale
            return None
        if c.expired:  # past its deadline: a late ACK, NACK or RENEW settles nothing, swept or not
            return None
        return c

    def ack(self, group: str, member: str, tags: list[str]) -> int:
        settled = 0
        for t in tags:
            c = self._own(group, member, t)
            if c:
                del self.checkouts[c.tag]
                self.groups[group].done.add(c.id)
                settled += 1
        if settled:
            self._trim(settled + 100)
        self._alive(group, member)
        return settled

    def nack(
        self, group: str, member: str, tags: list[str], *, delay_ms: int = 0, discard: bool = False,
        now: tuple[int, int] | None = None,
    ) -> int:
        returned, gone = 0, 0
        g = self.groups.get(group)
        for t in tags:
            c = self._own(group, member, t)
            if not c:
                continue
            assert g is not None
            del self.checkouts[c.tag]
            returned += 1
            if discard:
                g.done.add(c.id)
                gone += 1
                continue
            fail = c.fail + 1
            if self.max_failures > 0 and fail >= self.max_failures:
                self.dead.append((c.id, group, member, c.acq, fail, self.payloads[c.id]))
                g.done.add(c.id)
                gone += 1
            elif delay_ms > 0:
                window = (now[0] + delay_ms, now[1] + delay_ms) if now else None
                g.delayed[c.id] = Returned(c.acq, fail, window=window)
            else:
                g.ready[c.id] = Returned(c.acq, fail)
        if gone:
            self._trim(gone + 100)
        self._alive(group, member)
        return returned

    def renew(
        self, group: str, member: str, tags: list[str], *, lock_ms: int | None = None,
        now: tuple[int, int] | None = None,
    ) -> int:
        g = self.groups.get(group)
        if not lock_ms:
            me = g.members.get(member) if g else None
            lock_ms = (me.lock_ms if me else None) or self.default_lock_ms
        renewed = 0
        for t in tags:
            c = self._own(group, member, t)
            if c:
                c.lock_ms = lock_ms
                c.window = (now[0] + lock_ms, now[1] + lock_ms) if now else None
                renewed += 1  # a tag given twice is renewed (and counted) twice
        self._alive(group, member)
        return renewed

    def expire(self, tags: list[int]) -> None:
        """The test moved these leases' deadlines into the past (score 0)."""
        for t in tags:
            self.checkouts[t].expired = True

    def make_due(self, group: str, ids: list[int]) -> None:
        """The test moved these delayed redeliveries' due time into the past (score 0)."""
        for i in ids:
            self.groups[group].delayed[i].due = True

    def sweep(self) -> SweepReply:
        self._promote_due()
        # ZRANGEBYSCORE dl -inf now: every expired score is 0, so ties go in lex order of the tag
        expired = sorted(t for t, c in self.checkouts.items() if c.expired)  # tags of one width: lex = numeric
        by_member: dict[tuple[str, str], list[str]] = {}
        for t in expired:
            c = self.checkouts.pop(t)
            self.groups[c.group].ready[c.id] = Returned(c.acq, c.fail)
            by_member.setdefault((c.group, c.member), []).append(str(t))
        notices = []
        for (gname, m), tags in by_member.items():
            g = self.groups[gname]
            successor = ""
            if m in g.members:
                g.members[m].suspected = True
                if g.mode == "single-active" and g.owner == m:
                    self._return_member_checkouts(g, m)
                    for other, st in g.members.items():
                        if other != m and not st.suspected:
                            successor = other
                            break
                    g.owner = successor or None
                    g.members[m] = g.members.pop(m)  # the timed-out member goes to the back of the line
            notices.append((gname, m, tags, successor))
        return SweepReply(len(expired), notices)

    def seek(self, group: str, kind: str, arg: int | None = None, member: str | None = None) -> SeekReply:
        """SEEK is the act of the group's active member (``member`` None: an operator's)."""
        g = self.groups.get(group)
        if g is None:
            raise NotFound(f"no subscription {group}")
        if member is not None:
            me = g.members.get(member)
            if me is None:
                raise NotFound("not a member")
            if me.marker:
                raise Stale("evicted")
            if me.max is not None and me.delivered >= me.max:
                raise Stale("ended")
            if g.mode in ("exclusive", "single-active") and g.owner != member:
                raise NoPerm("standby")
        if kind == "earliest":
            cur = self.first
        elif kind == "latest":
            cur = self.seq + 1
        elif kind == "id":
            if arg is None or arg < 1:
                raise BadArg("SEEK ID must be a message id (1 or more)")
            cur = min(arg, self.seq + 1)
        elif kind == "time":
            assert arg is not None
            cur = self.first_at_or_after(arg)
        else:
            raise BadArg("SEEK takes ID id, TIME ms, EARLIEST or LATEST")
        if kind == "time" and cur == self.first and 1 < self.first <= self.seq:
            clamped = self.stamps[self.first] > arg  # the target is older than the oldest message kept
        else:
            clamped = cur < self.first
        cur = max(cur, self.first)
        for c in self.group_checkouts(group):
            del self.checkouts[c.tag]
        g.ready.clear()
        g.delayed.clear()
        g.epoch += 1
        g.cursor = cur
        self._skip_before(g, cur)
        return SeekReply(g.epoch, cur, clamped)

    def unsubscribe(self, group: str, member: str) -> int:
        g = self.groups.get(group)
        if g is None or member not in g.members:
            return 0
        returned = self._return_member_checkouts(g, member)
        del g.members[member]
        if g.owner == member:
            g.owner = None
            if g.mode == "single-active":
                for other, st in g.members.items():
                    if not st.suspected:
                        g.owner = other
                        break
        return returned

    # -- what Redis must hold --------------------------------------------------------------

    # The meta-hash fields this model owns; others (journal cap, push lists, shared
    # strategies, presence...) belong to features it does not model.
    QUEUE_FIELDS = frozenset({"seq", "first", "tag", "groups"})
    GROUP_FIELDS = frozenset({"mode", "pol", "ep", "cur", "own", "onpre", "mem"})
    MEMBER_FIELDS = frozenset({"n", "qos", "sus", "mk", "lock", "max"})

    @classmethod
    def owns_field(cls, name: str) -> bool:
        parts = name.split("|")
        if parts[0] == "g" and len(parts) == 3:
            return parts[2] in cls.GROUP_FIELDS
        if parts[0] == "m" and len(parts) == 4:
            return parts[3] in cls.MEMBER_FIELDS
        return name in cls.QUEUE_FIELDS

    def expected_meta(self) -> dict[str, str]:
        """The fields of the queue's meta hash this model owns (``sus`` holds a time: "*")."""
        if not self.touched_meta:
            return {}
        meta = {"seq": str(self.seq), "first": str(self.first)}
        if self.tag:
            meta["tag"] = str(self.tag)
        if self.groups:
            meta["groups"] = "\n".join(self.groups)
        for name, g in self.groups.items():
            p = f"g|{name}|"
            meta.update({p + "mode": g.mode, p + "pol": g.policy, p + "ep": str(g.epoch),
                         p + "cur": str(g.cursor), p + "onpre": g.onpre})
            if g.owner:
                meta[p + "own"] = g.owner
            if g.members:
                meta[p + "mem"] = "\n".join(g.members)
            for m, st in g.members.items():
                q = f"m|{name}|{m}|"
                meta[q + "n"] = str(st.delivered)
                meta[q + "qos"] = "1"
                if st.suspected:
                    meta[q + "sus"] = "*"
                if st.marker:
                    meta[q + "mk"] = st.marker
                if st.lock_ms:
                    meta[q + "lock"] = str(st.lock_ms)
                if st.max is not None:
                    meta[q + "max"] = str(st.max)
        return meta

    def expected_ready(self) -> set[str]:
        return {SEP.join((g.name, f"{i:016d}", str(r.acq), str(r.fail)))
                for g in self.groups.values() for i, r in g.ready.items()}

    def expected_delayed(self) -> dict[str, Returned]:
        return {SEP.join((g.name, f"{i:016d}", str(r.acq), str(r.fail))): r
                for g in self.groups.values() for i, r in g.delayed.items()}

    def expected_owned(self) -> set[str]:
        return {SEP.join((c.group, c.member, str(c.tag))) for c in self.checkouts.values()}

    def check(self) -> None:
        """The model's own invariants (it must never believe an impossible state)."""
        for g in self.groups.values():
            held = [c.id for c in self.group_checkouts(g.name)]
            assert len(held) == len(set(held)), f"{g.name}: an id checked out twice at once: {sorted(held)}"
            for i in range(self.first, self.seq + 1):
                states = [i in g.done, i in g.ready, i in g.delayed, i in held, i >= g.cursor]
                assert sum(states) == 1, f"{g.name}: id {i} is in {sum(states)} states {states}"
            if g.mode == "single-active":
                # only the active member ever holds checkouts
                assert all(c.member == g.owner for c in self.group_checkouts(g.name))
            if g.owner is not None:
                assert g.owner in g.members
