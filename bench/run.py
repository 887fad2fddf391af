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
Then the Redis cost of each fence alone (bench.fence_costs), the Python SDK in
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
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from bench.fence_costs import fence_costs
from bench.peers import run_peers
from bench.sdk import sdk_styles
from bench.stats import RedisMeter, machine_busy_s, percentiles_ms, proc_cpu_s, self_cpu_s
from bench.workloads import FenceMQ, RawStreams, Run, e2e
from fencemq.config import Config
from fencemq.server.embedded import EmbeddedRedis
from fencemq.server.runner import WorkerThread

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"

GOAL_MSGS_PER_S = 50_000
GOAL_RATIO = 0.5
GOAL_P99_LOW_MS = 2.0
GOAL_REDIS_US_PER_MSG = 12.0


class WorkerProcess:
    """bench.serve_worker in a subprocess; SIGTERM drains it."""

    def __init__(self, redis_url: str, profile: str | None = None, trace: str | None = None) -> None:
        cmd = [sys.executable, "-m", "bench.serve_worker", "--redis-url", redis_url]
        if profile:
            cmd += ["--profile", profile]
        if trace:
            cmd += ["--trace", trace]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.startswith("PORT "):
            self.stop()
            raise RuntimeError(f"worker process did not start (said {line!r})")
        self.port = int(line.split()[1])
        self.pid = self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


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

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    dirty = git("status", "--porcelain", "--", "broker", "lua")
    return {
        "git_commit": git("rev-parse", "--short", "HEAD"),
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


def goals(res: dict[str, Any]) -> list[dict[str, Any]]:
    head, raw = res["variants"]["fencemq_process"], res["variants"]["raw"]
    thr = head["throughput"]["msgs_per_s"]
    ratio = thr / raw["throughput"]["msgs_per_s"]
    p99 = head["low_load"]["latency_ms"]["p99"]
    cpu = head["throughput"]["redis"]["cpu_us_per_msg"]
    return [
        {"goal": "throughput", "target": f">= {GOAL_MSGS_PER_S} msg/s", "value": round(thr), "pass": thr >= GOAL_MSGS_PER_S},
        {"goal": "ratio to raw Streams", "target": f">= {GOAL_RATIO}x", "value": round(ratio, 3), "pass": ratio >= GOAL_RATIO},
        {"goal": "p99 publish->deliver at low load", "target": f"<= {GOAL_P99_LOW_MS} ms", "value": round(p99, 3),
         "pass": p99 <= GOAL_P99_LOW_MS},
        {"goal": "Redis CPU per message (INFO cpu)", "target": f"<= {GOAL_REDIS_US_PER_MSG} us", "value": round(cpu, 2),
         "pass": cpu <= GOAL_REDIS_US_PER_MSG},
    ]


LABELS = {"raw": "raw Streams (Lua)", "fencemq_process": "FenceMQ (worker process)",
          "fencemq_thread": "FenceMQ (worker thread)"}
COLORS = {"raw": "#888888", "fencemq_process": "#1f77b4", "fencemq_thread": "#9ecae1"}
PEER_LABELS = {"nats_jetstream": "NATS JetStream (file)", "rabbitmq_quorum": "RabbitMQ (quorum queue)"}


def plot(res: dict[str, Any], lat: dict[str, dict[str, list[int]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["variants"])
    fig, ax = plt.subplots(2, 2, figsize=(13, 9))
    others = max(v["throughput"]["others_cpu_cores"] for v in res["variants"].values())
    fig.suptitle(f"FenceMQ e2e, QoS1, {res['args']['messages']} x {res['args']['size']} B  "
                 f"(Redis {res['machine']['redis_version']}, {res['machine']['cpus']} CPUs, "
                 f"commit {res['machine']['git_commit']}; unrelated processes used up to {others:.1f} CPUs meanwhile)")

    a = ax[0][0]
    peers = {n: p for n, p in res.get("peers", {}).items() if "msgs_per_s" in p}
    vals = [res["variants"][n]["throughput"]["msgs_per_s"] for n in names] + [p["msgs_per_s"] for p in peers.values()]
    bars = a.bar([LABELS[n] for n in names] + [PEER_LABELS[n] for n in peers], vals,
                 color=[COLORS[n] for n in names] + ["#9e9ac8"] * len(peers))
    a.bar_label(bars, labels=[f"{v / 1000:.1f}k" for v in vals])
    a.axhline(GOAL_MSGS_PER_S, color="red", ls="--", lw=1, label=f"goal {GOAL_MSGS_PER_S // 1000}k msg/s")
    a.axhline(GOAL_RATIO * res["variants"]["raw"]["throughput"]["msgs_per_s"], color="orange", ls=":", lw=1,
              label=f"goal {GOAL_RATIO}x raw")
    a.set_ylabel("msg/s, first publish to last ack")
    a.set_title("end-to-end throughput (peers: bench.peers, same run)")
    a.legend(fontsize=8)
    a.tick_params(axis="x", labelsize=8)
    plt.setp(a.get_xticklabels(), rotation=20, ha="right")

    a = ax[0][1]
    for n in names:
        data = sorted(v / 1e6 for v in lat[n]["low_load"])
        if data:
            a.plot(data, [(i + 1) / len(data) for i in range(len(data))], color=COLORS[n], label=LABELS[n])
    a.axvline(GOAL_P99_LOW_MS, color="red", ls="--", lw=1, label=f"goal p99 {GOAL_P99_LOW_MS} ms")
    a.axhline(0.99, color="black", ls=":", lw=0.8)
    a.set_xscale("log")
    a.set_xlabel("publish -> deliver latency (ms, log)")
    a.set_ylabel("CDF")
    a.set_title(f"low load: {res['args']['low_messages']} PUBs at {res['args']['low_rate']:.0f} msg/s")
    a.legend(fontsize=8)

    a = ax[1][0]
    width = 0.2
    xs = range(len(names))
    for k, (key, label) in enumerate([("p50", "flat-out p50"), ("p99", "flat-out p99")]):
        v = [res["variants"][n]["throughput"]["latency_ms"][key] for n in names]
        bars = a.bar([x + (k - 1.5) * width for x in xs], v, width, label=label, color=["#fdae6b", "#e6550d"][k])
        a.bar_label(bars, labels=[f"{x:.0f}" if x >= 10 else f"{x:.2g}" for x in v], fontsize=7)
    for k, (key, label) in enumerate([("p50", "low-load p50"), ("p99", "low-load p99")]):
        v = [res["variants"][n]["low_load"]["latency_ms"][key] for n in names]
        bars = a.bar([x + (k + 0.5) * width for x in xs], v, width, label=label, color=["#a1d99b", "#31a354"][k])
        a.bar_label(bars, labels=[f"{x:.0f}" if x >= 10 else f"{x:.2g}" for x in v], fontsize=7)
    a.axhline(GOAL_P99_LOW_MS, color="red", ls="--", lw=1)
    a.set_yscale("log")
    a.set_xticks(list(xs), [LABELS[n] for n in names], fontsize=8)
    a.set_ylabel("ms (log)")
    a.set_title("publish -> deliver latency")
    a.legend(fontsize=8)

    a = ax[1][1]
    width = 0.38
    series = [("cpu_us_per_msg", "Redis process CPU (INFO cpu)", "#3182bd"),
              ("evalsha_us_per_msg", "EVALSHA time (INFO commandstats)", "#9ecae1")]
    for k, (key, label, color) in enumerate(series):
        v = [res["variants"][n]["throughput"]["redis"][key] for n in names]
        bars = a.bar([x + (k - 0.5) * width for x in xs], v, width, label=label, color=color)
        a.bar_label(bars, labels=[f"{x:.1f}" for x in v], fontsize=7)
    a.axhline(GOAL_REDIS_US_PER_MSG, color="red", ls="--", lw=1, label=f"goal {GOAL_REDIS_US_PER_MSG:g} us")
    a.set_xticks(list(xs), [LABELS[n] for n in names], fontsize=8)
    a.set_ylabel("Redis us per message (flat-out run)")
    a.set_title("Redis cost per message")
    a.legend(fontsize=8)

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(res: dict[str, Any]) -> None:
    head = (f"{'variant':<26}{'msg/s':>9}{'x raw':>7}{'p50 ms':>9}{'p99 ms':>9}{'low p50':>9}{'low p99':>9}"
            f"{'redis us/msg':>13}{'lua us/msg':>11}{'client us':>10}{'worker us':>10}{'others':>8}")
    print()
    print(head)
    print("-" * len(head))
    raw = res["variants"]["raw"]["throughput"]["msgs_per_s"]
    for name, v in res["variants"].items():
        t, low = v["throughput"], v["low_load"]
        w = t["worker_cpu_us_per_msg"]
        print(f"{LABELS[name]:<26}{t['msgs_per_s']:>9.0f}{t['msgs_per_s'] / raw:>7.2f}"
              f"{t['latency_ms']['p50']:>9.2f}{t['latency_ms']['p99']:>9.2f}"
              f"{low['latency_ms']['p50']:>9.3f}{low['latency_ms']['p99']:>9.3f}"
              f"{t['redis']['cpu_us_per_msg']:>13.2f}{t['redis']['evalsha_us_per_msg']:>11.2f}"
              f"{t['client_cpu_us_per_msg']:>10.1f}{'' if w is None else f'{w:.1f}':>10}{t['others_cpu_cores']:>8.2f}")
    print("\nruns (median reported): " + "; ".join(
        f"{LABELS[n]}: {', '.join(f'{x / 1000:.1f}k' for x in v['throughput']['runs_msgs_per_s'])} msg/s, "
        f"low p99 {', '.join(f'{x:.2f}' for x in v['low_load']['runs_p99_ms'])} ms"
        for n, v in res["variants"].items()))
    print("client/worker us = CPU of the bench process / worker process per message; others = CPU cores used "
          "meanwhile by unrelated processes on this machine")
    fc = res.get("fence_costs")
    if fc:
        print(f"\nfences alone ({fc['batch']} msgs per call, {fc['calls']} calls):")
        for f in ("publish", "pull", "ack"):
            c = fc[f]
            inner = sorted(((v["usec"], k, v["calls"]) for k, v in c["commands"].items() if k != "evalsha"), reverse=True)[:4]
            top = ", ".join(f"{k} {u / fc['calls']:.0f}us/{calls // fc['calls']}x" for u, k, calls in inner)
            print(f"  {f:<8} EVALSHA {c['evalsha_us_per_call']:7.1f} us/call = {c['evalsha_us_per_msg']:5.2f} us/msg;"
                  f" Python wall {c['python_wall_us_per_call']:7.1f} us/call; inside: {top}")
    sdk = res.get("sdk", {})
    if sdk:
        print("\nthe Python SDK through a worker process (bench.sdk): " + ", ".join(
            f"{style} {r['msgs_per_s']:,.0f} msg/s" for style, r in sdk.items()))
    peers = res.get("peers", {})
    if peers:
        ours = res["variants"]["fencemq_process"]["throughput"]["msgs_per_s"]
        print("\npeers, same run, at-least-once (bench.peers):")
        for name, p in peers.items():
            if "msgs_per_s" in p:
                print(f"  {PEER_LABELS[name]:<26} {p['msgs_per_s']:>9,.0f} msg/s  flat-out p99 {p['p99_ms']:8.1f} ms  "
                      f"FenceMQ is {ours / p['msgs_per_s']:.1f}x")
            else:
                print(f"  {PEER_LABELS[name]:<26} skipped: {p['skipped']}")
    print("\ngoals (headline = FenceMQ worker process):")
    for g in res["goals"]:
        print(f"  {'PASS' if g['pass'] else 'FAIL'}  {g['goal']:<36} {g['value']!s:>10}  (target {g['target']})")


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

        print("fences alone:", flush=True)
        res["fence_costs"] = asyncio.run(fence_costs(server.url, meter, size=opts.size))
        admin.flushall()

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
