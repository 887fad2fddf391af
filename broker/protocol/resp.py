"""RESP2/RESP3 codec for the worker's Redis-protocol front end.

Sans-I/O: no sockets, event loop or clock. The anyio server feeds in the bytes
it received and writes out the bytes ``encode()`` returns, so every framing edge
case (a command split at any byte, a pipeline in one packet, a hostile length
header) is testable with plain byte strings, and a benchmark or fuzzer can drive
the same code. :class:`RequestParser` checks each ``*N``/``$len`` header itself,
so limits fire before a payload is buffered, and streams the validated bytes
into ``hiredis.Reader``: it is the exact reader, which the worker's
fencemq.protocol.request_reader.RequestReader falls back on wherever its C fast
path cannot prove a frame well formed. A :class:`RequestError` means: reply
``-`` + ``exc.message``, then close the connection, as Redis does.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable

import hiredis

__all__ = [
    "Prebuilt","NULL_ARRAY", "ErrorReply", "NullArray", "ProtocolError", "Push", "RequestError", "RequestParser",
           "RequestTooLarge", "SimpleString", "Verbatim", "encode", "encode_bulk_array", "encode_many", "split_inline"]


class RequestError(ValueError):
    """A request the connection cannot continue after; ``message`` is the RESP error line."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ProtocolError(RequestError):
    """Malformed input. Also handed to hiredis, hence the prefixing of bare messages."""

    def __init__(self, message: str) -> None:
        if not message.startswith("ERR "):
            message = "ERR Protocol error: " + message
        super().__init__(message)


class RequestTooLarge(RequestError):
    """A declared argument count or bulk length is over the configured limit."""


_UNBALANCED = "ERR Protocol error: unbalanced quotes in request"
_WS = b" \t\n\r\x0b\x0c"  # C isspace(): skipped between arguments
_SPACE = re.compile(rb"[ \t\n\r\x0b\x0c]*")
# One argument as sdssplitargs reads it: unquoted bytes, then at most one quoted
# section; possessive repeats because the C loop never backtracks.
_ARG = re.compile(rb"""([^ \t\n\r"']*+)(?:"((?:\\x[0-9a-fA-F]{2}|\\.|[^"\\])*+)"|'((?:\\'|[^'])*+)')?""", re.S)
_ESCAPE = re.compile(rb"\\(x[0-9a-fA-F]{2}|.)", re.S)
_ESC = {ord("n"): b"\n", ord("r"): b"\r", ord("t"): b"\t", ord("b"): b"\b", ord("a"): b"\a"}


def _unescape(m: re.Match[bytes]) -> bytes:
    g = m.group(1)
    return bytes((int(g[1:], 16),)) if len(g) == 3 else _ESC.get(g[0], g)


def split_inline(line: bytes) -> list[bytes]:
    """Split an inline command exactly like Redis's ``sdssplitargs`` (quotes, escapes)."""
    if b'"' not in line and b"'" not in line and b"\x0b" not in line and b"\x0c" not in line:
        return line.split()
    args: list[bytes] = []
    i = 0
    while (i := _SPACE.match(line, i).end()) < len(line):  # type: ignore[union-attr]
        m = _ARG.match(line, i)
        assert m is not None  # the pattern can match the empty string
        i = m.end()
        if i < len(line) and line[i] not in _WS:  # e.g. 'a"b' or '"a"b' or an unclosed quote
            raise ProtocolError(_UNBALANCED)
        plain, dq, sq = m.groups()
        if dq is not None:
            plain += _ESCAPE.sub(_unescape, dq)
        elif sq is not None:
            plain += sq.replace(b"\\'", b"'")
        args.append(plain)
    return args


def _parse_len(raw: bytes) -> int | None:
    """Strict decimal like Redis's string2ll (no '+', spaces, '_' or leading zeros)."""
    digits = raw[1:] if raw[:1] == b"-" else raw
    if not digits.isdigit() or len(digits) > 18 or (digits[0] == 0x30 and raw != b"0"):
        return None
    return int(raw)


_START, _HEADER, _BODY = range(3)


