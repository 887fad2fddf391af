"""Scheduled messages (issue 34): PUB … DELAY ms | AT unix-ms, and UNPUB.

Through a worker (whose sweeper releases what is due) and redis-py; what Redis holds is read
straight from it. A scheduled message is stored at once, outside the log, and appended to the
log when due, so every rule below follows from "it is published at its time".
"""

from __future__ import annotations

import time

import pytest
import redis

from fencemq.model.keys import Keyspace, QueueRef
from tests import helpers
from tests.helpers import pulled as pull, subscribed as sub, as_map, client, error_code, wait_for, worker

KEYS = Keyspace()


def pull_until(c: redis.Redis, handle: str, n: int = 1, timeout: float = 5.0) -> list[dict]:
    got: list[dict] = []

    def more() -> bool:
        got.extend(pull(c, handle))
        return len(got) >= n

    wait_for(more, timeout, what=f"{n} deliveries")
    return got


def scheduled(direct: redis.Redis, topic: str, lmq: str | None = None) -> int:
    return direct.zcard(KEYS.queue(QueueRef(topic, lmq)).scheduled)


def redis_ms(direct: redis.Redis) -> int:
    s, us = direct.time()
    return s * 1000 + us // 1000


def test_a_delayed_message_is_stored_at_once_and_delivered_only_when_due(redis_url, direct) -> None:
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        h = sub(c, "jobs", "GROUP", "g")
        before = redis_ms(direct)
        sid = c.execute_command("PUB", "jobs", b"later", "DELAY", 600).decode()
        assert sid.startswith("s") and sid[1:].isdigit()
        assert scheduled(direct, "jobs") == 1
        assert direct.hlen(KEYS.queue(QueueRef("jobs")).log) == 0, "nothing is in the log before its time"
        assert pull(c, h) == []
        got = pull_until(c, h)
        assert [d["payload"] for d in got] == ["later"]
        assert int(got[0]["ts"]) >= before + 600, "delivered at its time, not before (Redis's clock)"
        assert got[0]["id"] == "1", "it got its message id when it entered the log"
        assert scheduled(direct, "jobs") == 0


def test_at_schedules_by_unix_time_and_a_time_already_past_publishes_at_once(redis_url, direct) -> None:
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        h = sub(c, "jobs", "GROUP", "g")
        now = redis_ms(direct)
        sid = c.execute_command("PUB", "jobs", b"at", "AT", now + 500).decode()
        assert sid.startswith("s")
        assert c.execute_command("PUB", "jobs", b"past", "AT", now - 10_000) == b"1"
        assert [d["payload"] for d in pull(c, h)] == ["past"]
        got = pull_until(c, h)
        assert [d["payload"] for d in got] == ["at"]
        assert int(got[0]["ts"]) >= now + 500


def test_a_group_created_after_the_publish_but_before_the_time_receives_it(redis_url, direct) -> None:
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        c.execute_command("PUB", "jobs", b"x", "DELAY", 400)
        late = sub(c, "jobs", "GROUP", "late", "FROM", "LATEST")
        assert [d["payload"] for d in pull_until(c, late)] == ["x"], "every subscription that exists then"


def test_a_seek_to_latest_before_the_time_does_not_skip_a_scheduled_message(redis_url, direct) -> None:
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        h = sub(c, "jobs", "GROUP", "g")
        c.execute_command("PUB", "jobs", b"later", "DELAY", 400)
        c.execute_command("PUB", "jobs", b"now")
        c.execute_command("SEEK", h, "LATEST")
        assert pull(c, h) == []
        assert [d["payload"] for d in pull_until(c, h)] == ["later"]


def test_unpub_cancels_a_scheduled_message_and_a_released_one_is_not_cancellable(redis_url, direct) -> None:
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        h = sub(c, "jobs", "GROUP", "g")
        keep = c.execute_command("PUB", "jobs", b"keep", "DELAY", 300).decode()
        drop = c.execute_command("MPUB", "jobs", 2, b"d1", b"d2", "DELAY", 300)
        assert c.execute_command("UNPUB", "jobs", *drop) == 2
        assert c.execute_command("UNPUB", "jobs", *drop) == 0, "cancelled once"
        assert scheduled(direct, "jobs") == 1
        assert [d["payload"] for d in pull_until(c, h)] == ["keep"]
        time.sleep(0.3)
        assert pull(c, h) == [], "the cancelled ones never come"
        assert c.execute_command("UNPUB", "jobs", keep) == 0, "released: in the log, no longer scheduled"


