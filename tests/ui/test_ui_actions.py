"""The UI's writes over HTTP: login as a FenceMQ user, the permission on the queue's topic,
the CSRF token and the confirmation step, then evict, seek, purge, replay and discard
through broker/ops/, against a real worker and Redis."""

from __future__ import annotations

import html
import re

import pytest
import redis

from fencemq.model.keys import Keyspace
from tests.helpers import deliveries
from tests.ui.conftest import OPERATOR_PASSWORD, VIEWER_PASSWORD, csrf_of, log_in


DEAD = Keyspace("fmq").queue_by_id("t:jobs").dead


def evict_form(http, member: str = "c2", group: str = "billing", q: str = "t:orders", **extra: str) -> dict:
    page = http.get("/queue", params={"q": q}).text
    return {"csrf": csrf_of(page), "q": q, "group": group, "member": member, **extra}


def members_of(direct: redis.Redis, key: str = "fmq:{t:orders}") -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in direct.hgetall(key).items()}


def test_an_anonymous_visitor_sees_no_page_and_cannot_post_an_action(broker: dict, dashboard_of) -> None:
    http = dashboard_of()
    page = http.get("/queue", params={"q": "t:orders"})
    assert page.status_code == 303 and page.headers["location"] == "/login?next=%2Fqueue%3Fq%3Dt%253Aorders"
    before = members_of(broker["direct"])
    r = http.post("/action/evict", data={"csrf": "x", "q": "t:orders", "group": "billing", "member": "c2",
                                         "confirmed": "yes"})
    assert r.status_code == 401 and "Log in" in r.text
    assert members_of(broker["direct"]) == before


def test_a_user_without_the_operator_permission_sees_no_action_and_is_refused(broker: dict, dashboard_of) -> None:
    http = dashboard_of()
    log_in(http, "viewer", VIEWER_PASSWORD)
    page = http.get("/queue", params={"q": "t:orders"}).text
    assert "viewer" in page and "/action/" not in page
    assert "/action/" not in http.get("/dlq", params={"q": "t:jobs"}).text
    before = members_of(broker["direct"])
    r = http.post("/action/evict", data={**evict_form(http), "confirmed": "yes"})
    assert r.status_code == 403 and "user &#39;viewer&#39; has no permission to evict on &#39;orders&#39;" in r.text
    assert members_of(broker["direct"]) == before


def test_a_wrong_password_logs_nobody_in(broker: dict, dashboard_of) -> None:
    http = dashboard_of()
    r = http.post("/login", data={"user": "operator", "password": "not-the-password", "next": "/"})
    assert r.status_code == 401 and "Wrong user name or password" in r.text
    assert "fencemq_ui" not in http.cookies
    assert "/action/" not in http.get("/queue", params={"q": "t:orders"}).text


def test_an_eviction_asks_for_confirmation_then_fences_the_client_off(broker: dict, dashboard_of) -> None:
    http = dashboard_of()
    log_in(http, "operator", OPERATOR_PASSWORD)
    form = evict_form(http, member="c1")
    before = members_of(broker["direct"])
    assert 'id="act-evict-1-1"' in http.get("/queue", params={"q": "t:orders"}).text
    asked = http.post("/action/evict", data=form)
    assert asked.status_code == 200 and "Confirm: evict" in asked.text and 'name="confirmed" value="yes"' in asked.text
    assert "Evict <strong>c1</strong> from group <strong>billing</strong>" in asked.text
    assert members_of(broker["direct"]) == before, "asking must change nothing"
    done = http.post("/action/evict", data={**form, "confirmed": "yes"})
    assert done.status_code == 200 and "Done: evict" in done.text
    assert '"returned": 3' in html.unescape(done.text)
    # c1 is fenced: its PULLs return nothing, though the messages it held are back in the queue
    c1 = broker["c"]["c1"]
    assert deliveries(c1.execute_command("PULL", broker["handles"]["c1"], "COUNT", 5)) == []
    assert len(deliveries(broker["c"]["c2"].execute_command("PULL", broker["handles"]["c2"], "COUNT", 5))) == 5
    page = http.get("/queue", params={"q": "t:orders"}).text
    assert re.search(r"c1</td>\s*<td><span class=\"state evicted\">evicted</span> by operator", page)


def test_a_post_without_the_logins_csrf_token_changes_nothing(broker: dict, dashboard_of) -> None:
    http = dashboard_of()
    log_in(http, "operator", OPERATOR_PASSWORD)
    before = members_of(broker["direct"])
    for token in ("", "forged-token"):
        r = http.post("/action/evict", data={**evict_form(http), "csrf": token, "confirmed": "yes"})
        assert r.status_code == 403 and "CSRF" in r.text
    assert members_of(broker["direct"]) == before


