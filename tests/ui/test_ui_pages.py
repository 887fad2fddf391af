"""The web UI's pages over HTTP, against a real worker and Redis: what each page shows,
how listings page and sort, and that a page's stream sends it again when the broker moves."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import httpx
import redis

from tests.helpers import free_port, wait_for
from tests.ui.conftest import VIEWER, log_in


def text(html: str) -> str:
    """The page's words, tags dropped (what a reader sees, roughly)."""
    body = html.split("<main", 1)[-1]
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", body)).replace("&#39;", "'").replace("&amp;", "&")


def rows(html: str) -> list[str]:
    return [text(r).strip() for r in re.findall(r"<tr[^>]*>(.*?)</tr>", html, re.S)]


def test_the_overview_shows_workers_sessions_backlog_and_suspects(broker: dict, dashboard_of) -> None:
    http = dashboard_of(login=VIEWER)
    page = http.get("/")
    assert page.status_code == 200
    words = text(page.text)
    assert broker["worker"].worker.id in words
    assert re.search(r"Sessions (\d+) alive of 8", words), words
    # the busiest, by backlog: orders (billing 7 unread, audit 10 unread or returned), chat's lmqs, jobs
    busiest = [r.split()[:3] for r in rows(page.text.split("Busiest", 1)[1].split("</table>", 1)[0])[1:]]
    assert busiest[:3] == [["orders", "plain", "17"], ["chat", "(2", "lmqs)"], ["jobs", "plain", "1"]], busiest
    assert re.search(r"Consumers 7 1 suspected, 1 fenced off", words), words  # c1 c2 c3 X Y d1 s1
    assert re.search(r"Suspects .*orders audit c3 suspected", words)
    assert re.search(r"Dead letters 1 ", words) and re.search(r"Checked out 3 ", words)
    assert "Oldest unacked" in words and "orders" in words.split("Oldest unacked", 1)[1]


def test_the_queues_page_lists_every_kind_and_filters_by_kind_topic_and_name(broker: dict, dashboard_of) -> None:
    http = dashboard_of(login=VIEWER)

    def names(**params: Any) -> list[str]:
        page = http.get("/queues", params=params)
        assert page.status_code == 200, page.text
        return sorted(re.findall(r'<td><a href="/queue\?q=[^"]+">([^<]+)</a></td>', page.text))

    everything = names()
    assert everything == sorted(["orders", "jobs", "chat[s-1]", "chat[s-2]", "sensors/+ ($share/g1)"])
    assert names(kind="lite") == ["chat[s-1]", "chat[s-2]"]
    assert names(kind="filter") == ["sensors/+ ($share/g1)"]
    assert names(topic="chat") == ["chat[s-1]", "chat[s-2]"]
    assert names(match="o*") == ["orders"]


def test_sorting_orders_the_page_by_the_column_either_way(broker: dict, dashboard_of) -> None:
    http = dashboard_of(login=VIEWER)

    def order(sort: str, desc: bool) -> list[str]:
        page = http.get("/queues", params={"sort": sort, "order": "desc" if desc else "asc"})
        return re.findall(r'<td><a href="/queue\?q=[^"]+">([^<]+)</a></td>', page.text)

    assert order("backlog", True)[0] == "orders"
    assert order("name", False) == sorted(order("name", False))
    assert order("name", True) == sorted(order("name", False), reverse=True)
    assert 'aria-sort="descending"' in http.get("/queues", params={"sort": "backlog", "order": "desc"}).text


