"""Before authentication a connection can cost the worker next to nothing, and guessing passwords is slow."""

from __future__ import annotations

import pytest

from fencemq.server.guard import AuthThrottle
from tests.helpers import Err, RespConn, worker


@pytest.fixture
def w(redis_url):
    with worker(redis_url, password="legacy secret", auth_delay_ms=1, auth_delay_max_ms=4,
                auth_timeout_ms=60_000) as started:
        yield started


def test_an_unauthenticated_bulk_over_16_kib_is_refused_from_its_header_and_closes_the_connection(w) -> None:
    with RespConn(w.port) as c:
        c.send_raw(b"*3\r\n$3\r\nPUB\r\n$6\r\norders\r\n$50000000\r\n")
        reply = c.reply()
        assert isinstance(reply, Err) and reply.code == "NOAUTH" and "authenticate first" in reply
        assert c.is_closed()


def test_an_unauthenticated_frame_of_more_than_ten_arguments_closes_the_connection(w) -> None:
    with RespConn(w.port) as c:
        c.send_raw(b"*11\r\n")
        assert c.reply().code == "NOAUTH"
        assert c.is_closed()


def test_after_auth_the_next_pipelined_command_may_be_large(w) -> None:
    with RespConn(w.port) as c:
        c.send("AUTH", "legacy secret")
        c.send("PUB", "orders", b"x" * 100_000)
        assert c.replies(2) == ["OK", "1"]


def test_three_failed_auths_close_the_connection(w) -> None:
    with RespConn(w.port) as c:
        assert c.call("AUTH", "wrong one").code == "WRONGPASS"
        assert c.call("AUTH", "wrong two").code == "WRONGPASS"
        last = c.call("AUTH", "wrong three")
        assert last.code == "WRONGPASS" and "closing the connection" in last
        assert c.is_closed()
    with RespConn(w.port) as fresh:
        assert fresh.call("AUTH", "legacy secret") == "OK", "a right password still works, from a new connection"


def test_a_connection_that_never_authenticates_is_closed_after_auth_timeout_ms(redis_url) -> None:
    with worker(redis_url, password="legacy secret", auth_timeout_ms=200) as w, RespConn(w.port) as c:
        assert c.call("PING") == "PONG"
        assert c.is_closed(timeout=5)


def test_each_failure_from_an_address_doubles_the_wait_of_its_next_auth_up_to_the_cap() -> None:
    throttle = AuthThrottle(base_s=0.1, max_s=1.0)
    assert throttle.wait("10.0.0.1", now=0) == 0
    waits = []
    for _ in range(6):
        throttle.failed("10.0.0.1", now=100)
        waits.append(round(throttle.delay(throttle.failures("10.0.0.1")), 3))
    assert waits == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert throttle.wait("10.0.0.2", now=100) == 0, "another address is not held back"


def test_parallel_attempts_from_one_address_queue_one_delay_apart() -> None:
    throttle = AuthThrottle(base_s=0.5, max_s=10.0)
    throttle.failed("10.0.0.1", now=0)  # next attempt no sooner than 0.5
    assert [throttle.wait("10.0.0.1", now=0) for _ in range(3)] == [0.5, 1.0, 1.5]


def test_an_address_that_stops_failing_is_forgotten_and_a_success_clears_it() -> None:
    throttle = AuthThrottle(base_s=0.5, max_s=10.0)
    throttle.failed("a", now=0)
    assert throttle.wait("a", now=10_000) == 0
    throttle.failed("b", now=0)
    throttle.succeeded("b")
    assert throttle.wait("b", now=0) == 0
