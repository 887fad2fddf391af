"""Redis failing a command reaches the client as a documented code with what to do, on an open connection.

READONLY (a demoted primary), NOREPLICAS (min-replicas-to-write), a lost
connection: TRYAGAIN. A full Redis: OOM. A Redis that cannot persist:
MISCONF. Never INTERNAL (kept for a fence's bug), never a dropped connection.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time

import pytest
import redis
from redis.exceptions import RedisClusterException, SlotNotCoveredError

from fencemq.model.keys import Keyspace, QueueRef
from fencemq.model.slots import key_slot
from fencemq.server.embedded import EmbeddedRedis
from tests.helpers import Err, RespConn, as_map, pipeline, wait_for, worker

KEYS = Keyspace("fmq")

pytestmark = pytest.mark.standalone


def code(reply: object) -> str:
    assert isinstance(reply, Err), f"expected an error reply, got {reply!r}"
    return str(reply).split(" ", 1)[0]


def test_every_retriable_code_is_in_the_table_with_what_to_do() -> None:
    from fencemq.errors import BY_CODE, RETRIABLE, TABLE

    assert {"TRYAGAIN", "OOM", "MISCONF", "UNCONFIRMED"} <= RETRIABLE
    assert "INTERNAL" not in RETRIABLE and "BADARG" not in RETRIABLE
    for entry in TABLE:
        if entry.retriable:
            assert BY_CODE[entry.code] is entry.exception
            assert "again" in entry.meaning


def test_a_worker_whose_primary_was_demoted_answers_tryagain_and_keeps_the_connection() -> None:
    with EmbeddedRedis() as primary, EmbeddedRedis() as other, worker(primary.url) as w, RespConn(w.port) as c:
        assert c.call("PUB", "orders", "before") == "1"
        primary.client().execute_command("REPLICAOF", "127.0.0.1", other.port)  # the old primary, now a replica
        wait_for(lambda: primary.client().info("replication")["master_link_status"] == "up", 10)
        for command in (("PUB", "orders", "x"), ("MPUB", "orders", 2, "a", "b")):
            reply = c.call(*command)
            assert code(reply) == "TRYAGAIN", reply
            assert "READONLY" in reply and "send it again" in reply
        c.send_raw(pipeline(("PUB", "orders", "1"), ("PUB", "orders", "2"), ("PING",)))
        batch = c.replies(3)
        assert [code(r) for r in batch[:2]] == ["TRYAGAIN", "TRYAGAIN"], batch
        assert batch[2] == "PONG"  # the same connection, still served


def test_noreplicas_is_tryagain_for_publish_and_pull(redis_url: str) -> None:
    direct = redis.Redis.from_url(redis_url)
    with worker(redis_url) as w, RespConn(w.port) as c:
        c.hello(3, "alice")
        handle = as_map(c.call("SUB", "orders", "GROUP", "g"))["handle"]
        direct.config_set("min-replicas-to-write", 1)
        try:
            for command in (("PUB", "orders", "x"), ("PULL", handle, "COUNT", 5)):
                reply = c.call(*command)
                assert code(reply) == "TRYAGAIN", reply
                assert "NOREPLICAS" in str(reply)
        finally:
            direct.config_set("min-replicas-to-write", 0)
        assert c.call("PUB", "orders", "y").isdigit()


def test_a_full_redis_answers_oom_and_nothing_is_written(redis_url: str) -> None:
    direct = redis.Redis.from_url(redis_url)
    with worker(redis_url) as w, RespConn(w.port) as c:
        assert c.call("PUB", "orders", "first") == "1"
        direct.config_set("maxmemory-policy", "noeviction")
        direct.config_set("maxmemory", 1)
        try:
            sub = c.call("SUB", "invoices", "GROUP", "g")  # a new queue: refused by Redis itself
            pub = c.call("PUB", "orders", "x")
        finally:
            direct.config_set("maxmemory", 0)
        assert code(sub) == "OOM", sub
        assert "out of memory" in str(sub)
        # a publish has its own word for it (docs/operations.md, "Redis memory")
        assert code(pub) == "FULL" and "maxmemory" in str(pub), pub
        # (a memory alarm the worker sampled while maxmemory was 1 holds until its next sample)
        def published() -> object:
            reply = c.call("PUB", "orders", "y")
            return None if isinstance(reply, Err) and code(reply) == "FULL" else reply

        assert wait_for(published) == "2"  # the refused one took no id


def test_a_redis_that_cannot_persist_answers_misconf() -> None:
    doomed = tempfile.mkdtemp(prefix="fencemq-misconf-")
    with EmbeddedRedis(data_dir=doomed) as server, worker(server.url) as w, RespConn(w.port) as c:
        direct = server.client()
        direct.config_set("stop-writes-on-bgsave-error", "yes")
        direct.config_set("save", "3600 1")  # Redis refuses writes for a failed snapshot only with save points
        shutil.rmtree(doomed)  # the snapshot has nowhere to go
        direct.bgsave()
        wait_for(lambda: direct.info("persistence")["rdb_last_bgsave_status"] == "err", 10)
        reply = c.call("PUB", "orders", "x")
        assert code(reply) == "MISCONF", reply
        direct.config_set("stop-writes-on-bgsave-error", "no")
        assert c.call("PUB", "orders", "y").isdigit()


def test_a_pipelined_pub_batch_that_loses_redis_is_answered_not_dropped() -> None:
    server = EmbeddedRedis().start()
    try:
        with worker(server.url) as w, RespConn(w.port, timeout=30) as c:
            assert c.call("PUB", "orders", "warm") == "1"
            server.kill()
            started = time.monotonic()
            c.send_raw(pipeline(*[("PUB", "orders", f"m{i}") for i in range(5)], ("PING",)))
            replies = c.replies(6, timeout=30)
            assert [code(r) for r in replies[:5]] == ["TRYAGAIN"] * 5, replies
            assert replies[5] == "PONG"
            assert time.monotonic() - started < 20
    finally:
        server.stop()


def test_a_sweeper_whose_shard_went_dark_says_so_once_not_a_traceback_every_round(cluster, caplog) -> None:
    from tests.server.test_cluster_worker import masters_by_slot

    sessions_index = masters_by_slot(cluster)[key_slot(KEYS.sessions)]
    with worker(f"redis://127.0.0.1:{cluster[0].port}/0", sweep_interval_ms=20) as w:
        with caplog.at_level(logging.WARNING, logger="fencemq.server.sweeper"):
            cluster[sessions_index].kill()  # no replica to take over: every round meets it
            time.sleep(4.0)
        said = [r for r in caplog.records if r.name == "fencemq.server.sweeper"]
        assert len(said) == 1, [r.getMessage() for r in said]
        assert said[0].levelno == logging.WARNING and said[0].exc_info is None, said[0].getMessage()
        assert said[0].getMessage().startswith("sweep round failed, trying again every 20 ms"), said[0].getMessage()
        assert w._thread.is_alive()


@pytest.mark.parametrize("failure", [
    SlotNotCoveredError("Slot 5 is not covered by the cluster"),  # a Cluster shard gone dark, slots not yet moved
    RedisClusterException("Redis Cluster cannot be connected"),
    ConnectionRefusedError(111, "Connection refused"),  # an OSError, not a redis-py error at all
], ids=["slot not covered", "cluster unreachable", "socket refused"])
def test_a_redis_failure_redis_py_raises_outside_redis_error_is_tryagain_and_keeps_the_connection(
        redis_url: str, monkeypatch: pytest.MonkeyPatch, failure: Exception) -> None:
    # redis-py's Cluster client raises RedisClusterException (and a socket OSError) outside RedisError:
    # the doors catch what fences.redis_errors.REDIS_FAILURES names, not RedisError alone
    with worker(redis_url) as w, RespConn(w.port, timeout=10) as c:
        c.hello(3, "alice")
        handle = as_map(c.call("SUB", "orders", "GROUP", "g"))["handle"]
        c.call("PUB", "orders", "m")
        tag = as_map(c.call("PULL", handle)[0])["tag"]
        leases = w.worker.core.leases

        async def dark(*_args: object, **_kwargs: object) -> None:
            raise failure

        monkeypatch.setattr(leases, "ack_then_pull", dark)
        monkeypatch.setattr(leases, "pull", dark)
        c.send_raw(pipeline(("ACK", handle, tag), ("PULL", handle, "COUNT", 5), ("PULL", handle), ("PING",)))
        replies = c.replies(4, timeout=10)
        assert [code(r) for r in replies[:3]] == ["TRYAGAIN"] * 3, replies
        assert replies[3] == "PONG", "the same connection, still served"


def test_an_ack_pipelined_with_a_pull_on_a_shard_gone_dark_answers_both_with_tryagain(cluster) -> None:
    from tests.server.test_cluster_worker import masters_by_slot, topics_on_every_master

    topic = topics_on_every_master(cluster)[1]
    with worker(f"redis://127.0.0.1:{cluster[0].port}/0") as w, RespConn(w.port, timeout=60) as c:
        c.hello(3, "alice")
        handle = as_map(c.call("SUB", topic, "GROUP", "g"))["handle"]
        c.call("PUB", topic, "m")
        tag = as_map(c.call("PULL", handle)[0])["tag"]
        owner = masters_by_slot(cluster)
        assert len(set(owner.values())) == 3
        cluster[1].kill()  # the master that holds the queue, no replica to take over
        c.send_raw(pipeline(("ACK", handle, tag), ("PULL", handle, "COUNT", 5), ("PING",)))
        replies = c.replies(3, timeout=60)
        assert [code(r) for r in replies[:2]] == ["TRYAGAIN", "TRYAGAIN"], replies
        assert replies[2] == "PONG"


@pytest.mark.parametrize("loop", ["session keep-alive", "worker lease", "memory watch"])
def test_a_background_loop_that_meets_a_surprise_logs_it_and_goes_on_and_the_worker_serves_on(
        redis_url: str, caplog, loop: str) -> None:
    # redis-py has raised RuntimeError and AttributeError outside every Redis failure while a Cluster
    # node died (now translated where they start); one escaping a loop ended the whole worker.
    with worker(redis_url, session_lease_ms=1500, memory_sample_ms=50) as w, RespConn(w.port) as c:
        c.hello(3, "alice")
        services = w.worker.services
        owner, name = {"session keep-alive": (services.sessions, "keep_alive"),
                       "worker lease": (w.worker, "_still_here"),
                       "memory watch": (services.core.ctx.memory, "sample")}[loop]
        real = getattr(owner, name)
        calls = []

        async def surprised_once(*args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise AttributeError("'NoneType' object has no attribute 'writelines'")
            return await real(*args, **kwargs)

        with caplog.at_level(logging.ERROR):
            setattr(owner, name, surprised_once)
            wait_for(lambda: len(calls) >= 3, 10)  # the loop went on after the surprise
        assert any(r.levelno == logging.ERROR and r.exc_info for r in caplog.records), caplog.text
        assert c.call("PING") == "PONG"
        assert as_map(c.call("SUB", "orders", "GROUP", "g"))["handle"]  # served, with its session
    # (leaving the block raises the worker's error, had it ended on one)


def test_a_sweep_schedule_flush_that_meets_a_surprise_logs_it_and_the_next_flush_writes(redis_url: str, direct,
                                                                                        caplog) -> None:
    # The flush runs in the worker's task group, spawned by a PULL's lease: a surprise escaping it ended the worker.
    with worker(redis_url) as w, RespConn(w.port) as c:
        c.hello(3, "alice")
        ctx = w.worker.services.core.ctx
        real, calls = ctx.set_scores, []
        qid = QueueRef("orders").qid
        schedule = ctx.shards.keys_of(ctx.shards.shard_of(qid))[0]

        async def surprised_once(index, scores, *args, **kwargs):
            if index == schedule:  # not the sessions' or the worker's lease rounds, which also set scores
                calls.append(dict(scores))
                if len(calls) == 1:
                    raise AttributeError("'NoneType' object has no attribute 'writelines'")
            return await real(index, scores, *args, **kwargs)

        handle = as_map(c.call("SUB", "orders", "GROUP", "g"))["handle"]
        with caplog.at_level(logging.ERROR):
            ctx.set_scores = surprised_once
            for payload in ("a", "b"):
                c.call("PUB", "orders", payload)
                assert len(c.call("PULL", handle)) == 1
                wait_for(lambda: len(calls) >= (1 if payload == "a" else 2), 10)  # each lease's flush ran
        assert any(r.levelno == logging.ERROR and r.exc_info for r in caplog.records), caplog.text
        assert qid in calls[1] and direct.zscore(schedule, qid) is not None, "the next flush listed the queue"
        assert c.call("PING") == "PONG"