class RequestParser:
    """Incremental request parser: ``feed()`` bytes, then call ``gets()`` until None."""

    def __init__(
        self, *, max_bulk: int = 8 * 1024 * 1024, max_args: int = 1_000_000, max_inline: int = 64 * 1024
    ) -> None:
        self.max_bulk, self.max_args, self.max_inline = max_bulk, max_args, max_inline
        self._reader = hiredis.Reader(protocolError=ProtocolError, replyError=ProtocolError)
        self._buf = bytearray()  # bytes not yet consumed, plus at most one partial line
        self._pos = 0  # consumed up to here
        self._scan = 0  # no line terminator before here (avoids rescanning a slow line)
        self._mb_start = 0  # start of the multibulk bytes not yet handed to hiredis
        self._state = _START
        self._args_left = 0
        self._need = 0  # bytes of the current bulk (payload + CRLF) still to come
        self._failed: RequestError | None = None

    @staticmethod
    def too_many_args(count: int, limit: int) -> str:
        return (f"LIMIT request of {count} arguments exceeds the {limit}-argument limit;"
                " send fewer arguments per command or raise max_args")

    @staticmethod
    def too_big_arg(size: int, limit: int) -> str:
        return f"LIMIT argument of {size} bytes exceeds the {limit}-byte limit; split the payload or raise max_payload"

    def feed(self, data: bytes) -> None:
        """Queue received bytes; never raises (errors surface from ``gets()``)."""
        self._buf += data

    @property
    def buffered(self) -> int:
        """Bytes received and not yet returned (a payload being streamed sits in hiredis, not here)."""
        return len(self._buf) - self._pos

    @property
    def mid_request(self) -> bool:
        """Part of a request was received (its payload may already be streamed on to hiredis)."""
        return self._state != _START or self._pos < len(self._buf)

    def rest_at_boundary(self) -> bytes | None:
        """At a request boundary, the bytes not yet read (the parser is then done with); else None."""
        if self._failed is not None or self._state != _START:
            return None
        return bytes(self._buf[self._pos :])

    def gets(self) -> list[bytes] | None:
        """The next complete command as a list of bytes, or None if more data is needed."""
        if self._failed is not None:
            raise self._failed
        try:
            return self._advance()
        except RequestError as exc:
            self._failed = exc
            raise

    def _advance(self) -> list[bytes] | None:
        buf, pos = self._buf, self._pos
        end = len(buf)
        while True:
            state = self._state
            if state == _BODY:  # skip the payload (hiredis gets it later), then check CRLF
                take = min(self._need - 2, end - pos)
                pos += take
                self._need -= take
                if self._need > 2 or end - pos < 2:
                    break
                if buf[pos] != 13 or buf[pos + 1] != 10:
                    raise ProtocolError("bulk payload not followed by CRLF")
                pos += 2
                self._args_left -= 1
                if self._args_left:
                    self._state = _HEADER
                    continue
                self._reader.feed(buf, self._mb_start, pos - self._mb_start)
                self._state, self._pos, self._mb_start = _START, pos, pos
                cmd = self._reader.gets()
                if not isinstance(cmd, list):  # cannot happen: the framing was validated
                    raise ProtocolError(f"unexpected request element of type {type(cmd).__name__}")
                return cmd
            if pos >= end:
                break
            first = buf[pos]
            if state == _START and first != 0x2A:  # inline command, terminated by \n
                nl = buf.find(b"\n", max(pos, self._scan))
                if nl < 0 or nl - pos > self.max_inline:
                    if end - pos > self.max_inline:
                        raise ProtocolError("too big inline request")
                    self._scan = end
                    break
                line = bytes(buf[pos : nl - 1 if nl > pos and buf[nl - 1] == 13 else nl])
                pos = self._scan = nl + 1
                args = split_inline(line)
                if args:
                    self._pos = pos
                    return args
                continue
            if state == _HEADER and first != 0x24:
                raise ProtocolError(f"expected '$', got '{chr(first)}'")
            eol = buf.find(b"\r\n", max(pos, self._scan))
            if eol < 0:
                if end - pos > self.max_inline:
                    what = "mbulk" if state == _START else "bulk"
                    raise ProtocolError(f"too big {what} count string")
                self._scan = end - 1
                break
            value = _parse_len(bytes(buf[pos + 1 : eol]))
            if state == _START:
                self._mb_start = pos
                pos = self._scan = eol + 2
                if value is None:
                    raise ProtocolError("invalid multibulk length")
                if value > self.max_args:
                    raise RequestTooLarge(self.too_many_args(value, self.max_args))
                if value > 0:  # like Redis, *0 and *-1 are silently skipped
                    self._state, self._args_left = _HEADER, value
            else:
                pos = self._scan = eol + 2
                if value is None or value < 0:
                    raise ProtocolError("invalid bulk length")
                if value > self.max_bulk:
                    raise RequestTooLarge(self.too_big_arg(value, self.max_bulk))
                self._state, self._need = _BODY, value + 2
        # Out of data: hand hiredis the validated part of the current multibulk and
        # drop consumed bytes, so a large payload never accumulates in our buffer.
        if self._state != _START and pos > self._mb_start:
            self._reader.feed(buf, self._mb_start, pos - self._mb_start)
            self._mb_start = pos
        if pos:
            del buf[:pos]
            self._scan = max(0, self._scan - pos)
            self._mb_start = max(0, self._mb_start - pos)
        self._pos = 0
        return None


