"""What the MQTT tests share: Hypothesis strategies for every packet, a client's-eye
view of a server session, and checks that the strategies reach every packet type."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st

from fencemq.protocol.mqtt.codec import encode
from fencemq.protocol.mqtt.events import ConnectRequested, MqttServerLimits
from fencemq.protocol.mqtt.session import MqttServerSession
from fencemq.protocol.mqtt.stream import MqttStreamDecoder

from fencemq.protocol.mqtt.packets import (
    MQTT_5,
    MQTT_311,
    PacketType,
    Auth,
    Connack,
    Connect,
    Disconnect,
    Pingreq,
    Pingresp,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
    SubscriptionOptions,
    Unsuback,
    Unsubscribe,
    Will,
)
from fencemq.protocol.mqtt.properties import (
    BOOLEAN, NONZERO, NONZERO_WHEN_SENT, PROPERTIES, QOS_0_OR_1, Kind, Properties,
)
from fencemq.protocol.mqtt.reasons import CONNACK_RETURN_CODES_V311, REASONS_V5, SUBACK_RETURN_CODES_V311
from fencemq.protocol.mqtt.wire import MAX_VARINT

# MQTT strings: any Unicode scalar value but U+0000 (surrogates cannot be UTF-8)
text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12)
blob = st.binary(max_size=24)
packet_ids = st.integers(1, 0xFFFF)

_INT_RANGES = {Kind.BYTE: 0xFF, Kind.TWO_BYTE: 0xFFFF, Kind.FOUR_BYTE: 0xFFFF_FFFF, Kind.VARINT: MAX_VARINT}


def _value(spec) -> st.SearchStrategy:
    if spec.check in (BOOLEAN, QOS_0_OR_1):
        return st.integers(0, 1)
    if spec.kind in _INT_RANGES:
        return st.integers(1 if spec.check in (NONZERO, NONZERO_WHEN_SENT) else 0, _INT_RANGES[spec.kind])
    if spec.kind is Kind.UTF8:
        return text
    if spec.kind is Kind.BINARY:
        return blob
    return st.tuples(text, text)


def properties(carrier: str) -> st.SearchStrategy[Properties]:
    """Any set of properties a ``carrier`` packet may hold, repeatable ones repeated."""
    fields = {}
    for spec in PROPERTIES:
        if carrier not in spec.carriers:
            continue
        if spec.name == "user_properties":
            fields[spec.name] = st.lists(_value(spec), max_size=3).map(tuple)
        elif spec.name == "subscription_identifiers":
            fields[spec.name] = st.lists(_value(spec), max_size=3 if carrier == "PUBLISH" else 1).map(tuple)
        else:
            fields[spec.name] = st.none() | _value(spec)
    return st.fixed_dictionaries({}, optional=fields).map(lambda values: Properties(**values))


def _props(version: int, carrier: str) -> st.SearchStrategy[Properties]:
    return properties(carrier) if version == MQTT_5 else st.just(Properties())


def _reason(version: int, carrier: str) -> st.SearchStrategy[int]:
    return st.sampled_from(sorted(REASONS_V5[carrier])) if version == MQTT_5 else st.just(0)


def wills(version: int) -> st.SearchStrategy[Will]:
    return st.builds(Will, text, blob, st.integers(0, 2), st.booleans(), _props(version, "WILL"))


def connects(version: int) -> st.SearchStrategy[Connect]:
    def build(client_id, clean, keep_alive, username, password, will, props):
        if version != MQTT_5 and username is None:
            password = None  # 3.1.1 sends a password only with a user name
        return Connect(client_id, version, clean, keep_alive, username, password, will, props)

    return st.builds(build, text, st.booleans(), st.integers(0, 0xFFFF), st.none() | text, st.none() | blob,
                     st.none() | wills(version), _props(version, "CONNECT"))


def _response(cls, version: int) -> st.SearchStrategy:
    carrier = cls.packet_type.name
    return st.builds(cls, packet_ids, _reason(version, carrier), _props(version, carrier))


def _publish(version: int) -> st.SearchStrategy[Publish]:
    def build(topic, payload, qos, retain, dup, packet_id, props):
        if qos == 0:
            return Publish(topic, payload, 0, retain, False, None, props)
        return Publish(topic, payload, qos, retain, dup, packet_id, props)

    return st.builds(build, text, blob, st.integers(0, 2), st.booleans(), st.booleans(), packet_ids,
                     _props(version, "PUBLISH"))


def _options(version: int) -> st.SearchStrategy[SubscriptionOptions]:
    if version == MQTT_5:
        return st.builds(SubscriptionOptions, st.integers(0, 2), st.booleans(), st.booleans(), st.integers(0, 2))
    return st.builds(SubscriptionOptions, st.integers(0, 2))


def packets(version: int) -> st.SearchStrategy:
    """Any packet of any type the version has, either direction."""
    return st.one_of(list(packet_strategies(version).values()))


def packet_strategies(version: int) -> dict:
    """A strategy per packet type the version has."""
    codes = st.lists(st.sampled_from(sorted(REASONS_V5["SUBACK"] if version == MQTT_5
                                            else SUBACK_RETURN_CODES_V311)), min_size=1, max_size=4).map(tuple)
    unsuback_codes = (st.lists(st.sampled_from(sorted(REASONS_V5["UNSUBACK"])), min_size=1, max_size=4).map(tuple)
                      if version == MQTT_5 else st.just(()))
    connack_codes = (st.sampled_from(sorted(REASONS_V5["CONNACK"])) if version == MQTT_5
                     else st.sampled_from(sorted(CONNACK_RETURN_CODES_V311)))
    choices = [
        connects(version),
        st.builds(Connack, connack_codes, st.booleans(), _props(version, "CONNACK")),
        _publish(version),
        *(_response(cls, version) for cls in (Puback, Pubrec, Pubrel, Pubcomp)),
        st.builds(Subscribe, packet_ids, st.lists(st.tuples(text, _options(version)), min_size=1, max_size=3)
                  .map(tuple), _props(version, "SUBSCRIBE")),
        st.builds(Suback, packet_ids, codes, _props(version, "SUBACK")),
        st.builds(Unsubscribe, packet_ids, st.lists(text, min_size=1, max_size=3).map(tuple),
                  _props(version, "UNSUBSCRIBE")),
        st.builds(Unsuback, packet_ids, unsuback_codes, _props(version, "UNSUBACK")),
        st.just(Pingreq()),
        st.just(Pingresp()),
        st.builds(Disconnect, _reason(version, "DISCONNECT"), _props(version, "DISCONNECT")),
    ]
    if version == MQTT_5:
        choices.append(st.builds(Auth, _reason(version, "AUTH"), _props(version, "AUTH")))
    kinds = [Connect, Connack, Publish, Puback, Pubrec, Pubrel, Pubcomp, Subscribe, Suback, Unsubscribe, Unsuback,
             Pingreq, Pingresp, Disconnect, Auth]
    return {kind.packet_type: strategy for kind, strategy in zip(kinds, choices)}


# --------------------------------------------------------------------------- a client's-eye view of a session


def encode_all(version: int, *items) -> bytes:
    return b"".join(encode(p, version) for p in items)


class Peer:
    """Drives an MqttServerSession as a client would: packets in, the server's packets out."""

    def __init__(self, version: int = MQTT_5, limits: MqttServerLimits | None = None, now: float = 0.0) -> None:
        self.version = version
        self.session = MqttServerSession(limits or MqttServerLimits(assign_client_id=lambda: "assigned-1"), now)
        self._decoder = MqttStreamDecoder(protocol_level=version)

    def send(self, *items, now: float = 0.0) -> list:
        data = b"".join(p if isinstance(p, bytes) else encode(p, self.version) for p in items)
        return self.session.receive_bytes(data, now)

    def received(self) -> list:
        return self._decoder.packets(self.session.outbound())

    def connect(self, now: float = 0.0, session_present: bool = False, **fields) -> list:
        """CONNECT, accepted; returns the events and leaves the CONNACK read."""
        fields.setdefault("client_id", "c1")
        events = self.send(Connect(protocol_level=self.version, **fields), now=now)
        assert isinstance(events[-1], ConnectRequested), events
        later = self.session.accept(now, session_present)
        connack = self.received()[0]
        assert isinstance(connack, Connack) and connack.reason_code == 0, connack
        self.connack = connack
        return events + later


@pytest.mark.parametrize("version", [MQTT_311, MQTT_5])
def test_the_strategies_cover_every_packet_type_of_the_version(version):
    expected = set(PacketType) - ({PacketType.AUTH} if version == MQTT_311 else set())
    assert set(packet_strategies(version)) == expected
