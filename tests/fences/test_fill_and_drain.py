"""Redis filled under load, then drained (issue 27, "Done means"): producers get FULL, consumers drain the whole
backlog without one error, producers then succeed again, and nothing acknowledged is lost.

Four producers publish 4 KiB messages to four topics (one consumer group each) into a Redis whose maxmemory
is 8 MiB above what it used at the start — on every master under ``--redis-cluster``. Two runs: with the
default watermark (publishing stops at 90% of maxmemory), and with the watermark at maxmemory itself, where
Redis's own limit refuses the publishes and the consumers drain a Redis that refuses every other write.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import redis

from tests.fences.memory_nodes import Nodes
from tests.helpers import as_map, client, deliveries, worker

TOPICS = [f"fill{i}" for i in range(4)]
BODY = b"x" * 4096
BATCH = 10
HEADROOM = 8 << 20


class Producer(threading.Thread):
    """Publishes MPUBs of BATCH until one succeeds after a FULL (or it is told to stop); keeps every id
    acknowledged, counts FULL, stops at any other error."""

    def __init__(self, port: int, topic: str) -> None:
        super().__init__(daemon=True)
        self.c = client(port, 2, f"producer-{topic}")
        self.topic = topic
        self.acked: list[int] = []
        self.full = 0
        self.after_full = 0  # batches stored after the first FULL
        self.other: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                ids = self.c.execute_command("MPUB", self.topic, BATCH, *[BODY] * BATCH)
            except redis.ResponseError as exc:
                if str(exc).startswith("FULL "):
                    self.full += 1
                    time.sleep(0.01)
                else:
                    self.other.append(str(exc))
                    return
                continue
            self.acked += [int(i) for i in ids]
            if self.full:
                self.after_full += 1
                return  # it succeeded again once consumers drained: enough


@pytest.mark.parametrize("high", [0.9, 1.0], ids=["watermark", "at-maxmemory"])
def test_producers_get_full_consumers_drain_everything_then_producers_succeed_and_nothing_is_lost(
        redis_server, redis_url, high) -> None:
    with Nodes(redis_server) as nodes, worker(redis_url, memory_sample_ms=50, memory_high_watermark=high,
                                              memory_low_watermark=0.6) as w:
        consumer = client(w.port, 2, "drainer")
        handles = {t: as_map(consumer.execute_command("SUB", t, "GROUP", "g"))["handle"] for t in TOPICS}
        start = nodes.used()
        nodes.limit_above(HEADROOM)
        producers = [Producer(w.port, t) for t in TOPICS]
        for p in producers:
            p.start()
        deadline = time.monotonic() + 60
        while not all(p.full for p in producers) and time.monotonic() < deadline:
            assert not any(p.other for p in producers), [p.other for p in producers]
            time.sleep(0.05)
        assert all(p.full for p in producers), "every producer is refused FULL once Redis is full"
        peak = nodes.used()
        stored = sum(len(p.acked) for p in producers)

        # consumers drain while the producers keep trying: not one error
        got: Counter[tuple[str, int]] = Counter()
        drain_started = time.monotonic()
        while time.monotonic() < deadline:
            empty = True
            for t, h in handles.items():
                batch = deliveries(consumer.execute_command("PULL", h, "COUNT", 100))
                if batch:
                    empty = False
                    got.update((t, int(d["id"])) for d in batch)
                    assert consumer.execute_command("ACK", h, *[d["tag"] for d in batch]) == len(batch)
            if empty and all(p.after_full for p in producers):
                break
        drained_s = time.monotonic() - drain_started
        for p in producers:
            p.stop.set()
        for p in producers:
            p.join(10)
        assert not any(p.other for p in producers), [p.other for p in producers]
        assert all(p.after_full for p in producers), "producers succeed again once consumers drained"
        # what was published after the drain is consumed too
        for t, h in handles.items():
            while batch := deliveries(consumer.execute_command("PULL", h, "COUNT", 100)):
                got.update((t, int(d["id"])) for d in batch)
                consumer.execute_command("ACK", h, *[d["tag"] for d in batch])
        acknowledged = {(p.topic, i) for p in producers for i in p.acked}
        assert acknowledged - set(got) == set(), "every acknowledged message was delivered"
        assert max(got.values()) == 1, "none delivered twice"
        end = nodes.used()
        print(f"\nfill-and-drain ({'watermark 0.9' if high < 1 else 'at maxmemory'}): {stored:,} messages of 4 KiB "
              f"stored before every producer met FULL ({sum(p.full for p in producers)} FULL replies in all); "
              f"memory {sum(start) / 2**20:.1f} -> {sum(peak) / 2**20:.1f} MiB at the peak -> {sum(end) / 2**20:.1f} "
              f"after; drained {len(got):,} in {drained_s:.1f} s without an error")
        assert sum(end) < sum(start) + HEADROOM * len(start) * 0.5
