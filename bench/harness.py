"""What the benchmarks share: where the checkout is, a worker in its own process, the machine they ran on."""

from __future__ import annotations

import os
import platform
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fencemq.server.embedded import EmbeddedRedis

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"


class WorkerProcess:
    """bench.serve_worker in a subprocess; SIGTERM drains it.

    With ``mqtt`` it serves MQTT too (``mqtt_port``); with ``open_files`` it starts with that
    many descriptors allowed, soft and hard (raising the hard limit takes CAP_SYS_RESOURCE,
    which root in a container may lack)."""

    def __init__(self, redis_url: str, profile: str | None = None, trace: str | None = None,
                 extra: list[str] | None = None, *, mqtt: bool = False, open_files: int | None = None,
                 stderr: Any = None) -> None:
        cmd = [sys.executable, "-m", "bench.serve_worker", "--redis-url", redis_url, *(extra or [])]
        if profile:
            cmd += ["--profile", profile]
        if trace:
            cmd += ["--trace", trace]
        if mqtt:
            cmd += ["--mqtt-port", "0"]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                     preexec_fn=(lambda: allow_open_files(open_files)) if open_files else None)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.startswith("PORT "):
            self.stop()
            raise RuntimeError(f"worker process did not start (said {line!r})")
        self.port = int(line.split()[1])
        self.mqtt_port = int(self.proc.stdout.readline().split()[1]) if mqtt and self.proc.stdout else 0
        self.pid = self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def allow_open_files(n: int) -> bool:
    """Let this process open ``n`` files, soft and hard limit (raising the hard one takes CAP_SYS_RESOURCE);
    whether it could."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= n and hard >= n:
        return True
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, max(n, hard)))
        return True
    except (ValueError, OSError):
        return False


def wait_listening(port: int, timeout: float = 20.0, host: str = HOST) -> None:
    """Until something accepts on ``port`` (OSError after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@contextmanager
def private_server() -> Iterator[tuple[EmbeddedRedis, dict[str, Any]]]:
    """A private Redis for one bench, with the facts of the machine it runs on (machine_info), said once."""
    import redis

    with EmbeddedRedis() as server:
        admin = redis.Redis.from_url(server.url)
        try:
            machine = machine_info(server, admin)
        finally:
            admin.close()
        print(f"private {server.binary} v{machine['redis_version']} on port {server.port}", flush=True)
        yield server, machine


def machine_info(server: EmbeddedRedis, admin: Any) -> dict[str, Any]:
    cpu_model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = admin.info("server")

    dirty = _git("status", "--porcelain", "--", "broker", "lua")
    return {
        "git_commit": _git("rev-parse", "--short", "HEAD"),
        "broker_or_lua_uncommitted": bool(dirty),
        "loadavg_at_start": os.getloadavg(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu_model": cpu_model,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "redis_binary": server.binary,
        "redis_version": info.get("redis_version"),
        "valkey_version": info.get("valkey_version"),
    }


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def git_commit() -> str:
    return _git("rev-parse", "HEAD")
