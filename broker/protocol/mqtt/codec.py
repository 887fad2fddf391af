"""Encode and decode MQTT 3.1.1 and 5.0 control packets, whole (fixed header included).

``encode(packet, protocol_level)`` gives the bytes of a packet; ``decode_body``
reads one packet from its first byte and its body (what follows the Remaining
Length), checking the fixed-header flags (MQTT-2.1.3-1), the packet's layout,
and the properties its type may carry. The streaming side (where a packet
starts and ends, size limits) is ``mqtt/stream``.
"""

from __future__ import annotations

from fencemq.protocol.mqtt.packets import (
    MQTT_5,
    MQTT_311,
    PROTOCOL_NAME,
    PUBLISH_RESPONSES,
    Auth,
    Connack,
    Connect,
    Disconnect,
    Packet,
    PacketType,
    Pingreq,
    Pingresp,
    Publish,
    PublishResponse,
    Suback,
    Subscribe,
    SubscriptionOptions,
    Unsuback,
    Unsubscribe,
    Will,
)
from fencemq.protocol.mqtt.properties import NO_PROPERTIES, Properties, decode_properties, encode_properties
from fencemq.protocol.mqtt.reasons import (
    CONNACK_RETURN_CODES_V311,
    REASONS_V5,
    SUBACK_RETURN_CODES_V311,
    MalformedPacket,
    MqttError,
    ProtocolViolation,
    UnsupportedProtocolVersion,
)
from fencemq.protocol.mqtt.wire import MAX_VARINT, Reader, binary, u8, u16, utf8, varint

# The fixed-header flags each type must carry (MQTT-2.1.3-1); PUBLISH's are its own.
REQUIRED_FLAGS = {t: 0b0010 if t in (PacketType.PUBREL, PacketType.SUBSCRIBE, PacketType.UNSUBSCRIBE) else 0
                  for t in PacketType if t is not PacketType.PUBLISH}

_CLEAN_START, _WILL, _WILL_RETAIN, _PASSWORD, _USERNAME = 0x02, 0x04, 0x20, 0x40, 0x80


# --------------------------------------------------------------------------- encoding


def encode(packet: Packet, protocol_level: int = MQTT_5) -> bytes:
    """The bytes of ``packet`` as ``protocol_level`` (4: MQTT 3.1.1, 5: MQTT 5.0) writes it."""
    if protocol_level not in (MQTT_311, MQTT_5):
        raise ValueError(f"protocol level {protocol_level} is neither 4 (MQTT 3.1.1) nor 5 (MQTT 5.0)")
    v5 = protocol_level == MQTT_5
    kind = packet.packet_type
    flags = REQUIRED_FLAGS.get(kind, 0)
    if isinstance(packet, Publish):
        flags = _publish_flags(packet)
    body = _ENCODERS[kind](packet, v5)
    if len(body) > MAX_VARINT:
        raise ValueError(f"{kind.name} of {len(body)} bytes is over MQTT's Remaining Length limit")
    return u8(kind << 4 | flags) + varint(len(body)) + body


def _props(props: Properties, carrier: str, v5: bool) -> bytes:
    if v5:
        return encode_properties(props, carrier)
    if props:
        raise ValueError(f"an MQTT 3.1.1 {carrier} carries no properties; got {sorted(props.present())}")
    return b""


def _check_reason(code: int, carrier: str) -> None:
    if code not in REASONS_V5[carrier]:
        raise ValueError(f"0x{code:02X} is not a reason code a {carrier} may carry")


def _packet_id(packet_id: int | None) -> bytes:
    if packet_id is None or not 1 <= packet_id <= 0xFFFF:
        raise ValueError(f"packet identifier {packet_id!r} is not in 1 … 65535 (MQTT-2.2.1-3)")
    return u16(packet_id)


