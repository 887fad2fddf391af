"""Tests for fencemq.protocol.request_reader: hiredis reads the frames, Redis's rules and limits still hold.

RequestParser (fencemq.protocol.resp) is the exact pure-Python reader; the
RequestReader must return the same commands and the same errors for any input
cut at any byte, while handing whole frames to hiredis.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fencemq.protocol.request_reader import RequestReader
from fencemq.protocol.resp import ProtocolError, RequestError, RequestParser, RequestTooLarge


def mb(*args: bytes) -> bytes:
    """A multibulk request, written out by hand."""
    out = b"*%d\r\n" % len(args)
    for a in args:
        out += b"$%d\r\n%s\r\n" % (len(a), a)
    return out


def drain(r: RequestReader | RequestParser) -> list[list[bytes]]:
    cmds = []
    while (cmd := r.gets()) is not None:
        cmds.append(cmd)
    return cmds


def read_chunks(chunks, make=RequestReader, **limits) -> tuple[list[list[bytes]], str | None]:
    """The commands read from ``chunks`` in order, and the error that ended them (if any)."""
    r = make(**limits)
    cmds: list[list[bytes]] = []
    try:
        for chunk in chunks:
            r.feed(chunk)
            while (cmd := r.gets()) is not None:
                cmds.append(cmd)
    except RequestError as exc:
        return cmds, exc.message
    return cmds, None


PIPELINE = (
    mb(b"SET", b"k", b"v\r\n\x00\r\nend")
    + b"PING\r\n"
    + b"\r\n"
    + b'set "a b" \'c d\' "\\x41\\n"\n'
    + b"*0\r\n"
    + mb(b"", b"*1\r\n$1\r\nx\r\n")
    + b"   \r\n"
    + b"*-1\r\n"
    + mb(b"QUIT")
)
PIPELINE_CMDS = [
    [b"SET", b"k", b"v\r\n\x00\r\nend"],
    [b"PING"],
    [b"set", b"a b", b"c d", b"A\n"],
    [b"", b"*1\r\n$1\r\nx\r\n"],
    [b"QUIT"],
]


# -- framing ---------------------------------------------------------------------------------------


def test_a_pipeline_in_one_read_gives_every_command_in_order():
    assert read_chunks([PIPELINE]) == (PIPELINE_CMDS, None)


@pytest.mark.parametrize("cut", range(len(PIPELINE) + 1))
def test_a_pipeline_cut_at_any_byte_gives_the_same_commands(cut):
    assert read_chunks([PIPELINE[:cut], PIPELINE[cut:]]) == (PIPELINE_CMDS, None)


def test_a_pipeline_read_one_byte_at_a_time_gives_the_same_commands():
    assert read_chunks([PIPELINE[i : i + 1] for i in range(len(PIPELINE))]) == (PIPELINE_CMDS, None)


def test_arguments_are_binary_safe_bytes():
    payload = b"a\r\nb\x00c\r\n$3\r\n*2\r\n+OK\r\n:1\r\n"
    cmds, err = read_chunks([mb(b"PUB", b"k\x00\r\n", payload) + mb(b"") + mb(b"GET", b"k")])
    assert err is None and cmds == [[b"PUB", b"k\x00\r\n", payload], [b""], [b"GET", b"k"]]
    assert all(type(a) is bytes for cmd in cmds for a in cmd)


def test_an_incomplete_request_gives_none_until_its_last_byte():
    r = RequestReader()
    assert r.gets() is None
    data = mb(b"PUB", b"orders", b"hello")
    r.feed(data[:-1])
    assert r.gets() is None
    assert r.gets() is None
    r.feed(data[-1:])
    assert r.gets() == [b"PUB", b"orders", b"hello"]
    assert r.gets() is None


def test_inline_commands_between_multibulk_requests_are_read_like_redis():
    data = mb(b"PING") + b"ECHO 'a b'\n" + mb(b"GET", b"k") + b"\r\n\r\n" + b"QUIT\r\n" + mb(b"X")
    assert read_chunks([data]) == ([[b"PING"], [b"ECHO", b"a b"], [b"GET", b"k"], [b"QUIT"], [b"X"]], None)


commands = st.lists(st.lists(st.binary(max_size=40), min_size=1, max_size=5), min_size=1, max_size=8)


@given(commands, st.lists(st.integers(min_value=0, max_value=4000), max_size=12))
def test_random_pipelines_cut_anywhere_give_the_commands_sent(cmds, cuts):
    data = b"".join(mb(*c) for c in cmds)
    bounds = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    assert read_chunks([data[a:b] for a, b in zip(bounds, bounds[1:])]) == (cmds, None)


# Pieces a hostile or broken client could string together: the reader must agree with
# the exact parser on every command and every error, wherever the reads are cut.
PIECES = [mb(b"PING"), mb(b"PUB", b"t", b"x" * 20), b"*2\r\n$1\r\na\r\n", b"$1\r\nb\r\n", b"+b\r\n", b":1\r\n",
          b"(12\r\n", b"=7\r\ntxt:abc\r\n", b"*1\r\n", b"*0\r\n", b"*-1\r\n", b"$-1\r\n", b"$2\r\nab", b"c\r\n",
          b"PING\r\n", b"\r\n", b"'x\r\n", b"*abc\r\n", b"$01\r\n", b"-ERR x\r\n", b"%1\r\n", b"_\r\n", b"\n"]


@settings(max_examples=600)
@given(st.lists(st.sampled_from(PIECES), min_size=1, max_size=8), st.lists(st.integers(0, 400), max_size=6))
def test_any_input_gives_the_commands_and_the_error_of_the_exact_parser(pieces, cuts):
    data = b"".join(pieces)
    bounds = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    chunks = [data[a:b] for a, b in zip(bounds, bounds[1:])]
    assert read_chunks(chunks) == read_chunks(chunks, RequestParser)


# -- malformed input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"*abc\r\n", "ERR Protocol error: invalid multibulk length"),
        (b"*01\r\n", "ERR Protocol error: invalid multibulk length"),
        (b"*99999999999999999999\r\n", "ERR Protocol error: invalid multibulk length"),
        (b"*1\r\n$-1\r\n", "ERR Protocol error: invalid bulk length"),
        (b"*1\r\n$05\r\nhello\r\n", "ERR Protocol error: invalid bulk length"),
        (b"*1\r\n$3\r\nabcXY", "ERR Protocol error: bulk payload not followed by CRLF"),
        (b"*1\r\n$1\r\nab\r\n", "ERR Protocol error: bulk payload not followed by CRLF"),
        (b"*2\r\n$1\r\nabc$1\r\nd\r\n", "ERR Protocol error: bulk payload not followed by CRLF"),
        (b"*1\r\n:3\r\n", "ERR Protocol error: expected '$', got ':'"),
        (b"*1\r\n+PING\r\n", "ERR Protocol error: expected '$', got '+'"),
        (b"*2\r\n$1\r\na\r\n(12\r\n", "ERR Protocol error: expected '$', got '('"),
        (b"*2\r\n$1\r\na\r\n=5\r\ntxt:x\r\n", "ERR Protocol error: expected '$', got '='"),
        (b"*1\r\n*1\r\n$1\r\na\r\n", "ERR Protocol error: expected '$', got '*'"),
        (b"*2\r\n$1\r\na\r\nPING\r\n", "ERR Protocol error: expected '$', got 'P'"),
        (b'PUB orders "unbalanced\r\n', "ERR Protocol error: unbalanced quotes in request"),
    ],
)
def test_malformed_requests_get_the_error_redis_gives_whole_or_byte_by_byte(data, message):
    for chunks in ([data], [data[i : i + 1] for i in range(len(data))], [mb(b"PING") + data]):
        cmds, err = read_chunks(chunks)
        assert err == message
        assert cmds == ([[b"PING"]] if len(chunks) == 1 and chunks[0].startswith(mb(b"PING")) else [])


def test_any_number_of_empty_requests_is_skipped():
    assert read_chunks([b"*0\r\n" * 20000 + mb(b"PING") + b"*-1\r\n" * 20000 + mb(b"PONG")]) == (
        [[b"PING"], [b"PONG"]], None)


def test_commands_before_an_error_are_returned_and_the_error_sticks():
    r = RequestReader()
    r.feed(mb(b"PING") + b"ECHO hi\r\n" + b"*x\r\n" + mb(b"NEVER"))
    assert r.gets() == [b"PING"]
    assert r.gets() == [b"ECHO", b"hi"]
    with pytest.raises(ProtocolError):
        r.gets()
    r.feed(mb(b"AFTER"))
    with pytest.raises(ProtocolError):  # no resync: the server closes the connection
        r.gets()


# -- limits ----------------------------------------------------------------------------------------


def test_an_oversized_bulk_is_refused_from_its_header_alone():
    r = RequestReader()
    r.feed(b"*2\r\n$3\r\nSET\r\n$10485760\r\n")  # none of the 10 MiB payload
    with pytest.raises(RequestTooLarge) as exc:
        r.gets()
    assert exc.value.message == (
        "LIMIT argument of 10485760 bytes exceeds the 8388608-byte limit; split the payload or raise max_payload"
    )


def test_too_many_arguments_are_refused_from_the_count_alone():
    r = RequestReader()
    r.feed(b"*1000001\r\n")
    with pytest.raises(RequestTooLarge) as exc:
        r.gets()
    assert exc.value.message.startswith("LIMIT request of 1000001 arguments exceeds the 1000000-argument limit;")


def test_limits_hold_for_a_request_that_arrives_whole_and_are_inclusive():
    assert read_chunks([mb(b"abcd")], max_bulk=4) == ([[b"abcd"]], None)
    assert read_chunks([mb(b"a", b"b", b"c")], max_args=3) == ([[b"a", b"b", b"c"]], None)
    cmds, err = read_chunks([mb(b"PING") + mb(b"x", b"abcde")], max_bulk=4)
    assert cmds == [[b"PING"]] and err == "LIMIT argument of 5 bytes exceeds the 4-byte limit; split the payload" \
        " or raise max_payload"
    cmds, err = read_chunks([mb(b"PING") + mb(b"a", b"b", b"c", b"d")], max_args=3)
    assert cmds == [[b"PING"]] and err is not None and err.startswith("LIMIT request of 4 arguments")


def test_a_too_long_inline_request_or_count_line_is_refused():
    assert read_chunks([b"x" * 17], max_inline=16)[1] == "ERR Protocol error: too big inline request"
    assert read_chunks([b"*" + b"1" * 20], max_inline=16)[1] == "ERR Protocol error: too big mbulk count string"
    assert read_chunks([mb(b"PING") + b"*1\r\n$" + b"1" * 20], max_inline=16) == (
        [[b"PING"]], "ERR Protocol error: too big bulk count string")


def test_a_large_payload_is_streamed_not_kept_by_the_reader():
    payload = bytes(range(256)) * 4096  # 1 MiB
    data = mb(b"PUB", b"k", payload)
    r = RequestReader()
    chunk = 16 * 1024
    cmd = None
    for i in range(0, len(data), chunk):
        r.feed(data[i : i + chunk])
        cmd = r.gets()
        if cmd is None:
            assert r.buffered <= chunk
    assert cmd == [b"PUB", b"k", payload]


def test_what_is_buffered_is_what_is_not_yet_returned():
    r = RequestReader()
    r.feed(mb(b"PING") + mb(b"PING")[:5])
    assert r.buffered == len(mb(b"PING")) + 5
    assert r.gets() == [b"PING"]
    assert r.gets() is None
    assert r.buffered <= 5
    r.feed(mb(b"PING")[5:])
    assert r.gets() == [b"PING"]
    assert r.gets() is None and r.buffered == 0
