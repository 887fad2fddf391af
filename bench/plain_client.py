"""A plain Redis client that awaits each call: FenceMQ through a worker against raw Streams, same client.

    python -m bench.plain_client [--messages 50000] [--size 128] [--repeat 3] [--callgrind 30]
    # alone; bench.run calls plain_client()

What an application written with nothing but redis-py's asyncio client gets, no
pipelining anywhere (issue #32):

* ``fencemq``: a producer awaits ``MPUB topic 100 p1 … p100``, one call after the
  other; a consumer on its own connection awaits ``PULL h COUNT 100 BLOCK 1000``,
  then ``ACK h tag…`` of that batch.
* ``raw``: the same shape against Redis Streams with the same client: one
  ``EVALSHA`` of a Lua XADD ×100 (a batch of 100 in one call, as MPUB is), then
  ``XREADGROUP … COUNT 100 BLOCK 1000`` and ``XACK`` of the batch.

Both run against one private Redis, the FenceMQ worker in a process of its own
(bench.serve_worker). Figure: messages / (first publish → last ack), the median of
``repeat`` runs per system, alternating so that the machine's load falls on both;
Redis CPU per message (INFO), the worker's (/proc) and the client's own (this process: redis-py
encoding the calls and parsing the replies) are kept beside it, with the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from bench.harness import HOST, ROOT, WorkerProcess
from bench.stats import RedisMeter, proc_cpu_s
from bench.workloads import RAW_PUBLISH_LUA
from fencemq.server.embedded import EmbeddedRedis

BATCH, COUNT, BLOCK_MS = 100, 100, 1000


def _field(reply: Any, name: bytes) -> Any:
    """A field of a map reply: a dict in RESP3 (redis-py 8 asks for it), field/value pairs in RESP2."""
    if isinstance(reply, dict):
        return reply[name]
    return reply[reply.index(name) + 1]


async def _fencemq(port: int, topic: str, total: int, size: int) -> float:
    producer = aioredis.Redis(host=HOST, port=port)
    consumer = aioredis.Redis(host=HOST, port=port)
    try:
        handle = _field(await consumer.execute_command("SUB", topic, "GROUP", "g"), b"handle")
        payload = b"x" * size

        async def produce() -> None:
            for start in range(0, total, BATCH):
                n = min(BATCH, total - start)
                await producer.execute_command("MPUB", topic, n, *([payload] * n))

        t0 = time.perf_counter()
        publishing = asyncio.create_task(produce())
        acked = 0
        while acked < total:
            deliveries = await consumer.execute_command("PULL", handle, "COUNT", COUNT, "BLOCK", BLOCK_MS)
            if deliveries:
                acked += await consumer.execute_command("ACK", handle, *[_field(d, b"tag") for d in deliveries])
        await publishing
        return time.perf_counter() - t0
    finally:
        await producer.aclose()
        await consumer.aclose()


async def _raw(port: int, key: str, total: int, size: int) -> float:
    producer = aioredis.Redis(host=HOST, port=port)
    consumer = aioredis.Redis(host=HOST, port=port)
    try:
        sha = await producer.script_load(RAW_PUBLISH_LUA)
        await consumer.xgroup_create(key, "g", id="0", mkstream=True)
        payload = b"x" * size

        async def produce() -> None:
            for start in range(0, total, BATCH):
                n = min(BATCH, total - start)
                await producer.evalsha(sha, 1, key, *([payload] * n))

        t0 = time.perf_counter()
        publishing = asyncio.create_task(produce())
        acked = 0
        while acked < total:
            reply = await consumer.xreadgroup("g", "c1", {key: ">"}, count=COUNT, block=BLOCK_MS)
            if reply:
                ids = [entry[0] for entry in reply[0][1]]
                acked += await consumer.xack(key, "g", *ids)
        await publishing
        return time.perf_counter() - t0
    finally:
        await producer.aclose()
        await consumer.aclose()


def _own_cpu_s() -> float:
    """CPU seconds of this process: the client's side (redis-py encoding the calls, parsing the replies)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _measure(meter: RedisMeter, redis_pid: int, worker_pid: int | None, total: int, run: Any) -> dict[str, Any]:
    meter.reset()
    r0 = proc_cpu_s(redis_pid)
    w0 = proc_cpu_s(worker_pid) if worker_pid else 0.0
    c0 = _own_cpu_s()
    seconds = asyncio.run(run())
    c1 = _own_cpu_s()
    r1 = proc_cpu_s(redis_pid)
    w1 = proc_cpu_s(worker_pid) if worker_pid else 0.0
    s = meter.read()
    return {"messages": total, "seconds": seconds, "msgs_per_s": total / seconds,
            "redis_cpu_us_per_msg": s["cpu_us"] / total, "redis_proc_cpu_us_per_msg": (r1 - r0) * 1e6 / total,
            "worker_cpu_us_per_msg": (w1 - w0) * 1e6 / total if worker_pid else None,
            "client_cpu_us_per_msg": (c1 - c0) * 1e6 / total,
            "evalsha_us_per_msg": s["evalsha_usec"] / total, "commands": s["commands"]}


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ordered = sorted(runs, key=lambda r: r["msgs_per_s"])
    out = dict(ordered[(len(ordered) - 1) // 2])
    out["runs_msgs_per_s"] = [round(r["msgs_per_s"]) for r in runs]
    return out


def plain_client(redis_url: str, redis_pid: int, total: int, size: int, repeat: int = 3) -> dict[str, Any]:
    """Both systems with redis-py asyncio, awaiting each call; ``fencemq / raw`` is the figure."""
    load_at_start = list(os.getloadavg())  # the machine is shared: the figures are ratios, the load beside them
    admin = __import__("redis").Redis.from_url(redis_url)
    meter = RedisMeter(admin)
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    worker = WorkerProcess(redis_url)
    runs: dict[str, list[dict[str, Any]]] = {"raw": [], "fencemq": []}
    try:
        asyncio.run(_raw(port, "plain:warm", min(total, 5000), size))
        asyncio.run(_fencemq(worker.port, "plain-warm", min(total, 5000), size))
        for i in range(repeat):
            runs["raw"].append(_measure(meter, redis_pid, None, total,
                                        lambda: _raw(port, f"plain:raw{i}", total, size)))
            runs["fencemq"].append(_measure(meter, redis_pid, worker.pid, total,
                                            lambda: _fencemq(worker.port, f"plain-fmq{i}", total, size)))
            print(f"  plain redis-py, run {i + 1}/{repeat}: raw {runs['raw'][-1]['msgs_per_s']:,.0f} msg/s, "
                  f"FenceMQ {runs['fencemq'][-1]['msgs_per_s']:,.0f} msg/s", flush=True)
    finally:
        worker.stop()
        admin.close()
    raw, fmq = _median(runs["raw"]), _median(runs["fencemq"])
    pairs = [f["msgs_per_s"] / r["msgs_per_s"] for r, f in zip(runs["raw"], runs["fencemq"])]
    return {"shape": {"batch": BATCH, "count": COUNT, "block_ms": BLOCK_MS, "size": size, "messages": total,
                      "client": f"redis-py {__import__('redis').__version__} asyncio, one call at a time"},
            "load_avg": {"start": load_at_start, "end": list(os.getloadavg())},
            "raw": raw, "fencemq": fmq, "ratio": fmq["msgs_per_s"] / raw["msgs_per_s"],
            "ratio_per_pair": [round(p, 3) for p in pairs]}


async def _lockstep(port: int, topic: str, cycles: int, size: int, wait_s: float | None) -> None:
    """``cycles`` of MPUB 100, PULL … COUNT 100 BLOCK, ACK, each call alone and in this order: the
    same calls every cycle (bench.plain_client's own runs overlap producer and consumer, so how the
    calls fall varies from run to run). With ``wait_s`` the PULL is sent first and waits that long for
    the MPUB, which hands it the messages (a long poll's path); without, the PULL finds them."""
    producer = aioredis.Redis(host=HOST, port=port)
    consumer = aioredis.Redis(host=HOST, port=port)
    try:
        handle = _field(await consumer.execute_command("SUB", topic, "GROUP", "g"), b"handle")
        payloads = [b"x" * size] * BATCH
        for _ in range(cycles):
            pulling = asyncio.ensure_future(
                consumer.execute_command("PULL", handle, "COUNT", COUNT, "BLOCK", 60_000)) if wait_s else None
            if pulling is not None:
                await asyncio.sleep(wait_s)
            await producer.execute_command("MPUB", topic, BATCH, *payloads)
            deliveries = await (pulling if pulling is not None else
                                consumer.execute_command("PULL", handle, "COUNT", COUNT, "BLOCK", 60_000))
            await consumer.execute_command("ACK", handle, *[_field(d, b"tag") for d in deliveries])
    finally:
        await producer.aclose()
        await consumer.aclose()


def callgrind_instructions(redis_url: str, cycles: int, size: int) -> dict[str, Any]:
    """Instructions the worker executes per cycle of MPUB 100, PULL, ACK in lock step (valgrind
    callgrind, counted for those calls only): unlike CPU time, the same on a machine others are using,
    so a change to the worker's per-call path shows before and after on any day. Two shapes: the PULL
    finds the messages (``found``), or waits and is handed them by the MPUB (``handed``; less what the
    worker's own tasks run in as long with no client: ``idle``). Valgrind slows the worker ~50x: the
    PULL waits 0.3 s for its MPUB."""
    out_counts: dict[str, Any] = {"cycles": cycles, "calls_per_cycle": 3, "messages_per_cycle": BATCH}
    with tempfile.TemporaryDirectory() as tmp:
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={tmp}/cg.%p",
               sys.executable, "-m", "bench.serve_worker", "--redis-url", redis_url]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            line = proc.stdout.readline() if proc.stdout else ""
            port = int(line.split()[1])
            asyncio.run(_lockstep(port, "cg-warm", 5, size, 0.3))
            asyncio.run(_lockstep(port, "cg-warm", 5, size, None))
            for shape, wait_s in (("found", None), ("handed", 0.3), ("idle", 0.3)):
                subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True, capture_output=True)
                subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], check=True, capture_output=True)
                if shape == "idle":  # what the worker's own tasks (sweeper, heartbeat…) run meanwhile
                    time.sleep(wait_s * cycles)
                else:
                    asyncio.run(_lockstep(port, f"cg-{shape}", cycles, size, wait_s))
                subprocess.run(["callgrind_control", "-i", "off", str(proc.pid)], check=True, capture_output=True)
                before = set(Path(tmp).iterdir())
                subprocess.run(["callgrind_control", "-d", shape, str(proc.pid)], check=True, capture_output=True)
                dump = max(set(Path(tmp).iterdir()) - before, key=lambda p: p.stat().st_mtime)
                totals = [int(x.split()[1]) for x in dump.read_text(errors="replace").splitlines()
                          if x.startswith(("summary:", "totals:"))]
                out_counts[f"{shape}_instructions_per_cycle"] = round(max(totals) / cycles)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    # the handed shape waits 0.3 s a cycle: the worker's own tasks of that time are not the calls'
    out_counts["handed_less_idle_per_cycle"] = (out_counts["handed_instructions_per_cycle"]
                                                - out_counts["idle_instructions_per_cycle"])
    return out_counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=50_000)
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--callgrind", type=int, default=0, metavar="N",
                    help="also count the worker's instructions per cycle of MPUB, PULL, ACK over N cycles "
                         "in lock step (valgrind callgrind)")
    ap.add_argument("--out", default=None, help="also write the result as JSON here")
    opts = ap.parse_args()
    with EmbeddedRedis() as server:
        res = plain_client(server.url, server.pid, opts.messages, opts.size, opts.repeat)
        if opts.callgrind:
            res["callgrind"] = callgrind_instructions(server.url, opts.callgrind, opts.size)
    fmq, raw = res["fencemq"], res["raw"]
    print(f"plain redis-py: FenceMQ {fmq['msgs_per_s']:,.0f} / raw {raw['msgs_per_s']:,.0f} msg/s"
          f" = {res['ratio']:.2f} (pairs {res['ratio_per_pair']})")
    print(f"  CPU per message: worker {fmq['worker_cpu_us_per_msg']:.2f} us (/ raw's Redis "
          f"{raw['redis_cpu_us_per_msg']:.2f} = {fmq['worker_cpu_us_per_msg'] / raw['redis_cpu_us_per_msg']:.2f}), "
          f"Redis {fmq['redis_cpu_us_per_msg']:.2f} us, client {fmq['client_cpu_us_per_msg']:.2f} us "
          f"(raw's client {raw['client_cpu_us_per_msg']:.2f} us); load {res['load_avg']}")
    if opts.callgrind:
        cg = res["callgrind"]
        print(f"  under valgrind, worker instructions per cycle of MPUB {BATCH}, PULL, ACK: "
              f"{cg['found_instructions_per_cycle']:,} (the PULL finds them), "
              f"{cg['handed_less_idle_per_cycle']:,} (the PULL waits and is handed them; the worker's own tasks "
              f"of those waits, {cg['idle_instructions_per_cycle']:,} a cycle, left out)")
    if opts.out:
        Path(opts.out).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
