"""MQTT 5.0 properties (§2.2.2): their identifiers, types, and which packet may carry each.

One table, ``PROPERTIES``, is the source of truth for both directions. A
property a packet may not carry, or of the wrong type, makes a malformed packet
(0x81); a property given twice that may appear once, or a value outside its
range (a boolean byte other than 0/1, a Receive Maximum of 0 …), is a protocol
error (0x82). User Properties keep their order and may repeat names.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum
from typing import Any, NamedTuple

from fencemq.protocol.mqtt.reasons import MalformedPacket, ProtocolViolation
from fencemq.protocol.mqtt.wire import MAX_VARINT, Reader, binary, u8, u16, u32, utf8, varint


class Kind(Enum):
    BYTE = "byte"
    TWO_BYTE = "two byte integer"
    FOUR_BYTE = "four byte integer"
    VARINT = "variable byte integer"
    UTF8 = "UTF-8 string"
    BINARY = "binary data"
    UTF8_PAIR = "UTF-8 string pair"


# value checks beyond the type
BOOLEAN = "0 or 1"
NONZERO = "not 0"
# Topic Alias 0 may not be sent (MQTT-3.3.2-8), but a receiver answers it with
# DISCONNECT 0x94, not 0x82: the session checks it, the decoder lets it through
NONZERO_WHEN_SENT = "not 0 when sent"
QOS_0_OR_1 = "0 or 1 (a Maximum QoS)"

WILL = "WILL"  # the Will Properties of a CONNECT payload carry properties of their own
_ACKS = ("PUBACK", "PUBREC", "PUBREL", "PUBCOMP")
_EVERY_PACKET = ("CONNECT", "CONNACK", "PUBLISH", WILL, *_ACKS, "SUBSCRIBE", "SUBACK", "UNSUBSCRIBE", "UNSUBACK",
                 "DISCONNECT", "AUTH")


class PropertySpec(NamedTuple):
    identifier: int
    name: str  # the field of Properties
    kind: Kind
    carriers: frozenset[str]
    check: str | None = None


def _spec(identifier: int, name: str, kind: Kind, carriers: tuple[str, ...], check: str | None = None) -> PropertySpec:
    return PropertySpec(identifier, name, kind, frozenset(carriers), check)


PROPERTIES: tuple[PropertySpec, ...] = (
    _spec(0x01, "payload_format_indicator", Kind.BYTE, ("PUBLISH", WILL), BOOLEAN),
    _spec(0x02, "message_expiry_interval", Kind.FOUR_BYTE, ("PUBLISH", WILL)),
    _spec(0x03, "content_type", Kind.UTF8, ("PUBLISH", WILL)),
    _spec(0x08, "response_topic", Kind.UTF8, ("PUBLISH", WILL)),
    _spec(0x09, "correlation_data", Kind.BINARY, ("PUBLISH", WILL)),
    _spec(0x0B, "subscription_identifiers", Kind.VARINT, ("PUBLISH", "SUBSCRIBE"), NONZERO),
    _spec(0x11, "session_expiry_interval", Kind.FOUR_BYTE, ("CONNECT", "CONNACK", "DISCONNECT")),
    _spec(0x12, "assigned_client_identifier", Kind.UTF8, ("CONNACK",)),
    _spec(0x13, "server_keep_alive", Kind.TWO_BYTE, ("CONNACK",)),
    _spec(0x15, "authentication_method", Kind.UTF8, ("CONNECT", "CONNACK", "AUTH")),
    _spec(0x16, "authentication_data", Kind.BINARY, ("CONNECT", "CONNACK", "AUTH")),
    _spec(0x17, "request_problem_information", Kind.BYTE, ("CONNECT",), BOOLEAN),
    _spec(0x18, "will_delay_interval", Kind.FOUR_BYTE, (WILL,)),
    _spec(0x19, "request_response_information", Kind.BYTE, ("CONNECT",), BOOLEAN),
    _spec(0x1A, "response_information", Kind.UTF8, ("CONNACK",)),
    _spec(0x1C, "server_reference", Kind.UTF8, ("CONNACK", "DISCONNECT")),
    _spec(0x1F, "reason_string", Kind.UTF8, ("CONNACK", *_ACKS, "SUBACK", "UNSUBACK", "DISCONNECT", "AUTH")),
    _spec(0x21, "receive_maximum", Kind.TWO_BYTE, ("CONNECT", "CONNACK"), NONZERO),
    _spec(0x22, "topic_alias_maximum", Kind.TWO_BYTE, ("CONNECT", "CONNACK")),
    _spec(0x23, "topic_alias", Kind.TWO_BYTE, ("PUBLISH",), NONZERO_WHEN_SENT),
    _spec(0x24, "maximum_qos", Kind.BYTE, ("CONNACK",), QOS_0_OR_1),
    _spec(0x25, "retain_available", Kind.BYTE, ("CONNACK",), BOOLEAN),
    _spec(0x26, "user_properties", Kind.UTF8_PAIR, _EVERY_PACKET),
    _spec(0x27, "maximum_packet_size", Kind.FOUR_BYTE, ("CONNECT", "CONNACK"), NONZERO),
    _spec(0x28, "wildcard_subscription_available", Kind.BYTE, ("CONNACK",), BOOLEAN),
    _spec(0x29, "subscription_identifier_available", Kind.BYTE, ("CONNACK",), BOOLEAN),
    _spec(0x2A, "shared_subscription_available", Kind.BYTE, ("CONNACK",), BOOLEAN),
)
BY_IDENTIFIER = {p.identifier: p for p in PROPERTIES}
BY_NAME = {p.name: p for p in PROPERTIES}
# Properties that may appear more than once, and where (§2.2.2.2, §3.8.2.1.2).
REPEATABLE = {"user_properties": None, "subscription_identifiers": frozenset({"PUBLISH"})}


@dataclass(frozen=True, slots=True, repr=False)
class Properties:
    """The properties of one packet; None (or empty) where absent."""

    payload_format_indicator: int | None = None
    message_expiry_interval: int | None = None
    content_type: str | None = None
    response_topic: str | None = None
    correlation_data: bytes | None = None
    subscription_identifiers: tuple[int, ...] = ()
    session_expiry_interval: int | None = None
    assigned_client_identifier: str | None = None
    server_keep_alive: int | None = None
    authentication_method: str | None = None
    authentication_data: bytes | None = None
    request_problem_information: int | None = None
    will_delay_interval: int | None = None
    request_response_information: int | None = None
    response_information: str | None = None
    server_reference: str | None = None
    reason_string: str | None = None
    receive_maximum: int | None = None
    topic_alias_maximum: int | None = None
    topic_alias: int | None = None
    maximum_qos: int | None = None
    retain_available: int | None = None
    user_properties: tuple[tuple[str, str], ...] = ()
    maximum_packet_size: int | None = None
    wildcard_subscription_available: int | None = None
    subscription_identifier_available: int | None = None
    shared_subscription_available: int | None = None

    def present(self) -> dict[str, Any]:
        """The properties that are set, by field name."""
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None and v != ()}

    def __bool__(self) -> bool:
        return bool(self.present())

    def __repr__(self) -> str:
        return "Properties(" + ", ".join(f"{k}={v!r}" for k, v in self.present().items()) + ")"


NO_PROPERTIES = Properties()

_LIMITS = {Kind.BYTE: 0xFF, Kind.TWO_BYTE: 0xFFFF, Kind.FOUR_BYTE: 0xFFFF_FFFF, Kind.VARINT: MAX_VARINT}


def _check_value(spec: PropertySpec, value: int, sending: bool = False) -> bool:
    if spec.check == BOOLEAN or spec.check == QOS_0_OR_1:
        return value in (0, 1)
    if spec.check == NONZERO or (sending and spec.check == NONZERO_WHEN_SENT):
        return value != 0
    return True


def _encode_value(spec: PropertySpec, value: Any) -> bytes:
    kind = spec.kind
    if kind in _LIMITS:
        if not isinstance(value, int) or not 0 <= value <= _LIMITS[kind] or not _check_value(spec, value, True):
            raise ValueError(f"property {spec.name}={value!r} is not a valid {kind.value} ({spec.check or 'in range'})")
        if kind is Kind.VARINT:
            return varint(value)
        return {Kind.BYTE: u8, Kind.TWO_BYTE: u16, Kind.FOUR_BYTE: u32}[kind](value)
    if kind is Kind.UTF8:
        return utf8(value, spec.name)
    if kind is Kind.BINARY:
        return binary(value)
    key, val = value
    return utf8(key, "user property name") + utf8(val, "user property value")


def encode_properties(props: Properties, carrier: str) -> bytes:
    """The Property Length and the properties, for a packet of type ``carrier``."""
    body = bytearray()
    for spec in PROPERTIES:
        value = getattr(props, spec.name)
        if value is None or value == ():
            continue
        if carrier not in spec.carriers:
            raise ValueError(f"a {carrier} packet may not carry the property {spec.name}")
        values = value if spec.name in REPEATABLE else (value,)
        if spec.name == "subscription_identifiers" and carrier != "PUBLISH" and len(values) > 1:
            raise ValueError(f"a {carrier} packet carries at most one subscription identifier")
        for one in values:
            body += varint(spec.identifier) + _encode_value(spec, one)
    return varint(len(body)) + bytes(body)


def _decode_value(spec: PropertySpec, reader: Reader) -> Any:
    kind = spec.kind
    what = f"property {spec.name}"
    if kind is Kind.BYTE:
        value = reader.u8(what)
    elif kind is Kind.TWO_BYTE:
        value = reader.u16(what)
    elif kind is Kind.FOUR_BYTE:
        value = reader.u32(what)
    elif kind is Kind.VARINT:
        value = reader.varint(what)
    elif kind is Kind.UTF8:
        return reader.utf8(what)
    elif kind is Kind.BINARY:
        return reader.binary(what)
    else:
        return reader.utf8("user property name"), reader.utf8("user property value")
    if not _check_value(spec, value):
        raise ProtocolViolation(f"{what} is {value}; it must be {spec.check}")
    return value


def decode_properties(reader: Reader, carrier: str) -> Properties:
    """Read a Property Length and the properties after it, for a packet of type ``carrier``."""
    block = reader.sub(reader.varint("property length"), "the properties")
    values: dict[str, Any] = {}
    while block.remaining:
        identifier = block.varint("property identifier")
        spec = BY_IDENTIFIER.get(identifier)
        if spec is None or carrier not in spec.carriers:
            name = spec.name if spec else f"0x{identifier:02X}"
            raise MalformedPacket(f"a {carrier} packet may not carry the property {name}")
        value = _decode_value(spec, block)
        if spec.name in REPEATABLE:
            where = REPEATABLE[spec.name]
            if where is not None and carrier not in where and spec.name in values:
                raise ProtocolViolation(f"a {carrier} packet carries the property {spec.name} more than once")
            values[spec.name] = values.get(spec.name, ()) + (value,)
        elif spec.name in values:
            raise ProtocolViolation(f"a {carrier} packet carries the property {spec.name} more than once")
        else:
            values[spec.name] = value
    return Properties(**values) if values else NO_PROPERTIES
