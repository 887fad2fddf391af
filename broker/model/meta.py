"""A queue's meta hash, read from Python: its field names, and its compact form.

Queue-level fields have plain names; a group's are ``g|<group>|<field>``, a
member's ``m|<group>|<member>|<field>`` (group and member names never hold
``|``: keys.check_name). The names below are what the Lua fences write
(lua/_common.lua ``gf``/``mf``; docs/data-model.md): Python code says
``MARKER``, never the two letters it is stored under.

An lmq at rest (one group, whose only member is its owner) keeps only the
meta fields that differ from their defaults; ``z`` = ``<group>|<owner>``
stands for the group, its member list and its owner, and the few fields left
take one-letter names, times in seconds (lua/_compact_meta.lua, ``compact_meta``;
docs/data-model.md, "Lmqs at rest"). The fences read through it; code that
reads meta hashes directly (the operator views) calls :func:`expand` (or
:func:`decode`) to see every field spelled out. The names and defaults here
must match ``compact_names`` / ``compact_defaults`` / ``SHORT_NAMES`` in
lua/_compact_meta.lua: tests/fences/test_lmq_at_rest.py holds the two to each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from fencemq.model.records import decode_names
from fencemq.model.values import text

# -- queue-level fields
SEQ = "seq"  # the last message id
FIRST = "first"  # the first retained message id
TAG = "tag"  # the last delivery tag
CREATED = "ct"  # ms
LAST_WRITE = "wt"  # ms
GROUPS = "groups"  # the group names, in creation order (records.encode_names)
JOURNAL_CAP = "jcap"
PUSH = "push"  # the push members (records.encode_push_members)
MAX_FAILURES = "maxdel"
PRIORITY = "prio"  # "1": the queue honours PUB … PRIORITY (lua/lib/priority.lua); absent: it does not
SERVER = "srv"  # the server that gave the last ids: its run_id's first 8 hex digits (lua/lib/ids.lua)
GAPS = "gaps"  # "a-b,c-d": ids skipped after a promotion or a restart, that no message holds (lua/lib/ids.lua)

# -- group fields: group_field(group, name)
MODE = "mode"  # exclusive | shared | single-active
CURSOR = "cur"  # the next id the group reads
EPOCH = "ep"
OWNER = "own"  # the exclusive owner, or the active member of a single-active group
POLICY = "pol"  # preempt | reject
ON_PREEMPT = "onpre"
MEMBERS = "mem"  # member names in arrival order (records.encode_names)
STRATEGY = "strat"  # a shared group's: round-robin | sticky | hash
QUEUE_OFFLINE = "qoff"
ROUND_ROBIN = "rr"  # the round-robin pointer
STICKY = "stk"  # the sticky member
LEVEL_CURSORS = "pc"  # a priority queue's: the next id to read at each level, level 0 first; absent: all = cur

# -- member fields: member_field(group, member, name)
DELIVERED = "n"
MAX = "max"  # MAX n: end of stream after n deliveries in all
LOCK = "lock"  # lease length, ms
SUSPECTED_SINCE = "sus"  # ms; absent: not suspected
TIMED_OUT = "to"  # with sus: the tags whose leases ran out (space-separated, at most 100), told again to its PULL or TAKE
MARKER = "mk"  # the eviction marker: who preempted (or evicted) this member
MARKER_JOURNALED = "fj"  # with mk: the fenced attempt is journaled ("1"); "2": the member has polled since (told again)
CAPACITY = "cap"  # a push member's mailbox capacity; absent: a pull member
QOS = "qos"
ENDED = "end"  # the end-of-stream sentinel is seated
ONLINE = "on"  # "0": its session has no connection


def gaps(fields: dict[str, str]) -> list[tuple[int, int]]:
    """The queue's gaps, ascending: inclusive ranges of ids no message holds or ever will."""
    text = fields.get(GAPS)
    if not text:
        return []
    return [(int(a), int(b)) for a, _, b in (span.partition("-") for span in text.split(","))]


def ids_between(fields: dict[str, str], low: int, high: int) -> int:
    """How many ids of [low, high] may hold a message: those in no gap (lua/lib/ids.lua, count_between)."""
    if high < low:
        return 0
    n = high - low + 1
    for a, b in gaps(fields):
        n -= max(0, min(b, high) - max(a, low) + 1)
    return n


def unread(fields: dict[str, str], cursor: int) -> int:
    """How many messages a group whose cursor is ``cursor`` has not read (a queue not set to honour priority)."""
    seq, first = int(fields.get(SEQ) or 0), int(fields.get(FIRST) or 1)
    return ids_between(fields, max(cursor, first), seq)


