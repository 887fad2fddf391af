"""Fan-out benchmark: one publisher, one shared group of 4 members plus 2 non-shared filters.

    python -m bench.fanout [--messages 10000] [--size 128] [--repeat 3] [--out bench/results]

A FenceMQ worker runs in its own process (``bench.serve_worker``, as in
``bench.run``) in front of one private Redis (``fencemq.server.embedded``). The bench
process runs, on one asyncio loop over ``bench/resp.py`` (pipelining RESP2 +
hiredis), each on its own connection:

* one publisher: ``MPUB fan<k>/t 100 p1..p100``, 10 commands in flight
  (``--batch``/``--window``);
* ``$share/g/fan<k>/#`` with 4 members, and ``fan<k>/+`` and ``fan<k>/#``
  (non-shared): 6 push subscriptions, every message is delivered 3 times
  (once to one group member, once to each non-shared subscription);
* each subscriber loops: ``ACK`` of what it took last + a pipeline of ``TAKE``
  (as many as it got last time, doubled, 4..64), a ``TAKE … BLOCK`` only after
  an all-empty round.

Reported per run: published msg/s (first publish → last publish reply),
end-to-end msg/s and deliveries/s (first publish → last ACK of all 3
subscriptions), publish → TAKE latency, per-member counts of the group,
Redis CPU / EVALSHA time per message, worker and client CPU per message, and
the CPU used meanwhile by unrelated processes (noise). Then raw Redis Streams on
the same server (bench.run's raw shape, the same number of messages): its Redis
CPU per message is what a delivery's is measured against (bench.goals). The median run (by
deliveries/s) is the headline. Writes ``<out>/fanout.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.resp import RespConn
from bench.harness import HOST, ROOT, WorkerProcess, machine_info
from bench.stats import (
    RedisMeter,
    machine_busy_s,
    percentiles_ms,
    proc_cpu_s,
    self_cpu_s,
)
from bench.mosquitto_peer import mosquitto_share
from bench.workloads import _STAMP, RawStreams, e2e, make_payload
from fencemq.server.embedded import EmbeddedRedis

MEMBERS = 4
COPIES = 3  # one group + two non-shared subscriptions
MIN_TAKES, MAX_TAKES = 4, 64


@dataclass
class Sink:
    """One subscription (the group counts as one): what it must receive, what it got."""

    name: str
    want: int
    acked: int = 0
    delivered: int = 0
    redelivered: int = 0
    t_last_ack: float = 0.0
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def settle(self, n: int) -> None:
        self.acked += n
        if self.acked >= self.want and not self.done.is_set():
            self.t_last_ack = time.perf_counter()
            self.done.set()


@dataclass
class Member:
    name: str
    sink: Sink
    handle: bytes = b""
    conn: RespConn | None = None
    taken: int = 0
    takes_sent: int = 0  # TAKE commands, empty ones included


async def subscribe(conn: RespConn, target: str) -> bytes:
    reply = await conn.call("SUB", target)
    fields = dict(zip(reply[::2], reply[1::2]))
    return fields[b"handle"]


def _settle_round(m: Member, deliveries: list[Any], lat: array, acks: list[bytes]) -> None:
    now = time.time_ns()
    unpack = _STAMP.unpack_from
    for d in deliveries:
        if d is None:
            continue
        if not isinstance(d, list):
            raise TypeError(f"{m.name}: unexpected delivery {d!r}")
        fields = dict(zip(d[::2], d[1::2]))  # a RESP2 map as a flat array
        acks.append(fields[b"tag"])
        lat.append(now - unpack(fields[b"payload"])[0])
        if fields[b"deliveries"] != 1:
            m.sink.redelivered += 1


async def consume(m: Member, lat: array, block_ms: int, verb: str = "PULL") -> None:
    """ACK the last round and fetch the next in one write, until the subscription has all it wants.

    PULL: one ``PULL handle COUNT n`` a round from the push mailbox (batched consumption);
    TAKE: a pipeline of n ``TAKE``s (one delivery each), as an MQTT-style one-at-a-time client would.
    """
    conn, handle, sink = m.conn, m.handle, m.sink
    assert conn is not None
    acks: list[bytes] = []
    want = MIN_TAKES
    idle = False
    while not sink.done.is_set():
        cmds: list[tuple] = []
        if acks:
            cmds.append(("ACK", handle, *acks))
        wait = ("BLOCK", block_ms) if idle else ()
        if verb == "PULL":
            cmds.append(("PULL", handle, "COUNT", MAX_TAKES, *wait))
            m.takes_sent += 1
        elif idle:
            cmds.append(("TAKE", handle, *wait))
            m.takes_sent += 1
        else:
            cmds.extend([("TAKE", handle)] * want)
            m.takes_sent += want
        replies = await asyncio.gather(*conn.send(cmds))
        if acks:
            sink.settle(replies[0])
            replies = replies[1:]
        acks = []
        _settle_round(m, replies[0] if verb == "PULL" else replies, lat, acks)
        m.taken += len(acks)
        sink.delivered += len(acks)
        idle = not acks
        want = min(MAX_TAKES, max(MIN_TAKES, 2 * len(acks)))
    if acks:
        sink.settle(await conn.call("ACK", handle, *acks))


async def publish(conn: RespConn, topic: str, total: int, size: int, batch: int, window: int) -> tuple[float, float]:
    pad = b"x" * max(0, size - _STAMP.size)
    inflight: deque[tuple[asyncio.Future, int]] = deque()
    sent = 0
    t0 = time.perf_counter()
    while sent < total:
        n = min(batch, total - sent)
        payloads = [make_payload(pad) for _ in range(n)]
        cmd = ("MPUB", topic, n, *payloads) if n > 1 else ("PUB", topic, payloads[0])
        inflight.append((conn.send([cmd])[0], n))
        sent += n
        while len(inflight) >= window:
            fut, k = inflight.popleft()
            reply = await fut
            assert (len(reply) == k) if isinstance(reply, list) else k == 1, reply
    while inflight:
        await inflight.popleft()[0]
    return t0, time.perf_counter()


async def fanout_run(port: int, tag: str, total: int, size: int, batch: int, window: int,
                     block_ms: int, verb: str = "PULL") -> dict[str, Any]:
    topic = f"fan{tag}/t"
    group = Sink("group", total)
    plus, hash_ = Sink(f"fan{tag}/+", total), Sink(f"fan{tag}/#", total)
    members = [Member(f"g{i}", group) for i in range(MEMBERS)] + [Member("plus", plus), Member("hash", hash_)]
    targets = [f"$share/g/fan{tag}/#"] * MEMBERS + [f"fan{tag}/+", f"fan{tag}/#"]
    producer = await RespConn.open(HOST, port)
    lat = array("q")
    tasks: list[asyncio.Task] = []
    try:
        for m, target in zip(members, targets):
            m.conn = await RespConn.open(HOST, port)
            m.handle = await subscribe(m.conn, target)
        tasks = [asyncio.create_task(consume(m, lat, block_ms, verb)) for m in members]
        t_first, t_last_pub = await publish(producer, topic, total, size, batch, window)
        sinks = (group, plus, hash_)
        await asyncio.wait_for(asyncio.gather(*(s.done.wait() for s in sinks)), timeout=600)
        t_end = max(s.t_last_ack for s in sinks)
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in [producer, *(m.conn for m in members if m.conn is not None)]:
            await c.close()
    e2e_s = t_end - t_first
    delivered = sum(s.delivered for s in sinks)
    return {
        "messages": total,
        "deliveries": delivered,
        "deliveries_expected": COPIES * total,
        "redelivered": sum(s.redelivered for s in sinks),
        "published_msgs_per_s": total / (t_last_pub - t_first),
        "e2e_msgs_per_s": total / e2e_s,
        "deliveries_per_s": delivered / e2e_s,
        "seconds": e2e_s,
        "group_members_taken": [m.taken for m in members[:MEMBERS]],
        "non_shared_taken": [m.taken for m in members[MEMBERS:]],
        "takes_per_delivery": sum(m.takes_sent for m in members) / max(1, delivered),
        "latency_ms": percentiles_ms(lat),
    }


def measured(meter: RedisMeter, redis_pid: int, worker_pid: int, make: Any) -> dict[str, Any]:
    meter.reset()
    me0, r0, w0, b0 = self_cpu_s(), proc_cpu_s(redis_pid), proc_cpu_s(worker_pid), machine_busy_s()
    t0 = time.perf_counter()
    out = asyncio.run(make())
    wall = time.perf_counter() - t0
    me1, r1, w1, b1 = self_cpu_s(), proc_cpu_s(redis_pid), proc_cpu_s(worker_pid), machine_busy_s()
    s = meter.read()
    n = out["messages"]
    ours = (me1 - me0) + (r1 - r0) + (w1 - w0)
    out.update({
        "redis": {
            "cpu_us_per_msg": s["cpu_us"] / n,
            "evalsha_us_per_msg": s["evalsha_usec"] / n,
            "evalsha_calls_per_msg": s["evalsha_calls"] / n,
            "commands": s["commands"],
        },
        "worker_cpu_us_per_msg": (w1 - w0) * 1e6 / n,
        "client_cpu_us_per_msg": (me1 - me0) * 1e6 / n,
        "phase_wall_s": wall,
        "others_cpu_cores": max(0.0, (b1 - b0) - ours) / wall,
    })
    return out


def raw_redis_cost(meter: RedisMeter, port: int, opts: argparse.Namespace) -> dict[str, Any]:
    """Raw Streams' Redis CPU per message in this run (bench.run's flat-out raw shape, the same messages):
    what a delivery's Redis CPU is measured against."""
    raw = lambda tag: lambda i: RawStreams(f"fanout-raw:{tag}", consumer=f"c{i}")  # noqa: E731
    asyncio.run(e2e(HOST, port, raw("warm"), total=min(5000, opts.messages), size=opts.size))
    costs = []
    for i in range(opts.repeat):
        meter.reset()
        run = asyncio.run(e2e(HOST, port, raw(str(i)), total=opts.messages, size=opts.size, batch=opts.batch,
                              window=opts.window))
        costs.append(meter.read()["cpu_us"] / max(1, run.messages))
    print(f"  raw Streams beside it: Redis CPU {statistics.median(costs):.2f} us/msg", flush=True)
    return {"redis_cpu_us_per_msg": statistics.median(costs), "runs_redis_cpu_us_per_msg": costs}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=10_000, help="messages per run")
    ap.add_argument("--size", type=int, default=128, help="payload bytes (>= 8: the send time)")
    ap.add_argument("--batch", type=int, default=100, help="messages per MPUB (1: one PUB each)")
    ap.add_argument("--window", type=int, default=10, help="publish commands in flight")
    ap.add_argument("--repeat", type=int, default=3, help="runs; the median (by deliveries/s) is reported")
    ap.add_argument("--block-ms", type=int, default=200, help="BLOCK after an empty round")
    ap.add_argument("--verb", choices=["PULL", "TAKE"], default="PULL",
                    help="PULL COUNT 64 a round (batched) or pipelined TAKEs (one delivery each)")
    ap.add_argument("--skip-peers", action="store_true", help="skip Mosquitto (bench.mosquitto_peer)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    opts = ap.parse_args(argv)
    if opts.size < 8:
        ap.error("--size must be at least 8 (the payload carries its send time)")
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)

    t_start = time.perf_counter()
    res: dict[str, Any] = {"args": vars(opts), "shape": {
        "publishers": 1, "shared_group_members": MEMBERS, "non_shared_subscriptions": 2, "copies_per_message": COPIES,
        "consumer_verbs": f"{opts.verb} + ACK" + (" (COUNT 64 a round)" if opts.verb == "PULL" else " (pipelined)"), "worker": "separate process (bench.serve_worker)"}}
    with EmbeddedRedis() as server:
        admin = server.client()
        meter = RedisMeter(admin)
        res["machine"] = machine_info(server, admin)
        print(f"private {server.binary} v{res['machine']['redis_version']} on port {server.port}", flush=True)
        worker = WorkerProcess(server.url)
        try:
            asyncio.run(fanout_run(worker.port, "warm", min(2000, opts.messages), opts.size, opts.batch, opts.window,
                                   opts.block_ms, opts.verb))
            runs = []
            for i in range(opts.repeat):
                print(f"  fan-out run {i + 1}/{opts.repeat}: {opts.messages} messages x {COPIES} copies ...", flush=True)
                run = measured(meter, server.pid, worker.pid, lambda i=i: fanout_run(
                    worker.port, str(i), opts.messages, opts.size, opts.batch, opts.window, opts.block_ms, opts.verb))
                if run["deliveries"] != run["deliveries_expected"]:
                    raise SystemExit(f"delivered {run['deliveries']}, expected {run['deliveries_expected']}")
                print(f"    published {run['published_msgs_per_s']:,.0f} msg/s; delivered "
                      f"{run['deliveries_per_s']:,.0f}/s ({run['e2e_msgs_per_s']:,.0f} msg/s end to end); "
                      f"p50 {run['latency_ms']['p50']:.1f} ms; {run['takes_per_delivery']:.2f} {opts.verb}/delivery; group {run['group_members_taken']}; "
                      f"others {run['others_cpu_cores']:.2f} cores", flush=True)
                runs.append(run)
        finally:
            worker.stop()
        admin.flushall()
        res["raw"] = raw_redis_cost(meter, server.port, opts)
        admin.close()

    if not opts.skip_peers:
        print("peer: Mosquitto on this machine, $share group of 2 paho subscribers, QoS 1 ...", flush=True)
        res["peers"] = {"mosquitto": mosquitto_share(opts.messages, opts.size)}
        print(f"  {res['peers']['mosquitto']}", flush=True)
    ordered = sorted(runs, key=lambda r: r["deliveries_per_s"])
    head = ordered[(len(ordered) - 1) // 2]
    res["runs"] = runs
    res["median"] = head
    res["summary"] = {
        "published_msgs_per_s": round(head["published_msgs_per_s"]),
        "deliveries_per_s": round(head["deliveries_per_s"]),
        "e2e_msgs_per_s": round(head["e2e_msgs_per_s"]),
        "runs_deliveries_per_s": [round(r["deliveries_per_s"]) for r in runs],
        "runs_published_msgs_per_s": [round(r["published_msgs_per_s"]) for r in runs],
        "latency_p50_ms": head["latency_ms"]["p50"],
        "latency_p99_ms": head["latency_ms"]["p99"],
        "redis_cpu_us_per_msg": head["redis"]["cpu_us_per_msg"],
        "worker_cpu_us_per_msg": head["worker_cpu_us_per_msg"],
        "group_members_taken": head["group_members_taken"],
        "others_cpu_cores_mean": statistics.fmean(r["others_cpu_cores"] for r in runs),
        "raw_redis_cpu_us_per_msg": res["raw"]["redis_cpu_us_per_msg"],
        "redis_cpu_per_delivery_x_raw": head["redis"]["cpu_us_per_msg"] / COPIES / res["raw"]["redis_cpu_us_per_msg"],
    }
    res["bench_seconds"] = time.perf_counter() - t_start
    res["machine"]["loadavg_at_end"] = os.getloadavg()
    (out / "fanout.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    s = res["summary"]
    print(f"\nfan-out, 1 publisher -> $share group of {MEMBERS} + 2 non-shared, {opts.size} B, "
          f"median of {opts.repeat}:")
    print(f"  published      {s['published_msgs_per_s']:>9,} msg/s")
    print(f"  delivered      {s['deliveries_per_s']:>9,} deliveries/s  ({s['e2e_msgs_per_s']:,} msg/s end to end, "
          f"x{COPIES})")
    print(f"  latency        p50 {s['latency_p50_ms']:.1f} ms, p99 {s['latency_p99_ms']:.1f} ms (publish -> delivery, flat out)")
    print(f"  Redis CPU      {s['redis_cpu_us_per_msg']:.1f} us/msg; worker CPU {s['worker_cpu_us_per_msg']:.1f} us/msg; "
          f"per delivery {s['redis_cpu_per_delivery_x_raw']:.1f}x raw Streams' per message "
          f"({s['raw_redis_cpu_us_per_msg']:.2f} us)")
    print(f"  group split    {s['group_members_taken']}")
    print(f"  others         {s['others_cpu_cores_mean']:.2f} CPU cores used by unrelated processes meanwhile")
    print(f"wrote {out / 'fanout.json'} in {res['bench_seconds']:.0f} s")


if __name__ == "__main__":
    main()
