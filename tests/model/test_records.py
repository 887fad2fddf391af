"""The record codecs (fencemq.model.records) and the meta field names (fencemq.model.meta).

Every codec round-trips both ways, and reads the exact bytes the Lua fences
write (the formats in lua/_common.lua, lua/_mailbox.lua, lua/nack.lua);
tests/ops/test_records_at_rest.py holds them to what real fences stored.
"""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fencemq.model import meta
from fencemq.model.records import (
    END_OF_STREAM,
    Checkout,
    DeadLetter,
    JournalBatch,
    JournalLine,
    MailboxEntry,
    OwnedEntry,
    ReadyEntry,
    decode_names,
    decode_push_members,
    encode_names,
    encode_push_members,
    is_end_of_stream,
    journal_events,
    lex_range,
)

# group, member and lmq names: printable ASCII without spaces or '|' (keys.check_name)
NAMES = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E, blacklist_characters="|"), min_size=1,
                max_size=20)
COUNTS = st.integers(0, 2**53)
IDS = st.integers(1, 10**16 - 1)  # a ready entry pads ids to 16 digits
TAGS = st.one_of(st.integers(1, 2**53).map(str), st.integers(1, 2**53).map(lambda n: f"q{n}"))
FREE_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\n"), min_size=1,
                    max_size=40)


@given(st.builds(Checkout, NAMES, NAMES, IDS, COUNTS, COUNTS, COUNTS))
def test_a_checkout_record_round_trips(record: Checkout) -> None:
    assert Checkout.decode(record.encode()) == record
    assert Checkout.decode(record.encode().decode()) == record  # str replies too


@given(st.builds(ReadyEntry, NAMES, IDS, COUNTS, COUNTS))
def test_a_ready_entry_round_trips_and_sorts_by_id(entry: ReadyEntry) -> None:
    raw = entry.encode()
    assert ReadyEntry.decode(raw) == entry
    assert ReadyEntry.group_of(raw) == entry.group
    later = ReadyEntry(entry.group, entry.id + 1, 0, 0).encode()
    assert raw < later or entry.id + 1 >= 10**16


@given(st.builds(OwnedEntry, NAMES, NAMES, TAGS))
def test_an_owned_entry_round_trips_and_falls_in_its_members_range(entry: OwnedEntry) -> None:
    raw = entry.encode()
    assert OwnedEntry.decode(raw) == entry
    for lo, hi in (lex_range(entry.group), lex_range(entry.group, entry.member)):
        assert lo[1:] <= raw < hi[1:]


@given(st.builds(JournalLine, COUNTS, NAMES, st.none() | NAMES, st.none() | NAMES, st.none() | COUNTS,
                 st.none() | TAGS, st.none() | COUNTS, st.none() | FREE_TEXT))
def test_a_journal_line_round_trips(line: JournalLine) -> None:
    assert JournalLine.decode(line.encode()) == line
    assert journal_events(line.encode()) == [line]


@st.composite
def journal_batches(draw: st.DrawFn) -> JournalBatch:
    n = draw(st.integers(2, 30))
    ids = tuple(sorted(draw(st.sets(st.integers(1, 2**53), min_size=n, max_size=n))))
    tags = draw(st.none() | st.lists(TAGS, min_size=n, max_size=n).map(tuple))
    extras = draw(st.none() | st.lists(st.sampled_from(["1", "2", "17"]), min_size=n, max_size=n).map(tuple))
    return JournalBatch(draw(COUNTS), draw(st.sampled_from(["pub", "out", "ack"])), draw(st.none() | NAMES),
                        draw(st.none() | NAMES), ids, tags, draw(st.none() | COUNTS), extras)


@given(journal_batches())
def test_a_journal_batch_round_trips_and_expands_to_its_events(batch: JournalBatch) -> None:
    raw = batch.encode()
    assert JournalBatch.decode(raw) == batch
    events = journal_events(raw)
    assert [e.id for e in events] == list(batch.ids)
    assert [e.tag for e in events] == list(batch.tags or [None] * len(batch.ids))
    assert [e.extra for e in events] == list(batch.extras or [None] * len(batch.ids))
    assert {(e.ms, e.event, e.group, e.member, e.epoch) for e in events} == {
        (batch.ms, batch.event, batch.group, batch.member, batch.epoch)}


def test_a_batch_journal_entry_reads_as_the_lua_fences_write_it() -> None:
    raw = b"17\tout\tg\tc1\t5-7,9\tq100-101,102-103\t2\t1*3,2"
    assert journal_events(raw) == [
        JournalLine(17, "out", "g", "c1", 5, "q100", 2, "1"), JournalLine(17, "out", "g", "c1", 6, "q101", 2, "1"),
        JournalLine(17, "out", "g", "c1", 7, "102", 2, "1"), JournalLine(17, "out", "g", "c1", 9, "103", 2, "2")]
    assert JournalBatch.decode(raw).encode() == raw
    assert [e.id for e in journal_events(b"17\tpub\t\t\t1-100\t\t\t")] == list(range(1, 101))
    with pytest.raises(ValueError, match="batch"):
        JournalLine.decode(raw)  # a reader of single lines is told, not handed a wrong event
    with pytest.raises(ValueError, match="4 ids but 3 tags"):
        journal_events(b"17\tack\tg\tc1\t1-4\t7-9\t0\t")


