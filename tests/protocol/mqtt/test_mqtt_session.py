"""The MQTT server session, connection side: CONNECT and CONNACK, keep alive, will, DISCONNECT
both ways, takeover, and what a broken rule costs. Each test is named after the normative
statement it checks (MQTT 5.0 numbering unless it says v311)."""

from __future__ import annotations

import pytest

from fencemq.protocol.mqtt.codec import encode
from fencemq.protocol.mqtt.events import (
    SESSION_NEVER_EXPIRES,
    ConnectionClosed,
    ConnectRequested,
    MessagePublished,
    MqttServerLimits,
    SubscribeRequested,
)
from fencemq.protocol.mqtt.packets import (
    MQTT_5,
    MQTT_311,
    Auth,
    Connack,
    Connect,
    Disconnect,
    Pingreq,
    Pingresp,
    Publish,
    Suback,
    Subscribe,
    SubscriptionOptions,
    Will,
)
from fencemq.protocol.mqtt.properties import Properties
from fencemq.protocol.mqtt.reasons import ReasonCode
from fencemq.protocol.mqtt.session import MqttServerSession, SessionState
from fencemq.protocol.mqtt.stream import decode_all
from tests.protocol.mqtt.support import Peer

BOTH = pytest.mark.parametrize("version", [MQTT_311, MQTT_5], ids=["3.1.1", "5.0"])
WILL = Will("status/c1", b"gone", 1, False, Properties(will_delay_interval=30))


def closed_event(events) -> ConnectionClosed:
    assert isinstance(events[-1], ConnectionClosed), events
    return events[-1]


def raw_connect(flags: int, level: int = 5, name: bytes = b"MQTT", tail: bytes | None = None) -> bytes:
    if tail is None:
        tail = (b"\x00" if level == 5 else b"") + b"\x00\x02c1"
    body = len(name).to_bytes(2, "big") + name + bytes([level, flags]) + b"\x00\x1e" + tail
    return b"\x10" + bytes([len(body)]) + body


# --------------------------------------------------------------------------- CONNECT


@BOTH
def test_MQTT_3_1_4_5_a_valid_connect_is_handed_up_then_acknowledged_with_0x00(version):
    peer = Peer(version)
    events = peer.send(Connect("c1", version, True, 30, "alice", b"pw", WILL if version == MQTT_5 else
                               Will("status/c1", b"gone", 1)))
    request = events[0]
    assert isinstance(request, ConnectRequested)
    assert (request.client_id, request.username, request.password, request.keep_alive) == ("c1", "alice", b"pw", 30)
    assert request.will.topic == "status/c1"
    assert peer.received() == []  # nothing is said before the shell decides
    peer.session.accept(0.0)
    (connack,) = peer.received()
    assert connack.reason_code == 0 and not connack.session_present
    assert peer.session.state is SessionState.CONNECTED


def test_the_connack_announces_the_server_limits():
    limits = MqttServerLimits(maximum_packet_size=4096, receive_maximum=20, topic_alias_maximum=5, maximum_qos=1,
                              retain_available=False, shared_subscription_available=False, server_keep_alive=15)
    peer = Peer(MQTT_5, limits)
    peer.connect()
    props = peer.connack.properties
    assert (props.maximum_packet_size, props.receive_maximum, props.topic_alias_maximum) == (4096, 20, 5)
    assert (props.maximum_qos, props.retain_available, props.shared_subscription_available) == (1, 0, 0)
    assert props.server_keep_alive == 15
    assert props.wildcard_subscription_available is None  # available: left out


@BOTH
def test_MQTT_3_1_0_1_a_first_packet_other_than_connect_closes_without_a_word(version):
    peer = Peer(version)
    events = peer.send(encode(Pingreq()))
    assert closed_event(events).initiated_by == "server"
    assert peer.session.outbound() == b""


@BOTH
def test_MQTT_3_1_0_2_a_second_connect_is_a_protocol_error(version):
    peer = Peer(version)
    peer.connect()
    closed = closed_event(peer.send(Connect("c1", version)))
    assert closed.reason_code == ReasonCode.PROTOCOL_ERROR
    expected = [Disconnect(0x82)] if version == MQTT_5 else []
    assert [type(p)(p.reason_code) if isinstance(p, Disconnect) else p for p in peer.received()] == expected


def test_MQTT_3_1_2_1_another_protocol_name_gets_0x84_in_v5():
    peer = Peer(MQTT_5)
    closed_event(peer.send(raw_connect(0x02, 5, b"MQTX")))
    (connack,) = decode_all(peer.session.outbound(), MQTT_5)
    assert connack.reason_code == ReasonCode.UNSUPPORTED_PROTOCOL_VERSION


