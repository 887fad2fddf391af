"""A crowd of clients for bench.connections: many processes, raw sockets, pre-encoded handshakes.

The client side of a connection storm must not be what is measured: 20,000 paho objects on
2 CPUs would be. Each process of a :class:`Crowd` holds its share of the connections as bare
asyncio protocols (uvloop when installed) whose handshakes are bytes encoded once
(``HELLO 2 SETNAME <id>`` for RESP, ``CONNECT`` for MQTT 3.1.1), and runs the phases the
parent asks for, all processes at once:

* ``connect``: open every connection (at most ``window`` handshakes in flight per process)
  and wait for its reply (HELLO's map, CONNACK). Reports what was accepted, refused
  (an error or a CONNACK code), closed, and per-handshake latency.
* ``subscribe``: MQTT SUBSCRIBE ``dev/<id>`` at QoS 1 on every connection, wait for SUBACK.
* ``drop``: reset every connection at once (SO_LINGER 0: the network blip, no DISCONNECT).
* ``close``: close every connection.
* ``received``: which connections received a PUBLISH since the last phase (subscriptions
  that deliver).

A connection goes to ``ports[i % len(ports)]`` from source address ``127.0.0.<2 + i % 16>``,
so 50,000 connections to one port do not run out of the ephemeral ports of one address.
Each process reports its own CPU time: the crowd was not the bottleneck if it stayed below
the wall time.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import resource
import socket
import struct
import time
from typing import Any

import hiredis

SOURCES = 16  # source addresses 127.0.0.2 … 127.0.0.17


def resp_hello(client_id: str) -> bytes:
    return hiredis.pack_command(("HELLO", "2", "SETNAME", client_id))


def mqtt_connect(client_id: str, clean: bool = True, keep_alive: int = 600) -> bytes:
    """CONNECT, MQTT 3.1.1 (Clean Session 0 is a session that outlives the connection)."""
    cid = client_id.encode()
    body = b"\x00\x04MQTT\x04" + bytes([0x02 if clean else 0x00]) + keep_alive.to_bytes(2, "big")
    body += len(cid).to_bytes(2, "big") + cid
    return b"\x10" + _length(len(body)) + body


def mqtt_subscribe(topic: str, packet_id: int = 1, qos: int = 1) -> bytes:
    t = topic.encode()
    body = packet_id.to_bytes(2, "big") + len(t).to_bytes(2, "big") + t + bytes([qos])
    return b"\x82" + _length(len(body)) + body


def mqtt_publish(topic: str, payload: bytes) -> bytes:
    """PUBLISH at QoS 0."""
    t = topic.encode()
    body = len(t).to_bytes(2, "big") + t + payload
    return b"\x30" + _length(len(body)) + body


def _length(n: int) -> bytes:
    out = bytearray()
    while True:
        n, digit = divmod(n, 128)
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)


class Client(asyncio.Protocol):
    """One connection: its handshake's reply, then what arrives (MQTT packets are counted by type)."""

    __slots__ = ("kind", "transport", "buf", "waiting", "reader", "publishes", "closed", "session_present")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiting: asyncio.Future[Any] | None = None
        self.reader = hiredis.Reader() if kind == "resp" else None
        self.publishes = 0
        self.closed = False
        self.session_present = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiting is not None and not self.waiting.done():
            self.waiting.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self.reader is not None:
            self.reader.feed(data)
            reply = self.reader.gets()
            if reply is not False and self.waiting is not None and not self.waiting.done():
                self.waiting.set_result(reply)
            return
        self.buf += data
        while len(self.buf) >= 2:
            size, used = 0, 1
            for shift in range(4):
                if used >= len(self.buf):
                    return
                byte = self.buf[used]
                used += 1
                size |= (byte & 0x7F) << (7 * shift)
                if not byte & 0x80:
                    break
            if len(self.buf) < used + size:
                return
            packet = bytes(self.buf[:used + size])
            del self.buf[:used + size]
            kind = packet[0] >> 4
            if kind == 3:  # PUBLISH: acknowledge QoS 1
                self.publishes += 1
                if packet[0] & 0x06:
                    topic_len = struct.unpack_from(">H", packet, used)[0]
                    pid = packet[used + 2 + topic_len:used + 4 + topic_len]
                    if self.transport is not None:
                        self.transport.write(b"\x40\x02" + pid)
            elif self.waiting is not None and not self.waiting.done():
                if kind == 2:
                    self.session_present = bool(packet[used] & 1)
                self.waiting.set_result(packet)

    def expect(self) -> asyncio.Future[Any]:
        self.waiting = asyncio.get_running_loop().create_future()
        return self.waiting


def _accepted(kind: str, reply: Any) -> str:
    if reply is None:
        return "closed"
    if kind == "resp":
        return "refused" if isinstance(reply, hiredis.ReplyError) else "accepted"
    return "accepted" if reply[0] >> 4 == 2 and reply[3] == 0 else "refused"


