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
from tests.helpers import as_map, client, deliveries, error_code, wait_for, worker

KEYS = Keyspace()


@pytest.fixture
def direct(redis_url):
    r = helpers.direct(redis_url)
    yield r
    r.close()


def sub(c: redis.Redis, topic: str, *args: object) -> str:
    return as_map(c.execute_command("SUB", topic, *args))["handle"]


def pull(c: redis.Redis, handle: str, n: int = 100) -> list[dict]:
    return deliveries(c.execute_command("PULL", handle, "COUNT", n))


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