@pytest.mark.parametrize("name, level", [(b"MQIsdp", 3), (b"MQTT", 3), (b"MQTT", 6)])
def test_v311_MQTT_3_1_2_2_an_unsupported_level_gets_return_code_1(name, level):
    session = MqttServerSession()
    closed_event(session.receive_bytes(raw_connect(0x02, level, name, b"\x00\x02c1"), 0.0))
    assert session.outbound() == b"\x20\x02\x00\x01"


@BOTH
def test_MQTT_3_1_2_3_the_reserved_flag_set_is_malformed(version):
    peer = Peer(version)
    closed = closed_event(peer.send(raw_connect(0x03, version)))
    assert closed.reason_code == ReasonCode.MALFORMED_PACKET and closed.will is None
    out = peer.session.outbound()
    if version == MQTT_5:  # MQTT-3.1.4-1: close; 5.0 may say why first
        assert decode_all(out, MQTT_5)[0].reason_code == ReasonCode.MALFORMED_PACKET
    else:
        assert out == b""


@BOTH
def test_MQTT_3_2_2_2_a_clean_start_session_is_never_present(version):
    peer = Peer(version)
    peer.send(Connect("c1", version, clean_start=True))
    with pytest.raises(ValueError):
        peer.session.accept(0.0, session_present=True)
    resumed = Peer(version)
    resumed.connect(clean_start=False, session_present=True)
    assert resumed.connack.session_present


def test_MQTT_3_1_3_6_and_3_2_2_16_an_empty_client_id_is_assigned_one_and_told_it():
    peer = Peer(MQTT_5)
    events = peer.connect(client_id="", clean_start=False)
    assert events[0].client_id == "assigned-1" and events[0].client_id_assigned
    assert peer.connack.properties.assigned_client_identifier == "assigned-1"
    assert peer.session.client_id == "assigned-1"


def test_v311_an_empty_client_id_with_clean_session_gets_one_silently():
    peer = Peer(MQTT_311)
    events = peer.connect(client_id="", clean_start=True)
    assert events[0].client_id == "assigned-1"
    assert peer.connack == Connack(0, False)


def test_v311_MQTT_3_1_3_8_an_empty_client_id_without_clean_session_is_identifier_rejected():
    peer = Peer(MQTT_311)
    closed = closed_event(peer.send(Connect("", MQTT_311, clean_start=False)))
    assert closed.reason_code == ReasonCode.CLIENT_IDENTIFIER_NOT_VALID
    assert peer.received() == [Connack(0x02)]


def test_MQTT_3_1_3_8_a_client_id_over_the_limit_is_refused_0x85():
    peer = Peer(MQTT_5, MqttServerLimits(maximum_client_id_bytes=8))
    closed_event(peer.send(Connect("x" * 9)))
    assert peer.received()[0].reason_code == ReasonCode.CLIENT_IDENTIFIER_NOT_VALID


def test_MQTT_3_2_2_12_a_will_qos_over_the_maximum_is_refused_0x9B():
    peer = Peer(MQTT_5, MqttServerLimits(maximum_qos=1))
    closed_event(peer.send(Connect("c1", will=Will("w", b"", 2))))
    assert peer.received()[0].reason_code == ReasonCode.QOS_NOT_SUPPORTED


def test_MQTT_3_2_2_13_a_retained_will_without_retain_available_is_refused_0x9A():
    peer = Peer(MQTT_5, MqttServerLimits(retain_available=False))
    closed_event(peer.send(Connect("c1", will=Will("w", b"", 0, True))))
    assert peer.received()[0].reason_code == ReasonCode.RETAIN_NOT_SUPPORTED


def test_a_will_topic_with_a_wildcard_is_refused_0x90():
    peer = Peer(MQTT_5)
    closed_event(peer.send(Connect("c1", will=Will("a/#"))))
    assert peer.received()[0].reason_code == ReasonCode.TOPIC_NAME_INVALID


def test_MQTT_4_12_0_1_an_authentication_method_we_do_not_support_is_refused_0x8C():
    peer = Peer(MQTT_5)
    closed_event(peer.send(Connect("c1", properties=Properties(authentication_method="SCRAM-SHA-1"))))
    assert peer.received()[0].reason_code == ReasonCode.BAD_AUTHENTICATION_METHOD


@pytest.mark.parametrize("reason, v311_code", [(0x86, 4), (0x87, 5), (0x85, 2), (0x88, 3), (0x8A, 5)])
def test_MQTT_3_2_2_7_a_refusal_is_sent_and_the_connection_closes(reason, v311_code):
    for version, expected in ((MQTT_5, reason), (MQTT_311, v311_code)):
        peer = Peer(version)
        peer.send(Connect("c1", version))
        closed = closed_event(peer.session.refuse(reason))
        assert closed.reason_code == reason and closed.will is None
        (connack,) = peer.received()
        assert connack.reason_code == expected and not connack.session_present  # MQTT-3.2.2-6
        assert peer.session.closed


