"""MQTT's data representations (MQTT 5.0 §1.5): integers, variable byte integers,
UTF-8 strings, binary data, string pairs; read from a bounded view, written to bytes.

Reading past the end of a packet, a string that is not well-formed UTF-8 or
that holds U+0000, and a variable byte integer longer than four bytes or not
in its shortest form are all malformed packets (0x81). Writing a value the
standard cannot carry is a ValueError: the caller, not the peer, is wrong.
"""

from __future__ import annotations

from fencemq.protocol.mqtt.reasons import MalformedPacket

MAX_VARINT = 268_435_455  # four bytes of seven bits (§1.5.5)
MAX_UTF8_BYTES = 65_535


def varint(value: int) -> bytes:
    if not 0 <= value <= MAX_VARINT:
        raise ValueError(f"{value} does not fit a variable byte integer (0 … {MAX_VARINT})")
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | 0x80 if value else byte)
        if not value:
            return bytes(out)


def u8(value: int) -> bytes:
    return value.to_bytes(1, "big")


def u16(value: int) -> bytes:
    return value.to_bytes(2, "big")


def u32(value: int) -> bytes:
    return value.to_bytes(4, "big")


def check_text(text: str, what: str = "string") -> bytes:
    """The UTF-8 bytes of ``text``, refusing what MQTT-1.5.4-1/-2 forbid."""
    if "\x00" in text:
        raise ValueError(f"{what} contains U+0000, which MQTT strings may not hold")
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate
        raise ValueError(f"{what} is not well-formed UTF-8: {exc.reason}") from None
    if len(data) > MAX_UTF8_BYTES:
        raise ValueError(f"{what} is {len(data)} bytes; MQTT strings hold at most {MAX_UTF8_BYTES}")
    return data


def utf8(text: str, what: str = "string") -> bytes:
    data = check_text(text, what)
    return u16(len(data)) + data


def binary(data: bytes) -> bytes:
    if len(data) > MAX_UTF8_BYTES:
        raise ValueError(f"binary data of {len(data)} bytes; MQTT carries at most {MAX_UTF8_BYTES}")
    return u16(len(data)) + bytes(data)


def decode_text(data: bytes | memoryview, what: str = "string") -> str:
    try:
        # strict 'utf-8' refuses surrogates and overlong forms, and keeps a
        # leading BOM as U+FEFF rather than stripping it (MQTT-1.5.4-3)
        text = str(data, "utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedPacket(f"{what} is not well-formed UTF-8 (MQTT-1.5.4-1): {exc.reason}") from None
    if "\x00" in text:
        raise MalformedPacket(f"{what} contains U+0000 (MQTT-1.5.4-2)")
    return text


def read_varint_prefix(data: bytes | memoryview, start: int = 0) -> tuple[int, int] | None:
    """(value, bytes used) of a variable byte integer at ``start``; None while incomplete."""
    value = 0
    for i in range(4):
        if start + i >= len(data):
            return None
        byte = data[start + i]
        value |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            if i and byte == 0:
                raise MalformedPacket("variable byte integer not in its shortest form (MQTT-1.5.5-1)")
            return value, i + 1
    raise MalformedPacket("variable byte integer longer than four bytes")


class Reader:
    """A cursor over one packet's body; every read past its end is a malformed packet."""

    __slots__ = ("data", "pos", "end")

    def __init__(self, data: bytes | memoryview, start: int = 0, end: int | None = None) -> None:
        self.data = memoryview(data)
        self.pos = start
        self.end = len(self.data) if end is None else end

    @property
    def remaining(self) -> int:
        return self.end - self.pos

    def take(self, n: int, what: str = "field") -> memoryview:
        if n > self.remaining:
            raise MalformedPacket(f"{what} runs past the end of the packet")
        view = self.data[self.pos:self.pos + n]
        self.pos += n
        return view

    def u8(self, what: str = "byte") -> int:
        return self.take(1, what)[0]

    def u16(self, what: str = "two byte integer") -> int:
        return int.from_bytes(self.take(2, what), "big")

    def u32(self, what: str = "four byte integer") -> int:
        return int.from_bytes(self.take(4, what), "big")

    def varint(self, what: str = "variable byte integer") -> int:
        found = read_varint_prefix(self.data[:self.end], self.pos)
        if found is None:
            raise MalformedPacket(f"{what} runs past the end of the packet")
        value, used = found
        self.pos += used
        return value

    def utf8(self, what: str = "string") -> str:
        return decode_text(self.take(self.u16(what), what), what)

    def binary(self, what: str = "binary data") -> bytes:
        return bytes(self.take(self.u16(what), what))

    def rest(self) -> bytes:
        return bytes(self.take(self.remaining))

    def sub(self, length: int, what: str) -> "Reader":
        """A reader over the next ``length`` bytes (a property block), skipping them here."""
        if length > self.remaining:
            raise MalformedPacket(f"{what} runs past the end of the packet")
        inner = Reader(self.data, self.pos, self.pos + length)
        self.pos += length
        return inner

    def expect_end(self, what: str) -> None:
        if self.remaining:
            raise MalformedPacket(f"{self.remaining} unexpected bytes at the end of {what}")
