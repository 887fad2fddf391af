"""The operator commands take every Redis URL a worker takes: a primary behind Sentinel too."""

from __future__ import annotations

import json
import sys
import subprocess

import pytest
import redis

from fencemq.server.embedded import EmbeddedRedis, EmbeddedSentinel

FENCEMQ = [sys.executable, "-m", "fencemq.cli.main"]

pytestmark = pytest.mark.standalone


def fencemq(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*FENCEMQ, *args], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


@pytest.mark.long  # `make test-long` (.ci/run) runs it, to keep make test short
def test_operator_commands_reach_the_primary_a_sentinel_names() -> None:
    with EmbeddedRedis() as primary, EmbeddedSentinel(primary.port, quorum=1) as sentinel:
        r = redis.Redis.from_url(primary.url)
        r.hset("fmq:{t:orders}", mapping={"seq": 3, "first": 1})
        r.close()
        url = f"redis+sentinel://127.0.0.1:{sentinel.port}/mymaster"
        status = fencemq("status", "--json", "--redis-url", url)
        assert status.returncode == 0, status.stderr
        assert [q["name"] for q in json.loads(status.stdout)["queues"]] == ["orders"]
        queues = fencemq("queues", "--json", "--redis-url", url)
        assert queues.returncode == 0 and '"orders"' in queues.stdout, queues.stderr
        unknown = fencemq("status", "--redis-url", f"redis+sentinel://127.0.0.1:{sentinel.port}/nosuchservice")
        assert unknown.returncode == 2 and "nosuchservice" in unknown.stderr, unknown.stderr
        malformed = fencemq("queues", "--redis-url", "redis+sentinel://127.0.0.1:1")
        assert malformed.returncode == 2 and "service" in malformed.stderr, malformed.stderr