def test_MQTT_3_1_4_6_nothing_after_a_refused_connect_is_processed():
    peer = Peer(MQTT_5)
    events = peer.send(Connect("c1"), Subscribe(1, (("a", SubscriptionOptions()),)), Publish("a", b"x"))
    assert len(events) == 1
    peer.session.refuse(ReasonCode.NOT_AUTHORIZED)
    assert [type(p) for p in peer.received()] == [Connack]


def test_packets_pipelined_after_connect_wait_for_the_accept():
    peer = Peer(MQTT_5)
    events = peer.send(Connect("c1"), Subscribe(1, (("a", SubscriptionOptions(1)),)), Publish("a", b"x"))
    assert [type(e) for e in events] == [ConnectRequested]
    later = peer.session.accept(0.0)
    assert [type(e) for e in later] == [SubscribeRequested, MessagePublished]


def test_session_expiry_is_granted_up_to_the_server_cap_and_said_when_lowered():
    peer = Peer(MQTT_5, MqttServerLimits(maximum_session_expiry_interval=600))
    events = peer.connect(properties=Properties(session_expiry_interval=3600))
    assert events[0].session_expiry_interval == 600
    assert peer.connack.properties.session_expiry_interval == 600
    same = Peer(MQTT_5, MqttServerLimits(maximum_session_expiry_interval=600))
    same.connect(properties=Properties(session_expiry_interval=60))
    assert same.connack.properties.session_expiry_interval is None


def test_v311_clean_session_0_never_expires_and_1_ends_with_the_connection():
    assert Peer(MQTT_311).connect(clean_start=False)[0].session_expiry_interval == SESSION_NEVER_EXPIRES
    assert Peer(MQTT_311).connect(clean_start=True)[0].session_expiry_interval == 0


def test_a_connect_that_never_comes_is_closed_at_the_connect_timeout():
    session = MqttServerSession(MqttServerLimits(connect_timeout=5.0), now=100.0)
    assert session.next_deadline() == 105.0
    assert session.tick(104.9) == []
    closed = closed_event(session.tick(105.0))
    assert closed.initiated_by == "server" and session.outbound() == b""


def test_a_connect_that_came_in_time_is_answered_however_long_the_server_takes_to_decide():
    peer = Peer(MQTT_311, MqttServerLimits(connect_timeout=5.0))
    assert peer.session.next_deadline() == 5.0
    peer.send(Connect(protocol_level=MQTT_311, client_id="c1"), now=1.0)
    assert peer.session.next_deadline() is None and peer.session.tick(60.0) == []
    peer.session.refuse(ReasonCode.SERVER_BUSY)
    (connack,) = peer.received()
    assert connack.reason_code == 0x03  # 3.1.1: Server unavailable


# --------------------------------------------------------------------------- keep alive


@BOTH
def test_MQTT_3_1_2_24_silence_for_one_and_a_half_keep_alives_closes(version):
    peer = Peer(version)
    peer.connect(now=0.0, keep_alive=10)
    assert peer.session.next_deadline() == 15.0
    peer.send(Pingreq(), now=12.0)  # any packet restarts the count
    assert peer.received() == [Pingresp()]  # MQTT-3.12.4-1
    assert peer.session.tick(26.9) == []
    closed = closed_event(peer.session.tick(27.0))
    assert closed.reason_code == ReasonCode.KEEP_ALIVE_TIMEOUT
    expected = [Disconnect(0x8D)] if version == MQTT_5 else []
    assert [Disconnect(p.reason_code) for p in peer.received()] == expected


def test_keep_alive_0_never_times_out():
    peer = Peer(MQTT_5)
    peer.connect(keep_alive=0)
    assert peer.session.next_deadline() is None
    assert peer.session.tick(1e9) == []


def test_MQTT_3_2_2_21_and_22_the_server_keep_alive_replaces_the_clients():
    peer = Peer(MQTT_5, MqttServerLimits(server_keep_alive=4))
    events = peer.connect(keep_alive=600)
    assert events[0].keep_alive == 4 and peer.connack.properties.server_keep_alive == 4
    assert peer.session.next_deadline() == 6.0


# --------------------------------------------------------------------------- DISCONNECT and the will


@BOTH
def test_MQTT_3_14_4_3_a_normal_disconnect_discards_the_will(version):
    peer = Peer(version)
    peer.connect(will=Will("w", b"bye"))
    closed = closed_event(peer.send(Disconnect()))
    assert (closed.initiated_by, closed.will, closed.reason_code) == ("client", None, 0)
    assert peer.received() == []  # the server says nothing back


