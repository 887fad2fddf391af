"""The MQTT codec and session held against paho-mqtt 2.x, a client that is not ours.

Properties: what paho's own ``Properties.pack`` writes decodes to the same values,
and what our encoder writes paho unpacks to the same values. Whole sessions: a
paho ``Client`` connects over TCP to a one-connection loopback broker built on
``MqttServerSession`` (the session decodes paho's packets; paho accepts our
CONNACK, SUBACK, PUBLISH, PUBACK, PUBREC, PUBCOMP, UNSUBACK), in both versions.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

paho_client = pytest.importorskip("paho.mqtt.client")
from paho.mqtt.packettypes import PacketTypes  # noqa: E402
from paho.mqtt.properties import Properties as PahoProperties  # noqa: E402
from paho.mqtt.subscribeoptions import SubscribeOptions  # noqa: E402

from fencemq.model.topics import matches  # noqa: E402
from fencemq.protocol.mqtt.events import (  # noqa: E402
    ConnectionClosed,
    ConnectRequested,
    DeliveryReceived,
    MessagePublished,
    MqttServerLimits,
    PublishReleased,
    SubscribeRequested,
    UnsubscribeRequested,
)
from fencemq.protocol.mqtt.packets import (  # noqa: E402
    MQTT_5,
    MQTT_311,
    Connect,
    Disconnect,
    Pubcomp,
    Publish,
    Pubrel,
    Subscribe,
    Unsubscribe,
)
from fencemq.protocol.mqtt.properties import Properties, decode_properties, encode_properties  # noqa: E402
from fencemq.protocol.mqtt.session import MqttServerSession  # noqa: E402
from fencemq.protocol.mqtt.stream import MqttStreamDecoder  # noqa: E402
from fencemq.protocol.mqtt.wire import Reader  # noqa: E402
from tests.protocol.mqtt.support import properties  # noqa: E402

CARRIERS = {"CONNECT": PacketTypes.CONNECT, "CONNACK": PacketTypes.CONNACK, "PUBLISH": PacketTypes.PUBLISH,
            "WILL": PacketTypes.WILLMESSAGE, "PUBACK": PacketTypes.PUBACK, "SUBSCRIBE": PacketTypes.SUBSCRIBE,
            "SUBACK": PacketTypes.SUBACK, "UNSUBACK": PacketTypes.UNSUBACK, "DISCONNECT": PacketTypes.DISCONNECT,
            "AUTH": PacketTypes.AUTH}
REPEATABLE = {"user_properties": "UserProperty", "subscription_identifiers": "SubscriptionIdentifier"}


def paho_name(identifier: int) -> str:
    return PahoProperties(PacketTypes.PUBLISH).getNameFromIdent(identifier).replace(" ", "")


def to_paho(props: Properties, carrier: str) -> PahoProperties:
    from fencemq.protocol.mqtt.properties import BY_NAME

    out = PahoProperties(CARRIERS[carrier])
    for name, value in props.present().items():
        setattr(out, paho_name(BY_NAME[name].identifier), list(value) if name in REPEATABLE else value)
    return out


def from_paho(paho: PahoProperties) -> dict:
    from fencemq.protocol.mqtt.properties import PROPERTIES

    got = {}
    for spec in PROPERTIES:
        name = paho_name(spec.identifier)
        if hasattr(paho, name):
            value = getattr(paho, name)
            got[spec.name] = tuple(value) if spec.name in REPEATABLE else value
    return got


PAHO_PROPERTIES = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
carrier_and_properties = st.sampled_from(sorted(CARRIERS)).flatmap(lambda c: st.tuples(st.just(c), properties(c)))


@PAHO_PROPERTIES
@given(carrier_and_properties)
def test_what_paho_packs_we_decode_to_the_same_properties(carrier_and_props):
    carrier, props = carrier_and_props
    assume(props.maximum_packet_size is None or props.maximum_packet_size <= 268_435_455)
    packed = to_paho(props, carrier).pack()
    assert decode_properties(Reader(packed), carrier) == props


@PAHO_PROPERTIES
@given(carrier_and_properties)
def test_what_we_encode_paho_unpacks_to_the_same_properties(carrier_and_props):
    carrier, props = carrier_and_props
    # paho refuses a Maximum Packet Size over 268435455, which the standard does not
    assume(props.maximum_packet_size is None or props.maximum_packet_size <= 268_435_455)
    unpacked, length = PahoProperties(CARRIERS[carrier]).unpack(encode_properties(props, carrier))
    assert length == len(encode_properties(props, carrier))
    assert from_paho(unpacked) == props.present()


# --------------------------------------------------------------------------- a loopback broker


class LoopbackBroker(threading.Thread):
    """One TCP connection, one MqttServerSession: accepts the CONNECT (or refuses it with
    ``refuse_with``), grants every subscription, stores nothing, and delivers every publish
    back to the same client when it matches one of its filters."""

    def __init__(self, refuse_with: int | None = None, limits: MqttServerLimits | None = None) -> None:
        super().__init__(daemon=True)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.refuse_with = refuse_with
        self.session = MqttServerSession(limits)
        self.seen: list = []  # what the client sent, decoded by a tap of our own decoder
        self.events: list = []
        self.filters: dict[str, int] = {}
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # surfaced by the test through .error
            self.error = exc

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        tap = MqttStreamDecoder()
        with conn:
            while not self.session.closed:
                data = conn.recv(65536)
                if not data:
                    self._handle(self.session.connection_lost())
                    break
                self.seen += tap.packets(data)
                self._handle(self.session.receive_bytes(data, time.monotonic()))
                conn.sendall(self.session.outbound())
            conn.sendall(self.session.outbound())

    def _handle(self, events: list) -> None:
        while events:
            event = events.pop(0)
            self.events.append(event)
            if isinstance(event, ConnectRequested):
                if self.refuse_with is not None:
                    events += self.session.refuse(self.refuse_with)
                else:
                    events += self.session.accept(time.monotonic())
            elif isinstance(event, SubscribeRequested):
                self.filters.update({r.topic_filter: r.granted_qos for r in event.requests if r.refusal is None})
                self.session.complete_subscribe(event.packet_id)
            elif isinstance(event, UnsubscribeRequested):
                for topic_filter in event.filters:
                    self.filters.pop(topic_filter, None)
                self.session.complete_unsubscribe(event.packet_id)
            elif isinstance(event, PublishReleased):
                self.session.complete_release(event.packet_id)
            elif isinstance(event, DeliveryReceived):
                self.session.release_delivery(event.packet_id)
            elif isinstance(event, MessagePublished):
                if event.qos:
                    self.session.acknowledge_publish(event.packet_id)
                for topic_filter, granted in self.filters.items():
                    if matches(topic_filter, event.topic):
                        self.session.deliver(event.topic, event.payload, min(event.qos, granted), False,
                                             event.properties)


class PahoProbe:
    """A paho Client on a background loop, with every callback recorded."""

    def __init__(self, version: int, client_id: str = "paho-1") -> None:
        protocol = paho_client.MQTTv5 if version == MQTT_5 else paho_client.MQTTv311
        self.client = paho_client.Client(paho_client.CallbackAPIVersion.VERSION2, client_id=client_id,
                                         protocol=protocol)
        self.connected = threading.Event()
        self.subscribed = threading.Event()
        self.unsubscribed = threading.Event()
        self.connect_result = None
        self.granted = None
        self.messages: list = []
        self.published: list[int] = []
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = lambda c, u, mid, codes, props: (setattr(self, "granted", codes),
                                                                    self.subscribed.set())
        self.client.on_unsubscribe = lambda c, u, mid, codes, props: self.unsubscribed.set()
        self.client.on_message = lambda c, u, message: self.messages.append(message)
        self.client.on_publish = lambda c, u, mid, code, props: self.published.append(mid)

    def _on_connect(self, client, userdata, flags, reason_code, props) -> None:
        self.connect_result = (reason_code, flags, props)
        self.connected.set()


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.01)


@pytest.mark.parametrize("version", [MQTT_311, MQTT_5], ids=["3.1.1", "5.0"])
def test_a_paho_session_publishes_subscribes_and_receives_at_every_qos(version):
    broker = LoopbackBroker()
    broker.start()
    probe = PahoProbe(version)
    v5 = version == MQTT_5
    probe.client.username_pw_set("alice", "secret")
    will_props = None
    if v5:
        will_props = PahoProperties(PacketTypes.WILLMESSAGE)
        will_props.WillDelayInterval = 5
        will_props.UserProperty = [("why", "gone")]
    probe.client.will_set("status/paho-1", b"offline", qos=1, retain=True, properties=will_props)
    connect_props = None
    if v5:
        connect_props = PahoProperties(PacketTypes.CONNECT)
        connect_props.SessionExpiryInterval = 120
        connect_props.ReceiveMaximum = 10
    probe.client.connect("127.0.0.1", broker.port, keepalive=30, clean_start=True if v5 else 3,
                         properties=connect_props)
    probe.client.loop_start()
    try:
        assert probe.connected.wait(10)
        assert probe.connect_result[0] == 0
        if v5:
            probe.client.subscribe([("t/#", SubscribeOptions(qos=2))])
        else:
            probe.client.subscribe("t/#", 2)
        assert probe.subscribed.wait(10)
        assert [int(code.value) if hasattr(code, "value") else int(code) for code in probe.granted] == [2]
        for qos in (0, 1, 2):
            publish_props = None
            if v5:
                publish_props = PahoProperties(PacketTypes.PUBLISH)
                publish_props.UserProperty = [("n", str(qos)), ("n", "again")]
                publish_props.ContentType = "text/plain"
                publish_props.ResponseTopic = "replies/paho-1"
                publish_props.CorrelationData = b"\x00\x01"
                publish_props.MessageExpiryInterval = 60
            probe.client.publish(f"t/{qos}", str(qos).encode(), qos=qos, properties=publish_props)
        wait_until(lambda: len(probe.messages) == 3 and len(probe.published) == 3)
        probe.client.unsubscribe("t/#")
        assert probe.unsubscribed.wait(10)
        probe.client.disconnect()
        broker.join(10)
    finally:
        probe.client.loop_stop()
    assert broker.error is None, broker.error

    received = sorted(probe.messages, key=lambda m: m.topic)
    assert [(m.topic, m.payload, m.qos) for m in received] == [("t/0", b"0", 0), ("t/1", b"1", 1),
                                                                ("t/2", b"2", 2)]
    if v5:
        for message in received:
            assert message.properties.ContentType == "text/plain"
            assert message.properties.CorrelationData == b"\x00\x01"
            assert message.properties.ResponseTopic == "replies/paho-1"
            assert message.properties.UserProperty == [("n", message.payload.decode()), ("n", "again")]

    connect = broker.seen[0]
    assert isinstance(connect, Connect) and connect.protocol_level == version
    assert (connect.client_id, connect.keep_alive, connect.username, connect.password) == (
        "paho-1", 30, "alice", b"secret")
    assert (connect.will.topic, connect.will.payload, connect.will.qos, connect.will.retain) == (
        "status/paho-1", b"offline", 1, True)
    if v5:
        assert connect.properties.session_expiry_interval == 120 and connect.properties.receive_maximum == 10
        assert connect.will.properties.will_delay_interval == 5
        assert connect.will.properties.user_properties == (("why", "gone"),)
    kinds = [type(p) for p in broker.seen]
    assert kinds.count(Publish) == 3 and Subscribe in kinds and Unsubscribe in kinds
    assert Pubrel in kinds and Pubcomp in kinds and kinds[-1] is Disconnect
    closed = broker.events[-1]
    assert isinstance(closed, ConnectionClosed) and closed.initiated_by == "client" and closed.will is None


# paho reports a 3.1.1 return code as its 5.0 reason code: our return code 4 reads as 0x86
@pytest.mark.parametrize("version, expected", [(MQTT_311, 0x86), (MQTT_5, 0x86)], ids=["3.1.1", "5.0"])
def test_paho_reads_a_refusing_connack(version, expected):
    broker = LoopbackBroker(refuse_with=0x86)
    broker.start()
    probe = PahoProbe(version)
    probe.client.connect("127.0.0.1", broker.port)
    probe.client.loop_start()
    try:
        assert probe.connected.wait(10)
    finally:
        probe.client.loop_stop()
    broker.join(10)
    code = probe.connect_result[0]
    assert int(code.value if hasattr(code, "value") else code) == expected
    assert isinstance(broker.events[-1], ConnectionClosed)


def test_paho_gets_the_assigned_client_identifier_of_an_empty_one():
    broker = LoopbackBroker(limits=MqttServerLimits(assign_client_id=lambda: "given-by-server"))
    broker.start()
    probe = PahoProbe(MQTT_5, client_id="")
    probe.client.connect("127.0.0.1", broker.port)
    probe.client.loop_start()
    try:
        assert probe.connected.wait(10)
        probe.client.disconnect()
        broker.join(10)
    finally:
        probe.client.loop_stop()
    assert probe.connect_result[2].AssignedClientIdentifier == "given-by-server"
