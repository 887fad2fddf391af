"""Message expiry (issue 34): PUB … TTL ms, and MQTT's Message Expiry Interval, one rule.

A message with a TTL carries its deadline (Redis's clock) in its first header; once it has passed,
the fences settle the message for every group that meets it without delivering it (lua/lib/expiry.lua
take_next, and a push mailbox's TAKE), and count it: ``expired`` in the totals, broker-wide and per
entry. Through a worker and redis-py; what Redis holds is read straight from it.
"""

from __future__ import annotations

import re
import time

import anyio
import pytest
import redis

from fencemq.model.keys import Keyspace, QueueRef
from fencemq.model.messages import EXPIRES, pack_body, unpack_delivery
from fencemq.ops import totals
from tests import helpers
from tests.helpers import pulled as pull, subscribed as sub, as_map, client, error_code, worker
from tests.server.mqtt.clients import Client

KEYS = Keyspace()


def redis_ms(direct: redis.Redis) -> int:
    s, us = direct.time()
    return s * 1000 + us // 1000


def sleep_until(direct: redis.Redis, ms: int) -> None:
    """Until Redis's clock reads ``ms`` or later (the fences judge expiry by it)."""
    while redis_ms(direct) < ms:
        time.sleep(0.02)


def sleep_past_expiries(direct: redis.Redis, topic: str) -> None:
    """Until Redis's clock is past every near deadline of the messages in ``topic``'s log (the TTLs under
    30 s here): the deadlines are stamped by the worker's reading of Redis's clock."""
    now = redis_ms(direct)
    deadlines = [int(m.group(1)) for v in direct.hvals(KEYS.queue(QueueRef(topic)).log)
                 for m in [re.search(rb"mqtt-expires-ms\r\n\$\d+\r\n(\d+)", v)] if m]
    near = [d for d in deadlines if d < now + 30_000]
    assert near, "a message with a near expiry is in the log"
    sleep_until(direct, max(near) + 1)


def counted(redis_url: str, entry: str) -> tuple[int, dict[str, int]]:
    """The broker's expired total, and the entry's figures, from the totals the fences keep (a Cluster's
    summed over its slots)."""
    async def read() -> tuple[int, dict[str, int]]:
        r = helpers.direct_async(redis_url)
        try:
            return ((await totals.read_totals(r, KEYS))["expired"],
                    (await totals.entry_figures(r, KEYS, [entry]))[entry])
        finally:
            await r.aclose()
    return anyio.run(read)


def test_the_expiry_header_is_packed_first_whatever_order_it_was_given_in() -> None:
    body = pack_body(b"p", {"a": "1", EXPIRES: "123", "b": "2"}, 1, "alice", "t/x")
    d = unpack_delivery("t/+", None, 0, b"1", 1, 1, b"5:" + body)
    assert list(d.headers) == [EXPIRES, "a", "b"] and d.headers[EXPIRES] == "123"


def test_a_message_is_delivered_before_its_ttl_and_settled_unsent_and_counted_after(redis_url, direct) -> None:
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        h = sub(c, "jobs", "GROUP", "g")
        before = redis_ms(direct)
        c.execute_command("PUB", "jobs", b"live", "TTL", 60_000)
        got = pull(c, h)
        assert [d["payload"] for d in got] == ["live"], "delivered while it is live"
        deadline = int(as_map(got[0]["headers"])[EXPIRES])
        # The worker stamps it with its reading of Redis's clock, right to within half a round trip
        # (docs/protocol.md, "Message expiry"): a loaded CI machine put it 2 ms before `before`.
        slack = 50
        assert before + 60_000 - slack <= deadline <= redis_ms(direct) + 60_000 + slack, "TTL from its publish, Redis's clock"
        c.execute_command("ACK", h, got[0]["tag"])

        c.execute_command("PUB", "jobs", b"stale", "TTL", 200)
        c.execute_command("PUB", "jobs", b"lasting")
        sleep_past_expiries(direct, "jobs")
        assert [d["payload"] for d in pull(c, h)] == ["lasting"], "the expired one is passed over, the next read"
        assert pull(c, h) == [], "nothing comes back later: it was settled, not returned"
        broker, entry = counted(redis_url, "t:jobs")
        assert broker == 1 and entry["expired"] == 1 and entry["ready"] == 0


def test_each_group_settles_an_expired_message_and_counts_it_once(redis_url, direct) -> None:
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        ha, hb = sub(c, "jobs", "GROUP", "a"), sub(c, "jobs", "GROUP", "b")
        c.execute_command("MPUB", "jobs", 3, b"1", b"2", b"3", "TTL", 2000)
        assert len(pull(c, ha)) == 3, "group a read them in time"
        sleep_past_expiries(direct, "jobs")
        assert pull(c, hb) == []
        assert counted(redis_url, "t:jobs")[0] == 3, "group b met three expired messages"