def test_bad_schedules_are_refused_and_change_nothing(redis_url, direct) -> None:
    with worker(redis_url, max_delay_ms=60_000) as w:
        c = client(w.port, 2, "alice")
        now = redis_ms(direct)
        for args, word in [(("DELAY", -1), "DELAY"), (("DELAY", "soon"), "DELAY"), (("DELAY", 60_001), "DELAY"),
                           (("AT", now + 120_000), "AT"), (("DELAY", 5, "AT", now), "DELAY or AT"),
                           (("RETAIN", "DELAY", 5), "RETAIN")]:
            with pytest.raises(redis.ResponseError) as e:
                c.execute_command("PUB", "jobs", b"x", *args)
            assert error_code(e.value) == "BADARG" and word in str(e.value), (args, str(e.value))
        for bad in ["1", "sx", "LMQ"]:
            with pytest.raises(redis.ResponseError) as e:
                c.execute_command("UNPUB", "jobs", bad)
            assert error_code(e.value) in ("BADARG", "ERR"), bad
        assert scheduled(direct, "jobs") == 0
        assert direct.hlen(KEYS.queue(QueueRef("jobs")).log) == 0


def test_a_repeated_dedup_id_returns_the_first_schedule_id_and_stores_nothing(redis_url, direct) -> None:
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        a = c.execute_command("PUB", "jobs", b"x", "DELAY", 5000, "ID", "job-1")
        assert c.execute_command("PUB", "jobs", b"x", "DELAY", 5000, "ID", "job-1") == a
        ids = c.execute_command("MPUB", "jobs", 3, b"a", b"b", b"c", "DELAY", 5000, "ID", "batch-1")
        assert c.execute_command("MPUB", "jobs", 3, b"a", b"b", b"c", "DELAY", 5000, "ID", "batch-1") == ids
        assert scheduled(direct, "jobs") == 4


def take(c: redis.Redis, handle: str, block_ms: int = 2000) -> dict | None:
    got = c.execute_command("TAKE", handle, "BLOCK", block_ms)
    return None if got is None else as_map(got)


def test_an_lmq_preempted_before_the_time_gives_the_message_to_its_owner_then(redis_url, direct) -> None:
    with worker(redis_url) as w:
        a, b = client(w.port, 2, "a"), client(w.port, 2, "b")
        ha = sub(a, "chats", "LMQ", "room1")
        a.execute_command("PUB", "chats", b"hello", "LMQ", "room1", "DELAY", 400)
        hb = sub(b, "chats", "LMQ", "room1")  # preempts a
        assert [d["payload"] for d in pull_until(b, hb)] == ["hello"]
        assert pull(a, ha) == [], "the evicted owner gets nothing"


def test_a_share_group_whose_members_change_before_the_time_serves_it_to_one_member_then(redis_url, direct) -> None:
    with worker(redis_url) as w:
        a, b, c = client(w.port, 2, "a"), client(w.port, 2, "b"), client(w.port, 2, "c")
        ha = sub(a, "$share/g/orders/#")
        c.execute_command("PUB", "orders/1", b"due", "DELAY", 500)
        hb = sub(b, "$share/g/orders/#")  # a member joins …
        a.execute_command("UNSUB", ha)  # … and the first leaves, before the time
        got = take(b, hb, 3000)
        assert got is not None and got["payload"] == "due" and got["topic"] == "orders/1"
        assert take(b, hb, 300) is None, "one copy for the group"


def test_a_filter_subscription_made_after_the_publish_receives_it_and_one_gone_does_not(redis_url, direct) -> None:
    with worker(redis_url) as w:
        a, b = client(w.port, 2, "a"), client(w.port, 2, "b")
        gone = sub(a, "metrics/#")
        b.execute_command("MPUB", "metrics/cpu", 2, b"m1", b"m2", "DELAY", 500)
        a.execute_command("UNSUB", gone)
        hb = sub(b, "metrics/+")
        assert [take(b, hb, 3000)["payload"], take(b, hb)["payload"]] == ["m1", "m2"]
        assert take(b, hb, 300) is None


