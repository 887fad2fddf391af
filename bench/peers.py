"""The brokers a user would pick instead, measured the way bench.run measures FenceMQ.

    python -m bench.peers [--messages 100000] [--size 128]     # alone; bench.run calls run_peers()

At-least-once, end to end: one publisher (each publish confirmed by the
broker, ``window`` batches of ``batch`` in flight) and one consumer (explicit
acks) at once, 128 B payloads that carry their send time. Figures: msg/s
(first publish to last delivery) and publish→deliver p50/p99.

* ``nats_jetstream``: NATS JetStream on 127.0.0.1:4222, a file-backed stream,
  a durable pull consumer (FETCH of ``batch``, AckExplicit).
* ``rabbitmq_quorum``: RabbitMQ on 127.0.0.1:5672 (guest/guest), a quorum
  queue, publisher confirms, persistent messages, prefetch 2×``batch``.

These are services of the machine the bench runs on, not of the repo: a peer
that does not answer (or whose client library is missing: ``pip install
'fencemq[bench]'``) is reported as skipped, with the reason.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any

from bench.stats import percentiles_ms
from bench.workloads import in_flight

NATS_URL = "nats://127.0.0.1:4222"
AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
STREAM, SUBJECT, QUEUE = "FMQBENCH", "fmqbench.e2e", "fmq-bench-quorum"


def _payload(size: int) -> bytes:
    return struct.pack("<d", time.perf_counter()) + b"x" * (size - 8)


def _sent_at(body: bytes) -> float:
    return struct.unpack_from("<d", body)[0]


async def _publish_all(publish: Callable[[bytes], Awaitable[Any]], total: int, size: int, batch: int,
                       window: int) -> None:
    """``window`` batches in flight, each of ``batch`` confirmed publishes."""
    async def one_batch(n: int) -> None:
        await asyncio.gather(*(publish(_payload(size)) for _ in range(n)))

    await in_flight(one_batch, total, batch, window)


def _result(total: int, started: float, latencies: list[float]) -> dict[str, Any]:
    elapsed = time.perf_counter() - started
    pct = percentiles_ms(int(x * 1e9) for x in latencies)
    return {"messages": total, "seconds": elapsed, "msgs_per_s": total / elapsed, "p50_ms": pct["p50"],
            "p99_ms": pct["p99"]}


async def nats_jetstream(total: int, size: int, batch: int, window: int) -> dict[str, Any]:
    import nats
    from nats.js.api import StreamConfig

    nc = await nats.connect(NATS_URL, connect_timeout=2, max_reconnect_attempts=0)
    try:
        js = nc.jetstream()
        try:
            await js.delete_stream(STREAM)
        except Exception:  # noqa: BLE001 - not there yet
            pass
        await js.add_stream(StreamConfig(name=STREAM, subjects=[SUBJECT]))
        sub = await js.pull_subscribe(SUBJECT, durable="fmq-bench", stream=STREAM)
        latencies: list[float] = []

        async def consume() -> None:
            while len(latencies) < total:
                try:
                    msgs = await sub.fetch(batch, timeout=1)
                except nats.errors.TimeoutError:
                    continue
                now = time.perf_counter()
                latencies.extend(now - _sent_at(m.data) for m in msgs)
                await asyncio.gather(*(m.ack() for m in msgs))

        started = time.perf_counter()
        consumer = asyncio.create_task(consume())
        await _publish_all(lambda body: js.publish(SUBJECT, body), total, size, batch, window)
        await consumer
        result = _result(total, started, latencies)
        await js.delete_stream(STREAM)
        return result
    finally:
        await nc.close()


async def rabbitmq_quorum(total: int, size: int, batch: int, window: int) -> dict[str, Any]:
    import aio_pika

    conn = await aio_pika.connect(AMQP_URL, timeout=2)
    try:
        pub = await conn.channel(publisher_confirms=True)
        sub = await conn.channel()
        await sub.set_qos(prefetch_count=2 * batch)
        await pub.queue_delete(QUEUE)
        queue = await sub.declare_queue(QUEUE, durable=True, arguments={"x-queue-type": "quorum"})
        latencies: list[float] = []
        done = asyncio.get_running_loop().create_future()

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            latencies.append(time.perf_counter() - _sent_at(message.body))
            await message.ack()
            if len(latencies) >= total and not done.done():
                done.set_result(None)

        tag = await queue.consume(on_message, no_ack=False)

        def publish(body: bytes) -> Awaitable[Any]:
            message = aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
            return pub.default_exchange.publish(message, routing_key=QUEUE)

        started = time.perf_counter()
        await _publish_all(publish, total, size, batch, window)
        await done
        result = _result(total, started, latencies)
        await queue.cancel(tag)
        await pub.queue_delete(QUEUE)
        return result
    finally:
        await conn.close()


PEERS = {"nats_jetstream": nats_jetstream, "rabbitmq_quorum": rabbitmq_quorum}


def run_peers(total: int, size: int, batch: int = 100, window: int = 10) -> dict[str, dict[str, Any]]:
    """Each peer's figures, or ``{"skipped": why}``; never raises for a peer that is not there."""
    out: dict[str, dict[str, Any]] = {}
    for name, bench in PEERS.items():
        try:
            out[name] = asyncio.run(asyncio.wait_for(bench(total, size, batch, window), timeout=600))
        except ImportError as exc:
            out[name] = {"skipped": f"client library missing ({exc.name}): pip install 'fencemq[bench]'"}
        except Exception as exc:  # noqa: BLE001 - a peer that is not running is a fact to report, not a crash
            out[name] = {"skipped": f"{type(exc).__name__}: {exc}"[:300]}
        print(f"  {name}: " + (f"{out[name]['msgs_per_s']:,.0f} msg/s, p99 {out[name]['p99_ms']:.2f} ms"
                               if "msgs_per_s" in out[name] else f"skipped ({out[name]['skipped']})"), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--size", type=int, default=128)
    opts = ap.parse_args()
    print(json.dumps(run_peers(opts.messages, opts.size), indent=2))


if __name__ == "__main__":
    main()
