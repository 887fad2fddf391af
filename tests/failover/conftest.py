"""`make test-failover` only (FENCEMQ_TEST_FAILOVER=1): Redis failing over under load, a minute or more each.

Each run's figures go to the log (and to $FENCEMQ_FAILOVER_REPORT as JSON lines when set).
"""

from __future__ import annotations

import os
import shutil

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("FENCEMQ_TEST_FAILOVER") == "1":
        if not shutil.which("ss") or os.geteuid() != 0:
            skip = pytest.mark.skip(reason="a host crash is played with `ss -K`, which needs root and iproute2")
            for item in items:
                if "failover" in str(item.fspath):
                    item.add_marker(skip)
        return
    skip = pytest.mark.skip(reason="Redis failing over under load: run with `make test-failover`")
    for item in items:
        if "failover" in str(item.fspath):
            item.add_marker(skip)