def _encode_connect(p: Connect, v5: bool) -> bytes:
    if p.protocol_level not in (MQTT_311, MQTT_5) or p.protocol_level != (MQTT_5 if v5 else MQTT_311):
        raise ValueError(f"CONNECT says protocol level {p.protocol_level}; encoding as {5 if v5 else 4}")
    flags = _CLEAN_START if p.clean_start else 0
    will = b""
    if p.will is not None:
        if p.will.qos not in (0, 1, 2):
            raise ValueError(f"will QoS {p.will.qos} is not 0, 1 or 2")
        flags |= _WILL | p.will.qos << 3 | (_WILL_RETAIN if p.will.retain else 0)
        will = _props(p.will.properties, "WILL", v5) + utf8(p.will.topic, "will topic") + binary(p.will.payload)
    if p.username is not None:
        flags |= _USERNAME
    if p.password is not None:
        if not v5 and p.username is None:
            raise ValueError("MQTT 3.1.1 sends a password only with a user name")
        flags |= _PASSWORD
    return (utf8(p.protocol_name, "protocol name") + u8(p.protocol_level) + u8(flags) + u16(p.keep_alive)
            + _props(p.properties, "CONNECT", v5) + utf8(p.client_id, "client identifier") + will
            + (utf8(p.username, "user name") if p.username is not None else b"")
            + (binary(p.password) if p.password is not None else b""))


def _encode_connack(p: Connack, v5: bool) -> bytes:
    if v5:
        _check_reason(p.reason_code, "CONNACK")
    elif p.reason_code not in CONNACK_RETURN_CODES_V311:
        raise ValueError(f"{p.reason_code} is not an MQTT 3.1.1 CONNACK return code")
    return u8(1 if p.session_present else 0) + u8(p.reason_code) + _props(p.properties, "CONNACK", v5)


def _publish_flags(p: Publish) -> int:
    if p.qos not in (0, 1, 2):
        raise ValueError(f"QoS {p.qos} is not 0, 1 or 2")
    if p.qos == 0 and (p.dup or p.packet_id is not None):
        raise ValueError("a QoS 0 PUBLISH has no packet identifier and no DUP flag (MQTT-2.2.1-2, MQTT-3.3.1-2)")
    return (0b1000 if p.dup else 0) | p.qos << 1 | (1 if p.retain else 0)


def _encode_publish(p: Publish, v5: bool) -> bytes:
    packet_id = _packet_id(p.packet_id) if p.qos else b""
    return utf8(p.topic, "topic name") + packet_id + _props(p.properties, "PUBLISH", v5) + bytes(p.payload)


def _encode_response(p: PublishResponse, v5: bool) -> bytes:
    carrier = p.packet_type.name
    head = _packet_id(p.packet_id)
    if not v5:
        if p.reason_code or p.properties:
            raise ValueError(f"an MQTT 3.1.1 {carrier} carries no reason code or properties")
        return head
    _check_reason(p.reason_code, carrier)
    if not p.properties:  # the short forms §3.4.2.1 allows
        return head if p.reason_code == 0 else head + u8(p.reason_code)
    return head + u8(p.reason_code) + _props(p.properties, carrier, v5)


def _encode_subscribe(p: Subscribe, v5: bool) -> bytes:
    if not p.subscriptions:
        raise ValueError("a SUBSCRIBE carries at least one topic filter (MQTT-3.8.3-2)")
    out = bytearray(_packet_id(p.packet_id) + _props(p.properties, "SUBSCRIBE", v5))
    for topic_filter, o in p.subscriptions:
        if o.qos not in (0, 1, 2) or o.retain_handling not in (0, 1, 2):
            raise ValueError(f"subscription options {o} out of range")
        if not v5 and (o.no_local or o.retain_as_published or o.retain_handling):
            raise ValueError("MQTT 3.1.1 subscription options carry only the QoS")
        options = o.qos | (0x04 if o.no_local else 0) | (0x08 if o.retain_as_published else 0) | o.retain_handling << 4
        out += utf8(topic_filter, "topic filter") + u8(options)
    return bytes(out)


def _encode_suback(p: Suback, v5: bool) -> bytes:
    for code in p.reason_codes:
        if v5:
            _check_reason(code, "SUBACK")
        elif code not in SUBACK_RETURN_CODES_V311:
            raise ValueError(f"0x{code:02X} is not an MQTT 3.1.1 SUBACK return code")
    return _packet_id(p.packet_id) + _props(p.properties, "SUBACK", v5) + bytes(p.reason_codes)