def test_paging_with_scan_cursors_visits_every_lmq_once(redis_url: str, dashboard_of) -> None:
    r = redis.Redis.from_url(redis_url)
    for i in range(60):
        r.hset(f"fmq:{{l:many:m{i:02d}}}", mapping={"seq": 0, "first": 1})
    r.close()
    http = dashboard_of()
    seen: list[str] = []
    params: dict[str, Any] = {"topic": "many", "limit": 25}
    for _ in range(20):
        page = http.get("/queues", params=params)
        assert page.status_code == 200
        on_page = re.findall(r">many\[(m\d\d)\]</a>", page.text)
        assert len(on_page) <= 25
        seen += on_page
        nxt = re.search(r'<a rel="next" href="/queues\?([^"]+)"', page.text)
        if nxt is None:
            assert "End of listing." in page.text
            break
        params = dict(httpx.QueryParams(nxt.group(1).replace("&amp;", "&")))
    assert sorted(seen) == [f"m{i:02d}" for i in range(60)]


def test_a_queue_page_shows_groups_member_states_and_checkouts(broker: dict, dashboard_of) -> None:
    http = dashboard_of(login=VIEWER)
    orders = text(http.get("/queue", params={"q": "t:orders"}).text)
    assert re.search(r"billing Mode shared Strategy round-robin Epoch 0 Cursor 4", orders), orders
    assert re.search(r"c1 active 3 3", orders) and re.search(r"c2 active 0 0", orders)
    assert re.search(r"c3 suspected for [\d.]+ s", orders)
    assert re.search(r"3 of 3, soonest deadline first", orders)
    assert len(re.findall(r"billing c1 [123] 0 1 in \d", orders)) == 3  # deadlines about 60 s away
    chat = text(http.get("/queue", params={"q": "l:chat:s-1"}).text)
    assert "Mode exclusive" in chat
    assert re.search(r"X evicted by Y", chat) and re.search(r"Y active", chat)
    share = text(http.get("/queue", params={"q": "f:$share/g1:sensors/+"}).text)
    assert re.search(r"s1 \w+ 0 0 [\d ]+/ \d+", share), share  # a push member: its mailbox fill
    assert "no retention: settled messages go" in orders  # what the topic keeps (fencemq retention)
    broker["direct"].hset("fmq:retention", "orders", "1000 3600000 0")
    assert "retention: 1,000 messages 3,600 s" in text(http.get("/queue", params={"q": "t:orders"}).text)


def test_lmq_search_finds_one_name_with_one_read_or_a_glob_by_scan(broker: dict, dashboard_of) -> None:
    http = dashboard_of(login=VIEWER)
    exact = http.get("/lmqs", params={"topic": "chat", "name": "s-2"}).text
    assert re.findall(r">(s-\d)</a>", exact) == ["s-2"]
    glob = http.get("/lmqs", params={"topic": "chat", "name": "s-*"}).text
    assert sorted(re.findall(r">(s-\d)</a>", glob)) == ["s-1", "s-2"]
    assert "No lmq named s-9 in chat" in text(http.get("/lmqs", params={"topic": "chat", "name": "s-9"}).text)


def test_the_sessions_page_lists_clients_with_worker_lease_and_subscriptions(broker: dict, dashboard_of) -> None:
    http = dashboard_of(login=VIEWER)
    lines = rows(http.get("/sessions").text)
    by_client = {line.split()[0]: line for line in lines[1:]}
    assert set(by_client) == {"producer", "c1", "c2", "c3", "X", "Y", "d1", "s1"}
    wid = broker["worker"].worker.id
    assert by_client["c1"].startswith(f"c1 – {wid} {wid}:") and by_client["c1"].endswith(" 1")
    assert by_client["producer"].endswith(" 0")
    found = [line.split()[0] for line in rows(http.get("/sessions", params={"match": "c"}).text)[1:]]
    assert sorted(found) == sorted(c for c in by_client if "c" in c)
    assert rows(http.get("/sessions", params={"match": "*"}).text) == []  # a glob character is a character


def test_the_dead_letters_page_previews_each_payload(broker: dict, dashboard_of) -> None:
    http = dashboard_of(login=VIEWER)
    words = text(http.get("/dlq", params={"q": "t:jobs"}).text)
    assert "1 dead letters" in words
    assert re.search(r"0 1 workers d1 1 .* ago job-1 5 B", words), words


