"""``fencemq retention list|set|clear`` (issue 27): an operator chooses what a topic keeps, and sees it."""

from __future__ import annotations

import json

import redis
from typer.testing import CliRunner

from fencemq.cli.main import app
from tests.helpers import client, worker

WIDE = {"COLUMNS": "220"}


def run(url: str, *args: str, stdin: str | None = None):
    return CliRunner().invoke(app, [*args, "--redis-url", url], env=WIDE, input=stdin)


def test_set_list_inspect_and_clear_a_topics_retention_policy(redis_url) -> None:
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        c.execute_command("PUB", "orders", b"x")
        done = run(redis_url, "retention", "set", "orders", "--count", "1000", "--age", "2h", "--bytes", "100MiB")
        assert done.exit_code == 0, done.stdout + done.stderr
        assert "orders keeps 1,000 messages, 2h, 100.0 MiB per queue" in done.stdout
        listed = json.loads(run(redis_url, "retention", "list", "--json").stdout)
        assert listed == {"orders": {"count": 1000, "age_ms": 7_200_000, "bytes": 100 << 20}}
        assert "1,000" in run(redis_url, "retention", "list").stdout
        shown = run(redis_url, "inspect", "queue", "orders")
        assert "retention" in shown.stdout and "1,000 messages, 2h" in shown.stdout
        queue = json.loads(run(redis_url, "inspect", "queue", "orders", "--json").stdout)
        assert queue["retention"] == {"count": 1000, "age_ms": 7_200_000, "bytes": 100 << 20}
        cleared = run(redis_url, "retention", "clear", "orders", "--yes")
        assert cleared.exit_code == 0 and "keeps only what some group has yet to settle" in cleared.stdout
        assert json.loads(run(redis_url, "retention", "list", "--json").stdout) == {}
        assert run(redis_url, "retention", "clear", "orders", "--yes").exit_code == 1  # nothing to clear


def test_a_bad_policy_is_refused_and_changes_nothing(redis_url) -> None:
    for args in (["--age", "10x"], ["--bytes", "lots"], [], ["--count", "0"]):
        refused = run(redis_url, "retention", "set", "orders", *args)
        assert refused.exit_code == 2, (args, refused.stdout, refused.stderr)
    assert redis.Redis.from_url(redis_url).hlen("fmq:retention") == 0