def _encode_unsubscribe(p: Unsubscribe, v5: bool) -> bytes:
    if not p.filters:
        raise ValueError("an UNSUBSCRIBE carries at least one topic filter (MQTT-3.10.3-2)")
    return (_packet_id(p.packet_id) + _props(p.properties, "UNSUBSCRIBE", v5)
            + b"".join(utf8(f, "topic filter") for f in p.filters))


def _encode_unsuback(p: Unsuback, v5: bool) -> bytes:
    if not v5:
        if p.reason_codes:
            raise ValueError("an MQTT 3.1.1 UNSUBACK carries no reason codes")
        return _packet_id(p.packet_id)
    for code in p.reason_codes:
        _check_reason(code, "UNSUBACK")
    return _packet_id(p.packet_id) + _props(p.properties, "UNSUBACK", v5) + bytes(p.reason_codes)


def _encode_disconnect_or_auth(p: Disconnect | Auth, v5: bool) -> bytes:
    carrier = p.packet_type.name
    if not v5:
        if isinstance(p, Auth):
            raise ValueError("MQTT 3.1.1 has no AUTH packet")
        if p.reason_code or p.properties:
            raise ValueError("an MQTT 3.1.1 DISCONNECT carries no reason code or properties")
        return b""
    _check_reason(p.reason_code, carrier)
    if not p.properties:
        return b"" if p.reason_code == 0 else u8(p.reason_code)
    return u8(p.reason_code) + _props(p.properties, carrier, v5)


def _encode_empty(_p: Pingreq | Pingresp, _v5: bool) -> bytes:
    return b""


_ENCODERS = {
    PacketType.CONNECT: _encode_connect, PacketType.CONNACK: _encode_connack, PacketType.PUBLISH: _encode_publish,
    PacketType.PUBACK: _encode_response, PacketType.PUBREC: _encode_response, PacketType.PUBREL: _encode_response,
    PacketType.PUBCOMP: _encode_response, PacketType.SUBSCRIBE: _encode_subscribe, PacketType.SUBACK: _encode_suback,
    PacketType.UNSUBSCRIBE: _encode_unsubscribe, PacketType.UNSUBACK: _encode_unsuback,
    PacketType.PINGREQ: _encode_empty, PacketType.PINGRESP: _encode_empty,
    PacketType.DISCONNECT: _encode_disconnect_or_auth, PacketType.AUTH: _encode_disconnect_or_auth,
}


# --------------------------------------------------------------------------- decoding


def decode_body(first_byte: int, body: bytes | memoryview, protocol_level: int | None) -> Packet:
    """One packet from its first byte and its body.

    ``protocol_level`` is None until a CONNECT has said it: then only a CONNECT
    decodes, and the level is read from it.
    """
    try:
        kind = PacketType(first_byte >> 4)
    except ValueError:
        raise MalformedPacket("packet type 0 is reserved") from None
    flags = first_byte & 0x0F
    if kind is not PacketType.PUBLISH and flags != REQUIRED_FLAGS[kind]:
        raise MalformedPacket(f"{kind.name} with fixed-header flags {flags:04b}, not {REQUIRED_FLAGS[kind]:04b} "
                              "(MQTT-2.1.3-1)")
    reader = Reader(body)
    if kind is PacketType.CONNECT:
        return _decode_connect(reader)
    if protocol_level is None:
        raise ProtocolViolation(f"{kind.name} before CONNECT; the first packet must be CONNECT (MQTT-3.1.0-1)")
    v5 = protocol_level == MQTT_5
    if kind is PacketType.AUTH and not v5:
        raise MalformedPacket("packet type 15 is reserved in MQTT 3.1.1")
    packet = _DECODERS[kind](reader, flags, v5) if kind is PacketType.PUBLISH else _DECODERS[kind](reader, v5)
    reader.expect_end(kind.name)
    return packet


def _decode_reason(reader: Reader, carrier: str) -> int:
    code = reader.u8("reason code")
    if code not in REASONS_V5[carrier]:
        raise ProtocolViolation(f"0x{code:02X} is not a reason code a {carrier} may carry")
    return code


