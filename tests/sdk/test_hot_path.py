"""The SDK's hot path: it decodes a PULL reply's deliveries by their bytes field names and packs
commands with hiredis; both must agree byte for byte with the slow paths they replace. Deliveries
read exactly what the worker's encoder wrote, in RESP2 and RESP3, with every optional field."""

from __future__ import annotations

import hiredis
import pytest

from fencemq.model.messages import Delivery
from fencemq.protocol.deliveries import encode_deliveries
from fencemq.sdk.replies import WireDelivery, _delivery

SENT = [
    Delivery("1", "1795706801064034", 0, "orders", b"x" * 128, 1, 1795706801063),
    Delivery("2", "q1795706801064035", 3, "chat", b"", 2, 1795706801064, lmq="room-7", qos=0),
    Delivery("3", "1795706801064036", 1, "a/b", b"\xff\x00bin", 1, 5, headers={"k": "v", "ü": "ß"},
             producer="pub-1"),
]


@pytest.mark.parametrize("proto", [2, 3])
def test_deliveries_read_back_as_the_worker_wrote_them(proto):
    reader = hiredis.Reader()
    reader.feed(encode_deliveries(SENT, proto))
    assert [_delivery(raw) for raw in reader.gets()] == SENT


@pytest.mark.parametrize("proto", [2, 3])
def test_a_delivery_decodes_a_field_when_the_application_first_reads_it_and_keeps_what_it_writes(proto):
    reader = hiredis.Reader()
    reader.feed(encode_deliveries(SENT, proto))
    got = [_delivery(raw) for raw in reader.gets()]
    assert all(type(d) is WireDelivery for d in got)
    d = got[2]
    assert (d.tag, d.epoch) == (SENT[2].tag, SENT[2].epoch), "what the fence and the settles read, at once"
    lazy = ("id", "topic", "payload", "ts", "headers", "producer")
    assert [name for name in lazy if _decoded(d, name)] == [], "decoded before the application read it"
    assert d.payload == b"\xff\x00bin" and _decoded(d, "payload") and not _decoded(d, "headers")
    d.headers = {"set": "by the application"}
    d.qos = 0
    assert (d.headers, d.qos, d.producer) == ({"set": "by the application"}, 0, "pub-1")
    assert got[1].qos == 0 and got[0].qos == 1, "a reply names no qos: the tag says (q…: QoS 0)"


def _decoded(d: Delivery, name: str) -> bool:
    try:
        getattr(Delivery, name).__get__(d)  # the dataclass's own slot, under the lazy field
        return True
    except AttributeError:
        return False


@pytest.mark.parametrize("args", [
    ("MPUB", "t", 2, b"a\x00b", "ü"),
    ("PULL", "h", "COUNT", 100, "BLOCK", 0),
    ("PUB", "t", memoryview(b"abc")),
    ("PUB", "t", bytearray(b"abc")),
])
def test_the_sdk_sends_the_bytes_redis_py_would(args):
    from redis.asyncio.connection import Connection

    from fencemq.sdk.connection import PipelinedConnection

    conn = PipelinedConnection.__new__(PipelinedConnection)
    conn._packer = Connection()
    assert b"".join(conn._pack(args)) == b"".join(Connection().pack_command(*args))


def test_an_argument_neither_packs_is_refused_as_redis_py_refuses_it():
    import redis.exceptions
    from redis.asyncio.connection import Connection

    from fencemq.sdk.connection import PipelinedConnection

    conn = PipelinedConnection.__new__(PipelinedConnection)
    conn._packer = Connection()
    with pytest.raises(redis.exceptions.DataError):
        conn._pack(("PUB", "t", None))
