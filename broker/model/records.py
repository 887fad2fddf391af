"""Every record the fences store, each with its one codec: ``encode`` and ``decode``.

The Lua fences write these (lua/lib/checkouts.lua, lua/lib/leases.lua, lua/lib/journal.lua,
lua/lib/mailbox.lua, lua/nack.lua;
docs/data-model.md); Python reads them here and nowhere else: the operator
views, the snapshot, the CLI and the benchmarks. Pure: no I/O. ``decode``
takes bytes or str (redis-py gives either), ``encode`` gives bytes byte for
byte what the Lua side writes, so ``encode(decode(raw)) == raw``.

Lex-ordered records (checkouts held, returned messages) start with the group
(and member) joined by NUL: :func:`lex_range` gives the ZRANGEBYLEX bounds of
one group's, or one member's, entries.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from fencemq.model.values import text

SEP = "\x00"  # between the fields of checkout, ready, owned and mailbox records
ID_DIGITS = 16  # a ready entry's id, zero-padded: lex order is id order
JOURNAL_FIELDS = 8
END_OF_STREAM = b"EOS"  # the mailbox entry a push member ends at


def _fields(raw: bytes | str, count: int, what: str) -> list[str]:
    parts = text(raw).split(SEP)
    if len(parts) != count:
        raise ValueError(f"a {what} has {count} NUL-separated fields, not {len(parts)}: {text(raw)[:80]!r}")
    return parts


def _number(value: str) -> int:
    """An integer Lua wrote (``tostring`` of a large number may be in exponent form)."""
    try:
        return int(value)
    except ValueError:
        return int(float(value))


def _join(*parts: Any) -> bytes:
    return SEP.join(str(p) for p in parts).encode()


def lex_range(*parts: str) -> tuple[bytes, bytes]:
    """ZRANGEBYLEX bounds of every entry starting with ``parts`` joined by NUL, then NUL."""
    prefix = SEP.join(parts).encode()
    return b"[" + prefix + SEP.encode(), b"(" + prefix + b"\x01"


BATCH = "b"  # a lease batch's key starts so: 'b<first tag>+<span>' (no delivery tag does)


def is_batch_key(field: bytes | str) -> bool:
    """Is this field of the checkouts hash (or member of the deadlines zset, last field of an owned
    entry) a lease batch's key rather than a delivery tag? (lua/lib/checkouts.lua)"""
    return text(field)[:1] == BATCH


def held_under(leases: Iterable[str], counts: Mapping[str, int]) -> int:
    """How many checkouts these leases hold: a tag one, a lease batch its count (``counts``: batch key ->
    the checkouts hash's count under it)."""
    return sum(counts.get(lease, 0) if is_batch_key(lease) else 1 for lease in leases)


def checkouts_in(hash_length: int, leases: Iterable[bytes | str]) -> int:
    """The checkouts a checkouts hash of ``hash_length`` fields holds, given every lease with a deadline
    (the deadlines zset's members): each lease batch has one count field beside the records."""
    return hash_length - sum(1 for lease in leases if is_batch_key(lease))


def batch_span(key: bytes | str) -> tuple[int, int]:
    """A lease batch's first tag and span (its last tag - its first) from its key."""
    first, span = text(key)[1:].split("+")
    return int(first), int(span)


@dataclass(frozen=True, slots=True)
class Checkout:
    """A checkout record (``co`` hash, by delivery tag): ``group NUL member NUL id NUL epoch NUL acquisitions NUL failures``,
    then, for a checkout of a lease batch (one PULL's checkouts under one deadline), ``NUL`` and the batch's key."""

    group: str
    member: str
    id: int
    epoch: int
    acquisitions: int
    failures: int
    batch: str | None = None

    def encode(self) -> bytes:
        if self.batch is None:
            return _join(self.group, self.member, self.id, self.epoch, self.acquisitions, self.failures)
        return _join(self.group, self.member, self.id, self.epoch, self.acquisitions, self.failures, self.batch)

    def lease(self, tag: bytes | str) -> str:
        """The lease this checkout (of ``tag``) is under, as the deadlines zset names it: its batch's key, or its tag."""
        return text(tag) if self.batch is None else self.batch

    @classmethod
    def decode(cls, raw: bytes | str) -> Checkout:
        parts = text(raw).split(SEP)
        if len(parts) == 7:
            g, m, msg_id, epoch, acq, fail, batch = parts
            if not is_batch_key(batch):
                raise ValueError(f"a checkout record's seventh field is a lease batch's key: {text(raw)[:80]!r}")
            return cls(g, m, _number(msg_id), _number(epoch), _number(acq), _number(fail), batch)
        g, m, msg_id, epoch, acq, fail = _fields(raw, 6, "checkout record")
        return cls(g, m, _number(msg_id), _number(epoch), _number(acq), _number(fail))


