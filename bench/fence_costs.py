"""Redis-side cost of each fence alone: publish, pull and ack of 100 messages per call.

Drives fencemq.fences.core.Core directly (redis-py asyncio, no worker, no RESP
server in between) on the bench's private server: publish 100, pull 100, ack
100, repeated, with CONFIG RESETSTAT before and INFO commandstats after each
call: Lua time per call and per message (EVALSHA usec; the commands the script
runs are counted inside it and also listed), and the Python-side wall time per
call (redis-py + Core + round trip).
"""

from __future__ import annotations

import time
from typing import Any

from redis.asyncio import Redis

from bench.stats import RedisMeter
from fencemq.config import Config
from fencemq.model.handles import Handle
from fencemq.fences.core import Core


async def fence_costs(url: str, meter: RedisMeter, *, calls: int = 200, batch: int = 100, size: int = 128) -> dict[str, Any]:
    redis = Redis.from_url(url, protocol=2)
    try:
        queues = Core(redis, Config(redis_url=url))
        topic = "bench-fence-costs"
        sub = await queues.subscriptions.subscribe("bench-fence-client", topic, group="g")
        handle = Handle.decode(sub.handle)
        # warm up: script cache, topic kind cache
        await queues.publishing.publish(topic, [b"w"])
        warm = await queues.leases.pull(handle, 1)
        await queues.leases.ack(handle, [d.tag for d in warm.deliveries])

        payloads = [b"x" * size] * batch
        totals = {f: {"evalsha_usec": 0, "evalsha_calls": 0, "cmd_usec": 0, "wall": 0.0, "commands": {}}
                  for f in ("publish", "pull", "ack")}

        async def measure(name: str, call) -> Any:
            meter.reset()
            t0 = time.perf_counter()
            result = await call
            wall = time.perf_counter() - t0
            s = meter.read()
            t = totals[name]
            t["wall"] += wall
            for key in ("evalsha_usec", "evalsha_calls", "cmd_usec"):
                t[key] += s[key]
            for c, v in s["commands"].items():
                acc = t["commands"].setdefault(c, {"calls": 0, "usec": 0})
                acc["calls"] += v["calls"]
                acc["usec"] += v["usec"]
            return result

        # The e2e shape: publish a batch, pull it, ack it. Checkouts stay few, as
        # in a consumer that keeps up (small hashes/zsets stay listpacks).
        pulled = 0
        for _ in range(calls):
            await measure("publish", queues.publishing.publish(topic, payloads))
            res = await measure("pull", queues.leases.pull(handle, batch))
            tags = [d.tag for d in res.deliveries]
            pulled += len(tags)
            await measure("ack", queues.leases.ack(handle, tags))

        out: dict[str, Any] = {"calls": calls, "batch": batch, "pulled": pulled}
        n = calls * batch
        for name, t in totals.items():
            out[name] = {
                "evalsha_us_per_call": t["evalsha_usec"] / max(1, t["evalsha_calls"]),
                "evalsha_us_per_msg": t["evalsha_usec"] / n,
                "all_cmds_us_per_msg": t["cmd_usec"] / n,
                "python_wall_us_per_call": t["wall"] * 1e6 / calls,
                "commands": t["commands"],
            }
        return out
    finally:
        await redis.aclose()
