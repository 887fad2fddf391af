"""Tests for fencemq.protocol.resp: the sans-I/O RESP request parser and reply encoder."""

from __future__ import annotations

import array
import enum
import math

import hiredis
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fencemq.protocol.resp import (
    NULL_ARRAY,
    ErrorReply,
    NullArray,
    ProtocolError,
    Push,
    RequestError,
    RequestParser,
    RequestTooLarge,
    SimpleString,
    Verbatim,
    encode,
    encode_bulk_array,
    encode_many,
    split_inline,
)

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def mb(*args: bytes) -> bytes:
    """A multibulk request, written out by hand (independent of the encoder)."""
    out = b"*%d\r\n" % len(args)
    for a in args:
        out += b"$%d\r\n%s\r\n" % (len(a), a)
    return out


def drain(p: RequestParser) -> list[list[bytes]]:
    cmds = []
    while (cmd := p.gets()) is not None:
        cmds.append(cmd)
    return cmds


def parse_chunks(chunks) -> list[list[bytes]]:
    p = RequestParser()
    cmds = []
    for chunk in chunks:
        p.feed(chunk)
        cmds += drain(p)
    return cmds


# --------------------------------------------------------------------------- encoding: exact bytes

def _case_id(value) -> str:
    # A memoryview's repr carries its address: ids must be the same in every process (pytest-xdist).
    return f"memoryview({bytes(value)!r})" if isinstance(value, memoryview) else repr(value)[:30]


EXACT = [
    (None, b"$-1\r\n", b"_\r\n"),
    (NULL_ARRAY, b"*-1\r\n", b"_\r\n"),
    (True, b":1\r\n", b"#t\r\n"),
    (False, b":0\r\n", b"#f\r\n"),
    (0, b":0\r\n", b":0\r\n"),
    (1023, b":1023\r\n", b":1023\r\n"),
    (1024, b":1024\r\n", b":1024\r\n"),
    (-7, b":-7\r\n", b":-7\r\n"),
    (INT64_MIN, b":-9223372036854775808\r\n", b":-9223372036854775808\r\n"),
    (1 << 64, b"$20\r\n18446744073709551616\r\n", b"(18446744073709551616\r\n"),
    (1.5, b"$3\r\n1.5\r\n", b",1.5\r\n"),
    (1e16, b"$5\r\n1e+16\r\n", b",1e+16\r\n"),
    (math.inf, b"$3\r\ninf\r\n", b",inf\r\n"),
    (-math.inf, b"$4\r\n-inf\r\n", b",-inf\r\n"),
    (math.nan, b"$3\r\nnan\r\n", b",nan\r\n"),
    (b"", b"$0\r\n\r\n", b"$0\r\n\r\n"),
    (b"a\r\nb\x00", b"$5\r\na\r\nb\x00\r\n", b"$5\r\na\r\nb\x00\r\n"),
    (bytearray(b"xy"), b"$2\r\nxy\r\n", b"$2\r\nxy\r\n"),
    (memoryview(b"abcdef")[::2], b"$3\r\nace\r\n", b"$3\r\nace\r\n"),
    ("héllo", b"$6\r\nh\xc3\xa9llo\r\n", b"$6\r\nh\xc3\xa9llo\r\n"),
    (SimpleString("OK"), b"+OK\r\n", b"+OK\r\n"),
    (ErrorReply("ERR bad\r\nthing\nhere"), b"-ERR bad thing here\r\n", b"-ERR bad thing here\r\n"),
    (Verbatim("hi"), b"$2\r\nhi\r\n", b"=6\r\ntxt:hi\r\n"),
    (Verbatim("# x", "mkd"), b"$3\r\n# x\r\n", b"=7\r\nmkd:# x\r\n"),
    ([], b"*0\r\n", b"*0\r\n"),
    ([1, [b"a", None]], b"*2\r\n:1\r\n*2\r\n$1\r\na\r\n$-1\r\n", b"*2\r\n:1\r\n*2\r\n$1\r\na\r\n_\r\n"),
    ((b"t",), b"*1\r\n$1\r\nt\r\n", b"*1\r\n$1\r\nt\r\n"),
    ({b"k": 1, 2: [True]}, b"*4\r\n$1\r\nk\r\n:1\r\n:2\r\n*1\r\n:1\r\n", b"%2\r\n$1\r\nk\r\n:1\r\n:2\r\n*1\r\n#t\r\n"),
    ({5}, b"*1\r\n:5\r\n", b"~1\r\n:5\r\n"),
    (frozenset({b"z"}), b"*1\r\n$1\r\nz\r\n", b"~1\r\n$1\r\nz\r\n"),
    (
        Push([b"message", b"chan", b"hi"]),
        b"*3\r\n$7\r\nmessage\r\n$4\r\nchan\r\n$2\r\nhi\r\n",
        b">3\r\n$7\r\nmessage\r\n$4\r\nchan\r\n$2\r\nhi\r\n",
    ),
]


