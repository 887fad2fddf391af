"""One gate, every door: each rule of docs/security.md held to RESP, MQTT 3.1.1, MQTT 5.0, MQTT over
WebSocket and the web UI, on one worker that serves them all.

``RULES`` is the table: a rule, and for each door either the check that holds the door to it or the
reason the rule does not apply there. docs/security.md's table of rules and doors is this one.
"""

from __future__ import annotations

import concurrent.futures
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from fencemq.model.keys import QueueRef
from tests.helpers import Err, as_map, wait_for
from tests.server.doors import (
    DOORS, KEYS, Doors, MqttWire, accepted, add_user, change_user, resp, will,
)

ROOT = ("root", "root-secret-1")
APP = ("app", "app-secret-1")
Check = Callable[[Doors, str], None]


@dataclass
class Rule:
    says: str  # the rule, as docs/security.md states it
    doors: dict[str, Check | str]  # a check per door, or why the rule does not apply there
    settings: dict[str, Any] = field(default_factory=dict)


# -- what the checks share -------------------------------------------------------------------


def root(d: Doors) -> Any:
    return resp(d.port, *ROOT)


def users(d: Doors, *extra: tuple[str, str, list[tuple[str, str]]]) -> None:
    """``root`` (every permission, $-topics included) and ``app`` (orders/#), and ``extra``."""
    add_user(d.redis_url, *ROOT, ("all", "#"), ("all", "$SYS/#"))
    add_user(d.redis_url, *APP, ("publish", "orders/#"), ("subscribe", "orders/#"))
    for name, password, grants in extra:
        add_user(d.redis_url, name, password, *grants)


def ui_login(http: httpx.Client, name: str, password: str) -> bool:
    r = http.post("/login", data={"user": name, "password": password, "next": "/"})
    return r.status_code == 303


def csrf(http: httpx.Client) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', http.get("/login").text + http.get("/").text)
    assert found, "no CSRF token on the page of a logged-in user"
    return found.group(1)


def ui_action(http: httpx.Client, name: str, qid: str, **form: str) -> httpx.Response:
    return http.post(f"/action/{name}", data={"csrf": csrf(http), "q": qid, "confirmed": "yes", **form})


def mqtt_login(d: Doors, door: str, client_id: str, who: tuple[str, str] = APP, **options: Any) -> MqttWire:
    m = d.mqtt(door)
    ack = m.connect(client_id, *who, **options)
    assert accepted(ack), f"CONNECT of {who[0]} answered {ack!r}"
    return m


def queue_exists(d: Doors, topic: str) -> bool:
    return bool(d.direct().exists(KEYS.queue(QueueRef(topic)).meta))


def events_stream(d: Doors, http: httpx.Client) -> tuple[int, Any]:
    """Open the overview's event stream; its status and the open response (close it when done)."""
    request = http.build_request("GET", "/events", params={"page": "overview"})
    response = http.send(request, stream=True)
    return response.status_code, response


def door_other_than(door: str) -> str:
    return "mqtt-5.0" if door == "resp" else "resp"


# A throttled login is answered after the delay its address earned (up to seconds, by design) plus the
# password hashes queued before it: a client waiting for its CONNACK must outwait that, on a busy machine too.
PATIENCE = 20.0


def fail_login(d: Doors, door: str, name: str = "app", password: str = "not-the-password") -> None:
    """One wrong password at ``door``, answered as refused."""
    if door == "resp":
        with resp(d.port) as c:
            assert c.call("AUTH", name, password).code == "WRONGPASS"
    elif door == "ui":
        with d.http() as http:
            assert not ui_login(http, name, password)
    else:
        m = d.mqtt(door, timeout=PATIENCE)
        try:
            assert not accepted(m.connect(f"guess-{time.monotonic_ns()}", name, password))
        finally:
            m.close()


def login_at(d: Doors, door: str, who: tuple[str, str] = APP) -> bool:
    """A login at ``door`` (a fresh connection); True when it let ``who`` in."""
    if door == "resp":
        with resp(d.port) as c:
            return c.call("AUTH", *who) == "OK"
    if door == "ui":
        with d.http() as http:
            return ui_login(http, *who)
    m = d.mqtt(door, timeout=PATIENCE)
    try:
        return accepted(m.connect(f"login-{time.monotonic_ns()}", *who))
    finally:
        m.close()


