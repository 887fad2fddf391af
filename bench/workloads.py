"""Producer/consumer loops for FenceMQ and for raw Redis Streams, over bench.resp.

Every payload starts with the sender's wall clock (time.time_ns, 8 bytes,
little endian) padded to the requested size; the consumer subtracts it from
its own clock when the PULL/XREADGROUP reply arrives (publish -> deliver).
Both systems run the same shape: batch publishes pipelined ``window`` deep on
one connection, one consumer connection that pipelines the ACK of batch k with
the read of batch k+1.
"""

from __future__ import annotations

import asyncio
import struct
import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from collections.abc import Awaitable, Callable
from typing import Any

from bench.resp import RespConn

_STAMP = struct.Struct("<q")

# One script call appends a batch; one script call settles the previous batch
# and reads the next (Lua cannot block, so an empty read falls back to a
# native XREADGROUP ... BLOCK).
RAW_PUBLISH_LUA = """
for i = 1, #ARGV do
  redis.call('XADD', KEYS[1], '*', 'd', ARGV[i])
end
return #ARGV
"""
RAW_ACK_READ_LUA = """
if #ARGV > 3 then
  redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 4))
end
return redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', ARGV[3], 'STREAMS', KEYS[1], '>')
"""


def make_payload(pad: bytes) -> bytes:
    return _STAMP.pack(time.time_ns()) + pad


@dataclass
class Run:
    messages: int = 0
    t_first_pub: float = 0.0  # perf_counter
    t_last_pub_reply: float = 0.0
    t_last_ack: float = 0.0
    acked: int = 0
    delivered: int = 0
    redelivered: int = 0
    pub_rtt_ns: array = field(default_factory=lambda: array("q"))
    latencies_ns: array = field(default_factory=lambda: array("q"))

    @property
    def seconds(self) -> float:
        return self.t_last_ack - self.t_first_pub


class FenceMQ:
    """FenceMQ verbs: MPUB/PUB, SUB ... GROUP, PULL COUNT n BLOCK ms, ACK."""

    name = "fencemq"

    def __init__(self, topic: str, group: str = "g") -> None:
        self.topic, self.group = topic, group
        self.handle: bytes | None = None
        self.redelivered = 0
        self._ti = self._pi = self._di = -1

    async def setup(self, producer: RespConn, consumer: RespConn, first: bool = True) -> None:
        reply = await consumer.call("SUB", self.topic, "GROUP", self.group)
        fields = dict(zip(reply[::2], reply[1::2]))
        self.handle = fields[b"handle"]

    def publish_batch(self, payloads: list[bytes]) -> tuple:
        return ("MPUB", self.topic, len(payloads), *payloads)

    def publish_one(self, payload: bytes) -> tuple:
        return ("PUB", self.topic, payload)

    def check_publish(self, reply: Any, n: int) -> None:
        if n > 1 or isinstance(reply, list):
            assert isinstance(reply, list) and len(reply) == n, reply

    async def step(self, conn: RespConn, acks: list, count: int, block_ms: int | None, lua: bool) -> tuple[list, list, int]:
        """ACK the previous batch and PULL the next in one write; (ack ids, payloads, acked).
        block_ms None: a PULL that does not block."""
        cmds: list[tuple] = []
        if acks:
            cmds.append(("ACK", self.handle, *acks))
        pull: tuple = ("PULL", self.handle, "COUNT", count)
        cmds.append(pull if block_ms is None else (*pull, "BLOCK", block_ms))
        futs = conn.send(cmds)
        deliveries = await futs[-1]
        acked = (await futs[0]) if acks else 0
        if not deliveries:
            return [], [], acked
        if self._ti < 0:
            first = deliveries[0]
            self._ti, self._pi = first.index(b"tag") + 1, first.index(b"payload") + 1
            self._di = first.index(b"deliveries") + 1
        ti, pi, di = self._ti, self._pi, self._di
        self.redelivered += sum(1 for d in deliveries if d[di] != 1)
        return [d[ti] for d in deliveries], [d[pi] for d in deliveries], acked

    async def final_ack(self, conn: RespConn, acks: list) -> int:
        return await conn.call("ACK", self.handle, *acks)


class RawStreams:
    """Redis Streams the best way we know from Python: Lua batches for XADD and XACK+XREADGROUP."""

    name = "raw"

    def __init__(self, key: str, group: str = "g", consumer: str = "c1") -> None:
        self.key, self.group, self.consumer = key, group, consumer
        self.sha_pub = self.sha_read = b""
        self.redelivered = 0  # Streams do not say; XCLAIM is not part of this run

    async def setup(self, producer: RespConn, consumer: RespConn, first: bool = True) -> None:
        self.sha_pub = await producer.call("SCRIPT", "LOAD", RAW_PUBLISH_LUA)
        self.sha_read = await producer.call("SCRIPT", "LOAD", RAW_ACK_READ_LUA)
        if first:
            await consumer.call("XGROUP", "CREATE", self.key, self.group, "0", "MKSTREAM")

    def publish_batch(self, payloads: list[bytes]) -> tuple:
        return ("EVALSHA", self.sha_pub, 1, self.key, *payloads)

    def publish_one(self, payload: bytes) -> tuple:
        return ("XADD", self.key, "*", "d", payload)

    def check_publish(self, reply: Any, n: int) -> None:
        assert (reply == n) if n > 1 else isinstance(reply, bytes), reply

    def _entries(self, reply: Any) -> tuple[list, list]:
        if not reply:
            return [], []
        entries = reply[0][1]
        return [e[0] for e in entries], [e[1][1] for e in entries]

    async def step(self, conn: RespConn, acks: list, count: int, block_ms: int | None, lua: bool) -> tuple[list, list, int]:
        if lua and block_ms is None:  # flat out: one script call acks batch k and reads batch k+1
            reply = await conn.call("EVALSHA", self.sha_read, 1, self.key, self.group, self.consumer, count, *acks)
            ids, payloads = self._entries(reply)
            return ids, payloads, len(acks)
        cmds: list[tuple] = []
        if acks:
            cmds.append(("XACK", self.key, self.group, *acks))
        block = () if block_ms is None else ("BLOCK", block_ms)
        cmds.append(("XREADGROUP", "GROUP", self.group, self.consumer, "COUNT", count, *block, "STREAMS", self.key, ">"))
        futs = conn.send(cmds)
        reply = await futs[-1]
        acked = (await futs[0]) if acks else 0
        ids, payloads = self._entries(reply)
        return ids, payloads, acked

    async def final_ack(self, conn: RespConn, acks: list) -> int:
        return await conn.call("XACK", self.key, self.group, *acks)


