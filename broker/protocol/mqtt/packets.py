"""The fifteen MQTT control packets as plain values, for MQTT 3.1.1 and 5.0.

One class per packet; the codec (``mqtt/codec``) turns them into bytes and
back. Properties are ignored by nothing: a 3.1.1 packet must carry none (the
encoder refuses), and a 5.0 packet carries the ones its type allows.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import ClassVar, Union

from fencemq.protocol.mqtt.properties import NO_PROPERTIES, Properties

MQTT_311 = 4  # the Protocol Level byte of MQTT 3.1.1
MQTT_5 = 5
PROTOCOL_NAME = "MQTT"


class PacketType(IntEnum):
    CONNECT = 1
    CONNACK = 2
    PUBLISH = 3
    PUBACK = 4
    PUBREC = 5
    PUBREL = 6
    PUBCOMP = 7
    SUBSCRIBE = 8
    SUBACK = 9
    UNSUBSCRIBE = 10
    UNSUBACK = 11
    PINGREQ = 12
    PINGRESP = 13
    DISCONNECT = 14
    AUTH = 15


class RetainHandling(IntEnum):
    SEND_AT_SUBSCRIBE = 0
    SEND_IF_NEW_SUBSCRIPTION = 1
    DO_NOT_SEND = 2


# Packets a client sends to a server; the others only a server sends (DISCONNECT,
# AUTH, PUBLISH and its acknowledgements go both ways).
CLIENT_TO_SERVER = frozenset({
    PacketType.CONNECT, PacketType.PUBLISH, PacketType.PUBACK, PacketType.PUBREC, PacketType.PUBREL,
    PacketType.PUBCOMP, PacketType.SUBSCRIBE, PacketType.UNSUBSCRIBE, PacketType.PINGREQ, PacketType.DISCONNECT,
    PacketType.AUTH,
})


@dataclass(frozen=True, slots=True)
class Will:
    topic: str
    payload: bytes = b""
    qos: int = 0
    retain: bool = False
    properties: Properties = NO_PROPERTIES  # may carry will_delay_interval and the message properties


@dataclass(frozen=True, slots=True)
class Connect:
    packet_type: ClassVar[PacketType] = PacketType.CONNECT
    client_id: str = ""
    protocol_level: int = MQTT_5
    clean_start: bool = True  # Clean Session in 3.1.1
    keep_alive: int = 0
    username: str | None = None
    password: bytes | None = None
    will: Will | None = None
    properties: Properties = NO_PROPERTIES
    protocol_name: str = PROTOCOL_NAME


@dataclass(frozen=True, slots=True)
class Connack:
    packet_type: ClassVar[PacketType] = PacketType.CONNACK
    reason_code: int = 0  # the Return Code in 3.1.1
    session_present: bool = False
    properties: Properties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class Publish:
    packet_type: ClassVar[PacketType] = PacketType.PUBLISH
    topic: str
    payload: bytes = b""
    qos: int = 0
    retain: bool = False
    dup: bool = False
    packet_id: int | None = None  # set exactly when qos > 0
    properties: Properties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class _PublishResponse:
    """PUBACK, PUBREC, PUBREL and PUBCOMP share one layout (§3.4 … §3.7); they differ by type."""

    packet_type: ClassVar[PacketType]
    packet_id: int
    reason_code: int = 0
    properties: Properties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class Puback(_PublishResponse):
    packet_type: ClassVar[PacketType] = PacketType.PUBACK


@dataclass(frozen=True, slots=True)
class Pubrec(_PublishResponse):
    packet_type: ClassVar[PacketType] = PacketType.PUBREC


@dataclass(frozen=True, slots=True)
class Pubrel(_PublishResponse):
    packet_type: ClassVar[PacketType] = PacketType.PUBREL


@dataclass(frozen=True, slots=True)
class Pubcomp(_PublishResponse):
    packet_type: ClassVar[PacketType] = PacketType.PUBCOMP


@dataclass(frozen=True, slots=True)
class SubscriptionOptions:
    """The Subscription Options byte (§3.8.3.1); only ``qos`` exists in 3.1.1."""

    qos: int = 0
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = RetainHandling.SEND_AT_SUBSCRIBE


@dataclass(frozen=True, slots=True)
class Subscribe:
    packet_type: ClassVar[PacketType] = PacketType.SUBSCRIBE
    packet_id: int
    subscriptions: tuple[tuple[str, SubscriptionOptions], ...]
    properties: Properties = NO_PROPERTIES  # subscription_identifiers (at most one), user_properties


@dataclass(frozen=True, slots=True)
class Suback:
    packet_type: ClassVar[PacketType] = PacketType.SUBACK
    packet_id: int
    reason_codes: tuple[int, ...]
    properties: Properties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class Unsubscribe:
    packet_type: ClassVar[PacketType] = PacketType.UNSUBSCRIBE
    packet_id: int
    filters: tuple[str, ...]
    properties: Properties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class Unsuback:
    packet_type: ClassVar[PacketType] = PacketType.UNSUBACK
    packet_id: int
    reason_codes: tuple[int, ...] = ()  # none in 3.1.1
    properties: Properties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class Pingreq:
    packet_type: ClassVar[PacketType] = PacketType.PINGREQ


@dataclass(frozen=True, slots=True)
class Pingresp:
    packet_type: ClassVar[PacketType] = PacketType.PINGRESP


@dataclass(frozen=True, slots=True)
class Disconnect:
    packet_type: ClassVar[PacketType] = PacketType.DISCONNECT
    reason_code: int = 0
    properties: Properties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class Auth:
    packet_type: ClassVar[PacketType] = PacketType.AUTH
    reason_code: int = 0
    properties: Properties = NO_PROPERTIES


Packet = Union[Connect, Connack, Publish, Puback, Pubrec, Pubrel, Pubcomp, Subscribe, Suback, Unsubscribe,
               Unsuback, Pingreq, Pingresp, Disconnect, Auth]
PublishResponse = Union[Puback, Pubrec, Pubrel, Pubcomp]
PUBLISH_RESPONSES: dict[PacketType, type] = {
    PacketType.PUBACK: Puback, PacketType.PUBREC: Pubrec, PacketType.PUBREL: Pubrel, PacketType.PUBCOMP: Pubcomp,
}
