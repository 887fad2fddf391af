"""The streaming MQTT decoder: bytes split anywhere give the same packets; a packet announced
over the maximum packet size is refused before its body is buffered."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fencemq.protocol.mqtt.codec import encode
from fencemq.protocol.mqtt.packets import MQTT_5, MQTT_311, Connect, Pingreq, Puback, Publish, Subscribe
from fencemq.protocol.mqtt.packets import SubscriptionOptions as Options
from fencemq.protocol.mqtt.properties import Properties
from fencemq.protocol.mqtt.reasons import MalformedPacket, PacketTooLarge, ProtocolViolation, ReasonCode
from fencemq.protocol.mqtt.stream import MqttStreamDecoder, decode_all
from tests.protocol.mqtt.support import connects, packets

SESSION = [
    Connect("client-1", MQTT_5, False, 30, "user", b"secret", properties=Properties(session_expiry_interval=60)),
    Subscribe(1, (("$share/g/sensors/+", Options(1)), ("a/#", Options(2, True)))),
    Publish("sensors/1", b"x" * 300, 1, packet_id=2, properties=Properties(user_properties=(("k", "v"),))),
    Publish("sensors/2", b"", 0),
    Puback(7),
    Pingreq(),
]
SESSION_BYTES = b"".join(encode(p, MQTT_5) for p in SESSION)


def test_a_session_split_at_every_byte_decodes_the_same():
    for cut in range(len(SESSION_BYTES) + 1):
        decoder = MqttStreamDecoder()
        got = decoder.packets(SESSION_BYTES[:cut]) + decoder.packets(SESSION_BYTES[cut:])
        assert got == SESSION, cut
        assert decoder.buffered == 0


def test_a_session_fed_one_byte_at_a_time_decodes_the_same():
    decoder = MqttStreamDecoder()
    got = []
    for i in range(len(SESSION_BYTES)):
        got += decoder.packets(SESSION_BYTES[i:i + 1])
        assert decoder.buffered < 1 + 2 + 2 + 300 + 20  # never more than the packet being read
    assert got == SESSION


@pytest.mark.parametrize("version", [MQTT_311, MQTT_5])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_packets_in_any_split_decode_as_they_were_encoded(version, data):
    first = data.draw(connects(version))
    rest = data.draw(st.lists(packets(version).filter(lambda p: not isinstance(p, Connect)), max_size=6))
    stream = b"".join(encode(p, version) for p in [first, *rest])
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    decoder = MqttStreamDecoder()
    got = []
    for start, end in zip([0, *cuts], [*cuts, len(stream)]):
        got += decoder.packets(stream[start:end])
    assert got == [first, *rest]
    assert decoder.protocol_level == version


def test_the_first_connect_sets_the_protocol_level():
    decoder = MqttStreamDecoder()
    decoder.packets(encode(Connect("c", MQTT_311), MQTT_311))
    assert decoder.protocol_level == MQTT_311


def test_MQTT_3_1_0_1_a_first_packet_other_than_connect_is_refused():
    with pytest.raises(ProtocolViolation):
        MqttStreamDecoder().packets(encode(Pingreq()))


def test_a_packet_announced_over_the_maximum_is_refused_from_its_header_alone():
    decoder = MqttStreamDecoder(maximum_packet_size=1000, protocol_level=MQTT_5)
    header = b"\x30" + bytes([0x80 | 0x7F, 0x7F])  # a PUBLISH announcing 16383 bytes
    with pytest.raises(PacketTooLarge) as info:
        decoder.packets(header)
    assert info.value.reason_code == ReasonCode.PACKET_TOO_LARGE
    assert decoder.buffered == 0


def test_the_maximum_packet_size_counts_the_whole_packet():
    limit = 100
    fits = encode(Publish("t", b"x" * (limit - 5)), MQTT_311)
    assert len(fits) == limit
    assert decode_all(fits, MQTT_311, limit) == [Publish("t", b"x" * (limit - 5))]
    with pytest.raises(PacketTooLarge):
        decode_all(encode(Publish("t", b"x" * (limit - 4)), MQTT_311), MQTT_311, limit)


def test_a_fifth_remaining_length_byte_is_malformed_before_the_body_arrives():
    decoder = MqttStreamDecoder(protocol_level=MQTT_5)
    with pytest.raises(MalformedPacket):
        decoder.packets(b"\x30\xff\xff\xff\xff")


def test_after_an_error_the_stream_stays_failed():
    decoder = MqttStreamDecoder(protocol_level=MQTT_5)
    with pytest.raises(MalformedPacket):
        decoder.packets(b"\x00\x00")
    with pytest.raises(MalformedPacket):
        decoder.packets(encode(Pingreq()))


def test_packets_before_a_bad_one_are_still_handed_out():
    decoder = MqttStreamDecoder(protocol_level=MQTT_5)
    decoder.feed(encode(Pingreq()) + b"\x00\x00")
    assert decoder.next_packet() == Pingreq()
    with pytest.raises(MalformedPacket):
        decoder.next_packet()


def test_decode_all_refuses_an_unfinished_packet():
    with pytest.raises(MalformedPacket):
        decode_all(encode(Pingreq())[:1], MQTT_5)
