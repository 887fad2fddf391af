"""A Cluster's topology looked up again never holds the commands of the healthy masters.

After a node fails, the worker's Cluster client asks the Cluster where the
slots are again. redis-py makes every command wait for that answer under one
lock; a node asked that does not answer (a host gone, a replica held back)
held them for the whole socket timeout, and the failed look-up closed every
connection. Here the look-up runs beside the commands, which go on with the
slot map they have (fences/redis_servers.py, FenceCluster.initialize).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import pytest
from redis.asyncio.cluster import ClusterNode

from fencemq.fences.redis_client import open_redis
from fencemq.fences.redis_servers import FenceCluster
from fencemq.server.embedded import EmbeddedRedis, start_cluster

pytestmark = pytest.mark.standalone


@pytest.fixture
def cluster() -> Iterator[list[EmbeddedRedis]]:
    servers = start_cluster(3)
    try:
        yield servers
    finally:
        for srv in servers:
            srv.stop()


@pytest.fixture
def silent_node() -> Iterator[int]:
    """A port that accepts connections and never answers: a node whose host is gone."""
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()


def test_a_look_up_that_waits_on_a_silent_node_holds_no_command_to_a_healthy_master(cluster, silent_node) -> None:
    async def scenario() -> None:
        r = await open_redis(f"redis://127.0.0.1:{cluster[0].port}/0")
        assert isinstance(r, FenceCluster)
        try:
            await r.set("orders", "before")
            everyone = dict(r.nodes_manager.startup_nodes)
            silent = ClusterNode("127.0.0.1", silent_node, **r.nodes_manager.connection_kwargs)
            r.nodes_manager.startup_nodes = {silent.name: silent}  # the only node it may ask
            r._initialize = True  # as after a node failed
            await r.set("orders", "during")  # answered while the look-up waits on the silent node
            assert await r.get("orders") == b"during"
            assert not r._refresh.done(), "the look-up was not under way"
            await r.topology_looked_up()  # it fails (the socket timeout): the slot map is kept
            assert r._initialize
            r.nodes_manager.startup_nodes = everyone
            assert await r.get("orders") == b"during"  # on the map it had, and it asks again
            await r.topology_looked_up()
            assert not r._initialize, "a later look-up did not take"
        finally:
            await r.aclose()

    asyncio.run(scenario())
