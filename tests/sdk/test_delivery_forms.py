"""The SDK reads a delivery the same whatever form the worker wrote it in.

A worker writes a delivery as a RESP3 map, or as a flat array of fields and values
(RESP2, or RESP3 after CLIENT DELIVERIES FLAT, which the SDK asks for in HELLO's
write because hiredis parses it several times faster). The fast readers
(``WireDelivery``, ``WireDelivery.flat``) are held to the slow one they replace
(``_delivery_slowly``), field for field, on replies a real worker wrote.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import fields
from typing import Any

import pytest

from fencemq import Client
from fencemq.config import Config
from fencemq.errors import FenceMQError
from fencemq.model.messages import Delivery
from fencemq.sdk.replies import _deliveries, _delivery, _delivery_slowly, _str, _strs, _tag, _tags
from fencemq.server.runner import WorkerThread
from tests.helpers import RespConn, as_map

FIELDS = [f.name for f in fields(Delivery)]


@pytest.fixture(scope="module")
def worker_port(redis_server: Any) -> Iterator[int]:
    with WorkerThread(Config(redis_url=redis_server.url, port=0)) as w:
        yield w.port


def _raw(port: int, proto: int, flat: bool, topic: str, group: str, *sub: str) -> tuple[RespConn, str]:
    c = RespConn(port, raw=True)
    c.call("HELLO", proto)
    if flat:
        c.call("CLIENT", "DELIVERIES", "FLAT")
    return c, as_map(c.call("SUB", topic, "GROUP", group, "FROM", "earliest", *sub))["handle"]


def _values(d: Delivery, *leave_out: str) -> dict[str, Any]:
    return {name: getattr(d, name) for name in FIELDS if name not in leave_out}


FORMS = {"map": (3, False), "flat": (3, True), "resp2": (2, False)}


@pytest.mark.parametrize("lmq", [None, "device-7"])
def test_a_pulled_delivery_reads_field_for_field_as_the_slow_reader_reads_it_in_every_form(worker_port, lmq):
    topic = f"forms-{lmq}"
    lite = ["LMQ", lmq] if lmq else []
    producer = RespConn(worker_port, raw=True)
    producer.call("HELLO", 3, "SETNAME", f"maker-{lmq}")
    producer.call("PUB", topic, "a\0b:c\r\n", "HDR", "trace", "t-1", "HDR", "k", "", *lite)
    producer.call("PUB", topic, "", *lite)  # empty payload, no headers
    read: dict[str, list[Delivery]] = {}
    for name, (proto, flat) in FORMS.items():
        c, handle = _raw(worker_port, proto, flat, topic, f"g-{name}", *lite)
        raw = c.call("PULL", handle, "COUNT", 10)
        assert len(raw) == 2
        fast, slow = _deliveries(raw), [_delivery_slowly(r) for r in raw]
        assert [_values(d) for d in fast] == [_values(d) for d in slow]
        assert fast == slow
        read[name] = fast
    first, second = read["flat"]
    assert (first.payload, first.headers, first.producer, first.lmq) == (b"a\0b:c\r\n", {"trace": "t-1", "k": ""},
                                                                       f"maker-{lmq}", lmq)
    assert (second.payload, second.headers) == (b"", {})
    # each group has its own tags; every other field is the message's
    assert [_values(d, "tag") for d in read["map"]] == [_values(d, "tag") for d in read["flat"]] \
        == [_values(d, "tag") for d in read["resp2"]]


def test_a_taken_delivery_reads_as_the_slow_reader_reads_it_map_or_flat(worker_port):
    taken = {}
    for name, (proto, flat) in FORMS.items():
        c, handle = _raw(worker_port, proto, flat, "forms-take", f"p-{name}", "PUSH")
        c.call("PUB", "forms-take", f"for {name}", "HDR", "x", "1")
        raw = c.call("TAKE", handle, "BLOCK", 2000)
        assert isinstance(raw, list if flat or proto == 2 else dict)
        assert _values(_delivery(raw)) == _values(_delivery_slowly(raw))
        taken[name] = _delivery(raw)
    assert taken["flat"].headers == {"x": "1"} and taken["flat"].payload.startswith(b"for ")


def test_a_reply_not_as_the_worker_writes_it_is_read_the_slow_way_or_refused_as_before():
    flat_out_of_order = [b"tag", b"t1", b"id", b"5", b"epoch", 2, b"topic", b"t", b"payload", b"p"]
    assert _values(_delivery(flat_out_of_order)) == _values(_delivery_slowly(flat_out_of_order))
    str_keyed = {"id": "5", "tag": "t1", "epoch": 2, "topic": "t", "payload": b"p"}
    assert _delivery(str_keyed) == _delivery_slowly(str_keyed)
    mixed = [str_keyed, flat_out_of_order]
    assert _deliveries(mixed) == [_delivery_slowly(r) for r in mixed]
    with pytest.raises(KeyError):
        _delivery([b"id", b"5", b"tag", b"t1"])  # no epoch: refused, as the slow reader refuses it
    with pytest.raises(FenceMQError):  # a field without its value: not a map, as the slow reader says
        _delivery([b"id", b"5", b"tag", b"t1", b"epoch", 2, b"topic", b"t", b"payload", b"p", b"lmq"])


@pytest.mark.parametrize("protocol", [2, 3])
def test_an_sdk_client_reads_every_field_of_a_delivery_in_either_protocol(worker_port, protocol):
    url = f"redis://127.0.0.1:{worker_port}"

    async def main() -> None:
        async with await Client.connect(url, f"sdk-forms-c{protocol}", protocol=protocol) as c, \
                await Client.connect(url, f"sdk-forms-p{protocol}", protocol=protocol) as p:
            topic = f"sdk-forms-{protocol}"
            sub = await c.subscribe(topic, group="g", start="earliest")
            await p.publish(topic, b"one\0two", headers={"h": "v"})
            (d,) = await sub.pull(5, block_ms=2000)
            assert (d.payload, d.headers, d.producer, d.topic, d.deliveries, d.qos) == \
                (b"one\0two", {"h": "v"}, f"sdk-forms-p{protocol}", topic, 1, 1)
            assert await sub.ack(d) == 1
            # what the client's connection was answered: flat arrays in RESP3 (asked for at HELLO) and RESP2
            await p.publish(topic, b"again")
            raw = await c.execute("PULL", sub.handle)
            assert isinstance(raw[0], list)

    asyncio.run(asyncio.wait_for(main(), 30))


def test_the_tags_and_ids_read_in_one_step_are_those_the_element_by_element_reading_gives():
    batch = _deliveries([[b"id", b"%d" % i, b"tag", b"t%d" % i, b"epoch", 0, b"topic", b"t", b"payload", b"p"]
                         for i in range(3)])
    for given in (tuple(batch), ("t9", b"t8"), (batch[0], "t9", b"t8")):
        assert _tags(given) == list(map(_tag, given))
    for raw in ([b"1", b"2"], [b"1", "2", 3]):
        assert _strs(raw) == [_str(v) for v in raw]
