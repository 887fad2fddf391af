"""MQTT reason codes, which packet may carry which, and the errors that carry one.

A decoding or session error knows the reason code the standard wants the
server to answer with (MQTT 5.0 §2.4, §4.13): the session turns it into a
CONNACK or DISCONNECT for a 5.0 client, or just a closed connection for a
3.1.1 client, which has no such packets.
"""

from __future__ import annotations

from enum import IntEnum


class ReasonCode(IntEnum):
    SUCCESS = 0x00
    NORMAL_DISCONNECTION = 0x00
    GRANTED_QOS_0 = 0x00
    GRANTED_QOS_1 = 0x01
    GRANTED_QOS_2 = 0x02
    DISCONNECT_WITH_WILL_MESSAGE = 0x04
    NO_MATCHING_SUBSCRIBERS = 0x10
    NO_SUBSCRIPTION_EXISTED = 0x11
    CONTINUE_AUTHENTICATION = 0x18
    RE_AUTHENTICATE = 0x19
    UNSPECIFIED_ERROR = 0x80
    MALFORMED_PACKET = 0x81
    PROTOCOL_ERROR = 0x82
    IMPLEMENTATION_SPECIFIC_ERROR = 0x83
    UNSUPPORTED_PROTOCOL_VERSION = 0x84
    CLIENT_IDENTIFIER_NOT_VALID = 0x85
    BAD_USER_NAME_OR_PASSWORD = 0x86
    NOT_AUTHORIZED = 0x87
    SERVER_UNAVAILABLE = 0x88
    SERVER_BUSY = 0x89
    BANNED = 0x8A
    SERVER_SHUTTING_DOWN = 0x8B
    BAD_AUTHENTICATION_METHOD = 0x8C
    KEEP_ALIVE_TIMEOUT = 0x8D
    SESSION_TAKEN_OVER = 0x8E
    TOPIC_FILTER_INVALID = 0x8F
    TOPIC_NAME_INVALID = 0x90
    PACKET_IDENTIFIER_IN_USE = 0x91
    PACKET_IDENTIFIER_NOT_FOUND = 0x92
    RECEIVE_MAXIMUM_EXCEEDED = 0x93
    TOPIC_ALIAS_INVALID = 0x94
    PACKET_TOO_LARGE = 0x95
    MESSAGE_RATE_TOO_HIGH = 0x96
    QUOTA_EXCEEDED = 0x97
    ADMINISTRATIVE_ACTION = 0x98
    PAYLOAD_FORMAT_INVALID = 0x99
    RETAIN_NOT_SUPPORTED = 0x9A
    QOS_NOT_SUPPORTED = 0x9B
    USE_ANOTHER_SERVER = 0x9C
    SERVER_MOVED = 0x9D
    SHARED_SUBSCRIPTIONS_NOT_SUPPORTED = 0x9E
    CONNECTION_RATE_EXCEEDED = 0x9F
    MAXIMUM_CONNECT_TIME = 0xA0
    SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED = 0xA1
    WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED = 0xA2


def _codes(*values: int) -> frozenset[int]:
    return frozenset(values)


_PUBLISH_RESPONSE = _codes(0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99)
_RELEASE = _codes(0x00, 0x92)

# MQTT 5.0: the reason codes each packet may carry (§3.2.2.2, §3.4.2.1 …, §3.15.2.1).
REASONS_V5: dict[str, frozenset[int]] = {
    "CONNACK": _codes(0x00, 0x80, 0x81, 0x82, 0x83, 0x84, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8A, 0x8C,
                      0x90, 0x95, 0x97, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9F),
    "PUBACK": _PUBLISH_RESPONSE,
    "PUBREC": _PUBLISH_RESPONSE,
    "PUBREL": _RELEASE,
    "PUBCOMP": _RELEASE,
    "SUBACK": _codes(0x00, 0x01, 0x02, 0x80, 0x83, 0x87, 0x8F, 0x91, 0x97, 0x9E, 0xA1, 0xA2),
    "UNSUBACK": _codes(0x00, 0x11, 0x80, 0x83, 0x87, 0x8F, 0x91),
    "DISCONNECT": _codes(0x00, 0x04, 0x80, 0x81, 0x82, 0x83, 0x87, 0x89, 0x8B, 0x8D, 0x8E, 0x8F, 0x90,
                         0x93, 0x94, 0x95, 0x96, 0x97, 0x98, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9E, 0x9F,
                         0xA0, 0xA1, 0xA2),
    "AUTH": _codes(0x00, 0x18, 0x19),
}

# MQTT 3.1.1: CONNACK return codes (§3.2.2.3) and SUBACK return codes (§3.9.3).
CONNACK_RETURN_CODES_V311 = _codes(0, 1, 2, 3, 4, 5)
SUBACK_RETURN_CODES_V311 = _codes(0x00, 0x01, 0x02, 0x80)

UNACCEPTABLE_PROTOCOL_VERSION_V311 = 0x01
IDENTIFIER_REJECTED_V311 = 0x02
SERVER_UNAVAILABLE_V311 = 0x03

# A 5.0 refusal said to a 3.1.1 client: the nearest of its six return codes.
_V311_REFUSAL = {
    0x84: UNACCEPTABLE_PROTOCOL_VERSION_V311,
    0x85: IDENTIFIER_REJECTED_V311,
    0x86: 0x04,
    0x8C: 0x04,
    0x87: 0x05,
    0x8A: 0x05,
}


def connack_code_v311(reason: int) -> int:
    if reason == ReasonCode.SUCCESS:
        return 0
    return _V311_REFUSAL.get(reason, SERVER_UNAVAILABLE_V311)


def describe(code: int) -> str:
    try:
        return f"0x{code:02X} {ReasonCode(code).name}"
    except ValueError:
        return f"0x{code:02X}"


class MqttError(ValueError):
    """The peer broke a rule; ``reason_code`` is what the standard says to answer with."""

    reason_code: int = ReasonCode.UNSPECIFIED_ERROR

    def __init__(self, message: str, reason_code: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if reason_code is not None:
            self.reason_code = reason_code
        # The protocol level of the CONNECT being decoded, once it is known, so a
        # malformed 5.0 CONNECT can still be answered with a 5.0 CONNACK.
        self.protocol_level: int | None = None

    def __str__(self) -> str:
        return f"{self.message} ({describe(self.reason_code)})"


class MalformedPacket(MqttError):
    reason_code = ReasonCode.MALFORMED_PACKET


class ProtocolViolation(MqttError):
    reason_code = ReasonCode.PROTOCOL_ERROR


class PacketTooLarge(MqttError):
    reason_code = ReasonCode.PACKET_TOO_LARGE


class UnsupportedProtocolVersion(MqttError):
    """A CONNECT whose protocol name or level this server does not speak."""

    reason_code = ReasonCode.UNSUPPORTED_PROTOCOL_VERSION

    def __init__(self, protocol_name: str, protocol_level: int) -> None:
        super().__init__(f"protocol {protocol_name!r} level {protocol_level} is not MQTT 3.1.1 or 5.0")
        self.protocol_name = protocol_name
        self.protocol_level = protocol_level
