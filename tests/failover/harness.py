"""What `make test-failover` does to a broker: load through worker processes while Redis fails over.

Producers publish with a dedup ID each and send a refused publish again (same
ID) until it is acknowledged; consumers pull and ACK. A *host crash* of a
primary is played as the issue describes it: its replica is held behind
with SIGSTOP under load, the primary is killed (-9), every TCP connection to
it is aborted with ``ss -K`` (so the bytes the kernel still held for the
replica are gone, as with a host that lost power), then the replica goes on.
:class:`Figures` are what the issue counts: acknowledged messages never
delivered, ids given to two messages, worker processes that exited, how
long publishing stopped, and every error a client saw.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from fencemq.errors import RETRIABLE
from fencemq.server.embedded import EmbeddedRedis
from tests.helpers import Closed, Err, RespConn, as_map, deliveries, free_port, subprocess_worker

TOPICS = [f"ft{i}" for i in range(6)]
LOCK_MS = 2000


def abort_connections_to(port: int) -> None:
    """Abort every TCP connection to 127.0.0.1:port, both ends, without a FIN: what a host that
    lost power leaves behind (``ss -K`` needs root and a kernel with INET_DIAG_DESTROY)."""
    for side in ("dport", "sport"):
        subprocess.run(["ss", "-K", f"( {side} = :{port} )"], capture_output=True, timeout=10)


def host_crash(primary: EmbeddedRedis, replicas: list[EmbeddedRedis], lag_s: float = 1.5) -> float:
    """The primary's host dies while its replicas lag behind: returns when the primary died."""
    pids = [r.pid for r in replicas]
    assert primary.pid and all(pids)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)  # type: ignore[arg-type]
    try:
        time.sleep(lag_s)  # load goes on: the replicas fall behind
        primary.kill()
        died = time.monotonic()  # (once it is gone: what it answered before counts as before)
        abort_connections_to(primary.port)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)  # type: ignore[arg-type]
    return died


