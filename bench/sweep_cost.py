"""The sweep's cost does not grow with the number of live checkouts (issue 3).

    python -m bench.sweep_cost [--sizes 10000 1000000] [--expired 1000] [--repeat 25] [--out bench/results]

On a private EmbeddedRedis (never the Redis on 127.0.0.1:6379), one queue per
size is filled through ``fencemq.fences.core.Core``: N messages published in MPUB
batches of 1,000, all pulled in batches of 1,000 by one member whose lock is an
hour, so N checkouts are live. Then, per measurement, exactly ``--expired`` of
them (chosen at random) get their deadline set to 0 in the queue's ``dl`` zset —
the clock is poked, nothing is mocked — and ``Core.sweep(qid)`` is timed
three ways:

* wall: the Python time of the call (fence + schedule upkeep, round trips);
* EVALSHA: the fence's own time from ``INFO commandstats`` (``CONFIG
  RESETSTAT`` before). It is elapsed time: a descheduled Redis counts;
* Redis CPU: the server's CPU time over the call (``INFO cpu``), the least
  sensitive to a busy machine.

The member then shows it is alive and pulls the returned messages again, so
every measurement starts from N live checkouts. Sizes are measured interleaved
(10k, 1M, 10k, 1M, ...) so drift hits both alike; the median of ``--repeat``
runs is reported (and the fastest run), with the ratio largest / smallest
(goal: at most 1.5). Writes ``<out>/sweep_cost.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import redis

from bench.harness import private_server
from bench.stats import FENCE_METRICS as METRICS, RedisMeter, interleaved_runs
from bench.stats import fence_summary as summary
from fencemq.config import Config
from fencemq.model.handles import Handle
from fencemq.model.records import Checkout
from fencemq.fences.core import Core
from fencemq.fences.redis_client import connect

GOAL_RATIO = 1.5
LOCK_MS = 3_600_000  # nothing expires by itself while the benchmark runs
BATCH = 1000
MEMBER = "bench-sweeper"


class LiveQueue:
    """One topic whose single consumer holds `size` live checkouts."""

    def __init__(self, queues: Core, size: int) -> None:
        self.queues = queues
        self.size = size
        self.topic = f"sweep-{size}"
        self.handle: Handle | None = None
        self.batches: list[list[str]] = []  # the tags of each PULL: one lease batch each
        self._expired: set[str] = set()

    @property
    def qid(self) -> str:
        assert self.handle is not None
        return self.handle.queue.qid

    async def build(self) -> float:
        t0 = time.perf_counter()
        q = self.queues
        sub = await q.subscriptions.subscribe(MEMBER, self.topic, group="g", lock_ms=LOCK_MS)
        self.handle = Handle.decode(sub.handle)
        payloads = [b"%015d" % i for i in range(BATCH)]
        for _ in range(self.size // BATCH):
            await q.publishing.publish(self.topic, payloads)
        while sum(map(len, self.batches)) < self.size:
            got = await q.leases.pull(self.handle, BATCH)
            assert got.status == "ok" and got.deliveries, got.status
            self.batches.append([d.tag for d in got.deliveries])
        return time.perf_counter() - t0

    async def refill(self, expected: int) -> None:
        """After a sweep: prove alive (any ACK clears suspicion) and check the returned ones out again."""
        assert self.handle is not None
        await self.queues.leases.ack(self.handle, ["0"])
        got = await self.queues.leases.pull(self.handle, BATCH)
        assert got.status == "ok" and len(got.deliveries) == expected, (got.status, len(got.deliveries))
        self.batches = [b for b in self.batches if not self._expired.intersection(b)]
        self.batches.append([d.tag for d in got.deliveries])

    async def measure(self, admin: redis.Redis, meter: RedisMeter, expired: int, rng: random.Random) -> dict[str, Any]:
        keys = self.queues.keys.queue_by_id(self.qid)
        # one lease per PULL (a lease batch): `expired` checkouts are whole batches' deadlines moved back
        assert admin.zcard(keys.deadlines) == len(self.batches), "one lease per PULL"
        assert admin.hlen(keys.checkouts) == self.size + len(self.batches), "a record per checkout, a count per batch"
        chosen = rng.sample(self.batches, max(1, expired // BATCH))
        self._expired = {t for b in chosen for t in b}
        leases = {Checkout.decode(admin.hget(keys.checkouts, b[0])).lease(b[0]) for b in chosen}
        admin.zadd(keys.deadlines, dict.fromkeys(leases, 0), xx=True)
        meter.reset()
        t0 = time.perf_counter()
        result = await self.queues.leases.sweep(self.qid)
        wall = time.perf_counter() - t0
        stats = meter.read()
        assert result.returned == expired, result.returned
        assert {t for _, _, tags, _ in result.timeouts for t in tags} == self._expired
        # the sweep fence, then the queue's next due time written by two O(1) fences (index_scores, and
        # schedule for a checkout made meanwhile) that run when Redis is at maxmemory (issue 27)
        assert stats["evalsha_calls"] == 3, stats["evalsha_calls"]
        await self.refill(expired)
        return {"wall_us": wall * 1e6, "evalsha_us": stats["evalsha_usec"], "redis_cpu_us": stats["cpu_us"]}


async def bench(url: str, sizes: list[int], expired: int, repeat: int, seed: int) -> dict[str, Any]:
    r = connect(url)
    admin = redis.Redis.from_url(url)
    meter = RedisMeter(admin)
    rng = random.Random(seed)
    try:
        queues = Core(r, Config(redis_url=url, max_lock_ms=LOCK_MS, retention_maxlen=0, retention_maxage_ms=0))
        for script in queues.fences.scripts.values():  # no NOSCRIPT round inside a measurement
            admin.script_load(script.script)
        live = [LiveQueue(queues, n) for n in sizes]
        built: dict[int, dict[str, Any]] = {}
        for q in live:
            seconds = await q.build()
            mem = admin.info("memory")["used_memory"]
            built[q.size] = {"build_s": round(seconds, 1), "redis_used_memory_mb_after": round(mem / 2**20)}
            print(f"{q.size:>9,} live checkouts built in {seconds:.1f} s (Redis uses {mem / 2**20:,.0f} MB)",
                  flush=True)
        runs = await interleaved_runs(live, lambda q: q.measure(admin, meter, expired, rng), repeat)
        return {"built": built, "runs": runs}
    finally:
        await r.aclose()
        admin.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 1_000_000], help="live checkouts per queue")
    ap.add_argument("--expired", type=int, default=1000, help="checkouts expired per sweep (whole PULLs of 1,000: one lease each)")
    ap.add_argument("--repeat", type=int, default=25)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args(argv)
    if any(n % BATCH or n < args.expired for n in args.sizes):
        ap.error(f"sizes must be multiples of {BATCH} and at least --expired")

    started = time.perf_counter()
    with private_server() as (server, machine):
        raw = asyncio.run(bench(server.url, args.sizes, args.expired, args.repeat, args.seed))

    sizes = sorted(args.sizes)
    per_size = {str(n): {**raw["built"][n], **summary(raw["runs"][n])} for n in sizes}
    small, large = per_size[str(sizes[0])], per_size[str(sizes[-1])]
    ratio_wall = large["median_wall_us"] / small["median_wall_us"]
    ratio_lua = large["median_evalsha_us"] / small["median_evalsha_us"]
    ratio_cpu = large["median_redis_cpu_us"] / small["median_redis_cpu_us"]
    ratio_min = {m: large["min_" + m] / small["min_" + m] for m in METRICS}
    res = {
        "what": f"Leases.sweep returning {args.expired} expired checkouts among N live ones",
        "machine": machine,
        "expired_per_sweep": args.expired,
        "repeat": args.repeat,
        "sizes": per_size,
        "ratio_wall": ratio_wall,
        "ratio_evalsha": ratio_lua,
        "ratio_redis_cpu": ratio_cpu,
        "ratio_of_minimums": ratio_min,
        "loadavg_at_end": os.getloadavg(),
        "goal": {"max_ratio": GOAL_RATIO, "met_wall": ratio_wall <= GOAL_RATIO, "met_evalsha": ratio_lua <= GOAL_RATIO,
                 "met_redis_cpu": ratio_cpu <= GOAL_RATIO},
        "total_s": round(time.perf_counter() - started, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "sweep_cost.json"
    path.write_text(json.dumps(res, indent=2) + "\n")

    print(f"\nsweep of {args.expired:,} expired checkouts (median of {args.repeat}):")
    print(f"{'live checkouts':>15} {'wall ms':>9} {'EVALSHA ms':>11} {'Redis CPU ms':>13}")
    for n in sizes:
        s = per_size[str(n)]
        print(f"{n:>15,} {s['median_wall_us'] / 1000:>9.2f} {s['median_evalsha_us'] / 1000:>11.2f} "
              f"{s['median_redis_cpu_us'] / 1000:>13.2f}")
    print("ratio of the fastest runs: " + ", ".join(f"{m.removesuffix('_us')} {v:.2f}x" for m, v in ratio_min.items()))
    verdict = "met" if all(v for k, v in res["goal"].items() if k.startswith("met_")) else "NOT met on every measure"
    print(f"ratio {sizes[-1]:,} / {sizes[0]:,}: wall {ratio_wall:.2f}x, EVALSHA {ratio_lua:.2f}x, "
          f"Redis CPU {ratio_cpu:.2f}x "
          f"(goal <= {GOAL_RATIO}x: {verdict}); {res['total_s']} s in all; wrote {path}")


if __name__ == "__main__":
    main()
