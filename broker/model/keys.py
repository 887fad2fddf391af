"""Key names: the only module that knows how FenceMQ lays its state out in Redis.

Every key of one queue starts with ``<prefix>:{<queue id>}`` so they all share
one hash tag, hence one Cluster slot, and a fence script can declare them all
in KEYS. Client-supplied names are escaped so that no two queues can ever
produce the same key and no name can break out of its hash tag.

A *queue* is a plain topic (``t:<topic>``), one lite queue of a lite topic
(``l:<topic>:<lmq>``), or the queue of one MQTT filter subscription
(``f:<owner>:<filter>``: owner is the client, or ``$share/<group>``), fed
by fan-out at publish. The layout of a queue, and why it is so small, is
described in docs/data-model.md.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import unquote
from dataclasses import dataclass
from functools import lru_cache


from fencemq.errors import BadArgument
from fencemq.model.slots import SLOTS, key_slot, slot_tag

# Bytes that would make names ambiguous inside a key, or break the hash tag.
_UNSAFE = re.compile(r"[%{}:\x00-\x20\x7f]")

MAX_TOPIC_BYTES = 512
MAX_NAME_BYTES = 128
# Group and client names end up inside hash field names joined by '|' and in
# lex-ordered members joined by NUL, so those bytes cannot appear in them.
_NAME_OK = re.compile(r"^[\x21-\x7e]+$")


def escape(name: str) -> str:
    return _UNSAFE.sub(lambda m: "%%%02X" % ord(m.group()), name)


def check_topic(topic: str, what: str = "topic") -> str:
    if not topic:
        raise BadArgument(f"{what} name is empty; give a non-empty name")
    if len(topic.encode()) > MAX_TOPIC_BYTES:
        raise BadArgument(f"{what} name is longer than {MAX_TOPIC_BYTES} bytes; use a shorter name")
    if "\x00" in topic:
        raise BadArgument(f"{what} name contains NUL; remove it")
    return topic


def check_name(name: str, what: str) -> str:
    """Group, client and lmq names: printable ASCII without '|' (a field separator)."""
    if not name:
        raise BadArgument(f"{what} name is empty; give a non-empty name")
    if len(name) > MAX_NAME_BYTES:
        raise BadArgument(f"{what} name is longer than {MAX_NAME_BYTES} bytes; use a shorter name")
    if not _NAME_OK.match(name) or "|" in name:
        raise BadArgument(f"{what} name '{name}' must be printable ASCII without spaces or '|'")
    return name


@dataclass(frozen=True, slots=True)
class QueueRef:
    """Identifies one queue: a plain topic, one lmq of a lite topic, or a filter subscription's."""

    topic: str  # the topic, or the filter of a filter subscription
    lmq: str | None = None
    owner: str | None = None  # filter subscriptions: the client, or $share/<group>

    @property
    def lite(self) -> bool:
        return self.lmq is not None

    @property
    def is_filter(self) -> bool:
        return self.owner is not None

    @property
    def qid(self) -> str:
        if self.owner is not None:
            return "f:" + escape(self.owner) + ":" + escape(self.topic)
        if self.lmq is None:
            return "t:" + escape(self.topic)
        return "l:" + escape(self.topic) + ":" + escape(self.lmq)

    def __str__(self) -> str:
        return self.topic if self.lmq is None else f"{self.topic}[{self.lmq}]"


def queue_ref(qid: str) -> QueueRef:
    """The queue a queue id (``QueueRef.qid``) names: its inverse."""
    kind, _, rest = qid.partition(":")
    if kind == "t":
        return QueueRef(unquote(rest))
    if kind == "f":
        owner, _, filt = rest.partition(":")
        return QueueRef(unquote(filt), None, unquote(owner))
    topic, _, lmq = rest.partition(":")
    return QueueRef(unquote(topic), unquote(lmq))


def _slot_name(base: str, tag: str) -> str:
    prefix, _, name = base.rpartition(":")
    return f"{prefix}:{{{tag}}}:{name}"


@lru_cache(maxsize=16)
def _every_slot_name(base: str) -> tuple[str, ...]:
    return tuple(_slot_name(base, slot_tag(slot)) for slot in range(SLOTS))


