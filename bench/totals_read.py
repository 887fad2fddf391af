"""What reading the broker's totals costs on a Redis Cluster, and what it costs a client's fence calls
(issue #33: the watcher and the sampler read them on the worker's event loop).

    .venv/bin/python -m bench.totals_read [--queues 10 10000] [--seconds 8] [--out bench/results]

A private 3-master Cluster (``start_cluster``) and a worker (``WorkerThread``, in this process).
For each ``--queues`` n, n plain topics get a message each through the worker (their slots come to
hold totals), then the totals are read three ways:

- ``before``: every slot (16,384) through redis-py's Cluster pipeline, as a total was read before
  the registry and the fast read (``every_slot=True, fast=False``: still there, the slow path the
  tests hold the others to);
- ``every_slot_fast``: every slot, by the fast read (what a Cluster with every slot in use costs);
- ``after``: the slots in use (the registry ``Keyspace.totals_slots``), by the fast read.

For each way:

- ``read_ms``: one read of what the health watcher reads each sample (``read_totals`` and
  ``largest_backlogs``) on an idle worker's loop, median and worst of 5, with the worker process's
  CPU time for it (``cpu_ms``, median);
- ``renew_ms``: a client in a process of its own RENEWs one lease through the worker, one call at a
  time, for ``--seconds`` while the worker's loop reads them back to back: p50, p99, max, with the
  same client's figures while nothing reads (``idle``).

Writes ``<out>/totals_read.json`` (with the load average before and after: the machine is shared)
and ``<out>/totals_read.png`` (``--plot-only``: the plot of an existing JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import redis

from bench.harness import ROOT, git_commit
from fencemq.config import Config
from fencemq.model.keys import Keyspace
from fencemq.ops import totals
from fencemq.server.embedded import start_cluster
from fencemq.server.runner import WorkerThread

KEYS = Keyspace("fmq")

# The client: one lease RENEWed one call at a time for a while; prints its latencies (ms) as JSON.
CLIENT = r"""
import json, sys, time
import redis
port, seconds = int(sys.argv[1]), float(sys.argv[2])
r = redis.Redis(port=port, protocol=2)
r.response_callbacks.clear()
r.execute_command("HELLO", 2, "SETNAME", "bench-renew")
handle = dict(zip(*[iter(r.execute_command("SUB", "renewed", "GROUP", "g", "LOCK", 300000))] * 2))[b"handle"]
r.execute_command("PUB", "renewed", b"x")
delivery = r.execute_command("PULL", handle, "COUNT", 1)[0]
tag = dict(zip(*[iter(delivery)] * 2))[b"tag"]
print("ready", flush=True)
sys.stdin.readline()
out, end = [], time.perf_counter() + seconds
while time.perf_counter() < end:
    t = time.perf_counter()
    assert r.execute_command("RENEW", handle, tag) == 1
    out.append((time.perf_counter() - t) * 1000)
