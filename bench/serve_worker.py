"""A FenceMQ worker in its own process, for the bench: prints ``PORT <n>`` once it listens.

    python -m bench.serve_worker --redis-url redis://127.0.0.1:PORT/0 [--profile out.prof]

SIGTERM drains and exits (fencemq.server.runner.serve). With --profile the whole run is
recorded by cProfile and written to the given file on exit.
"""

from __future__ import annotations

import argparse
import json
import sys


from fencemq.config import Config
from fencemq.server.runner import run, serve


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--redis-url", required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--mqtt-port", type=int, default=None, help="also serve MQTT (0: a free port; says MQTT <n>)")
    ap.add_argument("--max-connections", type=int, default=None, help="Config.max_connections (capped to the open files)")
    ap.add_argument("--loop", default=None, help="event loop: auto (uvloop when installed), uvloop, asyncio;"
                    " default auto, or asyncio with --profile (cProfile counts uvloop's waits as time in a coroutine)")
    ap.add_argument("--profile", default=None, help="write a cProfile of the worker here on exit")
    ap.add_argument("--profile-cpu", action="store_true", help="--profile counts CPU time, not wall time")
    ap.add_argument("--trace", default=None, help="time publish/pull/schedule/wake-ups; JSON here on exit")
    ap.add_argument("--durability", default="local", help="Config.durability: local, replicas=N, aof, aof+replicas=N")
    opts = ap.parse_args()
    if opts.loop is None:
        opts.loop = "asyncio" if opts.profile else "auto"
    trace = install_trace() if opts.trace else None
    config = Config(redis_url=opts.redis_url, port=opts.port, mqtt_port=opts.mqtt_port, durability=opts.durability,
                    **({"max_connections": opts.max_connections} if opts.max_connections else {}))

    def ready(worker: object, port: int) -> None:
        print(f"PORT {port}", flush=True)
        if opts.mqtt_port is not None:
            print(f"MQTT {worker.mqtt_port}", flush=True)  # type: ignore[attr-defined]

    if opts.profile:
        import cProfile

        import time

        # wall time by default; CPU time leaves out the waits in send() while the woken peer runs
        prof = cProfile.Profile(time.process_time) if opts.profile_cpu else cProfile.Profile()
        try:
            prof.runcall(run, serve, config, ready, loop=opts.loop)
        finally:
            prof.dump_stats(opts.profile)
    else:
        try:
            run(serve, config, ready, loop=opts.loop)
        finally:
            if trace is not None:
                with open(opts.trace, "w") as f:
                    json.dump(trace, f)
    sys.stdout.flush()


def install_trace() -> list:
    """Wrap the worker's steps (bench only, nothing is edited): each event is
    [step, start ns, end ns, send stamps of the payloads involved]."""
    import struct
    import time

    from fencemq.fences.context import FenceContext
    from fencemq.fences.leases import Leases
    from fencemq.fences.shared import Shared
    from fencemq.server.wakeups import Waiter

    events: list = []
    stamp = struct.Struct("<q").unpack_from

    def stamps(payloads: list) -> list[int]:
        return [stamp(p)[0] for p in payloads if isinstance(p, (bytes, bytearray)) and len(p) >= 8]

    def timed(name: str, fn, extract) -> object:
        async def wrapper(self, *args, **kwargs):
            t0 = time.time_ns()
            result = await fn(self, *args, **kwargs)
            events.append([name, t0, time.time_ns(), extract(args, kwargs, result)])
            return result
        return wrapper

    Shared.publish = timed("publish", Shared.publish, lambda a, k, r: stamps(a[1]))
    Leases.pull = timed("pull", Leases.pull, lambda a, k, r: stamps([d.payload for d in r.deliveries]))
    FenceContext.schedule = timed("schedule", FenceContext.schedule, lambda a, k, r: [])
    fire = Waiter.fire

    def traced_fire(self) -> None:
        t = time.time_ns()
        events.append(["wake", t, t, []])
        fire(self)

    Waiter.fire = traced_fire
    return events


if __name__ == "__main__":
    main()
