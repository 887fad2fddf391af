"""Tests for fencemq.protocol.deliveries: a relayed delivery is, on the wire, the delivery map
the generic encoder writes, in RESP2 and RESP3, from either stored form."""

from __future__ import annotations

import hiredis
import msgpack
from hypothesis import given
from hypothesis import strategies as st

from fencemq.model.messages import Delivery, pack_body, unpack_delivery
from fencemq.protocol.deliveries import encode_deliveries, encode_delivery
from fencemq.protocol.resp import encode


def read(data: bytes, proto: int):
    r = hiredis.Reader()
    r.feed(data)
    reply = r.gets()
    assert r.gets() is False  # exactly one reply, nothing left over

    def as_map(m):
        return m if proto == 3 else {m[i]: m[i + 1] for i in range(0, len(m), 2)}

    def norm(d):
        d = as_map(d)
        if b"headers" in d:
            d[b"headers"] = as_map(d[b"headers"])
        return d

    return [norm(d) for d in reply] if isinstance(reply, list) and reply and isinstance(reply[0], (list, dict)) \
        else norm(reply)


def old_body(payload, headers, qos, producer, topic=None) -> bytes:
    return b"%d:0:%s" % (qos, msgpack.packb([payload, headers or None, qos, producer, topic], use_bin_type=True))


names = st.text(min_size=1, max_size=10)
header_maps = st.none() | st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=3)


@given(st.binary(max_size=200), header_maps, st.none() | names, st.none() | names, st.none() | names,
       st.sampled_from([2, 3]), st.booleans())
def test_a_relayed_delivery_is_the_map_the_generic_encoder_writes(payload, headers, producer, source, lmq, proto,
                                                                   old):
    body = b"1700000000123:" + (old_body if old else pack_body)(payload, headers, 1, producer, source)
    d = unpack_delivery("orders/eu", lmq, 7, b"12-3", 40, 2, body)
    wire = encode_delivery(d, proto)
    assert read(wire, proto) == read(encode(d.as_delivery().as_reply(), proto), proto)
    assert read(wire, proto)[b"payload"] == payload


def test_a_pull_reply_relays_each_delivery_of_the_batch():
    batch = [unpack_delivery("orders", "s1", 2, b"%d" % i, i, 1, b"17000000000%02d:" % i + pack_body(
        b"m%d" % i, {"n": str(i)} if i % 2 else None, 1, "p")) for i in range(5)]
    for proto in (2, 3):
        got = read(encode_deliveries(batch, proto), proto)
        assert [(m[b"id"], m[b"payload"], m[b"lmq"], m[b"topic"]) for m in got] == [
            (b"%d" % i, b"m%d" % i, b"s1", b"orders") for i in range(5)]
        assert [m.get(b"headers") for m in got] == [None, {b"n": b"1"}, None, {b"n": b"3"}, None]


def test_a_plain_delivery_is_encoded_as_before():
    d = Delivery(id="1", tag="t", epoch=0, topic="x", payload=b"p", deliveries=1, ts=5, headers={"a": "b"})
    for proto in (2, 3):
        assert read(encode_delivery(d, proto), proto) == read(encode(d.as_reply(), proto), proto)


def test_a_delivery_changed_after_the_fence_returned_it_is_written_as_changed():
    d = unpack_delivery("orders", None, 1, b"7", 3, 1, b"1700000000123:" + pack_body(b"p", None, 1, None))
    d.tag, d.epoch = "ordinal-1", 4
    for proto in (2, 3):
        got = read(encode_delivery(d, proto), proto)
        assert (got[b"tag"], got[b"epoch"], got[b"payload"]) == (b"ordinal-1", 4, b"p")
