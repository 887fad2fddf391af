"""The operator commands cli/ops.py registers (queues, lmqs, inspect, evict, sweep, seek, purge,
dlq, top, bench) through typer's runner, against a real worker and Redis: human tables,
--json, and the exit codes of the errors an operator meets."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import typer
from typer.testing import CliRunner

from fencemq.config import Config
from fencemq.model import meta
from fencemq.model.records import journal_events
from fencemq.server.embedded import EmbeddedRedis, free_port
from fencemq.model.keys import QueueRef
from fencemq.model.handles import Handle
from fencemq.fences.core import Core
from fencemq.cli.ops import register
from tests.helpers import as_map, client, deliveries, worker

WIDE = {"COLUMNS": "220"}  # no cell wraps in the tables


def make_app() -> typer.Typer:
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)

    @app.callback()
    def main() -> None:
        """fencemq (test)"""

    register(app)
    return app


APP = make_app()


def invoke(*args: str, env: dict[str, str] | None = None, **kw: Any):
    result = CliRunner().invoke(APP, list(args), env={**WIDE, **(env or {})}, **kw)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def ok(*args: str, **kw: Any):
    result = invoke(*args, **kw)
    assert result.exit_code == 0, f"exit {result.exit_code}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


def ok_json(*args: str) -> Any:
    return json.loads(ok(*args, "--json").stdout)


def one_line_error(result, code: int) -> str:
    assert result.exit_code == code, f"exit {result.exit_code}, wanted {code}\n{result.stdout}\n{result.stderr}"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# -- the scripted workload -------------------------------------------------------------------


@pytest.fixture
def broker(redis_url: str) -> Iterator[dict[str, Any]]:
    """A worker (max_failures=1) and this state:

    * orders: 10 messages; group billing: c1 holds 1..3 (60 s leases), c2 idle; group
      audit: c3 let its 100 ms leases on 1..2 expire (suspected, both returned).
    * chat[s-1]: 2 messages; X subscribed, then Y preempted it (X carries marker Y).
      chat[s-2]: 1 message, nobody subscribed.
    * jobs: 2 messages; group workers: d1 pulled job-1 and NACKed it: dead-lettered.
    """
    with worker(redis_url, max_failures=1) as w:
        names = ("producer", "c1", "c2", "c3", "X", "Y", "d1")
        c = {n: client(w.port, 2, n) for n in names}
        c["producer"].execute_command("MPUB", "orders", 10, *[f"o{i}" for i in range(1, 11)])
        h1 = as_map(c["c1"].execute_command("SUB", "orders", "GROUP", "billing", "LOCK", 60_000))["handle"]
        h2 = as_map(c["c2"].execute_command("SUB", "orders", "GROUP", "billing"))["handle"]
        held = deliveries(c["c1"].execute_command("PULL", h1, "COUNT", 3))
        assert [d["id"] for d in held] == ["1", "2", "3"]
        h3 = as_map(c["c3"].execute_command("SUB", "orders", "GROUP", "audit", "LOCK", 100))["handle"]
        expiring = deliveries(c["c3"].execute_command("PULL", h3, "COUNT", 2))
        assert len(expiring) == 2

        hx = as_map(c["X"].execute_command("SUB", "chat", "LMQ", "s-1"))["handle"]
        c["producer"].execute_command("PUB", "chat", "hi", "LMQ", "s-1")
        c["producer"].execute_command("PUB", "chat", "there", "LMQ", "s-1")
        hy = as_map(c["Y"].execute_command("SUB", "chat", "LMQ", "s-1"))["handle"]
        c["producer"].execute_command("PUB", "chat", "other", "LMQ", "s-2")

        c["producer"].execute_command("MPUB", "jobs", 2, "job-1", "job-2")
        hd = as_map(c["d1"].execute_command("SUB", "jobs", "GROUP", "workers"))["handle"]
        (job,) = deliveries(c["d1"].execute_command("PULL", hd))
        assert job["payload"] == "job-1"
        c["d1"].execute_command("NACK", hd, job["tag"])  # max_failures=1: dead at once

        direct = redis.Redis.from_url(redis_url)
        deadline = time.monotonic() + 5
        while not direct.hexists("fmq:{t:orders}", meta.member_field("audit", "c3", meta.SUSPECTED_SINCE)):  # the worker's sweeper
            assert time.monotonic() < deadline, "c3's 100 ms leases were not swept within 5 s"
            time.sleep(0.05)
        try:
            yield {"url": redis_url, "worker": w, "c": c, "direct": direct,
                   "handles": {"c1": h1, "c2": h2, "c3": h3, "X": hx, "Y": hy, "d1": hd},
                   "c1_tags": [d["tag"] for d in held], "last_tag": expiring[-1]["tag"]}
        finally:
            for conn in c.values():
                try:
                    conn.execute_command("QUIT")
                except redis.RedisError:
                    pass
                conn.close()
            direct.close()


# -- queues / lmqs -----------------------------------------------------------------------------


def test_queues_json_lists_every_queue_with_its_figures(broker: dict) -> None:
    url = broker["url"]
    out = ok_json("queues", "--redis-url", url)
    assert out["cursor"] is None and out["nodes"] == 1
    rows = {q["name"]: q for q in out["queues"]}
    assert set(rows) == {"orders", "chat[s-1]", "chat[s-2]", "jobs"}
    orders = rows["orders"]
    assert (orders["qid"], orders["kind"], orders["seq"], orders["groups"], orders["members"]) == (
        "t:orders", "plain", 10, 2, 3)
    assert orders["backlog"] == 10  # audit: 8 unread + 2 returned
    assert (orders["checkouts"], orders["ready"], orders["suspected"], orders["dead_letters"]) == (3, 2, 1, 0)
    chat = rows["chat[s-1]"]
    assert (chat["kind"], chat["topic"], chat["lmq"], chat["owners"], chat["evicted"]) == (
        "lite", "chat", "s-1", ["Y"], 1)
    assert rows["jobs"]["dead_letters"] == 1
    assert rows["chat[s-2]"]["groups"] == 0 and rows["chat[s-2]"]["backlog"] is None


def test_queues_filters(broker: dict) -> None:
    url = broker["url"]

    def names(*args: str) -> list[str]:
        return sorted(q["name"] for q in ok_json("queues", "--redis-url", url, *args)["queues"])

    assert names("--kind", "lite") == ["chat[s-1]", "chat[s-2]"]
    assert names("--kind", "plain") == ["jobs", "orders"]
    assert names("--kind", "filter") == []
    assert names("--topic", "chat") == ["chat[s-1]", "chat[s-2]"]
    assert names("--topic", "orders") == ["orders"]
    assert names("--topic", "nope") == []
    assert names("--match", "o*") == ["orders"]
    assert names("--match", "*o*") == ["jobs", "orders"]
    assert names("--match", "[cj]*") == ["chat[s-1]", "chat[s-2]", "jobs"]
    lmqs = ok_json("lmqs", "--redis-url", url, "--topic", "chat", "--match", "*-2")["queues"]
    assert [(q["topic"], q["lmq"]) for q in lmqs] == [("chat", "s-2")]
    assert ok_json("lmqs", "--redis-url", url, "--topic", "chat")["pattern"] == "fmq:{l:chat:*}"


def test_queues_and_lmqs_tables(broker: dict) -> None:
    url = broker["url"]
    out = ok("queues", "--redis-url", url).stdout
    for text in ("Queues", "orders", "chat[s-1]", "chat[s-2]", "jobs", "lite", "plain", "End of listing."):
        assert text in out, f"{text!r} missing from:\n{out}"
    out = ok("lmqs", "--redis-url", url, "--topic", "chat").stdout
    assert "Lite queues" in out and "s-1" in out and "s-2" in out and "orders" not in out
    out = ok("queues", "--redis-url", url, "--topic", "orders").stdout
    assert "1 shown, 1 key scanned on 1 server." in out, out  # one key, not '1 keys'


def test_paging_with_the_cursor_visits_every_queue_once(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    try:
        for i in range(57):
            r.hset(f"fmq:{{l:many:m{i:02d}}}", mapping={"seq": 0, "first": 1})
        r.hset("fmq:{t:plain}", mapping={"seq": 0, "first": 1})
        r.set("fmq:{t:not-a-hash}", "x")  # TYPE hash keeps it out
        r.hset("fmq:{t:plain}:co", "1", "x")  # and the pattern keeps a queue's other keys out
    finally:
        r.close()
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        args = ["lmqs", "--redis-url", redis_url, "--topic", "many", "--limit", "10"]
        page = ok_json(*args, *(["--cursor", cursor] if cursor else []))
        pages += 1
        assert len(page["queues"]) <= 10
        seen += [q["lmq"] for q in page["queues"]]
        cursor = page["cursor"]
        if cursor is None:
            break
        assert pages < 50
    assert sorted(seen) == [f"m{i:02d}" for i in range(57)] and len(seen) == len(set(seen))
    assert pages >= 6
    first = ok("lmqs", "--redis-url", redis_url, "--topic", "many", "--limit", "10").stdout
    assert "More: --cursor " in first
    assert sorted(q["name"] for q in ok_json("queues", "--redis-url", redis_url, "--kind", "plain")["queues"]) == [
        "plain"]


# -- inspect --------------------------------------------------------------------------------------


def test_inspect_queue_json(broker: dict) -> None:
    q = ok_json("inspect", "queue", "orders", "--redis-url", broker["url"])
    assert (q["qid"], q["seq"], q["first"], q["retained"]) == ("t:orders", 10, 1, 10)
    assert q["last_tag"] == int(broker["last_tag"])  # tags only grow: the last one is c3's second
    assert (q["checkouts_total"], q["leased"], q["ready"], q["dead_letters"]) == (3, 3, 2, 0)
    groups = {g["group"]: g for g in q["groups"]}
    billing, audit = groups["billing"], groups["audit"]
    assert (billing["mode"], billing["epoch"], billing["cursor"], billing["unread"], billing["checkouts"]) == (
        "shared", 0, 4, 7, 3)
    assert [(m["member"], m["delivered"], m["checkouts"], m["suspected"]) for m in billing["members"]] == [
        ("c1", 3, 3, False), ("c2", 0, 0, False)]
    assert (audit["cursor"], audit["returned"], audit["backlog"]) == (3, 2, 10)
    (c3,) = audit["members"]
    assert c3["suspected"] and c3["lock_ms"] == 100 and c3["suspected_since_ms"] <= q["now_ms"]
    t1, t2, t3 = broker["c1_tags"]
    assert [(c["tag"], c["member"], c["id"], c["stale"]) for c in q["checkouts"]] == [
        (t1, "c1", 1, False), (t2, "c1", 2, False), (t3, "c1", 3, False)]
    assert all(50 < c["expires_in_s"] <= 60 for c in q["checkouts"])

    capped = ok_json("inspect", "queue", "orders", "--redis-url", broker["url"], "--limit", "1")
    assert capped["checkouts_shown"] == 1 and capped["checkouts_total"] == 3
    lite = ok_json("inspect", "queue", "chat", "--lmq", "s-1", "--redis-url", broker["url"])
    (default,) = lite["groups"]
    assert (default["mode"], default["owner"]) == ("exclusive", "Y")
    assert {m["member"]: m["marker"] for m in default["members"]} == {"X": "Y", "Y": None}


def test_inspect_queue_table(broker: dict) -> None:
    out = ok("inspect", "queue", "orders", "--redis-url", broker["url"]).stdout
    for text in ("t:orders", "ids 1..10", "billing", "audit", "c3 (suspected)", "Members of billing",
                 "Checkouts", "in 5"):
        assert text in out, f"{text!r} missing from:\n{out}"
    out = ok("inspect", "queue", "orders", "--redis-url", broker["url"], "--limit", "1").stdout
    assert "(1 of 3, soonest deadline first)" in out


def test_inspect_group_and_member(broker: dict) -> None:
    url = broker["url"]
    g = ok_json("inspect", "group", "orders", "billing", "--redis-url", url)
    assert (g["group"], g["mode"], g["strategy"], g["cursor"], g["backlog"], g["checkouts_total"]) == (
        "billing", "shared", "round-robin", 4, 7, 3)
    assert [m["member"] for m in g["members"]] == ["c1", "c2"]
    assert len(g["checkouts"]) == 3
    out = ok("inspect", "group", "orders", "billing", "--redis-url", url).stdout
    assert "round-robin" in out and "c1" in out and "c2" in out

    m = ok_json("inspect", "member", "orders", "billing", "c1", "--redis-url", url)
    assert (m["delivered"], m["max"], m["lock_ms"], m["checkouts_total"], m["suspected"], m["marker"]) == (
        3, None, 60_000, 3, False, None)
    assert m["handle"] == broker["handles"]["c1"].split(".")[0]  # a worker appends its MAC; inspect shows the fields
    assert m["session"]["alive"] and m["session"]["worker"] == broker["worker"].worker.id
    assert [c["id"] for c in m["checkouts"]] == [1, 2, 3]

    x = ok_json("inspect", "member", "chat", "default", "X", "--lmq", "s-1", "--redis-url", url)
    assert (x["marker"], x["owner"], x["group_owner"]) == ("Y", False, "Y")
    out = ok("inspect", "member", "chat", "default", "X", "--lmq", "s-1", "--redis-url", url).stdout
    assert "evicted by Y" in out and "Session" in out and "chat[s-1]" in out


def test_inspect_session(broker: dict) -> None:
    s = ok_json("inspect", "session", "c1", "--redis-url", broker["url"])
    assert s["alive"] and 0 < s["lease_in_s"] <= 10 and s["worker"] == broker["worker"].worker.id
    (h,) = s["handles"]
    assert (h["queue"], h["group"], h["mode"], h["delivered"], h["checkouts"], h["member"]) == (
        "orders", "billing", "shared", 3, 3, True)
    x = ok_json("inspect", "session", "X", "--redis-url", broker["url"])
    assert x["handles"][0]["marker"] == "Y" and x["lite_counts"] == {"chat": 1}
    assert [n["type"] for n in x["notices"]] == ["unsubscribe"] and x["notices"][0]["by"] == "Y"
    out = ok("inspect", "session", "X", "--redis-url", broker["url"]).stdout
    assert "Subscriptions" in out and "chat[s-1]" in out and "evicted by Y" in out and "unsubscribe" in out


def test_inspect_session_reads_an_lmq_at_rest_like_any_other(broker: dict) -> None:
    broker["c"]["X"].execute_command("UNSUB", broker["handles"]["X"])  # Y alone: chat[s-1] comes to rest
    assert broker["direct"].hexists("fmq:{l:chat:s-1}", "z"), "compact"
    (y,) = ok_json("inspect", "session", "Y", "--redis-url", broker["url"])["handles"]
    assert (y["queue"], y["mode"], y["epoch"], y["member"], y["owner"], y["marker"], y["delivered"]) == (
        "chat[s-1]", "exclusive", 0, True, True, None, 0)
    (default,) = ok_json("inspect", "queue", "chat", "--lmq", "s-1", "--redis-url", broker["url"])["groups"]
    assert (default["mode"], default["owner"], [m["member"] for m in default["members"]]) == ("exclusive", "Y", ["Y"])


def test_inspect_not_found_exits_1(broker: dict) -> None:
    url = broker["url"]
    line = one_line_error(invoke("inspect", "queue", "nosuch", "--redis-url", url), 1)
    assert "no queue nosuch" in line
    line = one_line_error(invoke("inspect", "queue", "chat", "--redis-url", url), 1)
    assert "--lmq" in line  # a lite topic: says what is missing
    line = one_line_error(invoke("inspect", "group", "orders", "nope", "--redis-url", url), 1)
    assert "no group 'nope'" in line and "billing" in line
    line = one_line_error(invoke("inspect", "member", "orders", "billing", "zed", "--redis-url", url), 1)
    assert "'zed' is not a member" in line
    line = one_line_error(invoke("inspect", "session", "ghost", "--redis-url", url), 1)
    assert "no session 'ghost'" in line
    one_line_error(invoke("inspect", "queue", "orders", "--lmq", "bad|name", "--redis-url", url), 2)


# -- evict / seek / sweep -----------------------------------------------------------------------


def test_evict_fences_the_member_and_tells_it(broker: dict) -> None:
    url, c, h1 = broker["url"], broker["c"], broker["handles"]["c1"]
    res = ok_json("evict", "orders", "billing", "c1", "--yes", "--redis-url", url)
    assert res["returned"] == 3 and res["notice"]["by"] == "operator" and res["notice"]["handle"] == h1.split(".")[0]
    assert c["c1"].execute_command("PULL", h1, "COUNT", 5) == []  # fenced by its marker
    notices = [as_map(n) for n in c["c1"].execute_command("HEARTBEAT")]
    assert [(n["type"], n["by"], n["handle"]) for n in notices] == [("unsubscribe", "operator", h1)]
    m = ok_json("inspect", "member", "orders", "billing", "c1", "--redis-url", url)
    assert m["marker"] == "operator" and m["checkouts_total"] == 0
    # c2 gets c1's returned messages first
    got = deliveries(c["c2"].execute_command("PULL", broker["handles"]["c2"], "COUNT", 3))
    assert [(d["id"], d["deliveries"]) for d in got] == [("1", 2), ("2", 2), ("3", 2)]

    out = ok("evict", "chat", "default", "Y", "--lmq", "s-1", "--yes", "--redis-url", url).stdout
    assert "evicted Y from group default of chat[s-1]" in out
    line = one_line_error(invoke("evict", "orders", "billing", "zed", "--yes", "--redis-url", url), 1)
    assert "'zed' is not a member" in line
    one_line_error(invoke("evict", "nosuch", "g", "c", "--yes", "--redis-url", url), 1)


def test_seek_moves_the_group(broker: dict) -> None:
    url, c = broker["url"], broker["c"]
    res = ok_json("seek", "orders", "billing", "--earliest", "--yes", "--redis-url", url)
    assert (res["epoch"], res["cursor"], res["clamped"], res["before"]) == (1, 1, False, {"epoch": 0, "cursor": 4})
    # c1's checkouts were released: its tags settle nothing, and the group reads from 1 again
    assert c["c1"].execute_command("ACK", broker["handles"]["c1"], *broker["c1_tags"]) == 0
    res = ok_json("seek", "orders", "billing", "--id", "8", "--yes", "--redis-url", url)
    assert (res["epoch"], res["cursor"]) == (2, 8)
    got = deliveries(c["c2"].execute_command("PULL", broker["handles"]["c2"], "COUNT", 5))
    assert [d["id"] for d in got] == ["8", "9", "10"] and {d["epoch"] for d in got} == {2}
    out = ok("seek", "orders", "audit", "--latest", "--yes", "--redis-url", url).stdout
    assert "epoch 0 → 1, cursor 3 → 11" in out
    res = ok_json("seek", "orders", "audit", "--time", "0", "--yes", "--redis-url", url)
    assert res["cursor"] == 1

    one_line_error(invoke("seek", "orders", "billing", "--redis-url", url), 2)
    one_line_error(invoke("seek", "orders", "billing", "--earliest", "--latest", "--redis-url", url), 2)
    assert "no group 'nope'" in one_line_error(invoke("seek", "orders", "nope", "--earliest", "--yes", "--redis-url", url), 1)


def test_sweep_returns_expired_leases_and_notifies(redis_url: str) -> None:
    """No worker runs under prefix `sw`, so nothing sweeps but the command."""
    cfg = Config(redis_url=redis_url, prefix="sw")

    async def setup() -> None:
        r = redis.asyncio.Redis.from_url(redis_url)
        try:
            q = Core(r, cfg)
            await q.publishing.publish("jobs", [b"a", b"b", b"c"])
            sub = await q.subscriptions.subscribe("w1", "jobs", group="g", lock_ms=1)
            assert len((await q.leases.pull(Handle.decode(sub.handle), 2)).deliveries) == 2
            await q.publishing.publish("other", [b"x"])
            sub = await q.subscriptions.subscribe("w2", "other", group="g", lock_ms=1)
            assert len((await q.leases.pull(Handle.decode(sub.handle), 1)).deliveries) == 1
        finally:
            await r.aclose()

    run(setup())
    time.sleep(0.05)
    res = ok_json("sweep", "--queue", "t:jobs", "--redis-url", redis_url, "--prefix", "sw")
    (q,) = res["queues"]
    assert (q["qid"], q["returned"], q["next_due_ms"]) == ("t:jobs", 2, None)
    assert [(t["group"], t["member"], len(t["tags"])) for t in q["timeouts"]] == [("g", "w1", 2)]
    direct = redis.Redis.from_url(redis_url)
    try:
        assert direct.hexists("sw:{t:jobs}", meta.member_field("g", "w1", meta.SUSPECTED_SINCE))
        (notice,) = direct.lrange("sw:sess:{w1}:notices", 0, -1)
        assert b"message_timeout" in notice
        assert direct.zscore("sw:schedule", "t:jobs") is None
    finally:
        direct.close()
    out = ok("sweep", "--all-due", "--redis-url", redis_url, "--prefix", "sw").stdout
    assert "other" in out and "g/w2 (1)" in out and "1 queue(s) swept, 1 lease(s) returned." in out
    assert ok_json("sweep", "--all-due", "--redis-url", redis_url, "--prefix", "sw")["swept"] == 0
    one_line_error(invoke("sweep", "--redis-url", redis_url), 2)
    one_line_error(invoke("sweep", "--queue", "t:x", "--all-due", "--redis-url", redis_url), 2)
    assert "no queue 't:nope'" in one_line_error(invoke("sweep", "--queue", "t:nope", "--redis-url", redis_url), 1)
    one_line_error(invoke("sweep", "--queue", "orders", "--redis-url", redis_url), 2)


# -- purge -------------------------------------------------------------------------------------


def test_purge_empties_the_backlog_and_leaves_checkouts(broker: dict) -> None:
    url, c = broker["url"], broker["c"]
    line = one_line_error(invoke("purge", "orders", "--redis-url", url), 2)  # no terminal, no --yes
    assert "--yes" in line
    assert ok_json("inspect", "queue", "orders", "--redis-url", url)["backlog"] == 10  # untouched

    res = ok_json("purge", "orders", "--yes", "--redis-url", url)
    groups = {g["group"]: g for g in res["groups"]}
    assert (groups["billing"]["unread"], groups["billing"]["returned"], groups["billing"]["checkouts_left"]) == (
        7, 0, 3)
    assert (groups["audit"]["unread"], groups["audit"]["returned"], groups["audit"]["cursor"]) == (8, 2, 11)
    assert res["dropped"] == 17 and res["checkouts_left"] == 3
    q = ok_json("inspect", "queue", "orders", "--redis-url", url)
    assert q["backlog"] == 0 and q["ready"] == 0 and q["checkouts_total"] == 3
    assert all(g["epoch"] == 0 for g in q["groups"])  # no tag went stale
    journal = broker["direct"].lrange("fmq:{t:orders}:jr", -2, -1)
    assert [(e.event, e.group) for raw in journal for e in journal_events(raw)] == [("purge", "billing"), ("purge", "audit")]
    assert c["c2"].execute_command("PULL", broker["handles"]["c2"], "COUNT", 5) == []
    assert c["c1"].execute_command("ACK", broker["handles"]["c1"], *broker["c1_tags"]) == 3  # checkouts still settle

    # new messages flow again
    c["producer"].execute_command("PUB", "orders", "o11")
    assert [d["id"] for d in deliveries(c["c2"].execute_command("PULL", broker["handles"]["c2"]))] == ["11"]

    out = ok("purge", "chat", "--lmq", "s-1", "--yes", "--redis-url", url).stdout
    assert "Purged chat[s-1]" in out and "2 message(s) dropped from 1 group(s)" in out
    one_line_error(invoke("purge", "nosuch", "--yes", "--redis-url", url), 1)


def test_purge_asks_on_a_terminal(broker: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    import fencemq.cli.write_cmd as write_cmd

    monkeypatch.setattr(write_cmd, "_interactive", lambda: True)
    monkeypatch.setattr(write_cmd.typer, "confirm", lambda *a, **k: False)
    result = invoke("purge", "orders", "--redis-url", broker["url"])
    assert result.exit_code == 1
    assert "billing" in result.stderr and "audit" in result.stderr  # what would go, shown before asking
    assert result.stderr.strip().splitlines()[-1] == "fencemq purge: not purged"
    assert ok_json("inspect", "queue", "orders", "--redis-url", broker["url"])["backlog"] == 10
    monkeypatch.setattr(write_cmd.typer, "confirm", lambda *a, **k: True)
    ok("purge", "orders", "--redis-url", broker["url"])
    assert ok_json("inspect", "queue", "orders", "--redis-url", broker["url"])["backlog"] == 0


# -- dead letters ------------------------------------------------------------------------------


def test_dlq_list(broker: dict) -> None:
    res = ok_json("dlq", "list", "jobs", "--redis-url", broker["url"])
    assert res["total"] == 1
    (d,) = res["dead_letters"]
    assert (d["id"], d["group"], d["member"], d["failures"], d["acquisitions"], d["payload"], d["preview"]) == (
        1, "workers", "d1", 1, 1, "job-1", "job-1")
    assert d["published_ms"] <= d["dead_ms"] <= res["now_ms"]
    out = ok("dlq", "list", "jobs", "--redis-url", broker["url"]).stdout
    assert "Dead letters of jobs (1 of 1)" in out and "job-1" in out and "workers" in out
    out = ok("dlq", "list", "orders", "--redis-url", broker["url"]).stdout
    assert "No dead letters" in out
    one_line_error(invoke("dlq", "list", "nosuch", "--redis-url", broker["url"]), 1)


def test_dlq_replay_makes_the_message_pullable_again(broker: dict) -> None:
    url, c, hd = broker["url"], broker["c"], broker["handles"]["d1"]
    # job-2 first: the group's cursor is past job-1
    (job2,) = deliveries(c["d1"].execute_command("PULL", hd))
    assert job2["payload"] == "job-2"
    c["d1"].execute_command("ACK", hd, job2["tag"])
    assert c["d1"].execute_command("PULL", hd) == []

    res = ok_json("dlq", "replay", "jobs", "--yes", "--redis-url", url)
    assert res["replayed"] == [{"id": 1, "group": "workers", "member": "d1", "acquisitions": 1, "via": "ready"}]
    assert res["skipped"] == [] and res["dead_letters_left"] == 0
    (again,) = deliveries(c["d1"].execute_command("PULL", hd))
    assert (again["id"], again["payload"], again["deliveries"]) == ("1", "job-1", 2)
    # failures were reset: with max_failures=1 one NACK dead-letters it again
    c["d1"].execute_command("NACK", hd, again["tag"])
    assert broker["direct"].llen("fmq:{t:jobs}:dlq") == 1
    out = ok("dlq", "replay", "jobs", "--count", "5", "--yes", "--redis-url", url).stdout
    assert "1 replayed, 0 kept, 0 dead letter(s) left." in out
    journal = [e.event for raw in broker["direct"].lrange("fmq:{t:jobs}:jr", 0, -1) for e in journal_events(raw)]
    assert journal.count("replay") == 2
    line = one_line_error(invoke("dlq", "replay", "jobs", "--redis-url", url), 1)  # nothing left
    assert "nothing replayed" in line
    assert json.loads(invoke("dlq", "replay", "jobs", "--redis-url", url, "--json").stdout)["replayed"] == []


def test_dlq_replay_brings_back_dead_letters_whose_message_the_log_let_go(redis_url: str) -> None:
    cfg = Config(redis_url=redis_url, retention_maxlen=2, max_failures=1)

    async def setup() -> Handle:
        r = redis.asyncio.Redis.from_url(redis_url)
        try:
            q = Core(r, cfg)
            await q.publishing.publish("t", [b"one", b"two"])
            h = Handle.decode((await q.subscriptions.subscribe("w", "t", group="g")).handle)
            first, second = (await q.leases.pull(h, 2)).deliveries
            await q.leases.nack(h, [first.tag, second.tag])  # both dead: settled, so the log lets them go
            await q.publishing.publish("t", [b"three"])
            assert await r.hlen(q.keys.queue(QueueRef("t")).log) == 1  # only 3 is left
            return h
        finally:
            await r.aclose()

    h = run(setup())
    res = ok_json("dlq", "replay", "t", "--count", "5", "--yes", "--redis-url", redis_url)
    assert [(r["id"], r["via"]) for r in res["replayed"]] == [(1, "ready"), (2, "ready")]  # a dead letter carries it
    assert res["skipped"] == [] and res["dead_letters_left"] == 0

    async def consume() -> list[bytes]:
        r = redis.asyncio.Redis.from_url(redis_url)
        try:
            q = Core(r, cfg)
            got = (await q.leases.pull(h, 10)).deliveries
            await q.leases.ack(h, [d.tag for d in got])
            assert await r.hlen(q.keys.queue(QueueRef("t")).log) == 0  # settled again: gone again
            return [d.payload for d in got]
        finally:
            await r.aclose()

    assert run(consume()) == [b"one", b"two", b"three"]


# -- top ---------------------------------------------------------------------------------------


def test_top_two_iterations(broker: dict) -> None:
    url = broker["url"]
    out = ok("top", "--iterations", "2", "--interval", "0.1", "--redis-url", url).stdout
    for text in ("FenceMQ top", "orders", "chat[s-1]", "jobs", "pub/s", "Suspected and evicted members",
                 "suspected for", "evicted by Y"):
        assert text in out, f"{text!r} missing from:\n{out}"

    import threading

    stop, publishing = threading.Event(), threading.Event()

    def publish() -> None:
        p = client(broker["worker"].port, 2, "busy")
        try:
            while not stop.is_set():
                p.execute_command("MPUB", "orders", 10, *["x"] * 10)
                publishing.set()
                time.sleep(0.01)
        finally:
            p.close()

    t = threading.Thread(target=publish)
    t.start()
    assert publishing.wait(10), "the publisher never published"  # top's two samples see it publish
    try:
        result = ok("top", "--iterations", "2", "--interval", "0.3", "--redis-url", url, "--json")
    finally:
        stop.set()
        t.join()
    first, second = (json.loads(line) for line in result.stdout.strip().splitlines())
    assert first["interval_s"] is None and second["interval_s"] > 0.2
    assert second["workers_alive"] == 1 and second["sessions_alive"] >= 7
    rows = {q["name"]: q for q in second["queues"]}
    assert second["queues"][0]["name"] == "orders"  # the busiest first
    assert rows["orders"]["rates"]["publish"] > 0
    assert second["totals"]["publish"] >= rows["orders"]["rates"]["publish"] > 0, "the totals sum the rates"
    assert second["totals"]["deliver"] is not None
    assert {(s["group"], s["member"]) for s in second["suspected"]} >= {("audit", "c3"), ("default", "X")}


# -- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize("args", [
    ["queues"], ["lmqs"], ["inspect", "queue", "t"], ["inspect", "session", "c"], ["evict", "t", "g", "c", "--yes"],
    ["sweep", "--all-due"], ["seek", "t", "g", "--earliest", "--yes"], ["purge", "t", "--yes"], ["dlq", "list", "t"],
    ["dlq", "replay", "t", "--yes"], ["top", "--iterations", "1"],
])
def test_unreachable_redis_exits_2_with_one_line(args: list[str]) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    started = time.monotonic()
    result = invoke(*args, "--redis-url", url)
    assert time.monotonic() - started < 10
    line = one_line_error(result, 2)
    assert f"is Redis running at {url}?" in line and "--redis-url" in line and "FENCEMQ_REDIS_URL" in line
    assert result.stdout == ""


def test_url_from_the_environment_and_no_url(monkeypatch: pytest.MonkeyPatch, broker: dict) -> None:
    monkeypatch.setenv("FENCEMQ_REDIS_URL", broker["url"])
    assert len(ok_json("queues")["queues"]) == 4
    monkeypatch.delenv("FENCEMQ_REDIS_URL")
    line = one_line_error(invoke("queues"), 2)
    assert "no Redis URL" in line and "FENCEMQ_REDIS_URL" in line


def test_usage_errors_exit_2(broker: dict) -> None:
    url = broker["url"]
    assert "--kind" in one_line_error(invoke("queues", "--kind", "weird", "--redis-url", url), 2)
    assert "cursor" in one_line_error(invoke("queues", "--cursor", "abc", "--redis-url", url), 2)
    assert "Cluster" in one_line_error(invoke("queues", "--cursor", "h:1/5", "--redis-url", url), 2)
    assert "prefix" in one_line_error(invoke("queues", "--prefix", "a:b", "--redis-url", url), 2)
    assert invoke("queues", "--limit", "0", "--redis-url", url).exit_code == 2  # typer's own range check


def test_another_prefix_sees_nothing(broker: dict) -> None:
    assert ok_json("queues", "--redis-url", broker["url"], "--prefix", "other")["queues"] == []
    assert "No queues match." in ok("queues", "--redis-url", broker["url"], "--prefix", "other").stdout


# -- bench ---------------------------------------------------------------------------------------


def test_bench_passes_arguments_through() -> None:
    result = invoke("bench", "--", "--help")
    assert result.exit_code == 0, result.output
    assert "--messages" in result.stdout  # bench.run's own help
    result = invoke("bench", "--definitely-not-an-option")
    assert result.exit_code == 2 and "bench.run exited with 2" in result.stderr  # argparse's usage error


# -- Redis Cluster: every master ---------------------------------------------------------------




def test_cluster_listing_visits_every_master_and_pages_across_them(cluster: list[EmbeddedRedis]) -> None:
    from redis.asyncio import RedisCluster

    url = f"redis://127.0.0.1:{cluster[0].port}/0"

    async def setup() -> None:
        rc = RedisCluster.from_url(url)
        try:
            q = Core(rc, Config(redis_url=url, max_failures=1))
            for i in range(30):
                await q.publishing.publish("spread", [b"a"], lmq=f"lmq-{i}")
            await q.publishing.publish("plain", [b"p1", b"p2"])
            h = Handle.decode((await q.subscriptions.subscribe("w", "plain", group="g")).handle)
            (d, _) = (await q.leases.pull(h, 2)).deliveries
            await q.leases.nack(h, [d.tag])
        finally:
            await rc.aclose()

    run(setup())
    out = ok_json("queues", "--redis-url", url)  # Cluster detected from INFO cluster
    assert out["nodes"] == 3 and out["cursor"] is None and len(out["queues"]) == 31
    seen, cursor, pages = [], None, 0
    while True:
        page = ok_json("lmqs", "--topic", "spread", "--limit", "7", "--redis-url", url,
                       *(["--cursor", cursor] if cursor else []))
        pages += 1
        seen += [q["lmq"] for q in page["queues"]]
        cursor = page["cursor"]
        if cursor is None:
            break
        assert "/" in cursor  # <host:port>/<cursor>
    assert sorted(seen) == sorted(f"lmq-{i}" for i in range(30)) and len(seen) == 30 and pages >= 5
    assert ok_json("inspect", "queue", "plain", "--redis-url", url, "--cluster")["checkouts_total"] == 1
    assert ok_json("dlq", "list", "plain", "--redis-url", url)["total"] == 1
    assert ok_json("dlq", "replay", "plain", "--yes", "--redis-url", url)["replayed"][0]["id"] == 1
    assert ok_json("purge", "plain", "--yes", "--redis-url", url)["dropped"] == 1
    sample = json.loads(ok("top", "--iterations", "1", "--redis-url", url, "--json").stdout)
    assert sample["queues_seen"] == 31


def test_cluster_flag_against_a_single_server_exits_2(redis_url: str) -> None:
    line = one_line_error(invoke("queues", "--cluster", "--redis-url", redis_url), 2)
    assert "Cluster" in line
