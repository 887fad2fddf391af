"""A worker's start waits for its Redis, saying so: down, refusing writes (NOREPLICAS), then serving."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from fencemq.config import Config
from fencemq.server.embedded import EmbeddedRedis, free_port
from fencemq.server.runner import WorkerThread
from tests.helpers import RespConn, wait_for

pytestmark = pytest.mark.standalone


def start_in_background(config: Config) -> tuple[WorkerThread, threading.Thread, list[BaseException]]:
    w = WorkerThread(config)
    failed: list[BaseException] = []

    def start() -> None:
        try:
            w.start()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            failed.append(exc)

    t = threading.Thread(target=start, daemon=True)
    t.start()
    return w, t, failed


def test_a_worker_started_before_its_redis_waits_says_so_and_then_serves(caplog) -> None:
    caplog.set_level(logging.WARNING, "fencemq.server.startup")
    port = free_port()
    w, starting, failed = start_in_background(Config(redis_url=f"redis://127.0.0.1:{port}/0", port=0))
    try:
        wait_for(lambda: any("waiting for Redis at redis://127.0.0.1" in r.getMessage() for r in caplog.records),
                 timeout=15, what="the worker saying it waits")
        assert not failed, failed
        assert w.port is None  # still waiting
        with EmbeddedRedis(port=port):
            starting.join(30)
            assert not failed, failed
            with RespConn(w.port) as c:
                assert c.call("PUB", "orders", "hello") == "1"
            assert any("answers after" in r.getMessage() for r in caplog.records)
            w.stop()
    finally:
        w.stop()


def test_a_worker_waits_while_its_redis_refuses_writes_for_want_of_replicas() -> None:
    with EmbeddedRedis() as server:
        server.client().config_set("min-replicas-to-write", 1)
        w, starting, failed = start_in_background(Config(redis_url=server.url, port=0))
        try:
            time.sleep(1.5)
            assert not failed and w.port is None
            server.client().config_set("min-replicas-to-write", 0)
            starting.join(30)
            assert not failed, failed
            with RespConn(w.port) as c:
                assert c.call("PUB", "orders", "hello") == "1"
        finally:
            w.stop()
