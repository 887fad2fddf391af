"""The per-connection bookkeeping of QoS 1/2 flows and topic aliases, both directions.

``OutboundFlows``: the server's deliveries in flight, keyed by packet
identifier, bounded by the client's Receive Maximum (the send quota of §4.9);
an identifier is reused only after its flow ended (PUBACK, PUBCOMP, or a
PUBREC >= 0x80: MQTT-4.4.0-2 … §2.2.1). ``InboundFlows``: the client's QoS 1/2
publishes the server has not finished, bounded by the server's Receive
Maximum. ``InboundAliases``/``OutboundAliases``: topic alias maps, which live
and die with the connection (MQTT-3.3.2-7).
"""

from __future__ import annotations

from enum import Enum

from fencemq.protocol.mqtt.reasons import MqttError, ProtocolViolation, ReasonCode


class Outbound(Enum):
    AWAITING_PUBACK = "QoS 1 sent"
    AWAITING_PUBREC = "QoS 2 sent"
    RECEIVED = "QoS 2 received (PUBREC), the shell has not released it yet"
    AWAITING_PUBCOMP = "QoS 2 released"


class FlowControlBlocked(RuntimeError):
    """``deliver`` at QoS 1/2 with no send quota left: wait for an acknowledgement (MQTT-3.3.4-9)."""


class OutboundFlows:
    __slots__ = ("send_maximum", "inflight", "reserved", "_next_id")

    def __init__(self, send_maximum: int) -> None:
        self.send_maximum = send_maximum
        self.inflight: dict[int, Outbound] = {}
        # identifiers of deliveries a resumed session will send again: no new delivery takes them
        self.reserved: set[int] = set()
        self._next_id = 1

    def reserve(self, packet_ids: set[int] | list[int]) -> None:
        self.reserved.update(packet_ids)

    @property
    def quota(self) -> int:
        return self.send_maximum - len(self.inflight)

    def start(self, qos: int, packet_id: int | None, released: bool = False) -> int:
        """Put a delivery in flight: a fresh identifier, or the original one on redelivery."""
        if self.quota <= 0:
            raise FlowControlBlocked(f"{len(self.inflight)} deliveries in flight, the client's Receive Maximum")
        if packet_id is None:
            packet_id = self._allocate()
        elif not 1 <= packet_id <= 0xFFFF or packet_id in self.inflight:
            raise ValueError(f"packet identifier {packet_id} is not free to redeliver with")
        self.reserved.discard(packet_id)
        if released:
            self.inflight[packet_id] = Outbound.AWAITING_PUBCOMP
        else:
            self.inflight[packet_id] = Outbound.AWAITING_PUBACK if qos == 1 else Outbound.AWAITING_PUBREC
        return packet_id

    def abandon(self, packet_id: int) -> None:
        self.inflight.pop(packet_id, None)

    def _allocate(self) -> int:
        # round robin over 1 … 65535, so a just-freed identifier is the last to be reused
        for _ in range(0xFFFF):
            candidate = self._next_id
            self._next_id = candidate % 0xFFFF + 1
            if candidate not in self.inflight and candidate not in self.reserved:
                return candidate
        raise FlowControlBlocked("every packet identifier is in flight")

    def on_puback(self, packet_id: int) -> bool:
        """True when the PUBACK ends a QoS 1 delivery (an unknown one is ignored)."""
        if self.inflight.get(packet_id) is Outbound.AWAITING_PUBACK:
            del self.inflight[packet_id]
            return True
        return False

    def on_pubrec(self, packet_id: int, reason_code: int) -> str:
        """'received' (the shell releases it), 'refused' (flow over), 'again' (resend PUBREL),
        'pending' (the shell has not released it yet: its PUBREL will answer) or 'unknown'."""
        state = self.inflight.get(packet_id)
        if state is Outbound.AWAITING_PUBREC:
            if reason_code >= 0x80:
                del self.inflight[packet_id]
                return "refused"
            self.inflight[packet_id] = Outbound.RECEIVED
            return "received"
        if state is Outbound.AWAITING_PUBCOMP:
            return "again"
        return "pending" if state is Outbound.RECEIVED else "unknown"

    def release(self, packet_id: int) -> None:
        """The shell has settled a received QoS 2 delivery: PUBREL goes out, PUBCOMP ends it."""
        if self.inflight.get(packet_id) is not Outbound.RECEIVED:
            raise ValueError(f"no QoS 2 delivery with packet identifier {packet_id} awaits its release")
        self.inflight[packet_id] = Outbound.AWAITING_PUBCOMP

    def on_pubcomp(self, packet_id: int) -> bool:
        if self.inflight.get(packet_id) is Outbound.AWAITING_PUBCOMP:
            del self.inflight[packet_id]
            return True
        return False


class Inbound(Enum):
    QOS1_RECEIVED = "QoS 1 awaiting the shell"
    QOS2_RECEIVED = "QoS 2 awaiting the shell"
    QOS2_RECORDED = "PUBREC sent, awaiting PUBREL"
    QOS2_RELEASED = "PUBREL received, awaiting the shell's PUBCOMP"


