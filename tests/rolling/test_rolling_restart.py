"""The rolling restart (issue #31; `make test-rolling`, run by .ci/run): applications never notice.

Three worker processes, each with an MQTT port, behind a list of addresses. Under a steady load —
an asyncio producer and a blocking one on the SDK, two `async for` consumers and a blocking `for`
consumer in one group, and a paho MQTT 5 publisher and subscriber that reconnect by themselves
(following the Server Reference of the DISCONNECT) — each worker is SIGTERMed and started again
in turn, then one is killed with -9 and started again. Then:

* the application code saw no exception (the SDK's calls and iterators carried on);
* every acknowledged publish was consumed (lost: 0), RESP and MQTT;
* nothing was consumed twice before the kill -9; what the kill made a duplicate is counted;
* the longest pause a consumer saw is reported, with the rest, in one JSON line (and in the file
  FENCEMQ_ROLLING_REPORT names, when set).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from fencemq import Client, SyncClient
from fencemq.server.embedded import EmbeddedRedis, free_port
from tests.helpers import subprocess_worker

pytestmark = [
    pytest.mark.skipif(os.environ.get("FENCEMQ_ROLLING") != "1",
                       reason="restarts three worker processes under load (~1 min): `make test-rolling` runs it"),
    pytest.mark.timeout(300),
]

LOCK_MS = 3000  # what a lost PULL reply (a kill -9) leaves checked out comes back after this
TOPIC, MQTT_TOPIC = "rolling", "rolling/mqtt"


class Fleet:
    """Three workers in their own processes, on fixed ports: a restart comes back where it was."""

    def __init__(self, redis_url: str, n: int = 3) -> None:
        self.redis_url = redis_url
        self.ports = [free_port() for _ in range(n)]
        self.mqtt_ports = [free_port() for _ in range(n)]
        self.procs: list[subprocess.Popen | None] = [None] * n
        self.restarts: list[dict[str, Any]] = []

    def start(self, i: int) -> None:
        nxt = (i + 1) % len(self.ports)
        self.procs[i] = subprocess_worker(
            self.redis_url, self.ports[i], mqtt_port=self.mqtt_ports[i], drain_timeout_ms=3000,
            default_lock_ms=LOCK_MS, server_reference=f"127.0.0.1:{self.mqtt_ports[nxt]}")

    def restart(self, i: int, sig: signal.Signals) -> None:
        proc = self.procs[i]
        assert proc is not None
        began = time.monotonic()
        proc.send_signal(sig)
        code = proc.wait(20)
        stopped = time.monotonic()
        self.start(i)
        self.restarts.append({"worker": i, "signal": sig.name, "exit": code,
                              "stop_s": round(stopped - began, 2), "down_s": round(time.monotonic() - stopped, 2)})

    @property
    def urls(self) -> list[str]:
        return [f"redis://127.0.0.1:{p}" for p in self.ports]

    def stop(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


@dataclass
class Ledger:
    """What the applications did and saw."""

    acked: set[bytes] = field(default_factory=set)  # publishes acknowledged to their producer
    received: list[tuple[str, bytes, float]] = field(default_factory=list)  # (consumer, payload, when)
    exceptions: list[str] = field(default_factory=list)  # anything the application code was handed
    lock: threading.Lock = field(default_factory=threading.Lock)

    def got(self, consumer: str, payload: bytes) -> None:
        with self.lock:
            self.received.append((consumer, payload, time.monotonic()))

    def failed(self, who: str, exc: BaseException) -> None:
        with self.lock:
            self.exceptions.append(f"{who}: {exc!r}")

    def consumed(self) -> set[bytes]:
        with self.lock:
            return {p for _, p, _ in self.received}


# -- the applications: plain SDK code, no error handling of their own -------------------------


async def async_side(urls: list[str], resp: Ledger, producing: threading.Event, stop: threading.Event) -> None:
    async def producer() -> None:
        try:
            async with Client(urls, client_id="roll-producer-a") as c:
                n = 0
                while producing.is_set():
                    if n % 2:
                        payloads = [b"a-%d" % (n + k) for k in range(5)]
                        await c.mpublish(TOPIC, payloads)
                        resp.acked.update(payloads)
                        n += 5
                    else:
                        await c.publish(TOPIC, b"a-%d" % n)
                        resp.acked.add(b"a-%d" % n)
                        n += 1
                    await asyncio.sleep(0.005)
        except Exception as exc:  # noqa: BLE001 - counted: the test requires there be none
            resp.failed("async producer", exc)

    async def consumer(name: str) -> None:
        try:
            async with Client(urls, client_id=name) as c:
                sub = await c.subscribe(TOPIC, group="g", lock_ms=LOCK_MS)
                async for d in sub.iter(count=20, block_ms=200):
                    resp.got(name, d.payload)
                    await sub.ack(d)
                    if stop.is_set():
                        return
        except Exception as exc:  # noqa: BLE001
            resp.failed(name, exc)

    async def stopper(tasks: list[asyncio.Task[None]]) -> None:
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # an idle consumer's long poll is 200 ms
        for t in tasks:
            t.cancel()

    consumers = [asyncio.ensure_future(consumer(f"roll-consumer-{k}")) for k in (1, 2)]
    await asyncio.gather(producer(), stopper(consumers), *consumers, return_exceptions=True)


def blocking_producer(urls: list[str], resp: Ledger, producing: threading.Event) -> None:
    try:
        with SyncClient.connect(urls, client_id="roll-producer-b") as c:
            n = 0
            while producing.is_set():
                c.publish(TOPIC, b"b-%d" % n)
                resp.acked.add(b"b-%d" % n)
                n += 1
                time.sleep(0.005)
    except Exception as exc:  # noqa: BLE001
        resp.failed("blocking producer", exc)


def blocking_consumer(c: SyncClient, resp: Ledger) -> None:
    """Until the client is closed (from the test's thread, at the end): `for` then simply ends."""
    try:
        sub = c.subscribe(TOPIC, group="g", lock_ms=LOCK_MS)
        for d in sub.iter(count=20, block_ms=200):
            resp.got("roll-consumer-3", d.payload)
            sub.ack(d)
    except Exception as exc:  # noqa: BLE001
        resp.failed("roll-consumer-3", exc)


class Balancer:
    """A TCP balancer in front of the workers' MQTT ports, as MQTT clients usually meet a fleet: each
    new connection goes to the next worker that accepts it (a draining one accepts none)."""

    def __init__(self, ports: list[int]) -> None:
        self.ports, self.turn = ports, 0
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = None
            for _ in range(len(self.ports)):
                self.turn += 1
                try:
                    upstream = socket.create_connection(("127.0.0.1", self.ports[self.turn % len(self.ports)]), 0.5)
                    upstream.settimeout(None)  # the 0.5 s was for connecting only
                    break
                except OSError:
                    continue
            if upstream is None:
                client.close()
                continue
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):  # either side gone: both go (a worker killed resets its client)
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self._listener.close()


