"""The overview's sampler: one per process, whatever the number of open pages.

Rates are differences between two samples, so someone has to keep the
previous one: a task started with the app samples every ``interval`` seconds
(server-side: a browser never asks for a refresh), keeps the last
``history_s`` seconds for the charts, and wakes every open overview stream.
Other pages' streams re-read their own page at the same interval.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import anyio

from fencemq.model.keys import Keyspace
from fencemq.ops.overview import OverviewState, overview_sample

log = logging.getLogger("fencemq.ui")


class Sampler:
    def __init__(self, keys: Keyspace, interval: float = 2.0, history_s: float = 600.0,
                 lease_ms: int | None = None) -> None:
        self.keys, self.interval, self.lease_ms = keys, interval, lease_ms
        self.state = OverviewState()
        self.history: deque[dict[str, Any]] = deque(maxlen=max(2, int(history_s / interval)))
        self.latest: dict[str, Any] | None = None
        self.error: str | None = None
        self.version = 0
        self._changed = anyio.Event()

    async def sample(self, redis: Any) -> dict[str, Any]:
        snap = await overview_sample(redis, self.keys, self.state, lease_ms=self.lease_ms)
        self.latest = snap
        self.error = None
        if snap["interval_s"]:
            self.history.append({"t": snap["now_ms"], **snap["rates"], "backlog": snap["backlog"]})
        self.version += 1
        self._changed.set()
        self._changed = anyio.Event()
        return snap

    async def run(self, redis: Any) -> None:
        while True:
            try:
                await self.sample(redis)
            except Exception as exc:  # noqa: BLE001 - a Redis hiccup must not end the sampling
                self.error = f"{type(exc).__name__}: {exc}"
                log.warning("overview sample failed: %s", self.error)
            await anyio.sleep(self.interval)

    async def wait_newer(self, version: int) -> int:
        """Return once a sample newer than ``version`` exists; its version."""
        while self.version <= version:
            await self._changed.wait()
        return self.version