@pytest.mark.parametrize(("value", "resp2", "resp3"), EXACT, ids=[_case_id(e[0]) for e in EXACT])
def test_encode_exact_bytes(value, resp2, resp3):
    assert encode(value, 2) == resp2
    assert encode(value, 3) == resp3


def test_encode_large_headers_beyond_the_cache():
    assert encode(b"x" * 2000, 2) == b"$2000\r\n" + b"x" * 2000 + b"\r\n"
    big = encode([0] * 1500, 3)
    assert big.startswith(b"*1500\r\n:0\r\n") and big.count(b":0\r\n") == 1500
    assert encode({i: i for i in range(1024)}, 2).startswith(b"*2048\r\n")
    assert encode(set(range(1100)), 3).startswith(b"~1100\r\n")


def test_encode_subclasses_use_their_base():
    class Color(enum.IntEnum):
        RED = 3

    class Name(enum.StrEnum):
        A = "alpha"

    assert encode(Color.RED, 2) == b":3\r\n"
    assert encode(Name.A, 3) == b"$5\r\nalpha\r\n"
    assert encode(memoryview(array.array("i", [1])), 2) == b"$%d\r\n" % array.array("i").itemsize + bytes(
        array.array("i", [1])
    ) + b"\r\n"


def test_encode_rejects_bad_input():
    with pytest.raises(ValueError):
        SimpleString("a\r\nb")
    with pytest.raises(ValueError):
        SimpleString("a\nb")
    with pytest.raises(ValueError):
        Verbatim("x", "text")
    with pytest.raises(TypeError):
        encode(object(), 3)
    with pytest.raises(TypeError):
        encode([1, object()], 2)
    with pytest.raises(ValueError):
        encode(1, 4)
    assert isinstance(NULL_ARRAY, NullArray)


def test_encode_many_is_concatenation():
    values = [SimpleString("OK"), 1, None, [b"a"], ErrorReply("ERR x")]
    for proto in (2, 3):
        assert encode_many(values, proto) == b"".join(encode(v, proto) for v in values)
        assert encode_many(iter(values), proto) == b"".join(encode(v, proto) for v in values)
    assert encode_many([], 3) == b""


# --------------------------------------------------------------------------- encoding: hiredis round trip

leaves = st.one_of(
    st.none(),
    st.just(NULL_ARRAY),
    st.booleans(),
    st.integers(min_value=INT64_MIN, max_value=INT64_MAX),
    st.integers(min_value=1 << 63) | st.integers(max_value=INT64_MIN - 1),
    st.floats(allow_nan=False),
    st.binary(max_size=40),
    st.binary(max_size=20).map(bytearray),
    st.text(max_size=20),
    st.text(st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)), max_size=20).map(SimpleString),
    st.text(max_size=20).map(lambda t: ErrorReply("ERR " + t)),
    st.text(max_size=20).map(Verbatim),
)
keys = st.one_of(st.binary(max_size=8), st.integers(min_value=INT64_MIN, max_value=INT64_MAX))
replies = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.lists(inner, max_size=5).map(tuple),
        st.lists(inner, max_size=5).map(Push),
        st.dictionaries(keys, inner, max_size=5),
        st.sets(keys, max_size=5),
        st.frozensets(keys, max_size=5),
    ),
    max_leaves=30,
)


