"""What a message is once stored, and what a consumer receives.

The log keeps ``<publish ms>:<qos>:<hash>:<body>``: the fence stamps the time
(Redis's clock, never the caller's); the qos digit and the hash bucket (of the
producer, else the topic, for the ``hash`` strategy of shared groups) are
readable by Lua with one pattern match; the body stays opaque to Lua.

The body is stored ready for the wire (the *RESP form*), so that a worker
relays each delivery's bytes instead of decoding and re-encoding the message:

    R<number of headers>:<producer length>:<producer><fragment>

where the fragment is the part of the delivery map a message never changes,
written as RESP3 field/value pairs: ``topic`` (only for a copy fanned out to a
filter, which carries its source topic; otherwise the queue's topic is the
topic), ``headers`` (when there are any: a map of bulk strings, ``%n``, which a
RESP2 reply turns into ``*2n``), ``payload``. Messages stored before it keep their msgpack body
``[payload, headers, qos, producer, source topic]`` and still deliver (its
first byte, 0x95, is never ``R``).
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass, field

import msgpack

RESP_FORM = b"R"
# A message's expiry (PUB … TTL, MQTT's Message Expiry Interval): its deadline in ms on Redis's clock.
# The fences settle an expired message without delivering it (lua/lib/expiry.lua, expires_at), and
# read this header only where pack_body puts it: first among the headers.
EXPIRES = "mqtt-expires-ms"
MAX_TTL_MS = 4_294_967_295_000  # MQTT's longest Message Expiry Interval (2^32-1 s), for every door
TOPIC_FIELD = b"$5\r\ntopic\r\n"  # a fragment starts so when it carries its own topic
HEADERS_FIELD = b"$7\r\nheaders\r\n"
PAYLOAD_FIELD = b"$7\r\npayload\r\n"


def pack_body(
    payload: bytes, headers: dict[str, str] | None, qos: int, producer: str | None, topic: str | None = None
) -> bytes:
    """The stored body of a message (without the publish time, which the fence puts in front)."""
    if headers:
        return _pack(payload, headers, qos, producer, topic)
    return b"%s$%d\r\n%s\r\n" % (_lead(qos, producer, topic), len(payload), payload)


@functools.lru_cache(maxsize=4096)
def _lead(qos: int, producer: str | None, topic: str | None) -> bytes:
    """What the bodies of one producer's messages to one topic share, up to the payload's length:
    worked out once, not per message (the bucket is a CRC of the producer or topic)."""
    return _pack(None, None, qos, producer, topic)


def _pack(payload: bytes | None, headers: dict[str, str] | None, qos: int, producer: str | None,
          topic: str | None) -> bytes:
    """The body; with no payload, the body up to the payload's length line."""
    if headers and EXPIRES in headers and next(iter(headers)) != EXPIRES:
        headers = {EXPIRES: headers[EXPIRES], **{k: v for k, v in headers.items() if k != EXPIRES}}
    bucket = zlib.crc32((producer or topic or "").encode())
    who = producer.encode() if producer else b""
    parts = [b"%d:%d:R%d:%d:" % (qos, bucket, len(headers) if headers else 0, len(who)), who]
    if topic:
        t = topic.encode()
        parts += (TOPIC_FIELD, b"$%d\r\n" % len(t), t, b"\r\n")
    if headers:
        parts += (HEADERS_FIELD, b"%%%d\r\n" % len(headers))
        for name, value in headers.items():
            k, v = name.encode(), value.encode()
            parts += (b"$%d\r\n" % len(k), k, b"\r\n$%d\r\n" % len(v), v, b"\r\n")
    parts.append(PAYLOAD_FIELD)
    if payload is not None:
        parts += (b"$%d\r\n" % len(payload), payload, b"\r\n")
    return b"".join(parts)


def with_expiry(headers: dict[str, str] | None, deadline_ms: int | None) -> dict[str, str] | None:
    """``headers`` with the expiry deadline (ms, Redis's clock) set; as they are when there is none."""
    if deadline_ms is None:
        return headers
    return {EXPIRES: str(deadline_ms), **{k: v for k, v in (headers or {}).items() if k != EXPIRES}}


def wire_form(stored: bytes) -> tuple[bytes, int, bytes, bytes] | None:
    """A log entry in the RESP form as (publish ms digits, number of headers, fragment, producer
    (empty when unknown)); None for the older msgpack form."""
    parts = stored.split(b":", 5)
    if len(parts) < 6 or parts[3][:1] != RESP_FORM:
        return None
    n = int(parts[4])
    if not n:
        return parts[0], int(parts[3][1:]), parts[5], b""
    rest = parts[5]
    return parts[0], int(parts[3][1:]), rest[n:], rest[:n]


def _bulk_at(fragment: bytes, pos: int) -> tuple[bytes, int]:
    """The bulk string whose ``$len`` line starts at ``pos``, and where the next item starts."""
    eol = fragment.index(b"\r\n", pos)
    end = eol + 2 + int(fragment[pos + 1 : eol])
    return fragment[eol + 2 : end], end + 2