# --- reply encoding ---------------------------------------------------------


class SimpleString(str):
    """A ``+status`` reply; must not contain CR or LF."""

    def __new__(cls, text: str = "") -> SimpleString:
        if "\r" in text or "\n" in text:
            raise ValueError(f"simple string may not contain CR or LF: {text!r}")
        return super().__new__(cls, text)


MAX_ERROR_CHARS = 512


class ErrorReply(str):
    """A ``-CODE message`` reply: one line, printable, at most MAX_ERROR_CHARS (then ``…``).

    Whatever an error quotes of a client's input, the reply stays small and
    safe to print: line breaks become spaces, other control characters ``?``.
    """

    def __new__(cls, text: str) -> ErrorReply:
        cut = len(text) > MAX_ERROR_CHARS
        text = text[:MAX_ERROR_CHARS].replace("\r\n", " ").replace("\r", " ").replace("\n", " ")
        if not text.isprintable():
            text = "".join(c if c.isprintable() else "?" for c in text)
        return super().__new__(cls, text + "…" if cut else text)


class Verbatim(str):
    """RESP3 verbatim string (``=``) with a 3-letter format (``txt``, ``mkd``); RESP2 bulk."""

    fmt: str

    def __new__(cls, text: str, fmt: str = "txt") -> Verbatim:
        if len(fmt) != 3 or not fmt.isascii():
            raise ValueError(f"verbatim format must be 3 ASCII characters, got {fmt!r}")
        self = super().__new__(cls, text)
        self.fmt = fmt
        return self


class Push(list):
    """An out-of-band message: RESP3 ``>`` push, RESP2 plain array (like Redis pub/sub)."""


class Prebuilt(bytes):
    """A reply already encoded for the connection's protocol (a hot path's fast lane)."""


