"""The operator CLI and the broker's Redis memory (issue 27): writes refused on a Redis that may evict keys,
reads still answered, and ``fencemq status`` showing the alarms the workers raise."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import redis
from typer.testing import CliRunner

from fencemq.cli.main import app
from fencemq.server.embedded import EmbeddedRedis
from tests.helpers import client, wait_for, worker

WIDE = {"COLUMNS": "220"}


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as s:
        yield s


def run(*args: str):
    return CliRunner().invoke(app, list(args), env=WIDE)


@pytest.mark.parametrize("command", [
    ["seek", "orders", "g", "--earliest", "--yes"],
    ["purge", "orders", "--yes"],
    ["sweep", "--all-due"],
    ["user", "add", "ops", "--password-stdin"],
])
def test_a_write_is_refused_on_a_redis_that_may_evict_keys_and_says_what_to_set(server, command) -> None:
    r = redis.Redis.from_url(server.url)
    r.config_set("maxmemory-policy", "allkeys-lru")
    result = CliRunner().invoke(app, [*command, "--redis-url", server.url], env=WIDE, input="long enough secret\n")
    assert result.exit_code != 0
    assert "EVICTING" in result.stderr and "CONFIG SET maxmemory-policy noeviction" in result.stderr
    assert r.hlen("fmq:users") == 0  # nothing was written
    assert run("queues", "--redis-url", server.url).exit_code == 0  # reading is not refused


def test_status_shows_the_memory_and_the_alarms_the_workers_raised(server) -> None:
    r = redis.Redis.from_url(server.url)
    with worker(server.url, memory_sample_ms=50) as w:
        c = client(w.port, 2, "alice")
        c.execute_command("PUB", "orders", b"x")
        r.config_set("maxmemory-policy", "volatile-lru")
        wait_for(lambda: r.hlen("fmq:alarms"), what="the eviction alarm's record")
        snap = json.loads(run("status", "--json", "--redis-url", server.url).stdout)
        assert snap["redis"]["maxmemory_policy"] == "volatile-lru"
        [alarm] = snap["alarms"]
        assert alarm["alarm"] == "eviction" and "volatile-lru" in alarm["detail"] and alarm["since_ms"] > 0
        table = run("status", "--redis-url", server.url).stdout
        assert "Alarms" in table and "eviction" in table and "volatile-lru" in table
        r.config_set("maxmemory-policy", "noeviction")
        wait_for(lambda: not r.hlen("fmq:alarms"), what="the alarm cleared")
        assert json.loads(run("status", "--json", "--redis-url", server.url).stdout)["alarms"] == []