def expected(v, p3: bool):
    """What hiredis should hand back for ``v`` encoded in RESP2/RESP3 (after ``normalize``)."""
    if v is None or v is NULL_ARRAY:
        return None
    if isinstance(v, bool):
        return v if p3 else int(v)
    if isinstance(v, int):
        return v if INT64_MIN <= v <= INT64_MAX else str(v).encode()
    if isinstance(v, float):
        return v if p3 else repr(v).encode()
    if isinstance(v, ErrorReply):
        return ("error", str(v))
    if isinstance(v, str):  # str, SimpleString, Verbatim (hiredis strips the "txt:" prefix)
        return v.encode()
    if isinstance(v, (bytes, bytearray)):
        return bytes(v)
    if isinstance(v, dict):
        if p3:
            return {expected(k, p3): expected(x, p3) for k, x in v.items()}
        return [expected(y, p3) for kv in v.items() for y in kv]
    if isinstance(v, Push):
        items = [expected(x, p3) for x in v]
        return ("push", items) if p3 else items
    return [expected(x, p3) for x in v]  # list, tuple, set (hiredis returns sets as lists)


def normalize(v):
    if isinstance(v, hiredis.ReplyError):
        return ("error", str(v))
    if isinstance(v, hiredis.PushNotification):
        return ("push", [normalize(x) for x in v])
    if isinstance(v, list):
        return [normalize(x) for x in v]
    if isinstance(v, dict):
        return {k: normalize(x) for k, x in v.items()}
    return v


def hiredis_parse_all(data: bytes) -> list:
    incomplete = object()  # not False: a RESP3 false reply *is* False
    reader = hiredis.Reader(notEnoughData=incomplete)
    reader.feed(data)
    out = []
    while (item := reader.gets()) is not incomplete:
        out.append(normalize(item))
    return out


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(replies)
def test_roundtrip_through_hiredis(value):
    for proto in (2, 3):
        data = encode(value, proto)
        # exactly one reply and nothing left over: the framing is exact
        assert hiredis_parse_all(data) == [expected(value, proto == 3)]


@given(st.lists(replies, max_size=6))
def test_encode_many_roundtrip(values):
    for proto in (2, 3):
        assert hiredis_parse_all(encode_many(values, proto)) == [expected(v, proto == 3) for v in values]


@given(st.lists(st.binary(max_size=5000), max_size=6))
def test_a_bulk_array_is_encoded_as_the_generic_encoder_does_in_both_protocols(items):
    assert encode_bulk_array(items) == encode(items, 2) == encode(items, 3)


@given(st.lists(st.binary(max_size=30), min_size=1, max_size=6))
def test_encoded_bytes_array_is_a_valid_request(args):
    # a RESP2 array of bulk strings is exactly the multibulk request form
    assert encode(args, 2) == mb(*args)
    p = RequestParser()
    p.feed(encode(args, 2))
    assert drain(p) == [args]


# --------------------------------------------------------------------------- request parsing

def test_multibulk_binary_safe():
    payload = b"a\r\nb\x00c\r\n$3\r\n*2\r\n"
    p = RequestParser()
    p.feed(mb(b"SET", b"k\x00\r\n", payload) + mb(b"") + mb(b"GET", b"k"))
    cmds = drain(p)
    assert cmds == [[b"SET", b"k\x00\r\n", payload], [b""], [b"GET", b"k"]]
    assert all(type(a) is bytes for cmd in cmds for a in cmd)


