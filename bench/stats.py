"""CPU and command-time meters: the Redis server (INFO), and processes (/proc)."""

from __future__ import annotations

import os
import statistics
from typing import Any, Awaitable, Callable, Iterable

import redis

_TICK = os.sysconf("SC_CLK_TCK")


class RedisMeter:
    """CONFIG RESETSTAT + INFO cpu before, INFO commandstats + INFO cpu after."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._cpu0 = 0.0

    def _cpu(self) -> float:
        info = self.client.info("cpu")
        return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])

    def reset(self) -> None:
        self.client.config_resetstat()
        self._cpu0 = self._cpu()

    def read(self) -> dict[str, Any]:
        cpu = self._cpu() - self._cpu0
        stats = self.client.info("commandstats")
        commands = {k.removeprefix("cmdstat_"): {"calls": int(v["calls"]), "usec": int(v["usec"])}
                    for k, v in stats.items()}
        # the INFO/CONFIG calls of the meter itself are not the workload's
        for admin in ("info", "config|resetstat", "config"):
            commands.pop(admin, None)
        ev = commands.get("evalsha", {"calls": 0, "usec": 0})
        return {
            "cpu_us": cpu * 1e6,
            "cmd_usec": sum(c["usec"] for c in commands.values()),
            "evalsha_usec": ev["usec"],
            "evalsha_calls": ev["calls"],
            "commands": commands,
        }


def proc_cpu_s(pid: int) -> float:
    """user+system CPU seconds of a process (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def rss(pid: int) -> int:
    """Resident memory of a process, bytes (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def machine_busy_s() -> float:
    """CPU seconds all CPUs spent busy since boot (/proc/stat), to see load from others."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (v + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / _TICK


def self_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def percentiles_ms(values_ns: Iterable[int]) -> dict[str, float]:
    data = sorted(values_ns)
    if not data:
        return {}

    def q(p: float) -> float:
        i = min(len(data) - 1, max(0, int(round(p * (len(data) - 1)))))
        return data[i] / 1e6

    return {"p50": q(0.50), "p90": q(0.90), "p99": q(0.99), "p999": q(0.999), "max": data[-1] / 1e6,
            "mean": statistics.fmean(data) / 1e6, "n": len(data)}


def run_and_write(name: str, main_async: Any, args: Any) -> dict[str, Any]:
    """Run a bench's async main, time it, write ``<args.out>/<name>.json``."""
    import asyncio
    import json
    import time
    from pathlib import Path

    t0 = time.perf_counter()
    result = asyncio.run(main_async(args))
    result["seconds"] = round(time.perf_counter() - t0, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


# What a fence-cost bench (sweep_cost, schedule) measures of one call, and its summary per size.
FENCE_METRICS = ("wall_us", "evalsha_us", "redis_cpu_us")


def fence_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in FENCE_METRICS:
        out["median_" + m] = statistics.median(r[m] for r in runs)
        out["min_" + m] = min(r[m] for r in runs)
    out["runs"] = runs
    return out


async def interleaved_runs(items: list[Any], measure: Callable[[Any], Awaitable[dict[str, Any]]],
                           repeat: int) -> dict[int, list[dict[str, Any]]]:
    """A warm-up call per item (script cache, first-touch effects), then ``repeat`` rounds that measure
    each item in turn, so the machine's drift touches every size alike; runs by ``item.size``."""
    for item in items:
        await measure(item)
    runs: dict[int, list[dict[str, Any]]] = {item.size: [] for item in items}
    for _ in range(repeat):
        for item in items:
            runs[item.size].append(await measure(item))
    return runs
