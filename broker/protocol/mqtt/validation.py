"""The rules a server applies to what a client asks: CONNECT, topic names, subscriptions.

Pure functions over packets and ``MqttServerLimits``. A refusal raises an
``MqttError`` whose reason code the session sends (CONNACK, SUBACK or
DISCONNECT, by where it happened). Topic names and filters follow FenceMQ's
one topic space, ``fencemq.model.topics``.
"""

from __future__ import annotations

from dataclasses import replace

from fencemq.errors import BadArgument
from fencemq.model.topics import check_topic_name, has_wildcard, parse_target
from fencemq.protocol.mqtt.events import SESSION_NEVER_EXPIRES, ConnectRequested, MqttServerLimits, SubscriptionRequest
from fencemq.protocol.mqtt.packets import MQTT_5, Connack, Connect, SubscriptionOptions
from fencemq.protocol.mqtt.properties import NO_PROPERTIES, Properties
from fencemq.protocol.mqtt.reasons import MqttError, ProtocolViolation, ReasonCode
from fencemq.protocol.mqtt.stream import MAX_PACKET_SIZE


class ConnectRefused(MqttError):
    """A well-formed CONNECT this server will not accept; answered by a CONNACK with ``reason_code``."""


def check_published_topic(topic: str) -> str:
    try:
        return check_topic_name(topic)
    except BadArgument as exc:
        raise MqttError(f"PUBLISH topic: {exc.message} (MQTT-3.3.2-2, MQTT-4.7.3-1)",
                        ReasonCode.TOPIC_NAME_INVALID) from None


def validate_connect(connect: Connect, limits: MqttServerLimits) -> ConnectRequested:
    """What a valid CONNECT asks for, as granted; ConnectRefused when it cannot be."""
    v5 = connect.protocol_level == MQTT_5
    props = connect.properties
    if props.authentication_method is not None:
        raise ConnectRefused(f"authentication method {props.authentication_method!r} is not supported "
                             "(no enhanced authentication)", ReasonCode.BAD_AUTHENTICATION_METHOD)
    client_id, assigned = connect.client_id, False
    if not client_id:
        if not v5 and not connect.clean_start:
            raise ConnectRefused("an empty client identifier needs Clean Session 1 in MQTT 3.1.1 (3.1.1: MQTT-3.1.3-8)",
                                 ReasonCode.CLIENT_IDENTIFIER_NOT_VALID)
        client_id, assigned = limits.assign_client_id(), True
    elif len(client_id.encode()) > limits.maximum_client_id_bytes:
        raise ConnectRefused(f"client identifier longer than {limits.maximum_client_id_bytes} bytes",
                             ReasonCode.CLIENT_IDENTIFIER_NOT_VALID)
    will = connect.will
    if will is not None:
        try:
            check_topic_name(will.topic)
        except BadArgument as exc:
            raise ConnectRefused(f"will topic: {exc.message}", ReasonCode.TOPIC_NAME_INVALID) from None
        if will.qos > limits.maximum_qos:
            raise ConnectRefused(f"will QoS {will.qos} is over the server's maximum {limits.maximum_qos} "
                                 "(MQTT-3.2.2-12)", ReasonCode.QOS_NOT_SUPPORTED)
        if will.retain and not limits.retain_available:
            raise ConnectRefused("a retained will, and this server keeps no retained messages (MQTT-3.2.2-13)",
                                 ReasonCode.RETAIN_NOT_SUPPORTED)
    if v5:
        asked_expiry = props.session_expiry_interval or 0
        keep_alive = limits.server_keep_alive if limits.server_keep_alive is not None else connect.keep_alive
    else:
        asked_expiry = 0 if connect.clean_start else SESSION_NEVER_EXPIRES
        keep_alive = connect.keep_alive
    return ConnectRequested(
        client_id=client_id, client_id_assigned=assigned, clean_start=connect.clean_start,
        session_expiry_interval=cap_session_expiry(asked_expiry, limits), keep_alive=keep_alive,
        username=connect.username, password=connect.password, will=will, protocol_level=connect.protocol_level,
        properties=props)


def cap_session_expiry(asked: int, limits: MqttServerLimits) -> int:
    cap = limits.maximum_session_expiry_interval
    return asked if cap is None else min(asked, cap)


def connack_properties(request: ConnectRequested, limits: MqttServerLimits) -> Properties:
    """The 5.0 CONNACK properties: only what differs from what the client may assume (§3.2.2.3)."""
    asked_expiry = request.properties.session_expiry_interval or 0
    return Properties(
        session_expiry_interval=(request.session_expiry_interval
                                 if request.session_expiry_interval != asked_expiry else None),
        receive_maximum=limits.receive_maximum if limits.receive_maximum != 0xFFFF else None,
        maximum_qos=limits.maximum_qos if limits.maximum_qos < 2 else None,
        retain_available=None if limits.retain_available else 0,
        maximum_packet_size=limits.maximum_packet_size if limits.maximum_packet_size < MAX_PACKET_SIZE else None,
        assigned_client_identifier=request.client_id if request.client_id_assigned else None,
        topic_alias_maximum=limits.topic_alias_maximum or None,
        wildcard_subscription_available=None if limits.wildcard_subscription_available else 0,
        subscription_identifier_available=None if limits.subscription_identifier_available else 0,
        shared_subscription_available=None if limits.shared_subscription_available else 0,
        server_keep_alive=limits.server_keep_alive,
    )


def accepting_connack(request: ConnectRequested, limits: MqttServerLimits, session_present: bool,
                      user_properties: tuple[tuple[str, str], ...] = ()) -> Connack:
    if session_present and request.clean_start:
        raise ValueError("a Clean Start session is never present (MQTT-3.2.2-2)")
    if request.protocol_level != MQTT_5:
        return Connack(ReasonCode.SUCCESS, session_present, NO_PROPERTIES)
    props = connack_properties(request, limits)
    return Connack(ReasonCode.SUCCESS, session_present,
                   replace(props, user_properties=user_properties) if user_properties else props)


def subscription_request(topic_filter: str, options: SubscriptionOptions, limits: MqttServerLimits,
                         protocol_level: int) -> SubscriptionRequest:
    """One SUBSCRIBE entry, as this server would grant it; a refusal travels in the request.

    A No Local shared subscription is a protocol error for the whole connection
    (MQTT-3.8.3-4), not a per-filter refusal: it raises.
    """
    refusal: int | None = None
    share: str | None = None
    plain = topic_filter
    try:
        target = parse_target(topic_filter)
        plain, share = target.filter, target.share
    except BadArgument:
        refusal = ReasonCode.TOPIC_FILTER_INVALID
    if share is not None and options.no_local:
        raise ProtocolViolation(f"No Local on the shared subscription {topic_filter!r} (MQTT-3.8.3-4)")
    if refusal is None and share is not None and not limits.shared_subscription_available:
        refusal = ReasonCode.SHARED_SUBSCRIPTIONS_NOT_SUPPORTED
    if refusal is None and has_wildcard(plain) and not limits.wildcard_subscription_available:
        refusal = ReasonCode.WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED
    if refusal is not None and protocol_level != MQTT_5:
        refusal = ReasonCode.UNSPECIFIED_ERROR  # 3.1.1 has one failure code, 0x80
    return SubscriptionRequest(topic_filter, plain, share, options, refusal, min(options.qos, limits.maximum_qos))


def message_properties(props: Properties) -> Properties:
    """A PUBLISH's properties as the message carries them on: without its Topic Alias."""
    return replace(props, topic_alias=None) if props.topic_alias is not None else props