def test_incomplete_returns_none_until_complete():
    p = RequestParser()
    assert p.gets() is None
    data = mb(b"SET", b"key", b"value")
    p.feed(data[:-1])
    assert p.gets() is None
    assert p.gets() is None
    p.feed(data[-1:])
    assert p.gets() == [b"SET", b"key", b"value"]
    assert p.gets() is None


PIPELINE = (
    mb(b"SET", b"k", b"v\r\n\x00\r\nend")
    + b"PING\r\n"
    + b"\r\n"
    + b'set "a b" \'c d\' "\\x41\\n"\n'
    + b"*0\r\n"
    + mb(b"", b"*1\r\n$1\r\nx\r\n")
    + b"   \r\n"
    + mb(b"QUIT")
)
PIPELINE_CMDS = [
    [b"SET", b"k", b"v\r\n\x00\r\nend"],
    [b"PING"],
    [b"set", b"a b", b"c d", b"A\n"],
    [b"", b"*1\r\n$1\r\nx\r\n"],
    [b"QUIT"],
]


def test_pipeline_in_one_chunk():
    assert parse_chunks([PIPELINE]) == PIPELINE_CMDS


@pytest.mark.parametrize("cut", range(len(PIPELINE) + 1))
def test_pipeline_split_at_every_byte(cut):
    assert parse_chunks([PIPELINE[:cut], PIPELINE[cut:]]) == PIPELINE_CMDS


def test_pipeline_one_byte_at_a_time():
    assert parse_chunks([PIPELINE[i : i + 1] for i in range(len(PIPELINE))]) == PIPELINE_CMDS


commands = st.lists(st.lists(st.binary(max_size=40), min_size=1, max_size=5), min_size=1, max_size=6)


@given(commands, st.lists(st.integers(min_value=0, max_value=2000), max_size=10))
def test_random_pipelines_any_chunking(cmds, cuts):
    data = b"".join(mb(*c) for c in cmds)
    bounds = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    chunks = [data[a:b] for a, b in zip(bounds, bounds[1:])]
    assert parse_chunks(chunks) == cmds


def test_large_payload_is_streamed_not_accumulated():
    payload = bytes(range(256)) * 4096  # 1 MiB
    data = mb(b"SET", b"k", payload)
    p = RequestParser()
    chunk = 16 * 1024
    for i in range(0, len(data), chunk):
        p.feed(data[i : i + chunk])
        cmd = p.gets()
        if cmd is None:
            # white-box: the parser keeps no more than the chunk it was just given
            assert len(p._buf) <= chunk
    assert cmd == [b"SET", b"k", payload]


@pytest.mark.parametrize(
    ("line", "args"),
    [
        (b"PING\r\n", [b"PING"]),
        (b"PING\n", [b"PING"]),
        (b"  set   a \t b  \r\n", [b"set", b"a", b"b"]),
        (b'set k "hello world"\r\n', [b"set", b"k", b"hello world"]),
        (b'echo "a\\"b\\\\c"\r\n', [b"echo", b'a"b\\c']),
        (b'echo "\\n\\r\\t\\x00\\xff\\xzz"\r\n', [b"echo", b"\n\r\t\x00\xffxzz"]),
        (b"echo 'it\\'s' 'a\\nb'\r\n", [b"echo", b"it's", b"a\\nb"]),
        (b'echo "" \'\'\r\n', [b"echo", b"", b""]),
        (b'echo pre"quoted part"\r\n', [b"echo", b"prequoted part"]),
        (b"echo \x00bin\r\n", [b"echo", b"\x00bin"]),
    ],
)
def test_inline_commands(line, args):
    p = RequestParser()
    p.feed(line)
    assert drain(p) == [args]


def test_empty_inline_lines_are_skipped():
    p = RequestParser()
    p.feed(b"\r\n\n   \r\n\t\nPING\r\n\r\n")
    assert drain(p) == [[b"PING"]]
    p.feed(b"\r\n")
    assert p.gets() is None


