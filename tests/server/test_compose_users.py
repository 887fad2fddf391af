"""docker-compose.yml runs the broker with real users: its `users` step makes them, its workers ask for them."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import RespConn, worker

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_every_worker_admits_only_users_and_no_legacy_password() -> None:
    workers = {name: s for name, s in COMPOSE["services"].items() if "fencemq serve" in str(s.get("command", ""))}
    assert workers
    for name, service in workers.items():
        assert "--users" in service["command"] and "--password" not in service["command"], name
        assert "FENCEMQ_PASSWORD" not in str(service.get("environment", "")), name
        assert service["depends_on"]["users"]["condition"] == "service_completed_successfully", name


@pytest.mark.long  # `make test-long` (.ci/run) runs it, to keep make test short
def test_the_users_step_makes_users_a_worker_then_admits_and_can_run_again(redis_url) -> None:
    users = COMPOSE["services"]["users"]
    entrypoint = [part.replace("$$", "$") for part in users["entrypoint"]]
    command = shlex.split(users["command"].replace("redis://redis:6379/0", redis_url))
    env = dict(os.environ, FENCEMQ_REDIS_URL=redis_url, APP_PASSWORD="app secret 1", OPS_PASSWORD="ops secret 1",
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    for _ in range(2):  # a restart of the stack runs it again over the existing users
        done = subprocess.run([*entrypoint, *command], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "app" in done.stdout and "ops" in done.stdout, "the command (user list) ran after the entrypoint"
    with worker(redis_url, users=True) as w, RespConn(w.port) as app, RespConn(w.port) as ops:
        assert app.call("PUB", "orders", "x").code == "NOAUTH"
        assert app.call("AUTH", "app", "app secret 1") == "OK"
        assert app.call("PUB", "orders", "x") == "1"
        assert ops.call("AUTH", "ops", "ops secret 1") == "OK"
        assert ops.call("PUB", "orders", "x").code == "NOPERM"
