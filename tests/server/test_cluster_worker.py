"""A worker in front of a Redis Cluster (three private masters, the slots split between them).

The worker finds out it talks to a Cluster (INFO cluster) and takes redis-py's
cluster client: each fence goes to the master that owns its queue's slot, a
long-poll waits on that master's sharded channel, and session notices ride
classic pub/sub, which reaches every node.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from fencemq import SyncClient
from fencemq.config import Config
from fencemq.server.embedded import EmbeddedRedis
from fencemq.model.keys import Keyspace, QueueRef
from fencemq.server.runner import WorkerThread
from tests.helpers import wait_for

KEYS = Keyspace()


def masters_by_slot(cluster: list[EmbeddedRedis]) -> dict[int, int]:
    """slot -> index of the master that owns it (read from CLUSTER SLOTS)."""
    owner: dict[int, int] = {}
    ports = [srv.port for srv in cluster]
    with redis.Redis(port=cluster[0].port) as r:
        for lo, hi, master, *_ in r.execute_command("CLUSTER", "SLOTS"):
            for slot in range(int(lo), int(hi) + 1):
                owner[slot] = ports.index(int(master[1]))
    return owner


def topics_on_every_master(cluster: list[EmbeddedRedis]) -> list[str]:
    """One plain topic per master: its queue's keys live there."""
    owner, found = masters_by_slot(cluster), {}
    for i in range(1000):
        topic = f"ct{i}"
        found.setdefault(owner[key_slot(KEYS.queue(QueueRef(topic)).meta.encode())], topic)
        if len(found) == len(cluster):
            return [found[m] for m in sorted(found)]
    raise AssertionError("no topic for some master")


@pytest.fixture
def cluster_worker(cluster: list[EmbeddedRedis]) -> Any:
    url = f"redis://127.0.0.1:{cluster[0].port}/0"  # any node: the worker finds the rest
    w = WorkerThread(Config(redis_url=url, port=0, session_lease_ms=500)).start()
    try:
        yield w
    finally:
        w.stop()
    assert w.error is None, f"the worker ended on an error: {w.error!r}"


def test_the_worker_serves_queues_on_every_master(cluster: list[EmbeddedRedis], cluster_worker: WorkerThread) -> None:
    topics = topics_on_every_master(cluster)
    with SyncClient.connect(f"redis://127.0.0.1:{cluster_worker.port}", client_id="c1") as c:
        for topic in topics:
            sub = c.subscribe(topic, start="earliest")
            c.mpublish(topic, [b"a", b"b"])
            got = sub.pull(5)
            assert [d.payload for d in got] == [b"a", b"b"]
            assert sub.ack(*got) == 2
    for srv, topic in zip(cluster, topics, strict=True):  # each queue's state is on its own master
        with redis.Redis(port=srv.port) as node:
            assert node.exists(KEYS.queue(QueueRef(topic)).meta) == 1


def test_a_long_poll_wakes_on_a_publish_to_a_queue_on_another_master(cluster: list[EmbeddedRedis],
                                                                       cluster_worker: WorkerThread) -> None:
    url = f"redis://127.0.0.1:{cluster_worker.port}"
    for topic in topics_on_every_master(cluster):
        with SyncClient.connect(url, client_id=f"waiter-{topic}") as waiter, \
                SyncClient.connect(url, client_id=f"producer-{topic}") as producer:
            sub = waiter.subscribe(topic, start="latest")
            got: list[Any] = []
            t = threading.Thread(target=lambda s=sub: got.extend(s.pull(1, block_ms=10_000)))
            started = time.monotonic()
            t.start()
            time.sleep(0.3)  # the PULL is waiting on the queue's sharded channel by now
            producer.publish(topic, b"wake up")
            t.join(15)
            assert [d.payload for d in got] == [b"wake up"], topic
            assert time.monotonic() - started < 5, f"{topic}: woken by the publish, not by the 10 s timeout"


def test_a_preempted_lite_owner_is_told_and_its_session_end_clears_the_marker(cluster: list[EmbeddedRedis],
                                                                               cluster_worker: WorkerThread) -> None:
    url = f"redis://127.0.0.1:{cluster_worker.port}"
    meta = KEYS.queue(QueueRef("chat", "room-7")).meta
    node = redis.Redis(port=cluster[masters_by_slot(cluster)[key_slot(meta.encode())]].port, decode_responses=True)
    b = SyncClient.connect(url, client_id="B")
    try:
        a = SyncClient.connect(url, client_id="A")
        a.subscribe("chat", lmq="room-7")
        b.subscribe("chat", lmq="room-7")
        notice = a.get_notice(timeout=5)  # pushed (RESP3); HEARTBEAT would not hand it out again
        assert notice is not None and notice["type"] == "unsubscribe"
        assert notice["by"] == "B" and notice["lmq"] == "room-7"
        assert node.hget(meta, "m|default|A|mk") == "B"
        a.close()  # its session lease (500 ms) runs out; any worker's sweeper ends it
        wait_for(lambda: not node.hexists(meta, "m|default|A|mk"), timeout=10, what="the marker to go")
        assert node.hget(meta, "g|default|own") == "B" or node.hget(meta, "z") in ("B", "default|B")
    finally:
        b.close()
        node.close()
