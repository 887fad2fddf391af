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


# -- the PULL reply's fast path: byte for byte the field-by-field writer it replaced ---------------------

_CHECKOUT = (b"$2\r\nid\r\n$%d\r\n%d\r\n$3\r\ntag\r\n$%d\r\n%b\r\n$5\r\nepoch\r\n:%d\r\n"
             b"$10\r\ndeliveries\r\n:%d\r\n$2\r\nts\r\n:%b\r\n")


def field_by_field(batch, proto: int) -> bytes:
    """encode_deliveries as it was before one format per kind of delivery (issue #32), kept here
    as the reference the fast path is held to."""
    from fencemq.model.messages import TOPIC_FIELD, StoredDelivery, wire_form
    from fencemq.protocol.deliveries import _PRODUCER, _encoded, _queue_fields, _resp2_headers

    out = [b"*%d\r\n" % len(batch)]
    queue_fields: dict = {}
    for d in batch:
        if type(d) is StoredDelivery and d.stored is not None and (wire := wire_form(d.stored)) is not None:
            stamp, headers, fragment, producer = wire
            shared = queue_fields.get((d.queue_topic, d.lmq)) or _queue_fields(d, queue_fields)
            fields = shared[0] + (headers > 0) + (producer != b"")
            if headers and proto == 2:
                fragment = _resp2_headers(fragment, headers)
            tag = d.raw_tag if type(d.raw_tag) is bytes else str(d.raw_tag).encode()
            out += (b"%%%d\r\n" % fields if proto == 3 else b"*%d\r\n" % (2 * fields),
                    _CHECKOUT % (len(str(d.msg_id)), d.msg_id, len(tag), tag, d.epoch, d.deliveries, stamp),
                    shared[1], b"" if fragment.startswith(TOPIC_FIELD) else shared[2], fragment)
            if producer:
                out.append(_PRODUCER % (len(producer), producer))
        else:
            out += _encoded(d, proto)
    return b"".join(out)


# names with the bytes a format or the RESP form could trip on: %, :, CR LF
awkward = st.text(alphabet=st.sampled_from("ab%:\r\n é/"), min_size=1, max_size=6)
one_delivery = st.tuples(st.binary(max_size=40), header_maps, st.none() | awkward, st.none() | awkward,
                         st.sampled_from(["orders", "a%b", "x:y"]), st.none() | awkward, st.integers(0, 3),
                         st.integers(1, 5), st.booleans(), st.sampled_from([b"17-3", "q9", 12]))


@given(st.lists(one_delivery, max_size=6), st.sampled_from([2, 3]))
def test_a_pull_reply_is_byte_for_byte_what_the_field_by_field_writer_wrote(specs, proto):
    batch = []
    for i, (payload, headers, producer, source, queue, lmq, epoch, acq, old, tag) in enumerate(specs):
        body = b"17000000001%02d:" % i + (old_body if old else pack_body)(payload, headers, 1, producer, source)
        batch.append(unpack_delivery(queue, lmq, epoch, tag, 100 + i, acq, body))
    if specs and specs[0][8]:  # a delivery changed after the fence returned it is encoded, not relayed
        batch[0].epoch = 9
        batch[0].payload = b"changed"
    assert encode_deliveries(batch, proto) == field_by_field(batch, proto)


def test_a_pull_of_one_producers_messages_is_what_the_field_by_field_writer_wrote():
    batch = [unpack_delivery("orders", None, 2, b"%d-1" % i, i, 1, b"17000000000%02d:" % i + pack_body(
        b"x" * 128, None, 1, "client-1")) for i in range(100)]
    for proto in (2, 3):
        assert encode_deliveries(batch, proto) == field_by_field(batch, proto)
