"""A server-side MQTT 3.1.1/5.0 session as a sans-I/O state machine.

The shell feeds it what the socket read (``receive_bytes(data, now)``), writes
what ``outbound()`` returns, calls ``tick(now)`` at ``next_deadline()``, and
acts on the events it gets back (``mqtt/events``); it answers them with
commands: ``accept``/``refuse`` a CONNECT, ``acknowledge_publish``,
``complete_subscribe``/``complete_unsubscribe``, ``deliver`` a message,
``take_over``, ``disconnect``, ``connection_lost``. No sockets, no clock: time
is what the caller passes in. Once ``closed`` is true the shell sends what is
left in ``outbound()`` and closes the connection.

A broken rule ends the session the way the standard says: a 5.0 client gets a
CONNACK (before CONNECT is accepted) or a DISCONNECT with the reason code
(MQTT-4.13.1-1), a 3.1.1 client a closed connection.
"""

from __future__ import annotations

from dataclasses import replace
from enum import Enum
from typing import Sequence

from fencemq.protocol.mqtt.codec import encode
from fencemq.protocol.mqtt.events import (
    ConnectionClosed, ConnectRequested, DeliveryAcknowledged, DeliveryReceived, DeliveryResult, MessagePublished,
    MqttEvent, MqttServerLimits, PublishReleased,
)
from fencemq.protocol.mqtt.inflight import InboundAliases, InboundFlows, OutboundAliases, OutboundFlows
from fencemq.protocol.mqtt.packets import (
    CLIENT_TO_SERVER, MQTT_5, MQTT_311, Auth, Connack, Connect, Disconnect, Packet, Pingreq, Pingresp, Puback,
    Pubcomp, Publish, Pubrec, Pubrel, Suback, Subscribe, Unsuback, Unsubscribe, Will,
)
from fencemq.protocol.mqtt.properties import NO_PROPERTIES, Properties
from fencemq.protocol.mqtt.reasons import (
    REASONS_V5, UNACCEPTABLE_PROTOCOL_VERSION_V311, MqttError, ProtocolViolation, ReasonCode,
    UnsupportedProtocolVersion, connack_code_v311,
)
from fencemq.protocol.mqtt.requests import PendingRequests
from fencemq.protocol.mqtt.stream import MAX_PACKET_SIZE, MqttStreamDecoder
from fencemq.protocol.mqtt.validation import (
    ConnectRefused, accepting_connack, cap_session_expiry, check_published_topic, message_properties, validate_connect,
)


class SessionState(Enum):
    AWAITING_CONNECT = "awaiting CONNECT"
    CONNECTING = "CONNECT handed up, awaiting accept or refuse"
    CONNECTED = "connected"
    CLOSED = "closed"


