"""The SDK decodes a PULL reply's deliveries by their bytes field names (the hot path): it must
read exactly what the worker's encoder wrote, in RESP2 and RESP3, with every optional field."""

from __future__ import annotations

import hiredis
import pytest

from fencemq.model.messages import Delivery
from fencemq.protocol.deliveries import encode_deliveries
from fencemq.sdk.replies import _delivery

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