def _read_fragment(fragment: bytes, n_headers: int) -> tuple[bytes | None, dict[str, str], bytes]:
    """The source topic (None: the queue's), the headers and the payload of a RESP-form fragment."""
    topic, headers, pos = None, {}, 0
    if fragment.startswith(TOPIC_FIELD):
        topic, pos = _bulk_at(fragment, len(TOPIC_FIELD))
    if n_headers:
        pos = fragment.index(b"\r\n", pos + len(HEADERS_FIELD)) + 2  # past the map's %n
        for _ in range(n_headers):
            name, pos = _bulk_at(fragment, pos)
            value, pos = _bulk_at(fragment, pos)
            headers[name.decode()] = value.decode()
    payload, _ = _bulk_at(fragment, pos + len(PAYLOAD_FIELD))
    return topic, headers, payload


@dataclass(slots=True)
class Delivery:
    """One checkout: acknowledge it with its ``tag``, never its ``id``."""

    id: str
    tag: str
    epoch: int
    topic: str
    payload: bytes
    deliveries: int
    ts: int
    lmq: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    qos: int = 1
    producer: str | None = None

    def as_reply(self) -> dict[str, object]:
        reply: dict[str, object] = {
            "id": self.id,
            "tag": self.tag,
            "epoch": self.epoch,
            "topic": self.topic,
            "payload": self.payload,
            "deliveries": self.deliveries,
            "ts": self.ts,
        }
        if self.lmq is not None:
            reply["lmq"] = self.lmq
        if self.headers:
            reply["headers"] = self.headers
        if self.producer:
            reply["producer"] = self.producer
        return reply


def _decoded(name: str) -> property:
    def read(self: StoredDelivery) -> object:
        return getattr(self.as_delivery(), name)

    def write(self: StoredDelivery, value: object) -> None:
        setattr(self.as_delivery(), name, value)
        self.stored = None  # changed: no longer the stored bytes, so encoded, not relayed

    return property(read, write, doc=f"``{name}``, decoded on first use")


class StoredDelivery(Delivery):
    """A delivery as the fence returned it: the stored bytes, relayed to the wire as they
    are (fencemq.protocol.deliveries), decoded into a plain Delivery only when a field
    is read (the SDK's replies, operator tools, the MQTT bridge)."""

    __slots__ = ("queue_topic", "msg_id", "raw_tag", "stored", "_plain")
    stored: bytes | None  # None once a decoded field was changed

    def __init__(self, queue_topic: str, lmq: str | None, epoch: int, tag: bytes | str, msg_id: int, acq: int,
                 stored: bytes) -> None:
        self.queue_topic, self.msg_id, self.raw_tag, self.stored, self._plain = queue_topic, msg_id, tag, stored, None
        self.lmq, self.epoch, self.deliveries = lmq, epoch, acq

    id = _decoded("id")
    tag = _decoded("tag")
    topic = _decoded("topic")
    payload = _decoded("payload")
    ts = _decoded("ts")
    headers = _decoded("headers")
    qos = _decoded("qos")
    producer = _decoded("producer")

    def as_delivery(self) -> Delivery:
        plain = self._plain
        if plain is None:
            plain = self._plain = self._decode(self.stored)
        plain.epoch, plain.deliveries, plain.lmq = self.epoch, self.deliveries, self.lmq  # never stale
        return plain

    def _decode(self, stored: bytes) -> Delivery:
        tag = self.raw_tag.decode() if isinstance(self.raw_tag, bytes) else str(self.raw_tag)
        common = dict(id=str(self.msg_id), tag=tag, epoch=self.epoch, deliveries=self.deliveries, lmq=self.lmq)
        parts = stored.split(b":", 5)
        if len(parts) < 6 or parts[3][:1] != RESP_FORM:  # the msgpack form, written before the RESP form
            stamp, _qos, _bucket, body = stored.split(b":", 3)
            payload, headers, qos, producer, source = msgpack.unpackb(body, raw=False)
            return Delivery(topic=source or self.queue_topic, payload=payload, ts=int(stamp),
                            headers=headers or {}, qos=qos, producer=producer, **common)  # type: ignore[arg-type]
        stamp, qos, _bucket, form, who_len, rest = parts
        n = int(who_len)
        topic, headers, payload = _read_fragment(rest[n:], int(form[1:]))
        return Delivery(topic=topic.decode() if topic is not None else self.queue_topic, payload=payload,
                        ts=int(stamp), headers=headers, qos=int(qos),
                        producer=rest[:n].decode() if n else None, **common)  # type: ignore[arg-type]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StoredDelivery):
            other = other.as_delivery()
        return self.as_delivery() == other

    __hash__ = None  # type: ignore[assignment]  # like Delivery: mutable, compared by value


# unpack_delivery(queue topic, lmq, epoch, tag, id, acquisitions, stored body): one call per
# delivery on the PULL path, so the class itself rather than a function around it.
unpack_delivery = StoredDelivery
