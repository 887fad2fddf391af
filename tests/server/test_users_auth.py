"""A worker started with users (`serve --users`): AUTH as a user, and only what it was granted."""

from __future__ import annotations

import anyio
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from fencemq.model.keys import Keyspace
from fencemq.ops.users import UserStore
from tests.helpers import Err, RespConn, as_map, direct, direct_async, worker

KEYS = Keyspace("fmq")


def add_user(redis_url: str, name: str, password: str, *grants: tuple[str, str]) -> None:
    async def main():
        r = direct_async(redis_url)
        try:
            await UserStore(r, KEYS.users).add(name, password, list(grants))
        finally:
            await r.aclose()
    anyio.run(main)


@pytest.fixture
def w(redis_url):
    add_user(redis_url, "svc", "service secret", ("publish", "orders/#"), ("subscribe", "orders/+"))
    with worker(redis_url, users=True, password="legacy secret") as started:
        yield started


def conn(w, *auth: str) -> RespConn:
    c = RespConn(w.port)
    if auth:
        assert c.call("AUTH", *auth) == "OK"
    return c


def test_nothing_runs_before_auth(w) -> None:
    c = conn(w)
    assert c.call("PUB", "orders/eu", "x").code == "NOAUTH"
    assert c.call("SUB", "orders/eu", "GROUP", "g").code == "NOAUTH"


def test_a_user_authenticates_with_auth_user_pass_and_with_hello(w) -> None:
    assert conn(w, "svc", "service secret").call("PUB", "orders/eu", "x") == "1"
    d = conn(w)
    assert d.call("HELLO", 3, "AUTH", "svc", "service secret")["server"] == "fencemq"
    assert d.call("PUB", "orders/eu", "y") == "2"


def test_redis_py_logs_in_as_a_user_with_username_and_password(w) -> None:
    r = redis.Redis(port=w.port, username="svc", password="service secret")
    assert r.execute_command("PUB", "orders/eu", "x") == b"1"
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=w.port, username="svc", password="wrong secret",
                    retry=Retry(NoBackoff(), 0)).execute_command("PING")


def test_a_wrong_password_or_an_unknown_user_is_wrongpass_and_leaves_the_connection_unauthenticated(w) -> None:
    c = conn(w)
    assert c.call("AUTH", "svc", "not the secret").code == "WRONGPASS"
    assert c.call("AUTH", "nobody", "service secret").code == "WRONGPASS"
    assert c.call("PUB", "orders/eu", "x").code == "NOAUTH"


def test_the_legacy_password_is_the_default_user_with_every_permission(w) -> None:
    assert conn(w, "legacy secret").call("PUB", "billing", "x") == "1"
    assert conn(w, "default", "legacy secret").call("SUB", "billing", "GROUP", "g")


def test_publishing_outside_the_grants_is_noperm_naming_what_is_missing(w) -> None:
    c = conn(w, "svc", "service secret")
    refused = c.call("PUB", "billing/eu", "x")
    assert isinstance(refused, Err) and refused.code == "NOPERM"
    assert "'svc'" in refused and "publish" in refused and "billing/eu" in refused
    assert c.call("MPUB", "billing/eu", 2, "a", "b").code == "NOPERM"


def test_subscribing_needs_a_grant_that_covers_the_whole_filter(w) -> None:
    c = conn(w, "svc", "service secret")
    c.call("CLIENT", "SETNAME", "svc-1")
    assert as_map(c.call("SUB", "orders/eu", "GROUP", "g"))["handle"]
    assert as_map(c.call("SUB", "$share/g/orders/+"))["handle"]
    assert c.call("SUB", "orders/#").code == "NOPERM", "orders/+ does not cover orders/#"
    assert c.call("SUB", "$share/g/#").code == "NOPERM"
    assert c.call("SUB", "billing", "GROUP", "g").code == "NOPERM"


def test_a_refused_publish_or_subscribe_stores_nothing(w, redis_url) -> None:
    c = conn(w, "svc", "service secret")
    c.call("CLIENT", "SETNAME", "svc-2")
    r = direct(redis_url)
    before = sorted(k for k in r.scan_iter() if b"sess" not in k and b"worker" not in k and b"schedule" not in k)
    c.call("PUB", "billing", "x")
    c.call("SUB", "billing", "GROUP", "g")
    after = sorted(k for k in r.scan_iter() if b"sess" not in k and b"worker" not in k and b"schedule" not in k)
    assert after == before


def change(redis_url: str, how: str, *args: object) -> None:
    async def main():
        r = direct_async(redis_url)
        try:
            await getattr(UserStore(r, KEYS.users), how)(*args)
        finally:
            await r.aclose()
    anyio.run(main)


def test_a_grant_given_reaches_an_open_connection_and_one_taken_away_ends_it(w, redis_url) -> None:
    from tests.helpers import wait_for

    c = conn(w, "svc", "service secret")
    assert c.call("PUB", "billing/eu", "x").code == "NOPERM"
    change(redis_url, "grant", "svc", "publish", "billing/#")
    wait_for(lambda: c.call("PUB", "billing/eu", "x") == "1", timeout=5, what="the new grant on the open connection")
    change(redis_url, "revoke", "svc", "publish", "billing/#")
    assert c.is_closed(5), "a connection whose user lost a grant went on with it"
    assert conn(w, "svc", "service secret").call("PUB", "billing/eu", "x").code == "NOPERM", "back under the record of now"