@pytest.mark.parametrize("line", [b'get "abc\r\n', b"get 'abc\r\n", b'get "a"b\r\n', b"get 'a'b\r\n", b'get "a\\"\r\n'])
def test_inline_unbalanced_quotes(line):
    p = RequestParser()
    p.feed(line)
    with pytest.raises(ProtocolError) as exc:
        p.gets()
    assert exc.value.message == "ERR Protocol error: unbalanced quotes in request"


def ref_sdssplitargs(line: bytes) -> list[bytes] | None:
    """Line-by-line port of Redis's sdssplitargs (src/sds.c); None means a quote error."""
    space = b" \t\n\x0b\x0c\r"
    esc = {ord("n"): 10, ord("r"): 13, ord("t"): 9, ord("b"): 8, ord("a"): 7}

    def at(i: int) -> int:
        return line[i] if i < len(line) else 0

    def ishex(c: int) -> bool:
        return c != 0 and c in b"0123456789abcdefABCDEF"

    p, out = 0, []
    while True:
        while at(p) and at(p) in space:
            p += 1
        if not at(p):
            return out
        inq = insq = done = False
        cur = bytearray()
        while not done:
            c = at(p)
            if inq:
                if c == 92 and at(p + 1) == ord("x") and ishex(at(p + 2)) and ishex(at(p + 3)):
                    cur.append(int(bytes([at(p + 2), at(p + 3)]), 16))
                    p += 3
                elif c == 92 and at(p + 1):
                    p += 1
                    cur.append(esc.get(at(p), at(p)))
                elif c == ord('"'):
                    if at(p + 1) and at(p + 1) not in space:
                        return None
                    done = True
                elif not c:
                    return None
                else:
                    cur.append(c)
            elif insq:
                if c == 92 and at(p + 1) == ord("'"):
                    p += 1
                    cur.append(ord("'"))
                elif c == ord("'"):
                    if at(p + 1) and at(p + 1) not in space:
                        return None
                    done = True
                elif not c:
                    return None
                else:
                    cur.append(c)
            elif c in (32, 10, 13, 9, 0):
                done = True
            elif c == ord('"'):
                inq = True
            elif c == ord("'"):
                insq = True
            else:
                cur.append(c)
            if at(p):
                p += 1
        out.append(bytes(cur))


# NUL is left out: C stops at it, while split_inline treats it as an ordinary byte.
inline_lines = st.lists(st.sampled_from([b"a", b"b", b" ", b"\t", b"\r", b"\x0b", b'"', b"'", b"\\", b"x", b"4", b"f", b"n"]),
                        max_size=25).map(b"".join)


@settings(max_examples=1000)
@given(inline_lines)
def test_split_inline_matches_redis_sdssplitargs(line):
    want = ref_sdssplitargs(line)
    if want is None:
        with pytest.raises(ProtocolError):
            split_inline(line)
    else:
        assert split_inline(line) == want


# --------------------------------------------------------------------------- limits

def test_oversized_bulk_rejected_from_header_alone():
    p = RequestParser()
    p.feed(b"*2\r\n$3\r\nSET\r\n$10485760\r\n")  # only the header; none of the 10 MiB payload
    with pytest.raises(RequestTooLarge) as exc:
        p.gets()
    assert exc.value.message == (
        "LIMIT argument of 10485760 bytes exceeds the 8388608-byte limit; split the payload or raise max_payload"
    )
    assert str(exc.value) == exc.value.message


def test_bulk_limit_is_inclusive():
    p = RequestParser(max_bulk=4)
    p.feed(mb(b"abcd"))
    assert p.gets() == [b"abcd"]
    p.feed(b"*1\r\n$5\r\n")
    with pytest.raises(RequestTooLarge, match="LIMIT argument of 5 bytes exceeds the 4-byte limit"):
        p.gets()


