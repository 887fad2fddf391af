"""Tests for fencemq.protocol.commands: the tags of ACK, NACK and RENEW as text."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fencemq.errors import BadArgument
from fencemq.protocol.commands import parse


@given(st.lists(st.text(max_size=8).map(str.encode) | st.binary(max_size=4), min_size=1, max_size=20))
def test_ack_tags_are_each_argument_as_text_or_a_badarg_naming_the_tag(tags):
    try:
        expected = [t.decode("utf-8") for t in tags]
    except UnicodeDecodeError:
        with pytest.raises(BadArgument, match="tag must be UTF-8"):
            parse([b"ACK", b"h", *tags])
        return
    assert parse([b"ACK", b"h", *tags]).args["tags"] == expected


def test_tags_holding_newlines_or_split_characters_stay_as_sent():
    assert parse([b"ACK", b"h", b"1\n2", b"3"]).args["tags"] == ["1\n2", "3"]
    with pytest.raises(BadArgument):
        parse([b"ACK", b"h", b"\xc3", b"\xa9"])  # two halves of one character are two bad tags
    assert parse([b"NACK", b"h", b"7", b"8", b"DELAY", b"5"]).args["tags"] == ["7", "8"]
    assert parse([b"RENEW", b"h", b"7", b"LOCK", b"500"]).args["tags"] == ["7"]
