"""A worker's copy of the retention policies stands while the master of their hash does not answer.

Every publish, ACK and NACK reads the policies (a copy at most a second old).
On a Cluster their hash lives on one master; while it fails over, the queues
of every other master must go on: the worker keeps the copy it has (no policy
can be set or cleared meanwhile: that write fails too), reading them again
beside the calls, not before them.
"""

from __future__ import annotations

import asyncio

from fencemq.config import Config
from fencemq.fences.redis_client import open_redis
from fencemq.fences.redis_errors import REDIS_FAILURES
from fencemq.fences.retention import Policy, Retention, set_policy
from fencemq.model.keys import Keyspace
from tests.failover.test_cluster_failover import owner_of

KEYS = Keyspace()


def test_the_policies_read_before_their_master_died_stand_and_a_worker_without_a_copy_waits(cluster) -> None:
    async def scenario() -> None:
        r = await open_redis(f"redis://127.0.0.1:{cluster[0].port}/0")
        try:
            await set_policy(r, KEYS, "orders", Policy(count=10))
            held, fresh = Retention(r, KEYS, Config()), Retention(r, KEYS, Config())
            assert (await held.args("orders"))["maxlen"] == 10
            owner_of(KEYS.retention, cluster).kill()
            held.invalidate()  # past the copy's age: read again beside the call, which goes on
            assert (await held.args("orders"))["maxlen"] == 10
            await held._reading  # the read fails (the master is gone): the copy stands
            assert (await held.args("orders"))["maxlen"] == 10
            try:
                await fresh.policies()
            except REDIS_FAILURES:
                pass
            else:
                raise AssertionError("a worker that never read the policies made them up")
        finally:
            await r.aclose()

    asyncio.run(scenario())
