"""Priority queues (issue 34): a priority queue's publish + pull + ack throughput against a plain queue's,
in the same run.

    python -m bench.priority [--messages 20000] [--batch 100] [--repeat 7] [--out bench/results]

On a private EmbeddedRedis (never the Redis on 127.0.0.1:6379), two plain topics, one set to honour
priority (lua/prioritize.lua), each with one group and one member, through ``fencemq.fences.core.Core``
(the fences a worker runs, without the RESP layer). A round publishes ``--messages`` messages of 128
bytes in MPUB-sized batches of ``--batch`` (to the priority topic each batch at a random level 0-9, so
every level is in use), then pulls them ``--batch`` at a time and ACKs each pull, until drained. The two
topics are measured interleaved, ``--repeat`` rounds after a warm-up; reported: the median messages per
second of the whole cycle and of each phase, Redis's CPU per message (``INFO cpu``), the memory of the
priority index per message held (``MEMORY USAGE``, the whole round's backlog), and the ratio priority / plain. Writes ``<out>/priority.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path

import redis

from bench.harness import private_server
from bench.stats import RedisMeter
from fencemq.config import Config
from fencemq.fences.core import Core
from fencemq.fences.priority import PRIORITIZE
from fencemq.fences.redis_client import connect
from fencemq.model.keys import QueueRef
from fencemq.model.handles import Handle

PAYLOAD = b"x" * 128


class Topic:
    def __init__(self, core: Core, name: str, priority: bool) -> None:
        self.core, self.name, self.priority = core, name, priority
        self.size = name  # interleaving key
        self.handle: Handle | None = None

    async def setup(self) -> None:
        if self.priority:
            await self.core.fences.run(PRIORITIZE, self.core.keys.queue(QueueRef(self.name)), on=1)
        sub = await self.core.subscriptions.subscribe("bench", self.name, group="g")
        self.handle = Handle.decode(sub.handle)

    async def round(self, n: int, batch: int, rng: random.Random, meter: RedisMeter,
                    admin: redis.Redis) -> dict[str, float]:
        assert self.handle is not None
        meter.reset()
        t0 = time.perf_counter()
        for start in range(0, n, batch):
            level = rng.randrange(10) if self.priority else None
            await self.core.shared.publish(self.name, [PAYLOAD] * min(batch, n - start), priority=level)
        t1 = time.perf_counter()
        cpu_publish = meter.read()["cpu_us"]
        index = admin.memory_usage(self.core.keys.queue(QueueRef(self.name)).priority, samples=0) or 0
        meter.reset()
        t1b = time.perf_counter()
        got = 0
        while True:
            res = await self.core.leases.pull(self.handle, batch)
            if not res.deliveries:
                break
            got += len(res.deliveries)
            await self.core.leases.ack(self.handle, [d.tag for d in res.deliveries])
        t2 = time.perf_counter()
        cpu = cpu_publish + meter.read()["cpu_us"]
        assert got == n, (self.name, got, n)
        return {"publish_per_s": n / (t1 - t0), "pull_ack_per_s": n / (t2 - t1b),
                "cycle_per_s": n / (t1 - t0 + t2 - t1b), "redis_cpu_us_per_message": cpu / n,
                "index_bytes_per_message": index / n}


async def bench(url: str, n: int, batch: int, repeat: int, seed: int) -> dict[str, list[dict[str, float]]]:
    r = connect(url)
    admin = redis.Redis.from_url(url)
    meter = RedisMeter(admin)
    rng = random.Random(seed)
    try:
        core = Core(r, Config(redis_url=url, max_batch=max(batch, 1000)))
        topics = [Topic(core, "plain", False), Topic(core, "prio", True)]
        for t in topics:
            await t.setup()
            await t.round(min(n, 2000), batch, rng, meter, admin)  # warm-up: scripts loaded, keys made
        runs: dict[str, list[dict[str, float]]] = {t.name: [] for t in topics}
        for i in range(repeat):
            for t in topics if i % 2 == 0 else topics[::-1]:
                runs[t.name].append(await t.round(n, batch, rng, meter, admin))
        return runs
    finally:
        await r.aclose()
        admin.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=20_000, help="messages per round and topic")
    ap.add_argument("--batch", type=int, default=100, help="MPUB size and PULL COUNT")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args(argv)

    started = time.perf_counter()
    with private_server() as (server, machine):
        runs = asyncio.run(bench(server.url, args.messages, args.batch, args.repeat, args.seed))

    metrics = ("cycle_per_s", "publish_per_s", "pull_ack_per_s", "redis_cpu_us_per_message", "index_bytes_per_message")
    medians = {name: {m: round(statistics.median(r[m] for r in rs), 2) for m in metrics} for name, rs in runs.items()}
    res = {
        "what": f"publish {args.messages:,} x 128 B in batches of {args.batch}, then pull {args.batch} + ACK until "
                "drained; one group, one member; a plain topic against one honouring priority (levels 0-9 at random "
                "per batch), interleaved",
        "machine": machine,
        "messages": args.messages,
        "batch": args.batch,
        "repeat": args.repeat,
        "median": medians,
        "ratio_priority_over_plain": {m: round(medians["prio"][m] / medians["plain"][m], 3) for m in metrics[:4]},
        "runs": runs,
        "loadavg_at_end": os.getloadavg(),
        "total_s": round(time.perf_counter() - started, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "priority.json").write_text(json.dumps(res, indent=2) + "\n")
    print(f"\nmedian of {args.repeat} rounds of {args.messages:,} messages (batch {args.batch}):")
    print(f"{'queue':>6} {'cycle/s':>9} {'publish/s':>10} {'pull+ack/s':>11} {'Redis CPU us/msg':>17} "
          f"{'index B/msg':>12}")
    for name in ("plain", "prio"):
        m = medians[name]
        print(f"{name:>6} {m['cycle_per_s']:>9,.0f} {m['publish_per_s']:>10,.0f} {m['pull_ack_per_s']:>11,.0f} "
              f"{m['redis_cpu_us_per_message']:>17.2f} {m['index_bytes_per_message']:>12.1f}")
    print("priority / plain: " + ", ".join(f"{m} {v:.2f}" for m, v in res["ratio_priority_over_plain"].items()))


if __name__ == "__main__":
    main()