print(json.dumps(out), flush=True)
"""


def percentile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def latency(xs: list[float]) -> dict[str, Any]:
    return {"calls": len(xs), "p50": round(percentile(xs, 50), 2), "p99": round(percentile(xs, 99), 2),
            "max": round(max(xs), 2)}


WAYS = {"before": (True, False), "every_slot_fast": (True, True), "after": (False, True)}  # (every_slot, fast)


async def watcher_read(r: Any, way: str) -> tuple[float, float]:
    """What the watcher reads each sample: the totals and the largest backlogs (wall ms, CPU ms)."""
    every_slot, fast = WAYS[way]
    t, c = time.perf_counter(), time.process_time()
    await totals.read_totals(r, KEYS, every_slot=every_slot, fast=fast)
    await totals.largest_backlogs(r, KEYS, 20, every_slot=every_slot, fast=fast)
    return (time.perf_counter() - t) * 1000, (time.process_time() - c) * 1000


async def reading(r: Any, way: str, stop: asyncio.Event) -> int:
    n = 0
    while not stop.is_set():
        await watcher_read(r, way)
        n += 1
    return n


def on_worker(w: WorkerThread, coro: Any) -> Any:
    return asyncio.run_coroutine_threadsafe(coro, w._loop).result()


def populate(port: int, n: int, start: int) -> None:
    c = redis.Redis(port=port, protocol=2)
    c.response_callbacks.clear()
    c.execute_command("HELLO", 2, "SETNAME", "bench-populate")
    for lo in range(start, n, 500):
        pipe = c.pipeline(transaction=False)
        for i in range(lo, min(n, lo + 500)):
            pipe.execute_command("PUB", f"q{i:05d}", b"m")
        pipe.execute()
    c.close()


def renews(port: int, seconds: float, w: WorkerThread | None, way: str) -> tuple[list[float], int]:
    """The client's RENEW latencies (ms) while the worker's loop reads the totals (w given) or not."""
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, str(port), str(seconds)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "ready"
        reads = None
        if w is not None:
            stop = asyncio.Event()

            async def go() -> asyncio.Future[int]:
                return asyncio.ensure_future(reading(w.worker.services.redis, way, stop))

            task = on_worker(w, go())
        proc.stdin.write("go\n")
        proc.stdin.flush()
        got = json.loads(proc.stdout.readline())
        if w is not None:
            async def halt() -> int:
                stop.set()
                return await task

            reads = on_worker(w, halt())
        return got, reads or 0
    finally:
        proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queues", type=int, nargs="+", default=[10, 10_000])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--out", default=str(ROOT / "bench/results"))
    ap.add_argument("--plot-only", action="store_true")
    args = ap.parse_args()
    if args.plot_only:
        plot(json.loads((Path(args.out) / "totals_read.json").read_text()), Path(args.out) / "totals_read.png")
        return
    load_before = os.getloadavg()
    servers = start_cluster(3)
    results: list[dict[str, Any]] = []
    try:
        url = servers[0].url
        for n in sorted(args.queues):
            for srv in servers:
                srv.client().flushall()
            with WorkerThread(Config(redis_url=url, port=0, metrics_sample_ms=3_600_000,
                                     health_sample_ms=3_600_000)) as w:
                populate(w.port, n, 0)
                r = w.worker.services.redis
                in_use = len(on_worker(w, totals.slots_in_use(r, KEYS)))
                counted = on_worker(w, totals.read_totals(r, KEYS))
                assert counted == on_worker(w, totals.read_totals(r, KEYS, every_slot=True, fast=False))
                idle, _ = renews(w.port, args.seconds, None, "after")
                row: dict[str, Any] = {"queues": n, "queues_counted": counted["queues"], "slots_in_use": in_use,
                                       "renew_ms_idle": latency(idle)}
                for way in WAYS:
                    reads = [on_worker(w, watcher_read(r, way)) for _ in range(5)]
                    walls = [wall for wall, _ in reads]
                    during, looped = renews(w.port, args.seconds, w, way)
                    row[way] = {"read_ms": {"median": round(statistics.median(walls), 1), "worst": round(max(walls), 1),
                                            "cpu_ms": round(statistics.median(c for _, c in reads), 1)},
                                "reads_during": looped, "renew_ms": latency(during)}
                    print(n, way, row[way], flush=True)
                results.append(row)
    finally:
        for srv in servers:
            srv.stop()
    out = {
        "bench": "totals_read", "masters": 3, "seconds": args.seconds, "results": results,
        "read": "read_totals + largest_backlogs (what the health watcher reads each sample), on the worker's loop",
        "commit": git_commit(), "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "machine": {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()},
    }
    path = Path(args.out) / "totals_read.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    plot(out, path.with_suffix(".png"))
    print(f"wrote {path} and its plot")


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    width = 0.25
    for j, way in enumerate(WAYS):
        xs = [i + (j - 1) * width for i in range(len(out["results"]))]
        left.bar(xs, [r[way]["read_ms"]["median"] for r in out["results"]], width, label=way)
        right.bar(xs, [r[way]["renew_ms"]["p99"] for r in out["results"]], width, label=way)
    labels = [f"{r['queues']:,} queues\n({r['slots_in_use']:,} slots in use)" for r in out["results"]]
    for ax, title in ((left, "one read of the totals + largest backlogs (ms, median)"),
                      (right, "a client's RENEW p99 while the worker reads them (ms)")):
        ax.set_xticks(range(len(labels)), labels)
        ax.set_title(title, fontsize=10)
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    idle = [r["renew_ms_idle"]["p99"] for r in out["results"]]
    right.plot(range(len(idle)), idle, "k_", markersize=30, label="idle")
    fig.suptitle(f"3-master Cluster, load average {out['loadavg_before'][0]:.1f} (2 cores, shared)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
