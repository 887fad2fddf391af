"""The web UI's fixtures: a worker with a known state, and the dashboard over its Redis.

The state (``scripted_state``), as tests/cli/test_cli_ops.py builds it for the CLI:

* orders: 10 messages; group billing: c1 holds 1..3 (60 s leases), c2 idle; group
  audit: c3 let its 100 ms leases on 1..2 expire (suspected, both returned).
* chat[s-1]: 2 messages; X subscribed, then Y preempted it (X carries marker Y).
  chat[s-2]: 1 message, nobody subscribed.
* jobs: 2 messages; group workers: d1 pulled job-1 and NACKed it: dead-lettered.
* $share/g1/sensors/+: a shared filter subscription of s1.

Browser tests (marked ``browser``) run only under ``make test-ui``
(FENCEMQ_TEST_BROWSER=1), in Debian's Chromium.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import re
import shutil
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from fencemq.model import meta
from fencemq.ops.users import UserStore
from fencemq.model.keys import Keyspace
from fencemq.ui.pages import UI
from fencemq.ui.serving import DashboardThread
from tests.helpers import as_map, client, deliveries, worker

CHROMIUM = os.environ.get("FENCEMQ_CHROMIUM", "/usr/bin/chromium")
OPERATOR_PASSWORD = "operator-secret-1"
VIEWER_PASSWORD = "viewer-secret-1"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "browser: drives Debian's Chromium through Playwright (`make test-ui`)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = os.environ.get("FENCEMQ_TEST_BROWSER") == "1"
    reason = None
    if not wanted:
        reason = "browser test: run with `make test-ui`"
    elif not os.path.exists(CHROMIUM) and not shutil.which("chromium"):
        reason = f"no Chromium at {CHROMIUM} (apt-get install -y chromium)"
    else:
        try:
            import playwright  # noqa: F401
        except ImportError:
            reason = "no playwright (pip install -e '.[ui-test]')"
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "browser" in item.keywords:
            item.add_marker(skip)


def scripted_state(url: str, port: int) -> dict[str, Any]:
    names = ("producer", "c1", "c2", "c3", "X", "Y", "d1", "s1")
    c = {n: client(port, 2, n) for n in names}
    c["producer"].execute_command("MPUB", "orders", 10, *[f"o{i}" for i in range(1, 11)])
    h1 = as_map(c["c1"].execute_command("SUB", "orders", "GROUP", "billing", "LOCK", 60_000))["handle"]
    h2 = as_map(c["c2"].execute_command("SUB", "orders", "GROUP", "billing"))["handle"]
    held = deliveries(c["c1"].execute_command("PULL", h1, "COUNT", 3))
    assert [d["id"] for d in held] == ["1", "2", "3"]
    h3 = as_map(c["c3"].execute_command("SUB", "orders", "GROUP", "audit", "LOCK", 100))["handle"]
    assert len(deliveries(c["c3"].execute_command("PULL", h3, "COUNT", 2))) == 2
    hx = as_map(c["X"].execute_command("SUB", "chat", "LMQ", "s-1"))["handle"]
    c["producer"].execute_command("PUB", "chat", "hi", "LMQ", "s-1")
    c["producer"].execute_command("PUB", "chat", "there", "LMQ", "s-1")
    hy = as_map(c["Y"].execute_command("SUB", "chat", "LMQ", "s-1"))["handle"]
    c["producer"].execute_command("PUB", "chat", "other", "LMQ", "s-2")
    c["producer"].execute_command("MPUB", "jobs", 2, "job-1", "job-2")
    hd = as_map(c["d1"].execute_command("SUB", "jobs", "GROUP", "workers"))["handle"]
    (job,) = deliveries(c["d1"].execute_command("PULL", hd))
    c["d1"].execute_command("NACK", hd, job["tag"])  # max_failures=1: dead at once
    hs = as_map(c["s1"].execute_command("SUB", "$share/g1/sensors/+"))["handle"]
    direct = redis.Redis.from_url(url)
    deadline = time.monotonic() + 5
    while not direct.hexists("fmq:{t:orders}", meta.member_field("audit", "c3", meta.SUSPECTED_SINCE)):
        assert time.monotonic() < deadline, "c3's 100 ms leases were not swept within 5 s"
        time.sleep(0.05)
    return {"c": c, "direct": direct, "handles": {"c1": h1, "c2": h2, "c3": h3, "X": hx, "Y": hy, "d1": hd,
                                                  "s1": hs}}


def add_users(url: str) -> None:
    """``operator``: every operator permission on every topic; ``viewer``: may only inspect and read
    payloads (subscribe), no operator action."""
    import redis.asyncio

    async def add() -> None:
        r = redis.asyncio.Redis.from_url(url)
        try:
            store = UserStore(r, Keyspace("fmq").users)
            await store.add("operator", OPERATOR_PASSWORD,
                            [(a, "#") for a in ("inspect", "evict", "seek", "purge", "dlq")])
            await store.add("viewer", VIEWER_PASSWORD, [("inspect", "#"), ("subscribe", "#")])
        finally:
            await r.aclose()

    # on a thread of its own: Playwright's sync API keeps an event loop running on this one
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, add()).result()


VIEWER = ("viewer", VIEWER_PASSWORD)


@pytest.fixture
def dashboard_of(redis_url: str):
    """Start a dashboard over ``redis_url``: ``dashboard_of(**UI options, login=(user, password))`` -> an
    httpx client at it (logged in as ``login`` when given: a broker with users shows nothing before)."""
    started: list[tuple[DashboardThread, httpx.Client]] = []

    def start(login: tuple[str, str] | None = None, **options: Any) -> httpx.Client:
        options.setdefault("interval", 0.2)
        d = DashboardThread(UI(redis_url, **options)).start()
        http = httpx.Client(base_url=d.url.rstrip("/"), timeout=10)
        started.append((d, http))
        if login is not None:
            log_in(http, *login)
        return http

    yield start
    for d, http in started:
        http.close()
        d.stop()


@pytest.fixture
def broker(redis_url: str) -> Iterator[dict[str, Any]]:
    """A worker (max_failures=1) holding the scripted state, with users ``operator`` and ``viewer``."""
    with worker(redis_url, max_failures=1) as w:
        state = scripted_state(redis_url, w.port)
        add_users(redis_url)
        try:
            yield {"url": redis_url, "worker": w, **state}
        finally:
            for conn in state["c"].values():
                conn.close()
            state["direct"].close()


def csrf_of(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found, "no CSRF token on the page"
    return found.group(1)


def log_in(http: httpx.Client, user: str, password: str) -> None:
    r = http.post("/login", data={"user": user, "password": password, "next": "/"})
    assert r.status_code == 303, f"login of {user} answered {r.status_code}"
