"""A Redis Cluster of three masters, two replicas each, under load: masters die, one as a host would.

Workers reach it through any node. First the master that holds the
broker's own fixed-slot keys (the filter registry's version, the lease
schedule) is killed (-9): publishing to the queues of the other masters must
not stop. Then another master's host crashes with its replicas held behind
(SIGSTOP, kill -9, its connections aborted). Both old masters return and
become replicas. Asserted in every durability mode: no worker process exits,
each dead master's queues publish again within its promotion time + 2 s,
every client error is retriable; with replicas=all (every replica a master
has connected holds the write: docs/operations.md, "durability"), nothing
acknowledged is lost and no id is given to two messages. (replicas=1 is not
enough here: each master has two replicas, and the one promoted may be the
one WAIT did not count.)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
import redis
from redis.crc import key_slot

from fencemq.model.keys import Keyspace, QueueRef
from fencemq.server.embedded import EmbeddedRedis, start_cluster_with_replicas
from tests.failover.lost_state import lost_state
from tests.failover.harness import TOPICS, Figures, Load, Workers, host_crash, report
from tests.helpers import wait_for

pytestmark = pytest.mark.slow
KEYS = Keyspace()


def owner_of(key: str, servers: list[EmbeddedRedis]) -> EmbeddedRedis | None:
    """The master that owns ``key``'s slot now, asked of any live node."""
    slot = key_slot(key.encode())
    for srv in servers:
        if srv.pid is None:
            continue
        try:
            with redis.Redis(port=srv.port, socket_timeout=1) as r:
                for lo, hi, master, *_ in r.execute_command("CLUSTER", "SLOTS"):
                    if lo <= slot <= hi:
                        port = int(master[1])
                        return next((s for s in servers if s.port == port), None)
        except (redis.RedisError, OSError):
            continue
    return None


def replicas_of(master: EmbeddedRedis, servers: list[EmbeddedRedis]) -> list[EmbeddedRedis]:
    out = []
    for srv in servers:
        if srv is master or srv.pid is None:
            continue
        try:
            info = srv.client(socket_timeout=1).info("replication")
        except (redis.RedisError, OSError):
            continue
        if info.get("role") == "slave" and int(info.get("master_port", 0)) == master.port:
            out.append(srv)
    return out


@contextlib.contextmanager
def started_cluster() -> Iterator[list[EmbeddedRedis]]:
    # as docs/operations.md says to run a Cluster under the broker: a shard without a master stops
    # only its own slots (with the default, yes, every node answers CLUSTERDOWN until the promotion)
    masters, followers = start_cluster_with_replicas(3, 2, node_timeout_ms=1000, appendonly=True, keep_data=True,
                                                     extra_args=["--cluster-require-full-coverage", "no"])
    everyone = masters + followers
    try:
        yield everyone
    finally:
        for srv in everyone:
            srv.keep_data = False
            srv.stop()


def queue_key(topic: str) -> str:
    return KEYS.queue(QueueRef(topic)).meta


MODES = ["local", "replicas=all"]  # replicas=all: what docs/operations.md says survives a host loss


@pytest.mark.parametrize("durability", MODES)
def test_masters_die_under_load_and_come_back_as_replicas(durability: str) -> None:
    figures = Figures()
    with started_cluster() as servers:
        workers = Workers(f"redis://127.0.0.1:{servers[0].port}/0", durability=durability)
        load = Load(workers.ports, figures).start()
        crashes = []
        try:
            time.sleep(3.0)
            # 1. the master of the broker's fixed-slot keys, killed (-9): the other masters' queues go on
            fixed = owner_of(KEYS.filters_version, servers)
            assert fixed is not None
            crashes.append(crash(fixed, servers, figures, host=False))
            # 2. another master's host: its replicas held behind, its connections aborted
            other = next(m for m in (owner_of(queue_key(t), servers) for t in TOPICS)
                         if m is not None and m is not fixed and m.pid is not None)
            crashes.append(crash(other, servers, figures, host=True))
            for dead in (fixed, other):  # both return: the Cluster makes them replicas
                dead.start(_same_port=True)
            for dead in (fixed, other):
                wait_for(lambda: role(dead) == "slave", 30, 0.1, what="an old master to become a replica")
            time.sleep(3.0)
        except BaseException:
            workers.post_mortem(figures)
            raise
        finally:
            load.stop()
            exited = workers.exited()
            lost = figures.acknowledged_lost()
            if lost:  # where the messages never delivered are stuck (tests/failover/lost_state.py)
                live = next(s for s in servers if s.pid is not None)
                state = lost_state(live.port, [figures.acked[uid] for uid in lost])
                report(f"cluster {durability} lost state", state)
                report(f"cluster {durability} worker logs", {"logs": workers.warnings()})
            workers.stop()
    outages = [(round(c["promotion_s"], 2),
                round(figures.back_after(c["died"], c["topics"]), 2) if c["topics"] else None,
                round(figures.longest_pause(c["died"], c["died"] + c["promotion_s"] + 1.0, c["others"]), 2))
               for c in crashes]
    figures_out = {**figures.summary(), "durability": durability, "worker_exits": len(exited),
                   "consumers_still_draining": load.undrained,
                   "crashes": [{"promotion_s": p, "outage_s": o, "others_outage_s": oo} for p, o, oo in outages]}
    report(f"cluster {durability}", figures_out)
    assert not exited, exited
    assert figures.bad_errors == [], figures.bad_errors[:5]
    for promotion, outage, others in outages:
        assert outage is None or outage <= promotion + 2.0, figures_out
        # a shard failing over stalls only the queues it holds (the others pause 0.5-1.7 s while
        # every node answers CLUSTERDOWN, cluster-require-full-coverage yes; 0.1-0.4 s with no)
        assert others <= 2.0, figures_out
    # an id is never given to two messages, whatever the durability (lua/lib/ids.lua)
    assert figures.ids_reused() == [], figures_out
    if "replicas" in durability:
        assert figures.acknowledged_lost() == [], figures_out


def role(server: EmbeddedRedis) -> str | None:
    try:
        with server.client(socket_timeout=1) as r:
            return r.info("replication")["role"]
    except (redis.RedisError, OSError):
        return None


def crash(master: EmbeddedRedis, servers: list[EmbeddedRedis], figures: Figures, *, host: bool) -> dict:
    topics = [t for t in TOPICS if owner_of(queue_key(t), servers) is master]
    others = [t for t in TOPICS if t not in topics]
    followers = replicas_of(master, servers)
    assert followers, "a master without replicas"
    if host:
        died = host_crash(master, followers)
    else:
        master.kill()
        died = time.monotonic()
    slot_key = queue_key(topics[0]) if topics else KEYS.filters_version
    wait_for(lambda: owner_of(slot_key, servers) in followers, 30, 0.05, what="a replica to be promoted")
    promoted = time.monotonic() - died
    if topics:
        wait_for(lambda: figures.back_after(died + promoted, topics) < float("inf"), 30, 0.05,
                 what="publishing to the dead master's queues to come back")
    time.sleep(1.0)
    return {"died": died, "promotion_s": promoted, "topics": topics, "others": others}
