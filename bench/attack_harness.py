"""What bench.attacks runs its attacks in: a worker process (its RSS read from /proc), a well-behaved
client beside it, and the user whose password the door attacks guess."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import redis

from bench.attack_doors import LEGACY_PASSWORD as PASSWORD  # the well-behaved client's, and the attacks'
from bench.attack_doors import USER, USER_PASSWORD, Ports
from bench.stats import rss


class Worker:
    """A worker process; with ``doors``, MQTT and the web UI too (``serve --mqtt-port --http-port``)."""

    def __init__(self, redis_url: str, doors: bool = False, **settings: Any) -> None:
        http = free_port() if doors else 0
        if doors:
            settings = {**settings, "mqtt_port": 0}
        run = (f"from fencemq.ui.serving import worker_with_ui\nanyio.run(worker_with_ui, cfg, ready, {http}, serve)\n"
               if doors else "anyio.run(serve, cfg, ready)\n")
        code = ("import logging, sys, anyio; from fencemq.config import Config; from fencemq.server.runner import serve\n"
                "logging.basicConfig(level=logging.INFO)\n"
                f"cfg = Config(redis_url={redis_url!r}, port=0, **{settings!r})\n"
                "def ready(w, port): print('PORT', port, w.mqtt_port or 0, flush=True)\n" + run)
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.startswith("PORT"):
            self.log.seek(0)
            raise RuntimeError(f"worker did not start: {self.log.read().decode()[-2000:]}")
        self.port = int(line.split()[1])
        self.ports = Ports(self.port, int(line.split()[2]), http)
        if doors:
            wait_for_http(http)

    def rss(self) -> int:
        return rss(self.proc.pid)

    def log_lines(self) -> list[str]:
        self.log.seek(0)
        return self.log.read().decode(errors="replace").splitlines()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class GoodClient(threading.Thread):
    """PUB, PULL, ACK on its own topic, checked, over and over: its slowest round trip is the verdict."""

    def __init__(self, port: int, tls: bool = False) -> None:
        super().__init__(daemon=True)
        self.port, self.tls, self.stop, self.failure = port, tls, threading.Event(), ""
        self.latencies: list[float] = []

    def run(self) -> None:
        try:
            tls = {"ssl": True, "ssl_cert_reqs": "none"} if self.tls else {}
            r = redis.Redis(port=self.port, password=PASSWORD, socket_timeout=30, **tls)
            r.execute_command("HELLO", 2, "SETNAME", "good")
            reply = r.execute_command("SUB", "good", "GROUP", "g")
            handle = dict(zip(reply[::2], reply[1::2]))[b"handle"]
            n = 0
            while not self.stop.is_set():
                started = time.monotonic()
                r.execute_command("PUB", "good", f"m{n}")
                got = r.execute_command("PULL", handle, "COUNT", 1)
                tag = dict(zip(got[0][::2], got[0][1::2]))[b"tag"]
                assert r.execute_command("ACK", handle, tag) == 1
                self.latencies.append(time.monotonic() - started)
                n += 1
                self.stop.wait(0.01)
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            self.failure = repr(exc)[:300]


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def wait_for_http(port: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"the web UI did not listen on {port}")


def add_user(redis_url: str) -> None:
    """The user the door attacks guess the password of (its record, as `fencemq user add` writes it)."""
    import anyio
    import redis.asyncio

    from fencemq.model.keys import Keyspace
    from fencemq.ops.users import UserStore

    async def add() -> None:
        r = redis.asyncio.Redis.from_url(redis_url)
        try:
            await UserStore(r, Keyspace("fmq").users).add(USER, USER_PASSWORD, [("publish", "#"), ("subscribe", "#")])
        finally:
            await r.aclose()

    anyio.run(add)
