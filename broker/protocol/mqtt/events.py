"""What an MQTT server session tells its shell, and the limits the shell gives it.

The session (``mqtt/session``) knows MQTT, not FenceMQ: it says "the client
published X", "the client wants these subscriptions", "the client acknowledged
delivery n", "the connection is over, and here is the will"; the shell maps
those onto fences and answers with commands on the session.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Callable, Literal, Union

from fencemq.protocol.mqtt.packets import SubscriptionOptions, Will
from fencemq.protocol.mqtt.properties import NO_PROPERTIES, Properties

SESSION_NEVER_EXPIRES = 0xFFFF_FFFF  # MQTT 5.0 §3.1.2.11.2; also what a 3.1.1 Clean Session 0 means


def random_client_id() -> str:
    return "fencemq-" + secrets.token_hex(8)


@dataclass(frozen=True, slots=True)
class MqttServerLimits:
    """What this server accepts and announces (5.0: in the CONNACK properties)."""

    maximum_packet_size: int = 1024 * 1024  # inbound; a larger packet is 0x95
    # The first packet, the CONNECT, before any authentication (None: maximum_packet_size); larger
    # closes the connection from its fixed header (5.0: CONNACK 0x95), before its body is read
    maximum_connect_size: int | None = None
    receive_maximum: int = 1024  # inbound QoS 1/2 publishes the client may have unacknowledged
    topic_alias_maximum: int = 64  # inbound topic aliases the client may use (0: none)
    maximum_qos: int = 2
    retain_available: bool = True
    wildcard_subscription_available: bool = True
    subscription_identifier_available: bool = True
    shared_subscription_available: bool = True
    server_keep_alive: int | None = None  # 5.0: overrides the client's Keep Alive
    maximum_session_expiry_interval: int | None = None  # None: grant what the client asks
    maximum_client_id_bytes: int = 0xFFFF  # any identifier MQTT allows (mqtt/client_ids.py names its session)
    connect_timeout: float = 10.0  # seconds from the connection to an accepted CONNECT
    maximum_inflight: int = 0xFFFF  # outbound QoS 1/2 deliveries in flight, under the client's Receive Maximum
    outbound_topic_aliases: bool = True  # use the aliases a 5.0 client allows
    assign_client_id: Callable[[], str] = field(default=random_client_id, compare=False)

    def __post_init__(self) -> None:
        if self.maximum_qos not in (0, 1, 2):
            raise ValueError(f"maximum_qos {self.maximum_qos} is not 0, 1 or 2")
        if not 1 <= self.receive_maximum <= 0xFFFF or not 0 <= self.topic_alias_maximum <= 0xFFFF:
            raise ValueError("receive_maximum is 1 … 65535 and topic_alias_maximum 0 … 65535")
        if not 1 <= self.maximum_inflight <= 0xFFFF:
            raise ValueError("maximum_inflight is 1 … 65535")
        if self.maximum_connect_size is not None and not 2 <= self.maximum_connect_size <= self.maximum_packet_size:
            raise ValueError("maximum_connect_size is 2 … maximum_packet_size")


@dataclass(frozen=True, slots=True)
class ConnectRequested:
    """A valid CONNECT; the shell checks the credentials and the session, then calls
    ``accept(session_present)`` or ``refuse(reason_code)``."""

    client_id: str
    client_id_assigned: bool  # the client sent an empty one (5.0: sent back in the CONNACK)
    clean_start: bool
    session_expiry_interval: int  # seconds, as granted; SESSION_NEVER_EXPIRES for ever
    keep_alive: int  # seconds, as it will be enforced (the server's, when it sets one); 0: none
    username: str | None
    password: bytes | None
    will: Will | None
    protocol_level: int
    properties: Properties = NO_PROPERTIES  # the CONNECT's own: user properties, request_* flags …


@dataclass(frozen=True, slots=True)
class MessagePublished:
    """The client published; for QoS 1/2 the shell stores it, then ``acknowledge_publish(packet_id)``."""

    topic: str
    payload: bytes
    qos: int
    retain: bool
    packet_id: int | None
    properties: Properties = NO_PROPERTIES  # message properties, topic alias resolved and removed
    dup: bool = False


@dataclass(frozen=True, slots=True)
class PublishReleased:
    """PUBREL: the client's QoS 2 publish ``packet_id`` is complete. The shell forgets the id where
    it keeps it, then answers with ``complete_release(packet_id)`` (PUBCOMP): a PUBCOMP sent before
    that could let a new publish with the id be taken for this one after a crash."""

    packet_id: int


@dataclass(frozen=True, slots=True)
class SubscriptionRequest:
    topic_filter: str  # as the client sent it
    filter: str  # without the $share/<group>/ prefix
    share_group: str | None
    options: SubscriptionOptions
    refusal: int | None = None  # a reason code >= 0x80 when the request cannot be granted as it stands
    granted_qos: int = 0  # the options' QoS, capped by the server's maximum QoS


@dataclass(frozen=True, slots=True)
class SubscribeRequested:
    """SUBSCRIBE; the shell subscribes, then ``complete_subscribe(packet_id, reason_codes)``."""

    packet_id: int
    requests: tuple[SubscriptionRequest, ...]
    subscription_identifier: int | None = None
    user_properties: tuple[tuple[str, str], ...] = ()

    def default_reason_codes(self) -> tuple[int, ...]:
        return tuple(r.refusal if r.refusal is not None else r.granted_qos for r in self.requests)


@dataclass(frozen=True, slots=True)
class UnsubscribeRequested:
    """UNSUBSCRIBE; the shell unsubscribes, then ``complete_unsubscribe(packet_id, reason_codes)``."""

    packet_id: int
    filters: tuple[str, ...]
    user_properties: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class DeliveryReceived:
    """PUBREC with success: QoS 2 delivery ``packet_id`` reached the client. The shell settles it for
    good, then answers with ``release_delivery(packet_id)`` (PUBREL). On a resumed session the
    shell resends it with ``resend_release(packet_id)``, not the message."""

    packet_id: int


@dataclass(frozen=True, slots=True)
class DeliveryAcknowledged:
    """Delivery ``packet_id`` is over: PUBACK (QoS 1), PUBCOMP (QoS 2), or a PUBREC with a
    reason code >= 0x80 (QoS 2, refused). A reason code >= 0x80 means the client refused it."""

    packet_id: int
    qos: int
    reason_code: int = 0
    properties: Properties = NO_PROPERTIES


Initiator = Literal["client", "server", "network"]


@dataclass(frozen=True, slots=True)
class ConnectionClosed:
    """The last event of every session: the shell closes the connection after sending ``outbound()``.

    ``will`` is the will to publish (after its Will Delay Interval, or when the
    session ends, MQTT-3.1.2-8), None when there is none or the client's
    DISCONNECT 0x00 deleted it. On a takeover the shell decides by the new
    connection's Clean Start (§3.1.3.2.2).
    """

    reason_code: int | None  # None: the network went away
    initiated_by: Initiator
    will: Will | None = None
    session_expiry_interval: int = 0
    taken_over: bool = False


@dataclass(frozen=True, slots=True)
class DeliveryResult:
    """What ``deliver`` did: sent with ``packet_id`` (None at QoS 0), or discarded because the
    packet is larger than the client's Maximum Packet Size (MQTT-3.1.2-28): settle it as delivered."""

    sent: bool
    packet_id: int | None = None


MqttEvent = Union[ConnectRequested, MessagePublished, PublishReleased, SubscribeRequested, UnsubscribeRequested,
                  DeliveryReceived, DeliveryAcknowledged, ConnectionClosed]
