"""The operator's hands: destructive commands ask first, a queue is named as the broker names it.

Run as a person would — ``fencemq`` on a pseudo-terminal where a question is
asked, without one where a script runs it — against a real worker and Redis.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from tests.helpers import Terminal, as_map, client, deliveries, worker

FENCEMQ = [sys.executable, "-m", "fencemq.cli.main"]


@pytest.fixture
def orders(redis_url: str):
    """A worker, a topic with one message, and alice holding it in group g."""
    with worker(redis_url) as w:
        alice = client(w.port, 2, "alice")
        alice.execute_command("PUB", "orders", "hello")
        h = as_map(alice.execute_command("SUB", "orders", "GROUP", "g"))["handle"]
        (d,) = deliveries(alice.execute_command("PULL", h))
        yield {"url": redis_url, "alice": alice, "handle": h, "tag": d["tag"]}


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*FENCEMQ, *args], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("command", [
    ["seek", "orders", "g", "--earliest"],
    ["evict", "orders", "g", "alice"],
])
def test_a_destructive_command_without_a_terminal_needs_yes_and_changes_nothing(orders, command):
    result = _run(*command, "--redis-url", orders["url"])
    assert result.returncode == 2
    assert "without --yes: no terminal to confirm on" in result.stderr
    # alice still holds her checkout: nothing was sought or evicted
    assert orders["alice"].execute_command("ACK", orders["handle"], orders["tag"]) == 1


def test_a_destructive_command_on_a_terminal_asks_and_a_no_changes_nothing(orders):
    with Terminal(*FENCEMQ, "seek", "orders", "g", "--earliest", "--redis-url", orders["url"]) as term:
        assert term.read_until(b"[y/N]"), term.seen
        assert b"Seek group g of orders to earliest" in term.seen
        term.type(b"n\r")
        assert term.exit_code() == 1
    assert orders["alice"].execute_command("ACK", orders["handle"], orders["tag"]) == 1


def test_a_destructive_command_on_a_terminal_answered_yes_does_it(orders):
    with Terminal(*FENCEMQ, "seek", "orders", "g", "--earliest", "--redis-url", orders["url"]) as term:
        assert term.read_until(b"[y/N]"), term.seen
        term.type(b"y\r")
        assert term.exit_code() == 0, term.seen
        assert "epoch 0 → 1".encode() in term.seen, term.seen
    assert orders["alice"].execute_command("ACK", orders["handle"], orders["tag"]) == 0, "the seek staled the tag"


def test_dlq_replay_asks_only_when_there_is_something_to_replay(orders):
    result = _run("dlq", "replay", "orders", "--redis-url", orders["url"])
    assert result.returncode == 1 and "nothing replayed (no dead letters)" in result.stderr


def test_a_shared_groups_queue_is_inspected_by_the_name_it_was_subscribed_with(redis_url):
    with worker(redis_url) as w:
        member = client(w.port, 2, "m1")
        member.execute_command("SUB", "$share/g/sensors/+")
        member.execute_command("PUB", "sensors/a", "x")
        result = _run("inspect", "queue", "$share/g/sensors/+", "--json", "--redis-url", redis_url)
        assert result.returncode == 0, result.stderr
        assert '"group": "g"' in result.stdout
        bare = _run("inspect", "queue", "sensors/+", "--redis-url", redis_url)
        assert bare.returncode == 2
        assert "--owner <client id>" in bare.stderr and "'$share/<group>/sensors/+'" in bare.stderr
        colon = _run("inspect", "queue", "$share:g:sensors/+", "--redis-url", redis_url)
        assert colon.returncode == 2 and "$share/g/sensors/+" in colon.stderr


ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")


def test_top_fits_an_80_by_24_terminal_without_cutting_a_header(redis_url):
    with worker(redis_url, default_lock_ms=100) as w:
        c = client(w.port, 2, "busy")
        for i in range(30):
            c.execute_command("PUB", f"topic-{i:02d}", "x")
        slow = client(w.port, 2, "slow")
        h = as_map(slow.execute_command("SUB", "topic-00", "GROUP", "g", "LOCK", 100))["handle"]
        slow.execute_command("PULL", h)  # and never settles: suspected once the lease runs out
        time.sleep(0.5)
        with Terminal(*FENCEMQ, "top", "--iterations", "1", "--redis-url", redis_url, columns=80, rows=24) as term:
            assert term.exit_code(20) == 0, term.seen
    frame = ANSI.sub(b"", term.seen).decode().replace("\r", "")
    frame = frame[frame.rindex("FenceMQ top"):].rstrip("\n").splitlines()
    assert len(frame) < 24, "\n".join(frame)
    assert all(len(line) <= 80 for line in frame), "\n".join(frame)
    head = frame[:2]
    for part in ("FenceMQ top", f"redis {redis_url}", "prefix fmq", "workers 1", "queues 30", "publish/s", "deliver/s"):
        assert any(part in line for line in head), f"{part!r} broken or missing in the header:\n" + "\n".join(head)
    headers = "\n".join(frame[:6])
    for header in ("queue", "backlog", "checked", "pub/s", "consumers"):
        assert re.search(rf"\b{re.escape(header)}(\s|$)", headers), f"{header!r} cut in:\n{headers}"
    assert "…" not in headers
    assert "more queue(s)" in " ".join(frame[-2:]), "the queues that do not fit are counted, not scrolled away"


def test_wide_terminals_show_every_column_of_the_queue_listing(orders):
    with Terminal(*FENCEMQ, "queues", "--redis-url", orders["url"], columns=160) as term:
        assert term.exit_code(20) == 0
    listing = ANSI.sub(b"", term.seen).decode()
    for header in ("kind", "last", "backlog", "checked", "ready", "delayed", "dead", "groups", "members", "owner",
                   "suspects", "idle"):
        assert header in listing, header
    with Terminal(*FENCEMQ, "queues", "--redis-url", orders["url"], columns=80) as term:
        assert term.exit_code(20) == 0
    narrow = ANSI.sub(b"", term.seen).decode()
    assert "backlog" in narrow and "…" not in narrow.split("────")[0], narrow
