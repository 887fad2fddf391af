"""Every argument under a limit; error replies small, printable and never a Python repr; a fence's crash named."""

from __future__ import annotations

import logging

import pytest

from fencemq.model.keys import Keyspace, QueueRef
from tests.helpers import RespConn, as_map, direct, worker


@pytest.fixture
def w(redis_url):
    with worker(redis_url, max_headers=4, max_header_bytes=100) as started:
        yield started


def nothing_published(c: RespConn, topic: str) -> bool:
    h = as_map(c.call("SUB", topic, "GROUP", "audit", "FROM", "EARLIEST"))["handle"]
    return c.call("PULL", h, "COUNT", 10) == []


@pytest.mark.parametrize("extra", [
    ["HDR", "k", "v" * 200],
    [x for i in range(5) for x in ("HDR", f"k{i}", "v")],
    ["ID", "i" * 300],
    ["ID", "i" * 5_000_000],
    ["HDR", "k" * 5_000_000, "v"],
], ids=["header-value-over-bytes", "too-many-headers", "dedup-id-over-256", "5-MiB-id", "5-MiB-header-name"])
def test_headers_and_dedup_ids_over_their_limits_are_limit_and_nothing_is_stored(w, extra) -> None:
    with RespConn(w.port, timeout=20) as c:
        reply = c.call("PUB", "orders", "x", *extra)
        assert reply.code == "LIMIT", reply
        assert len(reply) < 600
        assert nothing_published(c, "orders")


@pytest.mark.parametrize("command", [
    ["SUB", "orders", "GROUP", "g" * 100_000],
    ["PULL", "h" * 100_000],
    ["PING", "p" * 100_000],
    ["CLIENT", "SETNAME", "c" * 100_000],
], ids=["group", "handle", "ping", "client-id"])
def test_any_argument_but_a_payload_over_max_arg_bytes_is_limit_and_the_connection_goes_on(w, command) -> None:
    with RespConn(w.port) as c:
        assert c.call(*command).code == "LIMIT"
        assert c.call("PING") == "PONG"


def test_an_error_that_quotes_a_huge_argument_stays_small(w) -> None:
    with RespConn(w.port, timeout=20) as c:
        reply = c.call("PUB", "orders", "x", "Q" * 60_000)
        assert reply.code == "BADARG" and len(reply) <= 520


@pytest.mark.parametrize("command", [
    ["PUB", "orders", "x", b"\x00\x1b[2J\r\nBAD"],
    ["SUB", "orders", "FROM", "ID", b"\xff\x00abc"],
    ["SUB", "orders", "GROUP", "bad\x07name"],
    ["SUB", "a/#/c"],
    [b"\x00\x01FLY"],
], ids=["option", "integer", "group-name", "filter", "verb"])
def test_error_replies_are_printable_and_never_a_python_repr(w, command) -> None:
    with RespConn(w.port, raw=True) as c:
        reply = c.call(*command)
        assert reply.split(" ", 1)[0] in ("BADARG", "ERR"), reply
        assert reply.isprintable() and "b'" not in reply and "\\x" not in reply, reply


def test_a_fence_that_fails_inside_redis_is_internal_naming_the_fence_and_is_logged_once(redis_url, caplog) -> None:
    caplog.set_level(logging.ERROR)
    with worker(redis_url) as w, RespConn(w.port) as c:
        assert c.call("PUB", "orders", "x") == "1"
        meta = Keyspace("fmq").queue(QueueRef("orders")).meta
        r = direct(redis_url)
        r.delete(meta)
        r.set(meta, "not a hash")  # what no fence expects: its redis.call fails at run time
        first, second = c.call("PUB", "orders", "y"), c.call("PUB", "orders", "z")
        assert first.code == second.code == "INTERNAL"
        assert "fence publish" in first and "did not answer" not in first, first
        logged = [rec for rec in caplog.records if "failed inside Redis" in rec.getMessage()]
        assert len(logged) == 1 and "publish" in logged[0].getMessage()
