"""The Python SDK end to end, in both styles: asyncio ``Client`` and blocking ``SyncClient``.

    python -m bench.sdk [--messages 100000] [--size 128]     # alone; bench.run calls sdk_styles()

What an application written against ``fencemq.sdk.client`` gets through one
worker (a process of its own, ``bench.serve_worker``), QoS 1, 128 B:

* ``async``: a producer task (``mpublish`` of 100, 10 calls in flight, all
  multiplexed on the client's one connection) and a consumer on a second
  client (``pull(100, block_ms=1000)``, then ``ack`` of the batch), subscribed
  with ``prefetch=True`` (``async_no_prefetch``: the default).
* ``sync``: the same with ``SyncClient``, one thread producing (``mpublish``
  of 100, one call at a time: a blocking API has one call in flight per
  thread) and the main thread consuming (``sync_no_prefetch``: the default).

Figure: messages / (first publish → last ack). No latency here: bench.run
measures that on the wire.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from typing import Any

from bench.harness import WorkerProcess
from bench.workloads import in_flight
from fencemq import Client, SyncClient
from fencemq.server.embedded import EmbeddedRedis

BATCH, WINDOW = 100, 10


async def async_style(url: str, total: int, size: int, prefetch: bool = False) -> dict[str, Any]:
    topic = f"sdk-async-{time.monotonic_ns()}"
    payload = b"x" * size
    async with await Client.connect(url, "sdk-async-consumer") as consumer, \
            await Client.connect(url, "sdk-async-producer") as producer:
        sub = await consumer.subscribe(topic, group="g", start="earliest", prefetch=prefetch)
        started = time.perf_counter()

        async def mpublish(n: int) -> None:
            await producer.mpublish(topic, [payload] * n)

        publishing = asyncio.create_task(in_flight(mpublish, total, BATCH, WINDOW))
        done = 0
        while done < total:
            batch = await sub.pull(BATCH, block_ms=1000)
            if batch:
                done += await sub.ack(*batch)
        await publishing
        elapsed = time.perf_counter() - started
    return {"messages": total, "seconds": elapsed, "msgs_per_s": total / elapsed}


def sync_style(url: str, total: int, size: int, prefetch: bool = False) -> dict[str, Any]:
    topic = f"sdk-sync-{time.monotonic_ns()}"
    payload = b"x" * size
    with SyncClient.connect(url, client_id="sdk-sync-consumer") as consumer, \
            SyncClient.connect(url, client_id="sdk-sync-producer") as producer:
        sub = consumer.subscribe(topic, group="g", start="earliest", prefetch=prefetch)
        started = time.perf_counter()

        def produce() -> None:
            for start in range(0, total, BATCH):
                producer.mpublish(topic, [payload] * min(BATCH, total - start))

        publisher = threading.Thread(target=produce, name="sdk-sync-producer")
        publisher.start()
        done = 0
        while done < total:
            batch = sub.pull(BATCH, block_ms=1000)
            if batch:
                done += sub.ack(*batch)
        publisher.join()
        elapsed = time.perf_counter() - started
    return {"messages": total, "seconds": elapsed, "msgs_per_s": total / elapsed}


def sdk_styles(worker_port: int, total: int, size: int) -> dict[str, dict[str, Any]]:
    """Both styles as an application tuned for throughput runs them (``prefetch=True``: the next
    PULL rides with the ACK that settles a full batch), and with the default (no prefetch)."""
    url = f"redis://127.0.0.1:{worker_port}"
    out = {
        "async": asyncio.run(async_style(url, total, size, prefetch=True)),
        "sync": sync_style(url, total, size, prefetch=True),
        "async_no_prefetch": asyncio.run(async_style(url, total, size)),
        "sync_no_prefetch": sync_style(url, total, size),
    }
    for style, r in out.items():
        print(f"  SDK {style}: {r['msgs_per_s']:,.0f} msg/s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--size", type=int, default=128)
    opts = ap.parse_args()
    with EmbeddedRedis() as server:
        worker = WorkerProcess(server.url)
        try:
            print(json.dumps(sdk_styles(worker.port, opts.messages, opts.size), indent=2))
        finally:
            worker.stop()


if __name__ == "__main__":
    main()