class PahoClient:
    """A paho MQTT 5 client as an application writes one: it reconnects by itself (loop_start,
    reconnect_delay_set) and resumes its session (Clean Start 0, an expiry). What its DISCONNECTs
    said is kept (``told``: reason code, Server Reference)."""

    def __init__(self, client_id: str, port: int) -> None:
        self.connected = threading.Event()
        self.told: list[tuple[int, str | None]] = []
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
        self.c.reconnect_delay_set(0.05, 1)  # type: ignore[arg-type]
        self.c.max_queued_messages_set(0)
        self.c.on_connect = lambda *_a: self.connected.set()
        self.c.on_disconnect = self._on_disconnect
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = 300
        self.c.connect("127.0.0.1", port, keepalive=5, clean_start=False, properties=props)
        self.c.loop_start()
        assert self.connected.wait(10)

    def _on_disconnect(self, _c: Any, _u: Any, _flags: Any, reason: Any, props: Any) -> None:
        self.connected.clear()
        self.told.append((reason.value, getattr(props, "ServerReference", None) if props is not None else None))

    def stop(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def mqtt_publisher(port: int, ledger: Ledger, producing: threading.Event, told: list) -> None:
    sent: list[tuple[bytes, int]] = []  # payload, packet id (fewer than 65,535 here: none reused)
    acked: set[int] = set()  # PUBACK received (paho's on_publish, on its network thread)
    try:
        pub = PahoClient("roll-mqtt-pub", port)
        pub.c.on_publish = lambda _c, _u, mid, _reason, _props: acked.add(mid)
        n = 0
        while producing.is_set():
            payload = b"m-%d" % n
            sent.append((payload, pub.c.publish(MQTT_TOPIC, payload, qos=1).mid))  # queued while reconnecting
            n += 1
            time.sleep(0.01)
        deadline = time.monotonic() + 20  # what is queued or in flight is acknowledged once it got through
        while len(acked) < len(sent) and time.monotonic() < deadline:
            time.sleep(0.05)
        pub.stop()
        told += pub.told
    except Exception as exc:  # noqa: BLE001
        ledger.failed("mqtt publisher", exc)
    with ledger.lock:
        ledger.acked.update(payload for payload, mid in sent if mid in acked)


# -- the test -----------------------------------------------------------------------------------


def _pauses(received: list[tuple[str, bytes, float]], until: float) -> dict[str, float]:
    """Per consumer: the longest time between two deliveries while the producers ran."""
    by: dict[str, list[float]] = {}
    for who, _, when in received:
        if when <= until:
            by.setdefault(who, []).append(when)
    return {who: round(max((b - a for a, b in zip(ts, ts[1:])), default=0.0), 3) for who, ts in by.items()}


def test_a_rolling_restart_and_a_kill_under_load_go_unnoticed_by_the_applications() -> None:
    with EmbeddedRedis() as server:
        fleet = Fleet(server.url)
        resp, mq = Ledger(), Ledger()
        producing, stop = threading.Event(), threading.Event()
        producing.set()
        try:
            for i in range(3):
                fleet.start(i)
            balancer = Balancer(fleet.mqtt_ports)
            told: list[tuple[int, str | None]] = []
            sub = PahoClient("roll-mqtt-sub", balancer.port)
            sub.c.on_message = lambda _c, _u, msg: mq.got("mqtt-sub", msg.payload)
            subscribed = threading.Event()
            sub.c.on_subscribe = lambda *_a: subscribed.set()
            sub.c.subscribe(MQTT_TOPIC, qos=1)
            assert subscribed.wait(10), "no SUBACK"
            blocking = SyncClient.connect(fleet.urls, client_id="roll-consumer-3")
            threads = [threading.Thread(target=asyncio.run, args=(async_side(fleet.urls, resp, producing, stop),),
                                        name="async side"),
                       threading.Thread(target=blocking_producer, args=(fleet.urls, resp, producing),
                                        name="blocking producer"),
                       threading.Thread(target=blocking_consumer, args=(blocking, resp), name="blocking consumer"),
                       threading.Thread(target=mqtt_publisher, args=(balancer.port, mq, producing, told),
                                        name="mqtt publisher")]
            for t in threads:
                t.start()
            began = time.monotonic()
            time.sleep(2)
            for i in range(3):  # the deploy: one worker after the other
                fleet.restart(i, signal.SIGTERM)
                time.sleep(1.5)
            killed_at = time.monotonic()
            fleet.restart(1, signal.SIGKILL)  # and a crash
            time.sleep(2)
            producing.clear()
            produced_until = time.monotonic()
            deadline = produced_until + LOCK_MS / 1000 + 30
            while time.monotonic() < deadline and not (resp.acked <= resp.consumed() and mq.acked <= mq.consumed()
                                                       and not threads[3].is_alive()):
                time.sleep(0.1)
            stop.set()
            blocking.close()
            for t in threads:
                t.join(30)
            assert not [t.name for t in threads if t.is_alive()]
            sub.stop()
            told += sub.told
            balancer.close()
        finally:
            fleet.stop()

    def tally(ledger: Ledger) -> dict[str, Any]:
        counts = Counter(p for _, p, _ in ledger.received)
        twice = {p for p, n in counts.items() if n > 1}
        before_kill = {p for p in twice if sum(1 for _, q, t in ledger.received if q == p and t < killed_at) > 1}
        return {"acknowledged": len(ledger.acked), "consumed": len(counts), "lost": len(ledger.acked - set(counts)),
                "duplicates": len(twice), "duplicates_before_the_kill": len(before_kill),
                "exceptions": len(ledger.exceptions)}

    report = {"resp_sdk": tally(resp), "mqtt": tally(mq),
              "longest_pause_s": _pauses(resp.received + mq.received, produced_until),
              "run_s": round(produced_until - began, 1), "restarts": fleet.restarts,
              "mqtt_disconnects": Counter(f"0x{code:02X} {ref or ''}".strip() for code, ref in told),
              "exceptions": resp.exceptions + mq.exceptions}
    print("rolling restart:", json.dumps(report))
    if os.environ.get("FENCEMQ_ROLLING_REPORT"):
        with open(os.environ["FENCEMQ_ROLLING_REPORT"], "w") as f:
            json.dump(report, f, indent=2)
    assert report["exceptions"] == []
    assert [r["exit"] for r in fleet.restarts[:3]] == [0, 0, 0], "a SIGTERMed worker drains and exits 0"
    # each drained worker sent its MQTT 5 clients elsewhere, saying where
    assert any(code == 0x8B and ref for code, ref in told), told
    for side in ("resp_sdk", "mqtt"):
        assert report[side]["acknowledged"] > 100, report
        assert report[side]["lost"] == 0, report
        assert report[side]["duplicates_before_the_kill"] == 0, report
