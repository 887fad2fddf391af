"""Retention by choice (issue 27): what every group has settled leaves Redis, unless the topic's policy keeps it.

Through a worker and redis-py, against the session's Redis (a Cluster under ``--redis-cluster``): what the
log holds is read straight from Redis (the queue's ``log`` hash and its meta's ``first``).
"""

from __future__ import annotations

import time

import redis

from fencemq.model.keys import Keyspace, QueueRef
from tests.helpers import pulled as pull, subscribed as sub, client, worker

KEYS = Keyspace()


def kept(direct: redis.Redis, topic: str, lmq: str | None = None) -> list[int]:
    """The ids the queue's log holds, in order."""
    return sorted(int(i) for i in direct.hkeys(KEYS.queue(QueueRef(topic, lmq)).log))


def ack(c: redis.Redis, handle: str, got: list[dict]) -> int:
    return c.execute_command("ACK", handle, *[d["tag"] for d in got])


def test_a_message_every_group_has_settled_leaves_the_log_and_one_still_held_stays(redis_url, direct) -> None:
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        g1, g2 = sub(c, "orders", "GROUP", "g1"), sub(c, "orders", "GROUP", "g2")
        c.execute_command("MPUB", "orders", 10, *[b"m%d" % i for i in range(10)])
        got = pull(c, g1)
        assert ack(c, g1, got) == 10
        assert kept(direct, "orders") == list(range(1, 11))  # g2 has read none of them
        late = pull(c, g2, 3)  # g2 holds 1-3 unacknowledged
        assert ack(c, g2, pull(c, g2)) == 7  # and settles 4-10
        assert kept(direct, "orders") == list(range(1, 11)), "trimmed from the head only: 1-3 still held"
        assert ack(c, g2, late[:2]) == 2
        assert kept(direct, "orders") == list(range(3, 11))
        assert ack(c, g2, late[2:]) == 1
        assert kept(direct, "orders") == []
        assert direct.hget(KEYS.queue(QueueRef("orders")).meta, "first") == b"11"


def test_a_discarded_or_dead_lettered_message_is_settled_and_a_replayed_dead_letter_brings_its_message_back(
        redis_url, direct) -> None:
    from typer.testing import CliRunner

    from fencemq.cli.main import app

    with worker(redis_url, max_failures=1) as w:
        c = client(w.port, 2, "alice")
        h = sub(c, "jobs", "GROUP", "g")
        c.execute_command("MPUB", "jobs", 3, b"a", b"b", b"c")
        got = pull(c, h)
        assert c.execute_command("NACK", h, got[0]["tag"], "DISCARD") == 1
        assert c.execute_command("NACK", h, got[1]["tag"]) == 1  # max_failures 1: dead-lettered
        assert ack(c, h, got[2:]) == 1
        assert kept(direct, "jobs") == []
        replayed = CliRunner().invoke(app, ["dlq", "replay", "jobs", "--yes", "--json", "--redis-url", redis_url])
        assert replayed.exit_code == 0, replayed.stdout + replayed.stderr
        again = pull(c, h)
        assert [(d["id"], d["payload"]) for d in again] == [("2", "b")]
        assert ack(c, h, again) == 1
        assert kept(direct, "jobs") == []  # the replayed message left again once settled