def _decode_packet_id(reader: Reader) -> int:
    packet_id = reader.u16("packet identifier")
    if packet_id == 0:
        raise ProtocolViolation("packet identifier 0 (MQTT-2.2.1-3)")
    return packet_id


def _decode_connect(reader: Reader) -> Connect:
    name = reader.utf8("protocol name")
    level = reader.u8("protocol level")
    if name != PROTOCOL_NAME or level not in (MQTT_311, MQTT_5):
        raise UnsupportedProtocolVersion(name, level)
    try:
        return _decode_connect_rest(reader, level)
    except MqttError as exc:
        exc.protocol_level = level
        raise


def _decode_connect_rest(reader: Reader, level: int) -> Connect:
    v5 = level == MQTT_5
    flags = reader.u8("connect flags")
    if flags & 0x01:
        raise MalformedPacket("the reserved connect flag is set (MQTT-3.1.2-3)")
    will_qos = flags >> 3 & 0x03
    has_will = bool(flags & _WILL)
    if will_qos == 3:
        raise MalformedPacket("will QoS 3 (MQTT-3.1.2-14)")
    if not has_will and (will_qos or flags & _WILL_RETAIN):
        raise MalformedPacket("will QoS or will retain set without the will flag (MQTT-3.1.2-13, -15)")
    if not v5 and flags & _PASSWORD and not flags & _USERNAME:
        raise MalformedPacket("an MQTT 3.1.1 password flag without the user name flag (3.1.1: MQTT-3.1.2-22)")
    keep_alive = reader.u16("keep alive")
    props = decode_properties(reader, "CONNECT") if v5 else NO_PROPERTIES
    client_id = reader.utf8("client identifier")
    will = None
    if has_will:
        will_props = decode_properties(reader, "WILL") if v5 else NO_PROPERTIES
        topic = reader.utf8("will topic")
        will = Will(topic, reader.binary("will payload"), will_qos, bool(flags & _WILL_RETAIN), will_props)
    username = reader.utf8("user name") if flags & _USERNAME else None
    password = reader.binary("password") if flags & _PASSWORD else None
    reader.expect_end("CONNECT")
    return Connect(client_id, level, bool(flags & _CLEAN_START), keep_alive, username, password, will, props)


def _decode_connack(reader: Reader, v5: bool) -> Connack:
    ack_flags = reader.u8("connect acknowledge flags")
    if ack_flags & 0xFE:
        raise MalformedPacket("reserved CONNACK flags are set (MQTT-3.2.2-1)")
    if not v5:
        code = reader.u8("return code")
        if code not in CONNACK_RETURN_CODES_V311:
            raise ProtocolViolation(f"{code} is not an MQTT 3.1.1 CONNACK return code")
        return Connack(code, bool(ack_flags))
    code = _decode_reason(reader, "CONNACK")
    return Connack(code, bool(ack_flags), decode_properties(reader, "CONNACK"))


def _decode_publish(reader: Reader, flags: int, v5: bool) -> Publish:
    qos, dup, retain = flags >> 1 & 0x03, bool(flags & 0b1000), bool(flags & 1)
    if qos == 3:
        raise MalformedPacket("a PUBLISH with both QoS bits set (MQTT-3.3.1-4)")
    if dup and qos == 0:
        raise MalformedPacket("a QoS 0 PUBLISH with the DUP flag (MQTT-3.3.1-2)")
    topic = reader.utf8("topic name")
    packet_id = _decode_packet_id(reader) if qos else None
    props = decode_properties(reader, "PUBLISH") if v5 else NO_PROPERTIES
    return Publish(topic, reader.rest(), qos, retain, dup, packet_id, props)


def _decode_response(reader: Reader, v5: bool, kind: PacketType) -> PublishResponse:
    cls = PUBLISH_RESPONSES[kind]
    packet_id = _decode_packet_id(reader)
    if not v5 or not reader.remaining:
        return cls(packet_id)
    code = _decode_reason(reader, kind.name)
    props = decode_properties(reader, kind.name) if reader.remaining else NO_PROPERTIES
    return cls(packet_id, code, props)


