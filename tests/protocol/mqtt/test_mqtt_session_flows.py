"""The MQTT server session, message side: QoS 0/1/2 both ways, flow control, packet identifiers,
topic aliases, SUBSCRIBE/UNSUBSCRIBE. Named after the normative statements (MQTT 5.0 numbering)."""

from __future__ import annotations

import pytest

from fencemq.protocol.mqtt.events import (
    DeliveryAcknowledged,
    DeliveryReceived,
    DeliveryResult,
    MessagePublished,
    MqttServerLimits,
    PublishReleased,
    SubscribeRequested,
    UnsubscribeRequested,
)
from fencemq.protocol.mqtt.inflight import FlowControlBlocked
from fencemq.protocol.mqtt.packets import (
    MQTT_5,
    MQTT_311,
    Connect,
    Disconnect,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
    Unsuback,
    Unsubscribe,
)
from fencemq.protocol.mqtt.packets import SubscriptionOptions as Options
from fencemq.protocol.mqtt.properties import Properties
from fencemq.protocol.mqtt.reasons import ReasonCode
from tests.protocol.mqtt.support import Peer

BOTH = pytest.mark.parametrize("version", [MQTT_311, MQTT_5], ids=["3.1.1", "5.0"])
MESSAGE_PROPERTIES = Properties(payload_format_indicator=1, message_expiry_interval=30, content_type="text/plain",
                                response_topic="replies/1", correlation_data=b"\x01",
                                user_properties=(("b", "2"), ("a", "1"), ("b", "3")))


def connected(version: int = MQTT_5, limits: MqttServerLimits | None = None, **connect) -> Peer:
    peer = Peer(version, limits)
    peer.connect(**connect)
    return peer


def reason_of_close(peer: Peer) -> int:
    (packet,) = peer.received()
    assert isinstance(packet, Disconnect), packet
    return packet.reason_code


# --------------------------------------------------------------------------- the client publishes


@BOTH
def test_MQTT_3_3_4_1_a_qos_0_publish_is_handed_up_and_not_answered(version):
    peer = connected(version)
    (event,) = peer.send(Publish("a/b", b"x", retain=True))
    assert event == MessagePublished("a/b", b"x", 0, True, None)
    assert peer.received() == []


@BOTH
def test_MQTT_4_3_2_4_puback_follows_the_shells_acknowledgement_not_the_receipt(version):
    peer = connected(version)
    (event,) = peer.send(Publish("a/b", b"x", 1, packet_id=7))
    assert (event.qos, event.packet_id) == (1, 7)
    assert peer.received() == []  # not stored yet: no PUBACK
    peer.session.acknowledge_publish(7)
    assert peer.received() == [Puback(7)]


def test_a_puback_may_carry_a_reason_code_in_v5_and_not_in_v311():
    peer = connected(MQTT_5)
    peer.send(Publish("a", b"", 1, packet_id=1))
    peer.session.acknowledge_publish(1, ReasonCode.NO_MATCHING_SUBSCRIBERS, "nobody listens")
    assert peer.received() == [Puback(1, 0x10, Properties(reason_string="nobody listens"))]
    old = connected(MQTT_311)
    old.send(Publish("a", b"", 1, packet_id=1))
    old.session.acknowledge_publish(1, ReasonCode.NOT_AUTHORIZED)
    assert old.received() == [Puback(1)]


def test_MQTT_3_1_2_32_no_reason_string_when_the_client_asked_for_no_problem_information():
    peer = connected(properties=Properties(request_problem_information=0))
    peer.send(Publish("a", b"", 1, packet_id=1))
    peer.session.acknowledge_publish(1, ReasonCode.NOT_AUTHORIZED, "not yours")
    assert peer.received() == [Puback(1, 0x87)]