def test_a_release_run_again_after_its_copies_copies_nothing_twice(redis_url, direct) -> None:
    """A sweeper that dies between the filter copies and the release: the next one copies again (the same dedup
    ids: nothing new) and releases."""
    import anyio

    from fencemq.config import Config
    from fencemq.fences.core import Core

    with worker(redis_url, sweep_interval_ms=600_000) as w:  # this test sweeps, not the worker
        b = client(w.port, 2, "b")
        hb = sub(b, "copies/+")
        b.execute_command("PUB", "copies/x", b"once", "DELAY", 100)
        time.sleep(0.2)

        async def copy_twice_then_release() -> int:
            r = helpers.direct_async(redis_url)
            core = Core(r, Config(redis_url=redis_url))
            ref = QueueRef("copies/x")
            later = redis_ms(direct)
            refs = await core.shared.registry.matching(ref.topic)
            due = await core.scheduling.due(ref, later, 10)
            for _ in range(2):  # the copies, as a sweeper that died before releasing made them, then again
                for target in refs:
                    await core.publishing.append(target, [core.shared._copy_body(ref.topic, body) for _, body in due],
                                                 [f"\0release\0{ref.qid}\0{sid}" for sid, _ in due])
            released = await core.shared.release_due(ref, later)
            await r.aclose()
            return released

        assert anyio.run(copy_twice_then_release) == 1
        assert take(b, hb)["payload"] == "once"
        assert take(b, hb, 300) is None, "copied once"


def test_max_counts_a_scheduled_message_when_it_is_delivered_not_when_published(redis_url, direct) -> None:
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        h = sub(c, "jobs", "GROUP", "g", "MAX", 2)
        c.execute_command("PUB", "jobs", b"later", "DELAY", 300)
        c.execute_command("PUB", "jobs", b"now")
        assert [d["payload"] for d in pull(c, h)] == ["now"]
        assert [d["payload"] for d in pull_until(c, h)] == ["later"]
        c.execute_command("PUB", "jobs", b"third", "DELAY", 100)
        time.sleep(0.4)
        assert pull(c, h) == [], "MAX 2 reached"


def test_scheduled_messages_are_not_trimmed_by_retention_and_do_not_hold_the_log(redis_url, direct) -> None:
    with worker(redis_url) as w:
        direct.hset(KEYS.retention, "kept", "2 0 0")  # `fencemq retention set kept --count 2`
        c = client(w.port, 2, "alice")
        h = sub(c, "kept", "GROUP", "g")
        c.execute_command("MPUB", "kept", 3, b"s1", b"s2", b"s3", "DELAY", 60_000)
        c.execute_command("MPUB", "kept", 5, *[b"n%d" % i for i in range(5)])
        log = KEYS.queue(QueueRef("kept")).log
        assert sorted(int(i) for i in direct.hkeys(log)) == [4, 5], "the policy trims the log …"
        assert scheduled(direct, "kept") == 3, "… not what waits for its time"
        plain = sub(c, "plain", "GROUP", "g")
        c.execute_command("PUB", "plain", b"later", "DELAY", 60_000)
        c.execute_command("MPUB", "plain", 3, b"a", b"b", b"c")
        got = pull(c, plain)
        assert c.execute_command("ACK", plain, *[d["tag"] for d in got]) == 3
        assert direct.hlen(KEYS.queue(QueueRef("plain")).log) == 0, "settled messages go: a scheduled one holds nothing"
        assert pull(c, h)  # the kept topic's group reads what the policy kept


def test_a_released_message_is_dead_lettered_like_any_other(redis_url, direct) -> None:
    with worker(redis_url, max_failures=2) as w:
        c = client(w.port, 2, "alice")
        h = sub(c, "jobs", "GROUP", "g")
        c.execute_command("PUB", "jobs", b"poison", "DELAY", 200)
        for _ in range(2):
            got = pull_until(c, h)
            c.execute_command("NACK", h, got[0]["tag"])
        assert pull(c, h) == []
        dead = direct.lrange(KEYS.queue(QueueRef("jobs")).dead, 0, -1)
        assert len(dead) == 1


def test_a_scheduled_message_survives_a_worker_restart(redis_url, direct) -> None:
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        c.execute_command("PUB", "jobs", b"durable", "DELAY", 800)
    with worker(redis_url) as w:
        c = client(w.port, 2, "bob")
        h = sub(c, "jobs", "GROUP", "g", "FROM", "LATEST")
        assert [d["payload"] for d in pull_until(c, h)] == ["durable"]
