"""Workers, Redis and connections failing: nothing acknowledged is lost, sessions get cleaned.

(a) a worker process killed hard, (b) the script cache flushed, (c) Redis
restarted with AOF, (d) client connections dropped, (e) a client id taking
its session over from an older connection.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import redis

from tests.helpers import (
    Closed,
    Err,
    RespConn,
    as_map,
    client,
    deliveries,
    free_port,
    long_polls_parked,
    parked_long_polls,
    subprocess_worker,
    text,
    wait_for,
    worker,
)

SESSIONS = "fmq:sessions"  # zset: client id -> session lease deadline (Keyspace.sessions)


def drain_all(c, handle: str, want: set[str], timeout: float) -> dict[str, dict]:
    """PULL (and ACK) until every id in `want` was seen; returns every delivery by id."""
    seen: dict[str, dict] = {}

    def more() -> bool:
        got = deliveries(c.execute_command("PULL", handle, "COUNT", 1000))
        if got:
            c.execute_command("ACK", handle, *[d["tag"] for d in got])
        for d in got:
            seen.setdefault(d["id"], d)
        return want <= seen.keys()

    wait_for(more, timeout=timeout, interval=0.05, what=f"{len(want - seen.keys())} acknowledged messages")
    return seen


# -- (a) a worker killed hard ------------------------------------------------------------------


def test_a_worker_killed_hard_loses_no_acknowledged_message_and_its_session_is_cleaned_elsewhere(redis_url):
    port = free_port()
    proc = subprocess_worker(redis_url, port, session_lease_ms=1000)
    direct = redis.Redis.from_url(redis_url)
    try:
        producer = client(port, 2, "producer", timeout=2)
        acked: list[str] = [text(i) for i in producer.execute_command("MPUB", "orders", 100, *range(100))]
        acked += [text(producer.execute_command("PUB", "orders", f"p{i}")) for i in range(100)]

        victim = RespConn(port)
        assert victim.hello(3, "victim")["id"] == "victim"
        handle = as_map(victim.call("SUB", "orders", "GROUP", "g"))["handle"]
        held = {d["id"] for d in deliveries(victim.call("PULL", handle, "COUNT", 30))}
        assert len(held) == 30
        assert direct.zscore(SESSIONS, "victim") is not None

        # Keep publishing while the process dies: every PUB answered with an id counts.
        stop = threading.Event()
        failed: list[BaseException] = []

        def publish() -> None:
            i = 0
            while not stop.is_set():
                try:
                    acked.append(text(producer.execute_command("PUB", "orders", f"live{i}")))
                except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                    failed.append(exc)
                    return
                i += 1

        t = threading.Thread(target=publish)
        t.start()
        time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        proc.wait(5)
        t.join(5)
        stop.set()
        assert failed, "the publisher should have seen the worker die"
        assert len(acked) > 200
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)

    with worker(redis_url, session_lease_ms=1000, sweep_interval_ms=100) as second:
        fresh = client(second.port, 2, "fresh")
        h = as_map(fresh.execute_command("SUB", "orders", "GROUP", "g"))["handle"]
        seen = drain_all(fresh, h, set(acked), timeout=6)
        assert set(acked) <= seen.keys()
        # the dead victim's checkouts came back when its session lease ran out
        assert all(seen[i]["deliveries"] == 2 for i in held)
        assert all(d["deliveries"] == 1 for i, d in seen.items() if i not in held)
        wait_for(lambda: direct.zscore(SESSIONS, "victim") is None, timeout=3, what="the victim's session to end")
        print(f"victim's session gone {time.monotonic() - killed_at:.2f}s after the kill")
        assert not direct.exists("fmq:sess:{victim}", "fmq:sess:{victim}:subs")
        assert direct.zscore(SESSIONS, "fresh") is not None  # the live session is kept


# -- (b) the script cache flushed -----------------------------------------------------------------


def test_noscript_after_a_script_flush_is_invisible_to_clients(fresh_redis):
    direct = fresh_redis.client()
    with worker(fresh_redis.url, sweep_interval_ms=50) as w:
        c = client(w.port, 3, "c")
        c.execute_command("PUB", "orders", "before")
        h = as_map(c.execute_command("SUB", "orders", "GROUP", "g"))["handle"]
        (first,) = deliveries(c.execute_command("PULL", h))

        direct.script_flush()
        assert c.execute_command("ACK", h, first["tag"]) == 1
        direct.script_flush()
        ids = [text(i) for i in c.execute_command("MPUB", "orders", 2, "a", "b")]
        direct.script_flush()
        got = deliveries(c.execute_command("PULL", h, "COUNT", 10))
        assert [d["id"] for d in got] == ids
        direct.script_flush()
        assert c.execute_command("NACK", h, got[0]["tag"]) == 1
        direct.script_flush()
        assert c.execute_command("RENEW", h, got[1]["tag"], "LOCK", 100) == 1
        direct.script_flush()
        assert c.execute_command("SEEK", h, "EARLIEST") == 1
        direct.script_flush()
        # ("before" was acknowledged by the only group: the topic, with no retention policy, let it go)
        assert [d["payload"] for d in deliveries(c.execute_command("PULL", h, "COUNT", 10))] == ["a", "b"]

        # the sweeper's fence too: a lease that expires after a flush still comes back
        h2 = as_map(c.execute_command("SUB", "jobs", "LOCK", 100))["handle"]
        c.execute_command("PUB", "jobs", "j")
        deliveries(c.execute_command("PULL", h2))
        direct.script_flush()
        notices = wait_for(lambda: c.execute_command("HEARTBEAT"), timeout=3, what="a message_timeout notice")
        assert as_map(notices[0])["type"] == "message_timeout"
        direct.script_flush()
        assert text(c.execute_command("UNSUB", h2)) == "OK"


# -- (c) Redis restarted with AOF -------------------------------------------------------------------


def test_published_and_unacked_messages_survive_a_redis_restart_with_aof(fresh_redis):
    with worker(fresh_redis.url) as before:
        c = RespConn(before.port)
        c.hello(2, "durable")
        ids = c.call("MPUB", "orders", 3, "a", "b", "c")
        h = as_map(c.call("SUB", "orders", "GROUP", "g"))["handle"]
        (held,) = deliveries(c.call("PULL", h))
        c.close()
    fresh_redis.restart()  # SIGTERM: the AOF is fsynced; the script cache is gone
    with worker(fresh_redis.url) as after, RespConn(after.port) as c:
        c.hello(2, "durable")  # the session (lease 10 s) is taken over, with its subscription
        assert c.call("ACK", h, held["tag"]) == 1  # the unacknowledged checkout survived
        rest = deliveries(c.call("PULL", h, "COUNT", 10))
        assert [d["id"] for d in rest] == ids[1:]
        assert int(c.call("PUB", "orders", "d")) == int(ids[-1]) + 1


def test_a_running_worker_recovers_from_a_redis_restart(fresh_redis):
    # Sweeper and lease refresh slowed down so that the client's command is the
    # first to take a pooled connection after the restart (else whichever
    # background task takes it first gets the error, and it depends on timing).
    with worker(fresh_redis.url, sweep_interval_ms=60_000, session_lease_ms=60_000) as w:
        c = RespConn(w.port, timeout=5)
        c.hello(3, "durable")
        ids = c.call("MPUB", "orders", 3, "a", "b", "c")
        h = as_map(c.call("SUB", "orders", "GROUP", "g"))["handle"]
        (held,) = deliveries(c.call("PULL", h))
        fresh_redis.restart()

        # Acceptable: the first command after the restart fails with an error
        # reply (the pool's connections died with the server) — but the
        # connection stays open and the next command succeeds.
        try:
            first = c.call("ACK", h, held["tag"])
        except (Closed, TimeoutError, OSError) as exc:
            pytest.fail(f"the worker dropped the client on the first command after a Redis restart: {exc!r} "
                        f"(worker alive: {w._thread.is_alive()})")
        if isinstance(first, Err):
            first = c.call("ACK", h, held["tag"])
        assert first == 1
        assert [d["id"] for d in deliveries(c.call("PULL", h, "COUNT", 10))] == ids[1:]

        # pub/sub wake-ups are subscribed again: a long-poll wakes on a publish
        other = client(w.port, 2)
        c.send("PULL", h, "BLOCK", 3000)
        long_polls_parked(w)
        other.execute_command("PUB", "orders", "after restart")
        assert [d["payload"] for d in deliveries(c.reply(timeout=4))] == ["after restart"]
        c.close()


def test_an_idle_worker_survives_a_redis_restart(fresh_redis):
    # lease refresh every 100 ms, sweeper out of the way: the refresh meets the dead pooled connection
    with worker(fresh_redis.url, session_lease_ms=300, sweep_interval_ms=60_000) as w, RespConn(w.port) as c:
        c.hello(2, "idle")
        c.call("PUB", "orders", "x")
        fresh_redis.restart()
        time.sleep(1.1)  # (and the ids' server is asked: lua/lib/ids.lua, SERVER_CHECK_MS)
        assert w._thread.is_alive(), f"the worker died: {w._error!r}"
        # a restarted server may have lost its last writes: its ids skip past them (lua/lib/ids.lua)
        assert int(c.call("PUB", "orders", "y")) > 2


# -- (d) client connections dropped ------------------------------------------------------------------


def test_a_dropped_named_session_gets_its_checkouts_back_after_its_session_lease(redis_url):
    with worker(redis_url, session_lease_ms=500, sweep_interval_ms=50) as w:
        fresh = client(w.port, 2, "fresh")
        fresh.execute_command("MPUB", "orders", 2, "a", "b")
        victim = RespConn(w.port)
        victim.hello(2, "victim")
        h = as_map(victim.call("SUB", "orders", "GROUP", "g"))["handle"]
        assert len(deliveries(victim.call("PULL", h, "COUNT", 2))) == 2
        hf = as_map(fresh.execute_command("SUB", "orders", "GROUP", "g"))["handle"]

        victim.close()  # no QUIT: the session outlives the connection for its lease
        dropped = time.monotonic()
        assert deliveries(fresh.execute_command("PULL", hf, "COUNT", 10)) == []
        got = wait_for(lambda: deliveries(fresh.execute_command("PULL", hf, "COUNT", 10)), timeout=3,
                       what="the dropped session's checkouts")
        waited = time.monotonic() - dropped
        print(f"checkouts of a dropped named session came back after {waited * 1000:.0f} ms (lease 500 ms)")
        assert sorted(d["payload"] for d in got) == ["a", "b"]
        assert all(d["deliveries"] == 2 for d in got)
        assert 0.2 <= waited < 2.5
        # the session's record is unlisted after its checkouts went back (a second step of the same sweep)
        wait_for(lambda: redis.Redis.from_url(redis_url).zscore(SESSIONS, "victim") is None, timeout=2,
                 what="the dropped session's record to go")


def test_a_named_session_that_reconnects_within_its_lease_keeps_its_checkouts(redis_url):
    with worker(redis_url, session_lease_ms=3000) as w:
        c = RespConn(w.port)
        c.hello(2, "flaky")
        c.call("PUB", "orders", "x")
        h = as_map(c.call("SUB", "orders", "GROUP", "g"))["handle"]
        (d,) = deliveries(c.call("PULL", h))
        c.close()
        time.sleep(0.3)
        with RespConn(w.port) as again:
            again.hello(3, "flaky")
            assert again.call("ACK", h, d["tag"]) == 1


def test_an_anonymous_connection_that_drops_returns_its_checkouts_at_once(redis_url):
    with worker(redis_url) as w:  # session lease 10 s: only the disconnect can explain a quick return
        fresh = client(w.port, 2, "fresh")
        fresh.execute_command("MPUB", "orders", 2, "a", "b")
        anon = RespConn(w.port)
        h = as_map(anon.call("SUB", "orders", "GROUP", "g"))["handle"]
        assert len(deliveries(anon.call("PULL", h, "COUNT", 2))) == 2
        hf = as_map(fresh.execute_command("SUB", "orders", "GROUP", "g"))["handle"]
        assert deliveries(fresh.execute_command("PULL", hf, "COUNT", 10)) == []
        anon.close()
        got = wait_for(lambda: deliveries(fresh.execute_command("PULL", hf, "COUNT", 10)), timeout=1,
                       what="the anonymous connection's checkouts")
        assert sorted(d["payload"] for d in got) == ["a", "b"]
        assert all(d["deliveries"] == 2 for d in got)


def test_quit_from_a_named_session_returns_its_checkouts_at_once(redis_url):
    with worker(redis_url) as w:
        fresh = client(w.port, 2, "fresh")
        fresh.execute_command("MPUB", "orders", 2, "a", "b")
        leaving = RespConn(w.port)
        leaving.hello(3, "leaving")
        h = as_map(leaving.call("SUB", "orders", "GROUP", "g"))["handle"]
        assert len(deliveries(leaving.call("PULL", h, "COUNT", 2))) == 2
        hf = as_map(fresh.execute_command("SUB", "orders", "GROUP", "g"))["handle"]
        assert leaving.call("QUIT") == "OK"
        assert leaving.is_closed()
        got = wait_for(lambda: deliveries(fresh.execute_command("PULL", hf, "COUNT", 10)), timeout=1,
                       what="the quitting session's checkouts")
        assert sorted(d["payload"] for d in got) == ["a", "b"]
        assert all(d["deliveries"] == 2 for d in got)
        wait_for(lambda: redis.Redis.from_url(redis_url).zscore(SESSIONS, "leaving") is None, timeout=2,
                 what="the quitting session's record to go")




def test_a_client_that_disconnects_during_a_long_poll_gets_no_new_assignment(redis_url):
    with worker(redis_url, session_lease_ms=500, sweep_interval_ms=50) as w:
        fresh = client(w.port, 2, "fresh")
        gone = RespConn(w.port)
        gone.hello(2, "gone")
        h = as_map(gone.call("SUB", "orders", "GROUP", "g"))["handle"]
        hf = as_map(fresh.execute_command("SUB", "orders", "GROUP", "g"))["handle"]
        gone.send("PULL", h, "BLOCK", 5000)
        long_polls_parked(w)
        gone.close()
        wait_for(lambda: parked_long_polls(w) == 0, what="the worker to see the client hang up")
        fresh.execute_command("PUB", "orders", "new")
        (d,) = wait_for(lambda: deliveries(fresh.execute_command("PULL", hf)), timeout=3, what="the new message")
        assert d["deliveries"] == 1, "the message was checked out to the disconnected client first"


def test_a_client_that_disconnects_during_a_long_poll_loses_its_session_after_the_lease(redis_url):
    with worker(redis_url, session_lease_ms=500, sweep_interval_ms=50) as w:
        fresh = client(w.port, 2, "fresh")
        fresh.execute_command("PUB", "orders", "held")
        gone = RespConn(w.port)
        gone.hello(2, "gone")
        h = as_map(gone.call("SUB", "orders", "GROUP", "g"))["handle"]
        assert len(deliveries(gone.call("PULL", h))) == 1
        hf = as_map(fresh.execute_command("SUB", "orders", "GROUP", "g"))["handle"]
        gone.send("PULL", h, "BLOCK", 10_000)
        long_polls_parked(w)
        gone.close()
        (d,) = wait_for(lambda: deliveries(fresh.execute_command("PULL", hf)), timeout=2.5,
                        what="the disconnected session's checkout (lease 500 ms)")
        assert d["payload"] == "held" and d["deliveries"] == 2


# -- (e) the same client id connecting again ---------------------------------------------------------


def test_the_same_client_id_connecting_again_with_takeover_takes_the_session_over(redis_url):
    with worker(redis_url) as w:
        old = RespConn(w.port)
        old.hello(2, "phone")
        old.call("PUB", "orders", "x")
        h = as_map(old.call("SUB", "orders", "GROUP", "g"))["handle"]
        (d,) = deliveries(old.call("PULL", h))

        new = RespConn(w.port)
        new.hello(3, "phone", "TAKEOVER")
        assert old.is_closed(2.0), "the older connection must be closed"
        # the session, its subscription and its checkouts are the new connection's now
        assert new.call("ACK", h, d["tag"]) == 1
        assert new.call("PING") == "PONG"
        time.sleep(0.2)  # the old connection's cleanup must not end the session
        assert redis.Redis.from_url(redis_url).zscore(SESSIONS, "phone") is not None
        new.call("PUB", "orders", "y")
        assert [x["payload"] for x in deliveries(new.call("PULL", h))] == ["y"]
        new.close()


def test_a_takeover_through_another_worker_closes_the_older_connection(redis_url):
    with worker(redis_url) as first, worker(redis_url) as second:
        old = RespConn(first.port)
        old.hello(3, "laptop")
        h = as_map(old.call("SUB", "orders", "GROUP", "g"))["handle"]
        new = RespConn(second.port)
        new.hello(2, "laptop", "TAKEOVER")
        assert old.is_closed(2.0), "the older connection must be closed"
        assert deliveries(new.call("PULL", h)) == []
        new.close()