def _decode_subscribe(reader: Reader, v5: bool) -> Subscribe:
    packet_id = _decode_packet_id(reader)
    props = decode_properties(reader, "SUBSCRIBE") if v5 else NO_PROPERTIES
    entries = []
    while reader.remaining:
        topic_filter = reader.utf8("topic filter")
        options = reader.u8("subscription options")
        if options & (0xC0 if v5 else 0xFC):
            raise MalformedPacket(f"reserved bits of subscription options {options:08b} are set (MQTT-3.8.3-5)")
        qos, retain_handling = options & 0x03, options >> 4 & 0x03
        if qos == 3:
            raise MalformedPacket("a subscription asks for QoS 3")
        if retain_handling == 3:
            raise ProtocolViolation("retain handling 3 (§3.8.3.1)")
        entries.append((topic_filter, SubscriptionOptions(qos, bool(options & 0x04), bool(options & 0x08),
                                                          retain_handling)))
    if not entries:
        raise ProtocolViolation("a SUBSCRIBE without topic filters (MQTT-3.8.3-2)")
    return Subscribe(packet_id, tuple(entries), props)


def _decode_suback(reader: Reader, v5: bool) -> Suback:
    packet_id = _decode_packet_id(reader)
    props = decode_properties(reader, "SUBACK") if v5 else NO_PROPERTIES
    codes = tuple(reader.rest())
    allowed = REASONS_V5["SUBACK"] if v5 else SUBACK_RETURN_CODES_V311
    if not codes or not set(codes) <= allowed:
        raise ProtocolViolation(f"SUBACK reason codes {codes!r} are empty or not allowed")
    return Suback(packet_id, codes, props)


def _decode_unsubscribe(reader: Reader, v5: bool) -> Unsubscribe:
    packet_id = _decode_packet_id(reader)
    props = decode_properties(reader, "UNSUBSCRIBE") if v5 else NO_PROPERTIES
    filters = []
    while reader.remaining:
        filters.append(reader.utf8("topic filter"))
    if not filters:
        raise ProtocolViolation("an UNSUBSCRIBE without topic filters (MQTT-3.10.3-2)")
    return Unsubscribe(packet_id, tuple(filters), props)


def _decode_unsuback(reader: Reader, v5: bool) -> Unsuback:
    packet_id = _decode_packet_id(reader)
    if not v5:
        return Unsuback(packet_id)
    props = decode_properties(reader, "UNSUBACK")
    codes = tuple(reader.rest())
    if not codes or not set(codes) <= REASONS_V5["UNSUBACK"]:
        raise ProtocolViolation(f"UNSUBACK reason codes {codes!r} are empty or not allowed")
    return Unsuback(packet_id, codes, props)


def _decode_disconnect(reader: Reader, v5: bool) -> Disconnect:
    if not v5 or not reader.remaining:
        return Disconnect()
    code = _decode_reason(reader, "DISCONNECT")
    return Disconnect(code, decode_properties(reader, "DISCONNECT") if reader.remaining else NO_PROPERTIES)


def _decode_auth(reader: Reader, v5: bool) -> Auth:
    if not reader.remaining:
        return Auth()
    code = _decode_reason(reader, "AUTH")
    return Auth(code, decode_properties(reader, "AUTH") if reader.remaining else NO_PROPERTIES)


def _decode_ping(kind: type[Pingreq] | type[Pingresp]):
    return lambda _reader, _v5: kind()


_DECODERS = {
    PacketType.CONNACK: _decode_connack, PacketType.PUBLISH: _decode_publish,
    **{kind: (lambda reader, v5, kind=kind: _decode_response(reader, v5, kind)) for kind in PUBLISH_RESPONSES},
    PacketType.SUBSCRIBE: _decode_subscribe, PacketType.SUBACK: _decode_suback,
    PacketType.UNSUBSCRIBE: _decode_unsubscribe, PacketType.UNSUBACK: _decode_unsuback,
    PacketType.PINGREQ: _decode_ping(Pingreq), PacketType.PINGRESP: _decode_ping(Pingresp),
    PacketType.DISCONNECT: _decode_disconnect, PacketType.AUTH: _decode_auth,
}
