"""Users and grants in the UI, over HTTP against a real worker and Redis: behind the admin grant, each
change confirmed first, CSRF-checked, done through the CLI's operator layer (UserStore), written to the
audit log, and reaching the worker's connections as a CLI change does."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import re

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from fencemq.model.keys import Keyspace
from fencemq.ops.users import UserStore
from tests.helpers import wait_for, worker
from tests.ui.conftest import OPERATOR_PASSWORD, csrf_of
from tests.ui.test_ui_pages import text

ADMIN = ("root", "root-secret-1")


def store_call(url: str, method: str, *args: object) -> object:
    async def call() -> object:
        import redis.asyncio

        r = redis.asyncio.Redis.from_url(url)
        try:
            return await getattr(UserStore(r, Keyspace("fmq").users), method)(*args)
        finally:
            await r.aclose()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, call()).result()


@pytest.fixture
def admin(broker: dict) -> tuple[str, str]:
    store_call(broker["url"], "add", *ADMIN, [("admin", "#"), ("inspect", "#")])
    return ADMIN


def grants_of(url: str, name: str) -> list[tuple[str, str]] | None:
    user = store_call(url, "get", name)
    return None if user is None else sorted(user.grants)  # type: ignore[attr-defined]


def test_the_users_page_needs_the_admin_grant(broker: dict, dashboard_of, admin) -> None:
    http = dashboard_of(login=("operator", OPERATOR_PASSWORD))
    page = http.get("/users")
    assert page.status_code == 403 and "no permission to admin" in page.text
    assert http.post("/users/remove", data={"csrf": csrf_of(http.get("/").text), "user": "viewer",
                                            "confirmed": "yes"}).status_code == 403
    assert grants_of(broker["url"], "viewer") is not None, "nothing was removed"
    listed = text(dashboard_of(login=admin).get("/users").text)
    assert re.search(r"operator inspect # .*evict #", listed) and "viewer inspect #" in listed


@pytest.mark.long  # `make test-long` (.ci/run) runs it, to keep make test short
def test_adding_granting_revoking_and_removing_a_user_is_confirmed_audited_and_done_by_the_store(
        broker: dict, dashboard_of, admin, caplog) -> None:
    url = broker["url"]
    http = dashboard_of(login=admin)
    csrf = csrf_of(http.get("/users").text)
    form = {"csrf": csrf, "user": "alice", "password": "alice-secret-1", "grants": "subscribe:orders/#\npublish:x"}
    shown = http.post("/users/add", data=form)
    assert shown.status_code == 200 and "Confirm: add" in shown.text
    assert "Add user 'alice' with subscribe:orders/#, publish:x?" in text(shown.text)
    assert grants_of(url, "alice") is None, "nothing happens before the confirmation"
    assert http.post("/users/add", data={**form, "csrf": "forged", "confirmed": "yes"}).status_code == 403
    assert grants_of(url, "alice") is None, "nor without the login's CSRF token"
    with caplog.at_level(logging.WARNING, logger="fencemq.audit"):
        done = http.post("/users/add", data={**form, "confirmed": "yes"})
        assert done.status_code == 200 and "Done: add" in done.text
        assert grants_of(url, "alice") == [("publish", "x"), ("subscribe", "orders/#")]
        http.post("/users/grant", data={"csrf": csrf, "user": "alice", "action": "dlq", "filter": "orders/#",
                                        "confirmed": "yes"})
        assert ("dlq", "orders/#") in grants_of(url, "alice")
        http.post("/users/revoke", data={"csrf": csrf, "user": "alice", "action": "publish", "filter": "x",
                                         "confirmed": "yes"})
        assert grants_of(url, "alice") == [("dlq", "orders/#"), ("subscribe", "orders/#")]
    audit = [r.getMessage() for r in caplog.records if r.name == "fencemq.audit"]
    assert audit == [
        "audit: web UI user 'root' from 127.0.0.1: add user 'alice' with subscribe:orders/#, publish:x",
        "audit: web UI user 'root' from 127.0.0.1: grant 'alice' dlq on 'orders/#'",
        "audit: web UI user 'root' from 127.0.0.1: revoke publish on 'x' from 'alice'"]
    # a user removed from the UI is logged out of every door at once, as after `fencemq user del`
    with worker(url, users=True) as w:
        # no retries: redis-py would reconnect and AUTH again and again, each failure delayed longer
        # by the worker's throttle (up to 5 s), until an AUTH outlasts socket_timeout
        c = redis.Redis(port=w.port, username="alice", password="alice-secret-1", socket_timeout=5,
                        retry=Retry(NoBackoff(), 0))
        c.ping()
        http.post("/users/remove", data={"csrf": csrf, "user": "alice", "confirmed": "yes"})
        assert grants_of(url, "alice") is None

        def closed() -> bool:
            try:
                c.ping()
            except (redis.ConnectionError, redis.ResponseError):
                return True
            return False

        wait_for(closed, what="alice's connection ended")
        c.close()


def test_bad_changes_are_refused_with_a_clear_error_and_change_nothing(broker: dict, dashboard_of, admin) -> None:
    http = dashboard_of(login=admin)
    csrf = csrf_of(http.get("/users").text)
    for op, form, says in [
        ("add", {"user": "bob", "password": "short", "grants": ""}, "a password is 8"),
        ("add", {"user": "b o b", "password": "long-enough-1", "grants": ""}, "a user name is"),
        ("add", {"user": "bob", "password": "long-enough-1", "grants": "subscribe"}, "a grant is action:filter"),
        ("add", {"user": "bob", "password": "long-enough-1", "grants": "fly:#"}, "unknown action"),
        ("grant", {"user": "viewer", "action": "publish", "filter": "a/#/b"}, "#"),
        ("remove", {"user": "nobody"}, "no user 'nobody'"),
        ("grant", {"user": "nobody", "action": "publish", "filter": "x"}, "no user 'nobody'"),
    ]:
        r = http.post(f"/users/{op}", data={"csrf": csrf, **form, "confirmed": "yes"})
        assert r.status_code in (400, 404), (op, form, r.status_code)
        assert says in text(r.text), (op, form)
    assert grants_of(broker["url"], "bob") is None
    assert http.post("/users/rename", data={"csrf": csrf}).status_code == 404