def test_a_replayed_dead_letter_below_the_head_stays_while_another_groups_lease_batch_holds_it(
        redis_url, direct) -> None:
    # Both groups dead-letter message 2, so the log drops it; both replay it. Group h2 then pulls it in one
    # lease batch with a newer message: the batch's one holding entry stands for it, and h1 settling its
    # own copy must not delete the body h2 still holds.
    from typer.testing import CliRunner

    from fencemq.cli.main import app

    with worker(redis_url, max_failures=1) as w:
        c = client(w.port, 2, "alice")
        h1, h2 = sub(c, "jobs", "GROUP", "g1"), sub(c, "jobs", "GROUP", "g2")
        c.execute_command("MPUB", "jobs", 3, b"a", b"b", b"c")
        for h in (h1, h2):
            got = pull(c, h)
            assert c.execute_command("NACK", h, got[1]["tag"]) == 1  # max_failures 1: dead-lettered
            assert ack(c, h, [got[0], got[2]]) == 2
        assert kept(direct, "jobs") == []
        replayed = CliRunner().invoke(app, ["dlq", "replay", "jobs", "--count", "2", "--yes", "--json",
                                            "--redis-url", redis_url])
        assert replayed.exit_code == 0, replayed.stdout + replayed.stderr
        c.execute_command("PUB", "jobs", b"d")
        held = pull(c, h2)
        assert [(d["id"], d["payload"]) for d in held] == [("2", "b"), ("4", "d")]
        assert ack(c, h1, pull(c, h1)) == 2
        assert kept(direct, "jobs") == [2, 4], "g2 holds both: neither goes"
        assert ack(c, h2, held[1:]) == 1
        assert kept(direct, "jobs") == [2, 4], "the log's head waits for the lowest id still checked out"
        assert ack(c, h2, held[:1]) == 1
        assert kept(direct, "jobs") == []


def test_a_topic_with_a_retention_policy_keeps_what_was_consumed_up_to_its_count(redis_url, direct) -> None:
    direct.hset(KEYS.retention, "audit", "5 0 0")  # what `fencemq retention set audit --count 5` writes
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        h = sub(c, "audit", "GROUP", "g")
        c.execute_command("MPUB", "audit", 10, *[b"m%d" % i for i in range(10)])
        assert kept(direct, "audit") == [6, 7, 8, 9, 10]  # a count keeps the newest, read or not
        assert ack(c, h, pull(c, h)) == 5
        assert kept(direct, "audit") == [6, 7, 8, 9, 10]
        c.execute_command("SEEK", h, "EARLIEST")
        assert [d["id"] for d in pull(c, h)] == ["6", "7", "8", "9", "10"]


def test_a_retention_policy_by_age_trims_even_what_nobody_read(redis_url, direct) -> None:
    direct.hset(KEYS.retention, "ticks", "0 300 0")
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        sub(c, "ticks", "GROUP", "g")
        c.execute_command("MPUB", "ticks", 3, b"a", b"b", b"c")
        time.sleep(0.4)
        c.execute_command("PUB", "ticks", b"d")
        assert kept(direct, "ticks") == [4]


def test_a_retention_policy_by_bytes_keeps_the_log_near_its_size(redis_url, direct) -> None:
    direct.hset(KEYS.retention, "blobs", f"0 0 {64 << 10}")
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        sub(c, "blobs", "GROUP", "g")
        for _ in range(10):
            c.execute_command("MPUB", "blobs", 20, *[b"x" * 1024] * 20)
        log = KEYS.queue(QueueRef("blobs")).log
        assert len(kept(direct, "blobs")) < 200
        assert direct.memory_usage(log, samples=0) < 1.5 * (64 << 10)


def test_a_topic_without_groups_keeps_its_messages_for_its_first_subscriber(redis_url, direct) -> None:
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        c.execute_command("MPUB", "early", 3, b"a", b"b", b"c")
        c.execute_command("PUB", "early", b"d")
        assert kept(direct, "early") == [1, 2, 3, 4]
        h = sub(c, "early", "GROUP", "g", "FROM", "EARLIEST")
        assert [d["payload"] for d in pull(c, h)] == ["a", "b", "c", "d"]


def test_an_lmq_drops_what_its_owner_settled_unless_its_lite_topic_keeps_it(redis_url, direct) -> None:
    direct.hset(KEYS.retention, "kept-chats", "100 0 0")
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        ids = {}
        for topic in ("chats", "kept-chats"):
            h = sub(c, topic, "LMQ", "s1")
            ids[topic] = [int(i) for i in c.execute_command("MPUB", topic, 3, b"a", b"b", b"c", "LMQ", "s1")]
            assert ack(c, h, pull(c, h)) == 3
        assert kept(direct, "chats", "s1") == []
        assert kept(direct, "kept-chats", "s1") == ids["kept-chats"]