def test_bad_input_is_a_clear_error_page(broker: dict, dashboard_of) -> None:
    http = dashboard_of(login=VIEWER)
    assert http.get("/queue", params={"q": "t:nope"}).status_code == 404
    bad = http.get("/queue", params={"q": "orders"})
    assert bad.status_code == 400 and "name a queue by its id" in bad.text
    assert http.get("/queues", params={"limit": "7"}).status_code == 400
    assert http.get("/queues", params={"kind": "nope"}).status_code == 400
    assert http.get("/events", params={"page": "nope"}).status_code == 400


def live_events(http: httpx.Client, path: str, params: dict[str, Any], n: int) -> list[str]:
    """The first ``n`` live-region renders the page's stream sends."""
    out: list[str] = []
    with http.stream("GET", path, params=params) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        data: list[str] = []
        for line in stream.iter_lines():
            if line.startswith("data: "):
                data.append(line[6:])
            elif line == "" and data:
                out.append("\n".join(data))
                data = []
                if len(out) == n:
                    break
    return out


def test_a_queue_page_stream_sends_the_page_again_after_a_publish(broker: dict, dashboard_of) -> None:
    http = dashboard_of(login=VIEWER)
    producer = broker["c"]["producer"]
    seen: list[str] = []
    with http.stream("GET", "/events", params={"page": "queue", "q": "t:jobs"}) as stream:
        data: list[str] = []
        for line in stream.iter_lines():
            if line.startswith("data: "):
                data.append(line[6:])
            elif line == "" and data:
                seen.append(text("<main>" + "\n".join(data)))
                data = []
                if len(seen) == 1:
                    assert "Messages 2 last id" in seen[0]
                    producer.execute_command("PUB", "jobs", "job-3")
                elif "Messages 3 last id" in seen[-1]:
                    break
                assert len(seen) < 50, "the stream never showed the third message"


def test_the_overview_stream_reports_the_publish_rate(broker: dict, dashboard_of) -> None:
    http = dashboard_of(login=VIEWER, interval=0.3)
    producer = broker["c"]["producer"]
    with http.stream("GET", "/events", params={"page": "overview"}) as stream:
        data: list[str] = []
        renders = 0
        for line in stream.iter_lines():
            if line.startswith("data: "):
                data.append(line[6:])
            elif line == "" and data:
                render = "\n".join(data)
                data = []
                renders += 1
                producer.execute_command("MPUB", "orders", 5, *"abcde")
                rate = re.search(r'data-k="publish">([\d.,–]+)<', render).group(1)
                if rate not in ("–", "0.0"):
                    break
                assert renders < 30, "the overview never showed a publish rate"


