"""CLIENT DELIVERIES FLAT: a RESP3 connection gets each delivery as the flat array RESP2 writes.

A map costs a RESP3 client's parser several times what a flat array does (hiredis:
~3.4 against ~0.7 µs a delivery), so the SDK asks for the flat form; everything else
on the connection stays RESP3. Each test reads the same messages through a map, a
flat and a RESP2 connection (a group each) and holds them to each other.
"""

from __future__ import annotations

import pytest

from tests.helpers import Err, RespConn, as_map, pipeline, worker


@pytest.fixture
def w(redis_url):
    with worker(redis_url) as started:
        yield started


def _conn(port: int, proto: int, flat: bool = False) -> RespConn:
    c = RespConn(port, raw=True)
    c.call("HELLO", proto)
    if flat:
        assert c.call("CLIENT", "DELIVERIES", "FLAT") == "OK"
    return c


def _handle(c: RespConn, *args: object) -> str:
    return as_map(c.call("SUB", *args))["handle"]


def _fields(delivery: dict | list) -> dict:
    """A delivery's fields by name (a map, or a flat array's pairs), its headers the same way."""
    pairs = delivery.items() if isinstance(delivery, dict) else zip(delivery[::2], delivery[1::2], strict=True)
    out = {}
    for k, v in pairs:
        out[k] = _fields(v) if k == b"headers" else v
    return out


def test_a_flat_connection_gets_each_delivery_as_resp2_writes_it_with_the_fields_of_the_map(w):
    producer = RespConn(w.port, raw=True)
    producer.call("HELLO", 3, "SETNAME", "maker")  # a named publisher: its deliveries carry the producer
    producer.call("PUB", "orders", "a\0b:c", "HDR", "trace", "t-1")
    producer.call("PUB", "orders", "second")
    as_map3, flat3, resp2 = _conn(w.port, 3), _conn(w.port, 3, flat=True), _conn(w.port, 2)
    got = {}
    for name, c in (("map", as_map3), ("flat", flat3), ("resp2", resp2)):
        got[name] = c.call("PULL", _handle(c, "orders", "GROUP", f"g-{name}", "FROM", "earliest"), "COUNT", 10)
    assert all(isinstance(d, dict) for d in got["map"])
    assert all(isinstance(d, list) for d in got["flat"] + got["resp2"])
    # the flat array is RESP2's, field for field and in the same order; the map holds the same fields
    for m, f, r in zip(got["map"], got["flat"], got["resp2"], strict=True):
        assert f[0::2] == r[0::2]
        assert f[2] == b"tag" and f[4] == b"epoch"  # first in every delivery: the SDK reads them by place
        assert {k: v for k, v in _fields(f).items() if k != b"tag"} == \
            {k: v for k, v in _fields(m).items() if k != b"tag"}
        assert _fields(f)[b"producer"] == b"maker"
    assert [_fields(d)[b"payload"] for d in got["flat"]] == [b"a\0b:c", b"second"]
    assert [_fields(d).get(b"headers") for d in got["flat"]] == [{b"trace": b"t-1"}, None]


def test_a_take_and_a_pull_pipelined_with_an_ack_are_flat_too(w):
    c = _conn(w.port, 3, flat=True)
    push = _handle(c, "alerts", "GROUP", "p", "PUSH")
    pulled = _handle(c, "alerts", "GROUP", "q")
    c.call("MPUB", "alerts", 3, "one", "two", "three")
    taken = c.call("TAKE", push, "BLOCK", 1000)
    assert isinstance(taken, list) and _fields(taken)[b"payload"] == b"one"
    (first,) = c.call("PULL", pulled)
    c.send_raw(pipeline(("ACK", pulled, _fields(first)[b"tag"]), ("PULL", pulled, "COUNT", 5)))
    acked, rest = c.replies(2)
    assert acked == 1 and [_fields(d)[b"payload"] for d in rest] == [b"two", b"three"]
    assert all(isinstance(d, list) for d in rest)


def test_client_deliveries_takes_map_or_flat_and_anything_else_is_refused_changing_nothing(w):
    c = _conn(w.port, 3)
    h = _handle(c, "orders", "GROUP", "g")
    c.call("MPUB", "orders", 3, "a", "b", "c")
    for bad in (("CLIENT", "DELIVERIES", "ROUND"), ("CLIENT", "DELIVERIES"), ("CLIENT", "DELIVERIES", "FLAT", "MAP")):
        refused = c.call(*bad)
        assert isinstance(refused, Err) and refused.code == "BADARG"
    assert isinstance(c.call("PULL", h)[0], dict)  # still maps
    assert c.call("CLIENT", "DELIVERIES", "flat") == "OK"
    assert isinstance(c.call("PULL", h)[0], list)
    assert c.call("CLIENT", "DELIVERIES", "MAP") == "OK"
    assert isinstance(c.call("PULL", h)[0], dict)


def test_reset_gives_maps_again(w):
    c = _conn(w.port, 3, flat=True)
    assert c.call("RESET") == "RESET"
    c.call("HELLO", 3)
    h = _handle(c, "orders", "GROUP", "g")
    c.call("PUB", "orders", "x")
    assert isinstance(c.call("PULL", h)[0], dict)