def test_MQTT_4_3_2_5_a_qos_1_resend_of_a_pending_publish_is_not_handed_up_twice():
    peer = connected()
    peer.send(Publish("a", b"x", 1, packet_id=3))
    assert peer.send(Publish("a", b"x", 1, False, True, 3)) == []
    peer.session.acknowledge_publish(3)
    assert peer.received() == [Puback(3)]
    (again,) = peer.send(Publish("a", b"y", 1, packet_id=3))  # after the PUBACK: a new publication
    assert again.payload == b"y"


@BOTH
def test_MQTT_4_3_3_8_to_11_a_qos_2_publish_is_handed_up_once_then_recorded_released_and_completed(version):
    peer = connected(version)
    (event,) = peer.send(Publish("a", b"x", 2, packet_id=9))
    assert peer.send(Publish("a", b"x", 2, False, True, 9)) == []  # before the PUBREC
    peer.session.acknowledge_publish(9)
    assert peer.received() == [Pubrec(9)]
    assert peer.send(Publish("a", b"x", 2, False, True, 9)) == []  # MQTT-4.3.3-10: PUBREC again, no duplicate
    assert peer.received() == [Pubrec(9)]
    assert peer.send(Pubrel(9)) == [PublishReleased(9)]
    assert peer.received() == []  # the shell completes it once it has written that down
    assert peer.send(Pubrel(9)) == []  # a repeat meanwhile waits for that too
    assert peer.send(Publish("a", b"z", 2, packet_id=9)) == []  # the identifier is not free yet
    peer.session.complete_release(9)
    assert peer.received() == [Pubcomp(9)]
    (new,) = peer.send(Publish("a", b"z", 2, packet_id=9))  # MQTT-4.3.3-12
    assert new.payload == b"z"


def test_MQTT_4_3_3_9_a_refused_qos_2_publish_frees_its_identifier():
    peer = connected()
    peer.send(Publish("a", b"x", 2, packet_id=4))
    peer.session.acknowledge_publish(4, ReasonCode.QUOTA_EXCEEDED)
    assert peer.received() == [Pubrec(4, 0x97)]
    assert len(peer.send(Publish("a", b"x", 2, packet_id=4))) == 1


def test_a_pubrel_for_an_unknown_identifier_is_completed_with_0x92():
    peer = connected()
    assert peer.send(Pubrel(77)) == []
    assert peer.received() == [Pubcomp(77, ReasonCode.PACKET_IDENTIFIER_NOT_FOUND)]


def test_a_resumed_session_completes_qos_2_publishes_recorded_before():
    peer = Peer(MQTT_5)
    peer.send(Connect("c1", clean_start=False))
    peer.session.accept(0.0, session_present=True, inbound_releases=frozenset({5}))
    peer.received()
    assert peer.send(Publish("a", b"x", 2, False, True, 5)) == []  # already stored: PUBREC, not again
    assert peer.received() == [Pubrec(5)]
    assert peer.send(Pubrel(5)) == [PublishReleased(5)]
    peer.session.complete_release(5)
    assert peer.received() == [Pubcomp(5)]


def test_acknowledging_an_unknown_publish_is_a_caller_error():
    peer = connected()
    with pytest.raises(ValueError):
        peer.session.acknowledge_publish(1)
    peer.send(Publish("a", b"", 1, packet_id=1))
    with pytest.raises(ValueError):
        peer.session.acknowledge_publish(1, 0x92)  # not a PUBACK reason code
    peer.session.acknowledge_publish(1)


def test_MQTT_3_3_2_4_and_15_to_20_message_properties_go_up_unaltered():
    peer = connected()
    (event,) = peer.send(Publish("a", b"{}", 1, packet_id=1, properties=MESSAGE_PROPERTIES))
    assert event.properties == MESSAGE_PROPERTIES


def test_the_receive_maximum_bounds_unacknowledged_publishes_with_0x93():
    peer = connected(limits=MqttServerLimits(receive_maximum=2))
    assert peer.connack.properties.receive_maximum == 2
    peer.send(Publish("a", b"", 1, packet_id=1), Publish("a", b"", 2, packet_id=2))
    peer.session.acknowledge_publish(1)
    peer.send(Publish("a", b"", 1, packet_id=3))  # one slot came back
    peer.received()
    peer.send(Publish("a", b"", 0))  # QoS 0 is not counted
    peer.send(Publish("a", b"", 1, packet_id=4))
    assert reason_of_close(peer) == ReasonCode.RECEIVE_MAXIMUM_EXCEEDED