def hold_connection(d: Doors, door: str, who: tuple[str, str], held: list[Any], n: int = 0) -> bool:
    """One more connection of ``who`` through ``door``, kept in ``held``; False when the door refused it."""
    if door == "resp":
        c = resp(d.port)
        held.append(c)
        try:
            return c.call("AUTH", *who) == "OK"
        except Exception:  # noqa: BLE001 - refused by closing: that is the answer
            return False
    if door == "ui":
        http = d.http()
        held.append(http)
        ui_login(http, *who)
        status, response = events_stream(d, http)
        held.append(response)
        return status == 200
    try:
        m = d.mqtt(door)
    except OSError:
        return False
    held.append(m)
    try:
        return accepted(m.connect(f"held-{door}-{n}-{time.monotonic_ns()}", *who))
    except OSError:
        return False


def close_all(held: list[Any]) -> None:
    for h in held:
        try:
            h.close()
        except Exception:  # noqa: BLE001 - best effort
            pass


# -- identity ---------------------------------------------------------------------------------


def login_first_resp(d: Doors, door: str) -> None:
    users(d)
    with resp(d.port) as c:
        assert c.call("PUB", "orders/a", "x").code == "NOAUTH"


def login_first_mqtt(d: Doors, door: str) -> None:
    users(d)
    m = d.mqtt(door)
    assert not accepted(m.connect("nobody")), "a CONNECT without a user name and password was let in"
    m.close()


def login_first_ui(d: Doors, door: str) -> None:
    users(d)
    with root(d) as c:
        c.call("PUB", "orders/secret-topic", "x")
    with d.http() as http:
        for page in ("/", "/queues", "/sessions", "/queue?q=t:orders/secret-topic"):
            r = http.get(page)
            assert r.status_code in (303, 401), f"{page} answered {r.status_code} without a login"
            assert "secret-topic" not in r.text
        r = http.get("/events", params={"page": "queues"})
        assert r.status_code in (303, 401)


def pages_need_inspect_ui(d: Doors, door: str) -> None:
    users(d, ("viewer", "viewer-secret-1", [("inspect", "#")]))
    with d.http() as http:
        assert ui_login(http, *APP)
        for page in ("/", "/queues", "/sessions"):
            assert http.get(page).status_code == 403, f"{page} served to a user without inspect"
    with d.http() as http:
        assert ui_login(http, "viewer", "viewer-secret-1")
        assert http.get("/queues").status_code == 200


def payloads_need_topic_grant_resp(d: Doors, door: str) -> None:
    users(d, ("viewer", "viewer-secret-1", [("inspect", "#"), ("publish", "jobs")]))
    with resp(d.port, "viewer", "viewer-secret-1") as c:
        assert c.call("SUB", "jobs", "GROUP", "w").code == "NOPERM"


def payloads_need_topic_grant_mqtt(d: Doors, door: str) -> None:
    users(d, ("viewer", "viewer-secret-1", [("inspect", "#"), ("publish", "jobs")]))
    m = mqtt_login(d, door, "viewer-m", ("viewer", "viewer-secret-1"))
    assert m.subscribe("jobs")[0] >= 0x80
    m.close()


def payloads_need_topic_grant_ui(d: Doors, door: str) -> None:
    users(d, ("viewer", "viewer-secret-1", [("inspect", "#")]),
          ("reader", "reader-secret-1", [("inspect", "#"), ("subscribe", "jobs")]))
    with root(d) as c:
        c.call("CLIENT", "SETNAME", "worker-1")
        c.call("PUB", "jobs", "the-secret-payload")
        handle = as_map(c.call("SUB", "jobs", "GROUP", "w"))["handle"]
        (job,) = c.call("PULL", handle)
        c.call("NACK", handle, as_map(job)["tag"])  # max_failures 1: a dead letter at once
    with d.http() as http:
        assert ui_login(http, "viewer", "viewer-secret-1")
        page = http.get("/dlq", params={"q": "t:jobs"})
        assert page.status_code == 200 and "the-secret-payload" not in page.text
    with d.http() as http:
        assert ui_login(http, "reader", "reader-secret-1")
        assert "the-secret-payload" in http.get("/dlq", params={"q": "t:jobs"}).text


def default_needs_a_password_resp(d: Doors, door: str) -> None:
    with resp(d.port) as c:
        assert c.call("AUTH", "default", "anything-at-all").code == "WRONGPASS"


def default_needs_a_password_mqtt(d: Doors, door: str) -> None:
    m = d.mqtt(door)
    assert not accepted(m.connect("d1", "default", "anything-at-all"))
    m.close()


def default_needs_a_password_ui(d: Doors, door: str) -> None:
    with d.http() as http:
        assert not ui_login(http, "default", "anything-at-all")
        assert not ui_login(http, "default", "")


def default_never_in_the_ui(d: Doors, door: str) -> None:
    users(d)
    with d.http() as http:
        assert not ui_login(http, "default", "legacy-secret-1")


