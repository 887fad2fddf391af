"""The worker's request reader: frames parsed in C, Redis's rules kept exactly.

Sans-I/O, like fencemq.protocol.resp. ``hiredis.Reader`` reads whole chunks of
pipelined multibulk requests; Python then looks at each command once, not at
each argument. Every command hiredis hands back is checked in C-speed steps:
its canonical encoding (``*N``, then ``$len`` + bytes + CRLF per argument) is
rebuilt with ``bytes.join`` and must be the very bytes received, which proves
the frame was well formed (hiredis alone would accept ``+x`` or ``:1`` elements
and does not check the CRLF after a bulk); and its argument count and sizes
are held against the limits.

Everything else goes through :class:`~fencemq.protocol.resp.RequestParser`,
the exact pure-Python reader, until the next request boundary:

- a request that is not complete in the bytes received so far (the tail of a
  chunk, a large payload arriving over many reads): the parser checks each
  ``*N``/``$len`` header as it arrives, so an over-limit frame is refused from
  its header alone, and it streams the payload on without keeping it;
- inline commands, ``*0``/``*-1`` and malformed input, so every error is the
  one Redis gives.

A pipelined client costs one Python walk over the headers of at most one
request per read (the one cut by the read boundary) instead of one over every
argument.
"""

from __future__ import annotations

import hiredis

from fencemq.protocol.resp import ProtocolError, RequestError, RequestParser, RequestTooLarge, encode_bulk_array

__all__ = ["RequestReader"]


def _new_reader() -> hiredis.Reader:
    return hiredis.Reader(protocolError=ProtocolError, replyError=ProtocolError)


class RequestReader:
    """Incremental request reader: ``feed()`` bytes, then call ``gets()`` until None.

    The same contract and limits as RequestParser (a RequestError is final: reply
    ``-`` + ``exc.message`` and close), plus ``buffered``: the bytes held for
    requests not yet returned, for a caller that bounds how much it reads ahead.
    """

    def __init__(
        self, *, max_bulk: int = 8 * 1024 * 1024, max_args: int = 1_000_000, max_inline: int = 64 * 1024
    ) -> None:
        self.max_bulk, self.max_args, self.max_inline = max_bulk, max_args, max_inline
        # Fast mode: _reader has been fed exactly _buf[_pos:], starting at a request boundary.
        self._reader = _new_reader()
        self._buf = bytearray()
        self._pos = 0
        # Exact mode (between a boundary the fast path could not pass and the next one).
        self._exact: RequestParser | None = None
        self._failed: RequestError | None = None

    def set_limits(self, *, max_bulk: int, max_args: int) -> None:
        """New limits from the next header on (tighter before authentication, wider after)."""
        self.max_bulk, self.max_args = max_bulk, max_args
        if self._exact is not None:
            self._exact.max_bulk, self._exact.max_args = max_bulk, max_args

    @property
    def mid_request(self) -> bool:
        """Part of a request was received and it is not complete yet (or not parsed yet)."""
        if self._exact is not None:
            return self._exact.mid_request
        return len(self._buf) > self._pos

    @property
    def buffered(self) -> int:
        if self._exact is not None:
            return self._exact.buffered
        return len(self._buf) - self._pos

    def feed(self, data: bytes) -> None:
        """Queue received bytes; never raises (errors surface from ``gets()``)."""
        if self._exact is not None:
            self._exact.feed(data)
        else:
            self._buf += data
            self._reader.feed(data)

    def gets(self) -> list[bytes] | None:
        """The next complete command as a list of bytes, or None if more data is needed."""
        if self._failed is not None:
            raise self._failed
        try:
            if self._exact is None:
                return self._fast()
            return self._exact_step()
        except RequestError as exc:
            self._failed = exc
            raise

    def _fast(self) -> list[bytes] | None:
        while True:
            try:
                cmd = self._reader.gets()
            except Exception:  # noqa: BLE001 - whatever hiredis makes of it (a ProtocolError, or a TypeError
                # for a RESP3 map keyed by an array), the exact parser says what it is: inline, or malformed
                cmd = None
            if cmd != [] or not self._buf.startswith(b"*0\r\n", self._pos):
                break
            self._pos += 4  # *0: skipped, as Redis does
        if type(cmd) is list and cmd:
            buf, pos, n = self._buf, self._pos, len(cmd)
            try:
                frame = encode_bulk_array(cmd)
            except TypeError:  # an element that is not a bulk string (a number, an array, an error...)
                frame = None
            if frame is not None and buf.startswith(frame, pos):
                if n > self.max_args or len(frame) > self.max_bulk:
                    self._check_limits(cmd)
                self._pos = pos + len(frame)
                return cmd
        elif cmd is False:
            if self._pos == len(self._buf):  # at a boundary with nothing left: the common end of a read
                self._buf.clear()
                self._pos = 0
                return None
            # The rest is a request cut by the read boundary: the exact parser checks its headers
            # as they come (Redis refuses a bad one at once, and so do we), and streams its payload.
        return self._to_exact()

    def _check_limits(self, cmd: list[bytes]) -> None:
        if len(cmd) > self.max_args:
            raise RequestTooLarge(RequestParser.too_many_args(len(cmd), self.max_args))
        for size in map(len, cmd):
            if size > self.max_bulk:
                raise RequestTooLarge(RequestParser.too_big_arg(size, self.max_bulk))

    def _to_exact(self) -> list[bytes] | None:
        """Hand the bytes from the current boundary on to the exact parser."""
        self._exact = RequestParser(max_bulk=self.max_bulk, max_args=self.max_args, max_inline=self.max_inline)
        self._exact.feed(bytes(self._buf[self._pos :]) if self._pos else self._buf)
        self._buf = bytearray()
        self._pos = 0
        return self._exact_step()

    def _exact_step(self) -> list[bytes] | None:
        exact = self._exact
        assert exact is not None
        cmd = exact.gets()
        rest = exact.rest_at_boundary()
        # Back at a request boundary (a command was returned, or nothing at all is left; not
        # the start of a request still incomplete): the fast path takes over again.
        if rest is not None and (cmd is not None or not rest):
            self._exact = None
            self._reader = _new_reader()
            self._buf = bytearray(rest)
            self._pos = 0
            if rest:
                self._reader.feed(rest)
            if cmd is None:
                return self._fast()
        return cmd