def totals_registry(prefix: str) -> str:
    """The set of slots in use by the totals of the keyspace ``prefix`` (Keyspace.totals_slots)."""
    return f"{prefix}:totals-slots"


def slot_totals_registry(slot_key_name: str) -> str:
    """The registry (:func:`totals_registry`) a slot's totals key ``<prefix>:{<tag>}:totals`` is listed in."""
    return totals_registry(slot_key_name.rpartition(":{")[0])


def slot_key(base: str, key: str) -> str:
    """``base`` (``<prefix>:totals``) of the slot ``key`` is in: ``<prefix>:{<slot tag>}:totals``."""
    return _slot_name(base, slot_tag(key_slot(key)))


@dataclass(frozen=True, slots=True)
class QueueKeys:
    """All keys of one queue; every one carries the same hash tag."""

    meta: str  # hash: counters, config, group and member state
    log: str  # hash: message id -> "<publish ms>:<msgpack body>"
    checkouts: str  # hash: delivery tag -> group NUL member NUL id NUL epoch NUL acquisitions NUL failures
    deadlines: str  # zset: delivery tag scored by lease deadline (ms)
    owned: str  # zset (lex): group NUL member NUL tag, to return a member's checkouts in O(own)
    held: str  # zset: delivery tag scored by its message id, to find the lowest id checked out (retention)
    ready: str  # zset (lex): group NUL id(16 digits) NUL acquisitions NUL failures: returned messages
    delayed: str  # zset: same members as ready, scored by the time they become ready
    dedup: str  # zset: dedup id scored by publish time
    dedup_ids: str  # hash: dedup id -> message id
    dead: str  # list: dead-lettered messages
    journal: str  # list: capped event journal
    wake: str  # sharded pub/sub channel: "something became ready"
    waiters: str  # zset: waiting long polls a publish hands messages to, scored by the end of their wait
    scheduled: str  # zset: schedule id of a message published for later, scored by when it is due (ms)
    scheduled_bodies: str  # hash: schedule id -> the stored body it will be appended with
    priority: str  # zset: a priority queue's message ids scored (9 - level) * 2^48 + id (lua/lib/priority.lua)
    # The broker's totals the fences keep (lua/lib/totals.lua): one hash and one zset for the whole
    # broker on a single server; on a Cluster the pair of the queue's slot (slot_totals, slot_backlogs)
    totals: str  # hash: figures and events, broker-wide and per entry
    backlogs: str  # zset: entry (a topic, a lite topic, a filter queue) -> messages ready
    # An lmq at rest without a key of its own (docs/data-model.md, "Lmqs at rest"): the hash of
    # the lmq's slot that holds it, field ``rest_field``, while its meta key does not exist; a
    # queue that is not an lmq never rests, and names its meta here (same slot, never read as rest)
    rest: str
    rest_field: str  # the queue id: the meta key's hash tag

    @property
    def slot_totals(self) -> str:
        return slot_key(self.totals, self.meta)

    @property
    def slot_backlogs(self) -> str:
        return slot_key(self.backlogs, self.meta)

    def mailbox(self, group: str, member: str) -> str:
        return f"{self.meta}:mb:{escape(group)}:{escape(member)}"

    def lease_keys(self) -> list[str]:
        """The keys every lease-moving fence declares, in this order."""
        return [self.meta, self.log, self.checkouts, self.deadlines, self.owned, self.held, self.ready, self.delayed]

    def all_keys(self) -> list[str]:
        """Every fixed key of the queue (mailboxes aside), e.g. to delete it."""
        return [self.meta, self.log, self.checkouts, self.deadlines, self.owned, self.held, self.ready, self.delayed,
                self.dedup, self.dedup_ids, self.dead, self.journal, self.waiters, self.scheduled,
                self.scheduled_bodies, self.priority]


