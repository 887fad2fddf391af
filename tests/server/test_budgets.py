"""Per-connection budgets: what one client can make a worker hold, and for how long."""

from __future__ import annotations

import logging
import socket
import ssl
import threading

import pytest
import trustme

from tests.helpers import Err, RespConn, as_map, deliveries, free_port, pipeline, subprocess_worker, wait_for, worker
from tests.server.test_users_auth import add_user


def the_connection(w):
    return wait_for(lambda: next(iter(w.worker.connections.values()), None), what="the worker to see the connection")


def test_what_a_client_sends_behind_a_long_poll_is_buffered_up_to_max_read_ahead_and_no_further(redis_url):
    budget = 64 * 1024
    with worker(redis_url, max_read_ahead=budget) as w, RespConn(w.port, timeout=20) as c:
        h = as_map(c.call("SUB", "orders", "GROUP", "g"))["handle"]
        # a poll that outlasts any slow fill of the read-ahead: a publish ends it once the checks are done
        flood = pipeline(["PULL", h, "BLOCK", 60_000], *[["PING", "x" * 1000] for _ in range(4000)])  # ~4 MB
        sender = threading.Thread(target=c.send_raw, args=(flood,), daemon=True)
        sender.start()
        conn = the_connection(w)
        wait_for(lambda: conn.parser.buffered >= budget, timeout=30, what="the read-ahead to fill")
        # (on a busy machine the PULL may still be subscribing to its queue's wake-ups: the read-ahead
        # fills while the verb starts, as while it waits)
        wait_for(lambda: conn.session.waiting, timeout=30, what="the long poll to wait")
        # one receive may overshoot the budget; nothing more is read until the PULL is done
        assert conn.parser.buffered < budget + 65536
        with RespConn(w.port) as producer:
            producer.call("PUB", "orders", "wake")
        assert [d["payload"] for d in deliveries(c.reply(timeout=20))] == ["wake"]
        assert c.replies(4000, timeout=30)[-1] == "x" * 1000
        sender.join(10)


def test_a_client_flooding_from_its_first_byte_is_held_back_by_tcp_not_by_the_workers_memory(redis_url):
    # anyio reads a socket until a receive has to wait: the worker must pause it itself. (In a
    # process of its own, as in production: in a thread of the test the GIL makes it wait anyway.)
    port = free_port()
    proc = subprocess_worker(redis_url, port, max_read_ahead=64 * 1024)
    try:
        _flood_behind_a_long_poll(port)
    finally:
        proc.terminate()
        proc.wait(10)


def _flood_behind_a_long_poll(port: int) -> None:
    with RespConn(port, timeout=20) as c:
        h = as_map(c.call("SUB", "orders", "GROUP", "g"))["handle"]
        sent = {"bytes": 0}
        chunk = pipeline(*[["PING", "x" * 1000] for _ in range(1000)])

        def flood() -> None:
            c.sock.sendall(pipeline(["PULL", h, "BLOCK", 1500]))
            try:
                while sent["bytes"] < 300 << 20:
                    c.sock.sendall(chunk)
                    sent["bytes"] += len(chunk)
            except OSError:
                pass

        threading.Thread(target=flood, daemon=True).start()
        assert c.reply(timeout=20) == [], "the long poll ran out"
        assert sent["bytes"] < 64 << 20, f"the worker took {sent['bytes'] >> 20} MiB behind a long poll"
        c.close()


def test_a_client_that_does_not_read_its_replies_is_closed_after_output_timeout_ms(redis_url):
    with worker(redis_url, output_timeout_ms=200) as w:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", w.port))
        big = pipeline(*[["ECHO", "y" * 60_000] for _ in range(200)])  # 12 MB of replies, never read
        threading.Thread(target=lambda: _send_quietly(s, big), daemon=True).start()
        the_connection(w)
        wait_for(lambda: not w.worker.connections, timeout=10, what="the connection to be closed")
        s.close()


def _send_quietly(s: socket.socket, data: bytes) -> None:
    try:
        s.sendall(data)
    except OSError:
        pass


