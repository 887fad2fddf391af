"""Where FenceMQ's time goes: small experiments on a private server (not part of `make bench`).

    python -m bench.probe [--out bench/results]

1. Lua: the cost of one redis.call() from a script beyond the command itself.
2. Lua: 100 x HGET vs one HMGET of 100 fields (pull.lua reads the log one HGET per message).
3. Listpack: HSET/ZADD of 100 new entries into a small key (listpack, O(n) per entry)
   vs the same with listpacks disabled (hashtable/skiplist).
4. ack.lua as shipped vs a batched prototype (one HMGET, one HDEL, two ZREMs per call),
   on checkouts made by the real pull fence.
5. The fences alone (bench.fence_costs) with zset-max-listpack-entries 0, vs default
   (hashes keep their listpacks: idle lmqs rely on them for memory).
6. Round trips through a worker process: PING, PUB, empty PULL, vs PING to Redis.
7. The low-load publish -> deliver path through a worker process, step by step
   (bench.serve_worker --trace wraps Core.publish/pull/schedule and Waiter.fire).
Writes <out>/probe.json and prints a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from bench.fence_costs import fence_costs
from bench.resp import RespConn
from bench.harness import HOST, ROOT, WorkerProcess
from bench.stats import RedisMeter, percentiles_ms
from fencemq.config import Config
from fencemq.server.embedded import EmbeddedRedis
from fencemq.model.handles import Handle
from fencemq.fences.core import Core

BATCHED_ACK_LUA = r"""
-- prototype, for measurement only: ack.lua with one HMGET and batched deletes
local SEP = '\0'
local meta, co, dl, own = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local g, m = ARGV[1], ARGV[2]
local tags = {}
for i = 3, #ARGV do tags[#tags + 1] = ARGV[i] end
if #tags == 0 then return 0 end
local recs = redis.call('HMGET', co, unpack(tags))
local prefix = g .. SEP .. m .. SEP
local del, owned = {}, {}
for i, tag in ipairs(tags) do
  local rec = recs[i]
  if rec and string.sub(rec, 1, #prefix) == prefix then
    del[#del + 1] = tag
    owned[#owned + 1] = prefix .. tag
  end
end
if #del > 0 then
  redis.call('HDEL', co, unpack(del))
  redis.call('ZREM', dl, unpack(del))
  redis.call('ZREM', own, unpack(owned))
  redis.call('HDEL', meta, 'm|' .. g .. '|' .. m .. '|sus')
end
return #del
"""


def cmd(meter: RedisMeter, name: str) -> dict[str, int]:
    return meter.read()["commands"].get(name, {"calls": 0, "usec": 0})


def lua_call_overhead(admin: Any, meter: RedisMeter, n: int = 20000) -> dict[str, float]:
    admin.delete("probe:h")
    admin.hset("probe:h", mapping={f"f{i}": "v" for i in range(200)})  # hashtable encoding
    script = "for i = 1, tonumber(ARGV[1]) do redis.call('HGET', KEYS[1], 'f7') end return 1"
    admin.eval(script, 1, "probe:h", 1)
    meter.reset()
    admin.eval(script, 1, "probe:h", n)
    ev, hget = cmd(meter, "eval"), cmd(meter, "hget")
    return {"calls": n, "eval_us_per_call": ev["usec"] / n, "hget_us": hget["usec"] / n,
            "overhead_us_per_redis_call": (ev["usec"] - hget["usec"]) / n}


def hget_vs_hmget(admin: Any, meter: RedisMeter, reps: int = 200) -> dict[str, float]:
    admin.delete("probe:log")
    pipe = admin.pipeline(transaction=False)
    for start in range(1, 100_001, 1000):
        pipe.hset("probe:log", mapping={i: b"1700000000000:" + b"x" * 140 for i in range(start, start + 1000)})
    pipe.execute()
    loop = "local out = {} for i = 0, 99 do out[#out + 1] = redis.call('HGET', KEYS[1], ARGV[1] + i) end return #out"
    one = ("local f = {} for i = 0, 99 do f[#f + 1] = ARGV[1] + i end "
           "local out = redis.call('HMGET', KEYS[1], unpack(f)) return #out")
    res = {}
    for name, script in (("100x HGET", loop), ("1x HMGET 100", one)):
        admin.eval(script, 1, "probe:log", 1)
        meter.reset()
        for r in range(reps):
            admin.eval(script, 1, "probe:log", 1 + (r * 100) % 99_000)
        res[name + " us/call"] = cmd(meter, "eval")["usec"] / reps
    admin.delete("probe:log")
    return res


def listpack_inserts(admin: Any, meter: RedisMeter, reps: int = 200) -> dict[str, float]:
    zadd = ("local a = {} for i = 1, 100 do a[#a + 1] = 0; a[#a + 1] = ARGV[1] .. '\0anon-bench-client-1\0' .. i end "
            "redis.call('ZADD', KEYS[1], unpack(a)) redis.call('DEL', KEYS[1]) return 1")
    hset = ("local a = {} for i = 1, 100 do a[#a + 1] = tostring(1000000 + i); "
            "a[#a + 1] = ARGV[1] .. '\0anon-bench-client-1\0' .. i .. '\0' .. '0\0' .. '1\0' .. '0' end "
            "redis.call('HSET', KEYS[1], unpack(a)) redis.call('DEL', KEYS[1]) return 1")
    out: dict[str, float] = {}
    defaults = {k: admin.config_get(k)[k] for k in ("zset-max-listpack-entries", "hash-max-listpack-entries")}
    try:
        for mode, value in (("listpack", None), ("no listpack", "0")):
            for k in defaults:
                admin.config_set(k, value if value is not None else defaults[k])
            for name, script, inner in (("ZADD 100", zadd, "zadd"), ("HSET 100", hset, "hset")):
                meter.reset()
                for _ in range(reps):
                    admin.eval(script, 1, "probe:small", "g")
                out[f"{name} ({mode}) us/call"] = cmd(meter, inner)["usec"] / reps
    finally:
        for k, v in defaults.items():
            admin.config_set(k, v)
    return out


async def ack_prototype(url: str, meter: RedisMeter, rounds: int = 50) -> dict[str, float]:
    redis = Redis.from_url(url, protocol=2)
    try:
        queues = Core(redis, Config(redis_url=url))
        topic = "probe-ack"
        sub = await queues.subscriptions.subscribe("probe-client", topic, group="g")
        handle = Handle.decode(sub.handle)
        k = queues.keys.queue(handle.queue)
        for _ in range(2 * rounds):
            await queues.publishing.publish(topic, [b"x" * 128] * 100)
        prototype = redis.register_script(BATCHED_ACK_LUA)

        async def shipped(tags: list[str]) -> int:
            return await queues.leases.ack(handle, tags)

        async def batched(tags: list[str]) -> int:
            return int(await prototype(keys=[k.meta, k.checkouts, k.deadlines, k.owned],
                                       args=[handle.group, handle.member, *tags]))

        await batched([])  # load it
        out = {}
        for name, ack in (("ack.lua as shipped (Core.ack)", shipped), ("batched prototype", batched)):
            usec = inner = 0
            for _ in range(rounds):
                res = await queues.leases.pull(handle, 100)
                tags = [d.tag for d in res.deliveries]
                meter.reset()
                n = await ack(tags)
                assert n == len(tags), (name, n, len(tags))
                stats = meter.read()
                usec += stats["evalsha_usec"]
                inner += stats["cmd_usec"] - stats["evalsha_usec"]
                calls = sum(c["calls"] for c in stats["commands"].values()) - stats["evalsha_calls"]
            out[f"{name}: EVALSHA us/call (100 tags)"] = usec / rounds
            out[f"{name}: commands inside, us/call"] = inner / rounds
            out[f"{name}: redis.call()s per call"] = calls
        return out
    finally:
        await redis.aclose()


async def worker_round_trips(worker_port: int, redis_port: int, n: int = 1000) -> dict[str, Any]:
    w = await RespConn.open(HOST, worker_port)
    r = await RespConn.open(HOST, redis_port)
    out: dict[str, Any] = {}
    try:
        sub = await w.call("SUB", "probe-rtt", "GROUP", "g")
        handle = dict(zip(sub[::2], sub[1::2]))[b"handle"]

        async def rtt(conn: RespConn, *args: Any) -> dict[str, float]:
            samples = []
            for _ in range(n):
                t0 = time.perf_counter_ns()
                await conn.call(*args)
                samples.append(time.perf_counter_ns() - t0)
            return percentiles_ms(samples)

        out["PING redis"] = await rtt(r, "PING")
        out["PING worker"] = await rtt(w, "PING")
        out["PUB worker"] = await rtt(w, "PUB", "probe-rtt", b"x" * 128)
        out["PULL COUNT 1 + ACK (1 msg) worker"] = {}
        samples = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            d = await w.call("PULL", handle, "COUNT", 1)
            tag = dict(zip(d[0][::2], d[0][1::2]))[b"tag"]
            await w.call("ACK", handle, tag)
            samples.append(time.perf_counter_ns() - t0)
        out["PULL COUNT 1 + ACK (1 msg) worker"] = percentiles_ms(samples)
        out["PULL empty worker"] = await rtt(w, "PULL", handle, "COUNT", 1)
    finally:
        await w.close()
        await r.close()
    return out


def critical_path(url: str, n: int = 1000, rate: float = 500.0) -> dict[str, Any]:
    """Low-load publish -> deliver through a traced worker process, split into steps (ms, p50/p99)."""
    import tempfile

    from bench.workloads import FenceMQ, e2e

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        worker = WorkerProcess(url, trace=str(path))
        try:
            run = asyncio.run(e2e(HOST, worker.port, lambda i: FenceMQ("probe-path"), total=n, size=128, rate=rate))
        finally:
            worker.stop()
        events = json.loads(path.read_text())
    pub = {s[0]: (e[1], e[2]) for e in events if e[0] == "publish" and len(e[3]) == 1 for s in [e[3]]}
    pulls = {s: (e[1], e[2]) for e in events if e[0] == "pull" for s in e[3]}
    wakes = sorted(e[1] for e in events if e[0] == "wake")
    scheds = sorted((e[1], e[2]) for e in events if e[0] == "schedule")
    # deliveries arrive in publish order with one consumer: latency i belongs to the i-th stamp
    recv = {s: s + lat for s, lat in zip(sorted(pub), run.latencies_ns)}
    import bisect

    steps: dict[str, list[int]] = {k: [] for k in (
        "client send -> worker publish() starts", "publish() (fence + round trip)",
        "publish() start -> wake-up fired (SPUBLISH via pub/sub)", "wake-up -> pull() starts",
        "pull() that delivers (fence + round trip + schedule ZADD)", "  of which schedule ZADD",
        "pull() ends -> client has the reply", "total publish -> deliver")}
    for s, (p0, p1) in pub.items():
        if s not in pulls or s not in recv:
            continue
        q0, q1 = pulls[s]
        i = bisect.bisect_left(wakes, p0)
        if i == len(wakes) or wakes[i] > q0:
            continue  # delivered without waiting (the consumer was not blocked): not this path
        j = bisect.bisect_left(scheds, (q0, 0))
        steps["client send -> worker publish() starts"].append(p0 - s)
        steps["publish() (fence + round trip)"].append(p1 - p0)
        steps["publish() start -> wake-up fired (SPUBLISH via pub/sub)"].append(wakes[i] - p0)
        steps["wake-up -> pull() starts"].append(q0 - wakes[i])
        steps["pull() that delivers (fence + round trip + schedule ZADD)"].append(q1 - q0)
        if j < len(scheds) and scheds[j][1] <= q1:
            steps["  of which schedule ZADD"].append(scheds[j][1] - scheds[j][0])
        steps["pull() ends -> client has the reply"].append(recv[s] - q1)
        steps["total publish -> deliver"].append(recv[s] - s)
    out: dict[str, Any] = {k: percentiles_ms(v) for k, v in steps.items() if v}
    out["messages on this path"] = len(steps["total publish -> deliver"])
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    opts = ap.parse_args(argv)
    res: dict[str, Any] = {}
    with EmbeddedRedis() as server:
        admin = server.client(protocol=2)
        meter = RedisMeter(admin)
        res["lua_call_overhead"] = lua_call_overhead(admin, meter)
        res["hget_vs_hmget"] = hget_vs_hmget(admin, meter)
        res["listpack_inserts"] = listpack_inserts(admin, meter)
        res["ack_prototype"] = asyncio.run(ack_prototype(server.url, meter))
        admin.flushall()
        res["fences_default"] = asyncio.run(fence_costs(server.url, meter))
        admin.flushall()
        saved = {k: admin.config_get(k)[k] for k in ("zset-max-listpack-entries",)}
        for k in saved:
            admin.config_set(k, "0")
        try:
            res["fences_zset_max_listpack_entries_0"] = asyncio.run(fence_costs(server.url, meter))
        finally:
            for k, v in saved.items():
                admin.config_set(k, v)
        admin.flushall()
        worker = WorkerProcess(server.url)
        try:
            res["round_trips_ms"] = asyncio.run(worker_round_trips(worker.port, server.port))
        finally:
            worker.stop()
        admin.flushall()
        res["low_load_critical_path_ms"] = critical_path(server.url)
        admin.close()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.json").write_text(json.dumps(res, indent=2) + "\n")
    for section, values in res.items():
        print(section)
        if section.startswith("fences_"):
            for f in ("publish", "pull", "ack"):
                print(f"  {f:<8} {values[f]['evalsha_us_per_call']:8.1f} us/call EVALSHA")
            continue
        for key, v in values.items():
            if isinstance(v, dict) and not v:
                continue
            if isinstance(v, dict):
                print(f"  {key:<36} p50 {v.get('p50', 0):.3f} ms  p99 {v.get('p99', 0):.3f} ms")
            else:
                print(f"  {key:<36} {v:10.2f}")
    print(f"wrote {out / 'probe.json'}")


if __name__ == "__main__":
    main()
