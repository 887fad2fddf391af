"""Publishing with dedup ids over the wire: what makes a producer's resend safe.

An SDK gives every PUB a dedup id and every MPUB one for its batch, and sends them again when a
connection dropped before their replies came (docs/sdk.md, "Reconnecting"). So a repeat must store
nothing, a batch must be one dedup entry, and PUBs carrying ids must still run as one fence call
when pipelined.
"""

from __future__ import annotations

import pytest
import redis

from fencemq.model.keys import Keyspace, QueueRef
from tests.helpers import Err, RespConn, as_map, client, deliveries, pipeline, worker


@pytest.fixture
def w(redis_url):
    with worker(redis_url) as started:
        yield started


@pytest.fixture
def r(redis_url):
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


def everything(c, topic: str, count: int = 1000) -> list[str]:
    h = as_map(c.execute_command("SUB", topic, "GROUP", "g"))["handle"]
    return [d["payload"] for d in deliveries(c.execute_command("PULL", h, "COUNT", count))]


def test_an_mpub_repeated_with_its_dedup_id_returns_the_first_ids_and_stores_nothing(w, r):
    c = client(w.port, 3)
    first = c.execute_command("MPUB", "orders", 3, "a", "b", "c", "ID", "batch-1")
    again = c.execute_command("MPUB", "orders", 3, "a", "b", "c", "ID", "batch-1")
    other = c.execute_command("MPUB", "orders", 2, "d", "e", "ID", "batch-2")
    assert again == first and [int(i) for i in other] == [int(first[-1]) + 1, int(first[-1]) + 2]
    assert everything(c, "orders") == ["a", "b", "c", "d", "e"]
    # one dedup entry for a whole batch, not one per message
    assert r.zcard(Keyspace().queue(QueueRef("orders")).dedup) == 2


def test_pipelined_pubs_with_dedup_ids_run_as_one_fence_call_and_a_resend_stores_nothing(w, r):
    journal = Keyspace().queue(QueueRef("orders")).journal
    with RespConn(w.port) as c:
        c.hello(3)
        sent = [["PUB", "orders", f"m{i}", "ID", f"p:{i}"] for i in range(10)]
        c.send_raw(pipeline(*sent, ["MPUB", "orders", 2, "x", "y", "ID", "p:b"]))
        ids = c.replies(11)
        # one publish call journals one entry for its batch: ten PUBs and an MPUB were one call
        assert r.llen(journal) == 1
        # the connection dropped before the replies came: the producer sends all of it again
        c.send_raw(pipeline(*sent, ["MPUB", "orders", 2, "x", "y", "ID", "p:b"]))
        assert c.replies(11) == ids
    assert everything(client(w.port, 3), "orders") == [f"m{i}" for i in range(10)] + ["x", "y"]


def test_a_dedup_id_repeated_inside_one_pipeline_is_stored_once(w):
    with RespConn(w.port) as c:
        c.send_raw(pipeline(["PUB", "orders", "a", "ID", "same"], ["PUB", "orders", "b"],
                            ["PUB", "orders", "a", "ID", "same"], ["MPUB", "orders", 2, "c", "d", "ID", "run"],
                            ["MPUB", "orders", 2, "c", "d", "ID", "run"]))
        a, b, a2, cd, cd2 = c.replies(5)
    assert a == a2 and cd == cd2 and int(b) == int(a) + 1 and cd == [str(int(b) + 1), str(int(b) + 2)]
    assert everything(client(w.port, 3), "orders") == ["a", "b", "c", "d"]


def test_a_pipelined_batch_larger_than_max_batch_never_splits_an_mpub_across_fence_calls(redis_url):
    with worker(redis_url, max_batch=5) as w, RespConn(w.port) as c:
        c.send_raw(pipeline(["MPUB", "orders", 3, "a", "b", "c", "ID", "one"],
                            ["MPUB", "orders", 3, "d", "e", "f", "ID", "two"]))
        first = c.replies(2)
        c.send_raw(pipeline(["MPUB", "orders", 3, "a", "b", "c", "ID", "one"],
                            ["MPUB", "orders", 3, "d", "e", "f", "ID", "two"]))
        assert c.replies(2) == first
        consumer = client(w.port, 3)
        assert everything(consumer, "orders", count=5) + everything(consumer, "orders", count=5) \
            == ["a", "b", "c", "d", "e", "f"]


def test_a_dedup_id_over_its_limit_in_a_pipeline_is_refused_alone(w):
    with RespConn(w.port) as c:
        c.send_raw(pipeline(["PUB", "orders", "a", "ID", "ok"], ["PUB", "orders", "b", "ID", "i" * 300],
                            ["MPUB", "orders", 2, "c", "d", "ID", "i" * 300], ["PUB", "orders", "e"]))
        a, b, cd, e = c.replies(4)
    assert isinstance(b, Err) and b.code == "LIMIT" and isinstance(cd, Err) and cd.code == "LIMIT"
    assert int(e) == int(a) + 1
    assert everything(client(w.port, 3), "orders") == ["a", "e"]


def test_mpub_says_what_it_takes(w):
    with RespConn(w.port) as c:
        c.send_raw(pipeline(["MPUB", "orders", 1, "a", "HDR", "k", "v"]))
        (err,) = c.replies(1)
    assert isinstance(err, Err) and err.code == "BADARG" and "LMQ, QOS, ID" in err