def test_an_idle_connection_is_closed_after_idle_timeout_ms_but_a_long_poll_is_not_idle(redis_url):
    with worker(redis_url, idle_timeout_ms=300) as w:
        with RespConn(w.port) as polling:
            h = as_map(polling.call("SUB", "orders", "GROUP", "g"))["handle"]
            assert polling.call("PULL", h, "BLOCK", 900, timeout=5) == []
            assert polling.call("PING") == "PONG"
        with RespConn(w.port) as idle:
            assert idle.call("PING") == "PONG"
            assert idle.is_closed(timeout=5)


def test_a_request_left_unfinished_for_request_timeout_ms_closes_the_connection_but_idling_between_is_fine(
        redis_url):
    with worker(redis_url, request_timeout_ms=300) as w, RespConn(w.port) as slow, RespConn(w.port) as quiet:
        assert quiet.call("PING") == "PONG"
        slow.send_raw(b"*2\r\n$4\r\nPING\r\n$100\r\nabc")  # slowloris: never finished
        assert slow.is_closed(timeout=5)
        assert quiet.call("PING") == "PONG", "a connection between requests is not timed (idle_timeout_ms 0)"


def test_past_max_connections_a_new_connection_is_told_so_and_closed(redis_url):
    with worker(redis_url, max_connections=2) as w, RespConn(w.port) as a, RespConn(w.port) as b:
        assert a.call("PING") == b.call("PING") == "PONG"
        with RespConn(w.port) as third:
            reply = third.reply()
            assert isinstance(reply, Err) and "max number of clients" in reply
            assert third.is_closed()
        assert a.call("PING") == "PONG"


def test_a_user_past_max_connections_per_user_is_refused_at_auth(redis_url):
    add_user(redis_url, "svc", "service secret", ("all", "#"))
    with worker(redis_url, users=True, max_connections_per_user=1) as w, RespConn(w.port) as a, \
            RespConn(w.port) as b:
        assert a.call("AUTH", "svc", "service secret") == "OK"
        assert b.call("AUTH", "svc", "service secret").code == "LIMIT"
        assert b.call("PING") == "PONG"


def test_a_session_past_max_subscriptions_gets_limit_and_nothing_is_subscribed(redis_url):
    with worker(redis_url, max_subscriptions=2) as w, RespConn(w.port) as c:
        c.call("HELLO", 2, "SETNAME", "many")
        assert not isinstance(c.call("SUB", "a", "GROUP", "g"), Err)
        assert not isinstance(c.call("SUB", "b", "GROUP", "g"), Err)
        assert c.call("SUB", "c", "GROUP", "g").code == "LIMIT"
        lite = c.call("SUB", "chat", "GROUP", "g", "LMQ", "l1")
        assert not isinstance(lite, Err), f"lite subscriptions count apart: {lite}"


@pytest.fixture
def tls_worker(redis_url, tmp_path):
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_and_cert_chain_pem.write_to_path(tmp_path / "server.pem")
    with worker(redis_url, tls_cert_file=str(tmp_path / "server.pem"), tls_key_file=str(tmp_path / "server.pem"),
                tls_handshake_timeout_ms=300) as w:
        yield w


def test_a_stalled_tls_handshake_is_dropped_after_tls_handshake_timeout_ms(tls_worker):
    with socket.create_connection(("127.0.0.1", tls_worker.port), timeout=5) as s:
        assert s.recv(1) == b"", "the worker hung up on a client that never began its handshake"


def test_each_failed_handshake_is_one_log_line_without_a_traceback(tls_worker, caplog):
    caplog.set_level(logging.INFO)
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", tls_worker.port), timeout=5) as s:
            s.sendall(b"PING\r\n" * 100)  # not a ClientHello
            s.recv(100)
    wait_for(lambda: len([r for r in caplog.records if "TLS handshake" in r.getMessage()]) >= 3)
    failed = [r for r in caplog.records if "TLS handshake" in r.getMessage()]
    assert all(r.exc_info is None for r in failed) and all("\n" not in r.getMessage() for r in failed)
    assert not [r for r in caplog.records if r.name == "anyio.streams.tls"]
    ctx = ssl.create_default_context(cafile=None)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", tls_worker.port)) as raw, ctx.wrap_socket(raw) as s:
        s.sendall(b"PING\r\n")
        assert s.recv(100) == b"+PONG\r\n"