def checkout_items(pairs: Any) -> list[tuple[str, Checkout]]:
    """The (tag, checkout) pairs of a checkouts hash read whole (HGETALL, as pairs), its lease batches'
    counts left out."""
    return [(text(tag), Checkout.decode(rec)) for tag, rec in pairs if not is_batch_key(tag)]


def per_tag_view(co: dict[str, Any], deadlines: dict[str, int], owned: list[Any]
                 ) -> tuple[dict[str, bytes], dict[str, int], set[bytes]]:
    """A queue's checkouts as if each had a lease of its own (the layout before lease batches): its
    record without its place in a batch, a deadline and an ownership entry per tag. ``co`` is the
    checkouts hash (tag -> record, batch counts included), ``deadlines`` the deadlines zset (member ->
    ms), ``owned`` the ownership index's entries. What a check written for one lease per checkout reads."""
    records: dict[str, bytes] = {}
    per_tag: dict[str, int] = {}
    own: set[bytes] = set()
    batches_owned = set()
    for raw in owned:
        entry = OwnedEntry.decode(raw)
        if is_batch_key(entry.tag):
            batches_owned.add((entry.group, entry.member, entry.tag))
        else:
            own.add(entry.encode())
    for tag, raw in co.items():
        tag = text(tag)
        if is_batch_key(tag):
            continue
        c = Checkout.decode(raw)
        lease = c.lease(tag)
        records[tag] = Checkout(c.group, c.member, c.id, c.epoch, c.acquisitions, c.failures).encode()
        if lease in deadlines:
            per_tag[tag] = deadlines[lease]
        if lease != tag and (c.group, c.member, lease) in batches_owned:
            own.add(OwnedEntry(c.group, c.member, tag).encode())
    for member, score in deadlines.items():
        if not is_batch_key(member) and text(member) not in per_tag:
            per_tag[text(member)] = score  # a deadline with no record (settled meanwhile): as it is
    return records, per_tag, own


@dataclass(frozen=True, slots=True)
class ReadyEntry:
    """A returned (``rd``) or delayed (``dly``) message: ``group NUL id(16 digits) NUL acquisitions NUL failures``."""

    group: str
    id: int
    acquisitions: int
    failures: int

    def encode(self) -> bytes:
        return _join(self.group, f"{self.id:0{ID_DIGITS}d}", self.acquisitions, self.failures)

    @classmethod
    def decode(cls, raw: bytes | str) -> ReadyEntry:
        g, msg_id, acq, fail = _fields(raw, 4, "ready entry")
        return cls(g, _number(msg_id), _number(acq), _number(fail))

    @staticmethod
    def group_of(raw: bytes | str) -> str:
        """Only the group (counting per group needs no more)."""
        return text(raw).split(SEP, 1)[0]


@dataclass(frozen=True, slots=True)
class OwnedEntry:
    """A checkout a member holds (``own`` zset): ``group NUL member NUL tag``."""

    group: str
    member: str
    tag: str

    def encode(self) -> bytes:
        return _join(self.group, self.member, self.tag)

    @classmethod
    def decode(cls, raw: bytes | str) -> OwnedEntry:
        return cls(*_fields(raw, 3, "owned entry"))


@dataclass(frozen=True, slots=True)
class JournalLine:
    """A journal event (``jr`` list): ``ms TAB event TAB group TAB member TAB id TAB tag TAB epoch TAB extra``.

    The fences write an absent field as an empty one; here it is None. The
    extra field is last, so it may hold tabs. A QoS 0 delivery's tag starts with 'q'.
    A journal entry may also be a batch (:class:`JournalBatch`): read entries
    with :func:`journal_events`, which takes either.
    """

    ms: int
    event: str
    group: str | None = None
    member: str | None = None
    id: int | None = None
    tag: str | None = None
    epoch: int | None = None
    extra: str | None = None

    def encode(self) -> bytes:
        parts = (self.ms, self.event, self.group, self.member, self.id, self.tag, self.epoch, self.extra)
        return "\t".join("" if p is None else str(p) for p in parts).encode()

    @classmethod
    def decode(cls, raw: bytes | str) -> JournalLine:
        ms, event, group, member, msg_id, tag, epoch, extra = _journal_fields(raw)
        if _is_batch(msg_id):
            raise ValueError(f"a batch journal entry holds many events (read it with journal_events): {text(raw)[:80]!r}")
        return cls(_number(ms), event, group or None, member or None, _number(msg_id) if msg_id else None,
                   tag or None, _number(epoch) if epoch else None, extra or None)


