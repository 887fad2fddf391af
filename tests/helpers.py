"""Helpers for the worker tests: RESP clients, reply shapes, waits.

Two ways to talk to a worker:

* ``client(port, proto)``: redis-py with every response callback removed, so
  replies arrive as the worker sent them (maps as dicts in RESP3, flat arrays
  in RESP2) — ``as_map``/``deliveries`` give both one shape.
* ``RespConn``: a raw socket with a small RESP2/RESP3 reader of its own, for
  what redis-py hides: push frames (``>``), exact error lines, inline
  commands, pipelines written in one ``send``, and a connection's EOF.
"""

from __future__ import annotations

import fcntl
import os
import pty
import resource
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import termios
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Self

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from fencemq.fences import session_index
from fencemq.config import Config
from fencemq.server.handles import HandleSigner
from fencemq.model.keys import Keyspace
from fencemq.model.records import is_batch_key
from fencemq.server.runner import WorkerThread


def in_cluster_mode() -> bool:
    """True under ``pytest --redis-cluster`` (``make test-cluster``)."""
    return os.environ.get("FENCEMQ_TEST_CLUSTER") == "1"


def direct(redis_url: str, **options: Any) -> redis.Redis:
    """redis-py straight to the broker's Redis: a cluster client when the tests run on a Cluster."""
    if in_cluster_mode():
        return redis.RedisCluster.from_url(redis_url, **options)
    return redis.Redis.from_url(redis_url, **options)


def direct_async(redis_url: str, **options: Any) -> redis.asyncio.Redis:
    """The asyncio twin of ``direct``."""
    import redis.asyncio

    if in_cluster_mode():
        return redis.asyncio.RedisCluster.from_url(redis_url, **options)
    return redis.asyncio.Redis.from_url(redis_url, **options)


def worker(redis_url: str, **settings: Any) -> WorkerThread:
    """A worker on a free port (use as a context manager; ``.port``)."""
    return WorkerThread(Config(redis_url=redis_url, port=0, **settings))



def subscribed(c: redis.Redis, topic: str, *args: object) -> str:
    """SUB through a worker (``client``): the handle."""
    return as_map(c.execute_command("SUB", topic, *args))["handle"]


def pulled(c: redis.Redis, handle: str, n: int = 100) -> list[dict[str, Any]]:
    """PULL … COUNT n through a worker: the deliveries."""
    return deliveries(c.execute_command("PULL", handle, "COUNT", n))

def client(port: int, proto: int = 2, name: str | None = None, *, password: str | None = None,
           timeout: float = 10.0) -> redis.Redis:
    """redis-py on a worker, replies left raw; ``name`` binds a session (HELLO proto SETNAME name)."""
    r = redis.Redis(port=port, protocol=proto, socket_timeout=timeout, socket_connect_timeout=timeout,
                    retry=Retry(NoBackoff(), 0), password=password)
    r.response_callbacks.clear()
    if name is not None:
        r.execute_command("HELLO", proto, "SETNAME", name)
    return r


# -- reply shapes ----------------------------------------------------------------


def text(value: Any) -> Any:
    """bytes -> str, recursively (dict keys too)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "surrogateescape")
    if isinstance(value, dict):
        return {text(k): text(v) for k, v in value.items()}
    if isinstance(value, list):
        return [text(v) for v in value]
    return value


def as_map(reply: Any) -> dict[str, Any]:
    """A map reply as a dict with str keys and str values (RESP3 map or RESP2 flat array)."""
    if isinstance(reply, dict):
        return text(reply)
    assert isinstance(reply, list) and len(reply) % 2 == 0, f"not a map reply: {reply!r}"
    return {text(reply[i]): text(reply[i + 1]) for i in range(0, len(reply), 2)}


def deliveries(reply: Any) -> list[dict[str, Any]]:
    """A PULL reply as a list of delivery dicts."""
    assert isinstance(reply, list), f"PULL must answer an array, got {reply!r}"
    return [as_map(d) for d in reply]


def error_code(exc: BaseException) -> str:
    """The RESP error word of a redis-py error (redis-py strips the codes it knows)."""
    code = getattr(exc, "status_code", None)
    return code if code else str(exc).split(" ", 1)[0]


def wait_for(predicate: Callable[[], Any], timeout: float = 5.0, interval: float = 0.02, what: str = "") -> Any:
    """Poll until predicate() is truthy; returns its value, fails after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