@pytest.mark.parametrize("publish, limits, reason", [
    (Publish("a/+", b""), None, ReasonCode.TOPIC_NAME_INVALID),  # MQTT-3.3.2-2
    (Publish("", b""), None, ReasonCode.PROTOCOL_ERROR),  # no topic, no alias
    (Publish("a", b"", properties=Properties(subscription_identifiers=(1,))), None,
     ReasonCode.PROTOCOL_ERROR),  # MQTT-3.3.4-6
    (Publish("a", b"", 2, packet_id=1), MqttServerLimits(maximum_qos=1), ReasonCode.QOS_NOT_SUPPORTED),
    (Publish("a", b"", retain=True), MqttServerLimits(retain_available=False), ReasonCode.RETAIN_NOT_SUPPORTED),
], ids=["wildcard topic", "empty topic", "subscription identifier", "qos over maximum", "retain unavailable"])
def test_a_publish_the_server_cannot_take_ends_the_connection_with_its_reason(publish, limits, reason):
    peer = connected(limits=limits)
    peer.send(publish)
    assert reason_of_close(peer) == reason


# --------------------------------------------------------------------------- topic aliases from the client


def test_MQTT_3_3_2_12_a_topic_alias_is_set_then_used_then_remapped():
    peer = connected(limits=MqttServerLimits(topic_alias_maximum=2))
    first = peer.send(Publish("a/b", b"1", properties=Properties(topic_alias=2)))
    again = peer.send(Publish("", b"2", properties=Properties(topic_alias=2)))
    peer.send(Publish("c", b"3", properties=Properties(topic_alias=2)))
    remapped = peer.send(Publish("", b"4", properties=Properties(topic_alias=2)))
    assert [e[0].topic for e in (first, again, remapped)] == ["a/b", "a/b", "c"]
    assert again[0].properties.topic_alias is None  # the alias is the connection's, not the message's


@pytest.mark.parametrize("publish", [
    b"\x30\x07\x00\x01a\x03\x23\x00\x00",  # alias 0, which our encoder refuses to write (MQTT-3.3.2-8)
    Publish("a", b"", properties=Properties(topic_alias=3)),
], ids=["alias 0", "alias over the maximum"])
def test_a_topic_alias_of_0_or_over_the_maximum_is_0x94(publish):
    peer = connected(limits=MqttServerLimits(topic_alias_maximum=2))
    peer.send(publish)
    assert reason_of_close(peer) == ReasonCode.TOPIC_ALIAS_INVALID


def test_an_alias_with_no_topic_yet_is_a_protocol_error():
    peer = connected()
    peer.send(Publish("", b"", properties=Properties(topic_alias=1)))
    assert reason_of_close(peer) == ReasonCode.PROTOCOL_ERROR


def test_MQTT_3_3_2_7_topic_aliases_do_not_outlive_the_connection():
    first = connected()
    first.send(Publish("a", b"", properties=Properties(topic_alias=1)))
    second = connected()
    second.send(Publish("", b"", properties=Properties(topic_alias=1)))
    assert reason_of_close(second) == ReasonCode.PROTOCOL_ERROR


# --------------------------------------------------------------------------- the server delivers


@BOTH
def test_MQTT_4_3_2_3_a_qos_1_delivery_stays_in_flight_until_its_puback(version):
    peer = connected(version)
    result = peer.session.deliver("a", b"x", 1)
    assert result == DeliveryResult(True, 1)
    assert peer.received() == [Publish("a", b"x", 1, packet_id=1)]
    assert peer.send(Puback(1)) == [DeliveryAcknowledged(1, 1)]
    assert peer.send(Puback(1)) == []  # a second PUBACK settles nothing


