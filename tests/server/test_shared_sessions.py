"""Connections of one client id share its session (a client's pool); a takeover is explicit.

docs/protocol.md, "Sessions": every connection that presents the same client
id (HELLO … SETNAME, CLIENT SETNAME) acts for one session and keeps it alive;
it is left to its lease — or ended, after a QUIT — when the last of them
closes. ``HELLO … SETNAME id TAKEOVER`` or ``CLIENT TAKEOVER`` takes it over:
its other connections are closed.
"""

from __future__ import annotations

import threading
import time

import pytest
import redis

from tests.helpers import RespConn, as_map, client, deliveries, error_code, wait_for, worker

SESSIONS = "fmq:sessions"


def test_redis_py_default_pool_used_by_four_threads_acts_for_one_session(redis_url):
    with worker(redis_url) as w:
        r = redis.Redis(port=w.port, client_name="app")
        r.execute_command("MPUB", "jobs", 40, *[f"j{i}" for i in range(40)])
        handle = as_map(r.execute_command("SUB", "jobs", "GROUP", "crew"))["handle"]
        errors: list[BaseException] = []
        done: list[bytes] = []
        start = threading.Barrier(4)

        def consume() -> None:
            start.wait()
            try:
                for _ in range(10):
                    (d,) = deliveries(r.execute_command("PULL", handle))
                    assert r.execute_command("ACK", handle, d["tag"]) == 1
                    done.append(d["payload"])
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=consume) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert errors == []
        assert sorted(done) == sorted(f"j{i}" for i in range(40))
        pool = r.connection_pool
        assert len(pool._available_connections) + len(pool._in_use_connections) > 1, "the pool had one connection"


def test_a_second_connection_of_a_client_id_joins_its_session_and_the_first_stays_open(redis_url):
    with worker(redis_url) as w:
        first = RespConn(w.port)
        first.hello(3, "phone")
        first.call("PUB", "orders", "x")
        h = as_map(first.call("SUB", "orders", "GROUP", "g"))["handle"]
        second = RespConn(w.port)
        second.hello(2, "phone")
        (d,) = deliveries(second.call("PULL", h))
        assert first.call("ACK", h, d["tag"]) == 1  # a checkout of one connection, settled on the other
        assert not first.is_closed(0.3)
        first.close()
        second.close()


def test_the_session_goes_on_while_one_of_its_connections_remains(redis_url):
    with worker(redis_url, session_lease_ms=300, sweep_interval_ms=50) as w:
        a, b = client(w.port, 2, "svc"), client(w.port, 2, "svc")
        a.execute_command("PUB", "orders", "x")
        h = as_map(a.execute_command("SUB", "orders", "GROUP", "g"))["handle"]
        (d,) = deliveries(a.execute_command("PULL", h))
        a.close()
        time.sleep(1.0)  # three leases
        assert b.execute_command("ACK", h, d["tag"]) == 1, "the session and its checkout are still there"


def test_quit_on_one_of_two_connections_leaves_the_session_and_on_the_last_ends_it(redis_url):
    with worker(redis_url) as w:
        a, b = RespConn(w.port), RespConn(w.port)
        a.hello(2, "svc")
        b.hello(2, "svc")
        a.call("PUB", "orders", "x")
        h = as_map(a.call("SUB", "orders", "GROUP", "g"))["handle"]
        assert a.call("QUIT") == "OK"
        assert deliveries(b.call("PULL", h))[0]["payload"] == "x"
        assert b.call("QUIT") == "OK"
        r = redis.Redis.from_url(redis_url)
        wait_for(lambda: r.zscore(SESSIONS, "svc") is None, timeout=3, what="the session to end at the last QUIT")


def test_client_takeover_closes_the_sessions_other_connections(redis_url):
    with worker(redis_url) as w:
        old = RespConn(w.port)
        old.hello(3, "laptop")
        new = RespConn(w.port)
        assert new.call("CLIENT", "SETNAME", "laptop") == "OK"
        assert not old.is_closed(0.3)
        assert new.call("CLIENT", "TAKEOVER") == "OK"
        assert old.is_closed(2.0), "the other connection must be closed"
        assert new.call("PING") == "PONG"
        new.close()


def test_a_takeover_needs_a_named_session(redis_url):
    with worker(redis_url) as w, RespConn(w.port) as c:
        assert c.call("CLIENT", "TAKEOVER").code == "BADARG"
        assert c.call("HELLO", 3, "TAKEOVER").code == "BADARG"


def test_an_anonymous_connection_told_noperm_is_told_to_name_its_session(redis_url):
    with worker(redis_url) as w:
        named = client(w.port, 2, "alice")
        h = as_map(named.execute_command("SUB", "orders", "GROUP", "g"))["handle"]
        anonymous = client(w.port, 2)
        with pytest.raises(redis.ResponseError) as err:
            anonymous.execute_command("PULL", h)
        assert error_code(err.value) == "NOPERM" and "SETNAME" in str(err.value)
