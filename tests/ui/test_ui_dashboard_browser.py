"""The overview as the page an operator opens first, in Debian's Chromium (`make test-ui`): alarms that
appear on an open page when their condition holds and clear when it ends, without a reload."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fencemq.server.embedded import EmbeddedRedis
from fencemq.ui.app import UI
from fencemq.ui.serving import DashboardThread
from tests.helpers import wait_for, worker
from tests.ui.test_ui_browser import browser, tab  # noqa: F401 - the browser fixtures

pytestmark = pytest.mark.browser
FAST = {"memory_sample_ms": 100, "health_sample_ms": 100}


def opened(tab, url: str) -> object:  # noqa: F811 - the fixture, passed in
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
        r.set("filler", b"x" * (32 << 20))
        r.config_set("maxmemory", int(r.info("memory")["used_memory"] / 0.95))
        page.wait_for_selector(".alarms.on [data-alarm^='memory@']", timeout=15_000)
        assert "alarm" in page.inner_text(".alarms h2") and "% full" in page.inner_text(".alarms.on")
        r.delete("filler")
        page.wait_for_selector(".alarms.off", timeout=15_000)
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