class Keyspace:
    """Builds key names under a configurable prefix (default ``fmq``)."""

    def __init__(self, prefix: str = "fmq") -> None:
        if not prefix or _UNSAFE.search(prefix):
            raise BadArgument("key prefix must be non-empty without '{', '}', ':', '%' or spaces")
        self.prefix = prefix
        # The lease schedule and the lease intents beside it (fences/leases.py): the first of its
        # shards (fences/schedule_shards.py), the only one on a single server
        self.schedule = f"{prefix}:{{schedule}}"  # zset: queue id -> earliest due time
        self.schedule_intents = f"{prefix}:{{schedule}}:intents"  # zset: queue id -> last lease intent (ms)
        self.sessions = f"{prefix}:sessions"  # zset: client id -> session lease deadline
        self.workers = f"{prefix}:workers"  # zset: worker id -> worker lease deadline
        self._queue_keys = lru_cache(maxsize=65536)(self._build_queue_keys)

    def queue(self, ref: QueueRef) -> QueueKeys:
        return self._queue_keys(ref.qid)

    def schedule_shard(self, shard: int) -> tuple[str, str]:
        """(schedule, intents) of one shard of the lease schedule, each shard a hash tag of its own."""
        if shard == 0:
            return self.schedule, self.schedule_intents
        base = f"{self.prefix}:{{schedule:{shard}}}"
        return base, f"{base}:intents"

    def queue_by_id(self, qid: str) -> QueueKeys:
        return self._queue_keys(qid)

    def _build_queue_keys(self, qid: str) -> QueueKeys:
        base = f"{self.prefix}:{{{qid}}}"
        return QueueKeys(
            meta=base,
            log=base + ":log",
            checkouts=base + ":co",
            deadlines=base + ":dl",
            owned=base + ":own",
            held=base + ":held",
            ready=base + ":rd",
            delayed=base + ":dly",
            dedup=base + ":dd",
            dedup_ids=base + ":ddm",
            dead=base + ":dlq",
            journal=base + ":jr",
            wake=base + ":wake",
            waiters=base + ":lp",
            scheduled=base + ":sch",
            scheduled_bodies=base + ":schb",
            priority=base + ":pri",
            totals=self.totals,
            backlogs=self.backlogs,
            rest=slot_key(self.rest_base, base) if qid.startswith("l:") else base,
            rest_field=qid,
        )

    @property
    def rest_base(self) -> str:
        """``<prefix>:rest``: its slot's copy, ``<prefix>:{<slot tag>}:rest``, holds the lmqs of that
        slot at rest (QueueKeys.rest); :meth:`rest_keys` names them all."""
        return f"{self.prefix}:rest"

    def rest_keys(self, slots: Iterable[int] | None = None) -> list[str]:
        """The rest hashes of the slots ``slots`` (default: every slot), in that order."""
        return self.slot_keys("rest_base", slots)

    @property
    def totals(self) -> str:
        """Hash: the broker's totals on a single server (QueueKeys.slot_totals on a Cluster)."""
        return f"{self.prefix}:totals"

    @property
    def backlogs(self) -> str:
        """Zset: each entry's messages ready, on a single server (QueueKeys.slot_backlogs on a Cluster)."""
        return f"{self.prefix}:backlogs"

    def slot_keys(self, name: str, slots: Iterable[int] | None = None) -> list[str]:
        """``totals`` or ``backlogs`` of the Cluster slots ``slots`` (default: every slot), in that order."""
        names = _every_slot_name(getattr(self, name))
        return list(names) if slots is None else [names[slot] for slot in slots]

    @property
    def totals_slots(self) -> str:
        """Set: the Cluster slots whose totals a fence may have written (what a Cluster's totals are
        summed from): a worker adds a slot before its first fence call that carries the slot's
        totals (fences/registry.py, ``Fences.register_totals``)."""
        return totals_registry(self.prefix)

    def topic(self, topic: str) -> str:
        """Hash: the topic's kind (plain or lite) and its configuration."""
        return f"{self.prefix}:topic:{{{escape(topic)}}}"

    def session(self, client: str) -> str:
        return f"{self.prefix}:sess:{{{escape(client)}}}"

    def session_ending(self, client: str) -> str:
        """String: the lock a cleaner holds while it ends the session (broker/fences/sessions.py)."""
        return self.session(client) + ":ending"

    def session_conns(self, client: str) -> str:
        """Set: the tokens of the connections that share the session (a client's pool)."""
        return self.session(client) + ":conns"

    def session_handles(self, client: str) -> str:
        """Set: the client's non-lite handles (lite ones are in session_lmqs; broker/session_index.py)."""
        return self.session(client) + ":subs"

    def session_lmqs(self, client: str, bucket: int) -> str:
        """Hash, one of 16 buckets: ``group|lmq|topic`` -> "" per lite subscription the client holds."""
        return f"{self.session(client)}:lmqs:{bucket}"

    @property
    def users(self) -> str:
        """Hash: user name -> JSON record (scrypt hash of the password, grants); ops/users.py."""
        return f"{self.prefix}:users"

    @property
    def users_channel(self) -> str:
        """Pub/sub: the name of a user whose record changed (ops/users.py announces, the gate listens)."""
        return f"{self.users}:changed"

    @property
    def client_owners(self) -> str:
        """Hash: client id -> the user that first named a session with it (server/session.py)."""
        return f"{self.prefix}:client-owners"

    @property
    def handle_secret(self) -> str:
        """String: the key every worker signs the handles it hands out with (server/handles.py)."""
        return f"{self.prefix}:handle-secret"

    @property
    def filters(self) -> str:
        """Hash: filter subscription queue id -> msgpack [filter, share group or None, client or None]."""
        return f"{self.prefix}:filters"

    @property
    def filters_version(self) -> str:
        return f"{self.prefix}:filters:version"

    def filters_version_copy(self, shard: int) -> str:
        """String: on a Cluster, the filter registry's version as seen from one lease schedule shard's
        slot (fences/shared.py): every registration raises all of them, and a publish reads the one on
        its own queue's master, so the registry's master is on no publish's path."""
        tag = "schedule" if shard == 0 else f"schedule:{shard}"
        return f"{self.prefix}:{{{tag}}}:filters-version"

    @property
    def filters_channel(self) -> str:
        return f"{self.prefix}:filters:changed"

    @property
    def retention(self) -> str:
        """Hash: topic -> its retention policy, "count age_ms bytes" (fences/retention.py)."""
        return f"{self.prefix}:retention"

    @property
    def alarms(self) -> str:
        """Hash: alarm name (``memory@host:port``, ``eviction@host:port``) -> JSON record; fences/memory.py."""
        return f"{self.prefix}:alarms"

    @property
    def redis_nodes(self) -> str:
        """Hash: Redis node ``host:port`` -> JSON {role, primary, seen_ms}: the nodes the health watcher
        saw (a replica that is gone is shown down until forgotten); ops/redis_health.py."""
        return f"{self.prefix}:redis:nodes"

    @property
    def worker_figures(self) -> str:
        """Hash: worker id -> its open connections, noted at each health sample (server/health_watch.py)."""
        return f"{self.prefix}:workers:figures"

    @property
    def health_watcher(self) -> str:
        """String: the worker that judges the broker-wide alarms now, with a lease (server/health_watch.py)."""
        return f"{self.prefix}:health:watcher"

    @property
    def retained(self) -> str:
        """Hash: topic -> its retained message (stored form)."""
        return f"{self.prefix}:retained"

    # The retained messages' index (fences/retained.py), in the slot of ``retained`` (a hash tag of
    # its whole name: a key without braces hashes whole), so one fence keeps both.

    @property
    def retained_topics(self) -> str:
        """Zset (lex): every topic with a retained message."""
        return f"{self.prefix}:{{{self.retained}}}:topics"

    @property
    def retained_levels(self) -> str:
        """Zset (lex): the trie of the retained topics' levels, ``parent path NUL level`` per edge."""
        return f"{self.prefix}:{{{self.retained}}}:levels"

    @property
    def retained_indexed(self) -> str:
        """String: set once the index holds every retained topic (those kept before it existed)."""
        return f"{self.prefix}:{{{self.retained}}}:indexed"

    def session_lite_counts(self, client: str) -> str:
        """Hash: lite topic -> lite subscriptions the client holds (the quota)."""
        return self.session(client) + ":lite"

    def session_notices(self, client: str) -> str:
        return self.session(client) + ":notices"

    def session_channel(self, client: str) -> str:
        return self.session(client) + ":push"

    def queue_pattern(self) -> str:
        """SCAN pattern matching every queue's meta hash (and only those, with TYPE hash)."""
        return f"{self.prefix}:{{[tlf]:*}}"

    @staticmethod
    def qid_from_meta_key(key: str) -> str:
        return key[key.index("{") + 1 : key.rindex("}")]