def test_too_many_args_rejected_from_header_alone():
    p = RequestParser()
    p.feed(b"*1000001\r\n")
    with pytest.raises(RequestTooLarge) as exc:
        p.gets()
    assert exc.value.message.startswith("LIMIT request of 1000001 arguments exceeds the 1000000-argument limit;")
    p = RequestParser(max_args=3)
    p.feed(mb(b"a", b"b", b"c"))
    assert p.gets() == [b"a", b"b", b"c"]
    p.feed(b"*4\r\n")
    with pytest.raises(RequestTooLarge, match="max_args"):
        p.gets()


def test_too_big_inline_request():
    p = RequestParser(max_inline=16)
    p.feed(b"x" * 16)
    assert p.gets() is None  # at the limit: still waiting for the newline
    p.feed(b"x")
    with pytest.raises(ProtocolError, match="^ERR Protocol error: too big inline request$"):
        p.gets()


def test_too_big_count_strings():
    p = RequestParser(max_inline=16)
    p.feed(b"*" + b"1" * 20)
    with pytest.raises(ProtocolError, match="too big mbulk count string"):
        p.gets()
    p = RequestParser(max_inline=16)
    p.feed(b"*1\r\n$" + b"1" * 20)
    with pytest.raises(ProtocolError, match="too big bulk count string"):
        p.gets()


# --------------------------------------------------------------------------- malformed input

@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"*abc\r\n", "ERR Protocol error: invalid multibulk length"),
        (b"*\r\n", "ERR Protocol error: invalid multibulk length"),
        (b"*+1\r\n", "ERR Protocol error: invalid multibulk length"),
        (b"*01\r\n", "ERR Protocol error: invalid multibulk length"),
        (b"* 1\r\n", "ERR Protocol error: invalid multibulk length"),
        (b"*1_0\r\n", "ERR Protocol error: invalid multibulk length"),
        (b"*99999999999999999999\r\n", "ERR Protocol error: invalid multibulk length"),
        (b"*1\r\n$-5\r\n", "ERR Protocol error: invalid bulk length"),
        (b"*1\r\n$-1\r\n", "ERR Protocol error: invalid bulk length"),
        (b"*1\r\n$x\r\n", "ERR Protocol error: invalid bulk length"),
        (b"*1\r\n$3\r\nabcXY", "ERR Protocol error: bulk payload not followed by CRLF"),
        (b"*1\r\n$1\r\nabc\r\n", "ERR Protocol error: bulk payload not followed by CRLF"),
        (b"*1\r\n:3\r\n", "ERR Protocol error: expected '$', got ':'"),
        (b"*2\r\n$1\r\na\r\nPING\r\n", "ERR Protocol error: expected '$', got 'P'"),
    ],
)
def test_malformed_multibulk(data, message):
    # whole, and one byte at a time: the error does not depend on packet boundaries
    for chunks in ([data], [data[i : i + 1] for i in range(len(data))]):
        p = RequestParser()
        with pytest.raises(ProtocolError) as exc:
            for chunk in chunks:
                p.feed(chunk)
                drain(p)
        assert exc.value.message == message


def test_errors_are_value_errors_with_a_code():
    for cls in (ProtocolError, RequestTooLarge):
        assert issubclass(cls, RequestError) and issubclass(cls, ValueError)
    assert ProtocolError("bad thing").message == "ERR Protocol error: bad thing"
    assert RequestTooLarge("LIMIT x").message.split()[0] == "LIMIT"


def test_commands_before_an_error_are_returned_and_the_error_sticks():
    p = RequestParser()
    p.feed(mb(b"PING") + b"ECHO hi\r\n" + b"*x\r\n" + mb(b"NEVER"))
    assert p.gets() == [b"PING"]
    assert p.gets() == [b"ECHO", b"hi"]
    with pytest.raises(ProtocolError):
        p.gets()
    with pytest.raises(ProtocolError):  # the parser does not resync; the server closes the connection
        p.gets()


def test_negative_or_zero_multibulk_is_skipped_like_redis():
    p = RequestParser()
    p.feed(b"*0\r\n*-1\r\n*-5\r\n" + mb(b"PING"))
    assert drain(p) == [[b"PING"]]
