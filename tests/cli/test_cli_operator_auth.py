"""Operator commands act as a FenceMQ user, with that user's permissions, once the broker has an administrator."""

from __future__ import annotations

import pytest
import redis
from typer.testing import CliRunner

from fencemq.model.keys import Keyspace, QueueRef
from tests.cli.test_cli_ops import invoke

pytestmark = pytest.mark.standalone


@pytest.fixture
def url(redis_url: str) -> list[str]:
    r = redis.Redis.from_url(redis_url)
    for topic in ("orders/eu", "payments"):
        r.hset(Keyspace().queue(QueueRef(topic)).meta, mapping={"seq": 0, "first": 1, "groups": ""})
    r.close()
    return ["--redis-url", redis_url]


def as_user(monkeypatch: pytest.MonkeyPatch, name: str, password: str) -> None:
    monkeypatch.setenv("FENCEMQ_USER", name)
    monkeypatch.setenv("FENCEMQ_USER_PASSWORD", password)


def test_before_an_administrator_exists_redis_credentials_are_the_only_gate(url: list[str]) -> None:
    assert invoke("user", "add", "app", "--password-stdin", "--grant", "publish:orders/#", *url,
                  input="app password\n").exit_code == 0
    assert invoke("inspect", "queue", "payments", *url).exit_code == 0  # app users make no operators
    assert invoke("user", "add", "root", "--password-stdin", "--grant", "all:#", *url,
                  input="root password\n").exit_code == 0  # the first administrator


def test_once_an_administrator_exists_each_command_needs_its_permission_on_its_topic(
        url: list[str], monkeypatch: pytest.MonkeyPatch, redis_url: str) -> None:
    invoke("user", "add", "root", "--password-stdin", "--grant", "all:#", *url, input="root password\n")
    as_user(monkeypatch, "root", "root password")
    assert invoke("user", "add", "alice", "--password-stdin", "--grant", "inspect:orders/#", "--grant",
                  "evict:orders/#", *url, input="alice password\n").exit_code == 0

    monkeypatch.delenv("FENCEMQ_USER")
    anonymous = invoke("queues", *url)
    assert anonymous.exit_code == 4 and "FENCEMQ_USER" in anonymous.output

    as_user(monkeypatch, "alice", "not her password")
    assert invoke("queues", "--topic", "orders/eu", *url).exit_code == 4

    as_user(monkeypatch, "alice", "alice password")
    assert invoke("inspect", "queue", "orders/eu", *url).exit_code == 0
    refused = invoke("inspect", "queue", "payments", *url)
    assert refused.exit_code == 4 and "no permission to inspect on 'payments'" in refused.output
    assert invoke("queues", *url).exit_code == 4  # every topic: inspect on '#' is needed
    assert invoke("queues", "--topic", "orders/eu", *url).exit_code == 0
    purge = invoke("purge", "orders/eu", "--yes", *url)
    assert purge.exit_code == 4 and "purge" in purge.output
    r = redis.Redis.from_url(redis_url)
    assert r.exists(Keyspace().queue(QueueRef("orders/eu")).meta)  # refused: nothing changed
    r.close()
    assert invoke("user", "add", "mallory", "--password-stdin", *url, input="mallory password\n").exit_code == 4
    assert "mallory" not in invoke("user", "list", "--json", *url).stdout  # (alice may not even list)

    as_user(monkeypatch, "root", "root password")
    assert '"alice"' in invoke("user", "list", "--json", *url).stdout
    assert invoke("inspect", "queue", "payments", *url).exit_code == 0


# Every command that reads the broker's state through the operator layer, with the arguments it needs.
READS = {
    "status": [], "queues": [], "lmqs": [], "top": ["--iterations", "1"], "snapshot": ["--out", "{tmp}/snap"],
    "inspect queue": ["payments"], "inspect group": ["payments", "g"], "inspect member": ["payments", "g", "m"],
    "inspect session": ["alice"], "dlq list": ["payments"], "user list": [], "retention list": [],
    "scheduled list": ["payments"], "priority show": ["payments"],
}
WRITES = {"evict", "sweep", "seek", "purge", "dlq replay", "user add", "user passwd", "user del", "user grant",
          "user revoke", "retention set", "retention clear", "scheduled cancel",
          "priority set"}
NOT_THE_OPERATOR_LAYER = {"serve", "demo", "dashboard"}  # a worker, a tour, the UI (its own login)


def _commands(command, path=()):
    subs = getattr(command, "commands", None)
    if subs:
        for name, sub in subs.items():
            yield from _commands(sub, (*path, name))
    else:
        yield " ".join(path), {o for p in command.params for o in p.opts}


def test_every_command_that_talks_to_redis_is_a_read_a_write_or_not_the_operator_layer() -> None:
    import typer.main

    from fencemq.cli.main import app

    talking = {name for name, opts in _commands(typer.main.get_command(app)) if "--redis-url" in opts}
    assert talking == set(READS) | WRITES | NOT_THE_OPERATOR_LAYER


@pytest.mark.parametrize("command", READS)
def test_every_read_command_is_gated_alike_once_an_administrator_exists(
        command: str, url: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    invoke("user", "add", "root", "--password-stdin", "--grant", "all:#", *url, input="root password\n")
    from fencemq.cli.main import app

    def fencemq(*args: str):
        return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})

    args = [*command.split(), *(a.format(tmp=tmp_path) for a in READS[command]), *url]
    anonymous = fencemq(*args)
    assert anonymous.exit_code == 4 and "FENCEMQ_USER" in anonymous.output, anonymous.output
    as_user(monkeypatch, "root", "a wrong password")
    assert fencemq(*args).exit_code == 4
    as_user(monkeypatch, "root", "root password")
    allowed = fencemq(*args)
    assert allowed.exit_code in (0, 1), allowed.output  # 1: no such group, member or session (it was let in)


# A reading command an inspect grant lets in, and its writing twin that needs more: (read, write, permission,
# the exit code of the write once let in: 1 when it found nothing to act on).
READ_THEN_WRITE = {
    "scheduled": (["scheduled", "list", "payments"], ["scheduled", "cancel", "payments", "s1"], "purge", 1),
    "priority": (["priority", "show", "jobs"], ["priority", "set", "jobs", "on"], "admin", 0),
}


@pytest.mark.parametrize("family", READ_THEN_WRITE)
def test_an_inspect_grant_reads_scheduled_messages_and_priority_levels_but_changing_them_needs_more(
        family: str, url: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    read, write, permission, let_in = READ_THEN_WRITE[family]
    invoke("user", "add", "root", "--password-stdin", "--grant", "all:#", *url, input="root password\n")
    as_user(monkeypatch, "root", "root password")
    assert invoke("user", "add", "viewer", "--password-stdin", "--grant", "inspect:#", *url,
                  input="viewer password\n").exit_code == 0
    as_user(monkeypatch, "viewer", "viewer password")
    assert invoke(*read, *url).exit_code == 0
    refused = invoke(*write, *url)
    assert refused.exit_code == 4 and permission in refused.output, refused.output
    as_user(monkeypatch, "root", "root password")
    assert invoke(*write, *url).exit_code == let_in