class MqttServerSession:
    # (slots: an idle connection's session holds nothing it does not need; docs/operations.md)
    __slots__ = ("limits", "state", "protocol_level", "request", "will", "session_expiry_interval", "_decoder",
                 "_out", "_events", "_opened_at", "_last_received", "_client_maximum_packet_size",
                 "_problem_information", "outbound_flows", "inbound_flows", "_inbound_aliases", "_outbound_aliases",
                 "_requests")

    def __init__(self, limits: MqttServerLimits | None = None, now: float = 0.0) -> None:
        self.limits = limits or MqttServerLimits()
        self.state = SessionState.AWAITING_CONNECT
        self.protocol_level: int | None = None
        self.request: ConnectRequested | None = None
        self.will: Will | None = None
        self.session_expiry_interval = 0
        self._decoder = MqttStreamDecoder(self.limits.maximum_packet_size,
                                          maximum_first_size=self.limits.maximum_connect_size)
        self._out = bytearray()
        self._events: list[MqttEvent] = []
        self._opened_at = now
        self._last_received = now
        self._client_maximum_packet_size = MAX_PACKET_SIZE
        self._problem_information = True
        self.outbound_flows = OutboundFlows(1)
        self.inbound_flows = InboundFlows(self.limits.receive_maximum)
        self._inbound_aliases = InboundAliases(self.limits.topic_alias_maximum)
        self._outbound_aliases = OutboundAliases(0)
        self._requests = PendingRequests(self.limits, MQTT_5)

    # ------------------------------------------------------------------ I/O side

    @property
    def closed(self) -> bool:
        return self.state is SessionState.CLOSED

    @property
    def client_id(self) -> str | None:
        return self.request.client_id if self.request else None

    @property
    def mid_packet(self) -> bool:
        """Part of a packet has arrived and the rest not yet (what a request timeout measures)."""
        return self._decoder.mid_packet

    def outbound(self) -> bytes:
        data = bytes(self._out)
        self._out.clear()
        return data

    def receive_bytes(self, data: bytes, now: float) -> list[MqttEvent]:
        if self.closed:
            return []
        self._decoder.feed(data)
        self._pump(now)
        return self._take_events()

    def next_deadline(self) -> float | None:
        """When ``tick`` has something to do: the connect timeout, or 1.5 × Keep Alive after the last packet.

        The connect timeout bounds the client: it runs until its CONNECT is in. What comes after is
        the server's own work (the gate's login, bounded by its throttle; binding the session), and
        is answered, accept or refuse: a server slow under a crowd of CONNECTs (a reconnect storm)
        never closes one unanswered because it took its time."""
        if self.state is SessionState.AWAITING_CONNECT:
            return self._opened_at + self.limits.connect_timeout
        if self.state is SessionState.CONNECTED and self.request and self.request.keep_alive:
            return self._last_received + 1.5 * self.request.keep_alive
        return None

    def tick(self, now: float) -> list[MqttEvent]:
        deadline = self.next_deadline()
        if deadline is not None and now >= deadline:
            if self.state is SessionState.CONNECTED:  # MQTT-3.1.2-24
                self._end_by_server(ReasonCode.KEEP_ALIVE_TIMEOUT, "keep alive timeout")
            else:
                self._close(ConnectionClosed(ReasonCode.MAXIMUM_CONNECT_TIME, "server"))
        return self._take_events()

    # ------------------------------------------------------------------ commands: connection

    def accept(self, now: float, session_present: bool = False,
               inbound_releases: frozenset[int] = frozenset(),
               user_properties: tuple[tuple[str, str], ...] = ()) -> list[MqttEvent]:
        """Send CONNACK 0x00 and go on with what the client sent after its CONNECT.

        ``inbound_releases``: on a resumed session, the client's QoS 2 publishes
        recorded (PUBREC sent) before, still awaiting their PUBREL.
        ``user_properties``: what the server tells a 5.0 client beside (dropped in 3.1.1).
        """
        request = self._expect_state(SessionState.CONNECTING)
        self._send(accepting_connack(request, self.limits, session_present, user_properties))
        self.state = SessionState.CONNECTED
        self._last_received = now
        self.inbound_flows.restore(inbound_releases)
        self._pump(now)
        return self._take_events()

    def refuse(self, reason_code: int, reason_string: str | None = None) -> list[MqttEvent]:
        """Send CONNACK with ``reason_code`` (>= 0x80) and close (MQTT-3.2.2-7)."""
        self._expect_state(SessionState.CONNECTING)
        if reason_code < 0x80 or reason_code not in REASONS_V5["CONNACK"]:
            raise ValueError(f"0x{reason_code:02X} is not a CONNACK refusal")
        self._refuse(reason_code, reason_string)
        return self._take_events()

    def take_over(self) -> list[MqttEvent]:
        """Another connection took this client id: DISCONNECT 0x8E, close (MQTT-3.1.4-3)."""
        if self.state is SessionState.CONNECTED:
            self._end_by_server(ReasonCode.SESSION_TAKEN_OVER, None, taken_over=True)
        elif not self.closed:  # no DISCONNECT before a CONNACK (MQTT-3.14.0-1)
            self._close(ConnectionClosed(ReasonCode.SESSION_TAKEN_OVER, "server", taken_over=True))
        return self._take_events()

    def disconnect(self, reason_code: int = ReasonCode.SERVER_SHUTTING_DOWN,
                   reason_string: str | None = None, server_reference: str | None = None) -> list[MqttEvent]:
        """The server ends the connection (shutdown, administrative action …); the will stands.
        ``server_reference`` (5.0): where the client may connect instead (§4.11)."""
        if reason_code not in REASONS_V5["DISCONNECT"]:
            raise ValueError(f"0x{reason_code:02X} is not a DISCONNECT reason code")
        if self.state in (SessionState.AWAITING_CONNECT, SessionState.CONNECTING):
            self._close(ConnectionClosed(reason_code, "server"))
        elif not self.closed:
            self._end_by_server(reason_code, reason_string, server_reference=server_reference)
        return self._take_events()

    def connection_lost(self) -> list[MqttEvent]:
        """The network went away without a DISCONNECT: the will stands (MQTT-3.1.2-8)."""
        if not self.closed:
            connected = self.state is SessionState.CONNECTED
            self._close(ConnectionClosed(None, "network", self.will if connected else None,
                                         self.session_expiry_interval))
        return self._take_events()

    # ------------------------------------------------------------------ commands: the client's requests

    def acknowledge_publish(self, packet_id: int, reason_code: int = ReasonCode.SUCCESS,
                            reason_string: str | None = None) -> None:
        """The shell stored (or refused, >= 0x80) the client's QoS 1/2 publish: PUBACK or PUBREC."""
        if self.closed:
            return
        if reason_code not in REASONS_V5["PUBACK"]:  # PUBREC allows the same codes
            raise ValueError(f"0x{reason_code:02X} is not a PUBACK/PUBREC reason code")
        qos = self.inbound_flows.acknowledge(packet_id, reason_code)
        packet_class = Puback if qos == 1 else Pubrec
        self._send(packet_class(packet_id, *self._reason(reason_code, reason_string)))

    def complete_subscribe(self, packet_id: int, reason_codes: Sequence[int] | None = None) -> None:
        """SUBACK: one reason code per request, in order (MQTT-3.8.4-6); None grants the defaults."""
        if not self.closed:
            self._send(self._requests.suback(packet_id, reason_codes))

    def complete_unsubscribe(self, packet_id: int, reason_codes: Sequence[int] | None = None) -> None:
        """UNSUBACK (MQTT-3.10.4-4, -5); 5.0 carries one reason code per filter, None: all 0x00."""
        if not self.closed:
            self._send(self._requests.unsuback(packet_id, reason_codes))

    # ------------------------------------------------------------------ commands: deliveries

    @property
    def send_quota(self) -> int:
        """How many more QoS 1/2 deliveries may be sent now (the client's Receive Maximum, §4.9)."""
        return self.outbound_flows.quota if self.state is SessionState.CONNECTED else 0

    def deliver(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False,
                properties: Properties = NO_PROPERTIES, *, dup: bool = False,
                packet_id: int | None = None) -> DeliveryResult:
        """Send a message to the client. ``dup`` and ``packet_id`` redeliver an unacknowledged
        one on a resumed session with its original identifier (MQTT-4.4.0-1, MQTT-3.3.1-1)."""
        self._expect_state(SessionState.CONNECTED)
        if qos not in (0, 1, 2) or (qos == 0 and (dup or packet_id is not None)):
            raise ValueError(f"QoS {qos} with dup={dup} and packet_id={packet_id!r}")
        if qos:
            packet_id = self.outbound_flows.start(qos, packet_id)
        props = NO_PROPERTIES
        send_topic, new_alias = topic, False
        if self.protocol_level == MQTT_5:
            send_topic, alias, new_alias = self._outbound_aliases.assign(topic)
            props = replace(properties, topic_alias=alias) if alias or properties.topic_alias else properties
        try:
            data = encode(Publish(send_topic, payload, qos, retain, dup, packet_id, props), self.protocol_level)
        except ValueError:
            self._undo_delivery(topic if new_alias else None, packet_id)
            raise
        if len(data) > self._client_maximum_packet_size:  # MQTT-3.1.2-27/-28: discarded, as if delivered
            self._undo_delivery(topic if new_alias else None, packet_id)
            return DeliveryResult(False)
        self._out += data
        return DeliveryResult(True, packet_id)

    def _undo_delivery(self, new_alias_topic: str | None, packet_id: int | None) -> None:
        if new_alias_topic is not None:
            self._outbound_aliases.forget(new_alias_topic)
        if packet_id is not None:
            self.outbound_flows.abandon(packet_id)

    def release_delivery(self, packet_id: int) -> None:
        """After ``DeliveryReceived`` (PUBREC): the shell has settled the delivery for good; PUBREL."""
        if self.closed:
            return
        self.outbound_flows.release(packet_id)
        self._send(Pubrel(packet_id))

    def complete_release(self, packet_id: int) -> None:
        """After ``PublishReleased`` (PUBREL): the shell has noted the publish is complete; PUBCOMP.
        Until then the identifier stays taken, so a new publish cannot reuse it (MQTT-4.3.3-12)."""
        if self.closed:
            return
        self.inbound_flows.complete(packet_id)
        self._send(Pubcomp(packet_id))

    def resend_release(self, packet_id: int) -> None:
        """On a resumed session, a QoS 2 delivery the client already received: resend PUBREL."""
        self._expect_state(SessionState.CONNECTED)
        self.outbound_flows.start(2, packet_id, released=True)
        self._send(Pubrel(packet_id))

    # ------------------------------------------------------------------ reading packets

    def _pump(self, now: float) -> None:
        while self.state in (SessionState.AWAITING_CONNECT, SessionState.CONNECTED):
            try:
                packet = self._decoder.next_packet()
                if packet is None:
                    return
                self._last_received = now
                self._handle(packet)
            except MqttError as exc:
                self._violation(exc)

    def _handle(self, packet: Packet) -> None:
        if self.state is SessionState.AWAITING_CONNECT:
            assert isinstance(packet, Connect)  # the decoder decodes nothing else first (MQTT-3.1.0-1)
            self._on_connect(packet)
        elif isinstance(packet, Connect):
            raise ProtocolViolation("a second CONNECT (MQTT-3.1.0-2)")
        elif packet.packet_type not in CLIENT_TO_SERVER:
            raise ProtocolViolation(f"a client sent {packet.packet_type.name}, which only a server sends")
        elif isinstance(packet, Publish):
            self._on_publish(packet)
        elif isinstance(packet, Puback):
            if self.outbound_flows.on_puback(packet.packet_id):
                self._events.append(DeliveryAcknowledged(packet.packet_id, 1, packet.reason_code, packet.properties))
        elif isinstance(packet, Pubrec):
            self._on_pubrec(packet)
        elif isinstance(packet, Pubcomp):
            if self.outbound_flows.on_pubcomp(packet.packet_id):
                self._events.append(DeliveryAcknowledged(packet.packet_id, 2, packet.reason_code, packet.properties))
        elif isinstance(packet, Pubrel):
            outcome = self.inbound_flows.on_pubrel(packet.packet_id)
            if outcome == "released":  # the shell completes it (PUBCOMP) once it has written that down
                self._events.append(PublishReleased(packet.packet_id))
            elif outcome == "unknown":
                self._send(Pubcomp(packet.packet_id, self._v5_code(ReasonCode.PACKET_IDENTIFIER_NOT_FOUND)))
        elif isinstance(packet, (Subscribe, Unsubscribe)):
            outcome = (self._requests.on_subscribe(packet) if isinstance(packet, Subscribe)
                       else self._requests.on_unsubscribe(packet))
            if isinstance(outcome, (Suback, Unsuback)):
                self._send(outcome)
            else:
                self._events.append(outcome)
        elif isinstance(packet, Pingreq):
            self._send(Pingresp())  # MQTT-3.12.4-1
        elif isinstance(packet, Disconnect):
            self._on_disconnect(packet)
        elif isinstance(packet, Auth):
            raise ProtocolViolation("AUTH, and no authentication method was agreed (§4.12)")

    def _on_connect(self, connect: Connect) -> None:
        self.protocol_level = connect.protocol_level
        props = connect.properties
        self._client_maximum_packet_size = props.maximum_packet_size or MAX_PACKET_SIZE
        self._problem_information = props.request_problem_information != 0
        request = validate_connect(connect, self.limits)
        self.request, self.will = request, request.will
        self.session_expiry_interval = request.session_expiry_interval
        self.outbound_flows = OutboundFlows(min(props.receive_maximum or 0xFFFF, self.limits.maximum_inflight))
        if self.limits.outbound_topic_aliases:
            self._outbound_aliases = OutboundAliases(props.topic_alias_maximum or 0)
        self._requests = PendingRequests(self.limits, connect.protocol_level)
        self.state = SessionState.CONNECTING
        self._events.append(request)

    def _on_publish(self, packet: Publish) -> None:
        props = packet.properties
        if props.subscription_identifiers:
            raise ProtocolViolation("a client's PUBLISH carries a subscription identifier (MQTT-3.3.4-6)")
        if packet.qos > self.limits.maximum_qos:
            raise MqttError(f"PUBLISH at QoS {packet.qos}, over the Maximum QoS {self.limits.maximum_qos} "
                            "(MQTT-3.2.2-11)", ReasonCode.QOS_NOT_SUPPORTED)
        if packet.retain and not self.limits.retain_available:
            raise MqttError("a retained PUBLISH, and Retain Available is 0 (MQTT-3.2.2-14)",
                            ReasonCode.RETAIN_NOT_SUPPORTED)
        topic = check_published_topic(self._inbound_aliases.resolve(packet.topic, props.topic_alias))
        if packet.qos:
            assert packet.packet_id is not None
            seen = self.inbound_flows.on_publish(packet.qos, packet.packet_id)
            if seen == "recorded":  # a retransmission of a publish already stored: PUBREC again
                self._send(Pubrec(packet.packet_id))
            if seen != "new":
                return
        self._events.append(MessagePublished(topic, packet.payload, packet.qos, packet.retain, packet.packet_id,
                                             message_properties(props), packet.dup))

    def _on_pubrec(self, packet: Pubrec) -> None:
        outcome = self.outbound_flows.on_pubrec(packet.packet_id, packet.reason_code)
        if outcome == "refused":  # MQTT-4.4.0-2: the identifier is free, the message is not resent
            self._events.append(DeliveryAcknowledged(packet.packet_id, 2, packet.reason_code, packet.properties))
            return
        if outcome == "received":  # the shell releases it (PUBREL) once it has settled it
            self._events.append(DeliveryReceived(packet.packet_id))
            return
        if outcome == "pending":
            return
        not_found = self._v5_code(ReasonCode.PACKET_IDENTIFIER_NOT_FOUND) if outcome == "unknown" else 0
        self._send(Pubrel(packet.packet_id, not_found))

    def _on_disconnect(self, packet: Disconnect) -> None:
        asked = packet.properties.session_expiry_interval
        if asked is not None:
            assert self.request is not None
            if (self.request.properties.session_expiry_interval or 0) == 0 and asked != 0:
                raise ProtocolViolation("DISCONNECT sets a Session Expiry Interval the CONNECT had as 0 "
                                        "(§3.14.2.2.2)")
            self.session_expiry_interval = cap_session_expiry(asked, self.limits)
        # only a normal disconnection deletes the will (MQTT-3.1.2-10, MQTT-3.14.4-3)
        will = None if packet.reason_code == ReasonCode.NORMAL_DISCONNECTION else self.will
        self._close(ConnectionClosed(packet.reason_code, "client", will, self.session_expiry_interval))

    # ------------------------------------------------------------------ ending

    def _violation(self, exc: MqttError) -> None:
        if self.state is SessionState.CONNECTED:
            self._end_by_server(exc.reason_code, exc.message)
            return
        if isinstance(exc, UnsupportedProtocolVersion):
            if exc.protocol_level == MQTT_5:
                self._send_connack_v5(ReasonCode.UNSUPPORTED_PROTOCOL_VERSION, exc.message)
            elif exc.protocol_name == "MQTT" or (exc.protocol_name, exc.protocol_level) == ("MQIsdp", 3):
                self._out += encode(Connack(UNACCEPTABLE_PROTOCOL_VERSION_V311), MQTT_311)  # MQTT-3.1.2-2 (3.1.1)
            self._close(ConnectionClosed(exc.reason_code, "server"))
            return
        level = self.protocol_level or exc.protocol_level
        if level == MQTT_5 or isinstance(exc, ConnectRefused):
            self._refuse(exc.reason_code, exc.message, level)
        else:
            self._close(ConnectionClosed(exc.reason_code, "server"))  # MQTT-3.1.4-1: close, no CONNACK

    def _refuse(self, reason_code: int, reason_string: str | None, level: int | None = None) -> None:
        if (level or self.protocol_level) == MQTT_5:
            if reason_code not in REASONS_V5["CONNACK"]:
                reason_code = ReasonCode.UNSPECIFIED_ERROR
            self._send_connack_v5(reason_code, reason_string)
        else:
            self._out += encode(Connack(connack_code_v311(reason_code)), MQTT_311)
        self._close(ConnectionClosed(reason_code, "server"))

    def _send_connack_v5(self, reason_code: int, reason_string: str | None) -> None:
        self.protocol_level = MQTT_5
        self._send(Connack(reason_code, False, Properties(reason_string=reason_string)))

    def _end_by_server(self, reason_code: int, reason_string: str | None, taken_over: bool = False,
                       server_reference: str | None = None) -> None:
        if self.protocol_level == MQTT_5:
            if reason_code not in REASONS_V5["DISCONNECT"]:
                reason_code = ReasonCode.UNSPECIFIED_ERROR
            self._send(Disconnect(reason_code, Properties(reason_string=reason_string,
                                                          server_reference=server_reference)))
        self._close(ConnectionClosed(reason_code, "server", self.will, self.session_expiry_interval, taken_over))

    def _close(self, event: ConnectionClosed) -> None:
        self.state = SessionState.CLOSED
        self._events.append(event)

    # ------------------------------------------------------------------ helpers

    def _send(self, packet: Packet) -> None:
        """Encode for the client, dropping the Reason String and User Properties if the client did
        not ask for problem information or the packet would exceed its Maximum Packet Size
        (MQTT-3.1.2-32, MQTT-3.2.2-19/-20 and their like for every packet)."""
        assert self.protocol_level is not None
        props = getattr(packet, "properties", NO_PROPERTIES)
        if props and not self._problem_information and not isinstance(packet, (Connack, Disconnect)):
            packet = replace(packet, properties=replace(props, reason_string=None, user_properties=()))
        data = encode(packet, self.protocol_level)
        if len(data) > self._client_maximum_packet_size and props:
            packet = replace(packet, properties=replace(props, reason_string=None, user_properties=()))
            data = encode(packet, self.protocol_level)
        self._out += data

    def _reason(self, reason_code: int, reason_string: str | None) -> tuple[int, Properties]:
        if self.protocol_level != MQTT_5:
            return 0, NO_PROPERTIES
        return reason_code, Properties(reason_string=reason_string)

    def _v5_code(self, code: int) -> int:
        return code if self.protocol_level == MQTT_5 else 0

    def _expect_state(self, state: SessionState) -> ConnectRequested:
        if self.state is not state:
            raise RuntimeError(f"the session is {self.state.value}, not {state.value}")
        assert self.request is not None
        return self.request

    def _take_events(self) -> list[MqttEvent]:
        events, self._events = self._events, []
        return events

