"""SUBSCRIBE and UNSUBSCRIBE awaiting the shell's answer, and the SUBACK/UNSUBACK that answer them.

The session hands each request up as an event; the shell subscribes (or
refuses, per filter) and completes it. The acknowledgement carries one reason
code per filter, in order (MQTT-3.8.4-6, MQTT-3.11.3-1), and is checked
against what was asked: a refused filter is never granted, a granted QoS is
never above the one requested or the server's maximum.
"""

from __future__ import annotations

from typing import Sequence

from fencemq.protocol.mqtt.events import MqttServerLimits, SubscribeRequested, UnsubscribeRequested
from fencemq.protocol.mqtt.packets import MQTT_311, Suback, Subscribe, Unsuback, Unsubscribe
from fencemq.protocol.mqtt.reasons import REASONS_V5, MqttError, ProtocolViolation, ReasonCode
from fencemq.protocol.mqtt.validation import subscription_request


class PendingRequests:
    __slots__ = ("limits", "protocol_level", "subscribing", "unsubscribing")

    def __init__(self, limits: MqttServerLimits, protocol_level: int) -> None:
        self.limits = limits
        self.protocol_level = protocol_level
        self.subscribing: dict[int, SubscribeRequested] = {}
        self.unsubscribing: dict[int, UnsubscribeRequested] = {}

    def on_subscribe(self, packet: Subscribe) -> SubscribeRequested | Suback:
        """The request to hand up, or (5.0) the SUBACK 0x91 for an identifier still awaiting its SUBACK."""
        ids = packet.properties.subscription_identifiers
        if ids and not self.limits.subscription_identifier_available:
            raise MqttError("a subscription identifier, and this server announced none",
                            ReasonCode.SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED)
        if packet.packet_id in self.subscribing:
            self._identifier_in_use("SUBSCRIBE", packet.packet_id)
            return Suback(packet.packet_id, (ReasonCode.PACKET_IDENTIFIER_IN_USE,) * len(packet.subscriptions))
        requests = tuple(subscription_request(topic_filter, options, self.limits, self.protocol_level)
                         for topic_filter, options in packet.subscriptions)
        event = SubscribeRequested(packet.packet_id, requests, ids[0] if ids else None,
                                   packet.properties.user_properties)
        self.subscribing[packet.packet_id] = event
        return event

    def on_unsubscribe(self, packet: Unsubscribe) -> UnsubscribeRequested | Unsuback:
        if packet.packet_id in self.unsubscribing:
            self._identifier_in_use("UNSUBSCRIBE", packet.packet_id)
            return Unsuback(packet.packet_id, (ReasonCode.PACKET_IDENTIFIER_IN_USE,) * len(packet.filters))
        event = UnsubscribeRequested(packet.packet_id, packet.filters, packet.properties.user_properties)
        self.unsubscribing[packet.packet_id] = event
        return event

    def _identifier_in_use(self, kind: str, packet_id: int) -> None:
        if self.protocol_level == MQTT_311:  # no reason code to say it with: a protocol violation
            raise ProtocolViolation(f"{kind} {packet_id} reuses an identifier awaiting its acknowledgement "
                                    "(MQTT-2.2.1-3)")

    def suback(self, packet_id: int, reason_codes: Sequence[int] | None) -> Suback:
        try:
            request = self.subscribing.pop(packet_id)
        except KeyError:
            raise ValueError(f"no SUBSCRIBE {packet_id} awaits its SUBACK") from None
        codes = request.default_reason_codes() if reason_codes is None else tuple(reason_codes)
        if len(codes) != len(request.requests):
            self.subscribing[packet_id] = request
            raise ValueError(f"{len(codes)} reason codes for {len(request.requests)} topic filters")
        for code, entry in zip(codes, request.requests):
            if code not in REASONS_V5["SUBACK"] or code < 0x80 and (entry.refusal is not None
                                                                     or code > entry.granted_qos):
                self.subscribing[packet_id] = request
                raise ValueError(f"cannot answer 0x{code:02X} to {entry.topic_filter!r}")
        if self.protocol_level == MQTT_311:
            codes = tuple(code if code < 0x80 else 0x80 for code in codes)
        return Suback(packet_id, codes)

    def unsuback(self, packet_id: int, reason_codes: Sequence[int] | None) -> Unsuback:
        try:
            request = self.unsubscribing.pop(packet_id)
        except KeyError:
            raise ValueError(f"no UNSUBSCRIBE {packet_id} awaits its UNSUBACK") from None
        if self.protocol_level == MQTT_311:
            return Unsuback(packet_id)
        codes = (ReasonCode.SUCCESS,) * len(request.filters) if reason_codes is None else tuple(reason_codes)
        if len(codes) != len(request.filters) or not set(codes) <= REASONS_V5["UNSUBACK"]:
            self.unsubscribing[packet_id] = request
            raise ValueError(f"reason codes {codes!r} for the topic filters {request.filters!r}")
        return Unsuback(packet_id, codes)