def changed_user_resp(d: Doors, door: str) -> None:
    users(d)
    c = resp(d.port, *APP)
    assert c.call("PUB", "orders/a", "x") == "1"
    change_user(d.redis_url, "delete", "app")
    assert c.is_closed(5), "the connection of a removed user went on"


def changed_user_mqtt(d: Doors, door: str) -> None:
    users(d)
    m = mqtt_login(d, door, "changing")
    change_user(d.redis_url, "passwd", "app", "a-new-secret-1")
    assert m.is_closed(5), "the connection of a user whose password changed went on"


def changed_user_ui(d: Doors, door: str) -> None:
    users(d, ("viewer", "viewer-secret-1", [("inspect", "#")]), ("viewer2", "viewer-secret-2", [("inspect", "#")]))
    with d.http() as a, d.http() as b:
        assert ui_login(a, "viewer", "viewer-secret-1") and ui_login(b, "viewer2", "viewer-secret-2")
        assert a.get("/queues").status_code == 200 and b.get("/queues").status_code == 200
        change_user(d.redis_url, "passwd", "viewer", "a-new-secret-1")
        change_user(d.redis_url, "delete", "viewer2")
        assert a.get("/queues").status_code in (303, 401), "a changed user's UI session went on"
        assert b.get("/queues").status_code in (303, 401), "a removed user's UI session went on"


# -- grants -----------------------------------------------------------------------------------


def publish_grant_resp(d: Doors, door: str) -> None:
    users(d)
    with resp(d.port, *APP) as c:
        assert c.call("PUB", "billing", "x").code == "NOPERM"
    assert not queue_exists(d, "billing")


def publish_grant_mqtt(d: Doors, door: str) -> None:
    users(d)
    m = mqtt_login(d, door, "pub-1")
    code = m.publish("billing")
    assert code is not None and (code >= 0x80 or door == "mqtt-3.1.1")  # 3.1.1's PUBACK carries no code
    m.close()
    assert not queue_exists(d, "billing")


def will_at_connect(d: Doors, door: str) -> None:
    users(d)
    m = d.mqtt(door)
    ack = m.connect("will-1", *APP, will=will("secret/x", retain=True))
    m.close()  # no DISCONNECT: the will stands, if it was let in
    assert not accepted(ack), "a CONNECT with a will outside the publish grant was let in"
    time.sleep(0.3)
    assert not d.direct().hexists(KEYS.retained, "secret/x")


def will_when_published(d: Doors, door: str) -> None:
    users(d)
    m = mqtt_login(d, door, "will-2", will=will("orders/w", retain=True))
    change_user(d.redis_url, "revoke", "app", "publish", "orders/#")
    m.close()  # no DISCONNECT: the will goes out now, under the grants of now
    time.sleep(0.5)
    assert not d.direct().hexists(KEYS.retained, "orders/w"), "a will outside the current grants was published"


def delayed_will_when_scheduled(d: Doors, door: str) -> None:
    users(d)
    m = mqtt_login(d, door, f"will-3-{door}", will=will("orders/later", delay=30), expiry=60)
    change_user(d.redis_url, "revoke", "app", "publish", "orders/#")
    m.close()  # no DISCONNECT: the will would be scheduled for 30 s, under the grants of now
    time.sleep(0.5)
    waiting = d.direct().zcard(KEYS.queue(QueueRef("orders/later")).scheduled)
    assert waiting == 0, "a delayed will outside the current grants was scheduled"


def dollar_topics_resp(d: Doors, door: str) -> None:
    users(d, ("wide", "wide-secret-1", [("publish", "#"), ("subscribe", "#")]))
    with resp(d.port, "wide", "wide-secret-1") as c:
        refused = c.call("PUB", "$SYS/x", "x")
        assert isinstance(refused, Err) and refused.code == "NOPERM", refused
        c.call("CLIENT", "SETNAME", "wide-1")
        assert c.call("SUB", "$SYS/#").code == "NOPERM"
    assert not queue_exists(d, "$SYS/x")


def dollar_topics_mqtt(d: Doors, door: str) -> None:
    users(d, ("wide", "wide-secret-1", [("publish", "#"), ("subscribe", "#")]))
    m = mqtt_login(d, door, "wide-m", ("wide", "wide-secret-1"))
    m.publish("$SYS/x")
    assert m.subscribe("$SYS/#")[0] >= 0x80
    m.close()
    assert not queue_exists(d, "$SYS/x")