@dataclass
class Figures:
    acked: dict[str, tuple[str, str]] = field(default_factory=dict)  # dedup id -> (topic, message id)
    delivered: dict[tuple[str, str], set[str]] = field(default_factory=lambda: defaultdict(set))  # (topic, id) -> payloads
    errors: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # code -> count
    bad_errors: list[str] = field(default_factory=list)  # what a client should never see
    # (when the attempt was sent, when it was acknowledged, topic) of each acknowledged publish
    published_at: list[tuple[float, float, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    lease_timeouts: int = 0  # tags the consumers were told timed out (message_timeout): a PULL's reply lost

    def acknowledged_lost(self) -> list[str]:
        seen = {p for payloads in self.delivered.values() for p in payloads}
        return sorted(uid for uid in self.acked if uid not in seen)

    def ids_reused(self) -> list[tuple[str, str]]:
        """(topic, id) pairs given to more than one message, by the producers' acks or the deliveries."""
        given: dict[tuple[str, str], set[str]] = defaultdict(set)
        for uid, key in self.acked.items():
            given[key].add(uid)
        for key, payloads in self.delivered.items():
            given[key] |= payloads
        return sorted(k for k, uids in given.items() if len(uids) > 1)

    def back_after(self, t: float, topics: list[str] | None = None) -> float:
        """Seconds from ``t`` until a publish (to ``topics``, or any) sent after ``t`` was acknowledged."""
        with self.lock:
            acked = [a for sent, a, topic in self.published_at if sent >= t and (topics is None or topic in topics)]
        return (min(acked) - t) if acked else float("inf")

    def longest_pause(self, start: float, end: float, topics: list[str]) -> float:
        """The longest time between ``start`` and ``end`` without an acknowledged publish to ``topics``."""
        with self.lock:
            times = sorted(a for _, a, topic in self.published_at if start <= a <= end and topic in topics)
        edges = [start, *times, end]
        return max(b - a for a, b in zip(edges, edges[1:]))

    def summary(self) -> dict[str, Any]:
        lost_by_topic: dict[str, int] = defaultdict(int)
        for uid in self.acknowledged_lost():
            lost_by_topic[self.acked[uid][0]] += 1
        return {"acknowledged": len(self.acked), "acknowledged_lost": len(self.acknowledged_lost()),
                "lost_by_topic": dict(lost_by_topic),
                "ids_reused": len(self.ids_reused()), "client_errors": dict(self.errors),
                "lease_timeouts": self.lease_timeouts,
                "non_retriable_errors": self.bad_errors[:20]}


class Load:
    """Producers and consumers in threads, against worker ports, until :meth:`stop`."""

    def __init__(self, ports: list[int], figures: Figures) -> None:
        self.ports, self.figures = ports, figures
        self.producers = len(TOPICS)  # one per topic: a shard failing over holds back only its own
        self.stopping = threading.Event()
        self.draining = threading.Event()
        self.threads: list[threading.Thread] = []

    def start(self) -> Load:
        for i in range(self.producers):
            self.threads.append(threading.Thread(target=self._produce, args=(i,), daemon=True))
        for i, topic in enumerate(TOPICS):
            self.threads.append(threading.Thread(target=self._consume, args=(i, topic), daemon=True,
                                                 name=f"consumer of {topic}"))
        for t in self.threads:
            t.start()
        return self

    def _error(self, reply: Err, during: str) -> None:
        code = reply.code
        with self.figures.lock:
            self.figures.errors[code] += 1
            if code not in RETRIABLE:
                self.figures.bad_errors.append(f"{during}: {reply[:200]}")

    def _connect(self, port: int, name: str | None = None, until: threading.Event | None = None) -> RespConn | None:
        """A connection to the worker on ``port``, tried again until one is made; None once ``until``
        is set (a worker that never accepts again must not keep :meth:`stop` from ending the test)."""
        while until is None or not until.is_set():
            try:
                c = RespConn(port, timeout=15)
                if name is not None:
                    c.hello(2, name)
                return c
            except (OSError, Closed) as exc:
                with self.figures.lock:
                    self.figures.bad_errors.append(f"connect to the worker on {port}: {exc!r}")
                time.sleep(0.2)
        return None

    def _produce(self, i: int) -> None:
        c = self._connect(self.ports[i % len(self.ports)], until=self.stopping)
        if c is None:
            return
        n = 0
        topic = TOPICS[i]
        while not self.stopping.is_set():
            uid = f"p{i}-{n}"
            while True:  # the same message, with its ID, until it is acknowledged
                sent = time.monotonic()
                try:
                    reply = c.call("PUB", topic, uid, "ID", uid)
                except (OSError, Closed, TimeoutError) as exc:
                    with self.figures.lock:
                        self.figures.bad_errors.append(f"PUB: the worker's connection broke: {exc!r}")
                    c = self._connect(self.ports[i % len(self.ports)], until=self.stopping)
                    if c is None:
                        return
                    continue
                if isinstance(reply, Err):
                    self._error(reply, "PUB")
                    time.sleep(0.05)
                    continue
                with self.figures.lock:
                    self.figures.acked[uid] = (topic, str(reply))
                    self.figures.published_at.append((sent, time.monotonic(), topic))
                break
            n += 1

    def _consume(self, i: int, topic: str) -> None:
        port = self.ports[(i + 1) % len(self.ports)]
        name = f"consumer-{topic}"
        c = self._connect(port, name, until=self.draining)
        if c is None:
            return
        handle = None
        idle_since = None
        while True:
            try:
                if handle is None:
                    # short leases: what a PULL checked out and a failover kept from its reply comes back soon
                    reply = c.call("SUB", topic, "GROUP", "g", "LOCK", LOCK_MS)
                    if isinstance(reply, Err):
                        self._error(reply, "SUB")
                        time.sleep(0.05)
                        continue
                    handle = as_map(reply)["handle"]
                reply = c.call("PULL", handle, "COUNT", 200, "BLOCK", 300)
                if isinstance(reply, Err):
                    self._error(reply, "PULL")
                    if reply.code == "NOTFOUND":
                        handle = None
                    time.sleep(0.05)
                    continue
                got = deliveries(reply)
                if not got:
                    self._show_life(c, handle)
                    if self.draining.is_set():
                        idle_since = idle_since or time.monotonic()
                        if time.monotonic() - idle_since > 2 * LOCK_MS / 1000 + 1:  # (leases cut off come back)
                            return
                    continue
                idle_since = None
                with self.figures.lock:
                    for d in got:
                        self.figures.delivered[(topic, d["id"])].add(d["payload"])
                while True:
                    acked = c.call("ACK", handle, *[d["tag"] for d in got])
                    if not isinstance(acked, Err):
                        break
                    self._error(acked, "ACK")
                    if acked.code not in RETRIABLE:
                        break
                    time.sleep(0.05)
            except (OSError, Closed, TimeoutError) as exc:
                with self.figures.lock:
                    self.figures.bad_errors.append(f"consumer: the worker's connection broke: {exc!r}")
                c = self._connect(port, name, until=self.draining)
                if c is None:
                    return
                handle = None

    def _show_life(self, c: RespConn, handle: str) -> None:
        """What docs/protocol.md asks of a consumer whose lease timed out (as the SDK does on the
        ``message_timeout`` notice): RENEW the expired tags, which settles nothing but ends the
        suspicion. Without it a suspected member's PULLs come back empty for ever — and a PULL that
        ran while its reply was lost in a failover (answered TRYAGAIN) leaves just such a lease."""
        notices = c.call("HEARTBEAT")
        if isinstance(notices, Err):
            self._error(notices, "HEARTBEAT")
            return
        for raw in notices:
            notice = as_map(raw)
            if notice.get("type") == "message_timeout" and notice.get("handle") == handle and notice.get("tags"):
                with self.figures.lock:
                    self.figures.lease_timeouts += len(notice["tags"])
                renewed = c.call("RENEW", handle, *notice["tags"])
                if isinstance(renewed, Err):
                    self._error(renewed, "RENEW")

    def stop(self, drain_s: float = 30.0) -> None:
        """Stop publishing; let the consumers drain what was published, then stop them."""
        self.stopping.set()
        for t in self.threads[: self.producers]:
            t.join(30)
        self.draining.set()
        deadline = time.monotonic() + drain_s
        for t in self.threads[self.producers:]:
            t.join(max(0.1, deadline - time.monotonic()))
        self.undrained = [t.name for t in self.threads[self.producers:] if t.is_alive()]


def worker_log(proc: subprocess.Popen) -> str:
    """All a worker process has logged so far (tests.helpers.subprocess_worker's ``proc.log``)."""
    proc.log.seek(0)  # type: ignore[attr-defined]
    return proc.log.read().decode(errors="replace")  # type: ignore[attr-defined]


class Workers:
    """Worker processes on one Redis URL: whether each is still running is a figure."""

    def __init__(self, redis_url: str, n: int = 2, **settings: Any) -> None:
        self.ports = [free_port() for _ in range(n)]
        self.procs = [subprocess_worker(redis_url, port, session_lease_ms=20_000, **settings) for port in self.ports]

    def exited(self) -> list[str]:
        out = []
        for proc in self.procs:
            if proc.poll() is not None:
                out.append(f"exit {proc.returncode}: {worker_log(proc)[-1500:]}")
        return out

    def warnings(self, limit: int = 60) -> list[str]:
        """The last warnings and errors each worker logged."""
        out = []
        for proc in self.procs:
            lines = worker_log(proc).splitlines()
            out += [line[:300] for line in lines if line.startswith(("WARNING", "ERROR"))][-limit:]
        return out

    def post_mortem(self, figures: Figures, lines: int = 80) -> None:
        """Print why a client could not get through: each worker's exit code or, for one still
        running, whether it answers PING and every thread's stack (SIGUSR1), with the end of its
        log; then the clients' last errors."""
        out = []
        for proc, port in zip(self.procs, self.ports, strict=True):
            if proc.poll() is None:
                try:
                    with RespConn(port, timeout=2) as c:
                        state = f"running, PING: {c.call('PING')!r}"
                except (OSError, Closed) as exc:
                    state = f"running, PING: {exc!r}"
                proc.send_signal(signal.SIGUSR1)
                time.sleep(0.5)
            else:
                state = f"exited {proc.returncode}"
            log = worker_log(proc).splitlines()
            out.append(f"worker on {port}: {state}\n" + "\n".join(line[:300] for line in log[-lines:]))
        with figures.lock:
            out.append(f"the clients' last errors: {figures.bad_errors[-10:]}")
        print("\n".join(out))

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def report(name: str, figures: dict) -> None:
    print(f"\n{name}: {json.dumps(figures, sort_keys=True)}")
    path = os.environ.get("FENCEMQ_FAILOVER_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"run": name, **figures}, sort_keys=True) + "\n")