def test_a_worker_serves_the_ui_beside_its_port_with_http_port(redis_url: str) -> None:
    port, http_port = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "fencemq.cli.main", "serve", "--redis-url", redis_url,
                             "--port", str(port), "--http-port", str(http_port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines: list[str] = []
        wait_for(lambda: lines.append(proc.stdout.readline()) or "web UI on" in lines[-1], timeout=20,
                 what="the worker's ready lines")
        assert any(f"web UI on http://127.0.0.1:{http_port}/" in line for line in lines), lines
        page = httpx.get(f"http://127.0.0.1:{http_port}/", timeout=10)
        assert page.status_code == 200
        assert re.search(r"Connections \d+ on 1 of 1 workers", text(page.text))
        metrics = httpx.get(f"http://127.0.0.1:{http_port}/metrics", timeout=10)  # beside the pages
        assert metrics.status_code == 200 and "fencemq_connections" in metrics.text
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, out
    assert "drained" in out


def test_fencemq_dashboard_serves_a_brokers_redis_until_stopped(broker: dict) -> None:
    http_port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "fencemq.cli.main", "dashboard", "--redis-url", broker["url"],
                             "--port", str(http_port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        assert f"fencemq dashboard on http://127.0.0.1:{http_port}/" in line, line
        with httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=10) as http:
            assert http.get("/queues").status_code == 303, "a broker with users shows nothing before a login"
            log_in(http, *VIEWER)
            assert "orders" in http.get("/queues").text
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, out


def test_fencemq_dashboard_without_a_redis_url_says_what_to_pass() -> None:
    proc = subprocess.run([sys.executable, "-m", "fencemq.cli.main", "dashboard"], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin"}, timeout=30)
    assert proc.returncode == 2
    assert "no Redis URL: pass --redis-url" in proc.stderr


def test_a_session_search_pages_through_many_sessions_with_zscan(redis_url: str, dashboard_of) -> None:
    r = redis.Redis.from_url(redis_url)
    r.zadd("fmq:sessions", {f"u-{i:03d}": 10**13 + i for i in range(300)})
    r.close()
    http = dashboard_of()
    found: list[str] = []
    params: dict[str, Any] = {"match": "u-1"}
    for _ in range(20):
        page = http.get("/sessions", params=params).text
        found += [line.split()[0] for line in rows(page)[1:]]
        nxt = re.search(r'<a rel="next" href="/sessions\?([^"]+)"', page)
        if nxt is None:
            break
        params = dict(httpx.QueryParams(nxt.group(1).replace("&amp;", "&")))
    assert sorted(set(found)) == [f"u-{i}" for i in range(100, 200)]


def test_a_taken_http_port_stops_the_worker_with_a_message_naming_it(redis_url: str) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        http_port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "fencemq.cli.main", "serve", "--redis-url", redis_url,
                               "--port", "0", "--http-port", str(http_port)], capture_output=True, text=True,
                              timeout=60)
    assert proc.returncode == 1
    assert f"cannot serve the web UI on 127.0.0.1:{http_port} (--http-port)" in proc.stderr


def test_a_priority_queue_page_shows_each_levels_messages_and_scheduled_ones(redis_url: str, dashboard_of) -> None:
    from tests.helpers import client, honour_priority, pulled, subscribed, worker

    honour_priority(redis_url, "urgent")
    with worker(redis_url) as w:
        c = client(w.port, 2, "p1")
        fast, slow = subscribed(c, "urgent", "GROUP", "fast"), subscribed(c, "urgent", "GROUP", "slow")
        for body, level in (("a", 9), ("b", 9), ("c", 9), ("d", 1), ("e", 1), ("f", 0)):
            c.execute_command("PUB", "urgent", body, "PRIORITY", level)
        for _ in range(2):
            c.execute_command("PUB", "urgent", "later", "PRIORITY", 9, "DELAY", 600_000)
        c.execute_command("PUB", "plain", "x", "DELAY", 600_000)
        assert [d["payload"] for d in pulled(c, fast, 4)] == ["a", "b", "c", "d"]
        assert slow
        http = dashboard_of()
        page = http.get("/queue", params={"q": "t:urgent"}).text
        assert re.search(r"Scheduled 2 published for later", text(page)), text(page)
        levels = rows(page.split('<table class="levels">', 1)[1].split("</table>", 1)[0])
        assert levels == ["Level Held fast unread slow unread", "9 3 0 3", "1 2 1 2", "0 1 1 1"], levels
        plain = text(http.get("/queue", params={"q": "t:plain"}).text)
        assert "Scheduled 1 published" in plain and "Priority levels" not in plain
        overview = wait_for(lambda: (lambda page: page if re.search(r"Scheduled 3 published for later", text(page))
                                     else None)(http.get("/").text), timeout=10, what="the overview's scheduled total")
        table = overview.split('<table class="busiest">', 1)[1].split("</table>", 1)[0]
        header = re.findall(r"<th[^>]*>(.*?)</th>", table, re.S)
        cells = {r.split()[0]: r.split() for r in rows(table)[1:]}
        assert cells["urgent"][[text(h).strip() for h in header].index("Scheduled")] == "2", (header, cells)
        c.close()