def dollar_topics_ui(d: Doors, door: str) -> None:
    users(d, ("purger", "purger-secret-1", [("inspect", "#"), ("purge", "#")]))
    with root(d) as c:
        assert c.call("PUB", "$SYS/x", "x") == "1"
    with d.http() as http:
        assert ui_login(http, "purger", "purger-secret-1")
        assert ui_action(http, "purge", QueueRef("$SYS/x").qid).status_code == 403
    assert d.direct().hget(KEYS.queue(QueueRef("$SYS/x")).meta, "seq") == b"1"


def subscribe_covers_filter_resp(d: Doors, door: str) -> None:
    users(d, ("narrow", "narrow-secret-1", [("subscribe", "orders/+")]))
    with resp(d.port, "narrow", "narrow-secret-1") as c:
        c.call("CLIENT", "SETNAME", "narrow-1")
        assert c.call("SUB", "orders/#").code == "NOPERM"


def subscribe_covers_filter_mqtt(d: Doors, door: str) -> None:
    users(d, ("narrow", "narrow-secret-1", [("subscribe", "orders/+")]))
    m = mqtt_login(d, door, "narrow-m", ("narrow", "narrow-secret-1"))
    assert m.subscribe("orders/#")[0] >= 0x80
    m.close()


def resumed_session_resp(d: Doors, door: str) -> None:
    users(d)
    with resp(d.port) as c:
        c.hello(3, "resumer", "AUTH", *APP)
        handle = as_map(c.call("SUB", "orders/#"))["handle"]
    change_user(d.redis_url, "revoke", "app", "subscribe", "orders/#")
    with root(d) as r:
        r.call("PUB", "orders/a", "after the revoke")
    with resp(d.port) as c:
        c.hello(3, "resumer", "AUTH", *APP)
        got = c.call("PULL", handle, "COUNT", 10)
        assert isinstance(got, Err) or got == [], f"a revoked subscription still delivered {got!r}"
        notices = c.call("HEARTBEAT")
        told = [n for n in notices if isinstance(n, dict) and n.get("reason") == "permission revoked"]
        assert told, f"the client was not told its subscription was dropped: {notices!r}"


def resumed_session_mqtt(d: Doors, door: str) -> None:
    users(d)
    durable = {"clean": door == "mqtt-5.0" or door == "mqtt-ws", "expiry": 300}
    m = mqtt_login(d, door, "resumer-m", **durable)
    assert m.subscribe("orders/#")[0] < 0x80
    m.disconnect()
    change_user(d.redis_url, "revoke", "app", "subscribe", "orders/#")
    with root(d) as r:
        r.call("PUB", "orders/a", "after the revoke")
    m = d.mqtt(door)
    ack = m.connect("resumer-m", *APP, clean=False, expiry=300)
    assert accepted(ack)
    got = m.take(1.0)
    m.close()
    assert not got, f"a revoked subscription still delivered {[p.topic for p in got]}"
    if m.level == 5:
        assert ("subscription-revoked", "orders/#") in ack.properties.user_properties, ack.properties


def operator_matcher_ui(d: Doors, door: str) -> None:
    users(d, ("op", "op-secret-1", [("inspect", "#"), ("purge", "orders/+")]))
    with root(d) as c:
        c.call("CLIENT", "SETNAME", "sharer")
        c.call("SUB", "$share/g/orders/#")
        c.call("PUB", "orders/a", "x")
    qid = QueueRef("orders/#", None, "$share/g").qid
    with d.http() as http:
        assert ui_login(http, "op", "op-secret-1")
        assert ui_action(http, "purge", qid).status_code == 403, "purge:orders/+ purged the queue of orders/#"


def group_wide_resp(d: Doors, door: str) -> None:
    users(d, ("bob", "bob-secret-1", [("subscribe", "orders")]), ("carol", "carol-secret-1", [("subscribe", "orders")]))
    with root(d) as r:
        r.call("MPUB", "orders", 3, "a", "b", "c")
    with resp(d.port) as a, resp(d.port) as b:
        a.hello(3, "bob-1", "AUTH", "bob", "bob-secret-1")
        b.hello(3, "carol-1", "AUTH", "carol", "carol-secret-1")
        alone = as_map(a.call("SUB", "orders", "GROUP", "bobs-own"))["handle"]
        assert isinstance(a.call("SEEK", alone, "EARLIEST"), int), "a group only its own user uses may be moved"
        mine = as_map(a.call("SUB", "orders", "GROUP", "shared-g"))["handle"]
        as_map(b.call("SUB", "orders", "GROUP", "shared-g"))
        refused = a.call("SEEK", mine, "EARLIEST")
        assert isinstance(refused, Err) and refused.code == "NOPERM", refused