def test_a_returned_message_that_expires_is_not_delivered_again(redis_url, direct) -> None:
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        h = sub(c, "jobs", "GROUP", "g")
        c.execute_command("PUB", "jobs", b"once", "TTL", 1500)
        got = pull(c, h)
        assert [d["payload"] for d in got] == ["once"]
        assert c.execute_command("NACK", h, got[0]["tag"]) == 1
        sleep_past_expiries(direct, "jobs")
        assert pull(c, h) == []
        assert counted(redis_url, "t:jobs")[0] == 1
        q = KEYS.queue(QueueRef("jobs"))
        assert direct.zcard(q.ready) == 0 and len(helpers.checkout_records(direct, q)) == 0


def test_a_message_that_expires_in_a_push_mailbox_is_settled_at_take(redis_url, direct) -> None:
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        h = sub(c, "jobs", "GROUP", "g", "PUSH", "CAPACITY", 10)
        c.execute_command("PUB", "jobs", b"waits", "TTL", 1500)
        c.execute_command("PUB", "jobs", b"stays")
        q = KEYS.queue(QueueRef("jobs"))
        helpers.wait_for(lambda: len(helpers.checkout_records(direct, q)) == 2, what="both in the mailbox")
        sleep_past_expiries(direct, "jobs")
        got = as_map(c.execute_command("TAKE", h, "BLOCK", 1000))
        assert got["payload"] == "stays"
        assert len(helpers.checkout_records(direct, q)) == 1, "the expired one's checkout is gone, the taken one's held"
        assert counted(redis_url, "t:jobs")[0] == 1


def test_ttl_counts_from_when_a_scheduled_message_is_due(redis_url, direct) -> None:
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        h = sub(c, "jobs", "GROUP", "g")
        at = redis_ms(direct) + 400
        c.execute_command("PUB", "jobs", b"later", "AT", at, "TTL", 10_000)
        helpers.wait_for(lambda: direct.hlen(KEYS.queue(QueueRef("jobs")).log) == 1, what="the release")
        got = pull(c, h)
        assert [d["payload"] for d in got] == ["later"]
        assert int(as_map(got[0]["headers"])[EXPIRES]) == at + 10_000, "its deadline is TTL after its due time"


def test_a_filter_subscriptions_copy_expires_with_the_original(redis_url, direct) -> None:
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        h = sub(c, "metrics/+")
        c.execute_command("PUB", "metrics/cpu", b"stale", "TTL", 200)
        c.execute_command("PUB", "metrics/cpu", b"fresh")
        sleep_past_expiries(direct, "metrics/cpu")
        assert [d["payload"] for d in pull(c, h)] == ["fresh"]


def test_an_mqtt_message_expiry_is_the_same_rule_for_a_resp_consumer(redis_url, direct) -> None:
    """MQTT's Message Expiry Interval and PUB … TTL are one rule: a RESP consumer never gets an MQTT
    message past its expiry, and it is counted as expired."""
    with worker(redis_url, mqtt_port=0) as w:
        c = client(w.port, 2, "alice")
        h = sub(c, "exp/+", "QOS", 1)
        pub = Client(w.worker.mqtt_port, "exp-pub")
        try:
            pub.publish("exp/a", b"stale", MessageExpiryInterval=1)
            pub.publish("exp/a", b"fresh", MessageExpiryInterval=3600)
        finally:
            pub.close()
        sleep_past_expiries(direct, "exp/a")
        assert [d["payload"] for d in pull(c, h)] == ["fresh"]
        assert counted(redis_url, "f:alice:exp/+")[1]["expired"] == 1


def test_a_bad_ttl_is_refused_and_changes_nothing(redis_url, direct) -> None:
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        for args in [("TTL", 0), ("TTL", -5), ("TTL", "soon"), ("TTL", 4_294_967_295_001), ("HDR", EXPIRES, "soon")]:
            with pytest.raises(redis.ResponseError) as e:
                c.execute_command("PUB", "jobs", b"x", *args)
            assert error_code(e.value) == "BADARG", (args, str(e.value))
        with pytest.raises(redis.ResponseError) as e:
            c.execute_command("MPUB", "jobs", 1, b"x", "TTL", 0)
        assert error_code(e.value) == "BADARG"
        assert direct.exists(KEYS.queue(QueueRef("jobs")).log) == 0


def test_the_operator_sees_the_expired_count(redis_url, direct) -> None:
    from fencemq.ops.inspection import inspect_queue

    async def figures() -> tuple[int, int, int]:
        r = helpers.direct_async(redis_url)
        try:
            return ((await inspect_queue(r, KEYS, QueueRef("jobs")))["expired"],
                    (await totals.read_totals(r, KEYS))["expired"],
                    (await totals.entry_figures(r, KEYS, ["t:jobs"]))["t:jobs"]["expired"])
        finally:
            await r.aclose()

    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        h = sub(c, "jobs", "GROUP", "g")
        c.execute_command("MPUB", "jobs", 2, b"a", b"b", "TTL", 100)
        sleep_past_expiries(direct, "jobs")
        assert pull(c, h) == []
        assert anyio.run(figures) == (2, 2, 2)