class _Member:
    """One process's share of the crowd."""

    def __init__(self, kind: str, ids: list[str], indexes: list[int], ports: list[int], window: int,
                 clean: bool) -> None:
        self.kind, self.ids, self.indexes, self.ports, self.window, self.clean = kind, ids, indexes, ports, window, clean
        self.clients: list[Client | None] = [None] * len(ids)

    async def _open(self, k: int, latencies: list[int], outcome: dict[str, int]) -> None:
        i, client_id = self.indexes[k], self.ids[k]
        loop = asyncio.get_running_loop()
        hello = resp_hello(client_id) if self.kind == "resp" else mqtt_connect(client_id, self.clean)
        t0 = time.perf_counter_ns()
        try:
            _, client = await loop.create_connection(
                lambda: Client(self.kind), "127.0.0.1", self.ports[i % len(self.ports)],
                local_addr=(f"127.0.0.{2 + i % SOURCES}", 0))
        except OSError:
            outcome["connect_failed"] = outcome.get("connect_failed", 0) + 1
            return
        waiting = client.expect()
        assert client.transport is not None
        client.transport.write(hello)
        try:
            reply = await asyncio.wait_for(waiting, 120)
        except asyncio.TimeoutError:
            reply = None
        latencies.append(time.perf_counter_ns() - t0)
        verdict = _accepted(self.kind, reply)
        outcome[verdict] = outcome.get(verdict, 0) + 1
        if verdict == "accepted":
            outcome["session_present"] = outcome.get("session_present", 0) + client.session_present
            self.clients[k] = client
        elif client.transport is not None:
            client.transport.close()

    async def connect(self, window: int | None = None) -> dict[str, Any]:
        """Open every connection, ``window`` handshakes in flight at most (None: the crowd's)."""
        latencies: list[int] = []
        outcome: dict[str, int] = {}
        queue = iter(range(len(self.ids)))

        async def lane() -> None:
            for k in queue:
                await self._open(k, latencies, outcome)

        lanes = min(window or self.window, len(self.ids)) or 1
        await asyncio.gather(*(lane() for _ in range(lanes)))
        return {"outcome": outcome, "latencies_ns": latencies}

    async def subscribe(self) -> dict[str, Any]:
        waits = []
        for k, client in enumerate(self.clients):
            if client is not None and not client.closed and client.transport is not None:
                waits.append(client.expect())
                client.transport.write(mqtt_subscribe(f"dev/{self.ids[k]}"))
        done, _ = await asyncio.wait(waits, timeout=300) if waits else (set(), set())
        replies = [w.result() for w in done]
        return {"outcome": {"subacked": sum(1 for r in replies if r is not None and r[0] >> 4 == 9),
                            "suback_missing": len(waits) - len(done)}}

    async def drop(self) -> dict[str, Any]:
        for client in self.clients:
            if client is not None and client.transport is not None:
                sock = client.transport.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client.transport.abort()
        self.clients = [None] * len(self.ids)
        await asyncio.sleep(0)
        return {"outcome": {}}

    async def close(self) -> dict[str, Any]:
        for client in self.clients:
            if client is not None and client.transport is not None:
                client.transport.close()
        self.clients = [None] * len(self.ids)
        await asyncio.sleep(0.1)
        return {"outcome": {}}

    async def received(self) -> dict[str, Any]:
        got = {self.ids[k]: c.publishes for k, c in enumerate(self.clients) if c is not None and c.publishes}
        for c in self.clients:
            if c is not None:
                c.publishes = 0
        return {"outcome": {"received": len(got)}, "ids": sorted(got)}

    async def serve(self, pipe: Any) -> None:
        loop = asyncio.get_running_loop()
        while True:
            phase, kwargs = await loop.run_in_executor(None, pipe.recv)
            if phase == "exit":
                return
            cpu0, t0 = _cpu(), time.perf_counter()
            result = await getattr(self, phase)(**kwargs)
            result["cpu_s"], result["wall_s"] = _cpu() - cpu0, time.perf_counter() - t0
            pipe.send(result)


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _member_main(pipe: Any, args: tuple[Any, ...]) -> None:
    try:  # Linux: end with the bench, however it ends
        import ctypes
        import signal
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    want = len(args[1]) + 1000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), max(hard, want)))  # root may raise the hard one
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    member = _Member(*args)
    try:
        import uvloop
        uvloop.run(member.serve(pipe))
    except ImportError:
        asyncio.run(member.serve(pipe))


class Crowd:
    """``n`` clients of one kind (``resp`` or ``mqtt``) in ``processes`` processes, ids ``<prefix><i>``."""

    def __init__(self, kind: str, n: int, ports: list[int], *, prefix: str, processes: int = 4,
                 window: int = 64, clean: bool = True) -> None:
        ctx = mp.get_context("fork")
        self.members: list[tuple[Any, Any]] = []
        for p in range(processes):
            indexes = list(range(p, n, processes))
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_member_main, daemon=True,
                               args=(child, (kind, [f"{prefix}{i}" for i in indexes], indexes, ports, window, clean)))
            proc.start()
            self.members.append((proc, parent))

    def run(self, phase: str, **kwargs: Any) -> dict[str, Any]:
        """One phase in every process at once; their outcomes summed, latencies merged, times at worst."""
        t0 = time.perf_counter()
        for _, pipe in self.members:
            pipe.send((phase, kwargs))
        results = [pipe.recv() for _, pipe in self.members]
        merged: dict[str, Any] = {"wall_s": time.perf_counter() - t0, "outcome": {}, "latencies_ns": [],
                                  "crowd_cpu_s": [round(r["cpu_s"], 2) for r in results], "ids": []}
        for r in results:
            for k, v in r["outcome"].items():
                merged["outcome"][k] = merged["outcome"].get(k, 0) + v
            merged["latencies_ns"] += r.get("latencies_ns", [])
            merged["ids"] += r.get("ids", [])
        return merged

    def stop(self) -> None:
        for proc, pipe in self.members:
            try:
                pipe.send(("exit", {}))
            except OSError:
                pass
            proc.join(10)
            if proc.is_alive():
                proc.kill()

    def __enter__(self) -> "Crowd":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
