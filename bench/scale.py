"""Scale run: 1, 2 and 3 Redis Cluster masters, one worker process and one topic per master.

    python -m bench.scale [--messages 50000] [--masters 1,2,3] [--out bench/results]

For each cluster size a private cluster is formed (``fencemq.server.embedded.start_cluster``),
one worker process per master is started (``bench.serve_worker``, each knowing the whole
cluster), and every worker gets a producer and a consumer of its own on a topic whose slot
lives on "its" master, so each shard takes the same load. All pairs run at once
(``bench.workloads.e2e``: MPUB batches of 100, PULL COUNT 100, ACK). Reported per size:
total msg/s, msg/s per shard, Redis CPU per message on each master (INFO cpu over the run /
messages routed to it), worker CPU per message, and the CPU the machine had.

The ceiling per shard is what one master's Redis CPU per message allows (1e6 / µs per
message); the growth with shards is what the total does. On a machine with fewer cores
than masters + workers + the bench process, the machine caps the total, not FenceMQ: the
output says so. Writes ``<out>/scale.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from redis.crc import key_slot

from bench.harness import WorkerProcess, git_commit
from bench.stats import proc_cpu_s
from bench.workloads import FenceMQ, e2e
from fencemq.model.keys import Keyspace, QueueRef
from fencemq.server.embedded import start_cluster

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
KEYS = Keyspace("fmq")


def redis_cpu_s(client: Any) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def topic_on(slots: range, tag: str) -> str:
    """A topic name whose queue keys hash into ``slots``."""
    for k in range(100_000):
        topic = f"{tag}-{k}"
        if key_slot(KEYS.queue(QueueRef(topic)).meta.encode()) in slots:
            return topic
    raise RuntimeError(f"no topic of {tag} hashes into {slots}")


def slot_ranges(masters: int) -> list[range]:
    per = 16384 // masters
    return [range(i * per, 16384 if i == masters - 1 else (i + 1) * per) for i in range(masters)]


async def all_pairs(ports: list[int], topics: list[str], total: int, size: int) -> list[Any]:
    return await asyncio.gather(*(e2e(HOST, port, lambda i, t=topic: FenceMQ(t), total=total, size=size)
                                  for port, topic in zip(ports, topics, strict=True)))


def one_size(masters: int, total: int, size: int, run_tag: str) -> dict[str, Any]:
    servers = start_cluster(masters)
    workers: list[WorkerProcess] = []
    try:
        clients = [srv.client() for srv in servers]
        workers = [WorkerProcess(servers[0].url) for _ in range(masters)]
        ports = [w.port for w in workers]
        topics = [topic_on(r, f"{run_tag}-m{masters}-s{i}") for i, r in enumerate(slot_ranges(masters))]
        asyncio.run(all_pairs(ports, topics, min(5000, total), size))  # warm-up: scripts, connections, slots
        topics = [topic_on(r, f"{run_tag}-m{masters}-s{i}-run") for i, r in enumerate(slot_ranges(masters))]
        cpu0 = [redis_cpu_s(c) for c in clients]
        w0 = [proc_cpu_s(w.pid) for w in workers]
        t0 = time.perf_counter()
        runs = asyncio.run(all_pairs(ports, topics, total, size))
        wall = time.perf_counter() - t0
        cpu = [redis_cpu_s(c) - x for c, x in zip(clients, cpu0, strict=True)]
        wcpu = [proc_cpu_s(w.pid) - x for w, x in zip(workers, w0, strict=True)]
        for c in clients:
            c.close()
    finally:
        for w in workers:
            w.stop()
        for srv in servers:
            srv.stop()
    per_shard = [r.messages / r.seconds for r in runs]
    redis_us = [c * 1e6 / max(1, r.messages) for c, r in zip(cpu, runs, strict=True)]
    return {
        "masters": masters,
        "messages_per_shard": total,
        "total_msgs_per_s": sum(r.messages for r in runs) / wall,
        "msgs_per_s_per_shard": per_shard,
        "redis_cpu_us_per_msg_per_shard": redis_us,
        "ceiling_per_shard_msgs_per_s": [1e6 / u if u else None for u in redis_us],
        "worker_cpu_us_per_msg": [c * 1e6 / max(1, r.messages) for c, r in zip(wcpu, runs, strict=True)],
        "processes_busy": 2 * masters + 1,  # masters + workers + this bench
        "cpus": os.cpu_count(),
        "seconds": wall,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=50_000, help="messages per shard")
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--masters", default="1,2,3")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    opts = ap.parse_args(argv)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = [int(x) for x in opts.masters.split(",")]
    tag = f"scale{int(time.time())}"
    results = []
    for n in sizes:
        print(f"{n} master(s), one worker each, {opts.messages} messages per shard ...", flush=True)
        r = one_size(n, opts.messages, opts.size, tag)
        results.append(r)
        shards = ", ".join(f"{t / 1000:.1f}k msg/s at {u:.1f} us Redis CPU/msg"
                           for t, u in zip(r["msgs_per_s_per_shard"], r["redis_cpu_us_per_msg_per_shard"], strict=True))
        print(f"  total {r['total_msgs_per_s'] / 1000:.1f}k msg/s; per shard: {shards}", flush=True)
    cpus = os.cpu_count() or 1
    capped = [r["masters"] for r in results if r["processes_busy"] > cpus]
    note = (f"this machine has {cpus} CPUs; with {', '.join(map(str, capped))} master(s) the masters, workers and the "
            "bench share them, so the machine, not FenceMQ, caps the total: read the per-shard Redis CPU per "
            "message (the ceiling of a shard) rather than the total" if capped else "every process had a CPU")
    print(note)
    doc = {"benchmark": "scale", "git_commit": git_commit(), "args": vars(opts), "sizes": results, "note": note}
    (out / "scale.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out / 'scale.json'}")


if __name__ == "__main__":
    main()
