"""The MQTT codec: every packet round-trips in both versions; the wire rules of MQTT 3.1.1
and 5.0 (variable byte integers, UTF-8 strings, fixed-header flags, properties) hold;
what breaks them is refused with the reason code the standard names."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fencemq.protocol.mqtt.codec import decode_body, encode
from fencemq.protocol.mqtt.packets import (
    MQTT_5,
    MQTT_311,
    Auth,
    Connack,
    Connect,
    Disconnect,
    PacketType,
    Pingreq,
    Pingresp,
    Puback,
    Publish,
    Pubrel,
    Suback,
    Subscribe,
    SubscriptionOptions,
    Unsuback,
    Unsubscribe,
    Will,
)
from fencemq.protocol.mqtt.properties import Properties, decode_properties, encode_properties
from fencemq.protocol.mqtt.reasons import (
    MalformedPacket,
    MqttError,
    ProtocolViolation,
    ReasonCode,
    UnsupportedProtocolVersion,
)
from fencemq.protocol.mqtt.stream import decode_all
from fencemq.protocol.mqtt.wire import Reader, read_varint_prefix, utf8, varint
from tests.protocol.mqtt.support import packet_strategies, properties

ROUND_TRIP = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def decode_one(data: bytes, version: int | None):
    (packet,) = decode_all(data, version)
    return packet


def body(first: int, payload: bytes) -> bytes:
    return bytes([first]) + varint(len(payload)) + payload


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("version, kind", [(v, k) for v in (MQTT_311, MQTT_5) for k in packet_strategies(v)],
                         ids=lambda x: x.name if isinstance(x, PacketType) else {4: "3.1.1", 5: "5.0"}[x])
def test_every_packet_round_trips(version, kind):
    strategies = packet_strategies(version)

    @ROUND_TRIP
    @given(strategies[kind])
    def round_trip(packet):
        data = encode(packet, version)
        assert decode_one(data, None if kind is PacketType.CONNECT else version) == packet
        assert encode(decode_one(data, None if kind is PacketType.CONNECT else version), version) == data

    round_trip()


@ROUND_TRIP
@given(st.sampled_from(["CONNECT", "CONNACK", "PUBLISH", "WILL", "PUBACK", "SUBSCRIBE", "SUBACK", "UNSUBSCRIBE",
                        "UNSUBACK", "DISCONNECT", "AUTH"]).flatmap(lambda c: st.tuples(st.just(c), properties(c))))
def test_properties_round_trip_for_every_carrier(carrier_and_props):
    carrier, props = carrier_and_props
    assert decode_properties(Reader(encode_properties(props, carrier)), carrier) == props


# --------------------------------------------------------------------------- exact bytes


@pytest.mark.parametrize("packet, version, data", [
    (Pingreq(), MQTT_5, b"\xc0\x00"),
    (Pingresp(), MQTT_311, b"\xd0\x00"),
    (Disconnect(), MQTT_311, b"\xe0\x00"),
    (Disconnect(), MQTT_5, b"\xe0\x00"),  # reason 0x00 and no properties: both left out (§3.14.2.1)
    (Disconnect(ReasonCode.SESSION_TAKEN_OVER), MQTT_5, b"\xe0\x01\x8e"),
    (Puback(10), MQTT_5, b"\x40\x02\x00\x0a"),
    (Puback(10, 0x10), MQTT_5, b"\x40\x03\x00\x0a\x10"),
    (Pubrel(1), MQTT_311, b"\x62\x02\x00\x01"),
    (Connack(0, True), MQTT_311, b"\x20\x02\x01\x00"),
    (Connack(0, False), MQTT_5, b"\x20\x03\x00\x00\x00"),
    (Publish("a/b", b"hi", 1, True, True, 5), MQTT_311, b"\x3b\x09\x00\x03a/b\x00\x05hi"),
    (Subscribe(2, (("a/#", SubscriptionOptions(1, True, True, 2)),)), MQTT_5, b"\x82\x09\x00\x02\x00\x00\x03a/#\x2d"),
    (Suback(2, (1, 0x80)), MQTT_311, b"\x90\x04\x00\x02\x01\x80"),
    (Unsuback(3), MQTT_311, b"\xb0\x02\x00\x03"),
    (Connect("id", MQTT_311, True, 60), MQTT_311, b"\x10\x0e\x00\x04MQTT\x04\x02\x00\x3c\x00\x02id"),
    (Connect("", MQTT_5, True, 0, None, None, Will("w", b"x", 2, True)), MQTT_5,
     b"\x10\x14\x00\x04MQTT\x05\x36\x00\x00\x00\x00\x00\x00\x00\x01w\x00\x01x"),
])
def test_packets_encode_to_the_bytes_the_standard_shows(packet, version, data):
    assert encode(packet, version) == data
    assert decode_one(data, None if isinstance(packet, Connect) else version) == packet


# --------------------------------------------------------------------------- data representations


@pytest.mark.parametrize("value, size", [(0, 1), (127, 1), (128, 2), (16_383, 2), (16_384, 3), (2_097_151, 3),
                                         (2_097_152, 4), (268_435_455, 4)])
def test_variable_byte_integers_use_the_fewest_bytes(value, size):
    data = varint(value)
    assert len(data) == size
    assert read_varint_prefix(data) == (value, size)


def test_a_variable_byte_integer_has_at_most_four_bytes():
    with pytest.raises(ValueError):
        varint(268_435_456)
    with pytest.raises(MalformedPacket):
        read_varint_prefix(b"\xff\xff\xff\xff\x01")


def test_MQTT_1_5_5_1_a_variable_byte_integer_not_in_its_shortest_form_is_malformed():
    with pytest.raises(MalformedPacket):
        read_varint_prefix(b"\x80\x00")


@pytest.mark.parametrize("raw", [b"\xc0\x80", b"\xed\xa0\x80", b"\xff", b"\xe2\x82"],
                         ids=["overlong NUL", "surrogate", "invalid byte", "truncated"])
def test_MQTT_1_5_4_1_ill_formed_utf8_is_malformed(raw):
    packet = body(0x30, len(raw).to_bytes(2, "big") + raw)
    with pytest.raises(MalformedPacket) as info:
        decode_one(packet, MQTT_311)
    assert info.value.reason_code == ReasonCode.MALFORMED_PACKET


def test_MQTT_1_5_4_2_a_string_holding_U0000_is_malformed_and_is_never_encoded():
    with pytest.raises(MalformedPacket):
        decode_one(body(0x30, b"\x00\x03a\x00b"), MQTT_311)
    with pytest.raises(ValueError):
        encode(Publish("a\x00b"), MQTT_311)


def test_MQTT_1_5_4_3_a_byte_order_mark_is_kept_not_stripped():
    packet = decode_one(body(0x30, b"\x00\x04\xef\xbb\xbfa"), MQTT_311)
    assert packet.topic == "\ufeffa"


def test_strings_hold_at_most_65535_bytes():
    assert len(utf8("x" * 65_535)) == 65_537
    with pytest.raises(ValueError):
        utf8("x" * 65_536)


# --------------------------------------------------------------------------- fixed header


@pytest.mark.parametrize("kind", [t for t in PacketType if t not in (PacketType.PUBLISH, PacketType.CONNECT)],
                         ids=lambda k: k.name)
def test_MQTT_2_1_3_1_wrong_fixed_header_flags_are_malformed(kind):
    right = 0b0010 if kind in (PacketType.PUBREL, PacketType.SUBSCRIBE, PacketType.UNSUBSCRIBE) else 0
    with pytest.raises(MalformedPacket):
        decode_body(kind << 4 | (right ^ 0b0001), b"", MQTT_5)


def test_packet_type_0_is_reserved_and_AUTH_does_not_exist_in_311():
    with pytest.raises(MalformedPacket):
        decode_body(0x00, b"", MQTT_5)
    with pytest.raises(MalformedPacket):
        decode_body(0xF0, b"", MQTT_311)


def test_MQTT_3_3_1_4_a_publish_with_both_qos_bits_set_is_malformed():
    with pytest.raises(MalformedPacket):
        decode_body(0x36, b"\x00\x01a\x00\x01", MQTT_311)


def test_MQTT_3_3_1_2_a_qos_0_publish_with_dup_is_malformed():
    with pytest.raises(MalformedPacket):
        decode_body(0x38, b"\x00\x01a", MQTT_311)


def test_MQTT_2_2_1_3_packet_identifier_0_is_a_protocol_error():
    for first, data in [(0x32, b"\x00\x01a\x00\x00"), (0x40, b"\x00\x00"), (0x82, b"\x00\x00\x00\x01a\x00")]:
        with pytest.raises(ProtocolViolation):
            decode_body(first, data, MQTT_311)


def test_trailing_bytes_after_a_packet_are_malformed():
    for first, data, version in [(0x40, b"\x00\x01\x00", MQTT_311), (0xE0, b"\x00", MQTT_311),
                                 (0xC0, b"\x00", MQTT_5), (0x20, b"\x00\x00\x00\x00", MQTT_311)]:
        with pytest.raises(MalformedPacket):
            decode_body(first, data, version)


# --------------------------------------------------------------------------- CONNECT


def connect_bytes(flags: int, level: int = 5, rest: bytes = b"\x00\x00\x00\x00\x01c", name: bytes = b"MQTT") -> bytes:
    return len(name).to_bytes(2, "big") + name + bytes([level, flags]) + rest


def test_MQTT_3_1_2_3_the_reserved_connect_flag_is_malformed_and_the_level_is_known():
    with pytest.raises(MalformedPacket) as info:
        decode_body(0x10, connect_bytes(0x03), None)
    assert info.value.protocol_level == MQTT_5


@pytest.mark.parametrize("flags", [0x08, 0x10, 0x20], ids=["will qos 1", "will qos 2", "will retain"])
def test_MQTT_3_1_2_13_and_15_will_qos_and_retain_need_the_will_flag(flags):
    with pytest.raises(MalformedPacket):
        decode_body(0x10, connect_bytes(0x02 | flags), None)


def test_MQTT_3_1_2_14_will_qos_3_is_malformed():
    with pytest.raises(MalformedPacket):
        decode_body(0x10, connect_bytes(0x02 | 0x04 | 0x18), None)


def test_v311_MQTT_3_1_2_22_a_password_needs_a_user_name_but_not_in_v5():
    rest = b"\x00\x00\x00\x01c\x00\x02pw"
    with pytest.raises(MalformedPacket):
        decode_body(0x10, connect_bytes(0x42, 4, rest), None)
    packet = decode_body(0x10, connect_bytes(0x42, 5, b"\x00\x00\x00\x00\x01c\x00\x02pw"), None)
    assert packet.password == b"pw" and packet.username is None


@pytest.mark.parametrize("name, level", [(b"MQIsdp", 3), (b"MQTT", 3), (b"MQTT", 6), (b"HTTP", 5)])
def test_a_connect_of_another_protocol_is_unsupported(name, level):
    with pytest.raises(UnsupportedProtocolVersion) as info:
        decode_body(0x10, connect_bytes(0x02, level, name=name), None)
    assert (info.value.protocol_name, info.value.protocol_level) == (name.decode(), level)
    assert info.value.reason_code == ReasonCode.UNSUPPORTED_PROTOCOL_VERSION


def test_MQTT_3_1_0_1_nothing_but_connect_decodes_first():
    with pytest.raises(ProtocolViolation):
        decode_body(0xC0, b"", None)


# --------------------------------------------------------------------------- properties


def test_a_property_the_packet_may_not_carry_is_malformed():
    # Topic Alias (0x23) in a CONNECT
    with pytest.raises(MalformedPacket):
        decode_body(0x10, connect_bytes(0x02, 5, b"\x00\x00\x03\x23\x00\x01\x00\x01c"), None)
    with pytest.raises(ValueError):
        encode(Connect("c", properties=Properties(topic_alias=1)))


def test_an_unknown_property_identifier_is_malformed():
    with pytest.raises(MalformedPacket):
        decode_body(0xE0, b"\x00\x02\x7f\x00", MQTT_5)


def test_a_property_given_twice_is_a_protocol_error():
    # Session Expiry Interval twice in a DISCONNECT
    twice = b"\x11\x00\x00\x00\x01" * 2
    with pytest.raises(ProtocolViolation):
        decode_body(0xE0, b"\x00" + bytes([len(twice)]) + twice, MQTT_5)


def test_user_properties_repeat_and_keep_their_order():
    pairs = (("k", "2"), ("a", "1"), ("k", "1"))
    packet = Disconnect(0, Properties(user_properties=pairs))
    assert decode_one(encode(packet), MQTT_5).properties.user_properties == pairs


def test_subscription_identifiers_repeat_in_publish_but_not_in_subscribe():
    publish = Publish("t", b"", 0, properties=Properties(subscription_identifiers=(1, 268_435_455)))
    assert decode_one(encode(publish), MQTT_5) == publish
    two = b"\x0b\x01\x0b\x02"
    with pytest.raises(ProtocolViolation):
        decode_body(0x82, b"\x00\x01" + bytes([len(two)]) + two + b"\x00\x01a\x00", MQTT_5)


@pytest.mark.parametrize("carrier, block", [
    ("CONNECT", b"\x21\x00\x00"),  # Receive Maximum 0
    ("CONNECT", b"\x27\x00\x00\x00\x00"),  # Maximum Packet Size 0
    ("CONNECT", b"\x17\x02"),  # Request Problem Information 2
    ("PUBLISH", b"\x01\x02"),  # Payload Format Indicator 2
    ("PUBLISH", b"\x0b\x00"),  # Subscription Identifier 0
    ("CONNACK", b"\x24\x02"),  # Maximum QoS 2
])
def test_a_property_value_out_of_its_range_is_a_protocol_error(carrier, block):
    with pytest.raises(ProtocolViolation):
        decode_properties(Reader(varint(len(block)) + block), carrier)


def test_v311_packets_carry_no_properties():
    with pytest.raises(ValueError):
        encode(Publish("t", properties=Properties(content_type="x")), MQTT_311)
    with pytest.raises(ValueError):
        encode(Puback(1, 0x80), MQTT_311)
    with pytest.raises(ValueError):
        encode(Auth(), MQTT_311)


# --------------------------------------------------------------------------- SUBSCRIBE and friends


def test_MQTT_3_8_3_5_reserved_subscription_option_bits_are_malformed():
    with pytest.raises(MalformedPacket):
        decode_body(0x82, b"\x00\x01\x00\x00\x01a\x40", MQTT_5)
    with pytest.raises(MalformedPacket):  # 3.1.1: every bit above the QoS is reserved
        decode_body(0x82, b"\x00\x01\x00\x01a\x04", MQTT_311)


def test_retain_handling_3_is_a_protocol_error_and_qos_3_malformed():
    with pytest.raises(ProtocolViolation):
        decode_body(0x82, b"\x00\x01\x00\x00\x01a\x30", MQTT_5)
    with pytest.raises(MalformedPacket):
        decode_body(0x82, b"\x00\x01\x00\x00\x01a\x03", MQTT_5)


def test_MQTT_3_8_3_2_and_3_10_3_2_subscribe_and_unsubscribe_carry_a_filter():
    with pytest.raises(ProtocolViolation):
        decode_body(0x82, b"\x00\x01\x00", MQTT_5)
    with pytest.raises(ProtocolViolation):
        decode_body(0xA2, b"\x00\x01", MQTT_311)
    with pytest.raises(ValueError):
        encode(Subscribe(1, ()))
    with pytest.raises(ValueError):
        encode(Unsubscribe(1, ()))


@pytest.mark.parametrize("packet", [Puback(1, 0x92), Pubrel(1, 0x10), Disconnect(0x01), Connack(0x01),
                                    Suback(1, (0x03,)), Auth(0x80)], ids=repr)
def test_a_reason_code_the_packet_may_not_carry_is_refused_both_ways(packet):
    with pytest.raises(ValueError):
        encode(packet, MQTT_5)


def test_a_reason_code_not_allowed_is_a_protocol_error_when_decoded():
    with pytest.raises(ProtocolViolation):
        decode_body(0x40, b"\x00\x01\x92", MQTT_5)


def test_short_forms_of_v5_acknowledgements_decode_as_success_without_properties():
    assert decode_body(0x40, b"\x00\x07", MQTT_5) == Puback(7)
    assert decode_body(0x62, b"\x00\x07\x92", MQTT_5) == Pubrel(7, 0x92)
    assert decode_body(0xE0, b"", MQTT_5) == Disconnect()
    assert decode_body(0xF0, b"", MQTT_5) == Auth()


def test_errors_carry_their_reason_code():
    assert MalformedPacket("x").reason_code == 0x81
    assert ProtocolViolation("x").reason_code == 0x82
    assert MqttError("x", ReasonCode.TOPIC_ALIAS_INVALID).reason_code == 0x94
    assert "0x94 TOPIC_ALIAS_INVALID" in str(MqttError("x", 0x94))