def past_gap(fields: dict[str, str], position: int) -> int:
    """``position``, or the first id after the gap it falls in."""
    for a, b in gaps(fields):
        if a <= position <= b:
            position = b + 1
    return position


def group_field(group: str, name: str) -> str:
    return f"g|{group}|{name}"


def member_field(group: str, member: str, name: str) -> str:
    return f"m|{group}|{member}|{name}"


@dataclass(slots=True)
class Meta:
    """A meta hash spelled out and sorted by what each field belongs to.

    Dicts keep the order in which a group or member first appears among the
    hash's fields; ``group_names`` is the creation order the hash records.
    """

    fields: dict[str, str] = field(default_factory=dict)  # queue-level
    groups: dict[str, dict[str, str]] = field(default_factory=dict)
    members: dict[tuple[str, str], dict[str, str]] = field(default_factory=dict)

    @property
    def group_names(self) -> list[str]:
        return decode_names(self.fields.get(GROUPS))

    def member_names(self, group: str) -> list[str]:
        """A group's members in arrival order (single-active succession order)."""
        return decode_names(self.groups.get(group, {}).get(MEMBERS))


def decode(raw: dict[bytes, bytes] | dict[str, str] | list[Any]) -> Meta:
    """A meta hash (HGETALL's dict, or a flat field/value list), compact or not."""
    if isinstance(raw, list):
        raw = dict(zip(raw[0::2], raw[1::2], strict=True))
    meta = Meta()
    for name, value in expand(raw).items():
        parts = name.split("|")
        if len(parts) == 3 and parts[0] == "g":
            meta.groups.setdefault(parts[1], {})[parts[2]] = value
        elif len(parts) == 4 and parts[0] == "m":
            meta.members.setdefault((parts[1], parts[2]), {})[parts[3]] = value
        else:
            meta.fields[name] = value
    return meta


# -- the compact form ----------------------------------------------------------------------------

COMPACT_MARK = "z"  # "<group>|<owner>", or "<owner>" for the lite default group
LITE_GROUP = "default"  # a lite SUB's group when it names none
TIMES = ("C", "W")  # kept in seconds


AT_REST = {SEQ: "S", TAG: "T"}  # queue-level counters: their names in a compact hash


def _short_names(group: str, owner: str) -> dict[str, str]:
    return {AT_REST[SEQ]: SEQ, AT_REST[TAG]: TAG, "N": member_field(group, owner, DELIVERED), "C": CREATED,
            "W": LAST_WRITE}


def _defaults(group: str, owner: str, seq: int) -> dict[str, str]:
    def g(name: str) -> str:
        return group_field(group, name)

    def m(name: str) -> str:
        return member_field(group, owner, name)

    return {
        FIRST: str(seq + 1), SEQ: "0", g(MODE): "exclusive", g(POLICY): "preempt", g(EPOCH): "0",
        g(ON_PREEMPT): "keep", GROUPS: group, g(MEMBERS): owner, m(DELIVERED): "0", m(QOS): "1", m(ONLINE): "1",
        JOURNAL_CAP: "0", g(CURSOR): str(seq + 1),
    }


def from_rest(packed: bytes | None) -> dict[str, str]:
    """The meta hash of an lmq at rest without a key of its own, from its field in its slot's rest
    hash (keys.QueueKeys.rest; lua/lib/meta.lua, ``put_to_rest``): msgpack of the hash's flat
    field, value… list (a value that is a decimal integer packed as an integer), always a compact hash (read it through :func:`expand`). ``{}`` for None."""
    if packed is None:
        return {}
    flat = msgpack.unpackb(packed, raw=True)
    return {text(k): str(v) if isinstance(v, int) else text(v) for k, v in zip(flat[0::2], flat[1::2], strict=True)}


def expand(raw: dict[bytes, bytes] | dict[str, str]) -> dict[str, str]:
    """Every field of a meta hash as text, a compact one spelled out."""
    fields = {text(k): text(v) for k, v in raw.items()}
    mark = fields.pop(COMPACT_MARK, None)
    if mark is None:
        return fields
    group, bar, owner = mark.partition("|")
    if not bar:
        group, owner = LITE_GROUP, mark
    fields[group_field(group, OWNER)] = owner
    for short, name in _short_names(group, owner).items():
        if short in fields:
            value = fields.pop(short)
            fields[name] = str(int(value) * 1000) if short in TIMES else value
    for name, value in _defaults(group, owner, int(fields.get(SEQ, "0"))).items():
        fields.setdefault(name, value)
    return fields