def test_a_disconnect_with_will_message_0x04_keeps_the_will():
    peer = Peer(MQTT_5)
    peer.connect(will=WILL)
    closed = closed_event(peer.send(Disconnect(ReasonCode.DISCONNECT_WITH_WILL_MESSAGE)))
    assert closed.will == WILL


@BOTH
def test_MQTT_3_1_2_8_a_lost_connection_leaves_the_will_to_publish(version):
    peer = Peer(version)
    will = WILL if version == MQTT_5 else Will("status/c1", b"gone", 1)
    peer.connect(will=will)
    closed = closed_event(peer.session.connection_lost())
    assert (closed.initiated_by, closed.reason_code, closed.will) == ("network", None, will)


def test_a_disconnect_may_change_the_session_expiry_interval():
    peer = Peer(MQTT_5)
    peer.connect(properties=Properties(session_expiry_interval=60))
    closed = closed_event(peer.send(Disconnect(0, Properties(session_expiry_interval=0))))
    assert closed.session_expiry_interval == 0


def test_a_disconnect_may_not_give_an_expiry_to_a_session_connected_with_0():
    peer = Peer(MQTT_5)
    peer.connect()
    closed = closed_event(peer.send(Disconnect(0, Properties(session_expiry_interval=60))))
    assert closed.reason_code == ReasonCode.PROTOCOL_ERROR and closed.initiated_by == "server"
    assert peer.received()[0].reason_code == ReasonCode.PROTOCOL_ERROR


@BOTH
def test_MQTT_3_1_4_3_a_taken_over_session_gets_0x8E_and_its_will_goes_up(version):
    peer = Peer(version)
    will = Will("w", b"bye")
    peer.connect(will=will)
    closed = closed_event(peer.session.take_over())
    assert closed.taken_over and closed.will == will and closed.reason_code == ReasonCode.SESSION_TAKEN_OVER
    expected = [0x8E] if version == MQTT_5 else []
    assert [p.reason_code for p in peer.received()] == expected


def test_a_server_disconnect_names_its_reason():
    peer = Peer(MQTT_5)
    peer.connect()
    closed = closed_event(peer.session.disconnect(ReasonCode.ADMINISTRATIVE_ACTION, "evicted by operator"))
    (packet,) = peer.received()
    assert packet.reason_code == 0x98 and packet.properties.reason_string == "evicted by operator"
    assert closed.initiated_by == "server"


@pytest.mark.parametrize("end", ["disconnect", "take_over"])
def test_MQTT_3_14_0_1_no_disconnect_is_sent_before_the_connack(end):
    peer = Peer(MQTT_5)
    peer.send(Connect("c1"))
    closed_event(getattr(peer.session, end)())
    assert peer.received() == []


# --------------------------------------------------------------------------- violations after CONNECT


@pytest.mark.parametrize("data, reason", [
    (b"\x36\x04\x00\x01a\x00", ReasonCode.MALFORMED_PACKET),  # QoS 3 (MQTT-3.3.1-4)
    (encode(Connack()), ReasonCode.PROTOCOL_ERROR),  # a CONNACK from the client
    (encode(Suback(1, (0,))), ReasonCode.PROTOCOL_ERROR),
    (encode(Auth()), ReasonCode.PROTOCOL_ERROR),  # MQTT-4.12.0-7
    (b"\xe1\x00", ReasonCode.MALFORMED_PACKET),  # MQTT-3.14.1-1
])
def test_MQTT_4_13_1_1_a_malformed_packet_or_protocol_error_ends_with_its_reason_code(data, reason):
    peer = Peer(MQTT_5)
    peer.connect(will=WILL)
    closed = closed_event(peer.send(data))
    assert closed.reason_code == reason and closed.will == WILL
    assert [p.reason_code for p in peer.received()] == [reason]
    assert peer.send(Pingreq()) == [] and peer.session.outbound() == b""  # nothing after the close


def test_v311_a_violation_closes_the_connection_without_a_word():
    peer = Peer(MQTT_311)
    peer.connect()
    closed_event(peer.send(b"\x36\x04\x00\x01a\x00"))
    assert peer.received() == []


def test_a_packet_over_the_maximum_packet_size_is_0x95():
    peer = Peer(MQTT_5, MqttServerLimits(maximum_packet_size=64))
    peer.connect()
    closed = closed_event(peer.send(Publish("t", b"x" * 100)))
    assert closed.reason_code == ReasonCode.PACKET_TOO_LARGE
    assert peer.received()[0].reason_code == ReasonCode.PACKET_TOO_LARGE


def test_every_session_ends_with_exactly_one_connection_closed():
    peer = Peer(MQTT_5)
    peer.connect()
    events = peer.send(Disconnect()) + peer.session.connection_lost() + peer.session.take_over()
    assert [type(e) for e in events] == [ConnectionClosed]
