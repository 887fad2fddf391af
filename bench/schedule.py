"""Scheduled messages (issue 34): memory per scheduled message, and the release's cost does not grow
with how many are scheduled.

    python -m bench.schedule [--sizes 10000 1000000] [--due 1000] [--repeat 15] [--out bench/results]

On a private EmbeddedRedis (never the Redis on 127.0.0.1:6379), one plain topic per size is given N
messages of 128 bytes published for later through ``fencemq.fences.core.Core`` (MPUB … AT in
batches of 1,000, the batches' due times spread over the hour after the build, as a job queue's
would be). Redis's ``used_memory`` before and after gives the memory per scheduled message. Then,
per measurement, exactly ``--due`` of them (chosen at random) are made due by setting their score in
the queue's ``sch`` zset to 0 — the clock is poked, nothing is mocked — and
``Scheduling.release`` (lua/release.lua, what the sweeper runs) is timed three ways, as
bench/sweep_cost.py times the lease sweep: wall (Python), EVALSHA (``INFO commandstats``), Redis
CPU (``INFO cpu``). The same number is then scheduled again, so every measurement starts from N.
Sizes are measured interleaved; the median of ``--repeat`` runs is reported, with the ratio
largest / smallest (goal: at most 1.5, the lease sweep's). Writes ``<out>/schedule.json``.
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
from fencemq.fences.core import Core
from fencemq.fences.redis_client import connect
from fencemq.model.keys import QueueRef

GOAL_RATIO = 1.5
BATCH = 1000
HOUR_MS = 3_600_000
PAYLOAD = b"x" * 128


class Scheduled:
    """One topic holding `size` messages scheduled within the hour."""

    def __init__(self, core: Core, size: int) -> None:
        self.core, self.size = core, size
        self.ref = QueueRef(f"sched-{size}")

    async def schedule(self, n: int, at_ms: int) -> None:
        for start in range(0, n, BATCH):
            await self.core.publishing.publish(self.ref.topic, [PAYLOAD] * min(BATCH, n - start), at_ms=at_ms)

    async def build(self, admin: redis.Redis) -> dict[str, Any]:
        before = admin.info("memory")["used_memory"]
        t0 = time.perf_counter()
        now = await self.core.clock.now_ms()
        batches = self.size // BATCH
        for b in range(batches):
            await self.schedule(BATCH, now + 60_000 + b * (HOUR_MS - 60_000) // batches)
        seconds = time.perf_counter() - t0
        used = admin.info("memory")["used_memory"] - before
        return {"build_s": round(seconds, 1), "bytes_per_scheduled_message": round(used / self.size, 1),
                "redis_used_memory_mb_for_them": round(used / 2**20, 1)}

    async def measure(self, admin: redis.Redis, meter: RedisMeter, due: int, rng: random.Random) -> dict[str, Any]:
        k = self.core.keys.queue(self.ref)
        assert admin.zcard(k.scheduled) == self.size
        chosen = admin.zrandmember(k.scheduled, due)
        admin.zadd(k.scheduled, dict.fromkeys(chosen, 0), xx=True)
        now = await self.core.clock.now_ms()
        meter.reset()
        t0 = time.perf_counter()
        ids, _next = await self.core.scheduling.release(self.ref, now)
        wall = time.perf_counter() - t0
        stats = meter.read()
        assert len(ids) == due, len(ids)
        assert stats["evalsha_calls"] == 1, stats["evalsha_calls"]
        await self.schedule(due, now + 60_000 + rng.randrange(HOUR_MS - 60_000))
        return {"wall_us": wall * 1e6, "evalsha_us": stats["evalsha_usec"], "redis_cpu_us": stats["cpu_us"]}


async def bench(url: str, sizes: list[int], due: int, repeat: int, seed: int) -> dict[str, Any]:
    r = connect(url)
    admin = redis.Redis.from_url(url)
    meter = RedisMeter(admin)
    rng = random.Random(seed)
    try:
        core = Core(r, Config(redis_url=url, sweep_batch=due, max_batch=BATCH))
        for script in core.fences.scripts.values():  # no NOSCRIPT round inside a measurement
            admin.script_load(script.script)
        queues = [Scheduled(core, n) for n in sizes]
        built: dict[int, dict[str, Any]] = {}
        for q in queues:
            built[q.size] = await q.build(admin)
            print(f"{q.size:>9,} scheduled: {built[q.size]}", flush=True)
        runs = await interleaved_runs(queues, lambda q: q.measure(admin, meter, due, rng), repeat)
        return {"built": built, "runs": runs}
    finally:
        await r.aclose()
        admin.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 1_000_000], help="scheduled messages per topic")
    ap.add_argument("--due", type=int, default=1000, help="messages made due per release")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args(argv)
    if any(n % BATCH or n < args.due for n in args.sizes) or args.due > BATCH:
        ap.error(f"sizes must be multiples of {BATCH} and at least --due; --due at most {BATCH}")

    started = time.perf_counter()
    with private_server() as (server, machine):
        raw = asyncio.run(bench(server.url, args.sizes, args.due, args.repeat, args.seed))

    sizes = sorted(args.sizes)
    per_size = {str(n): {**raw["built"][n], **summary(raw["runs"][n])} for n in sizes}
    small, large = per_size[str(sizes[0])], per_size[str(sizes[-1])]
    ratios = {m: large["median_" + m] / small["median_" + m] for m in METRICS}
    res = {
        "what": f"Scheduling.release of {args.due} due messages among N scheduled within the hour; memory per "
                "scheduled message",
        "machine": machine,
        "due_per_release": args.due,
        "repeat": args.repeat,
        "sizes": per_size,
        "ratios": ratios,
        "ratio_of_minimums": {m: large["min_" + m] / small["min_" + m] for m in METRICS},
        "loadavg_at_end": os.getloadavg(),
        "goal": {"max_ratio": GOAL_RATIO, **{f"met_{m}": v <= GOAL_RATIO for m, v in ratios.items()}},
        "total_s": round(time.perf_counter() - started, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "schedule.json").write_text(json.dumps(res, indent=2) + "\n")

    print(f"\nrelease of {args.due:,} due messages (median of {args.repeat}):")
    print(f"{'scheduled':>11} {'B/message':>10} {'wall ms':>9} {'EVALSHA ms':>11} {'Redis CPU ms':>13}")
    for n in sizes:
        s = per_size[str(n)]
        print(f"{n:>11,} {s['bytes_per_scheduled_message']:>10} {s['median_wall_us'] / 1000:>9.2f} "
              f"{s['median_evalsha_us'] / 1000:>11.2f} {s['median_redis_cpu_us'] / 1000:>13.2f}")
    print("ratio largest/smallest: " + ", ".join(f"{m} {v:.2f}" for m, v in ratios.items())
          + f" (goal <= {GOAL_RATIO})")


if __name__ == "__main__":
    main()