def long_polls_parked(w: WorkerThread, n: int = 1, timeout: float = 10.0) -> None:
    """Wait until ``n`` long polls (PULL/TAKE … BLOCK) wait on worker ``w`` for a publish to wake them.

    A test of the wake-up must publish after that: published earlier, the PULL finds the message at
    once and the test never sees a wake-up (a sleep "until it is parked" guessed at it)."""
    wait_for(lambda: parked_long_polls(w) >= n, timeout, 0.005, what=f"{n} long poll(s) parked on the worker")


def parked_long_polls(w: WorkerThread) -> int:
    """How many long polls wait on worker ``w`` now (one that ended, its client gone, no longer counts)."""
    return sum(len(s) for s in list(w.worker.services.wakeups.waiters.values()))


@contextmanager
def fencemq_serve(*args: str, env: dict[str, str] | None = None, cwd: str | None = None,
                  stop: int = signal.SIGTERM) -> Iterator[tuple[subprocess.Popen, str]]:
    """`fencemq serve ARGS` in a process of its own, once it has printed its 'listening on' line:
    (the process, that line). Stopped with ``stop`` (SIGTERM: it drains) and waited for at the end."""
    proc = subprocess.Popen([sys.executable, "-m", "fencemq.cli.main", "serve", *args], env=env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            if "listening on" in line:
                break
        else:
            raise AssertionError(f"serve ended before listening (exit {proc.wait()})")
        yield proc, line
    finally:
        if proc.poll() is None:
            proc.send_signal(stop)
        proc.wait(30)
        proc.stdout.close()  # type: ignore[union-attr]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# A port the kernel hands out (bind to 0) lies in the ephemeral range, where every outgoing connection of
# every test process also takes its local port: between "free now" and the worker's bind, a client's
# connect could take it (CI once failed so: "Address already in use" for an MQTT port). Ports are chosen
# below that range instead, each pytest-xdist process in a band of its own, so neither a connection nor
# another test process can take one between the check and the bind.
_BAND_BASE = 10_000
_band_ports = max(1, (_ephemeral_low() - _BAND_BASE) // 16)
_band = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0) % 16
_next_port = _BAND_BASE + _band * _band_ports + (os.getpid() * 7919) % _band_ports


def free_port() -> int:
    """A port free now that no outgoing connection and no other test process will take before it is bound."""
    global _next_port
    band_start = _BAND_BASE + _band * _band_ports
    for _ in range(_band_ports):
        port = band_start + (_next_port - band_start) % _band_ports
        _next_port = port + 1
        try:
            with socket.create_server(("127.0.0.1", port)):
                return port
        except OSError:
            continue
    raise RuntimeError(f"no free port in {band_start}..{band_start + _band_ports - 1}")


def subprocess_worker(redis_url: str, port: int, *, file_limit: int | None = None, loop: str = "asyncio",
                      **settings: Any) -> subprocess.Popen:
    """A worker in its own process (``fencemq.server.runner.serve``), answering PING on ``port``.

    ``file_limit``: the process starts with this many open files at most (soft and hard limit);
    ``loop``: the event loop (fencemq.server.runner.LOOPS). The worker's log is ``proc.log``
    (a file: a chatty worker never blocks on a full pipe); SIGUSR1 writes every thread's stack to it."""
    extra = "".join(f", {k}={v!r}" for k, v in settings.items())
    code = (
        "import faulthandler, logging, signal; from fencemq.server.runner import run, serve; "
        "from fencemq.config import Config; "
        "logging.basicConfig(level=logging.INFO); faulthandler.register(signal.SIGUSR1); "
        f"run(serve, Config(redis_url={redis_url!r}, port={port}{extra}), loop={loop!r})"
    )

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (file_limit, file_limit))

    log = tempfile.TemporaryFile()  # noqa: SIM115 — not a pipe: a chatty worker must never block on a full one
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT,
                            preexec_fn=limited if file_limit else None)
    proc.log = log  # type: ignore[attr-defined]

    def answers() -> bool:
        if proc.poll() is not None:
            log.seek(0)
            raise AssertionError(f"worker process exited: {log.read().decode(errors='replace')[-2000:]}")
        try:
            with RespConn(port, timeout=0.5) as c:
                return c.call("PING") == "PONG"
        except (OSError, Closed):
            return False

    wait_for(answers, timeout=20, interval=0.05, what="the worker process to answer PING")
    return proc


