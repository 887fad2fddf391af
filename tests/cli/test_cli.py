"""The operator CLI: status (JSON and tables) against a real worker and Redis, the
demo end to end, serve's start-up and SIGTERM drain, and the errors an operator
sees when Redis is not where the CLI looks."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from typer.testing import CliRunner

from fencemq.config import Config
from fencemq.model import meta
from fencemq.server.embedded import free_port
from fencemq.server.runner import WorkerThread, event_loop
from fencemq.cli.main import app

ROOT = Path(__file__).resolve().parents[2]


def invoke(*args: str, **env: str):
    return CliRunner().invoke(app, list(args), env=env or None)


def client(port: int, name: str) -> redis.Redis:
    """One connection = one client id = one session, as a worker expects."""
    c = redis.Redis(port=port, protocol=3, single_connection_client=True, socket_timeout=10)
    c.execute_command("HELLO", 3, "SETNAME", name)
    return c


def m(reply) -> dict:
    return {k.decode(): (v.decode() if isinstance(v, bytes) else v) for k, v in reply.items()}


@pytest.fixture
def worker(redis_url: str) -> Iterator[WorkerThread]:
    with WorkerThread(Config(redis_url=redis_url, port=0)) as w:
        yield w


@pytest.fixture
def broker_state(redis_url: str, worker: WorkerThread) -> Iterator[dict]:
    """orders: 10 messages; group billing (c1 holds 3, c2 idle); group audit whose only
    member c3 let its leases expire (suspected, 2 returned). chat[s-1]: X preempted by Y."""
    port = worker.port
    clients = {name: client(port, name) for name in ("producer", "c1", "c2", "c3", "X", "Y")}
    c = clients
    c["producer"].execute_command("MPUB", "orders", 10, *[f"o{i}" for i in range(1, 11)])
    h1 = m(c["c1"].execute_command("SUB", "orders", "GROUP", "billing", "LOCK", 60_000))["handle"]
    c["c2"].execute_command("SUB", "orders", "GROUP", "billing")
    assert len(c["c1"].execute_command("PULL", h1, "COUNT", 3)) == 3
    h3 = m(c["c3"].execute_command("SUB", "orders", "GROUP", "audit", "LOCK", 100))["handle"]
    assert len(c["c3"].execute_command("PULL", h3, "COUNT", 2)) == 2

    m(c["X"].execute_command("SUB", "chat", "LMQ", "s-1"))
    c["producer"].execute_command("PUB", "chat", "hi", "LMQ", "s-1")
    last_chat_id = int(c["producer"].execute_command("PUB", "chat", "there", "LMQ", "s-1"))
    assert m(c["Y"].execute_command("SUB", "chat", "LMQ", "s-1"))["owner"] == "Y"

    direct = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + 5
    while not direct.hexists("fmq:{t:orders}", meta.member_field("audit", "c3", meta.SUSPECTED_SINCE)):  # the sweeper's doing
        assert time.monotonic() < deadline, "c3's 100 ms leases were not swept within 5 s"
        time.sleep(0.05)
    try:
        yield {"worker_id": worker.worker.id, "last_chat_id": last_chat_id}
    finally:
        for conn in clients.values():
            try:
                conn.execute_command("QUIT")
            except redis.RedisError:
                pass
            conn.close()
        direct.close()


def test_status_json_reports_workers_sessions_and_queues(redis_url: str, broker_state: dict) -> None:
    result = invoke("status", "--redis-url", redis_url, "--json")
    assert result.exit_code == 0, result.output
    snap = json.loads(result.stdout)
    assert {"workers", "sessions", "queues"} <= set(snap)

    workers = {w["id"]: w for w in snap["workers"]}
    assert workers[broker_state["worker_id"]]["alive"] is True
    assert {"producer", "c1", "c2", "c3", "X", "Y"} <= {s["client"] for s in snap["sessions"]}
    assert all(s["alive"] for s in snap["sessions"])

    queues = {q["name"]: q for q in snap["queues"]}
    assert set(queues) == {"orders", "chat[s-1]"}

    orders = queues["orders"]
    assert (orders["topic"], orders["lmq"], orders["last_id"], orders["first_id"]) == ("orders", None, 10, 1)
    assert orders["checkouts"] == 3  # c1's; c3's expired and went back
    assert 50 < orders["oldest_deadline_in_s"] <= 60
    assert orders["returned"] == 2
    groups = {g["name"]: g for g in orders["groups"]}
    billing = groups["billing"]
    assert (billing["mode"], billing["owner"], billing["epoch"]) == ("shared", None, 0)
    assert (billing["unread"], billing["returned"], billing["backlog"], billing["checkouts"]) == (7, 0, 7, 3)
    assert [(mb["id"], mb["pending"], mb["suspected"]) for mb in billing["members"]] == [
        ("c1", 3, False), ("c2", 0, False)]
    audit = groups["audit"]
    assert (audit["unread"], audit["returned"], audit["backlog"], audit["checkouts"]) == (8, 2, 10, 0)
    assert audit["suspected"] == ["c3"] and audit["evicted"] == []
    assert orders["backlog"] == 10  # the laggiest group's

    chat = queues["chat[s-1]"]
    assert (chat["topic"], chat["lmq"], chat["last_id"], chat["checkouts"]) == ("chat", "s-1", broker_state["last_chat_id"], 0)
    (default,) = chat["groups"]
    assert (default["mode"], default["owner"], default["backlog"]) == ("exclusive", "Y", 2)
    assert default["evicted"] == ["X"] and default["suspected"] == []
    assert {mb["id"]: mb["evicted_by"] for mb in default["members"]} == {"X": "Y", "Y": None}


def test_status_tables_name_the_queues(redis_url: str, broker_state: dict) -> None:
    result = invoke("status", "--redis-url", redis_url, COLUMNS="200")  # wide: no cell wraps
    assert result.exit_code == 0, result.output
    out = result.stdout
    for text in ("Workers", broker_state["worker_id"], "Queues", "orders", "chat[s-1]", "billing", "audit",
                 "exclusive", "(suspected)", "(evicted by Y)"):
        assert text in out, f"{text!r} missing from:\n{out}"


def test_status_of_an_empty_broker(redis_url: str) -> None:
    result = invoke("status", "--redis-url", redis_url, "--json")
    assert result.exit_code == 0, result.output
    assert {k: json.loads(result.stdout)[k] for k in ("workers", "sessions", "queues")} == {
        "workers": [], "sessions": [], "queues": []}
    result = invoke("status", "--redis-url", redis_url)
    assert result.exit_code == 0 and "No queues." in result.stdout


def test_status_with_unreachable_redis_exits_2_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    started = time.monotonic()
    result = invoke("status", "--redis-url", url)
    assert time.monotonic() - started < 10
    assert result.exit_code == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"is Redis running at {url}?" in lines[0]
    assert "--redis-url" in lines[0] and "FENCEMQ_REDIS_URL" in lines[0]

    monkeypatch.setenv("FENCEMQ_REDIS_URL", url)  # the environment is honoured the same way
    result = invoke("status", "--json")
    assert result.exit_code == 2 and url in result.stderr


def test_status_without_any_url_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FENCEMQ_REDIS_URL", raising=False)
    result = invoke("status")
    assert result.exit_code == 2
    assert "no Redis URL" in result.stderr and "--redis-url" in result.stderr
    assert "FENCEMQ_REDIS_URL" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_status_hides_the_password_of_the_url() -> None:
    url = f"redis://:s3cret@127.0.0.1:{free_port()}/0"
    result = invoke("status", "--redis-url", url)
    assert result.exit_code == 2
    assert "s3cret" not in result.stderr and "***" in result.stderr


def test_demo_runs_to_completion(redis_url: str) -> None:
    started = time.monotonic()
    result = invoke("demo", "--redis-url", redis_url)
    assert result.exit_code == 0, result.output
    assert time.monotonic() - started < 15
    out = result.stdout
    assert "MPUB orders 20" in out
    assert "was redelivered to bob with delivery count 2" in out
    assert "message_timeout" in out
    assert "A is preempted" in out and "fenced by its eviction marker" in out
    assert "unsubscribe chat[session-42] reason=preempted by=B" in out
    assert "checks passed" in out and "FAILED" not in out
    assert "Summary" in out
    # The worker is stopped and every demo session ended (QUIT), nothing lingers.
    assert not [t for t in threading.enumerate() if t.name == "fencemq-worker" and t.is_alive()]
    direct = redis.Redis.from_url(redis_url)
    try:
        assert direct.zcard("fmq:sessions") == 0
        assert direct.hget("fmq:{l:chat:session-42}", meta.group_field("default", meta.OWNER)) is None
    finally:
        direct.close()


def test_demo_with_unreachable_redis_exits_2() -> None:
    result = invoke("demo", "--redis-url", f"redis://127.0.0.1:{free_port()}/0")
    assert result.exit_code == 2 and "is Redis running at" in result.stderr


def test_serve_help_lists_the_options() -> None:
    result = invoke("serve", "--help")
    assert result.exit_code == 0, result.output
    for option in ("--host", "--port", "--redis-url", "--metrics-port", "--prefix", "--password", "--tls-cert",
                   "--tls-key", "--tls-ca"):
        assert option in result.stdout
    assert invoke("--version").stdout.startswith("fencemq ")


def test_serve_with_unreachable_redis_exits_2() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    result = invoke("serve", "--redis-url", url, "--port", "0")
    assert result.exit_code == 2
    assert f"is Redis running at {url}?" in result.stderr


def test_serve_on_a_busy_port_names_the_port_and_how_to_choose_another(redis_url: str) -> None:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = invoke("serve", "--redis-url", redis_url, "--port", str(port))
    assert result.exit_code == 1
    assert f"port {port} on 127.0.0.1 is already in use" in result.stderr and "--port" in result.stderr


def _read_until(proc: subprocess.Popen, needle: str, timeout: float) -> str:
    seen = ""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while needle not in seen:
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None and not sel.select(0):
            raise AssertionError(f"no {needle!r} from serve; got:\n{seen}\n{proc.stderr.read() if proc.poll() is not None else ''}")
        if sel.select(left):
            line = proc.stdout.readline()
            seen += line
    return seen


def test_serve_listens_then_drains_on_sigterm(redis_url: str) -> None:
    metrics_port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("FENCEMQ_REDIS_URL", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "serve", "--port", "0", "--redis-url", redis_url,
         "--metrics-port", str(metrics_port), "--prefix", "clitest"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        out = _read_until(proc, "listening on", 30)
        line = next(ln for ln in out.splitlines() if "listening on" in ln)
        assert line.startswith("fencemq worker ") and f"(redis: {redis_url})" in line
        assert line.endswith(f"event loop: {event_loop()[0]}")  # uvloop when installed
        port = int(line.split("listening on 127.0.0.1:")[1].split()[0])
        c = redis.Redis(port=port, protocol=3, socket_timeout=5)
        assert c.ping() is True
        assert c.execute_command("PUB", "t", "x") == b"1"
        c.close()
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as resp:
            assert b"fencemq_published_total" in resp.read()
        direct = redis.Redis.from_url(redis_url)
        assert direct.exists("clitest:{t:t}") and direct.zcard("clitest:workers") == 1
        direct.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
