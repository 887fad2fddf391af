"""Priority queues (issue 34): PUB … PRIORITY p on a topic set to honour it.

Through a worker and redis-py; what Redis holds is read straight from it. A priority queue
delivers its ready messages level 9 first, in publish order within a level; returned messages
still come before new ones; everything else (ids, the log, retention, SEEK) is a plain queue's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from typing import Any

import pytest
import redis
from typer.testing import CliRunner

from fencemq.cli.main import app
from fencemq.errors import PriorityOff
from fencemq.model.keys import Keyspace, QueueRef
from fencemq.ops import totals
from fencemq.ops.priority import set_priority
from tests.helpers import client, direct_async, error_code, honour_priority, in_cluster_mode, wait_for, worker
from tests.helpers import pulled as pull, subscribed as sub

KEYS = Keyspace()


def run_async(coro: Any) -> Any:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def totals_match(redis_url: str) -> None:
    async def go() -> None:
        r = direct_async(redis_url)
        try:
            counted = await totals.full_count(r, KEYS)
            kept = await totals.read_totals(r, KEYS)
            assert {k: kept[k] for k in counted["totals"]} == counted["totals"]
        finally:
            await r.aclose()
    run_async(go())


def payloads(deliveries: list[dict]) -> list[str]:
    return [d["payload"] for d in deliveries]


def ack(c: redis.Redis, handle: str, deliveries: list[dict]) -> int:
    return c.execute_command("ACK", handle, *[d["tag"] for d in deliveries]) if deliveries else 0


def index(direct: redis.Redis, topic: str) -> list[str]:
    return [m.decode() for m in direct.zrange(KEYS.queue(QueueRef(topic)).priority, 0, -1)]


def publish(c: redis.Redis, topic: str, *messages: tuple[str, int | None]) -> list[str]:
    ids = []
    for payload, level in messages:
        extra = ("PRIORITY", level) if level is not None else ()
        ids.append(c.execute_command("PUB", topic, payload, *extra).decode())
    return ids


def test_higher_levels_are_delivered_first_and_each_level_in_publish_order(redis_url, direct) -> None:
    assert honour_priority(redis_url, "jobs")["changed"]
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        h = sub(c, "jobs", "GROUP", "g")
        ids = publish(c, "jobs", ("a", None), ("b", 5), ("c", 9), ("d", 5), ("e", 0), ("f", 9))
        assert ids == ["1", "2", "3", "4", "5", "6"], "ids stay in publish order: one log"
        got = pull(c, h, 10)
        assert payloads(got) == ["c", "f", "b", "d", "a", "e"], "9 first, FIFO within a level, no PRIORITY is 0"
        assert [d["id"] for d in got] == ["3", "6", "2", "4", "1", "5"]
        assert ack(c, h, got) == 6
        assert direct.hlen(KEYS.queue(QueueRef("jobs")).log) == 0 and index(direct, "jobs") == [], \
            "settled by every group: gone from the log and the index"
        totals_match(redis_url)


def test_a_small_pull_takes_the_highest_ready_message_and_later_urgent_work_overtakes(redis_url, direct) -> None:
    honour_priority(redis_url, "jobs")
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        h = sub(c, "jobs", "GROUP", "g")
        c.execute_command("MPUB", "jobs", 3, b"r1", b"r2", b"r3", "PRIORITY", 1)
        assert payloads(pull(c, h, 1)) == ["r1"]
        publish(c, "jobs", ("urgent", 8))
        assert payloads(pull(c, h, 1)) == ["urgent"], "published later, delivered before the routine rest"
        assert payloads(pull(c, h, 5)) == ["r2", "r3"]
        totals_match(redis_url)


def test_a_returned_message_comes_before_new_ones_whatever_their_level(redis_url, direct) -> None:
    honour_priority(redis_url, "jobs")
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        h = sub(c, "jobs", "GROUP", "g")
        publish(c, "jobs", ("low", 0))
        first = pull(c, h, 1)
        publish(c, "jobs", ("high", 9))
        c.execute_command("NACK", h, first[0]["tag"])
        assert payloads(pull(c, h, 10)) == ["low", "high"], "what was returned is owed first (docs/protocol.md)"
        totals_match(redis_url)


def test_priority_on_a_queue_that_does_not_honour_it_or_out_of_range_is_refused_and_stores_nothing(
        redis_url, direct) -> None:
    plain = KEYS.queue(QueueRef("plain"))
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        sub(c, "plain", "GROUP", "g")
        before = direct.hgetall(plain.meta)
        for command in (("PUB", "plain", b"x", "PRIORITY", 3), ("MPUB", "plain", 2, b"x", b"y", "PRIORITY", 0),
                        ("PUB", "plain", b"x", "PRIORITY", 1, "DELAY", 500)):
            with pytest.raises(redis.ResponseError) as e:
                c.execute_command(*command)
            assert error_code(e.value) == "NOPRIORITY", command
            assert "fencemq priority set" in str(e.value)
        with pytest.raises(redis.ResponseError) as e:
            c.execute_command("PUB", "chat", b"x", "LMQ", "room-1", "PRIORITY", 2)
        assert error_code(e.value) == "NOPRIORITY" and "lmq" in str(e.value)
        honour_priority(redis_url, "jobs")
        for bad in (10, -1, "high"):
            with pytest.raises(redis.ResponseError) as e:
                c.execute_command("PUB", "jobs", b"x", "PRIORITY", bad)
            assert error_code(e.value) == "BADARG" and "PRIORITY" in str(e.value), bad
        assert direct.hgetall(plain.meta) == before, "nothing changed"
        assert direct.hlen(plain.log) == 0 and direct.zcard(plain.scheduled) == 0
        assert direct.hlen(KEYS.queue(QueueRef("jobs")).log) == 0
        assert not direct.exists(KEYS.queue(QueueRef("chat", "room-1")).log)
        totals_match(redis_url)


def test_priority_is_switched_only_while_the_log_is_empty(redis_url, direct) -> None:
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        h = sub(c, "jobs", "GROUP", "g")
        publish(c, "jobs", ("x", None))
        with pytest.raises(PriorityOff) as e:
            honour_priority(redis_url, "jobs")
        assert "empty" in str(e.value)
        assert direct.hget(KEYS.queue(QueueRef("jobs")).meta, "prio") is None
        assert ack(c, h, pull(c, h)) == 1  # drained: the log is empty again
        assert honour_priority(redis_url, "jobs")["changed"]
        assert not honour_priority(redis_url, "jobs")["changed"], "on already"
        publish(c, "jobs", ("a", 2), ("b", 7))
        assert payloads(pull(c, h)) == ["b", "a"]
        with pytest.raises(PriorityOff):
            run_async(_set_lmq(redis_url))


async def _set_lmq(redis_url: str) -> Any:
    r = direct_async(redis_url)
    try:
        return await set_priority(r, KEYS, QueueRef("chat", "room-1"), True)
    finally:
        await r.aclose()


def test_seek_moves_every_level_to_the_target_and_rereads_in_priority_order(redis_url, direct) -> None:
    honour_priority(redis_url, "jobs")
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        h = sub(c, "jobs", "GROUP", "g")
        publish(c, "jobs", ("a", 0), ("b", 9), ("c", 4), ("d", 9), ("e", 0))
        assert payloads(pull(c, h, 2)) == ["b", "d"]
        c.execute_command("SEEK", h, "EARLIEST")
        assert payloads(pull(c, h, 10)) == ["b", "d", "c", "a", "e"], "a cursor is an id: every level reads from it"
        c.execute_command("SEEK", h, "ID", 3)
        assert payloads(pull(c, h, 10)) == ["d", "c", "e"], "ids 3.. at every level, 9 first"
        c.execute_command("SEEK", h, "LATEST")
        assert pull(c, h) == []
        totals_match(redis_url)


def test_a_new_group_from_an_id_reads_every_level_from_there(redis_url, direct) -> None:
    honour_priority(redis_url, "jobs")
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        sub(c, "jobs", "GROUP", "g")
        publish(c, "jobs", ("a", 9), ("b", 0), ("c", 9), ("d", 1))
        late = sub(c, "jobs", "GROUP", "late", "FROM", "ID", 2)
        assert payloads(pull(c, late, 10)) == ["c", "d", "b"]
        totals_match(redis_url)


def test_retention_trims_the_oldest_ids_from_the_log_and_from_every_level(redis_url, direct) -> None:
    direct.hset(KEYS.retention, "audit", "3 0 0")  # `fencemq retention set audit --count 3`
    honour_priority(redis_url, "audit")
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        h = sub(c, "audit", "GROUP", "g")
        publish(c, "audit", ("a", 9), ("b", 5))
        assert payloads(pull(c, h, 1)) == ["a"], "read ahead of b"
        publish(c, "audit", ("c", 0), ("d", 5), ("e", 9), ("f", 0))
        assert sorted(index(direct, "audit"), key=int) == ["4", "5", "6"], "the index holds what the log holds"
        assert payloads(pull(c, h, 10)) == ["e", "d", "f"], "b and c went unread with the log's head"
        totals_match(redis_url)
        c.execute_command("SEEK", h, "EARLIEST")
        assert payloads(pull(c, h, 10)) == ["e", "d", "f"]
        totals_match(redis_url)


def test_purge_drops_every_level_of_every_group_and_new_messages_still_flow(redis_url, direct) -> None:
    honour_priority(redis_url, "jobs")
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        h = sub(c, "jobs", "GROUP", "g")
        publish(c, "jobs", ("a", 9), ("b", 0), ("c", 3))
        assert payloads(pull(c, h, 1)) == ["a"]
        result = CliRunner().invoke(app, ["purge", "jobs", "--yes", "--json", "--redis-url", redis_url]
                                    + (["--cluster"] if in_cluster_mode() else []))
        assert result.exit_code == 0, result.stdout + result.stderr
        assert pull(c, h) == []
        totals_match(redis_url)
        publish(c, "jobs", ("new-low", 1), ("new-high", 6))
        assert payloads(pull(c, h)) == ["new-high", "new-low"]
        totals_match(redis_url)


def test_a_shared_group_hands_out_the_highest_levels_first_across_its_members(redis_url, direct) -> None:
    honour_priority(redis_url, "jobs")
    with worker(redis_url) as w:
        c1, c2 = client(w.port, 2, "c1"), client(w.port, 2, "c2")
        h1 = sub(c1, "jobs", "GROUP", "g", "MODE", "shared")
        h2 = sub(c2, "jobs", "GROUP", "g", "MODE", "shared")
        publish(c1, "jobs", ("l1", 1), ("l2", 1), ("h1", 8), ("h2", 8))
        assert payloads(pull(c1, h1, 2)) == ["h1", "h2"]
        assert payloads(pull(c2, h2, 2)) == ["l1", "l2"]
        totals_match(redis_url)


def test_a_push_group_with_the_hash_strategy_keeps_the_levels_when_a_member_is_full(redis_url, direct) -> None:
    honour_priority(redis_url, "jobs")
    with worker(redis_url) as w:
        c1, c2 = client(w.port, 2, "c1"), client(w.port, 2, "c2")
        h1 = sub(c1, "jobs", "GROUP", "g", "MODE", "shared", "STRATEGY", "hash", "PUSH", "CAPACITY", 1)
        h2 = sub(c2, "jobs", "GROUP", "g", "MODE", "shared", "STRATEGY", "hash", "PUSH", "CAPACITY", 1)
        publish(c1, "jobs", *[(f"m{i}", i % 10) for i in range(8)])
        got = []

        def drained() -> bool:
            for c, h in ((c1, h1), (c2, h2)):
                reply = c.execute_command("TAKE", h)
                if reply and reply != b"EOS":
                    d = {k.decode(): v for k, v in zip(reply[::2], reply[1::2])}
                    got.append(d["payload"].decode())
                    c.execute_command("ACK", h, d["tag"])
            return len(got) >= 8

        wait_for(drained, 10, what="8 deliveries")
        assert sorted(got) == sorted(f"m{i}" for i in range(8)), "every message once, none lost when given back"
        totals_match(redis_url)


def test_a_delayed_priority_message_keeps_its_level_when_it_becomes_due(redis_url, direct) -> None:
    honour_priority(redis_url, "jobs")
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        h = sub(c, "jobs", "GROUP", "g")
        sid = c.execute_command("PUB", "jobs", b"later-urgent", "PRIORITY", 9, "DELAY", 300).decode()
        assert sid.startswith("s") and sid.endswith("p9"), "the schedule id carries the level"
        publish(c, "jobs", ("now-1", None), ("now-2", 3))

        def released() -> bool:
            return direct.hlen(KEYS.queue(QueueRef("jobs")).log) == 3

        wait_for(released, 5, what="the release")
        assert payloads(pull(c, h, 10)) == ["later-urgent", "now-2", "now-1"]
        cancel = c.execute_command("PUB", "jobs", b"never", "PRIORITY", 4, "DELAY", 60_000).decode()
        assert c.execute_command("UNPUB", "jobs", cancel) == 1, "UNPUB takes the id the publish answered"
        totals_match(redis_url)


def test_operators_see_messages_per_level_and_each_groups_unread(redis_url, direct) -> None:
    honour_priority(redis_url, "jobs")
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        h = sub(c, "jobs", "GROUP", "g")
        publish(c, "jobs", ("a", 9), ("b", 9), ("c", 2), ("d", None))
        pull(c, h, 1)
        cluster = ["--cluster"] if in_cluster_mode() else []
        result = CliRunner().invoke(app, ["priority", "show", "jobs", "--json", "--redis-url", redis_url] + cluster)
        assert result.exit_code == 0, result.stdout + result.stderr
        shown = json.loads(result.stdout)
        assert shown["priority"] is True
        assert shown["levels"] == {"9": 2, "2": 1, "0": 1}
        assert shown["unread"] == {"g": {"9": 1, "2": 1, "0": 1}}
        inspected = CliRunner().invoke(app, ["inspect", "queue", "jobs", "--json", "--redis-url", redis_url] + cluster)
        assert inspected.exit_code == 0, inspected.stdout + inspected.stderr
        queue = json.loads(inspected.stdout)
        assert queue["priority"]["levels"] == {"9": 2, "2": 1, "0": 1}
        assert [(g["group"], g["unread"]) for g in queue["groups"]] == [("g", 3)], "read ahead is not unread"
        text = CliRunner().invoke(app, ["inspect", "queue", "jobs", "--redis-url", redis_url] + cluster)
        assert "level 9: 2, level 2: 1, level 0: 1" in " ".join(text.stdout.split())
        shown_text = CliRunner().invoke(app, ["priority", "show", "jobs", "--redis-url", redis_url] + cluster)
        assert shown_text.exit_code == 0 and "unread" in shown_text.stdout
        off = CliRunner().invoke(app, ["priority", "set", "jobs", "off", "--redis-url", redis_url] + cluster)
        assert off.exit_code != 0 and "empty" in off.stdout + off.stderr


def test_a_waiting_long_poll_is_handed_the_message_a_publish_brings(redis_url, direct) -> None:
    honour_priority(redis_url, "jobs")
    with worker(redis_url) as w:
        c, producer = client(w.port, 2, "alice"), client(w.port, 2, "bob")
        h = sub(c, "jobs", "GROUP", "g")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(c.execute_command, "PULL", h, "COUNT", 5, "BLOCK", 5000)
            time.sleep(0.3)
            producer.execute_command("PUB", "jobs", b"urgent", "PRIORITY", 9)
            reply = waiting.result(timeout=10)
        assert reply and b"urgent" in [v for d in reply for v in d]
        totals_match(redis_url)


def test_a_dead_letter_replayed_is_delivered_again_after_its_level_was_read(redis_url, direct) -> None:
    honour_priority(redis_url, "jobs")
    with worker(redis_url, max_failures=1) as w:
        c = client(w.port, 2, "alice")
        h = sub(c, "jobs", "GROUP", "g")
        publish(c, "jobs", ("later", 0), ("bad", 9))  # bad's id is above the group's lowest unread (later's)
        bad = pull(c, h, 1)
        assert payloads(bad) == ["bad"]
        assert c.execute_command("NACK", h, bad[0]["tag"]) == 1  # max_failures 1: dead-lettered
        cluster = ["--cluster"] if in_cluster_mode() else []
        replayed = CliRunner().invoke(app, ["dlq", "replay", "jobs", "--yes", "--json", "--redis-url", redis_url]
                                      + cluster)
        assert replayed.exit_code == 0, replayed.stdout + replayed.stderr
        assert payloads(pull(c, h, 10)) == ["bad", "later"], "returned to the group: before new ones"
        totals_match(redis_url)


def test_a_groups_unread_counts_its_levels_in_inspect_group_and_the_queue_listing(redis_url, direct) -> None:
    from fencemq.ops.inspection import inspect_group
    from fencemq.ops.operations import queue_rows

    honour_priority(redis_url, "jobs")
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        h = sub(c, "jobs", "GROUP", "g")
        publish(c, "jobs", ("low-1", 1), ("low-2", 1), ("high", 9))
        assert payloads(pull(c, h, 1)) == ["high"]  # id 3 read; the group's cursor stays at 1 (low-water)

        async def read() -> tuple[dict, list[dict]]:
            r = direct_async(redis_url)
            try:
                return (await inspect_group(r, KEYS, QueueRef("jobs"), "g"),
                        await queue_rows(r, KEYS, [QueueRef("jobs").qid]))
            finally:
                await r.aclose()

        group, rows = run_async(read())
        assert (group["cursor"], group["unread"], group["unread_by_level"]) == (1, 2, {1: 2})
        assert group["backlog"] == 2 and rows[0]["backlog"] == 2, "not seq - cursor + 1 = 3"
        c.close()