BODIES = st.one_of(st.binary(max_size=300), st.integers(0, 70_000).map(lambda n: b"\xff" * n))


@given(st.builds(DeadLetter, IDS, NAMES, NAMES, COUNTS, COUNTS, COUNTS, BODIES))
def test_a_dead_letter_round_trips(letter: DeadLetter) -> None:
    raw = letter.encode()
    assert DeadLetter.decode(raw) == letter
    assert DeadLetter.decode(raw).encode() == raw


@given(st.builds(MailboxEntry, TAGS, IDS, COUNTS, COUNTS, st.binary(max_size=200)))
def test_a_mailbox_entry_round_trips_whatever_its_body_holds(entry: MailboxEntry) -> None:
    raw = entry.encode()
    assert MailboxEntry.decode(raw) == entry
    assert not is_end_of_stream(raw)


@given(st.lists(NAMES, unique=True))
def test_a_name_list_round_trips(names: list[str]) -> None:
    assert decode_names(encode_names(names)) == names
    assert decode_names(encode_names(names).encode()) == names


@given(st.lists(st.tuples(NAMES, NAMES), unique=True))
def test_the_push_member_list_round_trips(members: list[tuple[str, str]]) -> None:
    assert decode_push_members(encode_push_members(members)) == members


# -- the exact bytes the fences write --------------------------------------------------------------


def test_the_codecs_read_what_the_lua_fences_write() -> None:
    assert Checkout.decode(b"billing\x00c1\x007\x002\x003\x001") == Checkout("billing", "c1", 7, 2, 3, 1)
    assert ReadyEntry("billing", 7, 3, 1).encode() == b"billing\x000000000000000007\x003\x001"
    assert OwnedEntry.decode(b"billing\x00c1\x00q12") == OwnedEntry("billing", "c1", "q12")
    assert JournalLine.decode(b"1700000000000\tpub\t\t\t5\t\t\t") == JournalLine(1700000000000, "pub", id=5)
    assert JournalLine.decode(b"17\tpreempt\tdefault\tbob\t\t\t1\talice") == JournalLine(
        17, "preempt", "default", "bob", epoch=1, extra="alice")
    assert JournalLine.decode(b"17\tseek\tg\tm\t\t\t2\ttime\twith\ttabs").extra == "time\twith\ttabs"
    assert MailboxEntry.decode(b"9\x004\x001\x000\x0012:1:0:\x00body") == MailboxEntry("9", 4, 1, 0, b"12:1:0:\x00body")
    assert is_end_of_stream(END_OF_STREAM) and is_end_of_stream("EOS")
    with pytest.raises(ValueError):
        MailboxEntry.decode(b"EOS")
    # cmsgpack.pack({id, g, m, acq, fail, now, body}): every Lua string a msgpack str
    lua = b"\x97\x03\xa1g\xa1m\x02\x02\xcd\x03\xe8\xa4\x00\xffab"
    assert DeadLetter.decode(lua) == DeadLetter(3, "g", "m", 2, 2, 1000, b"\x00\xffab")
    assert DeadLetter.decode(lua).encode() == lua
    assert msgpack.unpackb(lua, raw=True)[6] == b"\x00\xffab"
    assert decode_push_members(b"g\tp1\ng\tp2") == [("g", "p1"), ("g", "p2")]
    assert decode_names(None) == [] and decode_names(b"") == []
    assert lex_range("g", "m") == (b"[g\x00m\x00", b"(g\x00m\x01")


def test_a_malformed_record_is_refused_not_misread() -> None:
    for bad in (b"g\x00m\x001", b"g\x00m\x001\x002\x003\x004\x005"):
        with pytest.raises(ValueError):
            Checkout.decode(bad)
    with pytest.raises(ValueError):
        ReadyEntry.decode(b"g\x00x\x001\x000")


# -- meta field names -------------------------------------------------------------------------------


def test_meta_field_names_are_the_ones_the_fences_write() -> None:
    assert meta.group_field("billing", meta.EPOCH) == "g|billing|ep"
    assert meta.member_field("default", "alice", meta.MARKER) == "m|default|alice|mk"
    assert meta.member_field("g", "m", meta.SUSPECTED_SINCE) == "m|g|m|sus"


def test_meta_decode_sorts_fields_by_owner_and_spells_out_a_compact_hash() -> None:
    raw = {b"z": b"default|alice", b"C": b"1700000000", b"S": b"4", b"m|default|alice|mk": b"bob"}
    decoded = meta.decode(raw)
    assert decoded.group_names == ["default"]
    assert decoded.member_names("default") == ["alice"]
    assert decoded.groups["default"][meta.OWNER] == "alice"
    assert decoded.groups["default"][meta.CURSOR] == "5"
    assert decoded.members[("default", "alice")][meta.MARKER] == "bob"
    assert decoded.fields[meta.CREATED] == "1700000000000" and decoded.fields[meta.SEQ] == "4"
    # the lite default group goes without saying: "alice" is "default|alice"
    assert meta.decode({**raw, b"z": b"alice"}) == decoded
    flat = meta.decode([b"seq", b"3", b"groups", b"a\nb", b"g|a|mode", b"shared", b"g|x|y|z", b"1"])
    assert flat.group_names == ["a", "b"] and flat.groups == {"a": {"mode": "shared"}}
    assert flat.fields["g|x|y|z"] == "1"  # not a group field: kept as it is