def _journal_fields(raw: bytes | str) -> list[str]:
    p = text(raw).split("\t", JOURNAL_FIELDS - 1)
    return p + [""] * (JOURNAL_FIELDS - len(p))


def _is_batch(ids: str) -> bool:
    return "," in ids or "-" in ids


def _expand_runs(field: str) -> list[str]:
    """``q7-9,10`` -> ``q7 q8 q9 10``: runs of consecutive integers, each with its prefix."""
    out: list[str] = []
    for run in field.split(","):
        first, _, last = run.partition("-")
        prefix = first.rstrip("0123456789")
        start = int(first[len(prefix):])
        out += [f"{prefix}{n}" for n in range(start, int(last) + 1 if last else start + 1)]
    return out


def _compress_runs(values: list[str]) -> str:
    """The inverse of :func:`_expand_runs`, as lua/lib/journal.lua writes it (longest runs first)."""
    out: list[str] = []
    i = 0
    while i < len(values):
        prefix = values[i].rstrip("0123456789")
        j = i
        while (j + 1 < len(values) and values[j + 1].rstrip("0123456789") == prefix
               and int(values[j + 1][len(prefix):]) == int(values[j][len(prefix):]) + 1):
            j += 1
        out.append(values[i] if j == i else f"{values[i]}-{values[j][len(prefix):]}")
        i = j + 1
    return ",".join(out)


def _expand_repeats(field: str) -> list[str]:
    """``1*99,2`` -> 99 times ``1``, then ``2``."""
    out: list[str] = []
    for item in field.split(","):
        value, star, times = item.rpartition("*") if "*" in item else (item, "", "1")
        out += [value] * int(times)
    return out


def _compress_repeats(values: list[str]) -> str:
    out: list[str] = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[i]:
            j += 1
        out.append(values[i] if j == i else f"{values[i]}*{j - i + 1}")
        i = j + 1
    return ",".join(out)


@dataclass(frozen=True, slots=True)
class JournalBatch:
    """One journal entry for the messages of one fence call (publish, pull, ack): they share the time,
    event, group, member and epoch. The fields of a :class:`JournalLine`, with ``ids`` as runs
    (``5-104,107``), ``tags`` as runs keeping their prefix (``q7-9,10``) and ``extras`` as repeats
    (``1*99,2``): empty when the event has none. A batch of one is written as a plain JournalLine.
    """

    ms: int
    event: str
    group: str | None
    member: str | None
    ids: tuple[int, ...]
    tags: tuple[str, ...] | None = None
    epoch: int | None = None
    extras: tuple[str, ...] | None = None

    def events(self) -> list[JournalLine]:
        tags = self.tags or (None,) * len(self.ids)
        extras = self.extras or (None,) * len(self.ids)
        return [JournalLine(self.ms, self.event, self.group, self.member, msg_id, tag, self.epoch, extra)
                for msg_id, tag, extra in zip(self.ids, tags, extras, strict=True)]

    def encode(self) -> bytes:
        parts = (self.ms, self.event, self.group, self.member, _compress_runs([str(i) for i in self.ids]),
                 _compress_runs(list(self.tags)) if self.tags else None, self.epoch,
                 _compress_repeats(list(self.extras)) if self.extras else None)
        return "\t".join("" if p is None else str(p) for p in parts).encode()

    @classmethod
    def decode(cls, raw: bytes | str) -> JournalBatch:
        ms, event, group, member, ids, tags, epoch, extras = _journal_fields(raw)
        id_list = tuple(int(i) for i in _expand_runs(ids))
        tag_list = tuple(_expand_runs(tags)) if tags else None
        extra_list = tuple(_expand_repeats(extras)) if extras else None
        for what, values in (("tags", tag_list), ("extras", extra_list)):
            if values is not None and len(values) != len(id_list):
                raise ValueError(f"a journal batch has {len(id_list)} ids but {len(values)} {what}: {text(raw)[:80]!r}")
        return cls(_number(ms), event, group or None, member or None, id_list, tag_list,
                   _number(epoch) if epoch else None, extra_list)


