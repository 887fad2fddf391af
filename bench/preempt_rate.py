"""Preemptions per second: two clients alternately taking 10,000 lmqs from each other.

    .venv/bin/python -m bench.preempt_rate [--lmqs 10000] [--rounds 10] [--out bench/results]

Client A subscribes every lmq (not timed); then B subscribes every lmq (each
SUB preempts A), then A again (preempting B), and so on for ``--rounds``
rounds. Every timed SUB is a preemption, checked from its reply.

At Redis (no worker) — the subscribe fence (``lua/subscribe.lua``, with the
keys and arguments ``fencemq.fences.subscribe.Subscriptions.subscribe`` passes) by EVALSHA,
pipelined over a raw RESP connection (bench/resp.py), 8 writes of 2,000 in
flight (keys and arguments recorded from a real ``Core`` call:
``bench.bulk_fences.Templates``):

* ``fence``: the fence alone, lite journal off (the default ``lite_journal_cap``) and on;
* ``fence_with_checkout``: the owner holds one checked-out message when it is
  preempted (a publish and a pull per lmq between rounds, not timed), so each
  preemption also returns a checkout;
* ``worker_writes``: everything a worker sends Redis for one SUB that
  preempts: the quota check, the handle's entry in the session index and its
  count (``lua/lite_hold.lua``, one call in the client's slot), the fence, and
  the notice to the evicted client (RPUSH, LTRIM, PUBLISH: one pipeline).

Through the worker — ``bench.serve_worker`` in its own process, two RESP2
connections (``HELLO 2 SETNAME A|B``) sending ``SUB topic LMQ name``
pipelined the same way (the worker runs a pipelined run of them together:
one ``lite_hold.lua`` call for the client's holds, the fences in one
pipeline, the evicted owner's notices in one RPUSH and one message).

Figures per variant: preemptions/s (wall clock, one client process), Redis
CPU µs per preemption (``INFO cpu`` delta: user+sys of the server) and EVALSHA
µs per call (``INFO commandstats``); "capacity at Redis" = 1e6 / Redis CPU
µs per preemption, what one Redis core sustains when clients are not the
bottleneck. The goal (≥ 30,000/s at Redis, issue #14) is checked against the
``fence`` variant's capacity with the default config; bench.goals also holds
the worker variant to ≥ 10,000/s. Writes ``<out>/preempt_rate.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from bench.bulk_fences import Bulk, Templates
from bench.harness import ROOT, git_commit
from bench.resp import RespConn
from bench.harness import WorkerProcess
from bench.stats import RedisMeter, machine_busy_s, proc_cpu_s, run_and_write
from fencemq.fences import session_index
from fencemq.config import Config
from fencemq.server.embedded import EmbeddedRedis
from fencemq.model.keys import Keyspace, QueueRef
from fencemq.model.handles import Handle

GOAL_PER_S = 30_000
JOURNAL_ON = 10_000  # the lite journal turned on, for comparison
TOPIC, GROUP = "pt", "default"
CLIENTS = ("A", "B")


def lmq_name(i: int) -> str:
    return f"p{i:05d}"


class Commands:
    """The Redis commands of one SUB, as fencemq.fences.subscribe.Subscriptions.subscribe (and the worker around it) sends them."""

    def __init__(self, config: Config, templates: Templates) -> None:
        self.config, self.t, self.keys = config, templates, Keyspace(config.prefix)

    def fence(self, i: int, client: str) -> list[Any]:
        return self.t.call("subscribe", lmq_name(i), client)

    def worker_writes(self, i: int, client: str, evicted: str) -> list[list[Any]]:
        ref = QueueRef(TOPIC, lmq_name(i))
        handle = Handle(ref, GROUP, client)
        notice = b"\x85" + b"x" * 120  # a msgpack map of the notice's size; its content does not matter here
        return [
            # lua/lite_hold.lua: quota, session index and count in one call in the client's slot
            ["EVALSHA", self.t.shas["lite_hold"], 2, self.keys.session_lite_counts(client),
             session_index.bucket_key(self.keys, handle), TOPIC, self.config.lite_quota, *session_index.entry_args(handle)],
            self.fence(i, client),
            ["RPUSH", self.keys.session_notices(evicted), notice],
            ["LTRIM", self.keys.session_notices(evicted), -1000, -1],
            ["PUBLISH", self.keys.session_channel(evicted), notice],
        ]

    def publish_and_pull(self, i: int, owner: str) -> list[list[Any]]:
        return [self.t.call("publish", lmq_name(i), owner), self.t.call("pull", lmq_name(i), owner)]


def _cpu(meter: RedisMeter) -> float:
    info = meter.client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


async def at_redis(variant: str, lite_journal_cap: int, lmqs: int, rounds: int) -> dict[str, Any]:
    with EmbeddedRedis() as server:
        r = server.client()
        meter = RedisMeter(r)
        config = Config(redis_url=server.url, lite_journal_cap=lite_journal_cap)
        cmds = Commands(config, await Templates.record(server.url, config, r, TOPIC))
        conn = await RespConn.open("127.0.0.1", server.port)
        bulk = Bulk(conn)
        try:
            await bulk.run(cmds.fence(i, "A") for i in range(lmqs))  # A owns everything
            timed, busy, evalsha_us, cmd_us, cpu_us, preempted = 0.0, 0.0, 0, 0, 0.0, 0
            for n in range(rounds):
                client, other = CLIENTS[(n + 1) % 2], CLIENTS[n % 2]
                if variant == "fence_with_checkout":  # the owner holds one message when it is preempted
                    await bulk.run(c for i in range(lmqs) for c in cmds.publish_and_pull(i, other))
                if variant == "worker_writes":
                    batch = [c for i in range(lmqs) for c in cmds.worker_writes(i, client, other)]
                    per_sub, fence_at = 5, 1
                else:
                    batch = [cmds.fence(i, client) for i in range(lmqs)]
                    per_sub, fence_at = 1, 0
                meter.reset()
                b0, t0 = machine_busy_s(), time.perf_counter()
                replies = await bulk.run(batch, collect=True)
                timed += time.perf_counter() - t0
                busy += machine_busy_s() - b0
                s = meter.read()
                evalsha_us += s["evalsha_usec"]
                cmd_us += s["cmd_usec"] - s["evalsha_usec"]
                cpu_us += s["cpu_us"]
                fences = replies[fence_at::per_sub]
                preempted += sum(1 for rep in fences if rep[3] == other.encode())
                if variant == "fence_with_checkout":
                    assert all(int(rep[4]) == 1 for rep in fences), "each preemption returns the owner's checkout"
            total = lmqs * rounds
            assert preempted == total, f"{preempted} of {total} SUBs preempted"
            return {
                "variant": variant, "lite_journal_cap": lite_journal_cap, "preemptions": total,
                "preemptions_per_s_wall": total / timed,
                "redis_cpu_us_per_preemption": cpu_us / total,
                "evalsha_us_per_preemption": evalsha_us / total,
                "other_commands_us_per_preemption": cmd_us / total,
                "capacity_at_redis_per_s": 1e6 * total / cpu_us if cpu_us else None,
                "capacity_by_command_time_per_s": 1e6 * total / (evalsha_us + cmd_us) if evalsha_us else None,
                "machine_busy_cores": busy / timed,
                "seconds": timed,
            }
        finally:
            await conn.close()
            r.close()


async def through_worker(lmqs: int, rounds: int) -> dict[str, Any]:
    with EmbeddedRedis() as server:
        r = server.client()
        meter = RedisMeter(r)
        worker = WorkerProcess(server.url)
        conns: dict[str, RespConn] = {}
        try:
            for name in CLIENTS:
                conns[name] = await RespConn.open("127.0.0.1", worker.port)
                await conns[name].call("HELLO", 2, "SETNAME", name)
            await Bulk(conns["A"]).run(["SUB", TOPIC, "LMQ", lmq_name(i)] for i in range(lmqs))
            timed, busy, cpu_us, evalsha_us, worker_cpu = 0.0, 0.0, 0.0, 0, 0.0
            calls: dict[str, int] = {}
            for n in range(rounds):
                client = CLIENTS[(n + 1) % 2]
                meter.reset()
                w0 = proc_cpu_s(worker.pid)
                b0, t0 = machine_busy_s(), time.perf_counter()
                replies = await Bulk(conns[client]).run((["SUB", TOPIC, "LMQ", lmq_name(i)] for i in range(lmqs)),
                                                        collect=True)
                timed += time.perf_counter() - t0
                busy += machine_busy_s() - b0
                worker_cpu += proc_cpu_s(worker.pid) - w0
                s = meter.read()
                cpu_us += s["cpu_us"]
                evalsha_us += s["evalsha_usec"]
                for name, c in s["commands"].items():
                    calls[name] = calls.get(name, 0) + c["calls"]
                owners = {dict(zip(rep[::2], rep[1::2], strict=True))[b"owner"] for rep in replies}
                assert owners == {client.encode()}, owners
            notices = r.llen(Keyspace().session_notices("A"))
            total = lmqs * rounds
            return {
                "variant": "worker_resp_pipelined_sub", "lite_journal_cap": Config().lite_journal_cap, "preemptions": total,
                "preemptions_per_s_wall": total / timed,
                "redis_cpu_us_per_preemption": cpu_us / total,
                "evalsha_us_per_preemption": evalsha_us / total,
                "capacity_at_redis_per_s": 1e6 * total / cpu_us if cpu_us else None,
                "worker_cpu_us_per_preemption": worker_cpu * 1e6 / total,
                "redis_commands_per_preemption": {k: round(v / total, 2) for k, v in sorted(calls.items())},
                "machine_busy_cores": busy / timed,
                "notices_queued_for_A": notices,
                "seconds": timed,
            }
        finally:
            for c in conns.values():
                await c.close()
            worker.stop()
            r.close()


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    default_cap = Config().lite_journal_cap
    runs = []
    for variant, cap, rounds in (
        ("fence", default_cap, args.rounds),
        ("fence", JOURNAL_ON, args.rounds),
        ("fence_with_checkout", default_cap, max(2, args.rounds // 2)),
        ("worker_writes", default_cap, args.rounds),
    ):
        res = await at_redis(variant, cap, args.lmqs, rounds)
        print(f"  at Redis, {variant}, lite_journal_cap={cap}: {res['preemptions_per_s_wall']:,.0f}/s wall, "
              f"{res['redis_cpu_us_per_preemption']:.1f} µs Redis CPU each "
              f"(capacity {res['capacity_at_redis_per_s']:,.0f}/s)", flush=True)
        runs.append(res)
    res = await through_worker(args.lmqs, args.rounds)
    print(f"  through the worker: {res['preemptions_per_s_wall']:,.0f}/s wall, "
          f"{res['redis_cpu_us_per_preemption']:.1f} µs Redis CPU and {res['worker_cpu_us_per_preemption']:.0f} µs "
          f"worker CPU each; Redis commands each: {res['redis_commands_per_preemption']}", flush=True)
    runs.append(res)
    headline = runs[0]
    return {
        "benchmark": "preempt_rate",
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    "loadavg_at_end": os.getloadavg()},
        "git_commit": git_commit(),
        "lmqs": args.lmqs,
        "rounds": args.rounds,
        "goal_per_s_at_redis": GOAL_PER_S,
        "headline": {
            "what": "subscribe fence alone, default config: capacity of one Redis core (1e6 / Redis CPU µs)",
            "capacity_at_redis_per_s": round(headline["capacity_at_redis_per_s"] or 0),
            "wall_per_s_one_client": round(headline["preemptions_per_s_wall"]),
        },
        "goal_met": (headline["capacity_at_redis_per_s"] or 0) >= GOAL_PER_S,
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lmqs", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    result = run_and_write("preempt_rate", main_async, args)
    out = Path(args.out)
    print(json.dumps(result["headline"], indent=2))
    print(f"goal ≥ {GOAL_PER_S:,}/s at Redis: {'met' if result['goal_met'] else 'NOT met'}; "
          f"wrote {out / 'preempt_rate.json'} in {result['seconds']} s")


if __name__ == "__main__":
    main()