@BOTH
def test_MQTT_4_3_3_4_to_6_a_qos_2_delivery_is_released_on_pubrec_and_over_on_pubcomp(version):
    peer = connected(version)
    peer.session.deliver("a", b"x", 2)
    peer.received()
    assert peer.send(Pubrec(1)) == [DeliveryReceived(1)]
    assert peer.received() == []  # the shell releases it once it has settled it
    assert peer.send(Pubrec(1)) == []  # a repeat meanwhile waits for that too
    assert peer.received() == []
    peer.session.release_delivery(1)
    assert peer.received() == [Pubrel(1)]
    assert peer.send(Pubrec(1)) == []  # a repeated PUBREC gets the PUBREL again, never the PUBLISH
    assert peer.received() == [Pubrel(1)]
    assert peer.send(Pubcomp(1)) == [DeliveryAcknowledged(1, 2)]
    assert peer.session.send_quota == peer.session.outbound_flows.send_maximum


def test_MQTT_4_4_0_2_and_4_8_2_6_a_refusing_puback_or_pubrec_ends_the_delivery_with_its_reason():
    peer = connected()
    peer.session.deliver("a", b"x", 1)
    peer.session.deliver("a", b"y", 2)
    peer.received()
    assert peer.send(Puback(1, 0x80)) == [DeliveryAcknowledged(1, 1, 0x80)]
    assert peer.send(Pubrec(2, 0x87)) == [DeliveryAcknowledged(2, 2, 0x87)]
    assert peer.received() == []  # no PUBREL for a refused delivery


def test_a_pubrec_for_an_unknown_identifier_is_released_with_0x92():
    peer = connected()
    assert peer.send(Pubrec(5)) == []
    assert peer.received() == [Pubrel(5, ReasonCode.PACKET_IDENTIFIER_NOT_FOUND)]


def test_MQTT_2_2_1_4_identifiers_are_unused_ones_and_reused_only_after_the_flow_ends():
    peer = connected()
    ids = [peer.session.deliver("a", b"", 1).packet_id for _ in range(3)]
    assert ids == [1, 2, 3]
    peer.send(Puback(2))
    flows = peer.session.outbound_flows
    flows._next_id = 1  # wrap around: the allocator must skip what is still in flight
    assert peer.session.deliver("a", b"", 1).packet_id == 2


def test_MQTT_3_3_4_9_and_4_9_0_2_the_clients_receive_maximum_bounds_deliveries_in_flight():
    peer = connected(properties=Properties(receive_maximum=2))
    assert peer.session.send_quota == 2
    peer.session.deliver("a", b"", 1)
    peer.session.deliver("a", b"", 2)
    assert peer.session.send_quota == 0
    with pytest.raises(FlowControlBlocked):
        peer.session.deliver("a", b"", 1)
    assert peer.session.deliver("a", b"q0", 0).sent  # MQTT-3.3.4-10: QoS 0 is not held back
    peer.send(Puback(1))
    assert peer.session.send_quota == 1


def test_MQTT_3_1_2_27_and_28_a_delivery_too_large_for_the_client_is_discarded():
    peer = connected(properties=Properties(maximum_packet_size=32))
    assert peer.session.deliver("a", b"x" * 64, 1) == DeliveryResult(False)
    assert peer.received() == []
    assert peer.session.send_quota == 0xFFFF  # its identifier was not kept
    assert peer.session.deliver("a", b"x", 1).sent


@BOTH
def test_MQTT_3_3_1_1_and_4_4_0_1_a_redelivery_keeps_its_identifier_and_sets_dup(version):
    peer = connected(version, clean_start=False)
    assert peer.session.deliver("a", b"x", 1, dup=True, packet_id=40).packet_id == 40
    assert peer.received() == [Publish("a", b"x", 1, False, True, 40)]
    with pytest.raises(ValueError):
        peer.session.deliver("a", b"x", 1, dup=True, packet_id=40)  # still in flight
    peer.session.resend_release(41)
    assert peer.received() == [Pubrel(41)]
    assert peer.send(Pubcomp(41)) == [DeliveryAcknowledged(41, 2)]


