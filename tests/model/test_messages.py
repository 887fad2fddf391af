"""Tests for fencemq.model.messages: the stored body (RESP form, and the older msgpack form) and
the deliveries decoded from it."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fencemq.model.messages import Delivery, StoredDelivery, pack_body, unpack_delivery, wire_form

STAMP = b"1700000000123:"


def old_body(payload: bytes, headers, qos: int, producer, topic=None) -> bytes:
    """A body as workers wrote it before the RESP form (msgpack)."""
    packed = msgpack.packb([payload, headers or None, qos, producer, topic], use_bin_type=True)
    return b"%d:%d:%s" % (qos, 0, packed)


names = st.text(min_size=1, max_size=12).filter(lambda s: s.strip() == s)
headers = st.none() | st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=4)


@given(st.binary(max_size=300), headers, st.sampled_from([0, 1]), st.none() | names, st.none() | names)
def test_a_message_reads_back_the_same_from_either_stored_form(payload, hdrs, qos, producer, topic):
    expected = Delivery(id="42", tag="9", epoch=3, topic=topic or "orders", payload=payload, deliveries=2,
                        ts=1700000000123, lmq="s1", headers=hdrs or {}, qos=qos, producer=producer)
    for pack in (pack_body, old_body):
        d = unpack_delivery("orders", "s1", 3, b"9", 42, 2, STAMP + pack(payload, hdrs, qos, producer, topic))
        assert isinstance(d, Delivery)
        assert d.as_delivery() == expected and d == expected and expected == d
        assert (d.payload, d.topic, d.headers, d.qos, d.producer, d.ts) == (
            payload, topic or "orders", hdrs or {}, qos, producer, 1700000000123)


def test_the_fields_lua_reads_stay_where_they_were():
    body = STAMP + pack_body(b"x", None, 1, "client-7")
    stamp, qos, bucket, _ = body.split(b":", 3)
    assert (stamp, qos) == (b"1700000000123", b"1") and bucket.isdigit()
    assert pack_body(b"x", None, 0, "client-7").split(b":")[1] == bucket  # the bucket is the producer's


def test_only_the_resp_form_is_relayed_as_stored():
    stamp, n_headers, fragment, producer = wire_form(STAMP + pack_body(b"hi", {"k": "v"}, 1, "p:1"))
    assert (stamp, n_headers) == (b"1700000000123", 1)
    assert fragment == b"$7\r\nheaders\r\n%1\r\n$1\r\nk\r\n$1\r\nv\r\n$7\r\npayload\r\n$2\r\nhi\r\n"
    assert producer == b"p:1"
    assert wire_form(STAMP + old_body(b"hi", {"k": "v"}, 1, "p:1")) is None


def test_a_stored_delivery_is_decoded_once_and_only_when_read():
    d = unpack_delivery("orders", None, 0, b"5", 1, 1, STAMP + pack_body(b"x", None, 1, None))
    assert type(d) is StoredDelivery and d._plain is None
    assert (d.epoch, d.deliveries, d.lmq) == (0, 1, None)  # known without decoding
    assert d._plain is None
    assert d.payload == b"x"
    plain = d._plain
    assert d.tag == "5" and d._plain is plain


def test_a_stored_delivery_is_not_hashable_like_a_delivery():
    d = unpack_delivery("orders", None, 0, b"5", 1, 1, STAMP + pack_body(b"x", None, 1, None))
    with pytest.raises(TypeError):
        hash(d)
