"""The gate reads an lmq at rest as it read it with a meta key: the owner of another user's lmq
still counts, and a client with a grant reads and acknowledges its own lmq that rested.

An lmq at rest has no meta key (fences/at_rest.py); tests/resting.py rests or wakes one by hand
as the fences do, so each check runs with the meta in both places.
"""

from __future__ import annotations

import pytest

from fencemq.model.keys import Keyspace, QueueRef
from tests.helpers import RespConn, direct, worker
from tests.resting import rest_by_hand, wake_by_hand
from tests.server.test_users_auth import add_user

K = Keyspace().queue(QueueRef("chat", "s-1"))


@pytest.fixture
def w(redis_url):
    add_user(redis_url, "alice", "alice secret", ("all", "chat/#"), ("all", "chat"))
    add_user(redis_url, "mallory", "mallory secret", ("subscribe", "chat"), ("publish", "chat"))
    with worker(redis_url, users=True) as started:
        yield started


def login(w, user: str, name: str) -> RespConn:
    c = RespConn(w.port)
    assert c.call("AUTH", user, f"{user} secret") == "OK"
    assert c.call("CLIENT", "SETNAME", name) == "OK"
    return c


@pytest.mark.parametrize("where", ["key", "rest"])
def test_raising_the_epoch_of_another_users_lmq_is_refused_wherever_its_meta_lies(w, redis_url, where) -> None:
    alice = login(w, "alice", "alice-1")
    assert "handle" in alice.call("SUB", "chat", "LMQ", "s-1")
    r = direct(redis_url)
    if where == "rest":
        rest_by_hand(r, K)  # the fence may have rested it already
        assert not r.exists(K.meta) and r.hexists(K.rest, K.rest_field)
    else:
        wake_by_hand(r, K)
        assert r.exists(K.meta)
    mallory = login(w, "mallory", "mallory-1")
    refused = mallory.call("SUB", "chat", "LMQ", "s-1", "EPOCH", 7)
    assert refused.code == "NOPERM" and "members of another user" in refused


@pytest.mark.parametrize("where", ["key", "rest"])
def test_a_client_with_a_grant_reads_and_acks_its_lmq_wherever_its_meta_lies(w, redis_url, where) -> None:
    alice = login(w, "alice", "alice-2")
    handle = dict(zip(*[iter(alice.call("SUB", "chat", "LMQ", "s-1"))] * 2))["handle"]
    r = direct(redis_url)
    (rest_by_hand if where == "rest" else wake_by_hand)(r, K)
    assert alice.call("PULL", handle) == []
    assert alice.call("SUB", "chat", "LMQ", "s-1", "EPOCH", 3)  # its own lmq: raising its epoch is its own
    handle = dict(zip(*[iter(alice.call("SUB", "chat", "LMQ", "s-1"))] * 2))["handle"]
    (rest_by_hand if where == "rest" else wake_by_hand)(r, K)
    alice.call("PUB", "chat", "hello", "LMQ", "s-1")
    (delivery,) = alice.call("PULL", handle, "COUNT", 5)
    fields = dict(zip(*[iter(delivery)] * 2))
    assert fields["payload"] == "hello"
    assert alice.call("ACK", handle, fields["tag"]) == 1