def test_v5_deliveries_carry_the_message_properties_and_subscription_identifiers():
    peer = connected()
    props = Properties(subscription_identifiers=(3, 9), user_properties=(("k", "v"),), content_type="a/b")
    peer.session.deliver("t", b"x", 0, True, props)
    assert peer.received() == [Publish("t", b"x", 0, True, properties=props)]


def test_v311_deliveries_drop_the_properties():
    peer = connected(MQTT_311)
    peer.session.deliver("t", b"x", 1, False, MESSAGE_PROPERTIES)
    assert peer.received() == [Publish("t", b"x", 1, packet_id=1)]


def test_MQTT_3_1_2_29_outbound_topic_aliases_stay_under_the_clients_maximum():
    peer = connected(properties=Properties(topic_alias_maximum=1))
    for topic in ("a/b", "a/b", "c"):
        peer.session.deliver(topic, b"", 0)
    sent = peer.received()
    assert [(p.topic, p.properties.topic_alias) for p in sent] == [("a/b", 1), ("", 1), ("c", None)]


def test_MQTT_3_1_2_30_no_topic_alias_for_a_client_that_allows_none():
    peer = connected()
    peer.session.deliver("a/b", b"", 0)
    peer.session.deliver("a/b", b"", 0)
    assert [p.properties.topic_alias for p in peer.received()] == [None, None]


def test_deliver_before_the_connection_is_accepted_is_a_caller_error():
    peer = Peer(MQTT_5)
    with pytest.raises(RuntimeError):
        peer.session.deliver("a", b"", 0)


# --------------------------------------------------------------------------- SUBSCRIBE and UNSUBSCRIBE


@BOTH
def test_MQTT_3_8_4_1_and_3_9_3_1_one_suback_with_a_code_per_filter_in_order(version):
    peer = connected(version)
    (event,) = peer.send(Subscribe(5, (("a/+", Options(2)), ("b/#", Options(1)), ("c", Options(0)))))
    assert isinstance(event, SubscribeRequested) and [r.topic_filter for r in event.requests] == ["a/+", "b/#", "c"]
    assert peer.received() == []
    peer.session.complete_subscribe(5, [2, ReasonCode.NOT_AUTHORIZED, 0])
    expected_refusal = 0x87 if version == MQTT_5 else 0x80
    assert peer.received() == [Suback(5, (2, expected_refusal, 0))]  # MQTT-3.8.4-2: the same identifier


@BOTH
def test_MQTT_4_7_1_1_and_2_an_invalid_filter_is_refused_in_the_suback(version):
    peer = connected(version)
    (event,) = peer.send(Subscribe(1, (("a/#/b", Options(1)), ("a+", Options(1)), ("ok/+", Options(1)))))
    refused = 0x8F if version == MQTT_5 else 0x80
    assert [r.refusal for r in event.requests] == [refused, refused, None]
    with pytest.raises(ValueError):
        peer.session.complete_subscribe(1, [1, 1, 1])  # a refused filter cannot be granted
    peer.session.complete_subscribe(1)
    assert peer.received() == [Suback(1, (refused, refused, 1))]


def test_MQTT_4_8_2_1_and_2_shared_subscriptions_are_parsed_and_checked():
    peer = connected()
    (event,) = peer.send(Subscribe(1, (("$share/g1/s/+", Options(1)), ("$share/g1", Options(1)),
                                       ("$share//a", Options(1)))))
    first, no_filter, no_name = event.requests
    assert (first.share_group, first.filter, first.refusal) == ("g1", "s/+", None)
    assert no_filter.refusal == no_name.refusal == ReasonCode.TOPIC_FILTER_INVALID


def test_MQTT_3_8_3_4_no_local_on_a_shared_subscription_is_a_protocol_error():
    peer = connected()
    peer.send(Subscribe(1, (("$share/g/a", Options(1, no_local=True)),)))
    assert reason_of_close(peer) == ReasonCode.PROTOCOL_ERROR


