"""The UI in a real browser: Debian's Chromium driven by Playwright (never a downloaded browser).

Every page at a desktop's 1280x800 and a phone's 375 px, with no console
error and nothing wider than the screen; the keyboard alone gets around and
evicts; a live update arrives without a reload; an eviction from the UI
fences the client off; a user without the operator permission sees no action.
Run by ``make test-ui``; ``make ui-screenshots`` also writes the pages'
screenshots to docs/ui/ (FENCEMQ_UI_SCREENSHOTS).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fencemq.ui.pages import UI
from fencemq.ui.serving import DashboardThread
from tests.helpers import deliveries
from tests.ui.conftest import CHROMIUM, OPERATOR_PASSWORD, VIEWER_PASSWORD

pytestmark = pytest.mark.browser

PAGES = {
    "login": "/login",
    "overview": "/",
    "queues": "/queues",
    "queue": "/queue?q=t%3Aorders",
    "lmq-search": "/lmqs?topic=chat&name=s-*",
    "sessions": "/sessions",
    "dead-letters": "/dlq?q=t%3Ajobs",
    "alarms": "/alarms",
    "redis": "/redis",
}
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 375, "height": 740}


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def site(broker: dict) -> Iterator[str]:
    with DashboardThread(UI(broker["url"], interval=0.3)) as d:
        yield d.url.rstrip("/")


class Watched:
    """A page whose console errors and uncaught exceptions are collected."""

    def __init__(self, browser: Any, viewport: dict[str, int]) -> None:
        self.context = browser.new_context(viewport=viewport)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(f"console: {m.text}") if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def tab(browser: Any) -> Iterator[Any]:
    opened: list[Watched] = []

    def open_tab(viewport: dict[str, int] = DESKTOP) -> Watched:
        w = Watched(browser, viewport)
        opened.append(w)
        return w

    yield open_tab
    for w in opened:
        w.close()


def shots_dir(tmp_path: Path) -> Path:
    wanted = os.environ.get("FENCEMQ_UI_SCREENSHOTS")
    out = Path(wanted) if wanted else tmp_path
    out.mkdir(parents=True, exist_ok=True)
    return out


def log_in(page: Any, site: str, user: str, password: str) -> None:
    page.goto(f"{site}/login")
    page.fill("#user", user)
    page.fill("#password", password)
    page.press("#password", "Enter")
    page.wait_for_url(f"{site}/")


def traffic(broker: dict, seconds: float) -> None:
    import time

    producer, c2 = broker["c"]["producer"], broker["c"]["c2"]
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1
        producer.execute_command("MPUB", "orders", 20, *[f"x{n}-{i}" for i in range(20)])
        for d in deliveries(c2.execute_command("PULL", broker["handles"]["c2"], "COUNT", 15)):
            c2.execute_command("ACK", broker["handles"]["c2"], d["tag"])
        time.sleep(0.1 + (n % 7) * 0.03)


@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["1280x800", "375px"])
def test_every_page_renders_without_console_errors_or_sideways_scrolling(site: str, tab, viewport, tmp_path,
                                                                         broker: dict) -> None:
    w = tab(viewport)
    out = shots_dir(tmp_path)
    if os.environ.get("FENCEMQ_UI_SCREENSHOTS"):
        traffic(broker, seconds=16)  # something on the charts: three points of the 5 s history, at least
    for name, path in PAGES.items():
        if name == "overview":  # the pages as an operator sees them, actions included
            log_in(w.page, site, "operator", OPERATOR_PASSWORD)
        w.page.goto(site + path)
        w.page.wait_for_selector("main h1")
        if name != "login":
            # the page's stream has delivered once: the script ran and the region was replaced
            w.page.wait_for_function("document.getElementById('live').dataset.updates !== '0'", timeout=10_000)
        overflow = w.page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 0, f"{name} is {overflow} px wider than a {viewport['width']} px screen"
        suffix = "" if viewport is DESKTOP else "-phone"
        w.page.screenshot(path=str(out / f"{name}{suffix}.png"), full_page=viewport is DESKTOP)
    assert w.errors == []


def test_the_keyboard_alone_reaches_the_content_and_the_pages(site: str, tab) -> None:
    page = tab().page
    log_in(page, site, "viewer", VIEWER_PASSWORD)  # a broker with users shows its pages after a login
    page.goto(site + "/")
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.textContent") == "Skip to content"
    page.keyboard.press("Enter")
    assert page.evaluate("document.activeElement.id") == "main"
    page.goto(site + "/")
    focused = []
    for _ in range(4):
        page.keyboard.press("Tab")
        focused.append(page.evaluate("document.activeElement.textContent.trim()"))
    assert focused[:4] == ["Skip to content", "FenceMQ", "Overview", "Queues"]
    page.keyboard.press("Enter")
    page.wait_for_url(site + "/queues")
    # every control on the page is reachable: the sortable headers are links
    assert page.locator("th a").count() == 7


def test_a_publish_shows_up_on_the_open_page_without_a_reload(site: str, tab, broker: dict) -> None:
    w = tab()
    log_in(w.page, site, "viewer", VIEWER_PASSWORD)
    w.page.goto(site + "/queue?q=t%3Ajobs")
    w.page.evaluate("window.notReloaded = true")
    assert re.search(r"Messages\s*2\b", w.page.inner_text("#live"))
    broker["c"]["producer"].execute_command("PUB", "jobs", "job-3")
    w.page.wait_for_function("/Messages\\s*3\\b/.test(document.getElementById('live').innerText)", timeout=10_000)
    assert w.page.evaluate("window.notReloaded") is True
    assert w.errors == []


def test_an_eviction_from_the_ui_is_confirmed_then_fences_the_client_off(site: str, tab, broker: dict) -> None:
    w = tab()
    page = w.page
    log_in(page, site, "operator", OPERATOR_PASSWORD)
    page.goto(site + "/queue?q=t%3Aorders")
    page.focus("#act-evict-1-1")  # billing's first member: c1
    page.keyboard.press("Enter")
    page.wait_for_selector("text=Confirm: evict")
    assert "Evict c1 from group billing of orders?" in page.inner_text(".confirm")
    assert page.evaluate("document.activeElement.id") == "confirm"
    page.keyboard.press("Enter")
    page.wait_for_selector("text=Done: evict")
    # fenced: c1's PULLs return nothing, while the messages it held went to c2
    assert deliveries(broker["c"]["c1"].execute_command("PULL", broker["handles"]["c1"], "COUNT", 5)) == []
    assert len(deliveries(broker["c"]["c2"].execute_command("PULL", broker["handles"]["c2"], "COUNT", 5))) == 5
    page.click("#back")
    page.wait_for_function("/c1\\s+evicted by operator/.test(document.getElementById('live').innerText)")
    assert w.errors == []


def test_a_user_without_the_operator_permission_sees_no_action(site: str, tab) -> None:
    w = tab()
    log_in(w.page, site, "viewer", VIEWER_PASSWORD)
    for path in ("/queue?q=t%3Aorders", "/dlq?q=t%3Ajobs"):
        w.page.goto(site + path)
        w.page.wait_for_function("document.getElementById('live').dataset.updates !== '0'", timeout=10_000)
        assert w.page.locator("form[action^='/action/'], button.danger").count() == 0
    assert w.errors == []
