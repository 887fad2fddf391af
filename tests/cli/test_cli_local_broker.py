"""After `fencemq serve` (no Redis URL: a private Redis), the operator commands on the same machine
find that Redis without anything copied, say which broker they talk to, and stop finding it when
serve stops, however it stops."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from tests.helpers import fencemq_serve, free_port

FENCEMQ = [sys.executable, "-m", "fencemq.cli.main"]


def _env(runtime: Path) -> dict[str, str]:
    env = {**os.environ, "FENCEMQ_RUNTIME_DIR": str(runtime), "PYTHONUNBUFFERED": "1"}
    for name in ("FENCEMQ_REDIS_URL", "FENCEMQ_PREFIX", "FENCEMQ_USER", "FENCEMQ_USER_PASSWORD"):
        env.pop(name, None)
    return env


@contextmanager
def serving(runtime: Path, *args: str) -> Iterator[tuple[subprocess.Popen, int, str]]:
    """`fencemq serve` without a Redis URL: (process, worker port, its 'listening' line)."""
    port = free_port()
    with fencemq_serve("--port", str(port), *args, env=_env(runtime)) as (proc, line):
        yield proc, port, line


def fencemq(runtime: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*FENCEMQ, *args], env=_env(runtime), capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


def test_operator_commands_find_the_private_redis_of_serve_and_say_which_broker_it_is(
        tmp_path: Path, redis_url: str) -> None:
    with serving(tmp_path, "--prefix", "mine") as (proc, port, line):
        assert "recorded in" in line, line
        r = redis.Redis(port=port, protocol=3)
        r.execute_command("HELLO", 3, "SETNAME", "alice")
        r.execute_command("PUB", "orders", "hello")
        for command in (["status", "--json"], ["queues", "--json"], ["inspect", "queue", "orders", "--json"]):
            result = fencemq(tmp_path, *command)
            assert result.returncode == 0, f"{command}: {result.stderr}"
            assert '"orders"' in result.stdout or '"topic": "orders"' in result.stdout, result.stdout
            said = result.stderr.strip()
            assert f"pid {proc.pid}" in said and f"worker 127.0.0.1:{port}" in said and "prefix mine" in said, said
        assert "alice" in fencemq(tmp_path, "status").stdout
        r.close()
        given = fencemq(tmp_path, "queues", "--json", "--redis-url", redis_url)  # a URL given wins
        assert given.returncode == 0 and '"orders"' not in given.stdout and "the broker of" not in given.stderr
    gone = fencemq(tmp_path, "status")
    assert gone.returncode == 2 and "no Redis URL" in gone.stderr, gone.stderr
    assert not list(tmp_path.glob("serve-*.json")), "serve left its record behind"


def test_the_record_is_its_users_alone_the_private_redis_wants_its_password_and_a_killed_serves_record_goes(tmp_path: Path) -> None:
    runtime = tmp_path / "run"
    with serving(runtime) as (proc, _port, _line):
        (record,) = runtime.glob("serve-*.json")
        assert stat.S_IMODE(runtime.stat().st_mode) == 0o700
        assert stat.S_IMODE(record.stat().st_mode) == 0o600
        url = json.loads(record.read_text())["redis_url"]
        password = redis.connection.parse_url(url)["password"]
        assert password and len(password) >= 20
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=redis.connection.parse_url(url)["port"]).ping()  # NOAUTH without it
        assert redis.Redis.from_url(url).ping()
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        assert password not in ps, "the private Redis's password is on a command line"
        proc.kill()  # kill -9: no clean-up of its own; the next reader sees its process is gone
        proc.wait()
        assert record.exists()
        result = fencemq(runtime, "queues")
    assert result.returncode == 2 and "no Redis URL" in result.stderr, result.stderr
    assert not record.exists()


def test_with_two_local_brokers_the_command_names_both_and_asks_which(tmp_path: Path) -> None:
    with serving(tmp_path) as (first, _p1, _l1), serving(tmp_path) as (second, _p2, _l2):
        result = fencemq(tmp_path, "status")
        assert result.returncode == 2, result.stderr
        assert f"pid {first.pid}" in result.stderr and f"pid {second.pid}" in result.stderr
        assert "--redis-url" in result.stderr
        given = fencemq(tmp_path, "status", "--redis-url", json.loads(
            next(tmp_path.glob(f"serve-{first.pid}.json")).read_text())["redis_url"])
        assert given.returncode == 0 and "the broker of" not in given.stderr, given.stderr


def test_a_runtime_directory_others_may_enter_is_not_used(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with serving(shared) as (_proc, _port, line):
        assert "no private directory" in line and "--redis-url redis://:" in line, line
        assert not list(shared.glob("serve-*.json"))
        planted = shared / "serve-1.json"
        planted.write_text(json.dumps({"pid": os.getpid(), "redis_url": "redis://127.0.0.1:1/0"}))
        result = fencemq(shared, "status")
    assert result.returncode == 2 and "no Redis URL" in result.stderr, result.stderr

