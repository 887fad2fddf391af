"""The soak of issue #27: 20 topics, every message consumed and acknowledged at once; Redis's memory over time.

    python -m bench.retention_soak [--seconds 60] [--out bench/results]

Two runs side by side on fresh private Redis servers, each with a worker in its own process:

* ``no policy`` — retention by choice: what every group has settled leaves Redis;
* ``kept 7 days`` — every topic given the policy main applied to all before issue #27 (1,000,000
  messages, 7 days), which keeps what was consumed.

Producers publish 200 B messages (MPUB of 100) to the 20 topics while one consumer per topic pulls 100 and
acknowledges them at once; then the producers stop and the consumers drain. Redis's ``used_memory`` is
sampled every second. Writes retention_soak.json and retention_soak.png.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from typing import Any

import redis

from bench.harness import ROOT, WorkerProcess
from fencemq.model.keys import Keyspace
from fencemq.server.embedded import EmbeddedRedis

TOPICS = [f"soak{i}" for i in range(20)]
BODY = b"x" * 200
BATCH = 100


def as_map(reply: Any) -> dict[bytes, Any]:
    return reply if isinstance(reply, dict) else dict(zip(reply[::2], reply[1::2]))


def used(admin: redis.Redis) -> int:
    return int(admin.info("memory")["used_memory"])


def produce(port: int, topics: list[str], stop: threading.Event, counts: list[int]) -> None:
    c = redis.Redis(port=port)
    while not stop.is_set():
        for t in topics:
            c.execute_command("MPUB", t, BATCH, *[BODY] * BATCH)
            counts[0] += BATCH


def consume(port: int, topics: list[str], stop: threading.Event, counts: list[int]) -> None:
    c = redis.Redis(port=port)
    c.response_callbacks.clear()
    c.execute_command("CLIENT", "SETNAME", f"soak-{topics[0]}")
    handles = []
    for t in topics:
        reply = c.execute_command("SUB", t, "GROUP", "g")
        handles.append(as_map(reply)[b"handle"])
    idle_rounds = 0
    while True:
        got = 0
        for h in handles:
            batch = c.execute_command("PULL", h, "COUNT", BATCH)
            if batch:
                tags = [as_map(d)[b"tag"] for d in batch]
                c.execute_command("ACK", h, *tags)
                got += len(batch)
        counts[0] += got
        idle_rounds = 0 if got else idle_rounds + 1
        if stop.is_set() and idle_rounds > 3:
            return


def run(name: str, seconds: float, keep: bool) -> dict[str, Any]:
    with EmbeddedRedis() as server:
        admin = redis.Redis.from_url(server.url)
        if keep:
            keys = Keyspace()
            admin.hset(keys.retention, mapping={t: f"1000000 {7 * 24 * 3600 * 1000} 0" for t in TOPICS})
        worker = WorkerProcess(server.url)
        try:
            published, consumed = [0], [0]
            stop_producing, stop_consuming = threading.Event(), threading.Event()
            consumers = [threading.Thread(target=consume, args=(worker.port, TOPICS[i::4], stop_consuming, consumed))
                         for i in range(4)]
            for t in consumers:
                t.start()
            time.sleep(0.5)  # subscribed before the first message
            start = used(admin)
            producers = [threading.Thread(target=produce, args=(worker.port, TOPICS[i::2], stop_producing,
                                                                 published)) for i in range(2)]
            began = time.monotonic()
            for t in producers:
                t.start()
            samples: list[tuple[float, int]] = [(0.0, start)]
            while time.monotonic() - began < seconds:
                time.sleep(1)
                samples.append((time.monotonic() - began, used(admin)))
            stop_producing.set()
            for t in producers:
                t.join()
            stop_consuming.set()
            for t in consumers:
                t.join()
            drained = time.monotonic() - began
            time.sleep(1)
            end = used(admin)
            samples.append((time.monotonic() - began, end))
            return {
                "run": name, "seconds": round(drained, 1), "published": published[0], "consumed": consumed[0],
                "msgs_per_s": round(published[0] / seconds), "used_memory_start_MB": round(start / 1e6, 1),
                "used_memory_peak_MB": round(max(u for _, u in samples) / 1e6, 1),
                "used_memory_end_MB": round(end / 1e6, 1),
                "end_over_start": round(end / start, 2),
                "samples": [(round(t, 1), u) for t, u in samples],
            }
        finally:
            worker.stop()
            admin.close()


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        ax.plot([t for t, _ in r["samples"]], [u / 1e6 for _, u in r["samples"]],
                label=f"{r['run']}: {r['used_memory_start_MB']} -> {r['used_memory_end_MB']} MB")
    ax.set_xlabel("seconds (producers stop at the last-but-one sample; consumers then drain)")
    ax.set_ylabel("Redis used_memory (MB)")
    ax.set_title("Issue #27 soak: 20 topics, every message consumed and acknowledged at once")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    results = [run("no policy", args.seconds, keep=False), run("kept 7 days (main before #27)", args.seconds, keep=True)]
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"shape": {"topics": len(TOPICS), "payload_B": len(BODY), "batch": BATCH, "producers": 2, "consumers": 4},
           "runs": results,
           "note": "the two runs ran one after the other on the same machine (load varies: compare memory, not rates)"}
    (args.out / "retention_soak.json").write_text(json.dumps(doc, indent=2) + "\n")
    plot(results, args.out / "retention_soak.png")
    for r in results:
        print(f"{r['run']}: {r['published']:,} published, {r['consumed']:,} consumed in {r['seconds']} s; "
              f"used_memory {r['used_memory_start_MB']} -> peak {r['used_memory_peak_MB']} -> "
              f"end {r['used_memory_end_MB']} MB ({r['end_over_start']}x the start)")


if __name__ == "__main__":
    main()