def test_seek_moves_the_group_and_raises_its_epoch(broker: dict, dashboard_of) -> None:
    http = dashboard_of()
    log_in(http, "operator", OPERATOR_PASSWORD)
    csrf = csrf_of(http.get("/queue", params={"q": "t:orders"}).text)
    form = {"csrf": csrf, "q": "t:orders", "group": "billing", "kind": "id", "arg": "8"}
    assert "Confirm: seek" in http.post("/action/seek", data=form).text
    assert http.post("/action/seek", data={**form, "confirmed": "yes"}).status_code == 200
    page = http.get("/queue", params={"q": "t:orders"}).text
    assert 'data-k="epoch-billing">1<' in page and 'data-k="cursor-billing">8<' in page
    bad = http.post("/action/seek", data={**form, "arg": "", "confirmed": "yes"})
    assert bad.status_code == 400 and "seek to id needs a value" in bad.text


def test_purge_drops_the_backlog_after_confirmation(broker: dict, dashboard_of) -> None:
    http = dashboard_of()
    log_in(http, "operator", OPERATOR_PASSWORD)
    csrf = csrf_of(http.get("/queue", params={"q": "t:orders"}).text)
    assert "Confirm: purge" in http.post("/action/purge", data={"csrf": csrf, "q": "t:orders"}).text
    assert 'data-k="backlog">10<' in http.get("/queue", params={"q": "t:orders"}).text
    http.post("/action/purge", data={"csrf": csrf, "q": "t:orders", "confirmed": "yes"})
    assert 'data-k="backlog">0<' in http.get("/queue", params={"q": "t:orders"}).text


def test_replay_puts_a_dead_letter_back_and_discard_drops_one(broker: dict, dashboard_of) -> None:
    http = dashboard_of()
    log_in(http, "operator", OPERATOR_PASSWORD)
    direct = broker["direct"]
    page = http.get("/dlq", params={"q": "t:jobs"}).text
    csrf = csrf_of(page)
    assert direct.llen(DEAD) == 1
    http.post("/action/replay", data={"csrf": csrf, "q": "t:jobs", "count": "1", "confirmed": "yes"})
    assert direct.llen(DEAD) == 0
    (again,) = deliveries(broker["c"]["d1"].execute_command("PULL", broker["handles"]["d1"]))
    assert again["payload"] == "job-1"
    broker["c"]["d1"].execute_command("NACK", broker["handles"]["d1"], again["tag"])
    assert direct.llen(DEAD) == 1
    page = http.get("/dlq", params={"q": "t:jobs"}).text
    digest = re.search(r'name="digest" value="([0-9a-f]+)"', page).group(1)
    form = {"csrf": csrf, "q": "t:jobs", "position": "0", "digest": digest}
    stale = http.post("/action/discard", data={**form, "digest": "0" * 16, "confirmed": "yes"})
    assert stale.status_code == 404 and "no longer where it was shown" in stale.text
    assert direct.llen(DEAD) == 1
    assert "Confirm: discard" in http.post("/action/discard", data=form).text
    http.post("/action/discard", data={**form, "confirmed": "yes"})
    assert direct.llen(DEAD) == 0


@pytest.mark.parametrize("password, users, name, given, ok", [
    (None, False, "default", "", True),  # an open broker: the default user needs no password
    (None, True, "default", "", False),  # users exist: the default user has no password to give
    ("legacy-pass", False, "default", "legacy-pass", True),
    ("legacy-pass", False, "default", "wrong", False),
])
def test_the_default_user_logs_in_as_the_broker_would_let_it(redis_url: str, dashboard_of, password, users, name,
                                                              given, ok) -> None:
    if users:
        from tests.ui.conftest import add_users

        add_users(redis_url)
    http = dashboard_of(password=password)
    r = http.post("/login", data={"user": name, "password": given, "next": "/queues"})
    assert r.status_code == (303 if ok else 401)
    if ok:
        assert r.headers["location"] == "/queues"


def test_login_never_redirects_off_the_site(broker: dict, dashboard_of) -> None:
    http = dashboard_of()
    for target in ("https://evil.example/", "//evil.example/", "/\\evil.example"):
        r = http.post("/login", data={"user": "operator", "password": OPERATOR_PASSWORD, "next": target})
        assert r.headers["location"] == "/"


def test_a_default_login_on_an_open_broker_ends_once_the_broker_has_users(redis_url: str, dashboard_of) -> None:
    http = dashboard_of()
    log_in(http, "default", "")
    assert csrf_of(http.get("/queues").text), "logged in as default on an open broker"
    from tests.ui.conftest import add_users

    add_users(redis_url)  # an administrator gives the broker users: default has no password to give any more
    r = http.get("/queues")
    assert r.status_code == 303 and r.headers["location"].startswith("/login"), "the default login went on"
    before = http.post("/action/purge", data={"csrf": "anything", "q": "t:orders", "confirmed": "yes"})
    assert before.status_code == 401