async def consume(conn: RespConn, system: Any, run: Run, total: int, count: int, block_ms: int, lua: bool,
                  done: asyncio.Event) -> None:
    """Read and settle until ``total`` messages are acked by all consumers together."""
    acks: list = []
    lat = run.latencies_ns
    unpack = _STAMP.unpack_from

    def settled(n: int) -> None:
        run.acked += n
        if run.acked >= total and not done.is_set():
            run.t_last_ack = time.perf_counter()
            done.set()

    # Flat out (lua=True) a read blocks only after an empty one, so an ACK never
    # waits behind a blocking read; at low load ACK and blocking PULL go together.
    block: int | None = block_ms
    while run.delivered < total:
        ids, payloads, acked = await system.step(conn, acks, count, block, lua)
        if lua:
            block = None if ids else block_ms
        now = time.time_ns()
        lat.extend([now - unpack(p)[0] for p in payloads])
        run.delivered += len(ids)
        settled(acked)
        acks = ids
    if acks:
        settled(await system.final_ack(conn, acks))


async def produce_batches(conn: RespConn, system: Any, run: Run, total: int, size: int, batch: int, window: int) -> None:
    pad = b"x" * max(0, size - _STAMP.size)
    inflight: deque[tuple[asyncio.Future, int]] = deque()
    sent = 0
    run.t_first_pub = time.perf_counter()
    while sent < total:
        n = min(batch, total - sent)
        payloads = [make_payload(pad) for _ in range(n)]
        inflight.append((conn.send([system.publish_batch(payloads)])[0], n))
        sent += n
        if len(inflight) >= window:
            fut, k = inflight.popleft()
            system.check_publish(await fut, k)
    while inflight:
        fut, k = inflight.popleft()
        system.check_publish(await fut, k)
    run.t_last_pub_reply = time.perf_counter()
    run.messages = sent


async def in_flight(send_batch: Callable[[int], Awaitable[Any]], total: int, batch: int, window: int) -> None:
    """Send ``total`` items as ``send_batch(n)`` calls of up to ``batch``, ``window`` calls at once (client APIs)."""
    slots = asyncio.Semaphore(window)

    async def one(n: int) -> None:
        try:
            await send_batch(n)
        finally:
            slots.release()

    tasks = []
    for start in range(0, total, batch):
        await slots.acquire()
        tasks.append(asyncio.create_task(one(min(batch, total - start))))
    await asyncio.gather(*tasks)


async def produce_paced(conn: RespConn, system: Any, run: Run, total: int, size: int, rate: float) -> None:
    """One publish command per message at ``rate`` msg/s (the low-load latency run)."""
    loop = asyncio.get_running_loop()
    pad = b"x" * max(0, size - _STAMP.size)
    futs = []
    t0 = loop.time()
    run.t_first_pub = time.perf_counter()
    rtt = run.pub_rtt_ns

    def replied(sent_ns: int) -> Any:
        return lambda fut: rtt.append(time.time_ns() - sent_ns)

    for i in range(total):
        delay = t0 + i / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        payload = make_payload(pad)
        fut = conn.send([system.publish_one(payload)])[0]
        fut.add_done_callback(replied(_STAMP.unpack_from(payload)[0]))
        futs.append(fut)
    for fut in futs:
        system.check_publish(await fut, 1)
    run.t_last_pub_reply = time.perf_counter()
    run.messages = total


async def e2e(host: str, port: int, make_system: Any, *, total: int, size: int, batch: int = 100, window: int = 10,
              count: int = 100, block_ms: int = 1000, rate: float | None = None, consumers: int = 1) -> Run:
    """One producer and ``consumers`` consumers (one connection each), concurrently, on one
    asyncio loop. ``make_system(i)`` gives consumer i's view (i = 0 also publishes).
    rate=None: flat out; else one publish command per message at that rate."""
    systems = [make_system(i) for i in range(consumers)]
    producer = await RespConn.open(host, port)
    conns = [await RespConn.open(host, port) for _ in range(consumers)]
    tasks: list[asyncio.Task] = []
    try:
        for i, (system, conn) in enumerate(zip(systems, conns)):
            await system.setup(producer, conn, first=i == 0)
        run, done = Run(), asyncio.Event()
        if rate is None:
            pub = produce_batches(producer, systems[0], run, total, size, batch, window)
        else:
            pub = produce_paced(producer, systems[0], run, total, size, rate)
        tasks = [asyncio.create_task(consume(c, s, run, total, count, block_ms, rate is None, done))
                 for s, c in zip(systems, conns)]
        await pub
        await done.wait()
        run.redelivered = sum(s.redelivered for s in systems)
        return run
    finally:
        for t in tasks:  # the others may still be blocked in a read: they are done
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in [producer, *conns]:
            await c.close()