class InboundFlows:
    __slots__ = ("receive_maximum", "flows", "restored")

    def __init__(self, receive_maximum: int) -> None:
        self.receive_maximum = receive_maximum
        self.flows: dict[int, Inbound] = {}
        # QoS 2 publishes recorded on an earlier connection, awaiting PUBREL: the
        # client's quota started afresh with this connection, so they do not count
        self.restored: set[int] = set()

    def restore(self, packet_ids: frozenset[int] | set[int] | tuple[int, ...]) -> None:
        self.restored.update(packet_ids)

    def on_publish(self, qos: int, packet_id: int) -> str:
        """'new' (hand it up), 'pending' (a retransmission the shell already has) or 'recorded' (resend PUBREC)."""
        if packet_id in self.restored and qos == 2:
            return "recorded"
        state = self.flows.get(packet_id)
        if state is None:
            if len(self.flows) >= self.receive_maximum:
                raise MqttError(f"more than Receive Maximum {self.receive_maximum} QoS 1/2 publishes "
                                "unacknowledged (§4.9)", ReasonCode.RECEIVE_MAXIMUM_EXCEEDED)
            self.flows[packet_id] = Inbound.QOS1_RECEIVED if qos == 1 else Inbound.QOS2_RECEIVED
            return "new"
        if (qos == 1) != (state is Inbound.QOS1_RECEIVED):
            raise ProtocolViolation(f"packet identifier {packet_id} is in use by a publish of the other QoS")
        return "recorded" if state is Inbound.QOS2_RECORDED else "pending"

    def acknowledge(self, packet_id: int, reason_code: int) -> int:
        """The QoS of the publish the shell acknowledges; a QoS 2 success now awaits PUBREL."""
        state = self.flows.get(packet_id)
        if state is Inbound.QOS1_RECEIVED:
            del self.flows[packet_id]
            return 1
        if state is Inbound.QOS2_RECEIVED:
            if reason_code >= 0x80:
                del self.flows[packet_id]
            else:
                self.flows[packet_id] = Inbound.QOS2_RECORDED
            return 2
        raise ValueError(f"no publish with packet identifier {packet_id} awaits an acknowledgement")

    def awaiting_release(self) -> set[int]:
        """The client's QoS 2 publishes recorded (PUBREC sent) and not yet released: what a resumed
        session must remember, so a retransmission is never handed up twice (MQTT-4.3.3-10)."""
        return {pid for pid, state in self.flows.items() if state is Inbound.QOS2_RECORDED} | self.restored

    def on_pubrel(self, packet_id: int) -> str:
        """'released' when the PUBREL ends a recorded QoS 2 publish (the shell completes it),
        'pending' when it repeats one the shell has not completed yet, 'unknown' otherwise."""
        state = self.flows.get(packet_id)
        if packet_id in self.restored:
            self.restored.discard(packet_id)
            state = Inbound.QOS2_RECORDED
        if state is Inbound.QOS2_RECORDED:
            self.flows[packet_id] = Inbound.QOS2_RELEASED
            return "released"
        if state is Inbound.QOS2_RELEASED:
            return "pending"
        if state is not None:
            raise ProtocolViolation(f"PUBREL {packet_id} before the server sent PUBREC")
        return "unknown"

    def complete(self, packet_id: int) -> None:
        """The shell completed a released QoS 2 publish (PUBCOMP goes out): the identifier is free."""
        if self.flows.get(packet_id) is not Inbound.QOS2_RELEASED:
            raise ValueError(f"no released QoS 2 publish with packet identifier {packet_id} awaits completion")
        del self.flows[packet_id]


class InboundAliases:
    __slots__ = ("maximum", "topics")

    def __init__(self, maximum: int) -> None:
        self.maximum = maximum
        self.topics: dict[int, str] = {}

    def resolve(self, topic: str, alias: int | None) -> str:
        if alias is None:
            if not topic:
                raise ProtocolViolation("a PUBLISH with neither a topic name nor a topic alias (§3.3.2.3.4)")
            return topic
        if not 1 <= alias <= self.maximum:
            raise MqttError(f"topic alias {alias} is not in 1 … {self.maximum}, the server's Topic Alias Maximum "
                            "(MQTT-3.3.2-12)", ReasonCode.TOPIC_ALIAS_INVALID)
        if topic:
            self.topics[alias] = topic
            return topic
        try:
            return self.topics[alias]
        except KeyError:
            raise ProtocolViolation(f"topic alias {alias} has no topic on this connection") from None


class OutboundAliases:
    """First come, first served: the first ``maximum`` topics get an alias for the connection."""

    __slots__ = ("maximum", "aliases")

    def __init__(self, maximum: int) -> None:
        self.maximum = maximum
        self.aliases: dict[str, int] = {}

    def assign(self, topic: str) -> tuple[str, int | None, bool]:
        """(topic to send, alias to send, whether the alias is new)."""
        alias = self.aliases.get(topic)
        if alias is not None:
            return "", alias, False
        if len(self.aliases) < self.maximum:
            alias = len(self.aliases) + 1
            self.aliases[topic] = alias
            return topic, alias, True
        return topic, None, False

    def forget(self, topic: str) -> None:
        """Undo the newest assignment (its packet was never sent), so its number is free again."""
        self.aliases.pop(topic, None)
