"""MULTI … EXEC: commands inside a transaction run only when EXEC runs them.

The semantics (docs/protocol.md, "Transactions"): commands are queued and
answered QUEUED, EXEC runs them in order and answers their replies as one
array (an error among them is that command's reply; the others run),
DISCARD or a dropped connection runs none of them, and a command refused
while queued (unknown, malformed, a blocking form) makes EXEC run none of
them (EXECABORT).
"""

from __future__ import annotations

import pytest
import redis

from tests.helpers import RespConn, as_map, client, deliveries, pipeline, wait_for, worker


def _published(port: int, topic: str = "orders") -> list[str]:
    """What a fresh group sees on the topic, from the earliest message."""
    c = client(port, 2, "auditor")
    h = as_map(c.execute_command("SUB", topic, "GROUP", "audit"))["handle"]
    return [d["payload"] for d in deliveries(c.execute_command("PULL", h, "COUNT", 100))]


def test_commands_between_multi_and_exec_are_queued_then_run_in_order_with_their_replies(redis_url):
    with worker(redis_url) as w, RespConn(w.port) as c:
        c.hello(2, "alice")
        assert c.call("MULTI") == "OK"
        assert c.call("PUB", "orders", "a") == "QUEUED"
        assert c.call("SUB", "orders", "GROUP", "g") == "QUEUED"
        assert c.call("PUB", "orders", "b") == "QUEUED"
        assert _published(w.port) == [], "nothing runs before EXEC"
        first, sub, second = c.call("EXEC")
        assert (int(first), int(second)) == (1, 2)
        assert [d["payload"] for d in deliveries(c.call("PULL", as_map(sub)["handle"], "COUNT", 10))] == ["a", "b"]


def test_a_pipelined_transaction_of_pubs_is_not_published_before_its_exec(redis_url):
    with worker(redis_url) as w, RespConn(w.port) as c:
        # back-to-back PUBs to one queue are batched into one fence call, but not inside MULTI
        c.send_raw(pipeline(["MULTI"], ["PUB", "orders", "a"], ["PUB", "orders", "b"], ["DISCARD"]))
        assert c.replies(4) == ["OK", "QUEUED", "QUEUED", "OK"]
        assert _published(w.port) == []


def test_a_transaction_cut_off_by_a_dropped_connection_runs_nothing(redis_url):
    with worker(redis_url) as w:
        c = RespConn(w.port)
        c.send_raw(pipeline(["MULTI"], ["PUB", "orders", "a"], ["MPUB", "orders", 2, "b", "c"]))
        assert c.replies(3) == ["OK", "QUEUED", "QUEUED"]
        c.close()
        wait_for(lambda: not w.worker.connections, what="the connection to close")
        assert _published(w.port) == []


def test_a_command_refused_while_queued_makes_exec_run_none_of_them(redis_url):
    with worker(redis_url) as w, RespConn(w.port) as c:
        for refused in (["NOSUCHVERB"], ["PUB", "orders"], ["PULL", "h", "BLOCK", 100], ["SUB", "t", "QOS", 7]):
            assert c.call("MULTI") == "OK"
            assert c.call("PUB", "orders", "never") == "QUEUED"
            assert c.call(*refused).code in ("ERR", "BADARG")
            reply = c.call("EXEC")
            assert reply.code == "EXECABORT", (refused, reply)
        assert _published(w.port) == []


def test_a_blocking_pull_inside_multi_is_refused_with_the_reason(redis_url):
    with worker(redis_url) as w, RespConn(w.port) as c:
        c.call("MULTI")
        reply = c.call("TAKE", "h", "BLOCK", 0)
        assert reply.code == "BADARG" and "transaction never waits" in reply


def test_an_error_of_one_command_at_exec_is_its_reply_and_the_others_still_run(redis_url):
    with worker(redis_url) as w, RespConn(w.port) as c:
        c.hello(2, "alice")
        c.call("MULTI")
        c.call("PUB", "orders", "a")
        c.call("ACK", "bm90LWEtaGFuZGxl", "1")  # not a handle of alice's
        c.call("PUB", "orders", "b")
        first, error, second = c.call("EXEC")
        assert error.code in ("BADARG", "NOPERM")
        assert _published(w.port) == ["a", "b"]


def test_exec_and_discard_without_multi_and_a_nested_multi_are_errors_that_keep_the_transaction(redis_url):
    with worker(redis_url) as w, RespConn(w.port) as c:
        assert c.call("EXEC").code == "ERR"
        assert c.call("DISCARD").code == "ERR"
        c.call("MULTI")
        c.call("PUB", "orders", "a")
        assert c.call("MULTI").code == "ERR"
        assert [int(x) for x in c.call("EXEC")] == [1]


def test_redis_py_transaction_pipeline_publishes_once_and_returns_every_reply(redis_url):
    with worker(redis_url) as w:
        r = redis.Redis(port=w.port, client_name="shop")
        with r.pipeline() as pipe:  # transaction=True: MULTI … EXEC
            pipe.execute_command("PUB", "orders", "a")
            pipe.execute_command("MPUB", "orders", 2, "b", "c")
            ids = pipe.execute()
        assert ids == [b"1", [b"2", b"3"]]
        assert _published(w.port) == ["a", "b", "c"]


def test_redis_py_transaction_with_a_refused_command_raises_and_publishes_nothing(redis_url):
    with worker(redis_url) as w:
        r = redis.Redis(port=w.port)
        with r.pipeline() as pipe:
            pipe.execute_command("PUB", "orders", "a")
            pipe.execute_command("PUB", "orders", "b", "QOS", "9")
            with pytest.raises(redis.exceptions.ResponseError):
                pipe.execute()
        assert _published(w.port) == []
