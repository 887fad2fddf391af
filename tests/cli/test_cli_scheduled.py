"""``fencemq scheduled list|cancel`` (issue 34): an operator sees what waits for its time and cancels it."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from fencemq.cli.main import app
from tests.helpers import client, worker

WIDE = {"COLUMNS": "220"}


def run(url: str, *args: str):
    return CliRunner().invoke(app, [*args, "--redis-url", url], env=WIDE)


def test_list_shows_the_scheduled_messages_and_cancel_removes_them(redis_url) -> None:
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        ids = [i.decode() for i in c.execute_command("MPUB", "later", 3, b"a", b"bb", b"ccc", "DELAY", 600_000)]
        listed = json.loads(run(redis_url, "scheduled", "list", "later", "--json").stdout)
        assert listed["scheduled"] == 3 and [m["id"] for m in listed["messages"]] == ids
        assert all(m["due_ms"] >= m["published_ms"] + 600_000 for m in listed["messages"])
        shown = run(redis_url, "scheduled", "list", "later")
        assert shown.exit_code == 0 and ids[0] in shown.stdout and "(3)" in shown.stdout
        queue = json.loads(run(redis_url, "inspect", "queue", "later", "--json").stdout)
        assert queue["scheduled"] == 3
        done = run(redis_url, "scheduled", "cancel", "later", ids[0], ids[1])
        assert done.exit_code == 0 and "2 of 2" in done.stdout, done.stdout + done.stderr
        again = run(redis_url, "scheduled", "cancel", "later", ids[0])
        assert again.exit_code != 0 and "0 of 1" in again.stdout
        assert run(redis_url, "scheduled", "cancel", "later", "42").exit_code == 2, "not a schedule id"
        assert json.loads(run(redis_url, "scheduled", "list", "later", "--json").stdout)["scheduled"] == 1