class NullArray:
    """Type of :data:`NULL_ARRAY`, the RESP2 ``*-1`` reply (e.g. a BLPOP timeout)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "NULL_ARRAY"


NULL_ARRAY = NullArray()

_CRLF = b"\r\n"
_SMALL = 1024  # headers for lengths/integers below this are precomputed
_HDR = {p: [b"%s%d\r\n" % (p, i) for i in range(_SMALL)] for p in (b"$", b"*", b"%", b"~", b">", b":")}
_INT, _BULK = _HDR[b":"], _HDR[b"$"]


def _header(prefix: bytes, n: int) -> bytes:
    return _HDR[prefix][n] if n < _SMALL else b"%s%d\r\n" % (prefix, n)


def _bulk(out: list, b: Any, n: int) -> None:
    out += (_BULK[n] if n < _SMALL else b"$%d\r\n" % n, b, _CRLF)


def _w_int(out: list, v: int, p3: bool) -> None:
    if 0 <= v < _SMALL:
        out.append(_INT[v])
    elif -(1 << 63) <= v < (1 << 63):
        out.append(b":%d\r\n" % v)
    elif p3:
        out.append(b"(%d\r\n" % v)  # RESP3 big number
    else:
        _w_str(out, str(v), p3)


def _w_str(out: list, v: str, p3: bool) -> None:
    b = v.encode()
    _bulk(out, b, len(b))


def _w_view(out: list, v: memoryview, p3: bool) -> None:
    v = v.cast("B") if v.c_contiguous else memoryview(v.tobytes())
    _bulk(out, v, v.nbytes)


def _w_verbatim(out: list, v: Verbatim, p3: bool) -> None:
    b = (v.fmt + ":" + v).encode() if p3 else v.encode()
    out += (b"=%d\r\n" % len(b), b, _CRLF) if p3 else (_header(b"$", len(b)), b, _CRLF)


def _w_float(out: list, v: float, p3: bool) -> None:
    s = repr(v).encode()  # shortest round-trip form; inf, -inf and nan as Redis spells them
    out += (b",", s, _CRLF) if p3 else (_header(b"$", len(s)), s, _CRLF)


def _aggregate(prefix: bytes, in_resp2: bool) -> Callable[[list, Any, bool], None]:
    def write(out: list, v: Any, p3: bool) -> None:
        out.append(_header(prefix if p3 or in_resp2 else b"*", len(v)))
        for item in v:
            _write(out, item, p3)

    return write


def _w_map(out: list, v: dict, p3: bool) -> None:
    out.append(_header(b"%", len(v)) if p3 else _header(b"*", 2 * len(v)))
    for key, val in v.items():
        _write(out, key, p3)
        _write(out, val, p3)


_DISPATCH: dict[type, Callable[[list, Any, bool], None]] = {
    bytes: lambda out, v, p3: _bulk(out, v, len(v)),
    bytearray: lambda out, v, p3: _bulk(out, v, len(v)),
    str: _w_str, memoryview: _w_view, int: _w_int, float: _w_float, Verbatim: _w_verbatim, dict: _w_map,
    bool: lambda out, v, p3: out.append((b"#t\r\n" if v else b"#f\r\n") if p3 else _INT[v]),
    type(None): lambda out, v, p3: out.append(b"_\r\n" if p3 else b"$-1\r\n"),
    NullArray: lambda out, v, p3: out.append(b"_\r\n" if p3 else b"*-1\r\n"),
    SimpleString: lambda out, v, p3: out.extend((b"+", v.encode(), _CRLF)),
    ErrorReply: lambda out, v, p3: out.extend((b"-", v.encode(), _CRLF)),
    list: _aggregate(b"*", True), tuple: _aggregate(b"*", True), Push: _aggregate(b">", False),
    set: _aggregate(b"~", False), frozenset: _aggregate(b"~", False),
    Prebuilt: lambda out, v, p3: out.append(v),
}


def _write(out: list, v: Any, p3: bool) -> None:
    fn = _DISPATCH.get(type(v))
    if fn is None:  # a subclass (IntEnum, StrEnum, ...): use its nearest known base
        fn = next((_DISPATCH[b] for b in type(v).__mro__ if b in _DISPATCH), None)
        if fn is None:
            raise TypeError(f"cannot encode {type(v).__name__} as a RESP reply")
        _DISPATCH[type(v)] = fn
    fn(out, v, p3)


_BULK_HEADERS = [b"$%d" % size for size in range(4096)]  # a bulk string's header, without its CRLF
_bulk_header = _BULK_HEADERS.__getitem__


def encode_bulk_array(items: list[bytes]) -> bytes:
    """An array of bulk strings (the same in RESP2 and RESP3, and the form of a request),
    built without a Python step per item: many message ids, or a request's canonical frame."""
    n = len(items)
    parts = [_CRLF] * (2 * n + 2)
    parts[0] = b"*%d" % n
    try:
        parts[1:-1:2] = map(_bulk_header, map(len, items))
    except IndexError:  # an item of 4 KiB or more: its bytes cost more than formatting its header
        parts[1:-1:2] = map(b"$%d".__mod__, map(len, items))
    parts[2:-1:2] = items
    parts[-1] = b""
    return _CRLF.join(parts)


def encode(value: Any, proto: int) -> bytes:
    """Serialize one reply for a client speaking RESP ``proto`` (2 or 3)."""
    return encode_many((value,), proto)


def encode_many(values: Iterable[Any], proto: int) -> bytes:
    """Serialize several replies (e.g. a pipeline's) into one buffer, for a single write."""
    if proto != 2 and proto != 3:
        raise ValueError(f"RESP protocol version must be 2 or 3, got {proto!r}")
    out: list = []
    for value in values:
        _write(out, value, proto == 3)
    return b"".join(out)