def group_wide_ui(d: Doors, door: str) -> None:
    users(d, ("reader", "reader-secret-1", [("inspect", "#"), ("subscribe", "orders")]))
    with root(d) as c:
        c.call("CLIENT", "SETNAME", "member-1")
        c.call("SUB", "orders", "GROUP", "g")
    with d.http() as http:
        assert ui_login(http, "reader", "reader-secret-1")
        r = ui_action(http, "seek", QueueRef("orders").qid, group="g", kind="earliest")
        assert r.status_code == 403


# -- names ------------------------------------------------------------------------------------


def private_groups_resp(d: Doors, door: str) -> None:
    users(d, ("bob", "bob-secret-1", [("subscribe", "orders")]))
    with resp(d.port) as alice, resp(d.port) as bob, root(d) as r:
        alice.hello(3, "alice-app", "AUTH", *APP)
        handle = as_map(alice.call("SUB", "orders"))["handle"]
        bob.hello(3, "bob-app", "AUTH", "bob", "bob-secret-1")
        assert isinstance(bob.call("SUB", "orders", "GROUP", "~alice-app"), Err)
        r.call("PUB", "orders", "for alice")
        got = alice.call("PULL", handle, "COUNT", 10)
        assert [as_map(x)["payload"] for x in got] == ["for alice"]


def private_groups_mqtt(d: Doors, door: str) -> None:
    users(d)
    m = mqtt_login(d, door, "tilde")
    assert m.subscribe("$share/~alice-app/orders/#")[0] >= 0x80
    m.close()


def client_ids_resp(d: Doors, door: str) -> None:
    users(d)
    with resp(d.port, *APP) as c:
        assert isinstance(c.call("CLIENT", "SETNAME", "$share/g"), Err)


def client_ids_mqtt(d: Doors, door: str) -> None:
    users(d)
    m = d.mqtt(door)
    ack = m.connect("$share/g", *APP)
    m.close()
    assert not accepted(ack), "a client named $share/g was let in"


# -- limits -----------------------------------------------------------------------------------


def connections_per_worker(d: Doors, door: str) -> None:
    users(d, ("viewer", "viewer-secret-1", [("inspect", "#")]))
    held: list[Any] = []
    try:
        other = door_other_than(door)
        assert hold_connection(d, other, ROOT, held, 1) and hold_connection(d, other, ROOT, held, 2)
        assert hold_connection(d, door, ("viewer", "viewer-secret-1") if door == "ui" else ROOT, held, 3)
        assert not hold_connection(d, door, ("viewer", "viewer-secret-1") if door == "ui" else ROOT, held, 4), \
            "a fourth connection was let in at max_connections 3"
    finally:
        close_all(held)


def connections_per_user(d: Doors, door: str) -> None:
    users(d, ("viewer", "viewer-secret-1", [("inspect", "#")]))
    who = ("viewer", "viewer-secret-1")
    held: list[Any] = []
    try:
        assert hold_connection(d, door_other_than(door), who, held, 1)
        assert hold_connection(d, door, who, held, 2)
        assert not hold_connection(d, door, who, held, 3), "a third connection of one user at a limit of 2"
        assert hold_connection(d, door, ROOT, held, 4), "another user is not held back"
    finally:
        close_all(held)


def subscriptions_resp(d: Doors, door: str) -> None:
    users(d)
    with resp(d.port) as c:
        c.hello(3, "subscriber", "AUTH", *APP)
        for n in range(3):
            assert as_map(c.call("SUB", f"orders/{n}"))["handle"]
        assert c.call("SUB", "orders/3").code == "LIMIT"


def subscriptions_mqtt(d: Doors, door: str) -> None:
    users(d)
    m = mqtt_login(d, door, "subscriber-m")
    codes = m.subscribe(*(f"orders/{n}" for n in range(5)))
    m.close()
    assert [c < 0x80 for c in codes] == [True, True, True, False, False], codes


def preauth_size_resp(d: Doors, door: str) -> None:
    users(d)
    with resp(d.port) as c:
        c.send_raw(b"*3\r\n$3\r\nPUB\r\n$6\r\norders\r\n$1000000\r\n")
        assert c.reply().code == "NOAUTH"
        assert c.is_closed()


def preauth_size_mqtt(d: Doors, door: str) -> None:
    users(d)
    m = d.mqtt(door)
    m.send_raw(b"\x10\xc0\x84\x3d")  # a CONNECT announcing 1,000,000 bytes, before any authentication
    assert m.is_closed(2), "the worker waited for a 1 MB CONNECT"


