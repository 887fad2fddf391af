"""Fixtures the worker tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fencemq.server.embedded import EmbeddedRedis
from tests.helpers import wait_for


@pytest.fixture
def pair() -> Iterator[tuple[EmbeddedRedis, EmbeddedRedis]]:
    """A primary and its replica, linked."""
    with EmbeddedRedis() as primary:
        with EmbeddedRedis(extra_args=["--replicaof", "127.0.0.1", str(primary.port)]) as replica:
            wait_for(lambda: replica.client().info("replication")["master_link_status"] == "up", 10)
            yield primary, replica
