"""A delivery as the worker writes it on the wire (docs/protocol.md, "Deliveries").

Sans-I/O. Built directly as RESP bytes rather than through the generic
encoder: PULL and TAKE replies are the hot path.
"""

from __future__ import annotations

from fencemq.model.messages import Delivery
from fencemq.protocol.resp import encode


def encode_delivery(d: Delivery, proto: int) -> bytes:
    """RESP bytes of ``d.as_reply()`` for a client speaking ``proto`` (2 or 3)."""
    fields = 7 + (d.lmq is not None) + bool(d.headers)
    tag, msg_id, topic = d.tag.encode(), d.id.encode(), d.topic.encode()
    out = [
        b"%%%d\r\n" % fields if proto == 3 else b"*%d\r\n" % (2 * fields),
        b"$2\r\nid\r\n$%d\r\n%s\r\n" % (len(msg_id), msg_id),
        b"$3\r\ntag\r\n$%d\r\n%s\r\n" % (len(tag), tag),
        b"$5\r\nepoch\r\n:%d\r\n" % d.epoch,
        b"$5\r\ntopic\r\n$%d\r\n%s\r\n" % (len(topic), topic),
        b"$7\r\npayload\r\n$%d\r\n" % len(d.payload), d.payload,
        b"\r\n$10\r\ndeliveries\r\n:%d\r\n$2\r\nts\r\n:%d\r\n" % (d.deliveries, d.published_ms),
    ]
    if d.lmq is not None:
        lmq = d.lmq.encode()
        out.append(b"$3\r\nlmq\r\n$%d\r\n%s\r\n" % (len(lmq), lmq))
    if d.headers:
        out.append(b"$7\r\nheaders\r\n")
        out.append(encode(d.headers, proto))
    return b"".join(out)


def encode_deliveries(batch: list[Delivery], proto: int) -> bytes:
    """A PULL reply: an array of deliveries."""
    return b"*%d\r\n" % len(batch) + b"".join(encode_delivery(d, proto) for d in batch)
