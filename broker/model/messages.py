"""What a message is once stored, and what a consumer receives.

The log keeps ``<publish ms>:<qos>:<hash>:<msgpack [payload, headers, qos,
producer, topic]>``: the fence stamps the time (Redis's clock, never the
caller's); the qos digit and the hash bucket (of the producer, else the topic,
for the ``hash`` strategy of shared groups) are readable by Lua with one
pattern match; the msgpack body stays opaque to Lua.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import zlib

import msgpack



def pack_body(
    payload: bytes, headers: dict[str, str] | None, qos: int, producer: str | None, topic: str | None = None
) -> bytes:
    bucket = zlib.crc32((producer or topic or "").encode())
    packed = msgpack.packb([payload, headers or None, qos, producer, topic], use_bin_type=True)
    return b"%d:%d:%s" % (qos, bucket, packed)


@dataclass(slots=True)
class Delivery:
    """One checkout: acknowledge it with its ``tag``, never its ``id``."""

    id: str
    tag: str
    epoch: int
    topic: str
    payload: bytes
    deliveries: int
    published_ms: int
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
            "ts": self.published_ms,
        }
        if self.lmq is not None:
            reply["lmq"] = self.lmq
        if self.headers:
            reply["headers"] = self.headers
        return reply


def unpack_delivery(topic: str, lmq: str | None, epoch: int, tag: bytes, msg_id: int, acq: int, stored: bytes) -> Delivery:
    """``topic`` is the queue's; a copy fanned out to a filter carries its source topic."""
    stamp, _qos, _bucket, body = stored.split(b":", 3)
    payload, headers, qos, producer, source = msgpack.unpackb(body, raw=False)
    return Delivery(
        id=str(msg_id),
        tag=tag.decode() if isinstance(tag, bytes) else str(tag),
        epoch=int(epoch),
        topic=source or topic,
        payload=payload,
        deliveries=int(acq),
        published_ms=int(stamp),
        lmq=lmq,
        headers=headers or {},
        qos=qos,
        producer=producer,
    )