def preauth_size_ui(d: Doors, door: str) -> None:
    users(d)
    with d.http() as http:
        r = http.post("/login", data={"user": "app", "password": "x" * 1_000_000, "next": "/"})
        assert r.status_code == 413, r.status_code


def timed(action: Callable[[], Any]) -> float:
    started = time.monotonic()
    action()
    return time.monotonic() - started


def usual_cost(action: Callable[[], Any]) -> float:
    """What ``action`` costs here and now, unthrottled: the least of three (one slow sample must not hide a delay)."""
    return min(timed(action) for _ in range(3))


def throttled_here(d: Doors, door: str) -> None:
    users(d)
    check = usual_cost(lambda: login_at(d, door))  # what a login costs here and now (a password hash)
    fail_login(d, door)
    assert timed(lambda: login_at(d, door)) - check >= 0.7, "the login after a failure from this address was not delayed"


def one_throttle(d: Doors, door: str) -> None:
    users(d)
    check = usual_cost(lambda: login_at(d, door))
    fail_login(d, door_other_than(door))
    assert timed(lambda: login_at(d, door)) - check >= 0.7, "a failure at another door did not delay this one"


def parallel_guesses(d: Doors, door: str) -> None:
    users(d)
    check = usual_cost(lambda: login_at(d, door))
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        done = [f.result() for f in [pool.submit(lambda: (fail_login(d, door), time.monotonic())[1])
                                     for _ in range(4)]]
    # one after the other, each after the delay the failures before it set: 0.5 + 1 + 2 s of waiting
    assert max(done) - started >= check + 2.5, \
        f"4 parallel wrong passwords were answered within {max(done) - started:.2f} s: checked together"


def auth_max_failures_resp(d: Doors, door: str) -> None:
    users(d)
    with resp(d.port) as c:
        for n in range(3):
            assert c.call("AUTH", "app", f"wrong-{n}").code == "WRONGPASS"
        assert c.is_closed()


def auth_timeout_resp(d: Doors, door: str) -> None:
    with resp(d.port) as c:
        assert c.is_closed(3)


def auth_timeout_mqtt(d: Doors, door: str) -> None:
    m = d.mqtt(door)  # the TCP connection (and, over WebSocket, its upgrade), then no CONNECT
    assert m.is_closed(3), "a connection without a CONNECT was held past auth_timeout_ms"


def request_timeout_resp(d: Doors, door: str) -> None:
    users(d)
    with resp(d.port, *APP) as c:
        c.send_raw(b"*3\r\n$3\r\nPUB\r\n$6\r\norders\r\n$1000\r\nab")
        assert c.is_closed(3)


def request_timeout_mqtt(d: Doors, door: str) -> None:
    users(d)
    m = mqtt_login(d, door, "slow", keep_alive=0)
    m.send_raw(b"\x32\xe8\x07" + b"\x00\x08orders/a")  # a PUBLISH of 1,000 bytes, never finished
    assert m.is_closed(3), "a packet begun and never finished held the connection"


def output_timeout_resp(d: Doors, door: str) -> None:
    users(d)
    c = resp(d.port, *APP)
    c.sock.setsockopt(__import__("socket").SOL_SOCKET, __import__("socket").SO_RCVBUF, 4096)
    request = b"*2\r\n$4\r\nECHO\r\n$60000\r\n" + b"y" * 60_000 + b"\r\n"
    threading.Thread(target=lambda: _send_quietly(c.sock, request * 300), daemon=True).start()
    time.sleep(2.5)
    assert c.is_closed(10)