# -- a raw RESP connection ---------------------------------------------------------


class Push(list):
    """A RESP3 push frame (``>``)."""


class Err(str):
    """An error reply (``-``), e.g. ``Err('NOPERM this handle ...')``; ``.code`` is its first word."""

    @property
    def code(self) -> str:
        return self.split(" ", 1)[0]


class _More(Exception):
    pass


class Closed(Exception):
    """The worker closed the connection."""


def encode_command(*args: Any) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


class RespConn:
    """A socket speaking RESP to a worker. Replies are str/int/list/dict/None, errors ``Err``,
    pushes ``Push``; bulk strings are decoded as UTF-8 (surrogateescape) unless ``raw=True``."""

    def __init__(self, port: int, *, timeout: float = 5.0, raw: bool = False) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.timeout = timeout
        self.raw = raw
        self.buf = b""
        self.pushes: list[Push] = []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    # -- writing
    def send(self, *args: Any) -> None:
        self.sock.sendall(encode_command(*args))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    # -- reading
    def read(self, timeout: float | None = None) -> Any:
        """The next frame, push frames included."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            try:
                value, end = self._parse(0)
            except _More:
                pass
            else:
                self.buf = self.buf[end:]
                return value
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no complete reply from the worker")
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                raise TimeoutError("no complete reply from the worker") from None
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                raise Closed(f"connection closed by the worker (unparsed: {self.buf[:80]!r})")
            self.buf += chunk

    def reply(self, timeout: float | None = None) -> Any:
        """The next reply that is not a push frame (pushes are kept in ``self.pushes``)."""
        while True:
            value = self.read(timeout)
            if isinstance(value, Push):
                self.pushes.append(value)
                continue
            return value

    def call(self, *args: Any, timeout: float | None = None) -> Any:
        self.send(*args)
        return self.reply(timeout)

    def replies(self, n: int, timeout: float | None = None) -> list[Any]:
        return [self.reply(timeout) for _ in range(n)]

    def next_push(self, timeout: float = 5.0) -> Push:
        """The next push frame (replies seen meanwhile are an error: nothing was asked)."""
        if self.pushes:
            return self.pushes.pop(0)
        value = self.read(timeout)
        assert isinstance(value, Push), f"expected a push frame, got {value!r}"
        return value

    def is_closed(self, timeout: float = 2.0) -> bool:
        """True if the worker closes the connection within timeout (unread replies are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                return False
            except (ConnectionResetError, BrokenPipeError):
                return True
            if not chunk:
                return True

    def hello(self, proto: int = 3, name: str | None = None, *extra: Any) -> dict[str, Any]:
        args: list[Any] = ["HELLO", proto, *extra]
        if name is not None:
            args += ["SETNAME", name]
        reply = self.call(*args)
        assert not isinstance(reply, Err), f"HELLO failed: {reply}"
        return as_map(reply)

    def _line(self, pos: int) -> tuple[bytes, int]:
        end = self.buf.find(b"\r\n", pos)
        if end < 0:
            raise _More
        return self.buf[pos:end], end + 2

    def _parse(self, pos: int) -> tuple[Any, int]:
        if pos >= len(self.buf):
            raise _More
        kind = self.buf[pos : pos + 1]
        line, pos = self._line(pos + 1)
        if kind == b"+":
            return line.decode(), pos
        if kind == b"-":
            return Err(line.decode()), pos
        if kind in (b":", b"("):
            return int(line), pos
        if kind == b",":
            return float(line), pos
        if kind == b"#":
            return line == b"t", pos
        if kind == b"_":
            return None, pos
        if kind in (b"$", b"=", b"!"):
            n = int(line)
            if n < 0:
                return None, pos
            if len(self.buf) < pos + n + 2:
                raise _More
            data = self.buf[pos : pos + n]
            if kind == b"=":
                data = data[4:]  # "txt:"
            if kind == b"!":
                return Err(data.decode()), pos + n + 2
            return (data if self.raw else data.decode("utf-8", "surrogateescape")), pos + n + 2
        if kind in (b"*", b">", b"~"):
            n = int(line)
            if n < 0:
                return None, pos
            items = []
            for _ in range(n):
                item, pos = self._parse(pos)
                items.append(item)
            return (Push(items) if kind == b">" else items), pos
        if kind == b"%":
            out = {}
            for _ in range(int(line)):
                k, pos = self._parse(pos)
                v, pos = self._parse(pos)
                out[k] = v
            return out, pos
        raise AssertionError(f"unexpected RESP type byte {kind!r} in {self.buf[pos - 10 : pos + 40]!r}")


def checkout_records(r: redis.Redis, k: Any) -> dict[str, bytes]:
    """A queue's checkout records by tag, read straight from Redis (each lease batch's count, kept in
    the same hash, left out: lua/lib/checkouts.lua)."""
    return {t.decode(): v for t, v in r.hgetall(k.checkouts).items() if not is_batch_key(t)}


def held_handles(r: redis.Redis, client: str, keys: Keyspace | None = None) -> set[str]:
    """Every handle the client's session holds, lite or not, as SUB returned them (read from its session index)."""
    with r.pipeline(transaction=False) as pipe:
        for cmd in session_index.read_commands(keys or Keyspace("fmq"), client):
            pipe.execute_command(*cmd)
        found = session_index.entries(client, pipe.execute())
    sign = signer(r, keys).sign
    return {h if isinstance(h, str) else sign(h.encode()) for h in found}


def signer(r: redis.Redis, keys: Keyspace | None = None) -> HandleSigner:
    """The broker's handle signer (its secret read from Redis), to sign a handle as a worker does."""
    secret = r.get((keys or Keyspace("fmq")).handle_secret)
    return HandleSigner(bytes.fromhex(secret.decode() if isinstance(secret, bytes) else secret or ""))


def pipeline(*commands: Iterable[Any]) -> bytes:
    """Several commands as one buffer, to be written with a single send."""
    return b"".join(encode_command(*c) for c in commands)


def _without_size(environ: Mapping[str, str]) -> dict[str, str]:
    # The pseudo-terminal tells the program its size, as a person's does; a COLUMNS or LINES
    # inherited from the test runner (pytest-xdist sets 80 x 24) would override it.
    return {k: v for k, v in environ.items() if k not in ("COLUMNS", "LINES")}


def _take_the_terminal() -> None:
    # In the child, after setsid: the pseudo-terminal becomes its controlling terminal, so ^C typed on it
    # interrupts the program (the line discipline signals the foreground group) and /dev/tty is it.
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    # ... and the program starts as a shell starts it: ^C at its default, whatever the test process did to
    # its own (exec keeps an ignored signal ignored, and a blocked one blocked: under pytest-xdist a
    # worker process that ran other tests first handed `fencemq top` an ignored ^C)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


class Terminal:
    """A program on a pseudo-terminal (120 x 24 unless told), as a person would run it."""

    def __init__(self, *argv: str, columns: int = 120, rows: int = 24, env: Mapping[str, str] | None = None,
                 cwd: str | None = None) -> None:
        self.fd, its_side = pty.openpty()
        fcntl.ioctl(its_side, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        self.proc = subprocess.Popen(argv, stdin=its_side, stdout=its_side, stderr=its_side, cwd=cwd,
                                     env={**_without_size(os.environ), "TERM": "xterm", **_without_size(env or {})},
                                     start_new_session=True, preexec_fn=_take_the_terminal)
        os.close(its_side)
        self.seen = b""

    def read_until(self, want: bytes, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and want not in self.seen:
            if select.select([self.fd], [], [], 0.1)[0]:
                try:
                    self.seen += os.read(self.fd, 4096)
                except OSError:  # the program ended
                    break
        return want in self.seen

    def type(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def type_hidden(self, keys: bytes, timeout: float = 5.0) -> None:
        """Type at a password prompt: once the program has turned echo off (getpass flushes what was
        typed before that, so typing on seeing the prompt would be lost)."""
        deadline = time.monotonic() + timeout
        while termios.tcgetattr(self.fd)[3] & termios.ECHO:
            assert time.monotonic() < deadline, f"echo never went off: {self.seen!r}"
            time.sleep(0.01)
        self.type(keys)

    def exit_code(self, timeout: float = 10.0) -> int:
        """Wait for the program to end (reading what it prints meanwhile): its exit code."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.read_until(b"\0never\0", 0.1)
        self.read_until(b"\0never\0", 0.1)
        return self.proc.wait(1)

    def __enter__(self) -> Terminal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait()
        os.close(self.fd)


async def publish_then_settle_one(redis_url: str, config: Config, *, publish_to: str, settle_on: str, client: str,
                                  pull: int = 1) -> None:
    """Through the fences (no worker): publish "late" to lmq ``publish_to`` of topic chat, then
    ``client`` subscribes lmq ``settle_on``, pulls up to ``pull`` and acks the first: writes a
    snapshot must notice (or, for the write time, must not)."""
    from redis.asyncio import Redis

    from fencemq.fences.core import Core
    from fencemq.model.handles import Handle

    r = Redis.from_url(redis_url)
    q = Core(r, config)
    try:
        await q.publishing.publish("chat", [b"late"], lmq=publish_to)
        handle = Handle.decode((await q.subscriptions.subscribe(client, "chat", lmq=settle_on)).handle)
        got = (await q.leases.pull(handle, pull)).deliveries
        assert await q.leases.ack(handle, [got[0].tag]) == 1
    finally:
        await r.aclose()


def honour_priority(redis_url: str, topic: str, on: bool = True) -> dict[str, Any]:
    """What `fencemq priority set TOPIC on|off` does (ops.priority.set_priority), straight on Redis."""
    import asyncio

    from fencemq.model.keys import QueueRef
    from fencemq.ops.priority import set_priority

    async def go() -> dict[str, Any]:
        r = direct_async(redis_url)
        try:
            return await set_priority(r, Keyspace(), QueueRef(topic), on)
        finally:
            await r.aclose()
    return asyncio.run(go())


class KillableMqttWorker:
    """A worker in its own process with an MQTT listener, to be killed with SIGKILL: it says and publishes nothing."""

    def __init__(self, redis_url: str, **settings: Any) -> None:
        self.mqtt_port = free_port()
        self.proc = subprocess_worker(redis_url, free_port(), mqtt_port=self.mqtt_port, **settings)
        wait_for(self._listening, timeout=10, what="the worker's MQTT listener")

    def _listening(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.mqtt_port), timeout=0.5).close()
            return True
        except OSError:
            return False

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(5)