def test_MQTT_3_2_2_10_and_3_8_4_7_granted_qos_is_capped_by_the_server_maximum():
    peer = connected(limits=MqttServerLimits(maximum_qos=1))
    (event,) = peer.send(Subscribe(1, (("a", Options(2)),)))
    assert event.requests[0].granted_qos == 1
    with pytest.raises(ValueError):
        peer.session.complete_subscribe(1, [2])
    peer.session.complete_subscribe(1)
    assert peer.received() == [Suback(1, (1,))]


def test_subscription_options_and_identifier_go_up_as_sent():
    peer = connected()
    options = Options(1, no_local=True, retain_as_published=True, retain_handling=2)
    (event,) = peer.send(Subscribe(1, (("a", options),), Properties(subscription_identifiers=(42,),
                                                                     user_properties=(("k", "v"),))))
    assert event.requests[0].options == options
    assert (event.subscription_identifier, event.user_properties) == (42, (("k", "v"),))


@pytest.mark.parametrize("limits, topic_filter, refusal", [
    (MqttServerLimits(shared_subscription_available=False), "$share/g/a", 0x9E),
    (MqttServerLimits(wildcard_subscription_available=False), "a/#", 0xA2),
])
def test_features_the_server_does_not_offer_are_refused_per_filter(limits, topic_filter, refusal):
    peer = connected(limits=limits)
    (event,) = peer.send(Subscribe(1, ((topic_filter, Options()),)))
    assert event.requests[0].refusal == refusal


def test_a_subscription_identifier_the_server_does_not_offer_ends_the_connection_0xA1():
    peer = connected(limits=MqttServerLimits(subscription_identifier_available=False))
    peer.send(Subscribe(1, (("a", Options()),), Properties(subscription_identifiers=(1,))))
    assert reason_of_close(peer) == ReasonCode.SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED


def test_a_subscribe_or_unsubscribe_reusing_an_identifier_awaiting_its_answer_gets_0x91():
    peer = connected()
    peer.send(Subscribe(1, (("a", Options()),)), Unsubscribe(2, ("a",)))
    assert peer.send(Subscribe(1, (("b", Options()), ("c", Options())))) == []
    assert peer.send(Unsubscribe(2, ("b",))) == []
    assert peer.received() == [Suback(1, (0x91, 0x91)), Unsuback(2, (0x91,))]
    peer.session.complete_subscribe(1)  # the first request is still answered
    assert peer.received() == [Suback(1, (0,))]


def test_v311_reusing_an_identifier_awaiting_its_suback_closes_the_connection():
    peer = connected(MQTT_311)
    peer.send(Subscribe(1, (("a", Options()),)))
    peer.send(Subscribe(1, (("b", Options()),)))
    assert peer.session.closed and peer.received() == []


@BOTH
def test_MQTT_3_10_4_4_to_6_one_unsuback_per_unsubscribe(version):
    peer = connected(version)
    (event,) = peer.send(Unsubscribe(3, ("a", "b")))
    assert event == UnsubscribeRequested(3, ("a", "b"))
    if version == MQTT_5:
        peer.session.complete_unsubscribe(3, [0, ReasonCode.NO_SUBSCRIPTION_EXISTED])
        assert peer.received() == [Unsuback(3, (0, 0x11))]
    else:
        peer.session.complete_unsubscribe(3)
        assert peer.received() == [Unsuback(3)]


def test_completing_a_request_that_is_not_pending_is_a_caller_error():
    peer = connected()
    with pytest.raises(ValueError):
        peer.session.complete_subscribe(9)
    with pytest.raises(ValueError):
        peer.session.complete_unsubscribe(9)
    peer.send(Unsubscribe(2, ("a",)))
    with pytest.raises(ValueError):
        peer.session.complete_unsubscribe(2, [0, 0])  # one code per filter
    peer.session.complete_unsubscribe(2)
