"""A delivery as the worker writes it on the wire (docs/protocol.md, "Deliveries").

Sans-I/O. Built directly as RESP bytes rather than through the generic
encoder: PULL and TAKE replies are the hot path. A delivery the fence returned
in the stored RESP form (fencemq.model.messages) is relayed: the per-checkout
fields (id, tag, epoch, deliveries, ts, lmq) are written around the stored
fragment (topic, headers, payload), which goes out as it is, followed by the
producer (the publisher's client id) when the message has one.
"""

from __future__ import annotations

from fencemq.model.messages import HEADERS_FIELD, RESP_FORM, TOPIC_FIELD, Delivery, StoredDelivery
from fencemq.protocol.resp import encode


# What a checkout adds to the stored fragment: id, tag (a format's fields to fill), then epoch,
# deliveries and ts (the publish ms).
_ID_TAG = b"$2\r\nid\r\n$%d\r\n%d\r\n$3\r\ntag\r\n$%d\r\n%b\r\n"
_COUNTS = b"$5\r\nepoch\r\n:%d\r\n$10\r\ndeliveries\r\n:%d\r\n$2\r\nts\r\n:"


_PRODUCER = b"$8\r\nproducer\r\n$%d\r\n%b\r\n"  # the publisher's client id, last (when known)


def encode_delivery(d: Delivery, proto: int) -> bytes:
    """RESP bytes of ``d.as_reply()`` for a client speaking ``proto`` (2 or 3)."""
    return encode_deliveries([d], proto)[4:]  # without the array header, b"*1\r\n"


def encode_deliveries(batch: list[Delivery], proto: int) -> bytes:
    """A PULL reply: an array of deliveries.

    A relayed delivery is one ``%`` of a format made once per reply for each kind of delivery
    in it (its queue, epoch, deliveries count, headers, producer: all the same in the usual
    batch), filled with what differs per message (id, tag, publish ms, fragment), rather than
    written field by field: the hot path of a PULL of 100."""
    out = [b"*%d\r\n" % len(batch)]
    append = out.append
    queue_fields: dict = {}  # (queue topic, lmq) -> their fields, worked out once per reply
    formats: dict = {}  # the format of each kind of delivery met in this reply
    for d in batch:
        stored = d.stored if type(d) is StoredDelivery else None
        parts = stored.split(b":", 5) if stored is not None else ()
        if len(parts) == 6 and parts[3][:1] == RESP_FORM:  # the RESP form (messages.wire_form)
            stamp, _qos, _bucket, form, who_len, rest = parts
            n = 0 if who_len == b"0" else int(who_len)
            producer = rest[:n]
            key = (d.queue_topic, d.lmq, d.epoch, d.deliveries, form, producer, rest.startswith(TOPIC_FIELD, n))
            fmt = formats.get(key)
            if fmt is None:
                fmt = formats[key] = _format(d, proto, int(form[1:]), producer, key[6], queue_fields)
            fragment = rest[n:] if n else rest
            if proto == 2 and form != b"R0" and (headers := int(form[1:])):
                fragment = _resp2_headers(fragment, headers)
            tag = d.raw_tag if type(d.raw_tag) is bytes else str(d.raw_tag).encode()
            msg_id = d.msg_id
            append(fmt % (len(str(msg_id)), msg_id, len(tag), tag, stamp, fragment))
        else:
            out += _encoded(d, proto)
    return b"".join(out)


def _format(d: StoredDelivery, proto: int, headers: int, producer: bytes, own_topic: bool,
            queue_fields: dict) -> bytes:
    """The ``%`` format of a relayed delivery of this kind: the map's size, id and tag to fill,
    epoch and deliveries, ts to fill, the queue's fields, the fragment to fill, the producer."""
    shared = queue_fields.get((d.queue_topic, d.lmq)) or _queue_fields(d, queue_fields)
    fields = shared[0] + (headers > 0) + (producer != b"")
    return b"".join([_literal(b"%%%d\r\n" % fields if proto == 3 else b"*%d\r\n" % (2 * fields)), _ID_TAG,
                     _literal(_COUNTS % (d.epoch, d.deliveries)), b"%b\r\n", _literal(shared[1]),
                     b"" if own_topic else _literal(shared[2]), b"%b",
                     _literal(_PRODUCER % (len(producer), producer)) if producer else b""])


def _literal(data: bytes) -> bytes:
    """``data`` as text of a ``%`` format (a topic, a producer id may hold a ``%``)."""
    return data.replace(b"%", b"%%")


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
