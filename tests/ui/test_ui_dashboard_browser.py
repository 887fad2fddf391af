"""The overview as the page an operator opens first, in Debian's Chromium (`make test-ui`): alarms that
appear on an open page when their condition holds and clear when it ends, without a reload."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from fencemq.server.embedded import EmbeddedRedis
from fencemq.ui.pages import UI
from fencemq.ui.serving import DashboardThread
from fencemq.model.keys import Keyspace
from fencemq.ops import totals
from tests.helpers import direct_async, wait_for, worker
from tests.ops.test_totals import SETTINGS, Workload, run_async
from tests.ui.test_ui_browser import DESKTOP, PHONE, browser, shots_dir, tab  # noqa: F401 - the browser fixtures
from tests.ui.test_ui_users import admin, grants_of  # noqa: F401 - a fixture

pytestmark = pytest.mark.browser
FAST = {"memory_sample_ms": 100, "health_sample_ms": 100}


async def full(url: str) -> dict[str, Any]:
    r = direct_async(url)
    try:
        return await totals.full_count(r, Keyspace("fmq"))
    finally:
        await r.aclose()


def opened(tab, url: str) -> Any:  # noqa: F811 - the fixture, passed in
    w = tab()
    w.page.goto(url)
    w.page.wait_for_function("document.getElementById('live').dataset.updates !== '0'", timeout=10_000)
    w.page.evaluate("window.notReloaded = true")
    return w


@pytest.fixture
def own_redis() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


def test_redis_filled_past_its_watermark_raises_an_alarm_on_the_open_overview_and_draining_clears_it(
        own_redis: EmbeddedRedis, tab) -> None:  # noqa: F811
    r = own_redis.client()
    with worker(own_redis.url, **FAST), DashboardThread(UI(own_redis.url, interval=0.2)) as d:
        w = opened(tab, d.url)
        page = w.page
        assert page.inner_text(".alarms h2") == "No alarms"
        # 32 values of 1 MiB, not one of 32, and the limit set from what is kept, client buffers left out:
        # a 32 MiB argument leaves a query buffer as large (used_memory 80 MiB, then 40 once Redis freed
        # it), and a watermark set while it was counted was never reached again
        fillers = [f"filler:{i}" for i in range(32)]
        with r.pipeline(transaction=False) as pipe:
            for key in fillers:
                pipe.set(key, b"x" * (1 << 20))
            pipe.execute()
        memory = r.info("memory")
        r.config_set("maxmemory", int((memory["used_memory"] - memory["mem_clients_normal"]) / 0.95))
        try:
            page.wait_for_selector(".alarms.on [data-alarm^='memory@']", timeout=30_000)
        except Exception as exc:  # say what the broker held then: the page, its alarms, Redis's memory
            memory = {k: v for k, v in r.info("memory").items() if k in ("used_memory", "maxmemory",
                                                                         "mem_not_counted_for_evict")}
            raise AssertionError(f"no memory alarm on the page: alarms {r.hgetall('fmq:alarms')}, memory {memory}, "
                                 f"page {page.inner_text('.alarms')[:500]!r}") from exc
        assert "alarm" in page.inner_text(".alarms h2") and "% full" in page.inner_text(".alarms.on")
        r.delete(*fillers)
        page.wait_for_selector(".alarms.off", timeout=30_000)
        assert page.evaluate("window.notReloaded") is True
        assert w.errors == []


def test_a_stopped_replica_shows_on_the_open_alarms_page_and_its_return_clears_it(tab) -> None:  # noqa: F811
    with EmbeddedRedis() as primary:
        primary.client().config_set("repl-diskless-sync-delay", "0")
        replica = EmbeddedRedis(extra_args=["--replicaof", "127.0.0.1", str(primary.port)]).start()
        try:
            wait_for(lambda: replica.client().info("replication")["master_link_status"] == "up", timeout=15,
                     what="the replica in sync")
            with worker(primary.url, **FAST), DashboardThread(UI(primary.url, interval=0.2)) as d:
                wait_for(lambda: primary.client().hexists("fmq:redis:nodes", f"127.0.0.1:{replica.port}"),
                         what="the replica noted by the health watcher")
                w = opened(tab, d.url + "alarms")
                page = w.page
                assert "No alarms" in page.inner_text("#live")
                replica.stop()
                row = page.wait_for_selector(f"[data-alarm='replica@127.0.0.1:{replica.port}']", timeout=15_000)
                assert "is not connected" in row.inner_text()
                replica.start(_same_port=True)
                page.wait_for_function("/No alarms/.test(document.getElementById('live').innerText)",
                                       timeout=30_000)
                assert page.evaluate("window.notReloaded") is True
                assert w.errors == []
        finally:
            replica.stop()


def card(page: Any, k: str) -> int:
    return int(page.inner_text(f"[data-k='{k}']").replace(",", ""))


def test_the_overview_cards_equal_a_full_count_of_the_broker_after_a_random_workload(redis_url: str, tab) -> None:  # noqa: F811
    with worker(redis_url, **SETTINGS) as w, DashboardThread(UI(redis_url, interval=0.2)) as d:
        load = Workload(redis_url, w.port, random.Random(7))
        try:
            for _ in range(250):
                load.step()
        finally:
            load.close()
        # the clients are gone: their sessions end (members leave, what they held goes back), then all is still
        r = redis.Redis.from_url(redis_url)
        wait_for(lambda: r.zcard("fmq:sessions") == 0, timeout=20, what="the workload's sessions to end")
        r.close()
        counted = run_async(full(redis_url))["totals"]
        page = opened(tab, d.url).page
        page.wait_for_function("document.getElementById('live').dataset.updates !== '0'")
        shown = {k: card(page, k) for k in ("ready", "out", "delayed", "dead", "retained", "queues", "consumers")}
        assert shown == {k: counted[k] for k in shown}
        assert shown["ready"] > 0 and shown["queues"] > 0
        assert f"{counted['suspected']} suspected, {counted['fenced']} fenced off" in page.inner_text(".counts")


def seed_history(r: Any, now_ms: int) -> None:
    """Points as the health watcher writes them: an hour of 30 s points, five minutes of 5 s points."""
    def point(t: int, i: int) -> str:
        return json.dumps({"t": t, "published": 100 * i, "delivered": 90 * i, "acked": 80 * i, "redelivered": i,
                           "ready": i, "out": 2, "delayed": 0, "dead": 0})
    r.delete("fmq:history:5m", "fmq:history:1h")
    for i in range(60):
        r.lpush("fmq:history:5m", point(now_ms - (60 - i) * 5_000, i))
    for i in range(120):
        r.lpush("fmq:history:1h", point(now_ms - (120 - i) * 30_000, 3 * i))


def test_a_range_change_redraws_the_charts_with_their_time_axis(redis_url: str, tab) -> None:  # noqa: F811
    r = redis.Redis.from_url(redis_url)
    now = int(r.time()[0]) * 1000
    seed_history(r, now)
    with DashboardThread(UI(redis_url, interval=0.2)) as d:
        page = opened(tab, d.url).page
        assert page.get_attribute(".charts", "data-range") == "5m"
        five = page.inner_text(".charts .xaxis")
        first = page.get_attribute(".charts polyline", "points")
        assert len(first.split()) >= 50, "five minutes of 5 s points"
        page.click("nav.ranges a[data-range='1h']")
        page.wait_for_function("document.querySelector('.charts').dataset.range === '1h'")
        hour = page.inner_text(".charts .xaxis")
        assert hour != five and re.fullmatch(r"(\d\d:\d\d\s*)+", hour.strip()), hour  # HH:MM ticks across an hour
        assert page.get_attribute(".charts polyline", "points") != first
        assert page.get_attribute("nav.ranges a[aria-current='true']", "data-range") == "1h"
        page.wait_for_function("document.getElementById('live').dataset.updates !== '0'")
        assert page.get_attribute(".charts", "data-range") == "1h", "a live update keeps the range"
    r.close()


def test_users_and_grants_are_managed_from_the_ui_each_change_confirmed(broker: dict, admin, tab) -> None:  # noqa: F811
    url = broker["url"]
    with DashboardThread(UI(url, interval=0.3)) as d:
        w = tab()
        page = w.page
        page.goto(d.url + "login")
        page.fill("#user", admin[0])
        page.fill("#password", admin[1])
        page.press("#password", "Enter")
        page.wait_for_url(d.url)
        page.click("nav a[href='/users']")
        page.fill("#new-user", "carol")
        page.fill("#new-password", "carol-secret-1")
        page.fill("#new-grants", "subscribe:orders/#")
        page.click("#add-user")
        page.wait_for_selector("text=Confirm: add")
        assert grants_of(url, "carol") is None
        assert page.evaluate("document.activeElement.id") == "confirm"
        page.keyboard.press("Enter")
        page.wait_for_selector("text=Done: add")
        page.goto(d.url + "users")
        row = page.locator("tr[data-user='carol']")
        assert "subscribe\norders/#" in row.inner_text()
        row.locator("form.grant select[name='action']").select_option("publish")
        row.locator("form.grant input[name='filter']").fill("orders/new")
        row.locator("button", has_text="Grant").click()
        page.click("#confirm")
        page.wait_for_selector("text=Done: grant")
        assert grants_of(url, "carol") == [("publish", "orders/new"), ("subscribe", "orders/#")]
        page.goto(d.url + "users")
        page.click("tr[data-user='carol'] button[aria-label='Revoke subscribe on orders/# from carol']")
        page.click("#confirm")
        page.wait_for_selector("text=Done: revoke")
        assert grants_of(url, "carol") == [("publish", "orders/new")]
        page.goto(d.url + "users")
        page.locator("tr[data-user='carol'] button.danger").click()
        assert "Remove user 'carol'?" in page.inner_text(".confirm")
        page.click("#confirm")
        page.wait_for_selector("text=Done: remove")
        assert grants_of(url, "carol") is None
        assert w.errors == []


@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["1280x800", "375px"])
def test_the_users_page_renders_for_an_admin_without_sideways_scrolling(broker: dict, admin, tab, viewport,  # noqa: F811
                                                                        tmp_path) -> None:
    with DashboardThread(UI(broker["url"], interval=0.3)) as d:
        w = tab(viewport)
        w.page.goto(d.url + "login")
        w.page.fill("#user", admin[0])
        w.page.fill("#password", admin[1])
        w.page.press("#password", "Enter")
        w.page.wait_for_url(d.url)
        w.page.goto(d.url + "users")
        w.page.wait_for_selector("tr[data-user='viewer']")
        overflow = w.page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 0, f"the users page is {overflow} px wider than a {viewport['width']} px screen"
        suffix = "" if viewport is DESKTOP else "-phone"
        w.page.screenshot(path=str(shots_dir(tmp_path) / f"users{suffix}.png"), full_page=viewport is DESKTOP)
        assert w.errors == []
