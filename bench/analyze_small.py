"""`fencemq analyze` of a newcomer's small snapshot, as they run it: a cold process, local Spark.

    .venv/bin/python -m bench.analyze_small [--runs 2] [--results bench/results/analyze_small.json]

A private Redis gets what a first hour leaves (20 topics with a consumer group each, a message
acknowledged, one lease run out, 6 lmqs); one snapshot of its 26 queues; then, alternately, ``--runs``
times each: the CLI as shipped (``fencemq analyze``: a snapshot this small gets the settings for small
inputs, spark/session.py) and the same command with the settings every larger snapshot runs with.
Each is a fresh process (JVM start-up included, as a user meets it); measured: wall seconds and the
JVM's CPU seconds. The goal (issue #29): ≤ 30 s on an otherwise idle machine. Figures taken beside
other work are reported with the machine's load; the ratio between the two settings, measured side
by side, is the figure that travels.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

GOAL_S = 30.0
# The CLI with the settings of a large snapshot: the same command, its small-input threshold at -1.
AS_LARGE = ("import sys; from fencemq.spark import session; session.SMALL_ROWS = -1; "
            "from fencemq.cli.main import app; sys.argv = ['fencemq', *sys.argv[1:]]; app()")


async def first_hour(url: str) -> None:
    from redis.asyncio import Redis

    from fencemq.config import Config
    from fencemq.fences.core import Core
    from fencemq.model.handles import Handle

    r = Redis.from_url(url)
    q = Core(r, Config(redis_url=url, default_lock_ms=50))
    try:
        for i in range(20):
            h = Handle.decode((await q.subscriptions.subscribe(f"consumer-{i}", f"topic-{i}", group="g")).handle)
            await q.publishing.publish(f"topic-{i}", [b"hello", b"again"])
            got = (await q.leases.pull(h, 2)).deliveries
            await q.leases.ack(h, [got[0].tag])  # the second one's lease runs out
        for n in range(6):
            await q.publishing.publish("chat", [b"hi"], lmq=f"session-{n}")
    finally:
        await r.aclose()


def timed(argv: list[str], env: dict[str, str]) -> dict[str, float]:
    """Wall seconds of ``argv`` and the CPU seconds of the JVMs it started (sampled until it ends)."""
    started = time.perf_counter()
    proc = psutil.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    jvm: dict[int, float] = {}
    while proc.poll() is None:
        for child in proc.children(recursive=True):
            try:
                if "java" in child.name():
                    jvm[child.pid] = sum(child.cpu_times()[:2])
            except psutil.Error:
                pass
        time.sleep(0.2)
    wall = time.perf_counter() - started
    err = proc.stderr.read().decode()
    if proc.returncode != 0:
        raise SystemExit(f"{argv} exited {proc.returncode}: {err[-2000:]}")
    return {"wall_s": round(wall, 2), "jvm_cpu_s": round(sum(jvm.values()), 1), "stderr_lines": len(err.splitlines())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.analyze_small", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--results", type=Path, default=Path("bench/results/analyze_small.json"))
    args = parser.parse_args(argv)

    from fencemq.server.embedded import EmbeddedRedis

    runs: dict[str, list[dict[str, float]]] = {"small_settings": [], "large_settings": []}
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory(prefix="fencemq-bench-analyze-") as tmp:
        asyncio.run(first_hour(server.url))
        time.sleep(0.2)  # the lease of 50 ms has run out
        snap = Path(tmp) / "snap"
        subprocess.run([sys.executable, "-m", "fencemq.cli.main", "snapshot", "--redis-url", server.url,
                        "--out", str(snap), "--json"], check=True, stdout=subprocess.DEVNULL)
        queues = json.loads((snap / "manifest.json").read_text())["queues"]
        env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
        loads = []
        for i in range(args.runs):
            for name, command in (("small_settings", [sys.executable, "-m", "fencemq.cli.main"]),
                                  ("large_settings", [sys.executable, "-c", AS_LARGE])):
                loads.append(os.getloadavg()[0])
                runs[name].append(timed([*command, "analyze", str(snap), "--out", f"{tmp}/out-{name}-{i}"], env))
                print(name, runs[name][-1], flush=True)
    best = {name: min(r["wall_s"] for r in rs) for name, rs in runs.items()}
    result = {
        "what": "fencemq analyze of a 26-queue snapshot, a cold process on local[*] (JVM start-up included)",
        "queues": queues,
        "runs": runs,
        "best_wall_s": best,
        "jvm_cpu_s_ratio_small_to_large": round(
            sum(r["jvm_cpu_s"] for r in runs["small_settings"]) / max(1e-9, sum(
                r["jvm_cpu_s"] for r in runs["large_settings"])), 2),
        "wall_ratio_small_to_large": round(best["small_settings"] / best["large_settings"], 2),
        "goal_s": GOAL_S,
        "goal_met": best["small_settings"] <= GOAL_S,
        "load_average_during": [round(x, 1) for x in loads],
        "cpus": os.cpu_count(),
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("best_wall_s", "jvm_cpu_s_ratio_small_to_large", "goal_met",
                                             "load_average_during")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
