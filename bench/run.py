"""End-to-end benchmark: FenceMQ vs raw Redis Streams, one run, one private server.

    python -m bench.run [--messages 100000] [--size 128] [--out bench/results]

Variants (same Redis server, flushed between them):
  raw              Redis Streams from Python the best way: Lua XADD of 100,
                   Lua XACK(batch k)+XREADGROUP COUNT 100 (batch k+1).
  fencemq_process  a FenceMQ worker in its own process (the headline).
  fencemq_thread   a FenceMQ worker in a thread of this process (shares the GIL
                   with the bench clients: a lower bound, for comparison).
Each variant: a flat-out run (MPUB of 100, 10 in flight; PULL COUNT 100 BLOCK
1000 + ACK pipelined) and a low-load run (one PUB per message at ~1,000 msg/s).
Then a plain redis-py asyncio client that awaits each call, against FenceMQ and
raw Streams (bench.plain_client), the Redis cost of each fence alone
(bench.fence_costs), the Python SDK in
both styles, asyncio and blocking (bench.sdk), and the peers a
user would pick instead, measured the same way on this machine's services
(bench.peers: NATS JetStream, RabbitMQ quorum queues; skipped when absent).
Writes <out>/e2e.json and <out>/e2e.png and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from bench.e2e_report import goals, plot, print_table
from bench.fence_cost import SCENARIOS as FENCE_SCENARIOS
from bench.fence_cost import count_instructions
from bench.fence_costs import fence_costs
from bench.harness import HOST, ROOT, WorkerProcess, machine_info
from bench.peers import run_peers
from bench.plain_client import plain_client
from bench.sdk import sdk_styles
from bench.stats import RedisMeter, machine_busy_s, percentiles_ms, proc_cpu_s, self_cpu_s
from bench.workloads import FenceMQ, RawStreams, Run, e2e
from fencemq.config import Config
from fencemq.server.embedded import EmbeddedRedis
from fencemq.server.runner import WorkerThread

def measure(meter: RedisMeter, redis_pid: int, worker_pid: int | None, make: Callable[[], Any]) -> tuple[Run, dict[str, Any]]:
    """Run one phase (a coroutine factory), with Redis and process CPU around it."""
    meter.reset()
    me0, r0, b0 = self_cpu_s(), proc_cpu_s(redis_pid), machine_busy_s()
    w0 = proc_cpu_s(worker_pid) if worker_pid else 0.0
    t0 = time.perf_counter()
    run: Run = asyncio.run(make())
    wall = time.perf_counter() - t0
    me1, r1, b1 = self_cpu_s(), proc_cpu_s(redis_pid), machine_busy_s()
    w1 = proc_cpu_s(worker_pid) if worker_pid else 0.0
    s = meter.read()
    n = max(1, run.messages)
    ours = (me1 - me0) + (r1 - r0) + (w1 - w0)
    out = {
        "messages": run.messages,
        "seconds": run.seconds,
        "msgs_per_s": run.messages / run.seconds if run.seconds > 0 else 0.0,
        "publish_msgs_per_s": run.messages / (run.t_last_pub_reply - run.t_first_pub),
        "acked": run.acked,
        "delivered": len(run.latencies_ns),
        "redelivered": run.redelivered,
        "latency_ms": percentiles_ms(run.latencies_ns),
        "redis": {
            "cpu_us_per_msg": s["cpu_us"] / n,
            "evalsha_us_per_msg": s["evalsha_usec"] / n,
            # commandstats counts the commands a script runs as well as the script: nested time twice
            "cmd_us_per_msg_incl_nested": s["cmd_usec"] / n,
            "evalsha_calls": s["evalsha_calls"],
            "commands": s["commands"],
        },
        "client_cpu_us_per_msg": (me1 - me0) * 1e6 / n,  # includes the worker when it is a thread
        "worker_cpu_us_per_msg": (w1 - w0) * 1e6 / n if worker_pid else None,
        "phase_wall_s": wall,
        # CPU (in cores) that processes other than the bench, its worker and its Redis
        # used meanwhile: noise from whatever else runs on the machine
        "others_cpu_cores": max(0.0, (b1 - b0) - ours) / wall,
    }
    return run, out


def pick_median(runs: list[tuple[Run, dict[str, Any]]], key: Callable[[dict[str, Any]], float]) -> tuple[Run, dict[str, Any]]:
    ordered = sorted(runs, key=lambda r: key(r[1]))
    return ordered[(len(ordered) - 1) // 2]


def run_variant(name: str, port: int, meter: RedisMeter, redis_pid: int, worker_pid: int | None,
                system_for: Callable[[str], Any], opts: argparse.Namespace) -> tuple[dict[str, Any], dict[str, list[int]]]:
    """Warm up, then ``opts.repeat`` flat-out and low-load runs; the median run of each is reported."""
    lat: dict[str, list[int]] = {}
    # warm-up: script cache, connections, worker caches (not recorded)
    asyncio.run(e2e(HOST, port, system_for(f"{name}-warm"), total=min(5000, opts.messages), size=opts.size,
                    consumers=opts.consumers))
    runs = []
    for i in range(opts.repeat):
        print(f"  {name}: flat out, {opts.messages} messages (run {i + 1}/{opts.repeat}) ...", flush=True)
        runs.append(measure(meter, redis_pid, worker_pid, lambda: e2e(
            HOST, port, system_for(f"{name}-thr{i}"), total=opts.messages, size=opts.size, batch=opts.batch,
            window=opts.window, count=opts.count, consumers=opts.consumers)))
    run, thr = pick_median(runs, lambda r: r["msgs_per_s"])
    thr["consumers"] = opts.consumers
    thr["runs_msgs_per_s"] = [r[1]["msgs_per_s"] for r in runs]
    thr["runs_others_cpu_cores"] = [r[1]["others_cpu_cores"] for r in runs]
    lat["throughput"] = list(run.latencies_ns)
    runs = []
    for i in range(opts.repeat):
        print(f"  {name}: low load, {opts.low_messages} messages at {opts.low_rate:.0f}/s (run {i + 1}/{opts.repeat}) ...",
              flush=True)
        runs.append(measure(meter, redis_pid, worker_pid, lambda: e2e(
            HOST, port, system_for(f"{name}-low{i}"), total=opts.low_messages, size=opts.size, count=opts.count,
            rate=opts.low_rate)))
    run, low = pick_median(runs, lambda r: r["latency_ms"]["p99"])
    low["target_rate"] = opts.low_rate
    low["publish_rtt_ms"] = percentiles_ms(run.pub_rtt_ns)
    low["runs_p99_ms"] = [r[1]["latency_ms"]["p99"] for r in runs]
    low["runs_p50_ms"] = [r[1]["latency_ms"]["p50"] for r in runs]
    low["runs_others_cpu_cores"] = [r[1]["others_cpu_cores"] for r in runs]
    lat["low_load"] = list(run.latencies_ns)
    return {"throughput": thr, "low_load": low}, lat


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=100_000, help="messages per flat-out run")
    ap.add_argument("--size", type=int, default=128, help="payload bytes (>= 8: the send time)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--batch", type=int, default=100, help="messages per MPUB / Lua XADD")
    ap.add_argument("--window", type=int, default=10, help="publish commands in flight")
    ap.add_argument("--count", type=int, default=100, help="PULL/XREADGROUP COUNT")
    ap.add_argument("--repeat", type=int, default=3, help="runs per phase; the median one is reported")
    ap.add_argument("--consumers", type=int, default=1, help="consumer connections in the flat-out run")
    ap.add_argument("--low-messages", type=int, default=2000)
    ap.add_argument("--low-rate", type=float, default=1000.0, help="msg/s in the low-load run")
    ap.add_argument("--skip-thread", action="store_true", help="skip the worker-thread variant")
    ap.add_argument("--plain-messages", type=int, default=0,
                    help="messages per run of the plain-client phase (default: half of --messages)")
    ap.add_argument("--profile", default=None, help="cProfile the worker process into this file")
    ap.add_argument("--skip-peers", action="store_true", help="skip NATS JetStream and RabbitMQ (bench.peers)")
    opts = ap.parse_args(argv)
    if opts.size < 8:
        ap.error("--size must be at least 8 (the payload carries its send time)")
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)

    t_start = time.perf_counter()
    res: dict[str, Any] = {"args": vars(opts), "variants": {}}
    lat: dict[str, dict[str, list[int]]] = {}
    with EmbeddedRedis() as server:
        admin = server.client()
        meter = RedisMeter(admin)
        res["machine"] = machine_info(server, admin)
        print(f"private {server.binary} v{res['machine']['redis_version']} on port {server.port}", flush=True)

        print("raw Redis Streams:", flush=True)
        res["variants"]["raw"], lat["raw"] = run_variant(
            "raw", server.port, meter, server.pid, None, lambda tag: lambda i: RawStreams(f"bench:{tag}", consumer=f"c{i}"), opts)
        admin.flushall()

        print("FenceMQ, worker process:", flush=True)
        worker = WorkerProcess(server.url, profile=opts.profile)
        try:
            res["variants"]["fencemq_process"], lat["fencemq_process"] = run_variant(
                "fencemq_process", worker.port, meter, server.pid, worker.pid, lambda tag: lambda i: FenceMQ(tag), opts)
        finally:
            worker.stop()
        admin.flushall()

        if not opts.skip_thread:
            print("FenceMQ, worker thread:", flush=True)
            with WorkerThread(Config(redis_url=server.url, port=0)) as wt:
                res["variants"]["fencemq_thread"], lat["fencemq_thread"] = run_variant(
                    "fencemq_thread", wt.port, meter, server.pid, None, lambda tag: lambda i: FenceMQ(tag), opts)
            admin.flushall()

        print("a plain redis-py client, one call at a time (FenceMQ and raw Streams):", flush=True)
        res["plain_client"] = plain_client(server.url, server.pid, opts.plain_messages or opts.messages // 2, opts.size,
                                           opts.repeat)
        admin.flushall()

        print("fences alone:", flush=True)
        res["fence_costs"] = asyncio.run(fence_costs(server.url, meter, size=opts.size))
        admin.flushall()
        if shutil.which("valgrind"):  # instructions per message, repeatable on a loaded machine (bench.fence_cost)
            res["fence_instructions"] = count_instructions(FENCE_SCENARIOS["topic"], 10, 100, opts.size)

        print("the Python SDK, asyncio and blocking:", flush=True)
        worker = WorkerProcess(server.url)
        try:
            res["sdk"] = sdk_styles(worker.port, opts.messages, opts.size)
        finally:
            worker.stop()
        admin.close()

    if not opts.skip_peers:
        print("peers (services of this machine):", flush=True)
        res["peers"] = run_peers(opts.messages, opts.size, opts.batch, opts.window)

    res["goals"] = goals(res)
    res["bench_seconds"] = time.perf_counter() - t_start
    res["machine"]["loadavg_at_end"] = os.getloadavg()
    (out / "e2e.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    plot(res, lat, out / "e2e.png")
    print_table(res)
    print(f"\nwrote {out / 'e2e.json'} and {out / 'e2e.png'} in {res['bench_seconds']:.0f} s")


if __name__ == "__main__":
    main()