def journal_events(raw: bytes | str) -> list[JournalLine]:
    """The events of one journal entry: one for a plain line (old or new), all of them for a batch."""
    if _is_batch(_journal_fields(raw)[4]):
        return JournalBatch.decode(raw).events()
    return [JournalLine.decode(raw)]


def decode_journal_entry(raw: bytes | str) -> JournalLine | JournalBatch:
    """A journal entry as its codec reads it (``encode`` gives the same bytes back)."""
    return JournalBatch.decode(raw) if _is_batch(_journal_fields(raw)[4]) else JournalLine.decode(raw)


def _msgpack_str(raw: bytes) -> bytes:
    """A string as Lua's cmsgpack packs it: always the str type (even binary), str8 from 32 bytes."""
    n = len(raw)
    if n < 32:
        head = bytes([0xA0 | n])
    elif n < 1 << 8:
        head = b"\xd9" + n.to_bytes(1, "big")
    elif n < 1 << 16:
        head = b"\xda" + n.to_bytes(2, "big")
    else:
        head = b"\xdb" + n.to_bytes(4, "big")
    return head + raw


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A dead letter (``dlq`` list): the msgpack array ``[id, group, member, acquisitions, failures, ms, body]``.

    ``body`` is the message as the log stored it (messages.unpack_delivery reads it);
    ``ms`` is when it was dead-lettered.
    """

    id: int
    group: str
    member: str
    acquisitions: int
    failures: int
    ms: int
    body: bytes

    def encode(self) -> bytes:
        out = [b"\x97", msgpack.packb(self.id), _msgpack_str(self.group.encode()), _msgpack_str(self.member.encode())]
        out += [msgpack.packb(n) for n in (self.acquisitions, self.failures, self.ms)]
        return b"".join([*out, _msgpack_str(self.body)])

    @classmethod
    def decode(cls, raw: bytes) -> DeadLetter:
        msg_id, group, member, acq, fail, ms, body = msgpack.unpackb(raw, raw=True)
        return cls(int(msg_id), text(group), text(member), int(acq), int(fail), int(ms), bytes(body))


@dataclass(frozen=True, slots=True)
class MailboxEntry:
    """A message in a push member's mailbox: ``tag NUL id NUL acquisitions NUL epoch NUL body``.

    The mailbox ends with the entry :data:`END_OF_STREAM` (see :func:`is_end_of_stream`).
    The body (last) is the stored message and may hold NUL bytes.
    """

    tag: str
    id: int
    acquisitions: int
    epoch: int
    body: bytes

    def encode(self) -> bytes:
        return _join(self.tag, self.id, self.acquisitions, self.epoch) + SEP.encode() + self.body

    @classmethod
    def decode(cls, raw: bytes) -> MailboxEntry:
        if is_end_of_stream(raw):
            raise ValueError("the end-of-stream sentinel is not a message")
        parts = bytes(raw).split(SEP.encode(), 4)
        if len(parts) != 5:
            raise ValueError(f"a mailbox entry has 5 NUL-separated fields, not {len(parts)}")
        tag, msg_id, acq, epoch, body = parts
        return cls(text(tag), _number(text(msg_id)), _number(text(acq)), _number(text(epoch)), body)


def is_end_of_stream(raw: bytes | str) -> bool:
    return (raw.encode() if isinstance(raw, str) else bytes(raw)) == END_OF_STREAM


# -- lists kept in one meta field ----------------------------------------------------------------


def decode_names(value: bytes | str | None) -> list[str]:
    """A meta field listing names one per line (a group's members, the queue's groups)."""
    return [name for name in text(value).split("\n") if name] if value else []


def encode_names(names: list[str]) -> str:
    return "\n".join(names)


def decode_push_members(value: bytes | str | None) -> list[tuple[str, str]]:
    """The queue's push members (meta ``push``): ``group TAB member`` lines."""
    return [(g, m) for g, _, m in (line.partition("\t") for line in decode_names(value))]


def encode_push_members(members: list[tuple[str, str]]) -> str:
    return "\n".join(f"{g}\t{m}" for g, m in members)
