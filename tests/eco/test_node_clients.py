"""Node's Redis clients against a worker, as their users write them: ioredis and node-redis.

Installed by the test itself (``npm ci`` in tests/eco/node from its
package-lock.json, into tests/eco/node/node_modules); skipped, with the
reason, where node or npm is absent. Each scenario of tests/eco/node/drive.mjs
prints what the clients saw, as JSON, for the test to judge.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import worker

NODE_DIR = Path(__file__).parent / "node"


@pytest.fixture(scope="module")
def node_clients() -> Path:
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are needed to drive ioredis and node-redis (apt-get install nodejs npm)")
    installed = NODE_DIR / "node_modules" / ".package-lock.json"
    lock = NODE_DIR / "package-lock.json"
    if not installed.exists() or installed.stat().st_mtime < lock.stat().st_mtime:
        done = subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=NODE_DIR,
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            pytest.fail(f"npm ci in {NODE_DIR} failed:\n{done.stderr[-2000:]}")
    return NODE_DIR


def drive(scenario: str, port: int) -> dict:
    done = subprocess.run(["node", str(NODE_DIR / "drive.mjs"), scenario, str(port)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, f"{scenario} failed ({done.returncode}): {done.stdout}{done.stderr}"
    return json.loads(done.stdout)


def test_ioredis_with_default_options_connects_publishes_and_runs_a_transaction(node_clients, redis_url):
    with worker(redis_url) as w:
        seen = drive("ioredisDefault", w.port)
    assert seen["status"] == "ready" and seen["info"].startswith("redis_version:")
    assert seen["id"] == "1"
    assert seen["txn"] == [[None, "2"], [None, "3"]]  # multi().exec(): each command's [error, reply]


def test_ioredis_connections_with_one_connection_name_share_the_session(node_clients, redis_url):
    with worker(redis_url) as w:
        seen = drive("ioredisPool", w.port)
    assert seen == {"acked": 1, "names": ["io-app", "io-app"], "payloads": ["j1"], "txnPayload": "j2"}


def test_node_redis_client_consumes_inside_multi_and_a_refused_command_aborts_the_whole_block(node_clients,
                                                                                              redis_url):
    with worker(redis_url) as w:
        seen = drive("nodeRedisClient", w.port)
    assert seen["loading"] and seen["payloads"] == ["n1", "n2"] and seen["acked"] == 2
    assert "NOSUCHVERB" in seen["discarded"] or "EXECABORT" in seen["discarded"]
    assert seen["rest"] == [], "the aborted transaction's PUB never ran"


def test_node_redis_client_pool_of_four_connections_acts_for_one_session(node_clients, redis_url):
    with worker(redis_url) as w:
        seen = drive("nodeRedisPool", w.port)
    assert seen["got"] == [[f"t{i}", 1] for i in range(1, 9)]
    assert seen["connections"] > 1, "the pool used one connection only"
