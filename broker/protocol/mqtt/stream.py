"""A streaming MQTT decoder: bytes in, in any split, whole packets out.

The buffer never holds more than one partial packet, and a packet whose
Remaining Length announces more than the negotiated Maximum Packet Size is
refused (0x95) as soon as its fixed header is read, before its body is
buffered or waited for. After any error the stream is unusable: the
connection must close.
"""

from __future__ import annotations

from fencemq.protocol.mqtt.codec import decode_body
from fencemq.protocol.mqtt.packets import Connect, Packet
from fencemq.protocol.mqtt.reasons import MalformedPacket, MqttError, PacketTooLarge
from fencemq.protocol.mqtt.wire import read_varint_prefix

MAX_PACKET_SIZE = 268_435_460  # 1 + 4 + the largest Remaining Length


class MqttStreamDecoder:
    """Feed bytes with :meth:`feed`; take packets with :meth:`next_packet` until it returns None.

    ``protocol_level`` None means "a server's first packet": only a CONNECT
    decodes, and it sets the level for the packets after it; that first packet
    may be at most ``maximum_first_size`` (the CONNECT before authentication).
    """

    __slots__ = ("maximum_packet_size", "maximum_first_size", "protocol_level", "_buffer", "_failed")

    def __init__(self, maximum_packet_size: int = MAX_PACKET_SIZE, protocol_level: int | None = None,
                 maximum_first_size: int | None = None) -> None:
        if not 2 <= maximum_packet_size <= MAX_PACKET_SIZE:
            raise ValueError(f"maximum packet size {maximum_packet_size} is not in 2 … {MAX_PACKET_SIZE}")
        self.maximum_packet_size = maximum_packet_size
        self.maximum_first_size = maximum_first_size if protocol_level is None else None
        self.protocol_level = protocol_level
        self._buffer = bytearray()
        self._failed: MqttError | None = None

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    @property
    def mid_packet(self) -> bool:
        """Part of a packet is buffered: a request begun and not finished."""
        return bool(self._buffer)

    def feed(self, data: bytes) -> None:
        if self._failed is not None:
            raise self._failed
        self._buffer += data

    def next_packet(self) -> Packet | None:
        """The next whole packet, or None until more bytes arrive."""
        if self._failed is not None:
            raise self._failed
        try:
            return self._next_packet()
        except MqttError as exc:
            self._failed = exc
            self._buffer.clear()
            raise

    def packets(self, data: bytes = b"") -> list[Packet]:
        """Feed ``data`` and take every whole packet it completes."""
        self.feed(data)
        out = []
        while (packet := self.next_packet()) is not None:
            out.append(packet)
        return out

    def _next_packet(self) -> Packet | None:
        buffer = self._buffer
        if len(buffer) < 2:
            return None
        found = read_varint_prefix(buffer, 1)
        if found is None:
            return None
        remaining, used = found
        size = 1 + used + remaining
        if self.maximum_first_size is not None and size > self.maximum_first_size:
            raise PacketTooLarge(f"a first packet of {size} bytes is over the {self.maximum_first_size} bytes a "
                                 f"CONNECT may have before authentication")
        if size > self.maximum_packet_size:
            raise PacketTooLarge(f"a packet of {size} bytes is over the maximum packet size "
                                 f"{self.maximum_packet_size}")
        if len(buffer) < size:
            return None
        first = buffer[0]
        body = bytes(buffer[1 + used:size])
        del buffer[:size]
        packet = decode_body(first, body, self.protocol_level)
        self.maximum_first_size = None
        if isinstance(packet, Connect) and self.protocol_level is None:
            # a second CONNECT changes nothing here: the session refuses it (MQTT-3.1.0-2)
            self.protocol_level = packet.protocol_level
        return packet


def decode_all(data: bytes, protocol_level: int | None, maximum_packet_size: int = MAX_PACKET_SIZE) -> list[Packet]:
    """Every packet in ``data``, which must end on a packet boundary."""
    decoder = MqttStreamDecoder(maximum_packet_size, protocol_level)
    packets = decoder.packets(data)
    if decoder.buffered:
        raise MalformedPacket(f"{decoder.buffered} bytes of an unfinished packet at the end")
    return packets
