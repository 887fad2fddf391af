"""Users and permissions as stored in Redis (fencemq.ops.users), against a real server."""

from __future__ import annotations

import anyio
import pytest

from fencemq.errors import BadArgument
from fencemq.model.keys import Keyspace
from fencemq.ops.users import User, UserStore, default_user
from tests.helpers import direct_async

KEYS = Keyspace("fmq")


def run(redis_url: str, body):
    async def main():
        r = direct_async(redis_url)
        try:
            return await body(UserStore(r, KEYS.users), r)
        finally:
            await r.aclose()
    return anyio.run(main)


def test_a_user_authenticates_with_its_own_password_only(redis_url) -> None:
    async def body(store, _r):
        await store.add("alice", "correct horse")
        return (await store.authenticate("alice", "correct horse"), await store.authenticate("alice", "wrong one!"),
                await store.authenticate("mallory", "correct horse"))
    good, wrong, unknown = run(redis_url, body)
    assert good == User("alice", ()) and wrong is None and unknown is None


def test_the_password_is_stored_as_a_salted_scrypt_hash_never_in_clear(redis_url) -> None:
    async def body(store, r):
        await store.add("alice", "correct horse")
        await store.add("bob", "correct horse")
        return await r.hgetall(KEYS.users)
    raw = run(redis_url, body)
    assert all(b"correct horse" not in v for v in raw.values())
    import json
    a, b = (json.loads(raw[k]) for k in (b"alice", b"bob"))
    assert a["n"] >= 2**14 and a["salt"] != b["salt"] and a["hash"] != b["hash"], "same password, different hashes"


def test_grants_are_actions_on_mqtt_filters(redis_url) -> None:
    async def body(store, _r):
        await store.add("svc", "long enough", [("publish", "orders/+"), ("subscribe", "orders/#")])
        return await store.authenticate("svc", "long enough")
    svc = run(redis_url, body)
    assert svc.may("publish", "orders/eu") and not svc.may("publish", "orders/eu/x")
    assert svc.may("subscribe", "orders/eu/x") and not svc.may("subscribe", "billing")
    assert not svc.may("evict", "orders/eu") and not svc.may("admin")
    assert "no permission to evict on 'orders/eu'" in svc.missing("evict", "orders/eu")


def test_the_default_user_may_do_everything() -> None:
    root = default_user()
    assert all(root.may(a, "any/topic") for a in ("publish", "subscribe", "evict", "seek", "purge", "admin"))


def test_grant_and_revoke_change_what_a_user_may_do(redis_url) -> None:
    async def body(store, _r):
        await store.add("ops", "long enough")
        await store.grant("ops", "evict", "#")
        after_grant = await store.authenticate("ops", "long enough")
        await store.revoke("ops", "evict", "#")
        return after_grant, await store.authenticate("ops", "long enough")
    granted, revoked = run(redis_url, body)
    assert granted.may("evict", "x") and not revoked.may("evict", "x")


def test_passwd_replaces_the_password_and_del_removes_the_user(redis_url) -> None:
    async def body(store, _r):
        await store.add("carol", "first password")
        await store.passwd("carol", "second password")
        old, new = await store.authenticate("carol", "first password"), await store.authenticate("carol", "second password")
        deleted = await store.delete("carol")
        return old, new, deleted, await store.authenticate("carol", "second password"), await store.list()
    old, new, deleted, after, users = run(redis_url, body)
    assert old is None and new is not None and deleted and after is None and users == []


@pytest.mark.parametrize("bad", [
    ("add", ("", "long enough")), ("add", ("a b", "long enough")), ("add", ("x" * 65, "long enough")),
    ("add", ("dave", "short")), ("grant", ("dave", "fly", "#")), ("grant", ("dave", "publish", "a/#/b")),
    ("passwd", ("nobody", "long enough")), ("grant", ("nobody", "publish", "#")),
])
def test_bad_input_is_badarg_and_changes_nothing(redis_url, bad) -> None:
    verb, args = bad

    async def body(store, r):
        await store.add("dave", "long enough")
        before = await r.hgetall(KEYS.users)
        with pytest.raises(BadArgument):
            await getattr(store, verb)(*args)
        return before, await r.hgetall(KEYS.users)
    before, after = run(redis_url, body)
    assert before == after


def test_adding_a_user_twice_is_refused_and_keeps_the_first(redis_url) -> None:
    async def body(store, _r):
        await store.add("erin", "first password")
        with pytest.raises(BadArgument, match="exists"):
            await store.add("erin", "other password")
        return await store.authenticate("erin", "first password")
    assert run(redis_url, body) is not None