def _send_quietly(sock: Any, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:
        pass


def output_timeout_mqtt(d: Doors, door: str) -> None:
    users(d)
    m = d.mqtt(door, rcvbuf=4096)
    assert accepted(m.connect("not-reading", *APP, keep_alive=0))
    assert m.subscribe("orders/#", qos=0)[0] < 0x80
    with root(d) as r:
        for _ in range(30):
            r.call("MPUB", "orders/x", 10, *([b"z" * 60_000] * 10))
    # the worker let go of it (the client, reading slowly, would see the end only after what the
    # kernel still holds for it trickles through)
    wait_for(lambda: not [t for t in d.worker.connections if ":mqtt" in t], timeout=10,
             what="the worker to close a subscriber that does not read")
    m.close()


def mqtt(check: Check | str) -> dict[str, Check | str]:
    """The same check (or reason) at the three MQTT doors."""
    return {door: check for door in ("mqtt-3.1.1", "mqtt-5.0", "mqtt-ws")}


RULES: dict[str, Rule] = {
    "login first": Rule(
        "On a broker with users, nothing is served before a login.",
        {"resp": login_first_resp, **mqtt(login_first_mqtt), "ui": login_first_ui}),
    "inspect grant": Rule(
        "Every page of the UI needs the inspect grant (on # for the broker-wide pages).",
        {"resp": "the wire has no operator reads: a client reads only what it subscribed to (next rows)",
         **mqtt("as RESP"), "ui": pages_need_inspect_ui}),
    "payloads": Rule(
        "A message's payload is read only with the subscribe grant on its topic.",
        {"resp": payloads_need_topic_grant_resp, **mqtt(payloads_need_topic_grant_mqtt),
         "ui": payloads_need_topic_grant_ui},
        {"max_failures": 1}),
    "default needs the password": Rule(
        "On a broker with users and no password, nobody logs in as default (before the first user too).",
        {"resp": default_needs_a_password_resp, **mqtt(default_needs_a_password_mqtt),
         "ui": default_needs_a_password_ui}),
    "default not in the UI": Rule(
        "On a broker with users, default never logs in to the UI, even with the legacy password.",
        {"resp": "the legacy password stays the default user of applications written before users",
         **mqtt("as RESP"), "ui": default_never_in_the_ui},
        {"password": "legacy-secret-1"}),
    "changed user": Rule(
        "A changed or removed user's connections and UI sessions end; they come back under its current record.",
        {"resp": changed_user_resp, **mqtt(changed_user_mqtt), "ui": changed_user_ui}),
    "publish grant": Rule(
        "A publish needs the publish grant on its topic.",
        {"resp": publish_grant_resp, **mqtt(publish_grant_mqtt), "ui": "the UI publishes nothing"}),
    "will at CONNECT": Rule(
        "A will is a publish: a CONNECT whose will the user may not publish is refused.",
        {"resp": "RESP has no will", **mqtt(will_at_connect), "ui": "the UI publishes nothing"}),
    "will when published": Rule(
        "A will is checked again when it is published, against the user's grants of then.",
        {"resp": "RESP has no will", **mqtt(will_when_published), "ui": "the UI publishes nothing"}),
    "delayed will when scheduled": Rule(
        "A delayed will is checked when it is scheduled, at its connection's end, against the user's grants of then.",
        {"resp": "RESP has no will", "mqtt-3.1.1": "3.1.1 has no Will Delay Interval",
         "mqtt-5.0": delayed_will_when_scheduled, "mqtt-ws": delayed_will_when_scheduled,
         "ui": "the UI publishes nothing"}),
    "$-topics": Rule(
        "A grant whose filter starts with a wildcard never reaches a $-topic, for any action.",
        {"resp": dollar_topics_resp, **mqtt(dollar_topics_mqtt), "ui": dollar_topics_ui}),
    "whole filter": Rule(
        "A subscription needs a subscribe grant that covers its whole filter.",
        {"resp": subscribe_covers_filter_resp, **mqtt(subscribe_covers_filter_mqtt),
         "ui": "the UI subscribes to nothing"}),
    "resumed session": Rule(
        "A resumed session's subscriptions are checked again: a revoked one is dropped, and the client told.",
        {"resp": resumed_session_resp, **mqtt(resumed_session_mqtt), "ui": "the UI holds no subscriptions"}),
    "operator matcher": Rule(
        "An operator action on a filter queue needs a grant that covers its whole filter (the one matcher).",
        {"resp": "no operator action on the wire (SEEK: the next row)", **mqtt("MQTT has no operator action"),
         "ui": operator_matcher_ui}),
    "group-wide": Rule(
        "Moving a group's cursor (SEEK) when another user also uses the group needs the seek grant.",
        {"resp": group_wide_resp, **mqtt("MQTT has no SEEK; a shared subscription never moves its group"),
         "ui": group_wide_ui}),
    "private groups": Rule(
        "Group names starting with ~ are the broker's (a client's own subscription): no client names one.",
        {"resp": private_groups_resp, **mqtt(private_groups_mqtt),
         "ui": "the UI names only groups that exist, under the evict and seek grants"}),
    "client ids": Rule(
        "Client ids starting with $ (a shared group's queue owner) or anon- are refused.",
        {"resp": client_ids_resp, **mqtt(client_ids_mqtt), "ui": "the UI names no client"}),
    "connections per worker": Rule(
        "At most max_connections per worker, counted across every door.",
        {door: connections_per_worker for door in DOORS}, {"max_connections": 3}),
    "connections per user": Rule(
        "At most max_connections_per_user of one user per worker, counted across every door.",
        {door: connections_per_user for door in DOORS}, {"max_connections_per_user": 2}),
    "subscriptions": Rule(
        "At most max_subscriptions per session, counted filter by filter.",
        {"resp": subscriptions_resp, **mqtt(subscriptions_mqtt), "ui": "the UI subscribes to nothing"},
        {"max_subscriptions": 3}),
    "pre-auth size": Rule(
        "Before a login a request may hold at most preauth_max_bulk bytes (16 KiB); larger closes the connection.",
        {"resp": preauth_size_resp, **mqtt(preauth_size_mqtt), "ui": preauth_size_ui}),
    "throttle": Rule(
        "A failed login delays the next one from that address.",
        {door: throttled_here for door in DOORS}, {"auth_delay_ms": 1000}),
    "one throttle": Rule(
        "A failed login at any door delays the next login from that address at every door.",
        {door: one_throttle for door in DOORS}, {"auth_delay_ms": 1000}),
    "parallel guesses": Rule(
        "Parallel logins from one address are checked one at a time, each after its delay.",
        {door: parallel_guesses for door in DOORS}, {"auth_delay_ms": 500}),
    "failures per connection": Rule(
        "A connection is closed after auth_max_failures failed logins.",
        {"resp": auth_max_failures_resp, **mqtt("a refused CONNECT closes the connection: one try each"),
         "ui": "each login is a request of its own; the throttle holds a guesser back"}),
    "auth timeout": Rule(
        "A connection that does not log in within auth_timeout_ms is closed.",
        {"resp": auth_timeout_resp, **mqtt(auth_timeout_mqtt),
         "ui": "a page without a login is answered at once; nothing waits for one"},
        {"auth_timeout_ms": 300}),
    "request timeout": Rule(
        "A request begun and not finished within request_timeout_ms closes the connection.",
        {"resp": request_timeout_resp, **mqtt(request_timeout_mqtt),
         "ui": "HTTP requests are read by uvicorn, not by FenceMQ: put the UI behind a reverse proxy beyond localhost"},
        {"request_timeout_ms": 300}),
    "output timeout": Rule(
        "A client that does not read what it is sent for output_timeout_ms is closed; one batch is held for it.",
        {"resp": output_timeout_resp, **mqtt(output_timeout_mqtt),
         "ui": "an event stream holds one page fragment and waits for it to be taken (counted as a connection)"},
        {"output_timeout_ms": 500}),
}


def test_every_rule_names_every_door_with_a_check_or_the_reason_it_does_not_apply() -> None:
    for says, rule in RULES.items():
        assert set(rule.doors) == set(DOORS), says
        for door, check in rule.doors.items():
            assert callable(check) or (isinstance(check, str) and check), (says, door)


# make test asks RESP and MQTT 5.0 every rule; MQTT 3.1.1, WebSockets and the UI ask them in make test-long
LATER_DOORS = ("mqtt-3.1.1", "mqtt-ws", "ui")
CASES = [pytest.param(name, door, id=f"{name}-{door}", marks=[pytest.mark.long] if door in LATER_DOORS else [])
         for name, rule in RULES.items() for door in DOORS if callable(rule.doors[door])]


@pytest.mark.parametrize(("name", "door"), CASES)
def test_every_door_obeys_every_rule(redis_url: str, name: str, door: str) -> None:
    rule = RULES[name]
    check = rule.doors[door]
    assert callable(check)
    with Doors(redis_url, **rule.settings) as d:
        check(d, door)


def test_a_refused_or_stalled_tls_handshake_is_dropped_in_time_and_logged_in_one_line(redis_url, tmp_path,
                                                                                      caplog) -> None:
    """TLS, on every door that speaks it (the UI is plain HTTP: TLS is a reverse proxy's)."""
    import socket

    import trustme

    cert = trustme.CA().issue_cert("127.0.0.1")
    pem = tmp_path / "server.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(pem))
    caplog.set_level(logging.INFO)
    with Doors(redis_url, tls_cert_file=str(pem), tls_key_file=str(pem), tls_handshake_timeout_ms=300) as d:
        for door, port in (("resp", d.port), ("mqtt", d.mqtt_port), ("mqtt-ws", d.ws_port)):
            stalled = socket.create_connection(("127.0.0.1", port), timeout=5)
            junk = socket.create_connection(("127.0.0.1", port), timeout=5)
            junk.sendall(b"PING\r\n" * 10)
            stalled.settimeout(3)
            try:
                assert stalled.recv(100) == b"", door
            except ConnectionResetError:
                pass
            except TimeoutError:
                raise AssertionError(f"{door}: a stalled TLS handshake was held past tls_handshake_timeout_ms")
            stalled.close(), junk.close()
        time.sleep(0.5)
    assert not [r for r in caplog.records if r.exc_info], "a failed TLS handshake was logged with a traceback"
