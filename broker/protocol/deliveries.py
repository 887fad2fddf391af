"""A delivery as the worker writes it on the wire (docs/protocol.md, "Deliveries").

Sans-I/O. Built directly as RESP bytes rather than through the generic
encoder: PULL and TAKE replies are the hot path. A delivery the fence returned
in the stored RESP form (fencemq.model.messages) is relayed: the per-checkout
fields (id, tag, epoch, deliveries, ts, lmq) are written around the stored
fragment (topic, headers, payload), which goes out as it is, followed by the
producer (the publisher's client id) when the message has one.
"""

from __future__ import annotations

from fencemq.model.messages import HEADERS_FIELD, TOPIC_FIELD, Delivery, StoredDelivery, wire_form
from fencemq.protocol.resp import encode


# What a checkout adds to the stored fragment: id, tag, epoch, deliveries, ts (the publish ms).
_CHECKOUT = (b"$2\r\nid\r\n$%d\r\n%d\r\n$3\r\ntag\r\n$%d\r\n%b\r\n$5\r\nepoch\r\n:%d\r\n"
             b"$10\r\ndeliveries\r\n:%d\r\n$2\r\nts\r\n:%b\r\n")


_PRODUCER = b"$8\r\nproducer\r\n$%d\r\n%b\r\n"  # the publisher's client id, last (when known)


def encode_delivery(d: Delivery, proto: int) -> bytes:
    """RESP bytes of ``d.as_reply()`` for a client speaking ``proto`` (2 or 3)."""
    return encode_deliveries([d], proto)[4:]  # without the array header, b"*1\r\n"


def encode_deliveries(batch: list[Delivery], proto: int) -> bytes:
    """A PULL reply: an array of deliveries."""
    out = [b"*%d\r\n" % len(batch)]
    queue_fields: dict = {}  # (queue topic, lmq) -> their fields, worked out once per reply
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


def _queue_fields(d: StoredDelivery, known: dict) -> tuple[int, bytes, bytes]:
    """The map size without headers, the ``lmq`` field and the ``topic`` field of ``d``'s queue."""
    topic = d.queue_topic.encode()
    lmq = d.lmq.encode() if d.lmq is not None else None
    known[(d.queue_topic, d.lmq)] = shared = (
        7 + (lmq is not None),
        b"$3\r\nlmq\r\n$%d\r\n%s\r\n" % (len(lmq), lmq) if lmq is not None else b"",
        b"$5\r\ntopic\r\n$%d\r\n%s\r\n" % (len(topic), topic),
    )
    return shared


def _resp2_headers(fragment: bytes, headers: int) -> bytes:
    """The fragment with its headers map (``%n``) written as RESP2's flat array (``*2n``)."""
    start = 0  # the headers come first, or right after the topic
    if fragment.startswith(TOPIC_FIELD):
        eol = fragment.index(b"\r\n", len(TOPIC_FIELD))
        start = eol + 4 + int(fragment[len(TOPIC_FIELD) + 1 : eol])
    at = start + len(HEADERS_FIELD)
    eol = fragment.index(b"\r\n", at)
    return b"%s*%d%s" % (fragment[:at], 2 * headers, fragment[eol:])


def _encoded(d: Delivery, proto: int) -> list:
    fields = 7 + (d.lmq is not None) + bool(d.headers) + bool(d.producer)
    tag, msg_id, topic = d.tag.encode(), d.id.encode(), d.topic.encode()
    out = [
        b"%%%d\r\n" % fields if proto == 3 else b"*%d\r\n" % (2 * fields),
        b"$2\r\nid\r\n$%d\r\n%s\r\n" % (len(msg_id), msg_id),
        b"$3\r\ntag\r\n$%d\r\n%s\r\n" % (len(tag), tag),
        b"$5\r\nepoch\r\n:%d\r\n" % d.epoch,
        b"$5\r\ntopic\r\n$%d\r\n%s\r\n" % (len(topic), topic),
        b"$7\r\npayload\r\n$%d\r\n" % len(d.payload), d.payload,
        b"\r\n$10\r\ndeliveries\r\n:%d\r\n$2\r\nts\r\n:%d\r\n" % (d.deliveries, d.ts),
    ]
    if d.lmq is not None:
        lmq = d.lmq.encode()
        out.append(b"$3\r\nlmq\r\n$%d\r\n%s\r\n" % (len(lmq), lmq))
    if d.headers:
        out.append(b"$7\r\nheaders\r\n")
        out.append(encode(d.headers, proto))
    if d.producer:
        producer = d.producer.encode()
        out.append(_PRODUCER % (len(producer), producer))
    return out
