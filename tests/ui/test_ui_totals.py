"""The overview's totals, busiest table and history over HTTP, against a real worker and Redis: the
table sorts by backlog, age and rate; the history the health watcher keeps in Redis is bounded and
gives the charts their rates; dead-letter growth within a window raises its alarm."""

from __future__ import annotations

import asyncio
import json
import re

import redis

from fencemq.model.keys import Keyspace
from fencemq.ops import history
from tests.helpers import as_map, client, deliveries, direct_async, wait_for, worker
from tests.ui.conftest import VIEWER
from tests.ui.test_ui_pages import rows

KEYS = Keyspace("fmq")


def busiest(html: str) -> list[str]:
    table = html.split('<table class="busiest">', 1)[1].split("</table>", 1)[0]
    return [r.split()[0] for r in rows(table)[1:]]


def test_the_busiest_table_sorts_by_backlog_age_checkouts_and_rate(broker: dict, dashboard_of) -> None:
    http = dashboard_of(login=VIEWER)
    assert busiest(http.get("/").text) == ["orders", "chat", "jobs"]  # by backlog: 17, 2 (lite), 1
    assert busiest(http.get("/", params={"sort": "backlog", "order": "asc"}).text) == ["jobs", "chat", "orders"]
    assert busiest(http.get("/", params={"sort": "out"}).text)[0] == "orders"  # c1 holds 3
    assert busiest(http.get("/", params={"sort": "dead"}).text)[0] == "jobs"
    by_age = http.get("/", params={"sort": "age"}).text
    assert busiest(by_age)[-1] == "chat", "a lite topic has no age of its own: last"
    assert 'aria-sort="descending"' in by_age.split('<table class="busiest">', 1)[1].split("Oldest", 1)[0]
    broker["c"]["producer"].execute_command("MPUB", "jobs", 50, *["j"] * 50)
    wait_for(lambda: busiest(http.get("/", params={"sort": "rate"}).text)[0] == "jobs", timeout=10,
             what="jobs first by publish rate")
    assert http.get("/", params={"sort": "nonsense"}).status_code == 400
    assert http.get("/", params={"range": "2d"}).status_code == 400


def test_the_history_is_bounded_and_gives_the_charts_their_rates(redis_url: str) -> None:
    async def main() -> None:
        r = direct_async(redis_url)
        try:
            s = history.BY_NAME["5m"]
            now = 1_000_000_000_000
            assert await history.due(r, KEYS, now) == list(history.SERIES), "an empty history: every series"
            for i in range(s.kept + 30):
                t = now + i * s.step_ms
                due = await history.due(r, KEYS, t)
                assert s in due
                await history.record(r, KEYS, [s], t, {"published": 10 * i, "ready": i})
            assert await r.llen(history.key(KEYS, s)) == s.kept, "cut to its range plus two points"
            assert await history.due(r, KEYS, t + 1_000) == [x for x in history.SERIES if x is not s]
            points = await history.read(r, KEYS, s, t)
            assert len(points) == s.kept  # the range, and the point before it (the first rate in range)
            assert points[0]["publish"] is None and all(p["publish"] == 2.0 for p in points[1:])  # 10 per 5 s
            assert points[-1]["ready"] == s.kept + 29
            assert history.counted_within(points, "published") == 10 * (len(points) - 1)
        finally:
            await r.aclose()

    asyncio.run(main())


def test_a_worker_keeps_the_history_and_dead_letter_growth_raises_its_alarm(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    settings = {"health_sample_ms": 100, "max_failures": 1, "alarm_dead_letter_growth": 3,
                "alarm_dead_letter_window_ms": 5_000}
    with worker(redis_url, **settings) as w:
        wait_for(lambda: r.llen("fmq:history:5m") >= 1, what="the first point of the history")
        first = json.loads(r.lindex("fmq:history:5m", 0))
        assert {"t", "published", "ready", "out", "dead", "sessions", "connections"} <= set(first)
        c = client(w.port, 2, "dl")
        h = as_map(c.execute_command("SUB", "jobs", "GROUP", "w"))["handle"]
        c.execute_command("MPUB", "jobs", 3, "a", "b", "c")
        tags = [d["tag"] for d in deliveries(c.execute_command("PULL", h, "COUNT", 3))]
        c.execute_command("NACK", h, *tags)  # max_failures 1: all three dead
        assert int(r.hget("fmq:totals", "dead_lettered")) == 3
        wait_for(lambda: r.hexists("fmq:alarms", "dead-letters@broker"), timeout=15,
                 what="the dead-letter growth alarm, once the history covers the window")
        detail = r.hget("fmq:alarms", "dead-letters@broker").decode()
        assert re.search(r"3 messages were dead-lettered in the last", detail), detail
        # nothing more dies: once the window has passed the growth is 0 and the alarm clears
        wait_for(lambda: not r.hexists("fmq:alarms", "dead-letters@broker"), timeout=20, what="the alarm cleared")
        c.close()
    r.close()
