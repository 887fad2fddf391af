"""Tests for fencemq.server.runner: the event loop a worker runs on."""

from __future__ import annotations

import importlib.util

import anyio
import pytest

from fencemq.config import Config
from fencemq.server.runner import WorkerThread, event_loop, run
from tests.helpers import as_map, client, deliveries

HAVE_UVLOOP = importlib.util.find_spec("uvloop") is not None
LOOPS = ["asyncio"] + (["uvloop"] if HAVE_UVLOOP else [])


def test_auto_is_uvloop_when_installed_else_asyncio():
    assert event_loop("auto")[0] == ("uvloop" if HAVE_UVLOOP else "asyncio")
    assert event_loop("asyncio") == ("asyncio", {})


def test_an_unknown_loop_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="auto, uvloop, asyncio"):
        event_loop("trio")


@pytest.mark.skipif(HAVE_UVLOOP, reason="uvloop is installed here")
def test_asking_for_uvloop_without_it_says_how_to_install_it():
    with pytest.raises(RuntimeError, match=r"fencemq\[fast\]"):
        event_loop("uvloop")


@pytest.mark.parametrize("loop", LOOPS)
def test_run_runs_on_the_chosen_loop(loop):
    async def loop_module() -> str:
        import asyncio

        await anyio.sleep(0)
        return type(asyncio.get_running_loop()).__module__

    assert run(loop_module, loop=loop).split(".")[0] == loop


@pytest.mark.parametrize("loop", LOOPS)
def test_a_worker_serves_publish_pull_and_ack_on_either_loop(redis_url, loop):
    with WorkerThread(Config(redis_url=redis_url, port=0), loop=loop) as w:
        c = client(w.port, 3, "c1")
        h = as_map(c.execute_command("SUB", "orders", "GROUP", "g"))["handle"]
        c.execute_command("MPUB", "orders", 3, "a", "b", "c")
        got = deliveries(c.execute_command("PULL", h, "COUNT", 10))
        assert [d["payload"] for d in got] == ["a", "b", "c"]
        assert c.execute_command("ACK", h, *[d["tag"] for d in got]) == 3
        c.close()



def test_two_workers_in_one_process_never_read_into_each_others_buffer(redis_url):
    # Workers read every connection into one buffer per event loop (fencemq.server.reading). Two
    # workers on two threads of one process (the tests, an embedding application) read at the same
    # time: a buffer shared between them would hand one client's bytes to the other's parser.
    import os
    import threading

    failures: list[str] = []

    def echo_many(port: int, seed: int) -> None:
        try:
            c = client(port, 2, timeout=10.0)
            for i in range(400):
                payload = os.urandom(1000 + (seed * 7919 + i * 104729) % 60000)
                if c.execute_command("ECHO", payload) != payload:
                    failures.append(f"client {seed}: echo {i} of {len(payload)} bytes came back changed")
                    return
            c.close()
        except Exception as exc:  # surfaced below
            failures.append(f"client {seed}: {exc!r}")

    with WorkerThread(Config(redis_url=redis_url, port=0)) as a, WorkerThread(Config(redis_url=redis_url, port=0)) as b:
        threads = [threading.Thread(target=echo_many, args=(w.port, n)) for n, w in enumerate([a, b] * 4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert failures == []


def test_a_serving_worker_collects_long_lived_garbage_far_less_often_than_cpython_by_default(redis_url):
    # (in a process of its own: serve() waits for signals, which only a main thread may, and sets the
    # process's collector, which the tests' own must not be)
    import subprocess
    import sys

    from fencemq.server.runner import GC_THRESHOLDS

    script = (
        "import gc, os, signal\n"
        "from fencemq.config import Config\n"
        "from fencemq.server.runner import run, serve\n"
        "def ready(worker, port):\n"
        "    print(gc.get_threshold(), flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        f"run(serve, Config(redis_url={redis_url!r}, port=0), ready)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == str(GC_THRESHOLDS), out.stderr[-2000:]
    assert GC_THRESHOLDS[0] > 700 and GC_THRESHOLDS[2] > 10
