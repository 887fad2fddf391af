"""Client ids belong to users: only the user that first named a session may name it again or take it over."""

from __future__ import annotations

import pytest

from tests.helpers import RespConn, worker
from tests.server.test_users_auth import add_user


@pytest.fixture
def w(redis_url):
    add_user(redis_url, "alice", "alice secret", ("all", "orders/#"))
    add_user(redis_url, "mallory", "mallory secret", ("all", "orders/#"))
    with worker(redis_url, users=True) as started:
        yield started


def login(w, user: str) -> RespConn:
    c = RespConn(w.port)
    assert c.call("AUTH", user, f"{user} secret") == "OK"
    return c


def test_another_users_setname_of_a_client_id_is_noperm_and_the_owner_keeps_its_session(w) -> None:
    owner = login(w, "alice")
    assert owner.call("CLIENT", "SETNAME", "app-1") == "OK"
    handle = dict(zip(*[iter(owner.call("SUB", "orders/eu", "GROUP", "g"))] * 2))["handle"]

    thief = login(w, "mallory")
    refused = thief.call("HELLO", 2, "SETNAME", "app-1", "TAKEOVER")
    assert refused.code == "NOPERM" and "belongs to another user" in refused
    assert thief.call("CLIENT", "SETNAME", "app-1").code == "NOPERM"
    assert owner.call("PULL", handle) == [], "the owner's connection is still open and holds its subscription"


def test_the_same_user_may_take_its_own_session_over(w) -> None:
    first = login(w, "alice")
    assert first.call("CLIENT", "SETNAME", "app-2") == "OK"
    second = login(w, "alice")
    assert second.call("HELLO", 2, "SETNAME", "app-2", "TAKEOVER")[1] == "fencemq"


def test_another_connections_anonymous_session_cannot_be_named(w) -> None:
    victim = login(w, "alice")
    victim.call("SUB", "orders/eu", "GROUP", "g")
    anon = victim.call("HELLO")[7]
    assert anon.startswith("anon-")
    assert login(w, "mallory").call("CLIENT", "SETNAME", anon).code == "NOPERM"
